"""An encoder + projector + LM on per-module layouts: every pair of mesh shapes, frozen and trained.

    mpiexec -n 4 python -m benchmarks vlm                 # encoder 4 × 256, LM 2 × 512, 8 images × 64 patches
    mpiexec -n 4 python -m benchmarks vlm --cap-mib 96    # a memory cap the replicated LM does not fit

The model is a LLaVA-shaped chain of torch.nn modules: a vision encoder (``--enc-layers`` ×
``nn.TransformerEncoderLayer`` of width ``--enc-hidden``) on patch embeddings ``[b, patches, e]``,
a projector ``nn.Linear(e, h)`` and a language model (``--lm-layers`` of width ``--lm-hidden``),
the encoder taking about a third of the forward flops by default. Every peer is
``parallelize(model, lm_mesh, plan={"encoder": encoder_mesh})`` for each (encoder layout, LM
layout) of the world's shapes (on 4 ranks: 2×2 and 1×1×4) and 1D (``megatron.Megatron`` over every
rank, where the ranks divide ``--heads``: torch's encoder layers split by heads and by column then
row), with the encoder frozen and trained; the inputs are scattered on the encoder's mesh, the
projector and LM run on the LM's, the encoder's output moves by ``redistribute`` (a 1D part: the
model on the other part's mesh, the squarest where both are 1D; its input all-gathered in, its
output split back out). All in the same run, checked against serial first,
timed in interleaved rounds (``benchmarks/compare.py``).

Reported per peer: the median fwd+bwd step (and its ratio to the first peer), the bytes a rank
sends in one step (``count_comm``), the bytes autograd keeps and the parameter bytes; and
``optimus2d.cost.planner.propose_layouts``'s predicted step time for the same layouts on hardware
calibrated in this run (``benchmarks/calibrate.py``), its pick under ``--cap-mib`` and whether the
measured best agrees. Parameters, their gradients and two AdamW moments of the trained modules
count against the cap (16 bytes a trained parameter, 4 a frozen one, plus what autograd keeps).

Two more peers per encoder setting: ``parallelize(model, mesh, plan=Auto(tokens=, seq=, memory=))``
(``plan="auto"`` on the world's squarest mesh, costs from ``optimus2d.cost.calibration``): the
encoder and the LM (each an ``nn.TransformerEncoder``: a part) each whole on the mesh shape it
predicts fastest; and the same with ``measure=`` (the 4 best predicted timed on copies). Checked and
timed with the rest, reported against the measured best of the mesh pairs ("auto ÷ best") and as
the pair they picked ("as pairs": the pick without the boundaries of the model's own mesh).

And the non-colocated peers (``benchmarks/vlm_apart.py``): the encoder on ranks of its own, the
projector and the LM on the rest, two pipeline stages under ``Schedule1F1B`` ("apart": the best
colocated pair's step over theirs). On cores the ranks share, a set that waits lends its core to
the other: their times are honest only with a core per rank (``scripts/cores.sh``).

``--workloads`` runs several shapes in one process (a size given on the command line overrides
theirs), each as above, and ends with one line per workload: the best homogeneous layout (every
module on one mesh), the best heterogeneous one, the planner's pick and the measured best, with the
pick's step time over the best's::

    small-frozen    encoder 2 × 128 frozen, LM 2 × 512, 8 × 64 tokens (the encoder a small share)
    large-trained   encoder 4 × 512 trained, LM 2 × 256, 8 × 64 tokens (the encoder the larger part)
    long-sequence   encoder 2 × 128 frozen, LM 2 × 256, p × 256 tokens (one long sequence a rank)
    pooled-frozen   encoder 12 × 256 frozen, LM 2 × 1024, p images × 144 patches pooled 4:1 (``--pool``,
                    ``SequencePool``: the LM sees 36 tokens an image, a quarter of the encoder's)
    resampled-frozen  the same modules, 8 images × 144 patches pooled 16:1 (9 tokens an image, a
                    resampler's compression): the frozen encoder two thirds of the step's flops

    mpiexec -n 4 python -m benchmarks vlm \
        --workloads small-frozen,large-trained,long-sequence,pooled-frozen,resampled-frozen

A workload some pairs of which do not fit ``--cap-mib`` (by their measured bytes a rank: 16 a
trained parameter, 4 a frozen one, and what autograd keeps of a step, the most over the ranks;
``memory_bytes``) gets a second line, the same verdict among the pairs that fit ("within the cap").
``plan="auto"`` is given the step's input (``Auto(example=)``): each block priced at the rows it
sees, the LM at the pooled ones.
"""

