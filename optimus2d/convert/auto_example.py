"""``Auto(example=)``: the rows and sequence length each block of a model sees, from one forward.

``plan="auto"`` prices every block at ``Auto(tokens=, seq=)`` rows by default: the model's input.
A model whose modules see different token counts — a VLM whose projector pools the encoder's
patches (the LM sees k times fewer), or whose LM adds text tokens to the image's — is priced
wrong that way. Given ``example`` (one step's inputs, as the model is called on them), the model
runs once on the meta device (a copy whose tensors are meta: nothing is computed or allocated) and
each block's rows and sequence are read from the first tensor it is called with
(``traced_rows``): a floating tensor whose last dim is the block's width (``[b, s, h]``; a layer's
sequence is the dim it attends over, ``[s, b, h]`` where not ``batch_first``; another block's is
its rows over dim 0, the dim a mesh splits), or integer ids ``[b, s]`` (a region's input). A
forward that cannot run on meta is refused (``ValueError``): give ``tokens=``/``seq=`` then.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map


def traced_rows(model: nn.Module, example, widths: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Block path → (rows, sequence length) it is first called with, for the paths of ``widths``
    (path → the block's hidden width) that run in ``model(*example)`` (``example``: a tensor, a tuple
    of positional arguments, or a dict of keyword arguments). Raises ``ValueError`` naming the error
    when the model's forward cannot run on the meta device."""
    args, kwargs = ((), example) if isinstance(example, dict) else (
        (example,) if isinstance(example, torch.Tensor) else tuple(example), {})  # fmt: skip
    memo: dict = {}
    for t in (*model.parameters(), *model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    seen: dict[str, tuple[int, int]] = {}
    with torch.random.fork_rng(devices=[]):
        try:
            twin = copy.deepcopy(model, memo)
            for path, width in widths.items():
                module = twin.get_submodule(path)
                module.register_forward_pre_hook(_recorder(path, width, _sequence_dim(module), seen), with_kwargs=True)
            meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
            with torch.no_grad():
                twin(*meta_args, **meta_kwargs)
        except Exception as err:  # any error of the model's own forward (or copy) on meta
            raise ValueError(
                f"parallelize: Auto(example=) runs the model once on the meta device to see each block's rows, and "
                f"its forward raised {type(err).__name__}: {err}; give Auto(tokens=, seq=) instead"
            ) from err
    return seen


def describe(example) -> str:
    """``example`` as its tensors' shapes and dtypes (the same on every rank that gives the same inputs)."""
    leaves, _ = tree_flatten(example)
    return ", ".join(f"{tuple(t.shape)}:{t.dtype}" if isinstance(t, torch.Tensor) else repr(t) for t in leaves)


def _to_meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _sequence_dim(module: nn.Module) -> int | None:
    """The dim a layer attends over (torch's layers: 1, or 0 where not ``batch_first``); None for
    another block, whose "sequence" is what its rows hold beyond dim 0 (the dim a mesh splits)."""
    attention = getattr(module, "self_attn", None)
    return (1 if attention.batch_first else 0) if isinstance(attention, nn.MultiheadAttention) else None


def _recorder(path: str, width: int, dim: int | None, seen: dict):
    def record(module, args, kwargs):
        if path in seen:
            return
        for t in _tensors([*args, *kwargs.values()]):
            if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == width:
                rows = t.numel() // width
                seq = t.shape[dim] if dim is not None and t.dim() >= 3 else rows // t.shape[0]
                seen[path] = (rows, seq)
                return
            if not t.is_floating_point() and not t.is_complex() and t.dim() == 2:  # ids [b, s]
                seen[path] = (t.numel(), t.shape[-1])
                return

    return record


def _tensors(values: Iterable) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(list(values))
    return [t for t in leaves if isinstance(t, torch.Tensor)]
