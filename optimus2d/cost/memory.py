"""Measure memory in bytes, not time: what autograd keeps for backward."""

from __future__ import annotations

import torch
from torch import nn

from optimus2d.comm.dtensor import local


def saved_activation_bytes(module: nn.Module, *inputs: torch.Tensor, **kwargs) -> int:
    """Bytes of the tensors one forward of ``module`` saves for backward, parameters excluded.

    Counted by storage, once each (views of one tensor count once), with
    ``torch.autograd.graph.saved_tensors_hooks``; the graph is freed before returning.
    """
    params = {local(p).untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs, **kwargs)
    del out
    return sum(seen.values())
