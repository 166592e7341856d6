"""``copy.deepcopy`` of a converted model (an EMA twin): the same mesh, its own weights, the same
training — forward, backward, gradient norm, one AdamW step — as the original and the serial model."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_close, assert_state_close
from torch import nn

import optimus2d
from optimus2d import checkpoint, clip_grad_norm_, parallelize, scatter, scatter_batch, serial_state_dict
from optimus2d.comm.dtensor import local
from optimus2d.layers.base import ShardedModule, param_sharding

pytestmark = pytest.mark.mpi


def _tags(model: nn.Module) -> dict:
    return {name: (param_sharding(p), getattr(p, "_optimus2d_mesh", None)) for name, p in model.named_parameters()}


def _check_copy(original: nn.Module, twin: nn.Module, mesh) -> None:
    """The twin runs on the same mesh, with tags like the original's, on weights of its own."""
    meshes = {id(m.mesh) for m in twin.modules() if isinstance(m, ShardedModule)}
    meshes |= {id(m._optimus2d_mesh) for m in twin.modules() if hasattr(m, "_optimus2d_mesh")}  # a library's module
    assert meshes == {id(mesh)}
    tags = _tags(twin)
    assert tags == _tags(original)
    assert all(owner is mesh for _, owner in tags.values())
    for (name, p), t in zip(original.named_parameters(), twin.parameters(), strict=True):
        assert type(p) is type(t), name  # a DTensor's copy is one too
        p, t = local(p), local(t)
        assert p is not t and p.data_ptr() != t.data_ptr() and torch.equal(p, t), name
    assert copy.deepcopy(mesh) is mesh and copy.copy(mesh) is mesh
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(mesh)


def _train_step(model, loss_fn, mesh):
    """forward, backward, clipped gradient norm (max 1e9: measured, not clipped), one AdamW step
    (eps 1e-3, and fp64 where a gradient is zero in exact arithmetic, the key bias's: its rounding
    noise, which Adam's first step would turn into ±lr, stays far below eps)."""
    model.zero_grad(set_to_none=True)
    out, loss = loss_fn(model)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm_(model.parameters(), 1e9)
    torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3).step()
    return out.detach(), grads, norm


def _twins_train_alike(serial, parallel, loss_fn, serial_loss_fn, mesh, tol=1e-5):
    twin = copy.deepcopy(parallel)
    _check_copy(parallel, twin, mesh)
    before = serial_state_dict(parallel)

    out_t, grads_t, norm_t = _train_step(twin, loss_fn, mesh)  # the twin trains first
    after = serial_state_dict(twin)
    for key, value in serial_state_dict(parallel).items():  # the original is untouched
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in parallel.parameters())

    out, grads, norm = _train_step(parallel, loss_fn, mesh)  # then the original: the same numbers
    assert torch.equal(out_t, out)
    assert torch.equal(norm_t, norm)
    for g_t, g in zip(grads_t, grads, strict=True):
        assert torch.equal(g_t, g)
    assert_state_close(serial_state_dict(parallel), after, 0.0)

    serial.zero_grad(set_to_none=True)  # and the serial model's
    out_ref, loss_ref = serial_loss_fn(serial)
    loss_ref.backward()
    norm_ref = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9)
    torch.optim.AdamW(serial.parameters(), lr=1e-2, eps=1e-3).step()
    assert_close(optimus2d.gather(out_t, mesh), out_ref, tol, "output")
    assert_close(norm_t, norm_ref, tol, "gradient norm")
    assert_state_close(after, serial.state_dict(), tol)
    return twin


def test_deepcopy_of_a_converted_encoder_trains_like_the_original(mesh, shared_dir):
    torch.manual_seed(0)
    e, heads = (18, 6) if mesh.q == 3 else (16, 4)  # heads and width divisible by q
    layer = nn.TransformerEncoderLayer(e, heads, 2 * e, dropout=0.0, batch_first=True, norm_first=True)
    serial = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(e), enable_nested_tensor=False).double()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    x = torch.randn(2 * mesh.depth * mesh.q, 5, e, dtype=torch.float64)
    probe = torch.randn(x.shape, dtype=torch.float64)

    def loss_fn(model):
        y = model(scatter(x, mesh))
        return y, (y * scatter(probe, mesh)).sum()

    def serial_loss_fn(model):
        y = model(x)
        return y, (y * probe).sum()

    twin = _twins_train_alike(serial, parallel, loss_fn, serial_loss_fn, mesh)
    if dist.is_initialized():  # the checkpoint functions read the twin's blocks
        path = os.path.join(shared_dir, "twin")
        checkpoint.save(path, twin)
        fresh = parallelize(copy.deepcopy(serial), mesh)
        checkpoint.load(path, fresh)
        assert_state_close(serial_state_dict(fresh), serial_state_dict(twin), 0.0)


def test_deepcopy_of_a_converted_llama_trains_like_the_original(mesh):
    transformers = pytest.importorskip("transformers")
    from test_families_mpi import _tiny_llama

    serial = _tiny_llama(mesh)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 9))
    assert transformers is not None

    def loss_fn(model):
        local = scatter_batch(ids, mesh)
        logits = model(input_ids=local, use_cache=False).logits
        return logits, optimus2d.cross_entropy(logits[:, :-1], local[:, 1:], mesh)

    def serial_loss_fn(model):
        logits = model(input_ids=ids, use_cache=False).logits
        return logits, F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    _twins_train_alike(serial, parallel, loss_fn, serial_loss_fn, mesh, tol=1e-4)


def test_deepcopy_keeps_the_hooks_and_tags_of_a_foreign_modules_blocks(mesh):
    """A library's module whose parameter a converter replaced by a block replicated over col and
    depth, with a hook summing its gradient there (as timm's class token): the copy keeps both."""
    from optimus2d.comm import primitives as P
    from optimus2d.comm.sharding import Sharding, shard
    from optimus2d.layers.base import keep_blocks_on_copy, mark_block

    class Shift(nn.Module):  # y = x + bias, its forward reads the parameter directly
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(12))

        def forward(self, x):
            return x + self.bias

    torch.manual_seed(0)
    serial = Shift()
    model = copy.deepcopy(serial)
    sharding = Sharding((("row",),), (12,))
    block = nn.Parameter(shard(model.bias.detach(), mesh, sharding).clone())
    block.register_hook(lambda grad: P.summed_copy(grad, mesh, ("col", "depth")))
    model.bias = block
    model._optimus2d_shardings, model._optimus2d_mesh = {"bias": sharding}, mesh
    mark_block(block, model, "bias", mesh)
    assert keep_blocks_on_copy(model) is model
    x, probe = torch.randn(2 * mesh.depth * mesh.q, 3, 12), torch.randn(2 * mesh.depth * mesh.q, 3, 12)

    def loss_fn(m):
        y = m(scatter(x, mesh))
        return y, (y * scatter(probe, mesh)).sum()

    def serial_loss_fn(m):
        y = m(x)
        return y, (y * probe).sum()

    twin = _twins_train_alike(serial, model, loss_fn, serial_loss_fn, mesh)
    assert len(twin.bias._backward_hooks) == 1
    assert copy.deepcopy(twin).bias._optimus2d_mesh is mesh  # a copy of the copy too
