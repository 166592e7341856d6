"""No process group at all: a 1-rank mesh is plain torch; validation and accounting helpers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from optimus2d import Mesh, count_comm, gather, scatter, serial_state_dict
from optimus2d.comm import Sharding, shard, unshard
from optimus2d.layers import Linear2D


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not dist.is_initialized(), "serial tests run without torch.distributed"


def test_one_rank_mesh_needs_no_process_group():
    mesh = Mesh(1)
    assert mesh.coord == (0, 0, 0) and mesh.size == 1
    assert all(mesh.group(a) is None for a in ("row", "col", "depth", "mesh"))
    with pytest.raises(RuntimeError, match=r"Mesh\(q=2, depth=1\) needs torch.distributed: call optimus2d.init"):
        Mesh(2, ranks=range(4))


def test_world_size_error_lists_what_fits():
    from optimus2d.comm.mesh import _fitting_shapes

    assert (
        _fitting_shapes(36)
        == "36 ranks fit Mesh(q=1, depth=36), Mesh(q=2, depth=9), Mesh(q=3, depth=4), Mesh(q=6, depth=1)"
    )


def test_linear_on_one_rank_is_bitwise_nn_linear():
    mesh = Mesh(1)
    torch.manual_seed(0)
    serial = nn.Linear(7, 5)
    torch.manual_seed(0)
    layer = Linear2D(7, 5, mesh=mesh)
    x = torch.randn(3, 4, 7, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with count_comm() as counter:
        y = layer(scatter(x, mesh))
        y.square().sum().backward()
    serial(x2).square().sum().backward()
    assert counter.count() == 0
    assert torch.equal(y, serial(x2))
    assert torch.equal(x.grad, x2.grad) and torch.equal(layer.weight.grad, serial.weight.grad)
    assert torch.equal(gather(y, mesh), y)
    assert list(serial_state_dict(layer)) == ["weight", "bias"]


def test_from_serial_keeps_frozen_flags_and_refuses_other_types():
    mesh = Mesh(1)
    serial = nn.Linear(4, 4)
    serial.weight.requires_grad_(False)
    layer = Linear2D.from_serial(serial, mesh)
    assert not layer.weight.requires_grad and layer.bias.requires_grad
    with pytest.raises(TypeError, match=r"expects nn\.Linear, got Conv1d"):
        Linear2D.from_serial(nn.Conv1d(4, 4, 1), mesh)
    assert "summa=ab" in repr(layer) and "local=[4, 4]" in repr(layer)


def test_sharding_replicated_axes_and_shape_checks():
    mesh = Mesh(1)
    s = Sharding((("row",), ("col",)), (4, 6))
    assert s.local_shape(mesh) == (4, 6) and s.replicated_axes(mesh) == ()
    with pytest.raises(ValueError, match=r"shape \(4, 5\) does not match"):
        shard(torch.zeros(4, 5), mesh, s)
    with pytest.raises(ValueError, match=r"local block of shape \(3, 6\)"):
        unshard(torch.zeros(3, 6), mesh, s)


def test_counter_records_kind_axis_and_bytes():
    from optimus2d.comm import counter as C

    with count_comm() as outer:
        with count_comm() as inner:
            C.record("broadcast", "row", torch.zeros(3, 4))
        C.record("all_reduce", "depth", torch.zeros(5, dtype=torch.bfloat16))
    assert inner.numel == 12 and inner.bytes == 48
    assert outer.count() == 2 and outer.bytes == 48 + 10
    assert outer.by("kind", "axis") == {("broadcast", "row"): 12, ("all_reduce", "depth"): 5}
    assert "total 2 collectives, 58 bytes" in outer.summary()


class _SquaredReLU(nn.ReLU):  # a subclass computing something else: must not take ReLU's derivative
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) ** 2


@pytest.mark.parametrize(
    ("activation", "frees"),
    [
        (nn.GELU(), True),
        (nn.GELU("tanh"), True),
        (torch.nn.functional.gelu, True),
        (nn.SiLU(), True),
        (nn.ReLU(), True),
        (torch.tanh, False),  # through autograd: its derivative reads its output
        (_SquaredReLU(), False),
    ],
    ids=["gelu", "gelu-tanh", "F.gelu", "silu", "relu", "tanh", "ReLU subclass"],
)
def test_recomputed_activation_gives_autograds_gradient_and_frees_its_value_first(activation, frees):
    import weakref

    from optimus2d.comm.recompute import Recomputed

    torch.manual_seed(0)
    pre = torch.randn(64, 32)
    grad = torch.randn(64, 32)
    leaf = pre.clone().requires_grad_()
    out = activation(leaf)
    out.backward(grad)
    recomputed = Recomputed(pre, activation)
    assert torch.equal(recomputed.value, out.detach())
    storage = weakref.ref(recomputed.value.untyped_storage())
    assert torch.equal(recomputed.grad(grad), leaf.grad)  # bit for bit
    if frees:
        assert storage() is None  # freed before the input gradient was made
    unread = Recomputed(pre, activation)  # no weight gradient wanted: value never made
    assert torch.equal(unread.grad(grad), leaf.grad) and unread._value is None
