"""One process group and one MPI communicator per list of ranks, shared by the meshes over them.

Creating a group is collective over the world, and a gloo group holds threads and sockets for the
life of the process (3 threads on each member). Held by the hundred, they slow what comes after:
MPICH's ``Comm.Split`` beside 100 gloo groups takes 7 ms a split, beside 200 it takes 0.5 s, with
pauses of up to 13 s (4 ranks on 2 cores, torch 2.13, MPICH 4; a program or a test session that
builds a mesh per model). So a mesh takes its groups from here: every mesh whose group has the same
ranks in the same order gets the group the first one created (``Mesh(2, 1)`` and ``Mesh(1, 4)`` over
4 ranks share the group of all 4), and a process holds one group per list of ranks, one MPI
communicator per split, however many meshes it builds. Meshes use them in program order, as one
mesh would.

**After a failure.** An operation abandoned by a failed wait (a timeout, a peer's failure, a
disagreement that broke a collective, an MPI error) may still match a later one on its group: the
mesh is dead (``comm/watch.py``), and so are the groups it shares. ``taint()`` marks the process
(``watch`` calls it on every failed wait and report); the next mesh built drops every shared group
and communicator before it takes its own, when any rank of the world is tainted (``settle``, given
the all-reduce the mesh's build makes over the default group): every rank decides alike, and new
groups are created. Groups are dropped, not destroyed (a peer may still hold its end).
"""

from __future__ import annotations

import torch.distributed as dist

from optimus2d.comm import compat

_groups: dict = {}  # (ranks, backend) → ProcessGroup, or None on a rank outside it
_comms: dict = {}  # a split of COMM_WORLD (its groups, in order) → this rank's communicator or COMM_NULL
_tainted = False  # a failed wait or report on this rank since the last settle


def taint() -> None:
    """A wait failed here: the shared groups may hold an abandoned operation."""
    global _tainted
    _tainted = True


def tainted() -> bool:
    return _tainted


def settle(any_tainted: bool) -> None:
    """Drop every shared group and communicator if any rank is tainted (``any_tainted``, the same on
    every rank: the caller's all-reduce over the world)."""
    global _tainted
    if any_tainted:
        _groups.clear()
        _comms.clear()
    _tainted = False


def group(ranks, backend: str | None = None):
    """The process group of ``ranks`` (in that order, where torch keeps it: ``compat.new_group``),
    created at its first request; collective over the world then, so every rank asks for every
    group in the same order (non-members get None)."""
    key = (tuple(int(r) for r in ranks), backend)
    if key not in _groups:
        made = compat.new_group(key[0], **({"backend": backend} if backend else {}))
        _groups[key] = made if dist.get_rank() in key[0] else None
    return _groups[key]


def split(comm_world, groups: list[list[int]], rank: int):
    """This rank's MPI communicator of the split of ``comm_world`` into ``groups`` (members in order;
    a rank in none, or alone in its group, gets ``COMM_NULL``); collective over ``comm_world`` at the
    first request of a split."""
    key = tuple(tuple(members) for members in groups)
    if key not in _comms:
        color, position = _undefined(), 0
        for n, members in enumerate(key):
            if rank in members and len(members) > 1:
                color, position = n, members.index(rank)
        _comms[key] = comm_world.Split(color, position)
    return _comms[key]


def held() -> tuple[int, int]:
    """(process groups, MPI communicators) held for sharing: what tests and benchmarks count."""
    return sum(g is not None for g in _groups.values()), len(_comms)


def _undefined():
    from mpi4py import MPI

    return MPI.UNDEFINED
