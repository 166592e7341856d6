"""Where an MLP step waits: every wait on an MPI request timed, for SUMMA and the weight-stationary form.

    mpiexec -n 4 python -m benchmarks waits --batch 2

Over the MPI transport every collective and message of a mesh ends in one ``Request.wait``
(``optimus2d/comm/mpi.py``). This times each of them while the MLP h→f→h steps (fwd+bwd) with
each algorithm forced, in interleaved rounds, and reports per algorithm: the step's median time,
the elements a rank sends, how many waits a rank makes, how long they took in all (median over
rounds, every rank), and by kind ("broadcast over row", "receive over col", ...) on the rank that
waited longest. A wait costs what is left of the transfer when it starts, plus the time the
partners arrive later than this rank: it shows which waits cost, which the cost model's single
latency per sync stage cannot tell apart.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

import optimus2d
from benchmarks import compare
from optimus2d.comm import mpi

ALGORITHMS = ("summa", "stationary")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    compare.add_run_arguments(parser)


@contextmanager
def timed_waits(records: list):
    """Within: each MPI wait appends (what, ms waited) to ``records``."""
    wait = mpi.Request.wait

    def timed(request: mpi.Request) -> bool:
        what, start = request._what, time.perf_counter()
        done = wait(request)
        records.append((what, (time.perf_counter() - start) * 1e3))
        return done

    mpi.Request.wait = timed
    try:
        yield records
    finally:
        mpi.Request.wait = wait


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    if mesh.transport != "mpi" or mesh.q == 1:
        raise ValueError(f"waits times MPI waits of a 2D step: it needs q > 1 over mpiexec's MPI; got {mesh}")
    h, f = args.hidden, args.ffn
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))
    x = torch.randn(args.batch, args.seq, h)
    x_2d, grad_2d = optimus2d.scatter(x, mesh), optimus2d.scatter(torch.randn_like(x), mesh)

    def step(algorithm: str):
        model = optimus2d.layers.MLP2D.from_serial(copy.deepcopy(serial), mesh)
        for layer in model.modules():
            if isinstance(layer, optimus2d.layers.Linear2D):
                layer.algorithm = algorithm
        return lambda: model(x_2d).backward(grad_2d)

    steps = {name: step(name) for name in ALGORITHMS}
    elements = {}
    for name, fn in steps.items():  # warm-up, and what each sends
        with optimus2d.count_comm() as counter:
            fn()
        elements[name] = counter.numel
    times = {name: [] for name in steps}
    waits = {name: [] for name in steps}  # a list of (what, ms) a round
    for n in range(args.rounds):
        for name, fn in steps.items():
            records: list = []
            dist.barrier()
            start = time.perf_counter()
            with timed_waits(records):
                fn()
            times[name].append((time.perf_counter() - start) * 1e3)
            waits[name].append(records)
        compare.progress("waits", n + 1, args.rounds)
    mine = {name: _summary(rounds) for name, rounds in waits.items()}
    everyone = [None] * world.size
    dist.all_gather_object(everyone, mine)
    algorithms = {}
    for name in steps:
        per_rank = [ranks[name] for ranks in everyone]
        longest = max(range(world.size), key=lambda r: per_rank[r]["waited_ms"])
        algorithms[name] = {
            "step_ms": statistics.median(times[name]),
            "elements": elements[name],
            "waits_per_step": [r["waits"] for r in per_rank],
            "waited_ms_by_rank": [r["waited_ms"] for r in per_rank],
            "longest_rank": longest,
            "by_kind_ms": per_rank[longest]["by_kind_ms"],
            "count_by_kind": per_rank[longest]["count_by_kind"],
        }
    if world.rank == 0:
        print(f"\n{compare.title(f'MLP {h}→{f}→{h}: where the step waits (MPI)', args, mesh)}")
        for name, a in algorithms.items():
            waited = a["waited_ms_by_rank"]
            print(
                f"{name}: step {a['step_ms']:.1f} ms, {a['elements']:,} elements, {min(a['waits_per_step'])}–"
                f"{max(a['waits_per_step'])} waits a rank, waited {min(waited):.1f}–{max(waited):.1f} ms"
            )
            for kind, ms in sorted(a["by_kind_ms"].items(), key=lambda kv: -kv[1]):
                print(f"    {kind:<24}{a['count_by_kind'][kind]:>3} × {ms:7.2f} ms in all (rank {a['longest_rank']})")
    return {"config": vars(args), "ranks": world.size, "mesh": [mesh.q, mesh.depth], "algorithms": algorithms}


def _summary(rounds: list[list[tuple[str, float]]]) -> dict:
    """Medians over rounds of one rank's waits: the count, the total, and the total by kind."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    for records in rounds:
        sums: dict[str, float] = defaultdict(float)
        for what, ms in records:
            sums[what] += ms
        for what in {w for r in rounds for w, _ in r}:
            by_kind[what].append(sums.get(what, 0.0))
    return {
        "waits": int(statistics.median(len(r) for r in rounds)),
        "waited_ms": statistics.median(sum(ms for _, ms in r) for r in rounds),
        "by_kind_ms": {what: statistics.median(v) for what, v in by_kind.items()},
        "count_by_kind": {what: sum(1 for w, _ in rounds[0] if w == what) for what in by_kind},
    }
