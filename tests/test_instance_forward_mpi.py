"""A forward set on one instance: a hub kernel is set aside (the class's forward runs, exact against
serial), any other is refused by path on every rank (``optimus2d/convert/instance_forward.py``)."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
from helpers import check_against_serial
from torch import nn

from optimus2d import parallelize
from optimus2d.convert.instance_forward import replaced_forward, set_aside_hub_kernels

pytestmark = pytest.mark.mpi

E = 12


class NewGELU(nn.Module):
    """A kernelizable activation, as transformers declares one (``@use_kernel_forward_from_hub``
    marks the class with ``kernel_layer_name``)."""

    kernel_layer_name = "NewGELU"

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x.pow(3))))


class RowMeanKernel(nn.Module):
    """A stand-in for a hub kernel that, run on a block of the hidden dim, would give another answer:
    if parallelize kept it, the outputs could not match the class's forward."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x.pow(3)))) + x.mean(-1, keepdim=True)


class _Repository:
    """A kernel repository on this machine: ``kernels`` loads a layer class from what ``load`` returns
    (its ``LayerRepository`` downloads one from the Hub)."""

    def load(self):
        return RowMeanKernel

    def __hash__(self):
        return 0

    def __eq__(self, other):
        return isinstance(other, _Repository)


def _kernelize(model: nn.Module, how: str) -> nn.Module:
    """The model's NewGELUs on the kernel, by ``kernels.kernelize`` itself, or as it does (0.19: the
    layer's forward bound to the instance, the repository noted beside it); the model flagged to
    kernelize again on ``train()`` (a transformers ``PreTrainedModel``'s ``_use_kernels``)."""
    if how == "kernels":
        kernels = pytest.importorskip("kernels")
        with kernels.use_kernel_mapping({"NewGELU": {"cpu": _Repository()}}):
            kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    else:
        for module in model.modules():
            if isinstance(module, NewGELU):
                module.forward = types.MethodType(RowMeanKernel.forward, module)
                module.__dict__["_kernel_repo"] = _Repository()
    model._use_kernels = True
    return model


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(E, 2 * E), NewGELU(), nn.Linear(2 * E, E), NewGELU())


@pytest.mark.parametrize("how", ["kernels", "as kernels does"])
def test_a_hub_kernel_is_set_aside_and_the_class_forward_runs(mesh, how):
    serial = _model()  # the class's forward everywhere: what the model computes
    kernelized = _kernelize(copy.deepcopy(serial), how)
    torch.manual_seed(1)
    x = torch.randn(2 * mesh.depth * mesh.q, 3, E)
    assert not torch.allclose(kernelized(x), serial(x))  # the kernel does run, and differs
    parallel = parallelize(kernelized, mesh)
    assert not any("forward" in m.__dict__ or "_kernel_repo" in m.__dict__ for m in parallel.modules())
    assert parallel._use_kernels is False  # train() does not put it back
    check_against_serial(serial, parallel, x, mesh)


def test_set_aside_names_the_modules_and_keeps_optimus2ds_own():
    model = _kernelize(nn.Sequential(*_model(), NewGELU()), "as kernels does")  # kernels on 1, 3 and 4

    def ours(self, x):
        return x

    ours.__module__ = "optimus2d.context.parallel"  # a forward optimus2d installs (context parallelism)
    model[1].__dict__.pop("_kernel_repo")  # no repository noted: anyone's forward, left (and refused)
    model[3].forward = types.MethodType(ours, model[3])
    assert set_aside_hub_kernels(model) == ["4"]
    assert "forward" not in model[4].__dict__ and "_kernel_repo" not in model[4].__dict__
    assert model[1].forward.__func__ is RowMeanKernel.forward and model[3].forward.__func__ is ours
    assert "a hub kernel? load with use_kernels=False" in replaced_forward(model[1])
    assert replaced_forward(model[3]) is None and replaced_forward(model[4]) is None


def test_a_forward_set_on_an_instance_is_refused_by_path(mesh):
    model = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))
    model[1].forward = lambda x: x.flip(-1)  # GELU judged element by element: this is not
    model[2].forward = functools.partial(lambda m, x: nn.Linear.forward(m, x) * 2, model[2])  # accelerate's form
    refused = (
        r"2 module\(s\) cannot be converted(.|\n)*1 \(GELU\): its forward is replaced on this instance "
        r"\(by test_a_forward_set_on_an_instance_is_refused_by_path.<locals>.<lambda>\)(.|\n)*2 \(Linear\)"
    )
    with pytest.raises(TypeError, match=refused):
        parallelize(model, mesh)
    assert type(model[0]) is nn.Linear  # checked whole before anything changed
    del model[1].forward, model[2].forward
    check_against_serial(copy.deepcopy(model), parallelize(model, mesh), torch.randn(2 * mesh.depth * mesh.q, E), mesh)
