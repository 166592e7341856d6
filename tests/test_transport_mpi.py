"""The MPI transport (``comm/mpi.py``): taken under mpiexec, the same numbers as torch.distributed's,
and a lost peer is a TimeoutError."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close
from torch import nn

from optimus2d import Mesh, gather, scatter
from optimus2d.comm import mpi
from optimus2d.comm import primitives as P
from optimus2d.layers import MLP2D

pytestmark = pytest.mark.mpi

_meshes: dict = {}


def _over(mesh: Mesh, transport: str) -> Mesh:
    """The same mesh shape carried by ``transport`` (built collectively, once)."""
    key = (mesh.q, mesh.depth, transport)
    if key not in _meshes:
        _meshes[key] = Mesh(mesh.q, mesh.depth, transport=transport)
    return _meshes[key]


def test_the_transport_is_what_was_asked_and_the_same_on_every_rank(mesh):
    told = os.environ.get("OPTIMUS2D_TRANSPORT", "auto")
    assert mesh.transport == ("mpi" if mesh.size > 1 and told != "torch" else "torch")  # mpiexec launched us
    transports = [None] * dist.get_world_size()
    dist.all_gather_object(transports, mesh.transport)
    assert set(transports) == {mesh.transport}
    assert _over(mesh, "torch").transport == "torch" and _over(mesh, "torch").mpi is None
    assert _over(mesh, "mpi").transport == ("mpi" if mesh.size > 1 else "torch")
    with pytest.raises(ValueError, match="transport 'tcp' is not one of"):
        Mesh(mesh.q, mesh.depth, transport="tcp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("algorithm", ["summa", "stationary"])
def test_both_transports_give_the_same_mlp(mesh, algorithm, dtype):
    """bf16 has no MPI datatype: its reductions go through torch, the rest through MPI."""
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 12)).to(dtype)
    x = torch.randn(2 * mesh.depth * mesh.q, 5, 12, dtype=dtype)
    results = []
    for m in (_over(mesh, "mpi"), _over(mesh, "torch")):
        mlp = MLP2D.from_serial(serial, m)
        mlp.fc1.algorithm = mlp.fc2.algorithm = algorithm
        x_local = scatter(x, m).clone().requires_grad_()
        y = mlp(x_local)
        (y * torch.arange(y.numel()).view_as(y).to(dtype)).sum().backward()
        grads = {name: p.grad for name, p in mlp.named_parameters()}
        results.append((gather(y.detach(), m), gather(x_local.grad, m), grads))
    (y, dx, grads), (y_t, dx_t, grads_t) = results
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert_close(y, y_t, tol, "output")
    assert_close(dx, dx_t, tol, "input grad")
    for name in grads:
        assert_close(grads[name], grads_t[name], tol, f"{name} grad")


@pytest.mark.parametrize("axis", ["row", "col", "depth", "mesh"])
def test_broadcast_and_reduce_over_every_axis(mesh, axis):
    """Groups of up to ``mpi.DIRECT_MEMBERS`` send message by message, larger ones through MPI's
    own collectives (the "mesh" axis of 4, 8 and 9 ranks): the same values, from every root."""
    mesh = _over(mesh, "mpi")
    size, me = mesh.axis_size(axis), mesh.index(axis)
    for root in range(size):
        t = torch.full((2, 3), float(me + 1)).t()  # non-contiguous: through a copy and back
        P.broadcast(t, mesh, axis, root)
        assert torch.equal(t, torch.full((3, 2), float(root + 1)))
        t = torch.full((5,), float(me + 1))
        P.reduce(t, mesh, axis, root, async_op=True).wait()
        if me == root:
            assert torch.equal(t, torch.full((5,), size * (size + 1) / 2))
        if size > 1:  # MAX, which the transport's reduce also takes
            t = torch.full((5,), float((me * 7) % size))
            request = mesh.mpi.reduce(t, axis, root, dist.ReduceOp.MAX)
            assert request._point_to_point == (size <= mpi.DIRECT_MEMBERS)  # message by message, or MPI's
            request.wait()
            if me == root:
                assert torch.equal(t, torch.full((5,), float(size - 1)))


@pytest.mark.parametrize("axis", ["row", "mesh"])
def test_broadcasts_and_reduces_in_flight_together_match_in_order(mesh, axis):
    """Several broadcasts from one root and reduces to it in flight at once (as SUMMA's steps issue
    them), waited in reverse order: each receives its own message (MPI keeps the order of messages
    with one sender and tag), in a direct group and in one of MPI's collectives."""
    mesh = _over(mesh, "mpi")
    size, me = mesh.axis_size(axis), mesh.index(axis)
    root = size - 1
    sent = [torch.full((n,), float(10 * n + me)) for n in (3, 5, 7)]
    reduced = [torch.full((4, 2), float(n * (me + 1))).t() for n in (1, 2)]  # non-contiguous
    handles = [P.broadcast(t, mesh, axis, root, async_op=True) for t in sent]
    handles += [P.reduce(t, mesh, axis, root, async_op=True) for t in reduced]
    for handle in reversed(handles):
        handle.wait()
    for n, t in zip((3, 5, 7), sent, strict=True):
        assert torch.equal(t, torch.full((n,), float(10 * n + root)))
    if me == root:
        for n, t in zip((1, 2), reduced, strict=True):
            assert torch.equal(t, torch.full((2, 4), float(n * size * (size + 1) / 2)))


