"""Pipeline stages on sub-meshes, driven by torch's schedules (``torch.distributed.pipelining``).

A model is cut into stages; every stage runs on its own ``Mesh`` over a disjoint set of ranks, by
default all of one shape (the meshes are replicas in ``Mesh``'s sense: stage s is replica s, ordered
by smallest rank; stages of different shapes: below). On 8 ranks, 2 stages × 2×2::

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
samples. ``scatter_microbatches(x, mesh, n)`` gives the block whose micro-batch m is this rank's
block of serial ``x.chunk(n)[m]``.

**Stages of different shapes** (``pipeline/layouts.py``): the same number of ranks p in every
stage, each its own (q, depth): ``stage_meshes(2, q=(2, 1), depth=(1, 4))`` on 8 ranks is a 2×2
stage on 0..3 then a 1×1×4 stage on 4..7; ``q=(1, 2), depth=(4, 1)`` puts a frozen
vision encoder, batch split only, before a 2×2 LLM. The lane pairs the n-th rank of each stage's
mesh. Where the next stage's shape differs, ``pipeline_stage`` wraps the chunk in ``ToNextStage``:
its output block moves on the sending stage's ranks to the next stage's shape over those ranks
(``pipe.meshes[next]``, by ``redistribute``; backward moves the gradient back), is declared to
torch in that shape ``[b/(n·d'·q'), ..., h/q']``, and travels the lane unchanged. A micro-batch is
then a global tensor re-split at each boundary, so feed the first stage and the last stage's
targets with ``scatter_microbatches`` (``scatter``'s m-th slices are other samples on another
mesh). Stages of unequal sizes are refused with the same ``ValueError`` on every rank: those run on
``rank_sets`` (``pipeline/rank_sets.py``), each stage on its own ranks, of any size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from optimus2d.comm import replicas, watch
from optimus2d.comm.functional import activation_sharding, all_reduce, batch_sharding
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sequence import sequence_batch_sharding, sequence_sharding
from optimus2d.context.parallel import ContextParallel
from optimus2d.pipeline.data_parallel import DataParallelStage, LaneStage, note_copies, pipeline_groups
from optimus2d.pipeline.layouts import ToNextStage, stage_shapes
from optimus2d.pipeline.rank_sets import RankSets, rank_set_stage

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
    """This rank's place in a pipeline of ``stages`` meshes of p ranks each.

    ``mesh``: its stage's mesh; ``stage``: that stage's index (the mesh's replica index);
    ``lane``: the process group of the n-th rank of every stage's mesh (n: this rank's position in
    its mesh, the same (k, i, j) where the shapes are equal), group rank = stage index (None when
    there is one stage); ``lane_ranks``: their global ranks. ``meshes[t]``: a mesh of stage t's shape
    over this rank's stage's ranks (``meshes[stage] is mesh``; the same object for equal shapes),
    the layout its output takes to go to stage t; default ``(mesh,) * stages``. ``dp``: the
    pipeline's data-parallel replicas (``pipeline/data_parallel.py``), ``dp_rank`` this rank's,
    ``dp_group``/``dp_ranks`` the ranks at its place in every replica (None: one replica).
    """

    mesh: Mesh
    stage: int
    stages: int
    lane: dist.ProcessGroup | None
    lane_ranks: tuple[int, ...]
    meshes: tuple[Mesh, ...] = ()
    dp: int = 1
    dp_rank: int = 0
    dp_group: dist.ProcessGroup | None = None
    dp_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.meshes:
            object.__setattr__(self, "meshes", (self.mesh,) * self.stages)

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Every stage's (q, depth)."""
        return tuple((m.q, m.depth) for m in self.meshes)

    def stage_ranks(self, stage: int, replica: int | None = None) -> tuple[int, ...]:
        """The global ranks of stage mesh ``stage`` of data-parallel ``replica`` (default this rank's)."""
        return self.mesh.replicas[stage * self.dp + (self.dp_rank if replica is None else replica)]


