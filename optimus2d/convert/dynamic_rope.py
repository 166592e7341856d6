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
_SUBCLASSES: dict[type, type] = {}


def follows_positions(module: nn.Module) -> bool:
    """Whether the module's forward is transformers' ``dynamic_rope_update`` wrapper."""
    forward = type(module).forward
    code = getattr(forward, "__code__", None)
    return getattr(code, "co_qualname", None) == _WRAPPER and hasattr(forward, "__wrapped__")


def over_the_mesh(module: nn.Module, mesh: Mesh) -> nn.Module:
    """``module`` (replicated) made to update its frequencies from the mesh's largest position."""
    base = type(module)
    if base not in _SUBCLASSES:
        _SUBCLASSES[base] = type(base.__name__, (base,), {"forward": _forward, "__module__": __name__})
    module.__class__ = _SUBCLASSES[base]
    module._optimus2d_mesh = mesh
    return module


def _forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
    """The frequency update (the wrapper, called on the largest position alone), then the table's own
    forward on this rank's positions."""
    decorated = type(self).__mro__[1].forward
    top = position_ids.detach().max().reshape(1, 1).clone()
    P.all_reduce_max(top, self._optimus2d_mesh, "mesh")
    decorated(self, x, top, layer_type)
    more = {"layer_type": layer_type} if layer_type is not None else {}
    return decorated.__wrapped__(self, x, position_ids, **more)
