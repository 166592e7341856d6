"""What a sync point costs over each transport (MPI, gloo) with every rank busy between them.

    mpiexec -n 4 python -m benchmarks transport

Each rank repeats: a piece of work (a 256×1024 by 1024×1024 matmul), then one collective of the
mesh (an exchange with a partner, a broadcast and an all-reduce over the mesh), through
``optimus2d.comm.primitives`` on a mesh of each transport. Reported: the median time one round
takes beyond the work alone, per transport and message size, and gloo's ÷ MPI's, from interleaved
repeats in the same run. Only where MPI launched the ranks is there an MPI row.

Then what one sync point costs after more or less work: a 64-byte exchange on the mesh's own
transport after matmuls of ``WORK_ROWS`` rows (the same 1024×1024 weight). Where ranks share
cores they drift apart while they work, and the first to reach the sync point waits for the last:
the wait grows with the work before it, not with the message.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import optimus2d
from benchmarks import compare, peers
from optimus2d.comm import primitives as P

SIZES = (16, 256 * 1024, 1024 * 1024)  # float32 elements: 64 B, 1 MiB, 4 MiB
WORK_ROWS = (32, 128, 512, 2048)  # the sync point's cost against the work before it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=7, help="interleaved repeats (median)")
    parser.add_argument("--steps", type=int, default=20, help="work + collective pairs a repeat")


def _ops(mesh: optimus2d.Mesh, n: int) -> dict:
    send, recv = torch.randn(n), torch.empty(n)
    return {
        "exchange": lambda: compare.exchange(mesh, send, recv),
        "broadcast": lambda: P.broadcast(recv, mesh, "mesh", 0),
        "all-reduce": lambda: P.all_reduce(recv, mesh, "mesh"),
    }


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    other = peers.other_transport(mesh)
    twin = optimus2d.Mesh(mesh.q, mesh.depth, transport=other) if other else None
    meshes = {"mpi": mesh if mesh.transport == "mpi" else twin} if other else {}
    meshes["gloo"] = mesh if mesh.transport == "torch" else twin
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    cases = {"work alone": lambda: None}
    for n in SIZES:
        for transport, m in meshes.items():
            for op, fn in _ops(m, n).items():
                cases[f"{op} {4 * n} B {transport}"] = fn
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.rounds):
        for name, fn in cases.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                a @ b
                fn()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
        compare.progress("transport", r + 1, args.rounds)
    median = {name: statistics.median(t) for name, t in times.items()}
    alone = median.pop("work alone")
    after_work = _sync_after_work(mesh, args)
    rows = []
    for n in SIZES:
        for op in ("exchange", "broadcast", "all-reduce"):
            row = {"op": op, "bytes": 4 * n}
            for transport in meshes:
                row[f"{transport}_ms"] = median[f"{op} {4 * n} B {transport}"] - alone
            if "mpi" in meshes and row["mpi_ms"] > 0.1:  # below that, the difference of two noisy medians
                row["gloo_over_mpi"] = row["gloo_ms"] / row["mpi_ms"]
            rows.append(row)
    if world.rank == 0:
        shape = f"Mesh(q={mesh.q}, depth={mesh.depth})"
        print(f"\nms a sync point beyond {alone:.2f} ms of work, {mesh.size} ranks as {shape}, every rank busy")
        print("{:<12}{:>10}".format("op", "bytes") + "".join(f"{t:>10}" for t in meshes) + "  gloo ÷ mpi")
        for row in rows:
            line = f"{row['op']:<12}{row['bytes']:>10,}" + "".join(f"{row[f'{t}_ms']:>10.2f}" for t in meshes)
            print(line + (f"{row['gloo_over_mpi']:>11.2f}" if "gloo_over_mpi" in row else ""))
        print(f"a 64-byte exchange over {mesh.transport} after more or less work:")
        for row in after_work:
            print(f"  work {row['work_ms']:7.2f} ms: sync point {row['sync_ms']:6.2f} ms")
    return {
        "config": vars(args),
        "ranks": mesh.size,
        "auto": mesh.transport,
        "work_ms": alone,
        "rows": rows,
        "sync_after_work": after_work,
    }


def _sync_after_work(mesh: optimus2d.Mesh, args: argparse.Namespace) -> list[dict]:
    """Per ``WORK_ROWS``: ms of work a step, and ms one 64-byte exchange adds after it (the median,
    over repeats, of each repeat's synced − unsynced times, measured back to back)."""
    weight, small = torch.randn(1024, 1024), (torch.randn(16), torch.empty(16))
    works = {rows: torch.randn(rows, 1024) for rows in WORK_ROWS}

    def repeat(rows: int, synced: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            works[rows] @ weight
            if synced:
                compare.exchange(mesh, *small)
        return (time.perf_counter() - start) / args.steps * 1e3

    work: dict[int, list[float]] = {rows: [] for rows in WORK_ROWS}
    sync: dict[int, list[float]] = {rows: [] for rows in WORK_ROWS}
    for r in range(2 * args.rounds):
        for rows in WORK_ROWS:
            alone = repeat(rows, False)
            work[rows].append(alone)
            sync[rows].append(repeat(rows, True) - alone)
        compare.progress("sync after work", r + 1, 2 * args.rounds)
    return [
        {"rows": rows, "work_ms": statistics.median(work[rows]), "sync_ms": statistics.median(sync[rows])}
        for rows in WORK_ROWS
    ]
