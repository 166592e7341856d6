"""Hugging Face attention on the sequence layout: ``sequence_parallel(model, mesh, assignment, mask)``.

Transformers' attention modules call the kernel named by ``config._attn_implementation`` through
``AttentionInterface``, with q, k, v already split into heads and rotated. Within
``sequence_parallel`` that name is "optimus2d_context", registered here, whose kernel is
``context.attention`` (K and V gathered over depth; grouped-query heads repeated first, as torch's
``sdpa`` path does) under the given mask. Transformers builds no mask for a kernel it does not know
(``masking_utils``: no mask interface registered), so the model's own mask, made from local
positions, never reaches it; the mask is the one given, over the whole sequence.

Feed the model the sequence layout: ``input_ids=context.scatter_batch(ids, mesh, assignment)`` and
``position_ids=context.positions(assignment, mesh)`` (broadcast over the batch), so rotary or
learned positions are the tokens' own; targets shifted in sequence order before they are scattered.
Attention dropout is refused (its mask would be drawn per block, not per serial position).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from optimus2d.comm import Mesh
from optimus2d.comm.agreement import agree
from optimus2d.context.attention import ATTENTION_METHODS, attention
from optimus2d.context.balance import Assignment
from optimus2d.cost.context import context_attention_method

NAME = "optimus2d_context"
CALLERS = "callers"  # sequence_parallel yields the ids of the modules whose attention ran the kernel
# what the kernel may be given beside q, k, v and the mask, and ignore: positions (rotary ones already
# applied to q and k), and flags. Any other tensor (T5's position_bias, attention sinks, a varlen
# kernel's cumulative lengths) would change what attention computes: refused.
_IGNORED_TENSORS = ("position_ids", "cache_position")


@contextlib.contextmanager
def sequence_parallel(
    model: nn.Module,
    mesh: Mesh,
    assignment: Assignment,
    mask: torch.Tensor,
    *,
    attention: str = "auto",
    memory: float | None = None,
) -> Iterator[set[int]]:
    """Within the block, every attention module of the (converted) transformers ``model`` computes
    ``context.attention`` over ``mesh``'s depth axis, for the tokens ``assignment`` gives each
    depth slice, under ``mask`` (``[s, s]`` bool, sequence order). Restores the model's attention
    implementation after. Refused (``TypeError``) for a model with no transformers config. Yields
    the set of ``id``s of the modules that ran the kernel, filled as the block runs (an attention
    computed another way is not in it: ``ContextParallel`` refuses a layer that ran none).

    ``attention``: "all_gather", "ring", or "auto": per layer, what ``cost.context_attention_method``
    picks for its sizes and ``memory`` (bytes a rank can spare for one layer's attention; None:
    the all-gather, which sends less)."""
    from transformers import AttentionInterface  # an optional dependency: only a transformers model needs it

    if attention not in ("auto", *ATTENTION_METHODS):
        raise ValueError(f"sequence_parallel: attention {attention!r} is not 'auto' or one of {ATTENTION_METHODS}")

    AttentionInterface.register(NAME, _kernel)
    configs = {
        id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")
    }
    if not configs:
        raise TypeError(f"sequence_parallel: {type(model).__name__} has no transformers config to route its attention")
    saved = {key: config._attn_implementation for key, config in configs.items()}
    calls: dict = {CALLERS: set()}  # the mask rows, made once a call; the modules that called the kernel
    state = (mesh, assignment, mask, attention, memory, calls)
    for module in model.modules():
        module._optimus2d_context = state
    hook = model.register_forward_pre_hook(functools.partial(_check_call, mesh), with_kwargs=True)
    try:
        for config in configs.values():
            config._attn_implementation = NAME
        yield calls[CALLERS]
    finally:
        hook.remove()
        for key, config in configs.items():
            config._attn_implementation = saved[key]
        for module in model.modules():
            module.__dict__.pop("_optimus2d_context", None)


def _check_call(mesh: Mesh, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook on the model inside ``sequence_parallel``: transformers drops a 2D padding
    ``attention_mask`` for a kernel it does not know, and hands it a 4D one, which the kernel does
    not read (the mask is the one given to ``sequence_parallel``): refused unless all ones (0.15 off
    with left padding, 0.26 with a documents' 4D mask). Without ``position_ids`` transformers numbers
    this rank's tokens 0.. (1.3e-3 off under head-tail): refused. Agreed over the mesh (a padding
    mask is one rank's own data)."""
    error = None
    padding = kwargs.get("attention_mask")
    if isinstance(padding, torch.Tensor) and (padding.dim() != 2 or not bool(padding.all())):
        error = ValueError(
            f"sequence_parallel: {type(model).__name__} is given an attention_mask {list(padding.shape)} that "
            f"masks tokens; the context-parallel attention applies the mask given to sequence_parallel alone: put "
            f"the padding or the documents there, and give no attention_mask (or one of ones)"
        )
    elif padding is not None and not isinstance(padding, torch.Tensor):
        error = ValueError(f"sequence_parallel: attention_mask is a {type(padding).__name__}: give no attention_mask")
    elif kwargs.get("position_ids") is None and any(kwargs.get(k) is not None for k in ("input_ids", "inputs_embeds")):
        error = ValueError(
            f"sequence_parallel: {type(model).__name__} is called without position_ids: transformers would number "
            f"this rank's tokens 0.., not their places in the sequence; give position_ids=context.positions("
            f"assignment, mesh)"
        )
    if mesh.check != "off" and mesh.size > 1:
        agree(mesh, "sequence_parallel", description=f"{type(model).__name__}'s call", error=error)
    elif error is not None:
        raise error


