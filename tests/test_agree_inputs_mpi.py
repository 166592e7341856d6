"""Inputs that one rank gets wrong are refused on every rank, before any collective could hang.

Issue 26: ``gather`` of the full tensor, a block one rank cut after ``scatter``, a token id out of
range on one rank, a meta tensor (``parallelize(plan=)``: ``test_agree_plan_mpi.py``). Each case
builds meshes of its own (a refusal may be fatal to a mesh) and asserts that every rank raises the
expected error, naming the rank and what it holds, within ``FAST_S`` (``tests/helpers.py``: the
error came from a check, not from a wait running out). Run over MPI and over gloo
(``OPTIMUS2D_TRANSPORT=torch``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import raises_fast
from torch import nn

import optimus2d
from optimus2d import Mesh
from optimus2d.layers import MLP2D, Embedding2D, LayerNorm2D, Linear2D, ShardedModule

pytestmark = pytest.mark.mpi


def _last(world) -> bool:
    return world.rank == world.size - 1


# ---- row 1: gather refuses what is not a block of its mesh ------------------------------------------
def test_gather_of_a_full_tensor_never_scattered_is_refused(world, world_mesh):
    torch.manual_seed(0)
    x = torch.randn(world_mesh.size, 4 * world_mesh.q)  # the same on every rank: the full tensor
    message = raises_fast(ValueError, r"gather on Mesh.*it is the full tensor", lambda: optimus2d.gather(x, world_mesh))
    shape = [world_mesh.size, 4 * world_mesh.q]
    assert f"every rank passes the same tensor float32{shape}" in message
    assert "pass check=False" in message and "optimus2d.scatter(x, mesh)" in message


def test_gather_takes_blocks_tagged_or_not(world, world_mesh):
    """What gather is given in practice: a module's output, its ``detach()`` (no tag), a sum of
    blocks computed by plain torch, a block that is the same on every rank with check=False."""
    torch.manual_seed(0)
    serial = nn.Linear(4 * world_mesh.q, 8 * world_mesh.q)
    layer = Linear2D.from_serial(serial, world_mesh)
    x = torch.randn(2 * world_mesh.size, 3, 4 * world_mesh.q)
    block = optimus2d.scatter(x, world_mesh)
    y = layer(block)
    with torch.no_grad():
        want = serial(x)
        assert torch.allclose(optimus2d.gather(y, world_mesh), want, atol=1e-5)
        assert torch.allclose(optimus2d.gather(y.detach(), world_mesh), want, atol=1e-5)
        assert torch.equal(optimus2d.gather(block * 2 + 1, world_mesh), x * 2 + 1)
    ones = torch.ones(2, 4)  # a block of ones on every rank: the same everywhere, but constant
    full_ones = torch.ones(2 * world_mesh.size // world_mesh.q, 4 * world_mesh.q)
    assert torch.equal(optimus2d.gather(ones, world_mesh), full_ones)
    tiled = torch.arange(8.0).view(2, 4)  # the same, not constant, on every rank: meant with check=False
    assert torch.equal(optimus2d.gather(tiled, world_mesh, check=False)[:2, :4], tiled)


def test_gather_of_a_block_of_another_mesh_is_refused(world, world_mesh):
    other = Mesh(world_mesh.q, world_mesh.depth, list(reversed(world_mesh.ranks)))  # same shape, other blocks
    x = torch.randn(2 * world_mesh.size, 4 * world_mesh.q)
    block = optimus2d.scatter(x, other)
    raises_fast(
        ValueError, r"gather expects a block of Mesh.*is a block of", lambda: optimus2d.gather(block, world_mesh)
    )


def test_gather_of_a_batch_block_is_refused(world, world_mesh):
    ids = torch.arange(world_mesh.size * 6).view(world_mesh.size, 6)
    raises_fast(
        ValueError,
        r"is a batch block .*from scatter_batch",
        lambda: optimus2d.gather(optimus2d.scatter_batch(ids, world_mesh), world_mesh),
    )


# ---- row 3: a block one rank changed after scatter ---------------------------------------------------
def _layer_and_block(mesh):
    torch.manual_seed(0)
    serial = nn.Linear(4 * mesh.q, 6 * mesh.q)
    x = torch.randn(2 * mesh.size, 3, 4 * mesh.q)
    return serial, Linear2D.from_serial(serial, mesh), x, optimus2d.scatter(x, mesh)


def _cut(block: torch.Tensor, how: str) -> torch.Tensor:
    if how == "batch":
        return block[:1]  # a new tensor: no tag
    if how == "sequence":
        return block[:, :2]
    if how == "longer":
        return torch.cat([block, block[:, :1]], 1)
    block.resize_(block.shape[0], 2, block.shape[2])  # in place: keeps the tags, not the shape
    return block


@pytest.mark.parametrize("how", ["batch", "sequence", "longer", "in place"])
def test_a_block_cut_on_one_rank_after_scatter(world, world_mesh, how):
    _, layer, _, block = _layer_and_block(world_mesh)
    if _last(world):
        block = _cut(block, how)
    message = raises_fast(ValueError, r"Linear2D on Mesh.*the ranks disagree", lambda: layer(block))
    assert f"this rank ({world.rank}) has Linear2D of float32{list(block.shape)}" in message
    assert f"rank {world.size - 1}: Linear2D of float32" in message


def test_a_block_one_rank_copied_still_runs(world, world_mesh):
    """One rank's block lost its tag (a copy) but not its shape: its peers, whose blocks come
    unchanged from scatter, exchange with it rather than leave it waiting; the output is exact."""
    serial, layer, x, block = _layer_and_block(world_mesh)
    if _last(world):
        block = block.clone()
    with torch.no_grad():
        y = layer(block)
        assert torch.allclose(optimus2d.gather(y, world_mesh), serial(x), atol=1e-5)


def test_an_output_of_an_earlier_call_on_one_rank(world, world_mesh):
    """Every rank feeds the second layer a module's output, unchanged (tagged as agreed), but the last
    rank's is that of an earlier call, on another batch: agreed then, not now."""
    _, layer, _, block = _layer_and_block(world_mesh)
    second = Linear2D(6 * world_mesh.q, 4 * world_mesh.q, mesh=world_mesh)
    with torch.no_grad():
        earlier = layer(optimus2d.scatter(torch.randn(world_mesh.size, 3, 4 * world_mesh.q), world_mesh))
        now = layer(block)
    fed = earlier if _last(world) else now
    message = raises_fast(ValueError, r"Linear2D on Mesh.*the ranks disagree", lambda: second(fed))
    assert f"rank {world.size - 1}: Linear2D of float32{list(earlier.shape)}" in message


