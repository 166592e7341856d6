"""The VLM benchmark's non-colocated peers: the encoder on ranks of its own, the pool, the projector
and the LM on the rest (``optimus2d.pipeline.rank_sets``), two stages under torch's ``Schedule1F1B``: the
encoder's ranks run micro-batch m + 1 while the LM's run m, the features cross the sets as each
rank's block, and a frozen encoder gets nothing back.

Each split a + (p − a) runs on the meshes ``optimus2d.pipeline.propose_placement`` predicts cheapest
for it (a candidate of its table: the cost model's step, each set's part replayed in
``Schedule1F1B``'s order by ``optimus2d.pipeline.simulator``), where both split a micro-batch
(``batch / MICROBATCHES``). One step is ``schedule.step`` on every rank, then a barrier, so that
every rank's timer holds the makespan (the encoder's ranks finish their forwards first). Checked
against serial by the loss Σ out·probe the LM's ranks return (a random projection of the whole
output). On cores shared by the ranks a set that waits lends its core to the other, which a machine with a
core per rank does not: read these times there.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B

import optimus2d
from benchmarks.compare import Peer, collective_device
from optimus2d.pipeline import mesh_sum, pipeline_stage, rank_sets, scatter_microbatches
from optimus2d.pipeline.placement import Candidate, shape_name

MICROBATCHES = 2
_SETS: dict = {}  # (encoder ranks, world, shapes) → RankSets: built once, in the same order on every rank


def apart_peer(serial: nn.Module, x: torch.Tensor, probe: torch.Tensor, placed: Candidate, frozen: bool) -> Peer:
    """``serial``'s encoder on ranks 0..a-1 (a = ``placed.encoder_ranks``), its projector and LM on the
    rest, converted on each set's mesh (``placed.encoder``, ``placed.rest``: (q, depth)); one step:
    ``Schedule1F1B`` over ``MICROBATCHES`` with the loss Σ out·probe."""
    p, n, a = dist.get_world_size(), MICROBATCHES, placed.encoder_ranks
    shapes = (placed.encoder, placed.rest)
    if (a, p, shapes) not in _SETS:
        _SETS[a, p, shapes] = rank_sets([range(a), range(a, p)], q=[s[0] for s in shapes], depth=[s[1] for s in shapes])
    pipe = _SETS[a, p, shapes]
    mb = x.shape[0] // n
    features = (mb, *x.shape[1:])
    if pipe.stage == 0:
        chunk = optimus2d.parallelize(copy.deepcopy(serial.encoder), pipe.mesh)
        stage = pipeline_stage(chunk, pipe, microbatch_shape=features, output_shape=features, output_grad=not frozen)
        args, kwargs = (scatter_microbatches(x, pipe.mesh, n),), {}
    else:
        rest = nn.Sequential(*(copy.deepcopy(m) for m in (serial.pool, serial.proj, serial.lm)))
        chunk = optimus2d.parallelize(rest, pipe.mesh)
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

    name = (f"{'frozen' if frozen else 'trained'} encoder apart: {a} + {p - a} ranks, "
            f"{shape_name(*shapes[0])} → {shape_name(*shapes[1])}")  # fmt: skip
    return Peer(name, chunk, step, lambda out: None, lambda out: out)


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