def _kernel(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` kernel: ``[b/q, heads/q, s/c, d_h]`` in, ``[b/q, s/c, heads/q, d_h]`` out."""
    state = module.__dict__.get("_optimus2d_context")
    if state is None:
        raise RuntimeError(f"{type(module).__name__}: attn_implementation {NAME!r} runs only inside sequence_parallel")
    if dropout:
        raise ValueError(
            f"sequence_parallel: {type(module).__name__} has attention dropout {dropout}; context-parallel "
            f"attention does not draw it as the serial model does (set attention_dropout=0 or call model.eval())"
        )
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"sequence_parallel: {type(module).__name__} uses softcapping or a sliding window, not supported"
        )
    unknown = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _IGNORED_TENSORS)
    if unknown:
        raise ValueError(
            f"sequence_parallel: {type(module).__name__} gives its attention {unknown}, which context-parallel "
            f"attention does not apply (a position bias, sinks): not supported"
        )
    mesh, assignment, mask, method, memory, cache = state
    cache[CALLERS].add(id(module))
    if getattr(module, "is_causal", None) is False and _causal_only(mask, cache):
        raise ValueError(
            f"sequence_parallel: {type(module).__name__} attends both ways (is_causal=False), but the mask given "
            f"lets no query see a later key: give the model's own mask (ContextParallel(mask=torch.ones(s, s, "
            f"dtype=torch.bool)), or a document mask, for an encoder)"
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads in a row
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if method == "auto":  # the same sizes on every rank: the same pick
        b, heads, n, d_h = query.shape
        method = context_attention_method(
            b, heads, n, d_h, mesh.depth, memory=memory, bytes_per_element=query.element_size()
        )
    out = attention(query, key, value, mesh, assignment, mask, scale=scaling, method=method, cache=cache)
    return out.transpose(1, 2).contiguous(), None


def _causal_only(mask: torch.Tensor, cache: dict) -> bool:
    """No query sees a later key, and some query misses a key: a causal mask (once a call)."""
    key = ("causal only", id(mask))
    if key not in cache:
        cache[key] = not bool(mask.triu(1).any()) and not bool(mask.all())
    return cache[key]
