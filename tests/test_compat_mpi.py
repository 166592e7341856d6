"""The torch releases optimus2d supports (``optimus2d/comm/compat.py``): on torch 2.11, whose process
groups sort their ranks, gathers and scatters still follow the mesh's order; what needs a newer torch
is refused on every rank with the version it needs (and its test skipped, with the same reason)."""

from __future__ import annotations

import pytest
import torch

from optimus2d import Mesh
from optimus2d.comm import compat
from optimus2d.comm import primitives as P
from optimus2d.pipeline import lanes

OUT_OF_ORDER = "pipeline groups out of rank order"


def test_torch_versions_parse():
    assert compat.version("2.11.0+cu130") == (2, 11, 0)
    assert compat.version("2.14.0.dev20260101") == (2, 14, 0)
    assert compat.TORCH >= compat.MIN_TORCH


@pytest.mark.mpi
def test_group_collectives_follow_the_mesh_order(world, mesh_shape, monkeypatch):
    """NCCL's path (one all-gather or reduce-scatter over the process group) on a mesh of reversed ranks,
    whose groups torch 2.11 orders otherwise: member m's block is still chunk m."""
    q, d = mesh_shape
    mesh = Mesh(q, d, ranks=list(reversed(range(world.size))))
    monkeypatch.setattr(P, "_direct", lambda mesh: False)
    for axis in ("row", "col", "depth"):
        n, members = mesh.axis_size(axis), mesh.members(axis)
        if n == 1:
            continue
        assert (mesh.group_order(axis) is None) == compat.KEEPS_ORDER, axis
        t = torch.arange(6.0).view(2, 3) + 100 * mesh.rank
        want = torch.cat([torch.arange(6.0).view(2, 3) + 100 * r for r in members], dim=1)
        assert torch.equal(P.all_gather(t, mesh, axis, 1), want), axis
        chunks = torch.arange(2.0 * n).view(n, 2) * (mesh.rank + 1)  # chunk m goes to member m
        got = P.reduce_scatter(chunks, mesh, axis, 0)
        assert torch.equal(got, chunks[mesh.index(axis)].view(1, 2) / (mesh.rank + 1) * sum(r + 1 for r in members))
        blocks = P.Blocks(t, mesh, axis)
        assert all(torch.equal(blocks.get(m), t - 100 * mesh.rank + 100 * members[m]) for m in range(n)), axis


def _lanes_out_of_rank_order(world):
    """Two stage meshes of 1×1×2 whose ranks run (0, 3) and (2, 1): lanes (0, 2) and (3, 1)."""
    if world.size != 4:
        pytest.skip("runs on 4 ranks")
    mesh = Mesh(1, 2, ranks=(0, 3) if world.rank in (0, 3) else (2, 1))
    return mesh, lanes(mesh)


@pytest.mark.mpi
@pytest.mark.skipif(compat.missing(OUT_OF_ORDER) is not None, reason=str(compat.missing(OUT_OF_ORDER)))
def test_lanes_out_of_rank_order(world):
    import torch.distributed as dist

    _, pipe = _lanes_out_of_rank_order(world)
    assert pipe.lane_ranks == ((0, 2) if world.rank in (0, 2) else (3, 1))
    assert tuple(dist.get_process_group_ranks(pipe.lane)) == pipe.lane_ranks


@pytest.mark.mpi
@pytest.mark.skipif(compat.missing(OUT_OF_ORDER) is None, reason="torch keeps a group's order: nothing to refuse")
def test_lanes_out_of_rank_order_need_a_newer_torch_on_every_rank(world):
    with pytest.raises(RuntimeError, match=rf"needs torch >= 2\.13 \(this is {compat.torch_version()}\)"):
        _lanes_out_of_rank_order(world)