def test_the_transports_reduce_refuses_an_op_it_cannot_make_before_sending(mesh):
    """MIN: a ValueError naming the op on every rank, direct group or MPI's, and nothing in flight
    (the next collective still pairs up)."""
    mesh = _over(mesh, "mpi")
    if mesh.mpi is None:
        pytest.skip("a 1-rank mesh has no MPI transport")
    for axis in ("row", "mesh"):
        if mesh.axis_size(axis) > 1:
            with pytest.raises(ValueError, match="SUM or MAX, not"):
                mesh.mpi.reduce(torch.ones(3), axis, 0, dist.ReduceOp.MIN)
    t = torch.ones(3)
    P.all_reduce(t, mesh, "mesh")
    assert torch.equal(t, torch.full((3,), float(mesh.size)))


def test_what_mpi_cannot_reduce_goes_through_torch(mesh):
    """MIN has no place in the MPI path and bf16 no MPI datatype: both still reduce, on every rank alike."""
    mpi_mesh = _over(mesh, "mpi")
    n = mpi_mesh.index("mesh") if mpi_mesh.size > 1 else 0
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.full((3,), float(n + 1), dtype=dtype)
        P.all_reduce(t, mpi_mesh, "mesh", op=dist.ReduceOp.MIN)
        assert torch.equal(t, torch.ones(3, dtype=dtype))
        P.all_reduce(t, mpi_mesh, "mesh")
        assert torch.equal(t, torch.full((3,), float(mpi_mesh.size), dtype=dtype))


def test_a_lost_peer_is_a_timeout_not_a_hang(mesh):
    mesh = Mesh(mesh.q, mesh.depth, transport="mpi")  # its own: a timeout is fatal to the mesh
    if mesh.mpi is None:
        pytest.skip("a 1-rank mesh sends nothing")
    timeout, mesh.mpi.timeout = mesh.mpi.timeout, 0.3
    try:
        if mesh.index("mesh") == 0:  # waits for a message that member 1 never sends
            with pytest.raises(TimeoutError, match=r"MPI receive over mesh on Mesh\(.*\) did not complete within 0\.3"):
                P.irecv(torch.empty(4), mesh, "mesh", 1, tag=77).wait()
    finally:
        mesh.mpi.timeout = timeout
    dist.barrier()


def test_a_shorter_message_than_its_receive_is_an_error(mesh):
    """MPI completes a receive whose message is shorter than its buffer: the rest of the buffer kept
    what it held (a ring step of another batch: a wrong output, no error). Now the receiver raises."""
    mesh = Mesh(mesh.q, mesh.depth, transport="mpi")  # its own: the error is reported to its mesh
    if mesh.mpi is None:
        pytest.skip("a 1-rank mesh sends nothing")
    if mesh.index("mesh") == 1:
        P.isend(torch.ones(2), mesh, "mesh", 0, tag=78).wait()
    if mesh.index("mesh") == 0:
        with pytest.raises(RuntimeError, match=r"MPI receive over mesh on Mesh\(.*received \[8\] bytes where \[16\]"):
            P.irecv(torch.empty(4), mesh, "mesh", 1, tag=78).wait()
    dist.barrier()


def test_only_point_to_point_waits_may_back_off(mesh, monkeypatch):
    """On shared cores a wait backs off (``watch``), but not an MPI collective's: its schedule
    advances only while it is tested. Broadcasts in groups of up to 3 are the root's sends."""
    from optimus2d.comm import watch

    mesh = _over(mesh, "mpi")
    if mesh.mpi is None:
        pytest.skip("a 1-rank mesh has no MPI transport")
    asked = []
    real = watch.wait
    monkeypatch.setattr(watch, "wait", lambda *a, backoff=True, **k: asked.append((a[2], backoff)) or real(*a, **k))
    mesh.mpi.all_reduce(torch.ones(3), "mesh", dist.ReduceOp.SUM).wait()
    axis = "row" if mesh.axis_size("row") > 1 else "mesh"
    mesh.mpi.broadcast(torch.ones(3), axis, 0).wait()
    direct = mesh.axis_size(axis) <= mpi.DIRECT_MEMBERS
    assert asked == [("MPI all-reduce over mesh", False), (f"MPI broadcast over {axis}", direct)], asked
