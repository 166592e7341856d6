"""Meshes over the same ranks share their process groups and MPI communicators (comm/shared_groups.py);
a failed wait on any rank makes every rank create new ones for the next mesh."""

from __future__ import annotations

import pytest
import torch

from optimus2d import Mesh
from optimus2d.comm import all_reduce, shared_groups, watch

pytestmark = pytest.mark.mpi

AXES = ("row", "col", "depth", "mesh")


def _groups(mesh: Mesh) -> dict:
    return {mesh.members(axis): mesh.group(axis) for axis in AXES if mesh.axis_size(axis) > 1}


def _comms(mesh: Mesh) -> dict:
    return {} if mesh.mpi is None else {mesh.members(a): mesh.mpi.comms[a] for a in AXES if a in mesh.mpi.comms}


def _sums(mesh: Mesh) -> None:
    """A collective on every axis gives the sum over the axis's members."""
    for axis in AXES:
        if mesh.axis_size(axis) > 1:
            t = torch.tensor([float(mesh.rank + 1)])
            assert all_reduce(t, mesh, (axis,)).item() == sum(r + 1 for r in mesh.members(axis)), axis


def test_meshes_over_the_same_ranks_share_their_groups(world, mesh_shape):
    if world.size == 1:
        pytest.skip("a mesh of one rank has no groups")
    first = Mesh(*mesh_shape)
    held = shared_groups.held()
    others = [Mesh(*mesh_shape) for _ in range(5)] + [Mesh(1, world.size), Mesh(1, world.size)]
    assert shared_groups.held()[0] <= held[0] + 2, "the 1×1×p meshes add their depth group at most"
    groups, comms = {**_groups(first)}, {**_comms(first)}
    for other in others:
        for ranks, group in _groups(other).items():
            assert groups.setdefault(ranks, group) is group, f"{other}: a second group of ranks {ranks}"
        for ranks, comm in _comms(other).items():
            assert comms.setdefault(ranks, comm) is comm, f"{other}: a second communicator of ranks {ranks}"
        _sums(other)
    _sums(first)


def test_a_failed_wait_on_one_rank_gives_every_mesh_after_it_new_groups(world):
    """Rank 1 alone times out in a wait; the next mesh every rank builds has groups of its own
    (the failed one's may hold an abandoned operation), and the mesh after that shares them again."""
    if world.size == 1:
        pytest.skip("one rank has no groups to share")
    before = Mesh(1, world.size)
    if world.rank == 1:
        with pytest.raises(TimeoutError, match="did not complete"):
            watch.wait(lambda: False, None, "a wait that fails", 0.01)
    fresh, again = Mesh(1, world.size), Mesh(1, world.size)
    assert fresh.group("depth") is not before.group("depth")
    assert again.group("depth") is fresh.group("depth")
    if before.mpi is not None:
        assert fresh.mpi.comms["depth"] is not before.mpi.comms["depth"]
        assert again.mpi.comms["depth"] is fresh.mpi.comms["depth"]
    assert not shared_groups.tainted()
    _sums(fresh)
