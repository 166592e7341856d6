"""Rotary tables whose frequencies follow the longest position of the batch: transformers' dynamic
and longrope RoPE (``@dynamic_rope_update``), which read ``max(position_ids)`` before each call.

Serial reads the whole batch's; a rank holds a block of it (its rows; its tokens under context
parallelism), and a rank whose rows are short would choose other frequencies (Phi-3's long or short
factors; a rescaled ``inv_freq``), so its logits would differ. Converted, the table reads the
largest position over the mesh (one all-reduce of one integer a call) and updates from it, then
computes this rank's cos/sin as transformers does. A data-parallel replica's mesh is its own batch,
as each DDP replica's is.
"""

from __future__ import annotations

import torch
from torch import nn

from optimus2d.comm import primitives as P
from optimus2d.comm.mesh import Mesh

_WRAPPER = "dynamic_rope_update.<locals>.wrapper"
_CONTEXT = "context_decorator.<locals>.decorate_context"  # torch's @torch.no_grad() and kin
_SUBCLASSES: dict[type, type] = {}


def _update_wrapper(forward):
    """transformers' ``dynamic_rope_update`` wrapper in ``forward``'s chain of decorators, under none
    or only torch's context decorators (transformers 5.23 puts ``@torch.no_grad()`` above it, 5.25
    not); None where there is none."""
    while forward is not None:
        name = getattr(getattr(forward, "__code__", None), "co_qualname", None)
        if name == _WRAPPER and hasattr(forward, "__wrapped__"):
            return forward
        if name != _CONTEXT:
            return None
        forward = getattr(forward, "__wrapped__", None)
    return None


def follows_positions(module: nn.Module) -> bool:
    """Whether the module's forward is transformers' ``dynamic_rope_update`` wrapper."""
    return _update_wrapper(type(module).forward) is not None


def over_the_mesh(module: nn.Module, mesh: Mesh) -> nn.Module:
    """``module`` (replicated) made to update its frequencies from the mesh's largest position."""
    base = type(module)
    if base not in _SUBCLASSES:
        _SUBCLASSES[base] = type(base.__name__, (base,), {"forward": _forward, "__module__": __name__})
    module.__class__ = _SUBCLASSES[base]
    module._optimus2d_mesh = mesh
    return module


def _forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
    """The frequency update (the decorated forward, called on the largest position alone), then the
    table's own forward on this rank's positions (outside torch's context decorators, if any: the
    table is made from buffers and integer positions, x giving only its dtype and device, so no
    gradient mode changes it)."""
    decorated = type(self).__mro__[1].forward
    top = position_ids.detach().max().reshape(1, 1).clone()
    P.all_reduce_max(top, self._optimus2d_mesh, "mesh")
    decorated(self, x, top, layer_type)
    more = {"layer_type": layer_type} if layer_type is not None else {}
    return _update_wrapper(decorated).__wrapped__(self, x, position_ids, **more)
