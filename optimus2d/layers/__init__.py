"""Modules that stand in for torch.nn ones on the mesh."""

from optimus2d.layers.base import ShardedModule
from optimus2d.layers.linear import Linear2D

__all__ = ["Linear2D", "ShardedModule"]