def stage_meshes(
    stages: int,
    q: int | Sequence[int],
    depth: int | Sequence[int] = 1,
    *,
    dp: int = 1,
    transport: str | None = None,
    check: str | None = None,
) -> StageMesh:
    """Split the world into ``stages`` meshes: stage s is ``Mesh(q_s, depth_s)`` on ranks
    s·p .. s·p + p - 1, and their lanes. ``q``, ``depth``: every stage's, or one per stage, each
    stage of the same p = depth_s·q_s² ranks (``stage_meshes(2, q=(2, 1), depth=(1, 4))`` on 8
    ranks: a 2×2 stage on 0..3, a 1×1×4 one on 4..7; ``pipeline/layouts.py``). ``dp``: that many
    data-parallel copies of the pipeline, stage s of copy r on ranks (s·dp + r)·p ..
    (``pipeline/data_parallel.py``; ``pipeline_stage`` then averages each stage's gradients over them).

    Collective: every rank of the world calls it, at the same point, with the same arguments (one
    all-gather over the world checks that first). A refusal (stages of unequal sizes, a world they do
    not split) is the same ``ValueError`` on every rank, before any mesh or group is built.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    shapes, error = stage_shapes(stages, q, depth, world, dp)
    if world > 1:  # the same stages on every rank, or the same error everywhere
        options = f"dp={dp!r}, transport={transport!r}, check={check!r}"
        asked = f"stage_meshes({stages!r}, shapes={shapes or (q, depth)!r}, {options})"
        replicas.agree_world("stage_meshes", asked, error, watch.collective_timeout())
    elif error is not None:
        raise error
    p = shapes[0][1] * shapes[0][0] ** 2
    m = (dist.get_rank() if world > 1 else 0) // p  # this rank's stage mesh: stage s of replica r, m = s·dp + r
    built: dict[tuple[int, int], Mesh] = {}
    for shape in shapes:  # one mesh per shape, in order, on every rank: replicas over the stages' ranks
        if shape not in built:
            built[shape] = Mesh(*shape, ranks=range(m * p, (m + 1) * p), transport=transport, check=check)
    if len(built) > 1:  # each boundary re-splits a micro-batch as serial chunk(n)[m]: noted for the targets
        for made in built.values():
            made.__dict__["_optimus2d_stage_shapes"] = tuple(shapes)
    return replace(lanes(built[shapes[m // dp]], dp=dp), meshes=tuple(built[shape] for shape in shapes))


def lanes(mesh: Mesh, dp: int = 1) -> StageMesh:
    """The pipeline whose stages are ``mesh``'s replicas (``Mesh(ranks=...)`` per stage, or
    ``Mesh.from_device_mesh`` with a leading "pp" dim), in the order of ``mesh.replicas``; with
    ``dp``, ``dp`` copies of it, replica mesh s·dp + r being stage s of copy r (a DeviceMesh's
    ("pp", "dp", ...) dims).

    Collective over the world: creates one lane group per mesh position (and copy), then one dp
    group per stage and position, on every rank, in the same order (``dist.new_group``).
    """
    replicas = mesh.replicas
    if mesh.coord is None:
        raise ValueError(f"lanes: rank {mesh.rank} is not in {mesh}; every rank must be in a stage's mesh")
    if not isinstance(dp, int) or dp < 1 or len(replicas) % dp:
        raise ValueError(f"lanes: dp={dp!r} does not divide the {len(replicas)} meshes of {mesh} into copies")
    lane, lane_ranks, dp_group, dp_ranks = pipeline_groups(replicas, dp, mesh.replica, mesh.ranks.index(mesh.rank))
    stage, replica = divmod(mesh.replica, dp)
    note_copies(mesh, dp, dp_group, dp_ranks)  # the loss helpers count the targets of every copy
    return StageMesh(mesh, stage, len(replicas) // dp, lane, lane_ranks, (), dp, replica, dp_group, dp_ranks)


def pipeline_stage(
    chunk: nn.Module,
    pipe: StageMesh | RankSets,
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
    next_stage: int | None = None,
    context: ContextParallel | None = None,
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

    Stages of different shapes (``stage_meshes(q=(…), depth=(…))``): the output block is declared,
    and sent, in the shape of the stage mesh that receives it, ``pipe.meshes[next_stage]``:
    ``[b/(n·d'·q'), ..., h/q']``; where that shape is not ``pipe.mesh``'s the chunk is wrapped in
    ``ToNextStage`` (``stage.submod.chunk`` is ``chunk``). ``next_stage``: the stage mesh that runs
    torch stage ``stage_index + 1``; default ``(stage_index + 1) % pipe.stages``, right for GPipe, 1F1B
    and the looped schedules; V-shaped ones (``ZBVZeroBubble``, ``DualPipeV``) pass it
    (``stage_index + 1`` below ``pipe.stages``, else ``2·pipe.stages − 2 − stage_index``); ignored for
    the last stage, whose output stays on ``pipe.mesh``. Data-parallel copies (``pipe.dp > 1``): a
    ``DataParallelStage``, which averages the gradients over ``pipe.dp_group`` at the step's last
    backward (``pipeline/data_parallel.py``). ``context``: the chunk runs with its sequence split
    over ``pipe.mesh``'s depth (``context.ContextParallel(pipe.mesh)``; a chunk that knows how, with a
    ``context`` attribute: ``LlamaStage``), and receives and sends sequence blocks
    ``[b/(n·q), s/d, ..., h/q]`` (ids ``[b/(n·q), s/d]``: ``context.scatter_batch``); every stage mesh
    of one shape. Every step of a torch schedule on these stages first
    agrees over the whole pipeline (``pipeline/agreement.py``): one schedule, one micro-batch count,
    each stage mesh fed alike in every copy and its first stage fed ``n`` of ``microbatch_shape``;
    else the same ``ValueError`` on every rank, before anything is sent.

    ``pipe`` a ``RankSets`` (stages on rank sets of different sizes, ``pipeline/rank_sets.py``): one
    torch stage per set, activations re-split between the sets' meshes; ``stage_index``,
    ``num_stages``, ``next_stage`` and ``context`` do not apply.
    """
    if token_ids:
        input_layout, input_dtype = "batch", torch.long
    if isinstance(pipe, RankSets):
        given = {"stage_index": stage_index, "num_stages": num_stages, "next_stage": next_stage, "context": context}
        if any(v is not None for v in given.values()):
            named = ", ".join(f"{k}=" for k, v in given.items() if v is not None)
            raise ValueError(f"pipeline_stage: {named} does not apply to stages on rank sets (one stage per set)")
        return rank_set_stage(
            chunk, pipe, microbatch_shape=microbatch_shape, output_shape=output_shape, dtype=dtype,
            input_layout=input_layout, input_dtype=input_dtype, input_grad=input_grad, output_grad=output_grad,
        )  # fmt: skip

    mesh = pipe.mesh
    stage_index, num_stages = _stage_place(pipe, stage_index, num_stages)
    if dtype is None:
        floats = [p.dtype for p in chunk.parameters() if p.is_floating_point()]
        dtype = floats[0] if floats else torch.get_default_dtype()
    if input_layout not in ("activation", "batch"):
        raise ValueError(f"pipeline_stage: input_layout={input_layout!r} is not 'activation' or 'batch'")
    out_mesh = _receiving_mesh(pipe, stage_index, num_stages, next_stage)
    device = mesh.device
    output_shape = output_shape or microbatch_shape
    if context is not None:  # sequence blocks in and out
        ids = input_layout == "batch"
        grad = stage_index > 0 if input_grad is None else input_grad
        ends = ((microbatch_shape, input_dtype or dtype, ids, grad), (output_shape, dtype, False, output_grad))
        return _sequence_stage(chunk, pipe, context, ends, (stage_index, num_stages))
    # meta tensors: torch reads shape, dtype and requires_grad (whether a gradient travels back: from every
    # output, and to the input of every stage but the first)
    shape = tuple(int(size) for size in microbatch_shape)
    if input_layout == "batch":  # ids, images: batch blocks
        inputs = _batch_block(shape, mesh, input_dtype or dtype, input_grad)
    else:
        grad = stage_index > 0 if input_grad is None else input_grad
        inputs = _activation_block("microbatch_shape", shape, (mesh,), mesh, dtype, grad)
    shape = tuple(int(size) for size in output_shape)
    outputs = _activation_block("output_shape", shape, (mesh, out_mesh), mesh, dtype, output_grad)
    if (out_mesh.q, out_mesh.depth) != (mesh.q, mesh.depth):
        chunk = ToNextStage(chunk, mesh, out_mesh)
    args = (chunk, stage_index, num_stages, device)
    kwargs = {"input_args": inputs, "output_args": outputs, "group": pipe.lane, "pipe": pipe}
    if pipe.dp_group is not None:  # data-parallel copies: gradients averaged over them
        return DataParallelStage(*args, **kwargs, dp_group=pipe.dp_group, mesh=mesh)
    return LaneStage(*args, **kwargs)


