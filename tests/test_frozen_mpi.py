"""Frozen modules at no cost: no weight gradient computed or sent, no activation kept that only a
weight gradient reads, nothing kept at all under an input that needs no gradient; measured with
``count_comm``, saved-tensor hooks and a counting hook on the weight-gradient kernels."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import _meshes, mesh_shapes
from torch import nn

import optimus2d.comm.stationary as stationary
import optimus2d.comm.summa as summa
from optimus2d import Mesh, count_comm, parallelize, scatter
from optimus2d.comm.dtensor import local
from optimus2d.layers import Linear2D

pytestmark = pytest.mark.mpi


class Saved:
    """Bytes of tensors autograd keeps for backward, parameters apart (a view of one costs nothing)."""

    def __init__(self, module: nn.Module) -> None:
        self.params = {local(p).untyped_storage().data_ptr() for p in module.parameters()}
        self.activation_bytes = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.params:
            self.activation_bytes += t.numel() * t.element_size()
        return t

    def __enter__(self) -> Saved:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)


class WeightGradKernels:
    """Counts calls of SUMMA's and the stationary algorithm's weight-gradient kernels."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        for module, name in [(summa, "_weight_grad_product"), (stationary._WeightGrad, "__init__")]:
            original = getattr(module, name)

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)


def _layer(mesh: Mesh, frozen: bool) -> nn.Module:
    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(24, 6, 48, dropout=0.0, batch_first=True).double()
    serial.requires_grad_(not frozen)
    return parallelize(serial, mesh)


def _x(mesh: Mesh, grad: bool) -> torch.Tensor:
    torch.manual_seed(1)
    x = scatter(torch.randn(2 * mesh.depth * mesh.q, 5, 24, dtype=torch.float64), mesh)
    return x.detach().requires_grad_(grad)


@pytest.mark.parametrize("rows", [4, 64])  # few rows: the stationary algorithm; many: SUMMA
def test_frozen_linear_keeps_no_activation(mesh, rows):
    torch.manual_seed(0)
    linear = Linear2D.from_serial(nn.Linear(24, 36).double(), mesh)
    x = scatter(torch.randn(rows * mesh.depth * mesh.q, 24, dtype=torch.float64), mesh).detach()
    kept = {}
    for frozen in (False, True):
        linear.requires_grad_(not frozen)
        with Saved(linear) as saved:
            y = linear(x.clone().requires_grad_())
        kept[frozen] = saved.activation_bytes
        y.sum().backward()
    assert kept[True] == 0 and kept[False] >= x.numel() * 8, kept


def test_frozen_prefix_keeps_nothing(mesh, monkeypatch):
    """A frozen module whose input needs no gradient records no graph: nothing kept, no backward."""
    layer = _layer(mesh, frozen=True)
    with Saved(layer) as saved:
        y = layer(_x(mesh, grad=False))
    assert y.grad_fn is None and saved.activation_bytes == 0


def test_frozen_layer_sends_no_weight_gradient(mesh, monkeypatch):
    """With a trainable input, the frozen layer's backward is the input gradient alone: no weight-
    gradient kernel runs, and on a q = 1 mesh (or one rank) backward sends nothing at all; the
    input gradient is serial's."""
    sent, kernels = {}, WeightGradKernels(monkeypatch)
    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(24, 6, 48, dropout=0.0, batch_first=True).double()
    torch.manual_seed(1)
    full = torch.randn(2 * mesh.depth * mesh.q, 5, 24, dtype=torch.float64, requires_grad=True)
    (serial(full) ** 2).sum().backward()
    for frozen in (False, True):
        layer = _layer(mesh, frozen)
        x = _x(mesh, grad=True)
        y = layer(x)
        kernels.calls = 0
        with count_comm() as c:
            (y * y).sum().backward()
        sent[frozen] = c.by("kind", "axis")
        want = scatter(full.grad, mesh)
        assert (x.grad - want).abs().max() <= 1e-9 * want.abs().max(), "input gradient"
        if frozen:
            assert kernels.calls == 0 and all(p.grad is None for p in layer.parameters())
        elif mesh.size > 1:
            assert kernels.calls > 0
    assert ("all_reduce", "depth") not in sent[True], sent[True]
    if mesh.q == 1:
        assert sum(sent[True].values()) == 0, sent[True]
    assert sum(sent[True].values()) < sum(sent[False].values()) or mesh.size == 1


def test_frozen_encoder_on_its_own_mesh_sends_nothing_back(world):
    """A frozen encoder on 1×1×p under a trainable model on the widest mesh: the encoder's backward
    sends 0 bytes (its input needs no gradient: it has no backward), and the model is exact."""
    from test_layouts_mpi import _input, _serial

    shapes = mesh_shapes(world.size)
    for shape in shapes:
        if shape not in _meshes:
            _meshes[shape] = Mesh(*shape)
    model_mesh, encoder_mesh = _meshes[shapes[-1]], _meshes[shapes[0]]
    serial = _serial(frozen=True)
    parallel = parallelize(copy.deepcopy(serial), model_mesh, plan={"encoder": encoder_mesh})
    x = scatter(_input(world), model_mesh)
    with Saved(parallel.encoder) as saved:
        features = parallel.encoder(x)
    assert features.grad_fn is None and saved.activation_bytes == 0
    y = parallel(x)  # the whole model, the encoder and its boundary included
    with count_comm() as whole:
        y.sum().backward()
    y = parallel.lm(parallel.proj(parallel.encoder(x).detach()))  # the trained part alone
    with count_comm() as trained:
        y.sum().backward()
    assert whole.by("kind", "axis") == trained.by("kind", "axis")  # the encoder's backward: 0 bytes
