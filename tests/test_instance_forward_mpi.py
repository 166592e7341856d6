"""A forward set on one instance: a hub kernel is set aside (the class's forward runs, exact against
serial), any other is refused by path on every rank (``optimus2d/convert/instance_forward.py``)."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
from helpers import assert_close, check_against_serial
from torch import nn

from optimus2d import gather, parallelize, scatter_batch
from optimus2d.convert.instance_forward import replaced_forward, set_aside_hub_kernels
from optimus2d.families.hf_bert import in_shard_rng

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
    assert parallel.forward.__func__ is nn.Sequential.forward
    check_against_serial(serial, parallel, x, mesh)


def test_set_aside_names_the_modules_and_keeps_what_is_not_a_kernel():
    model = _kernelize(nn.Sequential(*_model(), NewGELU(), NewGELU()), "as kernels does")  # kernels on 1, 3-5
    model[1].__dict__.pop("_kernel_repo")  # no repository noted: anyone's forward, left (and refused)
    in_shard_rng(model[3], None, lambda m: False)  # optimus2d's own wrapper, over the kernel: left (ours)
    model[5].forward = functools.partial(lambda m, x: m._old_forward(x), model[5])  # accelerate's hook in front
    model[5]._old_forward, model[5]._hf_hook = types.MethodType(RowMeanKernel.forward, model[5]), object()
    aside = set_aside_hub_kernels(model)
    assert aside.paths == ["4"] and model._use_kernels is False
    assert "forward" not in model[4].__dict__ and "_kernel_repo" not in model[4].__dict__
    assert model[1].forward.__func__ is RowMeanKernel.forward and model[3].forward.__wrapped__.__self__ is model[3]
    assert "a hub kernel? load with use_kernels=False" in replaced_forward(model[1])
    assert replaced_forward(model[3]) is None and replaced_forward(model[4]) is None
    assert "replaced on this instance (by test_set_aside" in replaced_forward(model[5])
    aside.put_back()  # as it was
    assert model[4].forward.__func__ is RowMeanKernel.forward and model._use_kernels is True


def test_a_forward_set_on_an_instance_is_refused_by_path(mesh):
    """Wherever it is: a leaf kept as element-wise, a Linear converted, a tied head, a child of a layer
    converted whole, a method of another module; the model and its kernels left as they were."""
    torch.manual_seed(0)
    emb, layer = nn.Embedding(24, E), nn.TransformerEncoderLayer(E, 6, 2 * E, dropout=0.0, batch_first=True)
    head = nn.Linear(E, 24, bias=False)
    head.weight = emb.weight
    model = _kernelize(nn.Sequential(emb, nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E), layer, NewGELU(), head),
                       "as kernels does")  # fmt: skip
    model[2].forward = lambda x: x.flip(-1)  # GELU judged element by element: this is not
    model[3].forward = functools.partial(lambda m, x: nn.Linear.forward(m, x) * 2, model[3])  # accelerate's form
    layer.linear1.forward = model[1].forward  # another module's
    head.forward = lambda x: x @ emb.weight.t()
    refused = (
        r"4 module\(s\) cannot be converted(.|\n)*2 \(GELU\): its forward is replaced on this instance "
        r"\(by test_a_forward_set_on_an_instance_is_refused_by_path.<locals>.<lambda>\)(.|\n)*3 \(Linear\)"
        r"(.|\n)*4.linear1 \(Linear\): its forward is replaced on this instance \(by Linear.forward of another "
        r"module\)(.|\n)*6 \(Linear\)"
    )
    with pytest.raises(TypeError, match=refused):
        parallelize(model, mesh)
    assert type(model[1]) is nn.Linear and model[5].forward.__func__ is RowMeanKernel.forward  # as it was
    assert model._use_kernels is True
    for m in (model[2], model[3], layer.linear1, head):
        del m.forward
    serial = copy.deepcopy(model)
    set_aside_hub_kernels(serial)
    ids = torch.randint(0, 24, (2 * mesh.depth * mesh.q, 3))
    parallel = parallelize(model, mesh)
    got = gather(parallel(scatter_batch(ids, mesh)), mesh)
    assert_close(got[..., :24], serial(ids), what="logits")


def test_a_converted_model_converts_again_with_optimus2ds_own_forwards(mesh):
    """BERT's converted layers run under optimus2d's wrappers (``functools.wraps`` copies the wrapped
    forward's ``__module__``): converting it again changes nothing."""
    transformers = pytest.importorskip("transformers")
    if mesh.q > 1:  # a converted BERT keeps this rank's head count: split again, hf_bert refuses it
        pytest.skip("BERT converted twice: on a mesh whose q is 1 (1, 1×1×4, 1×1×8)")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=24, num_hidden_layers=1, num_attention_heads=6,
                                     intermediate_size=48, vocab_size=40, hidden_dropout_prob=0.1)  # fmt: skip
    parallel = parallelize(transformers.BertForMaskedLM(config), mesh)
    wrapped = [path for path, m in parallel.named_modules() if "forward" in m.__dict__]
    assert wrapped  # the wrappers this test is about
    assert parallelize(parallel, mesh) is parallel
    # optimus2d's hooks made by functools.partial (its module is "functools": refused as a user's)
    assert any(isinstance(h, functools.partial) for h in parallel._forward_pre_hooks.values())
