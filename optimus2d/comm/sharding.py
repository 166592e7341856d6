"""Which block of a full tensor a rank holds, and moving between the full tensor and that block.

A ``Sharding`` names, for each dim of a tensor, the mesh axes that split it, outermost first.
"Split over the row group" means the block index along that dim is this rank's index in its row
group (j). Axes that split no dim replicate the tensor: e.g. a ``Linear2D`` weight is split over
"row" and "col" and replicated over "depth", so its gradient is summed over "depth".

    activation [b, s, h]   dims=(("depth", "col"), (), ("row",))   block [b/(d·q), s, h/q]
                            (batch block k·q + i, hidden block j)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from optimus2d.comm import primitives as P
from optimus2d.comm.mesh import AXES, Mesh

Slices = tuple[slice, ...]


@dataclass(frozen=True)
class Sharding:
    """``dims[d]``: the axes splitting dim d (outermost first); ``full_shape``: the serial shape.

    The local block of a dim split over axes of total size n has ``ceil(full / n)`` entries; a dim
    that does not divide (a vocabulary of 50257, say) is padded with zeros at its end.

    ``parts``: dim ``parts_dim`` is a concatenation of parts of these sizes (a fused q/k/v
    projection), each split on its own; the local block is the concatenation of the parts'
    blocks, so a rank holds whole heads of q, k and v.
    """

    dims: tuple[tuple[str, ...], ...]
    full_shape: tuple[int, ...]
    parts: tuple[int, ...] | None = None
    parts_dim: int = 0

    def _part_shardings(self) -> list[Sharding]:
        shape = list(self.full_shape)
        out = []
        for n in self.parts:
            shape[self.parts_dim] = n
            out.append(Sharding(self.dims, tuple(shape)))
        return out

    def part_sizes(self, mesh: Mesh | None) -> list[int]:
        """Each part's extent along ``parts_dim`` in the local block (``mesh`` None: in the full tensor)."""
        d = self.parts_dim
        return [p.full_shape[d] if mesh is None else p.local_shape(mesh)[d] for p in self._part_shardings()]

    def splits(self, mesh: Mesh, dim: int) -> int:
        n = 1
        for axis in self.dims[dim]:
            n *= mesh.axis_size(axis)
        return n

    def local_shape(self, mesh: Mesh) -> tuple[int, ...]:
        if self.parts:
            shape = list(self._part_shardings()[0].local_shape(mesh))
            shape[self.parts_dim] = sum(self.part_sizes(mesh))
            return tuple(shape)
        return tuple(-(-size // self.splits(mesh, d)) for d, size in enumerate(self.full_shape))

    def replicated_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """Axes (of more than one rank) over which the tensor is replicated."""
        used = {a for axes in self.dims for a in axes}
        return tuple(a for a in AXES if a not in used and mesh.axis_size(a) > 1)


def block_slices(sharding: Sharding, mesh: Mesh) -> list[tuple[Slices, Slices]]:
    """This rank's block as (slices of the full tensor, slices of the local block), one pair per
    part of a fused tensor (one otherwise). Entries of the local block outside every pair are zero
    padding; a pair may be empty (a block wholly past the end of a dim that does not divide)."""
    if sharding.parts:
        d, src_at, dst_at, out = sharding.parts_dim, 0, 0, []
        for part, local in zip(sharding._part_shardings(), sharding.part_sizes(mesh), strict=True):
            for src, dst in block_slices(part, mesh):
                src = (*src[:d], slice(src[d].start + src_at, src[d].stop + src_at), *src[d + 1 :])
                dst = (*dst[:d], slice(dst[d].start + dst_at, dst[d].stop + dst_at), *dst[d + 1 :])
                out.append((src, dst))
            src_at, dst_at = src_at + part.full_shape[d], dst_at + local
        return out
    src, dst = [], []
    for size, per, axes in zip(sharding.full_shape, sharding.local_shape(mesh), sharding.dims, strict=True):
        index = 0
        for axis in axes:  # outermost first, as comm.sharding.shard splits
            index = index * mesh.axis_size(axis) + mesh.index(axis)
        start = min(index * per, size)
        stop = min(start + per, size)
        src.append(slice(start, stop))
        dst.append(slice(0, stop - start))
    return [(tuple(src), tuple(dst))]


def replicated(shape: tuple[int, ...]) -> Sharding:
    return Sharding(tuple(() for _ in shape), tuple(shape))


def shard(full: torch.Tensor, mesh: Mesh, sharding: Sharding) -> torch.Tensor:
    """This rank's block of ``full`` (no communication; zero-padded where a dim does not divide)."""
    if tuple(full.shape) != sharding.full_shape:
        raise ValueError(f"tensor of shape {tuple(full.shape)} does not match {sharding}")
    if sharding.parts:
        pieces = full.split(list(sharding.parts), sharding.parts_dim)
        blocks = [shard(t, mesh, s) for t, s in zip(pieces, sharding._part_shardings(), strict=True)]
        return torch.cat(blocks, sharding.parts_dim)
    local_shape = sharding.local_shape(mesh)
    pad = []
    for d in reversed(range(full.dim())):
        pad += [0, local_shape[d] * sharding.splits(mesh, d) - full.shape[d]]
    out = F.pad(full, pad) if any(pad) else full
    for d, axes in enumerate(sharding.dims):
        for axis in axes:
            out = P.split(out, mesh, axis, d)
    return out


def unshard(local: torch.Tensor, mesh: Mesh, sharding: Sharding) -> torch.Tensor:
    """The full tensor, on every rank of the mesh (all-gathers over the splitting axes)."""
    expected = sharding.local_shape(mesh)
    if tuple(local.shape) != expected:
        raise ValueError(f"local block of shape {tuple(local.shape)} does not match {sharding} on {mesh}")
    if sharding.parts:
        parts = sharding._part_shardings()
        pieces = local.split(sharding.part_sizes(mesh), sharding.parts_dim)
        fulls = [unshard(t.contiguous(), mesh, p) for t, p in zip(pieces, parts, strict=True)]
        return torch.cat(fulls, sharding.parts_dim)
    out = local
    for d, axes in enumerate(sharding.dims):
        for axis in reversed(axes):
            out = P.all_gather(out, mesh, axis, d)
    for d, size in enumerate(sharding.full_shape):
        if out.shape[d] != size:
            out = out.narrow(d, 0, size)
    return out
