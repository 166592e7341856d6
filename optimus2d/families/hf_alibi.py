"""Attention with linear biases (ALiBi): BLOOM (``BloomForCausalLM``) and MPT (``MptForCausalLM``).

ALiBi adds to each head's scores a bias of its own slope; the model builds the biases of *every*
head once and hands them to each attention. On the mesh a rank holds heads block j (the block of
the projections' output it holds, ``mesh.index("row")``), so its attention takes the slice of the
biases of those heads, and its instance counts them (``num_heads / q``; heads q does not divide are
refused). Everything else is read and declared here class by class, as for GPT-2 (``hf.py``), and
each is exact against the serial model in ``tests/test_families_positions_mpi.py``:

- BLOOM: ``query_key_value`` holds, per head, its q, k and v rows side by side (``view(b, s, heads,
  3, head_dim)``): head block j is the contiguous block j of its rows, a plain ``Linear2D``. The
  biases come as ``alibi`` ``[b·heads, 1, keys]`` (batch-major); ``dropout_add`` is ``F.dropout``
  (drawn per shard, as ``Dropout2D``). ``pretraining_tp > 1`` with ``slow_but_exact`` slices the
  hidden dim by a global size: refused.
- MPT: ``Wqkv`` is q, k and v one after another, ``chunk(3, dim=2)``-ed: split per part. The biases
  come as ``position_bias`` ``[heads, 1, keys]``.

forward: as the library's, on ``[b/(d·q), s, h/q]``; the slice of the biases sends nothing.
"""

from __future__ import annotations

import functools
import importlib

from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.convert.forward_reader import draw_per_shard
from optimus2d.convert.parallelizer import keep, register_converter
from optimus2d.families.hf import keep_drawing_per_shard, local_heads
from optimus2d.layers import Linear2D


def _own_heads(attn: nn.Module, args: tuple, kwargs: dict, *, arg: str, batch_major: bool, mesh: Mesh):
    """A forward pre-hook: the biases ``kwargs[arg]`` of every head → those of this rank's heads."""
    bias = kwargs.get(arg)
    if bias is None:
        return None
    heads, j = attn._optimus2d_alibi_heads, mesh.index("row")
    total = heads * mesh.q
    if batch_major:  # [b·heads, 1, keys] → [b, heads, 1, keys], this rank's heads, back to [b·heads/q, 1, keys]
        per_row = bias.view(-1, total, *bias.shape[1:])[:, j * heads : (j + 1) * heads]
        bias = per_row.reshape(-1, *bias.shape[1:])
    else:  # [heads, q, keys]
        if bias.shape[0] != total:
            raise ValueError(f"{type(attn).__name__}: {arg} has {bias.shape[0]} heads, the model {total} ({mesh})")
        bias = bias[j * heads : (j + 1) * heads]
    return args, {**kwargs, arg: bias}


def _hook_heads(attn: nn.Module, mesh: Mesh, *, arg: str, batch_major: bool) -> None:
    hook = functools.partial(_own_heads, arg=arg, batch_major=batch_major, mesh=mesh)
    attn.register_forward_pre_hook(hook, with_kwargs=True)


def _refuse_tp_slices(module: nn.Module, mesh: Mesh) -> None:
    if module.pretraining_tp > 1 and module.slow_but_exact:
        raise ValueError(
            f"parallelize: {type(module).__name__} with pretraining_tp={module.pretraining_tp} and slow_but_exact "
            f"slices the hidden dim by a global size ({mesh}); set config.slow_but_exact = False"
        )


def _bloom_attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    _refuse_tp_slices(attn, mesh)
    heads = local_heads(attn, "num_heads", mesh)
    keep(attn, mesh)
    attn.num_heads = attn._optimus2d_alibi_heads = heads
    _hook_heads(attn, mesh, arg="alibi", batch_major=True)
    draw_per_shard(attn, mesh, lambda a: a.hidden_dropout > 0)  # dropout_add: F.dropout of the output block
    return attn


def _bloom_mlp(mlp: nn.Module, mesh: Mesh) -> nn.Module:
    _refuse_tp_slices(mlp, mesh)
    return keep_drawing_per_shard("hidden_dropout")(mlp, mesh)


def _mpt_attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    heads = local_heads(attn, "n_heads", mesh)
    width = attn.hidden_size
    attn.Wqkv = Linear2D.from_serial(attn.Wqkv, mesh, parts=(width, width, width))
    keep(attn, mesh)
    attn.n_heads = attn._optimus2d_alibi_heads = heads
    _hook_heads(attn, mesh, arg="position_bias", batch_major=False)
    draw_per_shard(attn, mesh, lambda a: a.attn_dropout_p > 0)  # F.dropout of the attention weights
    return attn


def register() -> None:
    """Register BLOOM's and MPT's classes (needs ``transformers``)."""
    bloom = importlib.import_module("transformers.models.bloom.modeling_bloom")
    register_converter(bloom.BloomAttention, _bloom_attention, converts_children=True)
    register_converter(bloom.BloomMLP, _bloom_mlp, converts_children=True)
    register_converter(bloom.BloomGelu, keep=True)  # x · ½(1 + tanh(…)): element by element
    for cls in (bloom.BloomBlock, bloom.BloomModel, bloom.BloomForCausalLM):
        register_converter(cls, keep=True)
    mpt = importlib.import_module("transformers.models.mpt.modeling_mpt")
    register_converter(mpt.MptAttention, _mpt_attention, converts_children=True)
    register_converter(mpt.MptMLP, keep_drawing_per_shard("hidden_dropout"), converts_children=True)
    for cls in (mpt.MptBlock, mpt.MptModel, mpt.MptForCausalLM):
        register_converter(cls, keep=True)
