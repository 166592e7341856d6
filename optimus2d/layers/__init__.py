"""Modules that stand in for torch.nn ones on the mesh."""

from optimus2d.layers.attention import MultiheadAttention2D
from optimus2d.layers.base import ShardedModule, fill_from_serial
from optimus2d.layers.block import TransformerBlock2D
from optimus2d.layers.dropout import Dropout2D
from optimus2d.layers.embedding import Embedding2D, TiedHead2D
from optimus2d.layers.linear import Linear2D, TransposedLinear2D, linear_2d
from optimus2d.layers.loss import cross_entropy
from optimus2d.layers.mlp import MLP2D
from optimus2d.layers.norm import LayerNorm2D, RMSNorm2D

__all__ = [
    "MLP2D",
    "Dropout2D",
    "Embedding2D",
    "LayerNorm2D",
    "Linear2D",
    "MultiheadAttention2D",
    "RMSNorm2D",
    "ShardedModule",
    "TiedHead2D",
    "TransformerBlock2D",
    "TransposedLinear2D",
    "cross_entropy",
    "fill_from_serial",
    "linear_2d",
]
