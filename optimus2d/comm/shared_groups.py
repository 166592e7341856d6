"""Process groups and MPI communicators handed on from meshes that are gone to the meshes built after.

Creating a group is collective over the world, and a gloo group holds threads and sockets for the
life of the process (3 threads on each member; torch frees none a program forgets). Held by the
hundred, they slow what comes after: MPICH's ``Comm.Split`` beside 100 gloo groups takes 7 ms a
split, beside 200 it takes 0.5 s, with pauses of up to 13 s (4 ranks on 2 cores, torch 2.13, MPICH 4;
a program or a test session that builds a mesh per model; where ranks outnumber cores ``init()`` now
has MPICH sleep in such calls, ``launch.yield_when_oversubscribed``: milliseconds again). So a
mesh's groups outlive it here: once a mesh is gone (collected) and nothing went wrong on it, a
mesh built later whose group has the same ranks in the same order takes that group (and its
communicator) instead of creating one. Meshes alive at the same time never share one: a failure on
one leaves the others as they were.

**Every rank decides alike.** A mesh's build (``Taking``) all-reduces (MIN, over the default group)
one flag per group and communicator this process created for meshes (created in the same order on
every rank, so the same list): free here. A group is taken only where it is free on every rank;
any other the mesh needs is created, by every rank in the same order. Garbage collection runs at
different times on different ranks; that only delays a reuse.

**Spoiled, never reused** (``spoil``): the groups of a mesh on which a wait failed (a timeout, a
peer's failure, a disagreement that broke a collective, an MPI or gloo error), for which a failure
was reported, whose operation was dropped without its wait (collected in flight: MPI might still
match its message), or whose group a failed checkpoint used. An operation holds its mesh, so a
mesh is collected only after its operations, and a dropped one has spoiled it by then.
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist

from optimus2d.comm import compat


class Lease:
    """A mesh's hold on its groups; ``spoiled``: they may hold an abandoned operation."""

    __slots__ = ("spoiled",)

    def __init__(self) -> None:
        self.spoiled = False


class _Slot:
    __slots__ = ("handle", "key", "lease", "owner")

    def __init__(self, key: tuple, handle, mesh, lease: Lease) -> None:
        self.key, self.handle = key, handle
        self.owner, self.lease = weakref.ref(mesh), lease

    def free(self) -> bool:
        return self.owner() is None and not self.lease.spoiled


_COLLECT_AT = 48  # slots held by live meshes before a build collects garbage (each rank on its own),
_collect_at = [_COLLECT_AT]  # or twice what was live after the last collection
_slots: list[_Slot] = []  # every group and communicator made for meshes, in creation order
_world: list = [None]  # the default group they were made under (a new init starts afresh)


def spoil(mesh) -> None:
    """Never hand ``mesh``'s groups on (an operation may be left in them)."""
    lease = getattr(mesh, "_lease", None)
    if lease is not None:
        lease.spoiled = True


class Taking:
    """One mesh's build: which of the groups of meshes that are gone are free on every rank (one
    all-reduce over the default group, with ``also``: flags the caller wants MIN-reduced with them).
    Collective over the world when it has more than one rank."""

    def __init__(self, mesh, also: list[int], device: torch.device) -> None:
        world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        if _world[0] is not world:
            _slots.clear()
            _world[0] = world
        mesh._lease = self.lease = Lease()
        self.mesh = mesh
        if _live() >= _collect_at[0]:  # meshes in reference cycles (a model's hooks) are gone only
            gc.collect()  # once collected (this rank's view; the flags are MIN-reduced)
            _collect_at[0] = max(_COLLECT_AT, 2 * _live())
        flags = [*also, *(int(s.free()) for s in _slots)]
        if world is not None and dist.get_world_size() > 1 and flags:
            reduced = torch.tensor(flags, dtype=torch.int32, device=device)
            dist.all_reduce(reduced, op=dist.ReduceOp.MIN)
            flags = reduced.tolist()
        self.also, self._free = flags[: len(also)], [bool(f) for f in flags[len(also) :]]

    def _take(self, key: tuple, create):
        for n, slot in enumerate(_slots):
            if self._free[n] and slot.key == key:
                self._free[n] = False
                slot.owner, slot.lease = weakref.ref(self.mesh), self.lease
                return slot.handle
        handle = create()
        _slots.append(_Slot(key, handle, self.mesh, self.lease))
        self._free.append(False)
        return handle

    def group(self, ranks, backend: str | None = None):
        """The process group of ``ranks`` (in that order, where torch keeps it: ``compat.new_group``),
        None on a rank outside it; every rank asks for every group, in the same order."""
        members = tuple(int(r) for r in ranks)

        def create():
            made = compat.new_group(members, **({"backend": backend} if backend else {}))
            return made if dist.get_rank() in members else None

        return self._take(("group", members, backend), create)

    def split(self, comm_world, groups: list[list[int]], rank: int):
        """This rank's MPI communicator of the split of ``comm_world`` into ``groups`` (members in
        order; ``COMM_NULL`` for a rank in none, or alone in its group); every rank asks alike."""
        key = tuple(tuple(members) for members in groups)

        def create():
            from mpi4py import MPI

            color, position = MPI.UNDEFINED, 0
            for n, members in enumerate(key):
                if rank in members and len(members) > 1:
                    color, position = n, members.index(rank)
            return comm_world.Split(color, position)

        return self._take(("split", key), create)


def _live() -> int:
    return sum(s.owner() is not None for s in _slots)


def held() -> int:
    """How many groups and communicators this process holds for meshes (in use or free)."""
    return len(_slots)