def _sequence_stage(chunk, pipe: StageMesh, context, ends, place: tuple[int, int]):
    """``pipeline_stage`` of a chunk that takes and returns sequence blocks (context parallelism);
    ``ends``: (full shape, dtype, ids or not, gradient or not) of its input and of its output."""
    mesh = pipe.mesh
    if not isinstance(context, ContextParallel) or context.mesh is not mesh:
        raise ValueError(f"pipeline_stage: context= must be a context.ContextParallel on this stage's mesh {mesh}")
    if any((m.q, m.depth) != (mesh.q, mesh.depth) for m in pipe.meshes):  # the same answer on every stage
        raise ValueError("pipeline_stage: a context-parallel pipeline needs every stage mesh of one shape")
    context.split(int(ends[0][0][1]))  # a sequence the split refuses: refused here, on every stage alike
    if not hasattr(chunk, "context"):
        raise TypeError(f"pipeline_stage: {type(chunk).__name__} does not say how to run with its sequence split")
    chunk.context = context
    blocks = []
    for what, (shape, dtype, ids, grad) in zip(("microbatch_shape", "output_shape"), ends, strict=True):
        shape = tuple(int(n) for n in shape)
        splits = [(0, mesh.q), (1, mesh.depth)] + ([] if ids else [(len(shape) - 1, mesh.q)])
        if len(shape) < 2 or any(shape[dim] % n for dim, n in splits):
            raise ValueError(
                f"pipeline_stage: {what}={shape} must be [b, s, ...] with b divisible by q = {mesh.q}, s by depth "
                f"= {mesh.depth}{'' if ids else f' and h by q = {mesh.q}'} (sequence blocks, {mesh})"
            )
        layout = sequence_batch_sharding if ids else sequence_sharding
        grad = bool(grad) and dtype.is_floating_point
        blocks.append(torch.empty(layout(shape).local_shape(mesh), dtype=dtype, device="meta", requires_grad=grad))
    args = (chunk, *place, mesh.device)
    kwargs = {"input_args": blocks[0], "output_args": blocks[1], "group": pipe.lane, "pipe": pipe}
    if pipe.dp_group is not None:
        return DataParallelStage(*args, **kwargs, dp_group=pipe.dp_group, mesh=mesh)
    return LaneStage(*args, **kwargs)


