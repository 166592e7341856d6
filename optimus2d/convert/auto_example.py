"""``Auto(example=)``: the rows and sequence length each block of a model sees, from one forward.

``plan="auto"`` prices every block at ``Auto(tokens=, seq=)`` rows by default: the model's input.
A model whose modules see different token counts — a VLM whose projector pools the encoder's
patches (the LM sees k times fewer), or whose LM adds text tokens to the image's — is priced
wrong that way. Given ``example`` (one step's inputs, as the model is called on them), the model
runs once on the meta device (a copy whose tensors are meta: nothing is computed or allocated; a
forward that reads a value, such as LLaVA's check of its image tokens, once for real under
``no_grad`` in eval mode instead) and each block's rows and sequence are read from the first tensor
it is called with
(``traced_rows``): a floating tensor whose last dim is the block's width (``[b, s, h]``; a layer's
sequence is the dim it attends over, ``[s, b, h]`` where not ``batch_first``; another block's is
its rows over dim 0, the dim a mesh splits), or integer ids ``[b, s]`` (a region's input). A
forward that runs neither way (or cannot run for real: parameters on meta) is refused
(``ValueError``): give ``tokens=``/``seq=`` then.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map


def traced_rows(model: nn.Module, example, widths: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Block path → (rows, sequence length) it is first called with, for the paths of ``widths``
    (path → the block's hidden width) that run in ``model(*example)`` (``example``: a tensor, a tuple
    of positional arguments, or a dict of keyword arguments). On a copy whose tensors are meta; where
    the forward reads a value (``.item()``: LLaVA's count of its image tokens), on ``model`` itself,
    once, under ``no_grad`` in eval mode (no running statistics updated; every module's mode and the
    random state restored after). Raises ``ValueError`` naming the error where neither runs."""
    args, kwargs = call_of(example)
    memo: dict = {}
    tensors = (*model.parameters(), *model.buffers())
    for t in tensors:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    gpus = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})  # their generators kept too
    with torch.random.fork_rng(devices=gpus):
        try:
            twin = copy.deepcopy(model, memo)
            return _run(twin, widths, *tree_map(_to_meta, (args, kwargs)))
        except Exception as err:  # the model's own forward (or its copy) cannot run on meta
            on_meta = err
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            raise _refusal(on_meta, "") from on_meta
        modes = {m: m.training for m in model.modules()}
        try:
            model.eval()
            return _run(model, widths, args, kwargs)
        except Exception as err:
            raise _refusal(on_meta, f"; run for real, {type(err).__name__}: {err}") from err
        finally:
            for m, mode in modes.items():
                m.training = mode


def _run(model: nn.Module, widths: dict[str, int], args, kwargs) -> dict[str, tuple[int, int]]:
    """``model(*args, **kwargs)`` under ``no_grad`` with a hook on each block of ``widths``: what they saw."""
    seen: dict[str, tuple[int, int]] = {}
    hooks = []
    try:
        for path, width in widths.items():
            module = model.get_submodule(path)
            record = _recorder(path, width, _sequence_dim(module), seen)
            hooks.append(module.register_forward_pre_hook(record, with_kwargs=True))
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _refusal(on_meta: Exception, then: str) -> ValueError:
    return ValueError(
        f"parallelize: Auto(example=) runs the model once to see each block's rows, and its forward raised "
        f"on the meta device {type(on_meta).__name__}: {on_meta}{then}; give Auto(tokens=, seq=) instead"
    )


def call_of(example) -> tuple[tuple, dict]:
    """``example`` as (positional, keyword) arguments: a tensor, a tuple or list of positional ones, or
    a mapping of keyword ones (a tokenizer's ``BatchEncoding`` too); ``TypeError`` for anything else."""
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, Mapping):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    raise TypeError(
        f"parallelize: Auto(example=) is one step's inputs: a tensor, a tuple of positional arguments or a dict "
        f"of keyword ones, not {type(example).__name__}"
    )


def describe(example) -> str:
    """``example`` as its structure, keywords and tensors' shapes and dtypes (plain values as they are,
    other objects by type): the same on every rank that calls the model alike."""
    if isinstance(example, torch.Tensor):
        return f"{tuple(example.shape)}:{example.dtype}"
    if isinstance(example, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(example[k])}" for k in sorted(example, key=str)) + "}"
    if isinstance(example, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in example) + ")"
    if example is None or isinstance(example, (bool, int, float, str)):
        return repr(example)
    return type(example).__name__


def _to_meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _sequence_dim(module: nn.Module) -> int | None:
    """The dim a layer attends over (torch's layers: 1, or 0 where not ``batch_first``); None for
    another block, whose "sequence" is what its rows hold beyond dim 0 (the dim a mesh splits)."""
    attention = getattr(module, "self_attn", None)
    return (1 if attention.batch_first else 0) if isinstance(attention, nn.MultiheadAttention) else None


def _recorder(path: str, width: int, dim: int | None, seen: dict):
    """The hook of one block: its first call's activation (a floating tensor of its width, wherever in
    the call), else its ids ``[b, s]`` (the largest integer 2-D tensor); a nested or empty tensor is
    not read. A block called more than once is priced at its first call."""

    def record(module, args, kwargs):
        if path in seen:
            return
        tensors = [t for t in _tensors([*args, *kwargs.values()]) if not t.is_nested and t.numel() > 0]
        for t in tensors:
            if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == width:
                rows = t.numel() // width
                seq = t.shape[dim] if dim is not None and t.dim() >= 3 else rows // t.shape[0]
                seen[path] = (rows, seq)
                return
        ids = [t for t in tensors if t.dim() == 2 and not t.is_floating_point() and not t.is_complex()]
        if ids:  # ids [b, s]: the largest (not one row of positions beside them)
            t = max(ids, key=torch.Tensor.numel)
            seen[path] = (t.numel(), t.shape[-1])

    return record


def _tensors(values: Iterable) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(list(values))
    return [t for t in leaves if isinstance(t, torch.Tensor)]
