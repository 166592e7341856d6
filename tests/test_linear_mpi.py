"""Linear2D against torch.nn.Linear on every mesh shape of the world (1, 4, 8, 9 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_state_close, step_both
from torch import nn

import optimus2d
from optimus2d import count_comm, gather, scatter, serial_state_dict
from optimus2d.cost import linear_2d_elements
from optimus2d.layers import Linear2D, TransposedLinear2D, linear_2d

pytestmark = pytest.mark.mpi

SEQ = 5  # odd, so no size is a power of two by accident


def _data(mesh, features, dtype=torch.float32, seed=1):
    torch.manual_seed(seed)  # the same full tensor on every rank
    return torch.randn(2 * mesh.depth * mesh.q, SEQ, features, dtype=dtype)


ALGORITHMS = pytest.mark.parametrize("algorithm", ["summa", "stationary"])


@ALGORITHMS
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("features", [(12, 30), (30, 12), (18, 18)], ids=["up", "down", "square"])
def test_linear_matches_torch(mesh, features, bias, algorithm):
    torch.manual_seed(0)
    serial = nn.Linear(*features, bias=bias)
    parallel = Linear2D.from_serial(serial, mesh)
    parallel.algorithm = algorithm
    assert parallel.summa == ("ab" if features[0] <= features[1] else "abt")
    y, y_ref, dx, dx_ref = step_both(serial, parallel, _data(mesh, features[0]), mesh)
    new_state = serial_state_dict(parallel)
    assert_close(y, y_ref, what="output")
    assert_close(dx, dx_ref, what="input grad")
    assert_state_close(new_state, serial.state_dict())


def test_reset_parameters_matches_nn_linear_init(mesh):
    torch.manual_seed(3)
    serial = nn.Linear(12, 18)
    torch.manual_seed(3)
    parallel = Linear2D(12, 18, mesh=mesh)
    state = serial_state_dict(parallel)
    assert torch.equal(state["weight"], serial.weight) and torch.equal(state["bias"], serial.bias)


def test_mlp_stack_matches_torch(mesh):
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 12))
    parallel = nn.Sequential(Linear2D.from_serial(serial[0], mesh), nn.GELU(), Linear2D.from_serial(serial[2], mesh))
    y, y_ref, dx, dx_ref = step_both(serial, parallel, _data(mesh, 12), mesh)
    new_state = serial_state_dict(parallel)
    assert_close(y, y_ref, what="output")
    assert_close(dx, dx_ref, what="input grad")
    assert_state_close(new_state, serial.state_dict())


def test_one_rank_mesh_is_bitwise_torch(mesh):
    if mesh.size != 1:
        pytest.skip("bitwise equality holds on a 1-rank mesh")
    torch.manual_seed(0)
    serial = nn.Linear(12, 30)
    parallel = Linear2D.from_serial(serial, mesh)
    x = _data(mesh, 12)
    with count_comm() as counter:
        y = parallel(scatter(x, mesh))
        y.sum().backward()
    assert counter.count() == 0
    assert torch.equal(y, serial(x))


@ALGORITHMS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_within_tolerance(mesh, dtype, algorithm):
    torch.manual_seed(0)
    serial = nn.Linear(24, 36)
    parallel = Linear2D.from_serial(serial, mesh).to(dtype)
    parallel.algorithm = algorithm
    x = _data(mesh, 24)
    y_ref = serial(x)  # fp32 reference
    x_low = x.to(dtype).requires_grad_()
    y = parallel(scatter(x_low, mesh))
    assert y.dtype == dtype and parallel.weight.dtype == dtype
    y.float().sum().backward()
    y_full = gather(y.detach(), mesh)
    x_ref = x.clone().requires_grad_()
    serial(x_ref).sum().backward()
    assert_close(y_full.float(), y_ref, tol=2e-2, what=f"{dtype} output")
    assert_close(x_low.grad.float(), x_ref.grad, tol=2e-2, what=f"{dtype} input grad")


def test_autocast_matches_torch_autocast(mesh):
    torch.manual_seed(0)
    serial = nn.Linear(24, 12)
    parallel = Linear2D.from_serial(serial, mesh)
    x = _data(mesh, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = parallel(scatter(x, mesh))
        y_ref = serial(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    y.float().sum().backward()
    y_full = gather(y.detach(), mesh)
    serial(x).sum().backward()
    assert parallel.weight.grad.dtype == torch.float32
    assert_close(y_full.float(), y_ref.float(), tol=2e-2, what="autocast output")
    grad = serial_state_dict_grad(parallel)
    assert_close(grad, serial.weight.grad, tol=2e-2, what="autocast weight grad")


def serial_state_dict_grad(layer: Linear2D) -> torch.Tensor:
    return optimus2d.comm.unshard(layer.weight.grad, layer.mesh, layer.shardings["weight"])


def _linear_elements(mesh, rows, fin, fout, **kw):
    return linear_2d_elements(rows, fin, fout, mesh.q, mesh.depth, on_diagonal=mesh.i == mesh.j, **kw)


@pytest.mark.parametrize("algorithm", ["auto", "summa", "stationary"])
@pytest.mark.parametrize("batch", [2, 12], ids=["small", "large"])  # "auto" picks stationary, then SUMMA
@pytest.mark.parametrize("features", [(12, 30), (30, 12)], ids=["up", "down"])
def test_comm_volume_meets_formula(mesh, features, batch, algorithm):
    fin, fout = features
    torch.manual_seed(0)
    layer = Linear2D(fin, fout, mesh=mesh, algorithm=algorithm)
    x = torch.randn(batch * mesh.depth * mesh.q, SEQ, fin)
    x = scatter(x, mesh).requires_grad_()
    with count_comm() as counter:
        layer(x).sum().backward()
    rows = x.shape[0] * x.shape[1] * mesh.depth * mesh.q
    assert counter.numel == _linear_elements(mesh, rows, fin, fout, algorithm=algorithm)
    if algorithm == "auto":  # the cheaper of the two, so within the foundation issue's bound, per rank:
        # (2·B·in + B·max(in,out) + 3·in·out)/q + bias
        bound = (2 * rows * fin + rows * max(fin, fout) + 3 * fin * fout) / mesh.q + 2 * fout
        assert counter.numel <= bound
        both = [_linear_elements(mesh, rows, fin, fout, algorithm=a) for a in ("summa", "stationary")]
        assert counter.numel == min(both) or mesh.i == mesh.j  # the diagonal's exchanges are free
    if mesh.size == 1:
        assert counter.count() == 0


@pytest.mark.parametrize("batch", [2, 12], ids=["small", "large"])
@pytest.mark.parametrize("case", ["input without grad", "no_grad"])
def test_auto_prices_only_the_gradients_backward_will_make(mesh, batch, case):
    """ "auto" counts what this call moves: no dX for an input without grad, no backward under no_grad."""
    fin, fout = 12, 30
    torch.manual_seed(0)
    layer = Linear2D(fin, fout, mesh=mesh)
    x = scatter(torch.randn(batch * mesh.depth * mesh.q, SEQ, fin), mesh)
    needs = {"dx": False} if case == "input without grad" else {"dx": False, "dw": False}
    with count_comm() as counter:
        if case == "no_grad":
            with torch.no_grad():
                layer(x)
        else:
            layer(x).sum().backward()
    rows = x.shape[0] * x.shape[1] * mesh.depth * mesh.q
    assert counter.numel == _linear_elements(mesh, rows, fin, fout, algorithm="auto", **needs)
    both = [_linear_elements(mesh, rows, fin, fout, algorithm=a, **needs) for a in ("summa", "stationary")]
    assert counter.numel == min(both) or mesh.i == mesh.j  # the diagonal's exchanges are free


@ALGORITHMS
def test_frozen_weight_sends_no_weight_gradient(mesh, algorithm):
    torch.manual_seed(0)
    layer = Linear2D(12, 30, mesh=mesh, algorithm=algorithm)
    layer.requires_grad_(False)
    x = scatter(_data(mesh, 12), mesh).requires_grad_()
    with count_comm() as counter:
        layer(x).sum().backward()
    rows = x.shape[0] * x.shape[1] * mesh.depth * mesh.q
    assert layer.weight.grad is None and x.grad is not None
    assert counter.numel == _linear_elements(mesh, rows, 12, 30, dw=False, algorithm=algorithm)


@ALGORITHMS
@pytest.mark.parametrize("features", [(12, 30), (30, 12)], ids=["up", "down"])
def test_input_without_grad_gets_none_computed(mesh, features, algorithm):
    torch.manual_seed(0)
    layer = Linear2D(*features, mesh=mesh, algorithm=algorithm)
    x = scatter(_data(mesh, features[0]), mesh)
    with count_comm() as counter:
        layer(x).sum().backward()
    rows = x.shape[0] * x.shape[1] * mesh.depth * mesh.q
    assert layer.weight.grad is not None
    assert counter.numel == _linear_elements(mesh, rows, *features, dx=False, algorithm=algorithm)


@ALGORITHMS
@pytest.mark.parametrize("input_grad", [True, False], ids=["dx", "no-dx"])
@pytest.mark.parametrize("features", [(12, 30), (30, 12)], ids=["up", "down"])
def test_weight_grad_arrives_in_the_weights_layout(mesh, features, input_grad, algorithm):
    """dW reaches ``weight`` contiguous in its [out, in] layout, so autograd accumulates it with a
    plain add (a transposed dW costs a strided copy: 2.4 ms a step in the issue's MLP)."""
    torch.manual_seed(0)
    layer = Linear2D(*features, mesh=mesh, algorithm=algorithm)
    layouts = []
    layer.weight.register_hook(lambda g: layouts.append((g.is_contiguous(), g.stride())))
    x = scatter(_data(mesh, features[0]), mesh).requires_grad_(input_grad)
    layer(x).sum().backward()
    assert layouts == [(True, layer.weight.stride())]


@ALGORITHMS
@pytest.mark.parametrize("input_grad", [True, False], ids=["dx", "no-dx"])
@pytest.mark.parametrize("features", [(12, 30), (30, 12)], ids=["up", "down"])
def test_transposed_weight_grad_arrives_in_its_layout(mesh, features, input_grad, algorithm):
    """The same for a weight stored [in, out] (``TransposedLinear2D``, GPT-2's Conv1D), which
    reaches the products as ``weight.t()``: its gradient is made in the [in, out] layout."""
    torch.manual_seed(0)
    layer = TransposedLinear2D(*features, mesh=mesh)
    layouts = []
    layer.weight.register_hook(lambda g: layouts.append((g.is_contiguous(), g.stride())))
    x = scatter(_data(mesh, features[0]), mesh).requires_grad_(input_grad)
    linear_2d(x, layer.weight.t(), layer.bias, mesh, layer.summa, algorithm).sum().backward()
    assert layouts == [(True, layer.weight.stride())]


def test_functional_linear_identity(mesh):
    """F.linear on the gathered weight equals the layer: the serial view is the weight used."""
    torch.manual_seed(0)
    layer = Linear2D(18, 12, mesh=mesh)
    x = _data(mesh, 18)
    y = gather(layer(scatter(x, mesh)), mesh)
    state = serial_state_dict(layer)
    assert_close(y, F.linear(x, state["weight"], state["bias"]), what="output")
