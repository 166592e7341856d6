"""What building a mesh costs beside the process groups a program already holds.

    mpiexec -n 8 python -m benchmarks --depth 2 meshes                                  # init()'s default
    MPIR_CVAR_ENABLE_HEAVY_YIELD=0 mpiexec -n 8 python -m benchmarks --depth 2 meshes   # MPICH's own default

A program holds gloo groups by the hundred (pipelines, DeviceMeshes, meshes of models still alive:
each group three threads and a socket a peer on every member). Beside them this times building
``--builds`` fresh meshes of the run's shape (kept alive, so none takes a gone mesh's groups), after
holding 0, 100 and 200 groups more (besides those of the meshes built before in the run). Under
mpiexec a mesh splits MPI's COMM_WORLD once an axis, a blocking MPI call: where ranks outnumber
cores MPICH spins between ``sched_yield`` calls, and ``optimus2d.init()`` asks it to sleep instead
(``launch.yield_when_oversubscribed``; it leaves a value the user set). Reported: the slowest rank's
median build, the slowest build of any rank, and the variable's value — run it with and without,
as above, to compare (MPI reads it once, at start).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch.distributed as dist

import optimus2d
from benchmarks.calibrate import usable_cores

HELD = (0, 100, 200)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--builds", type=int, default=4, help="meshes built after each count of groups")
    parser.add_argument("--held", type=int, nargs="+", default=list(HELD), help="groups held before each set")


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    if args.builds < 1 or min(args.held) < 0:  # the same arguments on every rank: refused before any group
        raise ValueError(
            f"benchmarks meshes: --builds must be at least 1 and --held at least 0, got --builds {args.builds} "
            f"and --held {' '.join(map(str, args.held))} (on {mesh})"
        )
    held, kept, rows = [], [], []
    for count in sorted(args.held):
        while len(held) < count:  # the world's group, as a pipeline's or a DeviceMesh's would be
            held.append(dist.new_group(list(range(world.size))))
            dist.barrier(group=held[-1])  # gloo connects a group's peers on its first use
        times = []
        for _ in range(args.builds):
            dist.barrier()
            start = time.perf_counter()
            kept.append(optimus2d.Mesh(mesh.q, mesh.depth))
            times.append(time.perf_counter() - start)
        slowest = max(times)
        every = [None] * world.size
        dist.all_gather_object(every, (statistics.median(times), slowest))
        median, slowest = max(m for m, _ in every), max(s for _, s in every)
        rows.append({"held_groups": count, "median_build_s": median, "slowest_build_s": slowest})
    yielding = os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD", "unset")
    if world.rank == 0:
        print(
            f"Mesh({mesh.q}, {mesh.depth}) built beside held gloo groups; {world.size} ranks on "
            f"{usable_cores()} cores; transport {mesh.transport}; "
            f"MPIR_CVAR_ENABLE_HEAVY_YIELD={yielding}"
        )
        print(f"{'held groups':>12} {'median build (slowest rank)':>28} {'slowest':>10}")
        for row in rows:
            median, slowest = row["median_build_s"] * 1e3, row["slowest_build_s"] * 1e3
            print(f"{row['held_groups']:>12} {median:>25.1f} ms {slowest:>7.1f} ms")
    return {"ranks": world.size, "transport": mesh.transport, "heavy_yield": yielding, "rows": rows}
