"""Long fused sequences: how context parallelism's sequence split balances the attention work,
then what a LLaMA decoder's training step costs with a long sequence in three layouts.

    python -m benchmarks long                     # s = 8192; c = 2, 4, 8; three masks; then training
    python -m benchmarks long --seq 32768 --cp 4 8 --skip-train
    mpiexec -n 8 python -m benchmarks --depth 2 long --train-seq 1024

The balance table: for each mask and context-parallel size c, the unmasked (query, key) pairs each
rank's queries hold (``optimus2d.context.assign``), as max / mean over the ranks, for the three
splits: uniform (contiguous s/c tokens a rank), head–tail (chunks r and 2c − 1 − r) and makespan
(blocks of ``--block`` tokens, greedy, an equal count a rank). The masks: causal; causal text with
three bidirectional image spans of ``--image`` tokens (a mixed image–text sequence); packed causal
documents of random lengths (seeded). Pairs are exact counts, not timings: rank 0 computes them.

Training (unless ``--skip-train``): the layouts of ``long_models`` ("2D + CP", "CP alone", "DTensor
1D + SP"), one step = forward, backward, AdamW step, zero_grad. (a) Its time at ``--train-seq``:
rank 0's clock, median of ``--rounds`` interleaved rounds after one warm-up step each; reported as
the ratio to DTensor's. (b) The longest sequence whose step stays within ``--memory-cap-mb`` per
rank: doubling from ``--start-seq``, then ``--bisect`` halvings, on multiples of what every layout
needs (2c for the head–tail split, p for the sequence shards), at most ``--max-seq``; also as the
ratio to DTensor's. (c) optimus2d's bytes per rank of one step (``count_comm``, by kind).

Memory of a step, per rank, the largest over ranks: on a GPU ``torch.cuda.max_memory_allocated``
over the step. On a CPU, ``torch.profiler`` with ``profile_memory``: c10's CPU allocator reports
every allocation with the bytes live that it allocated while profiling; the peak of that over one
step, from its value before the step's first allocation (gradients set to None before, AdamW's
moments already there), plus what lives between steps: parameters, AdamW's two moments and, for the
optimus2d layouts, the causal mask ``bool[s, s]`` that ``ContextParallel`` keeps per length. Not
seen: allocations on gloo's own threads and outside c10's allocator (MPI's, gloo's internals).
(Each profiled step prints kineto's start/stop lines on stderr.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import optimus2d
from benchmarks import long_models
from benchmarks.long_models import Layout
from optimus2d.context import METHODS, assign, causal_mask, document_mask, image_text_mask


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", type=int, default=8192, help="tokens in the fused sequence")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="context-parallel sizes")
    parser.add_argument("--image", type=int, default=576, help="tokens of each of the three images")
    parser.add_argument("--block", type=int, default=None, help="makespan's block (default: s/(8c))")
    long_models.add_arguments(parser)


def masks(s: int, image: int) -> dict[str, torch.Tensor]:
    """The three masks of the table, over ``s`` tokens."""
    spans = [(s * k // 4, s * k // 4 + image) for k in range(3)]
    generator = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < s:
        lengths.append(int(torch.randint(s // 32, s // 4, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - s
    if lengths[-1] <= 0:
        lengths.pop()
        lengths[-1] += s - sum(lengths)
    return {
        "causal": causal_mask(s),
        f"image-text ({len(spans)} images of {image})": image_text_mask(s, spans),
        f"packed documents ({len(lengths)})": document_mask(lengths),
    }


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    rows = []
    if world.rank == 0:
        print(f"unmasked (query, key) pairs per context-parallel rank, max / mean; s = {args.seq}")
        print(f"{'mask':<34}{'c':>3}" + "".join(f"{m:>12}" for m in METHODS))
        for kind, mask in masks(args.seq, args.image).items():
            for c in args.cp:
                block = args.block or max(1, args.seq // (8 * c))
                split = {m: assign(mask, c, m, block=block if m == "makespan" else None) for m in METHODS}
                for method, a in split.items():
                    rows.append(
                        {"mask": kind, "c": c, "method": method, "imbalance": a.imbalance, "pairs": list(a.pairs)}
                    )
                print(f"{kind:<34}{c:>3}" + "".join(f"{split[m].imbalance:>12.4f}" for m in METHODS))
    if dist.is_initialized():
        dist.barrier()
    result = {"config": vars(args), "ranks": world.size, "rows": rows}
    if not args.skip_train:
        result["train"] = train(args, world)
    return result


def timed(found: list[Layout], ids: torch.Tensor, rounds: int) -> list[list[float]]:
    """One warm-up step each, then ``rounds`` interleaved timed steps; the losses of the first two
    steps (before and after one AdamW step), for every layout."""
    losses = [[] for _ in found]
    for layout, mine in zip(found, losses, strict=True):
        layout.inputs(ids)
        mine.append(layout.step())
    for _ in range(rounds):
        for layout, mine in zip(found, losses, strict=True):
            dist.barrier()
            start = time.perf_counter()
            loss = layout.step()
            layout.times.append(1e3 * (time.perf_counter() - start))
            dist.barrier()
            mine.append(loss)
    return [mine[:2] for mine in losses]


def peak_bytes(layout: Layout, ids: torch.Tensor) -> int:
    """This layout's peak bytes per rank in one step at ``ids``' length, the largest over ranks."""
    layout.inputs(ids)
    device = ids.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        layout.step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            layout.step()
        events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while todo:
            event = todo.pop()
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                events.append((event.start_time_ns, event.extra_fields))
            todo.extend(event.children)
        # the allocator's count persists between profiles (blocks freed unprofiled stay counted):
        # the step's growth is from the count before its first allocation
        first = min(events, key=lambda e: e[0])[1] if events else None
        start = first.total_allocated - first.alloc_size if first is not None else 0
        grown = max((f.total_allocated for _, f in events), default=start) - start
        peak = layout.kept(ids.shape[1]) + grown
    out = torch.tensor([float(peak)], device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out.item())


def longest(layout: Layout, args: argparse.Namespace, batch: int, d: int, device: torch.device) -> dict:
    """The longest multiple of ``d`` whose step fits the cap: doubling, then ``args.bisect`` halvings
    (the peak at ``--train-seq`` first, for the table, reused if the search meets it)."""
    cap = args.memory_cap_mb * 2**20
    peaks: dict[int, int] = {}

    def fits(s: int) -> bool:
        if s not in peaks:
            peaks[s] = peak_bytes(layout, long_models.ids_of(batch, s, args.vocab, device))
        return peaks[s] <= cap

    fits(args.train_seq)

    lo, hi, s = 0, None, d * max(1, args.start_seq // d)
    while s <= args.max_seq:
        if not fits(s):
            hi = s
            break
        lo, s = s, 2 * s
    for _ in range(args.bisect if hi is not None else 0):
        mid = (lo + hi) // 2 // d * d
        if mid <= lo or mid >= hi:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"longest": lo, "first_over": hi, "peak_bytes": peaks}


def _refuse(args: argparse.Namespace, p: int, batch: int) -> None:
    sizes = {"--train-batch": batch, "--heads": args.heads, "--hidden": args.hidden, "--vocab": args.vocab}
    sizes["--ffn"] = args.ffn or 3 * args.hidden
    bad = [f"{flag} {n}" for flag, n in sizes.items() if n % p]
    if bad:
        raise SystemExit(f"long: {', '.join(bad)} must divide by the {p} ranks (every layout splits them)")


def _comm(layout: Layout) -> dict[str, int]:
    """Bytes of one step's collectives on a rank by kind, the largest over ranks (optimus2d's count)."""
    with optimus2d.count_comm() as counter:
        layout.step()
    mine: dict[str, int] = {}
    for r in counter.records:
        mine[r.kind] = mine.get(r.kind, 0) + r.bytes
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: max(d.get(k, 0) for d in every) for k in sorted({k for d in every for k in d})}


def train(args: argparse.Namespace, world: optimus2d.World) -> dict:
    """Time a step at ``--train-seq`` and find the longest sequence under the cap, for every layout."""
    p, device = world.size, world.device
    batch = args.train_batch or p
    _refuse(args, p, batch)
    found = long_models.layouts(args, p, device)
    d = long_models.divisor(p, found)
    if args.train_seq % d:
        raise SystemExit(f"long: --train-seq {args.train_seq} must be a multiple of {d} (2c and p of every layout)")
    losses = timed(found, long_models.ids_of(batch, args.train_seq, args.vocab, device), max(1, args.rounds))
    for n in range(2):  # the same model on the same batch: the same loss, before and after a step
        step = [mine[n] for mine in losses]
        spread = (max(step) - min(step)) / abs(min(step))
        named = ", ".join(f"{f.name} {mine[n]:.7f}" for f, mine in zip(found, losses, strict=True))
        if world.rank == 0:
            print(f"losses of step {n + 1}: {named}; spread {spread:.1e}", file=sys.stderr, flush=True)
        if spread > 1e-5:
            raise SystemExit(f"long: the layouts' losses of step {n + 1} differ: {named}")
    comm = {f.name: _comm(f) for f in found if f.mesh.startswith("Mesh(")}  # optimus2d's layouts
    medians = torch.tensor([statistics.median(f.times) for f in found])
    dist.broadcast(medians, src=0)  # rank 0's clock is the report
    searched = {}
    for f in found:
        searched[f.name] = longest(f, args, batch, d, device)
        if world.rank == 0:
            print(f"{f.name}: longest {searched[f.name]['longest']}", file=sys.stderr, flush=True)
    base = found[-1].name
    rows = []
    for f, ms in zip(found, medians.tolist(), strict=True):
        found_s = searched[f.name]
        rows.append(
            {
                "layout": f.name, "mesh": f.mesh, "c": f.c, "step_ms": ms,
                "step_vs_dtensor": ms / medians[-1].item(), "longest_seq": found_s["longest"],
                "first_over": found_s["first_over"],
                "longest_vs_dtensor": found_s["longest"] / max(1, searched[base]["longest"]),
                "peak_bytes": found_s["peak_bytes"], "comm_bytes": comm.get(f.name),
                "peak_at_train_seq_vs_dtensor": (
                    found_s["peak_bytes"][args.train_seq] / searched[base]["peak_bytes"][args.train_seq]
                ),
            }
        )  # fmt: skip
    if world.rank == 0:
        _print(args, p, batch, d, rows, losses[0])
    return {"batch": batch, "divisor": d, "losses": losses[0], "rows": rows}


def _print(args: argparse.Namespace, p: int, batch: int, d: int, rows: list[dict], losses: list[float]) -> None:
    cap = args.memory_cap_mb
    print(
        f"\nLLaMA {args.layers} layers × h {args.hidden} ({args.heads} heads, ffn {args.ffn or 3 * args.hidden}, "
        f"vocab {args.vocab}), fp32, global batch {batch}, {p} ranks; step = fwd + bwd + AdamW; losses "
        f"{losses[0]:.4f}, {losses[1]:.4f} (steps 1, 2), the same in every layout"
    )
    print(f"step: median of {args.rounds} at s = {args.train_seq}; longest s: a multiple of {d}, peak ≤ {cap:g} MiB")
    s = args.train_seq
    head = ("layout", "mesh", "step ms", "÷ DT", f"MiB@{s}", "÷ DT", "longest s", "÷ DT", "MiB", "comm MiB")
    print("{:<18}{:<18}{:>8}{:>7}{:>10}{:>7}{:>11}{:>7}{:>8}{:>10}".format(*head))
    for r in rows:
        over = r["first_over"]
        longest_s = f"{'≥' if over is None else ''}{r['longest_seq']}" if r["longest_seq"] else f"<{args.start_seq}"
        peak = r["peak_bytes"].get(r["longest_seq"])
        comm = r["comm_bytes"]
        print(
            f"{r['layout']:<18}{r['mesh']:<18}{r['step_ms']:>8.0f}{r['step_vs_dtensor']:>7.2f}"
            f"{r['peak_bytes'][s] / 2**20:>10.1f}{r['peak_at_train_seq_vs_dtensor']:>7.2f}{longest_s:>11}"
            f"{r['longest_vs_dtensor']:>7.2f}{(peak or 0) / 2**20:>8.1f}"
            f"{(f'{sum(comm.values()) / 2**20:.2f}' if comm is not None else '—'):>10}"
        )
    print(f"(÷ DT: to DTensor 1D + SP; MiB: a step's peak a rank; comm: count_comm's bytes a rank, a step at {s})")
    for r in rows:
        if r["comm_bytes"]:
            kinds = ", ".join(f"{k} {b / 2**20:.2f}" for k, b in r["comm_bytes"].items())
            print(f"  {r['layout']}: MiB per rank of one step at s = {args.train_seq} by kind: {kinds}")
    print("  DTensor's collectives are not counted (count_comm sees optimus2d's only)")
