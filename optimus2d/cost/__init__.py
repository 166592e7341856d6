"""The cost model: what each layout sends, holds and costs, before anything runs.

``volume.py``: elements a layer sends per rank (2D SUMMA or stationary, 1D), exact (tests compare
them with ``count_comm``); ``memory.py``: activation bytes saved for backward, measured;
``planner.py``: step time, efficiency and per-module layout proposals from a ``Hardware``
description; ``scale.py``: the projection to clusters (tensor × pipeline × data parallel);
``context.py``: context-parallel attention's all-gather and ring, their bytes and memory.
"""

from optimus2d.cost.context import context_attention, context_attention_method
from optimus2d.cost.volume import (
    linear_2d_algorithm,
    linear_2d_elements,
    linear_2d_stationary_elements,
    linear_2d_summa_elements,
    mlp_1d_elements,
    mlp_2d_elements,
)

__all__ = [
    "context_attention",
    "context_attention_method",
    "linear_2d_algorithm",
    "linear_2d_elements",
    "linear_2d_stationary_elements",
    "linear_2d_summa_elements",
    "mlp_1d_elements",
    "mlp_2d_elements",
]