def _stage_place(pipe: StageMesh, stage_index: int | None, num_stages: int | None) -> tuple[int, int]:
    """``stage_index`` and ``num_stages`` (default: one torch stage per stage mesh), checked against ``pipe``."""
    stage_index = pipe.stage if stage_index is None else stage_index
    num_stages = pipe.stages if num_stages is None else num_stages
    if num_stages % pipe.stages or not 0 <= stage_index < num_stages:
        raise ValueError(
            f"pipeline_stage: stage_index={stage_index} of num_stages={num_stages} does not fit a pipeline of "
            f"{pipe.stages} stage meshes (num_stages must be a multiple of it)"
        )
    return stage_index, num_stages


def _receiving_mesh(pipe: StageMesh, stage_index: int, num_stages: int, next_stage: int | None) -> Mesh:
    """The layout the stage's output is sent in: the next stage's shape (the last stage's stays on its mesh)."""
    if stage_index >= num_stages - 1:
        return pipe.mesh
    receiver = (stage_index + 1) % pipe.stages if next_stage is None else next_stage
    if not isinstance(receiver, int) or not 0 <= receiver < pipe.stages:
        raise ValueError(f"pipeline_stage: next_stage={next_stage!r} is not a stage mesh of 0..{pipe.stages - 1}")
    return pipe.meshes[receiver]


def _batch_block(shape: tuple[int, ...], mesh: Mesh, dtype: torch.dtype, input_grad: bool | None) -> torch.Tensor:
    """The meta tensor of this rank's block of an input split along the batch only (ids, images)."""
    split = mesh.depth * mesh.q
    if len(shape) < 1 or shape[0] % split:
        raise ValueError(
            f"pipeline_stage: batch microbatch_shape={shape} must be [b, ...] with b divisible by "
            f"depth·q = {split} (mesh {mesh})"
        )
    grad = bool(input_grad) and dtype.is_floating_point
    return torch.empty(batch_sharding(shape).local_shape(mesh), dtype=dtype, device="meta", requires_grad=grad)


def _activation_block(
    what: str, shape: tuple[int, ...], on: tuple[Mesh, ...], mesh: Mesh, dtype: torch.dtype, grad: bool
) -> torch.Tensor:
    """The meta tensor of this rank's block of an activation ``[b, ..., h]``, in the layout of ``on[-1]``."""
    splits = (math.lcm(*(m.depth * m.q for m in on)), math.lcm(*(m.q for m in on)))
    sent = f", sent as Mesh(q={on[-1].q}, depth={on[-1].depth})" if on[-1] is not mesh else ""
    if len(shape) < 2 or shape[0] % splits[0] or shape[-1] % splits[1]:
        raise ValueError(
            f"pipeline_stage: {what}={shape} must be [b, ..., h] with b divisible by depth·q = {splits[0]} "
            f"and h by q = {splits[1]} (mesh {mesh}{sent})"
        )
    local = activation_sharding(shape).local_shape(on[-1])
    return torch.empty(local, dtype=dtype, device="meta", requires_grad=grad)


def mesh_sum(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Σ of ``x`` (a block) over every rank of ``mesh``: the global sum, the same on every rank.

    forward: all-reduce over the mesh; backward: identity (each rank's block gets its own gradient).
    """
    return all_reduce(x.sum(), mesh, ("depth", "col", "row"))
