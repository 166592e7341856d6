"""The VLM benchmark's non-colocated peers: the encoder on ranks of its own, the projector and the LM
on the rest (``optimus2d.pipeline.rank_sets``), two stages under torch's ``Schedule1F1B``: the
encoder's ranks run micro-batch m + 1 while the LM's run m, the features cross the sets as each
rank's block, and a frozen encoder gets nothing back.

Each set is the squarest mesh of its ranks (4: 2×2; 2, 3: 1×1×2, 1×1×3); a split is offered where
both meshes split a micro-batch (``batch / MICROBATCHES``). One step is ``schedule.step`` on every
rank, then a barrier, so that every rank's timer holds the makespan (the encoder's ranks finish
their forwards first). Checked against serial by the loss Σ out·probe the LM's ranks return (a
random projection of the whole output). Beside each, ``predicted_seconds``: the cost model's step
for it, each set's part replayed in ``Schedule1F1B``'s order by ``optimus2d.pipeline.simulator``.
On cores shared by the ranks a set that waits lends its core to the other, which a machine with a
core per rank does not: read these times there.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B

import optimus2d
from benchmarks.compare import Peer, collective_device
from optimus2d.cost.planner import Hardware, Layer, Part, part_time
from optimus2d.pipeline import mesh_sum, pipeline_stage, rank_sets, scatter_microbatches
from optimus2d.pipeline.simulator import schedule_order, simulate

MICROBATCHES = 2
_SETS: dict = {}  # (encoder ranks, world) → RankSets: built once, in the same order on every rank


def squarest(ranks: int) -> tuple[int, int]:
    """(q, depth) of the mesh of ``ranks`` with the largest q (q² divides ``ranks``)."""
    q = math.isqrt(ranks)
    while ranks % (q * q):
        q -= 1
    return q, ranks // (q * q)


def splits(p: int, batch: int) -> list[int]:
    """The encoder rank counts a (1..p-1) whose two sets' meshes both split a micro-batch."""
    if batch % MICROBATCHES:
        return []
    mb = batch // MICROBATCHES
    return [a for a in range(1, p) if all(mb % (q * d) == 0 for q, d in (squarest(a), squarest(p - a)))]


def shape_name(q: int, depth: int) -> str:
    return f"{q}×{q}" + (f"×{depth}" if depth > 1 else "") if q > 1 else f"1×1×{depth}"


def apart_peer(serial: nn.Module, x: torch.Tensor, probe: torch.Tensor, a: int, frozen: bool) -> Peer:
    """``serial``'s encoder on ranks 0..a-1, its projector and LM on the rest, converted on each set's
    mesh; one step: ``Schedule1F1B`` over ``MICROBATCHES`` with the loss Σ out·probe."""
    p, n = dist.get_world_size(), MICROBATCHES
    shapes = (squarest(a), squarest(p - a))
    if (a, p) not in _SETS:
        _SETS[a, p] = rank_sets([range(a), range(a, p)], q=[s[0] for s in shapes], depth=[s[1] for s in shapes])
    pipe = _SETS[a, p]
    mb = x.shape[0] // n
    features = (mb, *x.shape[1:])
    if pipe.stage == 0:
        chunk = optimus2d.parallelize(copy.deepcopy(serial.encoder), pipe.mesh)
        stage = pipeline_stage(chunk, pipe, microbatch_shape=features, output_shape=features, output_grad=not frozen)
        args, kwargs = (scatter_microbatches(x, pipe.mesh, n),), {}
    else:
        chunk = optimus2d.parallelize(nn.Sequential(copy.deepcopy(serial.proj), copy.deepcopy(serial.lm)), pipe.mesh)
        stage = pipeline_stage(chunk, pipe, microbatch_shape=features, output_shape=(mb, *probe.shape[1:]),
                               input_grad=not frozen)  # fmt: skip
        args, kwargs = (), {"target": scatter_microbatches(probe, pipe.mesh, n)}
    schedule = Schedule1F1B(stage, n_microbatches=n, loss_fn=lambda out, w: mesh_sum(out * w, pipe.mesh),
                            scale_grads=False)  # fmt: skip

    def step() -> torch.Tensor | None:
        """One training step on both sets; the loss on the LM's ranks (None on the encoder's)."""
        if not torch.is_grad_enabled():  # a forward alone is not a pipeline's step: not timed
            return None
        losses: list = []
        schedule.step(*args, **kwargs, **({"losses": losses} if pipe.stage == 1 else {}))
        dist.barrier()  # the step ends when both sets are done
        return torch.stack(losses).sum().detach() if pipe.stage == 1 else None

    (q0, d0), (q1, d1) = shapes
    name = (f"{'frozen' if frozen else 'trained'} encoder apart: {a} + {p - a} ranks, "
            f"{shape_name(q0, d0)} → {shape_name(q1, d1)}")  # fmt: skip
    return Peer(name, chunk, step, lambda out: None, lambda out: out)


def predicted_seconds(args, hw: Hardware, a: int, frozen: bool) -> float:
    """The step the cost model predicts for ``apart_peer(..., a, frozen)``: each set's part per
    micro-batch (``planner.part_time`` on its mesh; a backward twice its forward), the features
    sent between them (bandwidth and latency), replayed in torch's ``Schedule1F1B`` order
    (``pipeline.simulator``). The projector is left out, as in the mesh pairs' predictions."""
    p, n = dist.get_world_size(), MICROBATCHES
    mb = args.batch // n
    (q0, d0), (q1, d1) = squarest(a), squarest(p - a)
    encoder = Part("encoder", Layer(mb, args.seq, args.enc_hidden, 4 * args.enc_hidden, args.heads), args.enc_layers,
                   frozen=frozen)  # fmt: skip
    lm = Part("lm", Layer(mb, args.seq, args.lm_hidden, 4 * args.lm_hidden, args.heads), args.lm_layers,
              input_grad=not frozen)  # fmt: skip
    e, m = part_time(encoder, q0, d0, hw), part_time(lm, q1, d1, hw)
    costs = {
        ("F", 0): e if frozen else e / 3,
        ("B", 0): 0.0 if frozen else 2 * e / 3,
        ("F", 1): m / 3,
        ("B", 1): 2 * m / 3,
    }
    sent = mb * args.seq * args.enc_hidden / a * hw.bytes_per_element / hw.bandwidth + hw.latency
    order = schedule_order(Schedule1F1B, 2, n)
    return simulate(order, lambda kind, stage: costs[kind, stage], where=lambda s: s, p2p=sent).makespan


def check(peers: list[Peer], reference: torch.Tensor, probe: torch.Tensor, tol: float = 1e-5) -> None:
    """Each peer's loss against serial's Σ reference·probe, relative to Σ |reference·probe|; every
    rank stops if one differs (the loss is on the LM's ranks; the encoder's have none)."""
    want, scale = (reference * probe).sum(), (reference * probe).abs().sum()
    errors = torch.zeros(len(peers), device=collective_device())
    for n, peer in enumerate(peers):
        loss = peer.forward()
        peer.model.zero_grad(set_to_none=True)
        if loss is not None:
            errors[n] = ((loss.cpu() - want.cpu()).abs() / scale.cpu()).item()
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    bad = [f"{p.name}: {e:.2e}" for p, e in zip(peers, errors.tolist(), strict=True) if e > tol]
    if bad:
        raise SystemExit("loss differs from serial: " + "; ".join(bad))