from __future__ import annotations

import argparse
import copy
import itertools
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

import optimus2d
from benchmarks import calibrate, compare, vlm_apart
from benchmarks.compare import Peer
from optimus2d.convert import choose_plan
from optimus2d.cost.planner import ONE_D, Layer, Part, propose_layouts
from optimus2d.megatron import Megatron
from optimus2d.pipeline import propose_placement


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name in ("enc_hidden", "enc_layers", "lm_hidden", "lm_layers", "pool"):  # unset: the workload's, else SIZES's
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--heads", type=int, default=8)
    compare.add_run_arguments(parser)
    parser.set_defaults(rounds=5, batch=None, seq=None)
    parser.add_argument(
        "--workloads",
        help=f"comma-separated presets ({', '.join(WORKLOADS)}); default: the sizes above, frozen and trained",
    )


SIZES = dict(enc_hidden=256, enc_layers=4, lm_hidden=512, lm_layers=2, batch=8, seq=64, pool=1)
# preset → (the sizes it sets, which encoders: frozen, trained or both); batch None: one sequence a rank
WORKLOADS = {
    "small-frozen": (dict(enc_hidden=128, enc_layers=2, lm_hidden=512, lm_layers=2, batch=8, seq=64), (True,)),
    "large-trained": (dict(enc_hidden=512, enc_layers=4, lm_hidden=256, lm_layers=2, batch=8, seq=64), (False,)),
    "long-sequence": (dict(enc_hidden=128, enc_layers=2, lm_hidden=256, lm_layers=2, batch=None, seq=256), (True,)),
    "pooled-frozen": (
        dict(enc_hidden=256, enc_layers=12, lm_hidden=1024, lm_layers=2, batch=None, seq=144, pool=4),
        (True,),
    ),
    "resampled-frozen": (
        dict(enc_hidden=256, enc_layers=12, lm_hidden=1024, lm_layers=2, batch=8, seq=144, pool=16),
        (True,),
    ),
}


def _sizes(args: argparse.Namespace, preset: dict, p: int) -> argparse.Namespace:
    """``args`` with every size given on the command line, else the preset's, else ``SIZES``'s."""
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else preset.get(k, SIZES[k]) for k in SIZES}
    return argparse.Namespace(**{**vars(args), **sizes, "batch": sizes["batch"] or p})


