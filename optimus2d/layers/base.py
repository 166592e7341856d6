"""What every optimus2d module shares: its mesh and the Sharding of each tensor it owns."""

from __future__ import annotations

import torch
from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding, shard, unshard


class ShardedModule(nn.Module):
    """A module whose own parameters/buffers are blocks of serial tensors.

    ``shardings[name]`` says which block of the serial tensor ``name`` this rank holds; tensors
    without an entry are replicated. ``optimus2d.serial_state_dict`` and ``from_serial`` use it.
    """

    mesh: Mesh
    shardings: dict[str, Sharding]

    def tag_parameters(self) -> None:
        """Mark each own parameter with its Sharding (``clip_grad_norm_`` counts replicas once)."""
        for name, param in self.named_parameters(recurse=False):
            param._optimus2d_sharding = self.shardings.get(name)
            param._optimus2d_mesh = self.mesh

    def load_serial_tensor(self, name: str, full: torch.Tensor) -> None:
        """Copy this rank's block of the serial tensor ``full`` into ``name`` (no communication)."""
        local = getattr(self, name)
        block = shard(full.detach(), self.mesh, self.shardings[name]) if name in self.shardings else full
        with torch.no_grad():
            local.copy_(block)

    def serial_tensor(self, name: str) -> torch.Tensor:
        """The serial tensor ``name`` on every rank (all-gathers when sharded)."""
        local = getattr(self, name).detach()
        if name not in self.shardings:
            return local
        return unshard(local.contiguous(), self.mesh, self.shardings[name])

    def serial_shape(self, name: str) -> tuple[int, ...]:
        if name in self.shardings:
            return self.shardings[name].full_shape
        return tuple(getattr(self, name).shape)
