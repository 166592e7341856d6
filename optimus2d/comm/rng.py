"""Random numbers for sharded tensors: masks that differ between shards and replay exactly.

(Named ``rng``, not ``random``, so that it never shadows the standard library's module.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

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
