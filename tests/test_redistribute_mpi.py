"""``redistribute`` between every pair of mesh shapes over the world (4: 2×2 ↔ 1×1×4; 8: 2×2×2 ↔
1×1×8; 9: 3×3 ↔ 1×1×9): blocks exact forward, a gradient that differs per destination reconstructed
exactly backward, the bytes each rank sends equal to the formula, refusals on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from conftest import _meshes, mesh_shapes

import optimus2d
from optimus2d import Mesh, count_comm, redistribute, scatter, scatter_batch
from optimus2d.comm.redistribution import boxes, global_shape

pytestmark = pytest.mark.mpi


def _meshes_of(world) -> dict[tuple[int, int], Mesh]:
    for shape in mesh_shapes(world.size):
        if shape not in _meshes:
            _meshes[shape] = Mesh(*shape)
    return {shape: _meshes[shape] for shape in mesh_shapes(world.size)}


def _pairs(world):
    meshes = _meshes_of(world)
    return [(meshes[a], meshes[b]) for a, b in itertools.product(meshes, repeat=2)]


def _full(world, kind: str) -> torch.Tensor:
    torch.manual_seed(7)
    shape = (2 * world.size, 3, 12) if kind == "activation" else (2 * world.size, 5)
    return torch.randn(shape, dtype=torch.float64)


def _block(full: torch.Tensor, mesh: Mesh, kind: str) -> torch.Tensor:
    box = boxes(mesh, kind, tuple(full.shape))[mesh.ranks.index(mesh.rank)]
    return full[tuple(slice(a, b) for a, b in box)].clone()


def _size(box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


def _overlap(x, y) -> int:
    return _size(tuple((max(a, c), min(b, e)) for (a, b), (c, e) in zip(x, y, strict=True)))


@pytest.mark.parametrize("kind", ["activation", "batch"])
def test_forward_blocks_and_bytes(world, kind):
    full = _full(world, kind)
    place = scatter if kind == "activation" else scatter_batch
    for src, dst in _pairs(world):
        with count_comm() as c:
            got = redistribute(place(full, src), src, dst)
        assert torch.equal(got, _block(full, dst, kind)), f"{src} → {dst}"
        # every rank receives its new box less what it held; the ranks' sends add up to that
        shape = tuple(full.shape)
        mine = dst.ranks.index(dst.rank)
        need = _size(boxes(dst, kind, shape)[mine]) - _overlap(
            boxes(dst, kind, shape)[mine], boxes(src, kind, shape)[src.ranks.index(src.rank)]
        )
        if (src.q, src.depth) == (dst.q, dst.depth):
            need = 0
        totals = torch.tensor([c.numel, need])
        if world.size > 1:
            dist.all_reduce(totals)
        assert totals[0] == totals[1], f"{src} → {dst}: sent {totals[0]} elements, the formula says {totals[1]}"


def test_bytes_by_hand(world):
    """2×2 → 1×1×4 on 4 ranks: "batch" moves nothing (each box halves in place); "activation"
    sends each rank's other hidden half of its new batch quarter: b/4 · s · h/2 elements."""
    if world.size != 4:
        pytest.skip("runs on 4 ranks")
    meshes = _meshes_of(world)
    src, dst = meshes[(2, 1)], meshes[(1, 4)]
    for kind, want in [("batch", 0), ("activation", 2 * 3 * 6)]:
        full = _full(world, kind)
        block = (scatter if kind == "activation" else scatter_batch)(full, src)
        with count_comm() as c:
            redistribute(block, src, dst)
        assert c.numel == want and c.bytes == 8 * want, (kind, c.summary())


