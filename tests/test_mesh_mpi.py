"""Mesh coordinates, groups, validation; scatter/gather; the public SUMMA functions."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close

from optimus2d import Mesh, count_comm, gather, scatter, scatter_batch, serial_state_dict
from optimus2d.comm import stationary_ab, stationary_abt, summa_ab, summa_abt, summa_atb
from optimus2d.layers import Linear2D

pytestmark = pytest.mark.mpi


def test_coordinates_and_groups_agree(mesh):
    q, d = mesh.q, mesh.depth
    coords = [None] * dist.get_world_size()
    dist.all_gather_object(coords, mesh.coord)
    assert sorted(coords) == sorted((k, i, j) for k in range(d) for i in range(q) for j in range(q))
    k, i, j = mesh.coord
    assert mesh.rank_at(k, i, j) == dist.get_rank()
    assert [coords[r] for r in mesh.members("row")] == [(k, i, jj) for jj in range(q)]
    assert [coords[r] for r in mesh.members("col")] == [(k, ii, j) for ii in range(q)]
    assert [coords[r] for r in mesh.members("depth")] == [(kk, i, j) for kk in range(d)]
    for axis, index in (("row", j), ("col", i), ("depth", k)):
        assert mesh.index(axis) == index
        assert mesh.global_rank(axis, index) == dist.get_rank()
        assert (mesh.group(axis) is None) == (mesh.axis_size(axis) == 1)


def test_world_size_that_does_not_fit_is_refused(world):
    p = world.size
    with pytest.raises(ValueError, match=rf"needs depth·q² = {4 * p} ranks but the world has {p}; {p} ranks fit"):
        Mesh(2, depth=p)
    with pytest.raises(ValueError, match=r"needs depth·q² = 4 ranks but was given 3"):
        Mesh(2, ranks=[0, 0, 0])
    with pytest.raises(ValueError, match="positive integers"):
        Mesh(0)
    with pytest.raises(ValueError, match="positive integers"):
        Mesh(True)
    with pytest.raises(ValueError, match=r"Mesh ranks must be integers"):  # 1.5 was taken as rank 1
        Mesh(1, depth=p, ranks=[r + 0.5 for r in range(p)])
    assert Mesh(1, depth=p, ranks=(r for r in range(p))).ranks == tuple(range(p))  # a generator, read once


def test_mesh_on_a_subset_of_ranks(world):
    if world.size < 5:
        pytest.skip("needs more ranks than the 2×2 sub-mesh")
    sub = Mesh(2, ranks=[1, 2, 3, 4])  # every rank builds it; ranks 0 and 5.. are not in it
    if dist.get_rank() not in (1, 2, 3, 4):
        assert sub.coord is None
        with pytest.raises(ValueError, match="is not in Mesh"):
            sub.group("row")
        return
    torch.manual_seed(0)
    serial = torch.nn.Linear(6, 10)
    layer = Linear2D.from_serial(serial, sub)
    x = torch.randn(4, 3, 6)
    y = gather(layer(scatter(x, sub)), sub)
    assert_close(y, serial(x), what="sub-mesh output")


def test_scatter_gather_round_trip_and_gradients(mesh):
    q, d = mesh.q, mesh.depth
    torch.manual_seed(0)
    x = torch.randn(2 * d * q, 3, 6 * q, requires_grad=True)
    local = scatter(x, mesh)
    k, i, j = mesh.coord
    b, h = 2, 6
    assert torch.equal(local, x[(k * q + i) * b : (k * q + i + 1) * b, :, j * h : (j + 1) * h])
    # scatter's backward gathers: every rank gets the whole gradient of the replicated input
    (local * (mesh.index("mesh") + 1)).sum().backward()
    full = gather(local.detach(), mesh)
    assert torch.equal(full, x.detach())
    for kk in range(d):
        for ii in range(q):
            for jj in range(q):
                block = x.grad[(kk * q + ii) * b : (kk * q + ii + 1) * b, :, jj * h : (jj + 1) * h]
                assert torch.all(block == (kk * q + ii) * q + jj + 1)
    # gather's backward keeps the local block of the (replicated) gradient
    local2 = local.detach().requires_grad_()
    weight = torch.arange(float(full.numel())).view_as(full)
    (gather(local2, mesh) * weight).sum().backward()
    assert torch.equal(local2.grad, scatter(weight, mesh))


def test_scatter_refuses_shapes_that_do_not_divide(mesh):
    q, d = mesh.q, mesh.depth
    with count_comm() as counter:
        if d * q > 1:
            with pytest.raises(
                ValueError, match=rf"batch dim 0 of tensor \({d * q + 1}, 4, {q}\) .* depth·q = {d * q}"
            ):
                scatter(torch.zeros(d * q + 1, 4, q), mesh)
        if q > 1:
            with pytest.raises(ValueError, match=rf"hidden dim -1 of tensor \({d * q}, {q + 1}\) .* q = {q}"):
                scatter(torch.zeros(d * q, q + 1), mesh)
            with pytest.raises(ValueError, match=rf"in_features=7 is not divisible by q={q}"):
                Linear2D(7, 2 * q, mesh=mesh)
            with pytest.raises(ValueError, match=rf"out_features=7 is not divisible by q={q}"):
                Linear2D(2 * q, 7, mesh=mesh)
        with pytest.raises(TypeError, match="full tensor"):
            scatter(torch.zeros(4), mesh)
        with pytest.raises(ValueError, match=rf"depth·q = {d * q}") if d * q > 1 else contextlib.nullcontext():
            scatter_batch(torch.zeros(d * q + 1, dtype=torch.long), mesh)
    assert counter.count() == 0


def test_stationary_products_and_algorithms_refuse_bad_input_before_any_collective(mesh):
    q = mesh.q
    with count_comm() as counter:
        with pytest.raises(ValueError, match=r"algorithm 'fast' is not one of \('auto', 'summa', 'stationary'\)"):
            Linear2D(2 * q, 2 * q, mesh=mesh, algorithm="fast")
        with pytest.raises(
            ValueError, match=r"stationary_ab: local blocks a \(4, 3\) \(dim 1\) and b \(2, 5\) \(dim 0\)"
        ):
            stationary_ab(torch.zeros(4, 3), torch.zeros(2, 5), mesh)
        with pytest.raises(ValueError, match=r"stationary_abt takes 2-D local blocks, got a \(4,\)"):
            stationary_abt(torch.zeros(4), torch.zeros(2, 5), mesh)
    assert counter.count() == 0


def test_transposed_linear_refuses_wrong_local_layout_and_dtype(mesh):
    from optimus2d.layers import TransposedLinear2D

    layer = TransposedLinear2D(6 * mesh.q, 6 * mesh.q, mesh=mesh)
    with count_comm() as counter:
        with pytest.raises(ValueError, match=r"input of shape \(2, 5, 7\) must be \[rows..., in_features/q = 6\]"):
            layer(torch.zeros(2, 5, 7))
        with pytest.raises(TypeError, match=r"TransposedLinear2D: input dtype torch\.float64 differs"):
            layer(torch.zeros(2, 6, dtype=torch.float64))
    assert counter.count() == 0


def test_linear_refuses_wrong_local_layout(mesh):
    q = mesh.q
    layer = Linear2D(6 * q, 6 * q, mesh=mesh)
    with count_comm() as counter:
        with pytest.raises(ValueError, match=r"input of shape \(2, 5, 7\) must be \[rows..., in_features/q = 6\]"):
            layer(torch.zeros(2, 5, 7))
        if q > 1:
            with pytest.raises(ValueError, match="looks like the full tensor"):
                layer(torch.zeros(2, 6 * q))
        with pytest.raises(TypeError, match=r"dtype torch\.float64 differs"):
            layer(torch.zeros(2, 6, dtype=torch.float64))
    assert counter.count() == 0


def _block(full, mesh, rows_over_depth):
    """Rank's block of a matrix: rows split over depth·q (activations) or q (weights), cols over q."""
    from optimus2d.comm import Sharding, shard

    rows = ("depth", "col") if rows_over_depth else ("col",)
    return shard(full, mesh, Sharding((rows, ("row",)), tuple(full.shape))).clone().requires_grad_()


