"""Pipeline stages of different mesh shapes: the pieces ``optimus2d.pipeline`` uses for them.

Every stage has the same number of ranks p, each its own (q, depth) with depth·q² = p; the lane
still pairs the n-th rank of every stage. On 8 ranks, a 2×2 stage then a 1×1×4 one::

    stage 0: Mesh(2, 1)          its output as Mesh(1, 4)           stage 1: Mesh(1, 4)
         j=0  j=1                     n=0  1  2  3                       n=0  1  2  3
    i=0   0    1    ─redistribute─▶     0  1  2  3     ─lane n─▶           4  5  6  7
    i=1   2    3    (on ranks 0..3)

Where two consecutive stages differ, the sender converts its output block on its own ranks, from
its mesh's layout to the next stage's shape laid over the same ranks (``redistribute``, autograd:
backward converts the gradient back), then the block travels along the lane unchanged: rank n of
the next stage receives exactly its block. Equal shapes convert nothing.

Meshes: ``stage_meshes`` builds, on every rank, one ``Mesh`` per distinct shape over its own
stage's ranks, in the order the shapes first appear. Each is a set of replicas of one shape over
the same split of the world, so ``Mesh``'s replica rule and its agreement hold unchanged; a rank
of stage s uses the one of its own shape as its mesh and that of stage t's shape to send to t
(``StageMesh.meshes[t]``; interleaved schedules send from the last stage mesh back to the first).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from optimus2d.comm.functional import gather, scatter, scatter_batch
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.redistribution import redistribute

__all__ = ["ToNextStage", "gather_microbatches", "scatter_microbatches", "stage_shapes"]


def stage_shapes(
    stages: int, q: int | Sequence[int], depth: int | Sequence[int], world: int, dp: int = 1
) -> tuple[tuple[tuple[int, int], ...], ValueError | None]:
    """Each stage's ``(q, depth)`` (an int is every stage's), and why they do not split a world of
    ``world`` ranks into ``dp`` replicas of ``stages`` stages of one size (None if they do). No
    communication."""
    for name, value in (("stages", stages), ("dp", dp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return (), ValueError(f"stage_meshes needs a positive number {name}, got {name}={value!r}")
    per_stage = []
    for name, value in (("q", q), ("depth", depth)):
        values = [value] * stages if isinstance(value, int) else list(value) if isinstance(value, Sequence) else None
        if values is None or len(values) != stages:
            return (), ValueError(f"stage_meshes: {name}={value!r} must be an int or one per stage ({stages})")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
            return (), ValueError(f"stage_meshes needs positive integers q and depth, got {name}={value!r}")
        per_stage.append(values)
    shapes = tuple(zip(*per_stage, strict=True))
    sizes = [d * qs * qs for qs, d in shapes]
    if len(set(sizes)) > 1:
        listed = "; ".join(f"stage {s}: Mesh(q={qs}, depth={d}), {sizes[s]} ranks" for s, (qs, d) in enumerate(shapes))
        return shapes, ValueError(
            f"stage_meshes: the stages have different numbers of ranks ({listed}); every stage needs the same "
            f"number depth·q², so that a lane pairs the n-th rank of each (stages of different sizes: "
            f"optimus2d.pipeline.rank_sets)"
        )
    if dp * stages * sizes[0] != world:
        (qs, d), p = shapes[0], sizes[0]
        what = f"Mesh(q={qs}, depth={d})" if len(set(shapes)) == 1 else f"meshes of {p} ranks"
        times = f"dp={dp} replicas of " if dp > 1 else ""
        n = f"{dp}·{stages}·{p}" if dp > 1 else f"{stages}·{p}"
        need = f"{times}{stages} stages of {what} need {n} = {dp * stages * p} ranks"
        return shapes, ValueError(f"stage_meshes: {need} but the world has {world}")
    return shapes, None


class ToNextStage(nn.Module):
    """``chunk`` whose output block moves from ``src``'s layout to ``dst``'s, over the same ranks.

    Output: global ``[b, ..., h]``; per rank ``[b/(d_s·q_s), ..., h/q_s]`` from ``chunk`` →
    ``[b/(d_d·q_d), ..., h/q_d]``. forward: ``redistribute`` (point to point over ``src``'s ranks);
    backward: the gradient converted back. ``pipeline_stage`` wraps a chunk in it where the next
    stage's mesh has another shape; the parameters are ``chunk``'s (``self.chunk``).
    """

    def __init__(self, chunk: nn.Module, src: Mesh, dst: Mesh) -> None:
        super().__init__()
        self.chunk, self.src, self.dst = chunk, src, dst

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.chunk(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"ToNextStage: the chunk returned {type(out).__name__}, not one activation tensor")
        return redistribute(out, self.src, self.dst, layout="activation")

    def extra_repr(self) -> str:
        return f"Mesh(q={self.src.q}, depth={self.src.depth}) → Mesh(q={self.dst.q}, depth={self.dst.depth})"


def scatter_microbatches(x: torch.Tensor, mesh: Mesh, n: int, *, layout: str = "activation") -> torch.Tensor:
    """Full ``x`` ``[b, ..., h]`` (the same on every rank) → this rank's block ``[b/(d·q), ..., h/q]``
    ("batch": ``[b/(d·q), ...]``) whose n slices along dim 0, torch's micro-batches, are this rank's
    blocks of the serial micro-batches ``x.chunk(n)[m]``, m = 0..n-1.

    Stages of different shapes need it: a micro-batch is then a global tensor that each boundary
    re-splits, so the last stage's targets must follow serial micro-batches, not ``scatter``'s
    (micro-batch m of ``scatter(x, mesh)`` is the m-th slice of every batch block, a sample set that
    depends on the mesh). Give the first stage ``scatter_microbatches(x, first_mesh, n)`` and the
    last ``scatter_microbatches(target, last_mesh, n)``; read the last stage's output back with
    ``gather_microbatches(out, last_mesh, n)``. forward: a permutation of the batch, then
    ``scatter`` (or ``scatter_batch``); backward: the gradient gathered and permuted back.
    """
    if layout not in ("activation", "batch"):
        raise ValueError(f"scatter_microbatches: layout={layout!r} is not 'activation' or 'batch'")
    blocks = mesh.depth * mesh.q
    if not isinstance(n, int) or n < 1 or x.dim() < 1 or x.shape[0] % (n * blocks):
        raise ValueError(
            f"scatter_microbatches: batch dim 0 of {tuple(x.shape)} is not divisible by n·depth·q = {n}·{blocks} "
            f"({mesh})"
        )
    rest = tuple(x.shape[1:])
    # [n, d·q, b/(n·d·q), ...] → [d·q, n, b/(n·d·q), ...]: batch block c holds block c of every micro-batch
    ordered = x.reshape(n, blocks, x.shape[0] // (n * blocks), *rest).transpose(0, 1).reshape(x.shape)
    block = scatter(ordered, mesh) if layout == "activation" else scatter_batch(ordered, mesh)
    block._optimus2d_microbatches = n  # what a pipeline step of stages of different shapes asks of it
    return block


def gather_microbatches(x_local: torch.Tensor, mesh: Mesh, n: int) -> torch.Tensor:
    """The inverse of ``scatter_microbatches``: this rank's block ``[b/(d·q), ..., h/q]`` of a last
    stage's output (what ``schedule.eval()``/``step()`` returns: torch's micro-batches merged in
    order) → the full ``[b, ..., h]`` in the serial batch order, on every rank. (``gather`` alone
    gives the rows in ``scatter_microbatches``' order: sample m·(b/n) + r of the serial batch where
    the serial order has another.) forward: ``gather``, then the permutation back; backward: the
    permutation, then ``gather``'s."""
    blocks = mesh.depth * mesh.q
    full = gather(x_local, mesh)
    if not isinstance(n, int) or n < 1 or full.shape[0] % (n * blocks):
        raise ValueError(
            f"gather_microbatches: batch dim 0 of {tuple(full.shape)} is not divisible by n·depth·q = {n}·{blocks} "
            f"({mesh})"
        )
    rest = tuple(full.shape[1:])
    return full.reshape(blocks, n, full.shape[0] // (n * blocks), *rest).transpose(0, 1).reshape(full.shape)