@pytest.mark.parametrize("kind", ["activation", "batch"])
def test_backward_signed_reconstruction(world, kind):
    """The loss weighs each destination rank's block by a different factor, so a gradient part
    routed to the wrong rank, dropped or counted twice changes the reconstruction."""
    full = _full(world, kind)
    weight = torch.randn_like(full)
    for src, dst in _pairs(world):
        x = _block(full, src, kind).requires_grad_()
        y = redistribute(x, src, dst, layout=kind)
        factor = 1.0 + dst.ranks.index(dst.rank)
        (y * _block(weight, dst, kind) * factor).sum().backward()
        # the expected global gradient: each destination's factor, summed over the destination
        # ranks holding an element (replicas over the row, in the "batch" layout)
        want = torch.zeros_like(full)
        for n, box in enumerate(boxes(dst, kind, tuple(full.shape))):
            at = tuple(slice(a, b) for a, b in box)
            want[at] += weight[at] * (1.0 + n)
        got = torch.zeros_like(full)
        box = boxes(src, kind, tuple(full.shape))[src.ranks.index(src.rank)]
        got[tuple(slice(a, b) for a, b in box)] = x.grad  # replicas' gradients are summed
        if world.size > 1:
            dist.all_reduce(got)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), f"{src} → {dst}"


def test_refusals_on_every_rank(world):
    meshes = _meshes_of(world)
    big = max(meshes.values(), key=lambda m: m.depth)  # 1×1×p: batch split p ways
    small = max(meshes.values(), key=lambda m: m.q)
    if big is small:
        pytest.skip("needs two mesh shapes")
    torch.manual_seed(0)  # the same full tensors on every rank, whatever ran before
    x = torch.randn(small.depth * small.q, 2, 2 * small.q * big.q)  # batch divides small, not big
    with pytest.raises(ValueError, match=r"batch dim 0 of tensor .* not divisible by depth·q"):
        redistribute(scatter(x, small), small, big)
    with pytest.raises(ValueError, match="cannot know the layout"):
        redistribute(torch.randn(2, 3), small, big)
    y = torch.randn(big.depth * big.q, 2, 2 * small.q + 1)  # a hidden dim small's q does not divide
    with pytest.raises(ValueError, match=r"hidden dim -1 of tensor .* not divisible by q"):
        redistribute(scatter(y, big), big, small)
    z = torch.randn(4 * big.depth * big.q, 3, 4 * small.q)  # a layout= other than the tag: the wrong boxes moved
    with pytest.raises(ValueError, match=r"is an activation block \(its tag\), not 'batch'"):
        redistribute(scatter(z, small), small, big, layout="batch")
    with pytest.raises(ValueError, match=r"is a batch block \(its tag\), not 'activation'"):
        redistribute(scatter_batch(z, small), small, big, layout="activation")


def test_a_destination_over_other_ranks_on_one_rank_is_refused_on_every_rank(world):
    """One rank's dst of the same shape over the ranks in another order: the others took it as the
    same mesh and returned, that rank waited to the timeout. Refused at once on every rank."""
    if world.size == 1:
        pytest.skip("one rank agrees with itself")
    q = max(q for q, d in mesh_shapes(world.size) if d == world.size // q**2)
    src, d = Mesh(q, world.size // q**2), world.size // q**2
    other = Mesh(q, d, list(reversed(range(world.size))))
    torch.manual_seed(0)
    x = scatter(torch.randn(2 * world.size, 3, 4 * q), src)
    with pytest.raises(ValueError, match=r"redistribute on Mesh.*ranks="):
        redistribute(x, src, other if world.rank == world.size - 1 else src)


def test_integer_batch_and_global_shape(world):
    """Token ids move like any batch tensor (no gradient); ``global_shape`` reads the layout."""
    meshes = _meshes_of(world)
    ids = torch.arange(2 * world.size * 4).reshape(2 * world.size, 4)
    for src, dst in _pairs(world):
        got = redistribute(scatter_batch(ids, src), src, dst)
        assert torch.equal(got, _block(ids, dst, "batch"))
        assert global_shape(got.shape, dst, "batch") == tuple(ids.shape)
    assert optimus2d.redistribute is redistribute and len(meshes) >= 1
