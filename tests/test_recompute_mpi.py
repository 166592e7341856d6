"""An activation recomputed inside the products (Linear2D's ``input_activation``, MLP2D's default):
the same numbers as torch, only the pre-activation kept for backward, on every mesh."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_state_close, step_both
from torch import nn

from optimus2d import count_comm, scatter, serial_state_dict
from optimus2d.cost.memory import saved_activation_bytes
from optimus2d.layers import MLP2D, Linear2D

pytestmark = pytest.mark.mpi

SEQ = 5
ALGORITHMS = pytest.mark.parametrize("algorithm", ["summa", "stationary"])
FEATURES = pytest.mark.parametrize("features", [(12, 30), (30, 12)], ids=["ab", "abt"])


class ActivatedLinear(nn.Module):
    """``linear(activation(x))`` through ``input_activation``."""

    def __init__(self, linear: Linear2D, activation) -> None:
        super().__init__()
        self.linear, self.activation = linear, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, input_activation=self.activation)


def _data(mesh, features: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2 * mesh.depth * mesh.q, SEQ, features)


@ALGORITHMS
@FEATURES
def test_input_activation_matches_torch(mesh, features, algorithm):
    torch.manual_seed(0)
    serial = nn.Sequential(nn.GELU(), nn.Linear(*features))
    linear = Linear2D.from_serial(serial[1], mesh)
    linear.algorithm = algorithm
    y, y_ref, dx, dx_ref = step_both(serial, ActivatedLinear(linear, F.gelu), _data(mesh, features[0]), mesh)
    assert_close(y, y_ref, what="output")
    assert_close(dx, dx_ref, what="input grad")
    assert_state_close(serial_state_dict(linear), serial[1].state_dict())


@ALGORITHMS
@FEATURES
def test_input_activation_keeps_only_the_input(mesh, features, algorithm):
    torch.manual_seed(0)
    linear = Linear2D(*features, mesh=mesh, algorithm=algorithm)
    x = scatter(_data(mesh, features[0]), mesh).clone().requires_grad_()  # its own storage
    kept = saved_activation_bytes(ActivatedLinear(linear, F.gelu), x)
    assert kept == x.numel() * x.element_size()  # not gelu(x) as well
    both = saved_activation_bytes(nn.Sequential(nn.GELU(), linear), x)
    assert both == 2 * kept


@ALGORITHMS
def test_mlp_recompute_is_bitwise_the_same_and_keeps_the_ffn_tensor_once(mesh, algorithm):
    hidden, ffn = 12, 48
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    results = {}
    for recompute in (True, False):
        mlp = MLP2D.from_serial(serial, mesh, recompute_activation=recompute)
        mlp.fc1.algorithm = mlp.fc2.algorithm = algorithm
        x = scatter(_data(mesh, hidden), mesh).clone().requires_grad_()  # its own storage
        kept = saved_activation_bytes(mlp, x)
        with count_comm() as counter:
            y = mlp(x)
            (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        grads = [p.grad for p in mlp.parameters()]
        results[recompute] = (y.detach(), x.grad, grads, kept, counter.numel)
    y, dx, grads, kept, sent = results[True]
    y_off, dx_off, grads_off, kept_off, sent_off = results[False]
    assert torch.equal(y, y_off) and torch.equal(dx, dx_off)
    assert all(torch.equal(g, g_off) for g, g_off in zip(grads, grads_off, strict=True))
    assert sent == sent_off
    rows = x.numel() // (hidden // mesh.q)
    assert kept == 4 * rows * (hidden + ffn) // mesh.q  # x's block and fc1's output block
    assert kept_off == 4 * rows * (hidden + 2 * ffn) // mesh.q  # and the activation's output


def test_random_activation_is_not_recomputed(mesh):
    """RReLU draws its slopes in training: recomputing it would not give the forward's values."""
    torch.manual_seed(0)
    mlp = MLP2D(12, 48, activation=nn.RReLU(), mesh=mesh)
    x = scatter(_data(mesh, 12), mesh).clone().requires_grad_()  # its own storage
    rows = x.numel() // (12 // mesh.q)
    assert saved_activation_bytes(mlp, x) >= 4 * rows * (12 + 2 * 48) // mesh.q


def test_an_in_place_activation_runs_as_torch(mesh):
    """nn.ReLU(inplace=True) rewrites fc1's output, so it is not recomputed from it."""
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(12, 48), nn.ReLU(inplace=True), nn.Linear(48, 12))
    parallel = MLP2D.from_serial(serial, mesh)
    y, y_ref, dx, dx_ref = step_both(serial, parallel, _data(mesh, 12), mesh)
    state = serial_state_dict(parallel)
    assert_close(y, y_ref, what="output")
    assert_close(dx, dx_ref, what="input grad")
    for ours, theirs in (("fc1", 0), ("fc2", 2)):
        for name in ("weight", "bias"):
            assert_close(state[f"{ours}.{name}"], getattr(serial[theirs], name), what=f"{ours}.{name}")


def test_an_activation_with_parameters_is_refused(mesh):
    serial = nn.Sequential(nn.Linear(12, 48), nn.PReLU(), nn.Linear(48, 12))
    with pytest.raises(TypeError, match="activation PReLU has parameters"):
        MLP2D.from_serial(serial, mesh)
    with pytest.raises(TypeError, match="activation PReLU has parameters"):
        MLP2D(12, 48, activation=nn.PReLU(), mesh=mesh)