class SequencePool(nn.Module):
    """The mean of each ``k`` consecutive tokens, ``[b, s, e]`` → ``[b, s/k, e]``: patch features pooled
    before the LM (as LLaVA-OneVision pools a video's, or Qwen2-VL merges 2×2 patches), so the LM
    sees k times fewer tokens than the encoder. Element by element on the hidden dim and within one
    sequence: correct on every layout's blocks as it is (``register_converter(keep=True)`` below)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(1, (-1, self.k)).mean(dim=2)


optimus2d.convert.register_converter(SequencePool, keep=True)


class EncoderProjectorLM(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        e, h = args.enc_hidden, args.lm_hidden

        def stack(width: int, layers: int) -> nn.TransformerEncoder:
            layer = nn.TransformerEncoderLayer(width, args.heads, 4 * width, dropout=0.0, batch_first=True)
            return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

        self.encoder = stack(e, args.enc_layers)
        self.pool = SequencePool(args.pool) if args.pool > 1 else nn.Identity()
        self.proj, self.lm = nn.Linear(e, h), stack(h, args.lm_layers)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.lm(self.proj(self.pool(self.encoder(patches))))


def _shape(mesh: optimus2d.Mesh | str) -> str:
    if mesh == ONE_D:
        return "1D"
    return f"{mesh.q}×{mesh.q}" + (f"×{mesh.depth}" if mesh.depth > 1 else "") if mesh.q > 1 else f"1×1×{mesh.depth}"


def _as_row(layout: tuple[int, int] | str) -> list[int] | str:
    """A layout as the rows store it: [q, depth], or "1d"."""
    return layout if layout == ONE_D else list(layout)


def _peer(name: str, serial, mesh: optimus2d.Mesh, plan: dict, x_mesh: optimus2d.Mesh, x, probe) -> Peer:
    """A copy of ``serial`` converted on ``mesh`` with ``plan``; its input scattered on ``x_mesh`` (the
    encoder's), the probe and the output on ``mesh`` (the LM's)."""
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=plan)
    local_x, local_probe = optimus2d.scatter(x, x_mesh, check=False), optimus2d.scatter(probe, mesh, check=False)
    step = _Step(local_x, local_probe)
    return Peer(
        name, model, lambda: model(local_x), lambda out: step.backward(out), lambda out: optimus2d.gather(out, mesh)
    )


def _pair_peer(serial, enc, lm, meshes: dict, square: optimus2d.Mesh, x, probe, frozen: bool) -> Peer:
    """The encoder laid out ``enc``, the LM ``lm``: a (q, depth) of ``meshes`` or ``ONE_D`` (a
    ``Megatron`` region over every rank). The model (the projector with it) on the LM's mesh, the
    encoder's where the LM is 1D, ``square`` where both are; the input scattered on the encoder's mesh
    (on the model's where the encoder is 1D: its region gathers it in)."""
    model_mesh = meshes[lm] if lm != ONE_D else meshes[enc] if enc != ONE_D else square
    region = Megatron(model_mesh)
    plan = {"encoder": region if enc == ONE_D else meshes[enc], **({"lm": region} if lm == ONE_D else {})}
    e, m = (_shape(meshes.get(layout, layout)) for layout in (enc, lm))
    name = f"{'frozen' if frozen else 'trained'} encoder {e}, LM {m}"
    return _peer(name, serial, model_mesh, plan, model_mesh if enc == ONE_D else meshes[enc], x, probe)


def _auto_peer(serial, mesh: optimus2d.Mesh, plan: dict, x, probe, frozen: bool, timed: bool) -> Peer:
    """``plan="auto"``'s layouts (``plan``, from ``choose_plan``; ``timed``: with ``measure=``) on ``mesh``."""
    name = f"{'frozen' if frozen else 'trained'} encoder, plan='auto'{' measured' if timed else ''} on {_shape(mesh)}"
    return _peer(name, serial, mesh, plan, mesh, x, probe)


class _Step:
    """The peers' forward and backward; called on a model, ``Auto(measure=)``'s step."""

    def __init__(self, local_x: torch.Tensor, local_probe: torch.Tensor) -> None:
        self.x, self.probe = local_x, local_probe

    def backward(self, out: torch.Tensor) -> None:
        (out * self.probe).sum().backward()

    def __call__(self, model: nn.Module) -> None:
        self.backward(model(self.x))


def _sent_bytes(peer: Peer) -> int:
    """The most bytes a rank sends in one fwd+bwd step (``count_comm``), over the ranks."""
    with optimus2d.count_comm() as counter:
        peer.backward(peer.forward())
    peer.model.zero_grad(set_to_none=True)
    most = torch.tensor([counter.bytes], device=compare.collective_device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    p = world.size
    shapes = [(q, p // (q * q)) for q in range(1, p + 1) if q * q <= p and p % (q * q) == 0]
    meshes = {shape: optimus2d.Mesh(*shape) for shape in shapes}
    if not args.workloads:
        return _workload(_sizes(args, SIZES, p), mesh, meshes, (True, False))
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"vlm: unknown workloads {unknown}; the presets are {list(WORKLOADS)}")
    results = {}
    for name in names:
        sizes, encoders = WORKLOADS[name]
        results[name] = _workload(_sizes(args, sizes, p), mesh, meshes, encoders)
    summary = [_verdict(name, result["rows"]) for name, result in results.items()]
    if dist.get_rank() == 0:
        print(f"{'workload':16} {'best homogeneous':>32} {'best heterogeneous':>34} {'hetero ÷ homo':>13} "
              f"{'pick ÷ best':>11} {'auto ÷ best':>11} {'measured':>8} {'as pairs':>11} {'apart':>6} "
              f"{'placed':>6}  the planner's pick")  # fmt: skip
        for v in summary:
            pairs = "/".join("-" if r is None else f"{r:.3f}" for r in (v["auto_pair_over_best"],
                             v["measured_auto_pair_over_best"]))  # fmt: skip
            print(
                f"{v['workload']:16} {v['homogeneous']:>24} {v['homogeneous_ms']:6.1f} ms "
                f"{v['heterogeneous']:>26} {v['heterogeneous_ms']:6.1f} ms {v['speedup']:13.2f} "
                f"{v['pick_over_best']:11.3f} {v['auto_over_best']:11.3f} {v['measured_auto_over_best']:8.3f} "
                f"{pairs:>11} {'-' if v['apart_speedup'] is None else format(v['apart_speedup'], '.2f'):>6} "
                f"{v['placement_over_best']:6.3f}  {v['pick']} (best: {v['best']}); placed: {v['placement']} "
                f"(best: {v['placement_best']})"
            )
            if (w := v["within_cap"]) is not None:
                print(
                    f"{'  within the cap':16} {w['homogeneous']:>24} {w['homogeneous_ms']:6.1f} ms "
                    f"{w['heterogeneous']:>26} {w['heterogeneous_ms']:6.1f} ms {w['speedup']:13.2f} "
                    f"{w['pick_over_best']:11.3f}  best: {w['best']}; {len(w['left_out'])} pairs over "
                    f"{args.cap_mib:g} MiB: {', '.join(w['left_out'])}"
                )
    return {"ranks": p, "workloads": results, "summary": summary}


def _verdict(name: str, rows: list[dict]) -> dict:
    """A workload's line: its best homogeneous and heterogeneous layouts, the pick, the best (of the
    mesh pairs), and ``plan="auto"``'s time over that best."""
    auto = min((r for r in rows if r["auto"] and not r["measured"]), key=lambda r: r["train_ms"])
    timed = min((r for r in rows if r["auto"] and r["measured"]), key=lambda r: r["train_ms"])
    apart = min((r for r in rows if r["apart"]), key=lambda r: r["train_ms"], default=None)
    placed = [r for r in rows if not r["auto"]]  # the pairs and the splits: what propose_placement chose among
    placement = next(r for r in placed if r["placement_pick"])
    fastest = min(placed, key=lambda r: r["train_ms"])
    rows = [r for r in rows if not r["auto"] and not r["apart"]]
    homo = min((r for r in rows if r["encoder"] == r["lm"]), key=lambda r: r["train_ms"])
    hetero = min((r for r in rows if r["encoder"] != r["lm"]), key=lambda r: r["train_ms"])
    best, pick = min(rows, key=lambda r: r["train_ms"]), next(r for r in rows if r["plan_pick"])
    within = _within_cap(rows, pick)

    def as_pair(auto: dict) -> float | None:
        """The mesh pair laid out as ``auto`` picked ÷ the best: the pick itself, without the boundaries
        the auto peer's model mesh adds (a pair's input enters on its encoder's mesh, its output stays
        on its LM's)."""
        shapes = {part: layout if layout == ONE_D else [int(n) for n in layout.split("×")[1:]]
                  for part, layout in auto["layouts"].items()}  # fmt: skip
        same = [r for r in rows if set(shapes) == {"encoder", "lm"} and [r["encoder"], r["lm"]] == [shapes["encoder"],
                shapes["lm"]]]  # fmt: skip
        return same[0]["train_ms"] / best["train_ms"] if same else None

    return {
        "workload": name, "homogeneous": homo["peer"], "homogeneous_ms": homo["train_ms"],
        "heterogeneous": hetero["peer"], "heterogeneous_ms": hetero["train_ms"],
        "speedup": homo["train_ms"] / hetero["train_ms"], "pick": pick["peer"], "best": best["peer"],
        "pick_over_best": pick["train_ms"] / best["train_ms"], "auto": auto["peer"],
        "auto_over_best": auto["train_ms"] / best["train_ms"], "auto_layouts": auto["layouts"],
        "measured_auto_over_best": timed["train_ms"] / best["train_ms"], "measured_auto_layouts": timed["layouts"],
        "auto_pair_over_best": as_pair(auto), "measured_auto_pair_over_best": as_pair(timed),
        "apart": apart and apart["peer"], "apart_speedup": apart and best["train_ms"] / apart["train_ms"],
        "apart_predicted_speedup": apart and min(r["predicted_ms"] for r in rows) / apart["predicted_ms"],
        "placement": placement["peer"], "placement_over_best": placement["train_ms"] / fastest["train_ms"],
        "placement_best": fastest["peer"], "within_cap": within,
    }  # fmt: skip


def _within_cap(rows: list[dict], pick: dict) -> dict | None:
    """The verdict among the mesh pairs whose measured bytes a rank fit the cap (``memory_bytes``),
    where some do not: the best homogeneous and heterogeneous of those, the best, and the pick's
    time over it (None: every pair fits, or no homogeneous or heterogeneous one does)."""
    fit = [r for r in rows if r["fits_measured"]]
    homo = min((r for r in fit if r["encoder"] == r["lm"]), key=lambda r: r["train_ms"], default=None)
    hetero = min((r for r in fit if r["encoder"] != r["lm"]), key=lambda r: r["train_ms"], default=None)
    if len(fit) == len(rows) or homo is None or hetero is None:
        return None
    best = min(fit, key=lambda r: r["train_ms"])
    return {
        "homogeneous": homo["peer"], "homogeneous_ms": homo["train_ms"], "heterogeneous": hetero["peer"],
        "heterogeneous_ms": hetero["train_ms"], "speedup": homo["train_ms"] / hetero["train_ms"], "best": best["peer"],
        "pick_over_best": pick["train_ms"] / best["train_ms"], "pick_fits": pick["fits_measured"],
        "left_out": [r["peer"] for r in rows if not r["fits_measured"]],
    }  # fmt: skip


def _memory_bytes(peer: Peer, row: dict) -> int:
    """The most bytes a rank holds to train ``peer``, over the ranks: 16 a trained parameter (its value,
    gradient and two AdamW moments), 4 a frozen one, and what autograd keeps of a step (measured,
    ``row["activation_bytes"]``)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    state = sum(local(t).nbytes * (4 if t.requires_grad else 1) for t in peer.model.parameters())
    most = torch.tensor([state + row["activation_bytes"]], device=compare.collective_device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _workload(args: argparse.Namespace, mesh: optimus2d.Mesh, meshes: dict, encoders: tuple[bool, ...]) -> dict:
    """Every (encoder mesh, LM mesh) of ``meshes`` for each of ``encoders`` (frozen: True), timed."""
    device, p, shapes = mesh.device, mesh.size, list(meshes)
    one_d = p > 1 and args.heads % p == 0  # Megatron's split: each part whole in 1D over every rank
    layouts = shapes + [ONE_D] * one_d
    torch.manual_seed(0)
    base = EncoderProjectorLM(args).to(device)
    x = torch.randn(args.batch, args.seq, args.enc_hidden, device=device)
    lm_seq = args.seq // args.pool  # the tokens a sequence has after the pool: the LM's
    probe = torch.randn(args.batch, lm_seq, args.lm_hidden, device=device)
    sizes = argparse.Namespace(hidden=args.lm_hidden, ffn=4 * args.lm_hidden)
    hw = calibrate.measure_hardware(mesh, device, sizes, 5, args.batch * args.seq)
    if one_d:  # DTensor's collectives (the 1D linears) go over torch's groups, not the mesh's transport
        hw = calibrate.with_torch_link(hw, mesh)
    rows, cap = [], args.cap_mib * 2**20
    for frozen in encoders:
        serial = copy.deepcopy(base)
        serial.encoder.requires_grad_(not frozen)
        with torch.no_grad():
            reference = serial(x)
        combos = list(itertools.product(layouts, repeat=2))
        peers = [_pair_peer(serial, e, m, meshes, mesh, x, probe, frozen) for e, m in combos]
        local_x, local_probe = optimus2d.scatter(x, mesh, check=False), optimus2d.scatter(probe, mesh, check=False)
        auto = optimus2d.Auto(tokens=args.batch * args.seq, seq=args.seq, memory=cap, example=x)  # the LM: pooled
        timed = replace(auto, measure=_Step(local_x, local_probe), top=4)  # the 4 best predicted, timed
        choices = [choose_plan(serial, mesh, a) for a in (auto, timed)]
        peers += [
            _auto_peer(serial, mesh, plan, x, probe, frozen, a is timed)
            for a, (_, plan) in zip((auto, timed), choices, strict=True)
        ]
        compare.check(peers, reference)
        parts = [
            Part("encoder", Layer(args.batch, args.seq, args.enc_hidden, 4 * args.enc_hidden, args.heads),
                 args.enc_layers, frozen=frozen),
            Part("lm", Layer(args.batch, lm_seq, args.lm_hidden, 4 * args.lm_hidden, args.heads), args.lm_layers,
                 input_grad=True),  # the projector before it trains
        ]  # fmt: skip
        placement = propose_placement(*parts, p, hw, microbatches=vlm_apart.MICROBATCHES, memory_cap=cap, one_d=one_d)
        splits = {}  # encoder ranks → the cheapest apart candidate of that split (the table is cheapest first)
        for c in placement.table:
            if c.encoder_ranks:
                splits.setdefault(c.encoder_ranks, c)
        splits = [splits[a] for a in sorted(splits)]
        apart = [vlm_apart.apart_peer(serial, x, probe, c, frozen) for c in splits]
        vlm_apart.check(apart, reference, probe)
        peers += apart
        sent = [_sent_bytes(peer) for peer in peers]
        compare.time_rounds(peers, args.rounds, device, f"{'frozen' if frozen else 'trained'} encoder")
        measured = compare.summarize(peers, args.batch * args.seq, args.batch, args.cap_mib)
        for peer, row in zip(peers, measured, strict=True):
            row["memory_bytes"] = _memory_bytes(peer, row)
            row["fits_measured"] = row["memory_bytes"] <= cap
        proposal = propose_layouts(parts, p, hw, memory_cap=cap, one_d=one_d)
        predicted = {(r[0]["encoder"], r[0]["lm"]): r for r in proposal.table}
        k = len(combos)  # the pairs, then plan="auto" (predicted, measured), then the non-colocated peers
        for (e, m), row, nbytes in zip(combos, measured[:k], sent[:k], strict=True):
            _, seconds, memory, fits = predicted[(e, m)]
            row.update(
                frozen=frozen, encoder=_as_row(e), lm=_as_row(m), sent_bytes=nbytes, predicted_ms=1e3 * seconds,
                predicted_memory=memory, fits_cap=fits, plan_pick=(e, m) == (proposal.layouts["encoder"],
                proposal.layouts["lm"]), auto=False, apart=False,
            )  # fmt: skip
        autos = zip(measured[k : k + 2], sent[k : k + 2], choices, (False, True), strict=True)
        for row, nbytes, (choice, _), timed_too in autos:
            row.update(
                frozen=frozen, encoder=None, lm=None, sent_bytes=nbytes, predicted_ms=1e3 * choice.seconds,
                predicted_memory=choice.memory, fits_cap=choice.memory <= cap, plan_pick=False, auto=True,
                layouts=choice.layouts, measured=timed_too, apart=False,
            )  # fmt: skip
        for row, nbytes, c in zip(measured[k + 2 :], sent[k + 2 :], splits, strict=True):
            row.update(
                frozen=frozen, encoder=list(c.encoder), lm=list(c.rest), sent_bytes=nbytes,
                predicted_ms=1e3 * c.seconds, predicted_memory=c.memory, fits_cap=c.fits, plan_pick=False,
                auto=False, apart=True, encoder_ranks=c.encoder_ranks,
            )  # fmt: skip
        best = placement.best  # the placement's pick: a pair of meshes over every rank, or a split
        for row in measured:
            row["placement_pick"] = (
                row["apart"] and row["encoder_ranks"] == best.encoder_ranks and row["encoder"] == list(best.encoder)
                and row["lm"] == list(best.rest)
            ) or (not best.encoder_ranks and not row["auto"] and not row["apart"]
                  and (row["encoder"], row["lm"]) == (_as_row(best.encoder), _as_row(best.rest)))  # fmt: skip
        rows += measured
    _print(rows, args, p, hw)
    return {
        "config": vars(args),
        "ranks": p,
        "transport": mesh.transport,
        "hardware": calibrate._fields(hw),
        "rows": rows,
    }


def _print(rows: list[dict], args: argparse.Namespace, p: int, hw) -> None:
    if dist.get_rank() != 0:
        return
    print(
        f"encoder {args.enc_layers} × {args.enc_hidden}, LM {args.lm_layers} × {args.lm_hidden}, {args.batch} × "
        f"{args.seq} patches, {p} ranks, median of {args.rounds} rounds; cap {args.cap_mib:g} MiB"
    )
    print(f"{'':44} {'step ms':>8} {'÷ first':>7} {'sent MB':>8} {'kept MB':>8} {'pred ms':>8} {'fits':>5} pick")
    for r in rows:
        first = next(f for f in rows if f["frozen"] == r["frozen"])["train_ms"]
        print(
            f"{r['peer']:44} {r['train_ms']:8.1f} {r['train_ms'] / first:7.2f} "
            f"{r['sent_bytes'] / 1e6:8.2f} {r['activation_bytes'] / 1e6:8.2f} {r['predicted_ms']:8.1f} "
            f"{'yes' if r['fits_cap'] else 'no':>5} {'<-' if r['plan_pick'] else ''}"
        )
    for frozen in dict.fromkeys(r["frozen"] for r in rows):
        mine = [r for r in rows if r["frozen"] == frozen and not r["auto"] and not r["apart"]]
        pick = next(r for r in mine if r["plan_pick"])
        for label, pool in (("every layout", mine), ("within the cap", [r for r in mine if r["fits_cap"]])):
            homo = min((r for r in pool if r["encoder"] == r["lm"]), key=lambda r: r["train_ms"], default=None)
            hetero = min((r for r in pool if r["encoder"] != r["lm"]), key=lambda r: r["train_ms"], default=None)
            if homo is None or hetero is None:
                continue
            best = min(pool, key=lambda r: r["train_ms"])
            print(
                f"{'frozen' if frozen else 'trained'} encoder, {label}: best heterogeneous ({hetero['peer']}) "
                f"÷ best homogeneous ({homo['peer']}) throughput {homo['train_ms'] / hetero['train_ms']:.2f}; "
                f"measured best {best['peer']!r}" + (f"; the plan's pick {pick['peer']!r}" if pick in pool else "")
            )
        best = min(mine, key=lambda r: r["train_ms"])
        for auto in (r for r in rows if r["frozen"] == frozen and r["auto"]):
            placed = ", ".join(f"{path}: {layout}" for path, layout in auto["layouts"].items())
            print(
                f"  {auto['peer']}: {auto['train_ms']:.1f} ms, {auto['train_ms'] / best['train_ms']:.2f}× the measured "
                "best: " + placed
            )
        for apart in (r for r in rows if r["frozen"] == frozen and r["apart"]):
            gain = best["train_ms"] / apart["train_ms"]
            foreseen = min(r["predicted_ms"] for r in mine) / apart["predicted_ms"]
            print(f"  {apart['peer']}: {apart['train_ms']:.1f} ms, throughput {gain:.2f}× the best colocated "
                  f"(predicted {foreseen:.2f}×; on shared cores a waiting set lends its core)")  # fmt: skip
