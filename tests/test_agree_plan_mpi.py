"""Inputs that one rank gets wrong are refused on every rank, before any collective could hang.

Issue 26: a ``parallelize(plan=)`` that differs on one rank (a key missing, another module, a bad
key, another mesh), and a plan every rank refuses. Each case builds
meshes of its own (a refusal may be fatal to a mesh) and asserts that every rank raises the expected
error, naming the rank and what it holds, within ``helpers.FAST_S`` (as ``tests/test_disagree_mpi.py``: the
error came from a check, not from a wait running out). Run over MPI and over gloo
(``OPTIMUS2D_TRANSPORT=torch``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import raises_fast
from torch import nn

import optimus2d
from optimus2d import Mesh

pytestmark = pytest.mark.mpi


def _last(world) -> bool:
    return world.rank == world.size - 1


# ---- row 1: gather refuses what is not a block of its mesh ------------------------------------------
@pytest.mark.parametrize("how", ["a key missing", "another module", "a bad key", "another mesh"])
def test_a_plan_that_differs_on_one_rank(world, world_mesh, how):
    q = world_mesh.q
    flat, other = Mesh(1, world.size), Mesh(1, world.size, list(reversed(range(world.size))))  # collective
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4 * q, 4 * q), nn.GELU(), nn.Linear(4 * q, 4 * q))
    plan = {"0": flat}
    if _last(world):
        plan = {"a key missing": {}, "another module": {"2": flat}, "a bad key": {"nope": flat}}.get(how, {"0": other})
    message = raises_fast(
        ValueError,
        r"parallelize on Mesh.*the ranks disagree",
        lambda: optimus2d.parallelize(model, world_mesh, plan=plan),
    )
    assert f"this rank ({world.rank}) has parallelize of plan" in message
    assert f"rank {world.size - 1}: parallelize of plan {{" in message
    assert f"'0': Mesh(q=1, depth={world.size}" in message  # the others' plan, named
    if how == "a bad key":
        assert "refused: ValueError: parallelize: plan= names no module of the model at 'nope'" in message


def test_a_plan_refused_by_every_rank_keeps_its_error(world, world_mesh):
    flat = Mesh(1, world.size)
    model = nn.Sequential(nn.Linear(4, 4))
    raises_fast(
        ValueError,
        r"plan= names no module of the model at 'nope'",
        lambda: optimus2d.parallelize(model, world_mesh, plan={"nope": flat}),
    )


def test_the_same_plan_converts(world, world_mesh):
    q = world_mesh.q
    flat = Mesh(1, world.size)
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(4 * q, 4 * q), nn.GELU(), nn.Linear(4 * q, 4 * q))
    model = optimus2d.parallelize(copy.deepcopy(serial), world_mesh, plan={"0": flat})
    x = torch.randn(2 * world_mesh.size, 4 * q)
    with torch.no_grad():
        assert torch.allclose(
            optimus2d.gather(model(optimus2d.scatter(x, world_mesh)), world_mesh), serial(x), atol=1e-5
        )


# ---- row 3: a block one rank changed after scatter ---------------------------------------------------
