"""A mesh that is gone hands its process groups and MPI communicators on to a mesh built later over
the same ranks (comm/shared_groups.py); meshes alive at once never share one, and a mesh on which
something went wrong hands nothing on."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from optimus2d import Mesh
from optimus2d.comm import primitives, shared_groups
from optimus2d.comm.watch import PeerFailedError

pytestmark = pytest.mark.mpi

AXES = ("row", "col", "depth", "mesh")


def _handles(mesh: Mesh) -> list:
    groups = [mesh.group(a) for a in AXES if mesh.axis_size(a) > 1]
    return groups + ([] if mesh.mpi is None else list(mesh.mpi.comms.values()))


def _sums(mesh: Mesh) -> None:
    """A collective on every axis gives the sum over the axis's members."""
    for axis in AXES:
        if mesh.axis_size(axis) > 1:
            t = torch.tensor([float(mesh.rank + 1)])
            primitives.all_reduce(t, mesh, axis)
            assert t.item() == sum(r + 1 for r in mesh.members(axis)), axis


def _short_timeout(mesh: Mesh, seconds: float) -> Mesh:
    mesh.timeout = seconds
    if mesh.mpi is not None:
        mesh.mpi.timeout = seconds
    return mesh


def _next_mesh_takes_none_of(handles: set[int], p: int) -> None:
    """Once the spoiled mesh is collected, the next mesh over its ranks has new groups, and they sum."""
    gc.collect()
    after = Mesh(1, p)
    assert not {id(h) for h in _handles(after)} & handles
    _sums(after)


@pytest.fixture
def multi(world):
    if world.size == 1:
        pytest.skip("a mesh of one rank has no groups")
    return world


def test_live_meshes_never_share_and_a_gone_one_hands_its_groups_on(multi, mesh_shape):
    first, second = Mesh(*mesh_shape), Mesh(*mesh_shape)
    assert not {id(h) for h in _handles(first)} & {id(h) for h in _handles(second)}
    del second
    gc.collect()
    held = shared_groups.held()
    third = Mesh(*mesh_shape)
    assert shared_groups.held() == held, "the third mesh created groups: the second's were free"
    assert not {id(h) for h in _handles(first)} & {id(h) for h in _handles(third)}
    held = []
    for _ in range(5):  # a mesh per model, each dropped: one mesh's groups, reused
        Mesh(*mesh_shape)
        gc.collect()
        held.append(shared_groups.held())
    assert held == held[:1] * 5, held
    _sums(first)
    _sums(third)


def test_a_failure_on_one_mesh_leaves_a_live_mesh_over_the_same_ranks_exact(multi):
    """The last rank skips an all-reduce on B; the others time out there. A, built before B over
    the same ranks, still sums exactly; a mesh built after B is gone takes none of B's groups."""
    p = multi.size
    a, b = Mesh(1, p), _short_timeout(Mesh(1, p), 2.0)
    if multi.rank != p - 1:
        with pytest.raises((TimeoutError, PeerFailedError)):  # the first to time out tells the others
            primitives.all_reduce(torch.tensor([100.0]), b, "mesh")
    dist.barrier()
    _sums(a)
    spoiled = {id(h) for h in _handles(b)}
    del b
    _next_mesh_takes_none_of(spoiled, p)


def test_an_operation_dropped_in_flight_keeps_its_groups_from_later_meshes(multi):
    """The last rank posts an all-reduce on A and drops it without its wait (an error between post
    and wait); nothing fails anywhere. Once A is gone, the next mesh over its ranks gets new groups:
    A's may still deliver that message."""
    p = multi.size
    a = Mesh(1, p)
    if multi.rank == p - 1:
        primitives.all_reduce(torch.tensor([100.0]), a, "mesh", async_op=True)  # dropped at once
    dropped = {id(h) for h in _handles(a)}
    del a
    _next_mesh_takes_none_of(dropped, p)