def _unblock(local, mesh, rows_over_depth):
    from optimus2d.comm import Sharding, unshard

    rows = ("depth", "col") if rows_over_depth else ("col",)
    full_shape = (local.shape[0] * (mesh.depth * mesh.q if rows_over_depth else mesh.q), local.shape[1] * mesh.q)
    return unshard(local.detach().contiguous(), mesh, Sharding((rows, ("row",)), full_shape))


@pytest.mark.parametrize("form", ["ab", "abt", "atb", "stationary_ab", "stationary_abt"])
def test_summa_forms_match_matmul(mesh, form):
    """C = A·B, A·Bᵀ, Aᵀ·B (SUMMA; and A·B, A·Bᵀ weight-stationary) and their gradients against
    torch.matmul in fp64. The stationary forms take the same blocks as SUMMA's."""
    fn = {"ab": summa_ab, "abt": summa_abt, "atb": summa_atb, "stationary_ab": stationary_ab}
    fn["stationary_abt"] = stationary_abt
    fn = fn[form]
    form = form.removeprefix("stationary_")
    q, d = mesh.q, mesh.depth
    m, k, n = 2 * d * q, 3 * q, 4 * q
    torch.manual_seed(5)
    a_shape, b_shape = {"ab": ((m, k), (k, n)), "abt": ((m, k), (n, k)), "atb": ((m, k), (m, n))}[form]
    a, b = torch.randn(a_shape, dtype=torch.float64), torch.randn(b_shape, dtype=torch.float64)
    a_ref, b_ref = a.clone().requires_grad_(), b.clone().requires_grad_()
    c_ref = {"ab": lambda: a_ref @ b_ref, "abt": lambda: a_ref @ b_ref.t(), "atb": lambda: a_ref.t() @ b_ref}[form]()
    torch.manual_seed(6)
    probe = torch.randn_like(c_ref)
    (c_ref * probe).sum().backward()

    a_loc = _block(a, mesh, True)
    b_loc = _block(b, mesh, form == "atb")
    c_loc = fn(a_loc, b_loc, mesh)
    c_over_depth = form != "atb"
    (c_loc * _block(probe, mesh, c_over_depth).detach()).sum().backward()
    c = _unblock(c_loc, mesh, c_over_depth)
    grad_a = _unblock(a_loc.grad, mesh, True)
    grad_b = _unblock(b_loc.grad, mesh, form == "atb")
    if form == "atb":  # C is replicated over depth: each slice's probe is the whole probe
        grad_a, grad_b = grad_a / d, grad_b / d
    assert_close(c, c_ref, 1e-12, "C")
    assert_close(grad_a, a_ref.grad, 1e-12, "dA")
    assert_close(grad_b, b_ref.grad, 1e-12, "dB")