# ---- row 4: token ids out of range on one rank --------------------------------------------------------
def _ids(world, mesh, bad: int):
    ids = optimus2d.scatter_batch(torch.ones(mesh.size, 4, dtype=torch.long), mesh)
    if _last(world):
        ids = ids.clone()  # a new tensor (its peers' come unchanged from scatter_batch)
        ids[0, 2] = bad
    return ids


def _named(world, mesh, bad: int) -> str:
    per_rank = [mesh.size // (mesh.depth * mesh.q), 4]
    last = f"rank {world.size - 1}: 1 of its ids {per_rank}, the first {bad} at [0, 2]"
    return f"token ids outside [0, 10) on 1 of {mesh.size} ranks: {last}"


class _Wrapper(ShardedModule):
    """An optimus2d module that calls an embedding inside: the embedding's call is not the outermost."""

    def __init__(self, embedding: Embedding2D) -> None:
        super().__init__(embedding.mesh)
        self.embedding = embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


@pytest.mark.parametrize("where", ["outermost", "inside another module", "on a mesh checked off"])
@pytest.mark.parametrize("bad", [10, -1])
def test_a_token_id_out_of_range_on_one_rank(world, world_mesh, where, bad):
    """Every rank raises the same error, naming the rank, its bad id and the vocabulary; the lookup's
    collectives all complete, so the mesh stays usable (the same ids in range run after)."""
    mesh = world_mesh if where != "on a mesh checked off" else Mesh(world_mesh.q, world_mesh.depth, check="off")
    embedding = Embedding2D(10, 4 * mesh.q, mesh=mesh)
    module = _Wrapper(embedding) if where == "inside another module" else embedding
    ids = _ids(world, mesh, bad)
    message = raises_fast(ValueError, r"Embedding2D\(num_embeddings=10\): token ids outside", lambda: module(ids))
    assert _named(world, mesh, bad) in message
    ids[ids == bad] = 1
    assert module(ids).shape == (mesh.size // (mesh.depth * mesh.q), 4, 4)


# ---- row 5: meta tensors --------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Linear2D, LayerNorm2D, MLP2D])
def test_a_meta_input_is_refused_on_every_rank(world, world_mesh, cls):
    q = world_mesh.q
    module = cls(4 * q, 8 * q, mesh=world_mesh) if cls is not LayerNorm2D else cls(4 * q, mesh=world_mesh)
    x = torch.empty(2, 3, 4, device="meta")
    named = "Linear2D" if cls is MLP2D else cls.__name__  # MLP2D is torch's module: its first Linear2D checks
    message = raises_fast(TypeError, rf"{named}: its input float32\[2, 3, 4\] is on the meta device", lambda: module(x))
    assert "pass real tensors" in message and "optimus2d.materialize" in message


def test_a_meta_input_on_one_rank_is_refused_on_every_rank(world, world_mesh):
    layer = Linear2D(4 * world_mesh.q, 8 * world_mesh.q, mesh=world_mesh)
    x = torch.empty(2, 3, 4, device="meta" if _last(world) else "cpu")
    raises_fast(
        TypeError, rf"rank {world.size - 1} refused it: TypeError: Linear2D: its input .* meta device", lambda: layer(x)
    )


def test_a_module_on_meta_is_refused_on_every_rank(world, world_mesh):
    layer = Linear2D(4 * world_mesh.q, 8 * world_mesh.q, mesh=world_mesh, device="meta")
    raises_fast(TypeError, r"Linear2D: its parameter weight is on the meta device", lambda: layer(torch.randn(2, 3, 4)))


def test_a_meta_input_on_a_mesh_checked_off(world):
    if world.size == 1:
        pytest.skip("one rank")
    mesh = Mesh(1, world.size, check="off")
    raises_fast(
        TypeError,
        r"Linear2D: its input .* meta device",
        lambda: Linear2D(4, 8, mesh=mesh)(torch.empty(2, 4, device="meta")),
    )
