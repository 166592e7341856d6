"""Pipeline stages on sub-meshes, driven by torch's schedules (``torch.distributed.pipelining``).

A model is cut into stages; every stage runs on its own ``Mesh`` of one shape over a disjoint set
of ranks (the meshes are replicas in ``Mesh``'s sense: stage s is replica s, ordered by smallest
rank). On 8 ranks, 2 stages × 2×2::

    stage 0 (ranks 0..3)        stage 1 (ranks 4..7)
         j=0  j=1                    j=0  j=1
    i=0   0    1               i=0    4    5
    i=1   2    3               i=1    6    7

A *lane* is the ranks with the same (k, i, j) in every stage's mesh, in stage order: {0, 4},
{1, 5}, {2, 6}, {3, 7}. Equal layouts hold the same block of an activation, so a stage's output
block ``[b/(d·q), s, h/q]`` travels unchanged to the rank of its lane in the next stage (no gather,
no re-split). The lane is the ``group=`` of torch's ``PipelineStage``; any torch schedule drives it::

    pipe = optimus2d.pipeline.stage_meshes(2, q=2)                 # collective over the world
    chunk = optimus2d.parallelize(chunks[pipe.stage], pipe.mesh)   # this rank's stage of the model
    stage = optimus2d.pipeline.pipeline_stage(chunk, pipe, microbatch_shape=(b // n, s, h))
    schedule = Schedule1F1B(stage, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
    if pipe.stage == 0:
        schedule.step(optimus2d.scatter(x, pipe.mesh))             # the rank's block of the batch
    elif pipe.stage == pipe.stages - 1:
        schedule.step(target=target_block, losses=losses)
    else:
        schedule.step()

``loss_fn(output_block, target_block)`` must return the micro-batch's loss, the same on every rank
of the last stage's mesh (``optimus2d.cross_entropy``, or ``mesh_sum`` of a local sum). torch
splits each rank's block into micro-batches along dim 0: micro-batch m holds the m-th slice of
every batch block, a different set of samples than serial ``x.chunk(n)[m]``, which changes nothing
for losses that are sums (``scale_grads=False``) or equal-sized means (``scale_grads=True``) over
samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from optimus2d.comm.functional import activation_sharding, all_reduce, batch_sharding
from optimus2d.comm.mesh import Mesh

__all__ = ["SCHEDULES", "StageMesh", "lanes", "mesh_sum", "pipeline_stage", "stage_meshes"]

# torch's schedules by name → (the class, the stages pipeline rank s of p runs: one, looped, or V-shaped)
SCHEDULES = {
    "GPipe": (pipelining.ScheduleGPipe, lambda s, p: [s]),
    "1F1B": (pipelining.Schedule1F1B, lambda s, p: [s]),
    "Interleaved1F1B": (pipelining.ScheduleInterleaved1F1B, lambda s, p: [s, s + p]),
    "LoopedBFS": (pipelining.ScheduleLoopedBFS, lambda s, p: [s, s + p]),
    "InterleavedZeroBubble": (pipelining.ScheduleInterleavedZeroBubble, lambda s, p: [s, s + p]),
    "ZBVZeroBubble": (pipelining.ScheduleZBVZeroBubble, lambda s, p: [s, 2 * p - 1 - s]),
    "DualPipeV": (pipelining.ScheduleDualPipeV, lambda s, p: [s, 2 * p - 1 - s]),
}


@dataclass(frozen=True)
class StageMesh:
    """This rank's place in a pipeline of ``stages`` meshes of one shape.

    ``mesh``: its stage's mesh; ``stage``: that stage's index (the mesh's replica index);
    ``lane``: the process group of the ranks at this rank's (k, i, j) in every stage's mesh, group
    rank = stage index (None when there is one stage); ``lane_ranks``: their global ranks.
    """

    mesh: Mesh
    stage: int
    stages: int
    lane: dist.ProcessGroup | None
    lane_ranks: tuple[int, ...]


def stage_meshes(
    stages: int, q: int, depth: int = 1, *, transport: str | None = None, check: str | None = None
) -> StageMesh:
    """Split the world into ``stages`` meshes ``Mesh(q, depth)``: stage s on ranks s·p .. s·p + p - 1
    (p = depth·q²), and their lanes. Collective: every rank of the world calls it, at the same point."""
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stage_meshes needs a positive number of stages, got {stages!r}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    p = depth * q * q if isinstance(q, int) and isinstance(depth, int) else 0
    if p < 1 or stages * p != world:
        raise ValueError(
            f"stage_meshes: {stages} stages of Mesh(q={q}, depth={depth}) need {stages}·{max(p, 0)} = "
            f"{stages * max(p, 0)} ranks but the world has {world}"
        )
    rank = dist.get_rank() if world > 1 else 0
    s = rank // p
    mesh = Mesh(q, depth, ranks=range(s * p, (s + 1) * p), transport=transport, check=check)
    return lanes(mesh)


def lanes(mesh: Mesh) -> StageMesh:
    """The pipeline whose stages are ``mesh``'s replicas (``Mesh(ranks=...)`` per stage, or
    ``Mesh.from_device_mesh`` with a leading "pp" dim), in the order of ``mesh.replicas``.

    Collective over the world: creates one lane group per mesh position, on every rank, in the
    same order (``dist.new_group``).
    """
    replicas = mesh.replicas
    if mesh.coord is None:
        raise ValueError(f"lanes: rank {mesh.rank} is not in {mesh}; every rank must be in a stage's mesh")
    position = mesh.ranks.index(mesh.rank)
    lane, lane_ranks = None, tuple(r[position] for r in replicas)
    if len(replicas) > 1:
        for n in range(mesh.size):  # every lane on every rank: creating a group is collective
            members = [r[n] for r in replicas]
            group = dist.new_group(members, sort_ranks=False)
            if n == position:
                lane = group
    return StageMesh(mesh, mesh.replica, len(replicas), lane, lane_ranks)


def pipeline_stage(
    chunk: nn.Module,
    pipe: StageMesh,
    *,
    microbatch_shape: Sequence[int],
    output_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    stage_index: int | None = None,
    num_stages: int | None = None,
    token_ids: bool = False,
    input_layout: str = "activation",
    input_dtype: torch.dtype | None = None,
    input_grad: bool | None = None,
    output_grad: bool = True,
):
    """torch's ``PipelineStage`` of ``chunk`` (already converted on ``pipe.mesh``), over the lane.

    ``microbatch_shape``: the full (serial) shape ``[b/n, ..., h]`` of one micro-batch's activation
    entering the stage; the stage receives and sends this rank's block ``[b/(n·d·q), ..., h/q]``.
    ``output_shape``: the same for its output (default: ``microbatch_shape``). Given both, torch's
    stage runs in its static mode: no trial forward or backward to infer shapes, so the mesh's
    collectives run only on real micro-batches. ``dtype``: of the activations (default: of the
    chunk's first floating-point parameter). ``stage_index``/``num_stages``: for schedules with
    several stages per rank (``ScheduleInterleaved1F1B``: stage ``pipe.stage + v·pipe.stages`` of
    ``V·pipe.stages``; ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: stages ``pipe.stage`` and
    ``2·pipe.stages - 1 - pipe.stage``; each chunk converted on the same ``pipe.mesh``); default one per rank.
    ``token_ids``: the stage (the first) takes integer ids ``[b/n, s]``, split along the batch only
    (``scatter_batch``: ``[b/(n·d·q), s]``), not an activation; the same as ``input_layout="batch",
    input_dtype=torch.long``. ``input_layout="batch"``: the input is split along the batch only
    (``scatter_batch``, e.g. images ``[b/n, C, H, W]`` → ``[b/(n·d·q), C, H, W]``), of ``input_dtype``
    (default ``dtype``). ``input_grad``: whether a gradient travels back from this stage's input
    (default: for an activation into any stage but the first); ``output_grad``: whether one comes back
    to its output (False for a frozen stage whose output needs none, e.g. a frozen encoder's features).
    """
    from torch.distributed.pipelining import PipelineStage

    mesh = pipe.mesh
    stage_index = pipe.stage if stage_index is None else stage_index
    num_stages = pipe.stages if num_stages is None else num_stages
    if num_stages % pipe.stages or not 0 <= stage_index < num_stages:
        raise ValueError(
            f"pipeline_stage: stage_index={stage_index} of num_stages={num_stages} does not fit a pipeline of "
            f"{pipe.stages} stage meshes (num_stages must be a multiple of it)"
        )
    if dtype is None:
        floats = [p.dtype for p in chunk.parameters() if p.is_floating_point()]
        dtype = floats[0] if floats else torch.get_default_dtype()
    if token_ids:
        input_layout, input_dtype = "batch", torch.long
    if input_layout not in ("activation", "batch"):
        raise ValueError(f"pipeline_stage: input_layout={input_layout!r} is not 'activation' or 'batch'")
    device = mesh.device
    splits = (mesh.depth * mesh.q, mesh.q)
    blocks = []
    for what, shape in (("microbatch_shape", microbatch_shape), ("output_shape", output_shape or microbatch_shape)):
        shape = tuple(int(size) for size in shape)
        if input_layout == "batch" and what == "microbatch_shape":  # ids, images: batch blocks
            if len(shape) < 1 or shape[0] % splits[0]:
                raise ValueError(
                    f"pipeline_stage: {input_layout} microbatch_shape={shape} must be [b, ...] with b divisible by "
                    f"depth·q = {splits[0]} (mesh {mesh})"
                )
            local = batch_sharding(shape).local_shape(mesh)
            kind = input_dtype or dtype
            grad = bool(input_grad) and kind.is_floating_point
            blocks.append(torch.empty(local, dtype=kind, device="meta", requires_grad=grad))
            continue
        if len(shape) < 2 or shape[0] % splits[0] or shape[-1] % splits[1]:
            raise ValueError(
                f"pipeline_stage: {what}={shape} must be [b, ..., h] with b divisible by depth·q = {splits[0]} "
                f"and h by q = {splits[1]} (mesh {mesh})"
            )
        # meta tensors: torch reads shape, dtype and requires_grad (whether a gradient travels back: from every
        # output, and to the input of every stage but the first)
        if what == "output_shape":
            grad = output_grad
        else:
            grad = stage_index > 0 if input_grad is None else input_grad
        local = activation_sharding(shape).local_shape(mesh)
        blocks.append(torch.empty(local, dtype=dtype, device="meta", requires_grad=grad))
    return PipelineStage(
        chunk, stage_index, num_stages, device, input_args=blocks[0], output_args=blocks[1], group=pipe.lane
    )


def mesh_sum(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Σ of ``x`` (a block) over every rank of ``mesh``: the global sum, the same on every rank.

    forward: all-reduce over the mesh; backward: identity (each rank's block gets its own gradient).
    """
    return all_reduce(x.sum(), mesh, ("depth", "col", "row"))
