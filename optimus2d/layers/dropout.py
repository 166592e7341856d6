"""Dropout on a sharded activation: each shard draws its own mask, replayable (``comm/rng.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm.mesh import Mesh, as_mesh
from optimus2d.comm.rng import shard_rng


class Dropout2D(nn.Dropout):
    """``nn.Dropout`` for a sharded activation: each shard draws its own mask (see ``shard_rng``).

    An ``nn.Dropout`` still (``isinstance``), so what turns dropout off by walking a model's modules
    (``m.p = 0`` for each ``nn.Dropout``: TRL's ``disable_dropout_in_model``) reaches it too."""

    def __init__(self, p: float = 0.5, *, mesh: Mesh) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        super().__init__(p)
        self.mesh = as_mesh(mesh, "Dropout2D(mesh=)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with shard_rng(self.mesh):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}"
