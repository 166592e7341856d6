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


@pytest.mark.parametrize("how", ["heads", "activation", "eps", "config"])
def test_a_module_set_otherwise_on_one_rank_is_refused_on_every_rank(world, world_mesh, how):
    """Weights alike, settings not: one rank's nhead, activation or eps was converted and ran (0.32,
    0.07, 0.78 off, no error); so was a Hugging Face config entry. Named on every rank."""
    if world_mesh.size == 1:
        pytest.skip("one rank agrees with itself")
    odd, q = _last(world), world_mesh.q
    torch.manual_seed(0)
    if how == "config":
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(
            vocab_size=32, hidden_size=8 * q, intermediate_size=16 * q, num_hidden_layers=1,
            num_attention_heads=2 * q, num_key_value_heads=2 * q, rms_norm_eps=1e-2 if odd else 1e-6,
        )  # fmt: skip
        model, named = transformers.LlamaForCausalLM(config), "between ranks: (the model), model, "
    else:
        heads = 4 * q if how == "heads" and odd else 2 * q
        activation = "relu" if how == "activation" and odd else "gelu"
        model = nn.Sequential(
            nn.TransformerEncoderLayer(8 * q, heads, 16 * q, dropout=0.0, activation=activation, batch_first=True),
            nn.LayerNorm(8 * q, eps=1.0 if how == "eps" and odd else 1e-5),
        )
        named = {"heads": "ranks: 0.self_attn.", "activation": "ranks: 0.", "eps": "ranks: 1."}[how]
    message = raises_fast(
        ValueError,
        r"parallelize: the serial modules' settings on Mesh.*differ between ranks",
        lambda: optimus2d.parallelize(model, world_mesh),
    )
    assert named in message, message


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