def test_serial_state_dict_round_trip(mesh):
    torch.manual_seed(0)
    serial = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6, bias=False))
    parallel = torch.nn.Sequential(Linear2D(6, 12, mesh=mesh), torch.nn.ReLU(), Linear2D(12, 6, bias=False, mesh=mesh))
    from optimus2d import load_serial_state_dict

    load_serial_state_dict(parallel, serial.state_dict())
    state = serial_state_dict(parallel)
    assert list(state) == list(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert torch.equal(state[key], value), key
    before = [p.clone() for p in parallel.parameters()]
    bad = dict(serial.state_dict(), **{"2.weight": torch.zeros(6, 13)})
    with pytest.raises(ValueError, match=r"2.weight has shape \(6, 13\), the serial model's is \(6, 12\)"):
        load_serial_state_dict(parallel, bad)
    with pytest.raises(ValueError, match=r"missing keys \['0.bias'\]"):
        load_serial_state_dict(parallel, {k: v for k, v in serial.state_dict().items() if k != "0.bias"})
    assert all(torch.equal(p, b) for p, b in zip(parallel.parameters(), before, strict=True))


def test_mesh_with_permuted_ranks(world, mesh_shape):
    q, d = mesh_shape
    mesh = Mesh(q, d, ranks=list(reversed(range(world.size))))  # rank p-1 at (0, 0, 0)
    assert mesh.rank_at(0, 0, 0) == world.size - 1
    torch.manual_seed(0)
    serial = torch.nn.Linear(6 * q, 4 * q)
    layer = Linear2D.from_serial(serial, mesh)
    x = torch.randn(2 * d * q, 3, 6 * q)
    y = gather(layer(scatter(x, mesh)), mesh)
    assert_close(y, serial(x), what="output on a permuted mesh")


def test_reduce_grad_does_not_alias_a_sibling_gradient(mesh):
    """y = h + p with p replicated: p's all-reduced gradient must not leak into h's branch."""
    from optimus2d.comm import reduce_grad

    h = torch.ones(3, 4, requires_grad=True)
    p = torch.zeros(3, 4, requires_grad=True)
    (h + reduce_grad(p, mesh, ("row", "col", "depth"))).sum().backward()
    assert torch.equal(h.grad, torch.ones(3, 4))
    assert torch.equal(p.grad, torch.full((3, 4), float(mesh.size)))
