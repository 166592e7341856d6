"""Random numbers for sharded tensors: masks that differ between shards and replay exactly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm.mesh import Mesh

_GOLDEN = 0x9E3779B97F4A7C15


@contextmanager
def shard_rng(mesh: Mesh, enabled: bool = True) -> Iterator[None]:
    """Inside, the default generators are seeded for this rank's shard; outside, nothing changed
    but one draw from the default CPU generator.

    That draw is the same on every rank (seed all ranks alike, as for parameter init), so masks
    are reproducible for a given seed, differ between the shards of one tensor (the seed is mixed
    with the rank's place in the mesh), and replay exactly under activation checkpointing, which
    restores the default generators before recomputing.
    """
    if not enabled:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,)).item())
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((seed + _GOLDEN * (mesh.index("mesh") + 1)) % 2**63)
        yield


class Dropout2D(nn.Module):
    """``nn.Dropout`` for a sharded activation: each shard draws its own mask (see ``shard_rng``)."""

    def __init__(self, p: float = 0.5, *, mesh: Mesh) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.mesh = p, mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with shard_rng(self.mesh):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}"
