"""Data-parallel replicas of a pipeline: ``stage_meshes(stages, q, depth, dp=n)``.

The world holds ``dp`` copies of the pipeline, every copy ``stages`` stage meshes of p ranks. Ranks
follow torchtitan's order (pipeline outermost): stage mesh s of replica r is ranks
(s·dp + r)·p .. (s·dp + r + 1)·p − 1, so ``Mesh.replicas[s·dp + r]``, as ``Mesh.from_device_mesh``
orders a DeviceMesh of dims ("pp", "dp", "depth", "row", "col"). On 8 ranks, 2 stages × dp 2 × 1×1×2::

                 replica 0    replica 1
    stage 0        0  1         2  3
    stage 1        4  5         6  7

    lanes (pipeline groups, per replica):    {0, 4}, {1, 5} | {2, 6}, {3, 7}
    dp groups (per stage and mesh position): {0, 2}, {1, 3} | {4, 6}, {5, 7}

Each copy runs the whole schedule on its share of the batch, on its own lanes. ``pipeline_stage``
builds a ``DataParallelStage``: torch's ``PipelineStage`` whose backward, on the step's last backward
of the stage (torch's own ``last_backward``, the point where it lets DDP reduce), averages the
chunk's gradients over the dp group: one all-reduce per dtype of the stage's flattened gradient
blocks, divided by dp, so every copy holds the gradient of the mean of the copies' losses (losses
that are means over equal shares, ``scale_grads=True``, give the serial mean's). Not torch's DDP: its
reducer hears only ``.backward()``, and the zero-bubble schedules compute weight gradients with
``autograd.grad`` (torch's own note in ``perform_reduce_grad``), which left DDP's gradients
unreduced, silently, under InterleavedZeroBubble; this stage reduces under every schedule. Building
the stage broadcasts copy 0's parameters and buffers over the dp group, as DDP does.
"""

from __future__ import annotations

import weakref
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from optimus2d.comm import compat
from optimus2d.comm import primitives as P
from optimus2d.comm.agreement import agree_group
from optimus2d.comm.dtensor import local
from optimus2d.comm.mesh import Mesh
from optimus2d.pipeline.agreement import agree_step

__all__ = ["DataParallelStage", "LaneStage", "copies_of", "note_copies", "pipeline_groups"]

_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stage mesh → (dp, dp_group, dp_ranks)


def note_copies(mesh: Mesh, dp: int, group: dist.ProcessGroup | None, ranks: tuple[int, ...]) -> None:
    """``mesh`` is a stage mesh of a pipeline of ``dp`` data-parallel copies, this rank's place in each
    being ``group`` over ``ranks`` (``lanes`` says so, for the loss helpers of ``pipeline/models/``)."""
    _COPIES[mesh] = (dp, group, ranks)


def copies_of(mesh: Mesh) -> tuple[int, dist.ProcessGroup | None, tuple[int, ...]]:
    """``(dp, dp_group, dp_ranks)`` of the last pipeline built on ``mesh``; ``(1, None, ())`` for none."""
    return _COPIES.get(mesh, (1, None, ()))


def pipeline_groups(
    replicas: tuple[tuple[int, ...], ...], dp: int, index: int, position: int
) -> tuple[dist.ProcessGroup | None, tuple[int, ...], dist.ProcessGroup | None, tuple[int, ...]]:
    """``(lane, lane_ranks, dp_group, dp_ranks)`` of the rank at ``position`` in replica mesh ``index``
    (= s·dp + r) of ``replicas`` (every stage mesh of every replica, in rank order).

    Collective over the world: creates every lane, then every dp group, on every rank in the same
    order (``dist.new_group``); a group of one rank is None (nothing to send).
    """
    stages, size = len(replicas) // dp, len(replicas[0])
    stage, replica = divmod(index, dp)
    lane_ranks = tuple(replicas[t * dp + replica][position] for t in range(stages))
    dp_ranks = tuple(replicas[stage * dp + r][position] for r in range(dp))

    def groups(count: int, members, mine: tuple[int, int]) -> dist.ProcessGroup:
        if not compat.KEEPS_ORDER:  # torch 2.11 sorts a group's ranks: stage (copy) order must be rank order
            if any(list(members(a, n)) != sorted(members(a, n)) for a in range(count) for n in range(size)):
                compat.require("pipeline groups out of rank order")
        found = None
        for a in range(count):  # every group on every rank: creating one is collective
            for n in range(size):
                group = compat.new_group(members(a, n))
                found = group if (a, n) == mine else found
        return found

    lane = dp_group = None
    if stages > 1:  # lane (r, n): place n of every stage of copy r
        lane = groups(dp, lambda r, n: [replicas[t * dp + r][n] for t in range(stages)], (replica, position))
    if dp > 1:  # dp group (t, n): place n of stage t in every copy
        dp_group = groups(stages, lambda t, n: [replicas[t * dp + r][n] for r in range(dp)], (stage, position))
    return lane, lane_ranks, dp_group, dp_ranks


class LaneStage(PipelineStage):
    """torch's ``PipelineStage``; on torch 2.11 (``compat.OLD_PIPELINES``), with its gaps closed.

    * Its multi-stage schedules open the lane with one ``batch_isend_irecv`` of a dummy tensor to and
      from each stage's neighbours (``_get_init_p2p_neighbors_ops``), including a neighbour stage on
      this same rank (the turn of a V-shaped schedule, ``ZBVZeroBubble``, ``DualPipeV``; an encoder
      stage beside an LLM stage, ``pipeline/bubbles.py``), which gloo cannot send ("Pair is not
      connected"). The schedules pass a same-rank neighbour's tensors locally (``set_local_fwd_input``),
      so the warm-up leaves out the messages to this rank itself.
    * A schedule's first ``eval()`` makes the receive buffers without ``requires_grad`` and a later
      ``step()`` keeps them, so no gradient leaves the stage ("has gradients None and is expecting to
      send gradients"): preparing the backward marks them as a first ``step()`` would have.

    * torch 2.11 checks a stage's outputs against the strides of the shapes it declared: a block
      sliced or redistributed on its way out (LLaVA's features without the class token) is made
      contiguous, as it would be to be sent.

    * torch 2.11 gives every received input a gradient and sends it back, whether or not it needs one
      (``_create_grad_send_info``: "It is up to the previous stage to discard this gradient"), so a
      frozen encoder's features cost their size again backward. As 2.13 does, the declared tensors
      (``input_args``/``output_args``, whose ``requires_grad`` ``pipeline_stage`` sets from
      ``input_grad``/``output_grad``) decide: a receive buffer needs a gradient only where its
      input was declared with one, only those gradients are sent, and a stage waits for its output's
      gradient only where the output was declared with one. Neighbours must then declare alike (one
      stage's ``output_grad`` the next one's ``input_grad``), as on 2.13; stages on rank sets check
      it in their handshake (``pipeline/rank_sets.py``).

    torch 2.13 and 2.14 warm the lane up by a vote per stage, 2.15 by an all-reduce over it in the
    schedule; both re-prepare the stage on a switch between ``eval`` and ``step``; there the stage
    is torch's own.

    On every torch, each step of a schedule starts with an agreement over the pipeline ``pipe`` (the
    ``StageMesh``; ``pipeline/agreement.py``): the same schedule and micro-batch count everywhere,
    each stage mesh fed alike in every copy, the first stage fed ``n_microbatches`` of its declared
    block (``declared``: the meta tensors of its input and output), or the same error on every rank.
    """

    def __init__(self, *args, pipe=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pipe = pipe
        self.declared = (kwargs.get("input_args"), kwargs.get("output_args"))

    def clear_runtime_states(self) -> None:
        if self.pipe is not None:  # torch's step asks this of every stage first, before it splits or sends
            agree_step(self, self.pipe)
        super().clear_runtime_states()

    if compat.OLD_PIPELINES:

        def forward_maybe_with_nosync(self, *args, **kwargs):
            out = super().forward_maybe_with_nosync(*args, **kwargs)  # 2.11 checks the declared strides
            if isinstance(out, torch.Tensor):
                return _dense(out)
            return type(out)(_dense(o) if isinstance(o, torch.Tensor) else o for o in out)

        def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
            me = dist.get_rank(self.group)
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != me]

        def _prepare_forward_infra(self, num_microbatches: int, args, kwargs=None):
            out = super()._prepare_forward_infra(num_microbatches, args, kwargs)
            if self.has_backward:  # 2.11 marks every receive buffer; only the declared ones need a gradient
                self._mark_receive_buffers()
            return out

        def _prepare_backward_infra(self, num_microbatches: int):
            self._mark_receive_buffers()  # as _prepare_forward_infra does for a backward
            return super()._prepare_backward_infra(num_microbatches)

        def _mark_receive_buffers(self) -> None:
            wanted = _declared_grads(self.declared[0])
            for infos in self.args_recv_info.values():
                declared = wanted is not None and len(wanted) == len(infos)  # else torch's own: every one
                for n, info in enumerate(infos):
                    buffer = getattr(info, "buffer", None)  # a _RecvInfo (not a first stage's placeholder)
                    if isinstance(buffer, torch.Tensor) and buffer.is_floating_point():
                        buffer.requires_grad_(not declared or wanted[n])

        def _create_grad_send_info(self, args_recv_info: tuple) -> list:
            sources = super()._create_grad_send_info(args_recv_info)  # every received input's source
            wanted = _declared_grads(self.declared[0])
            if wanted is None or len(wanted) != len(sources):
                return sources
            return [source if want else None for source, want in zip(sources, wanted, strict=True)]

        def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
            infos = super()._create_grad_recv_info(act_send_info)  # a buffer for every output sent
            wanted = _declared_grads(self.declared[1])
            if wanted is None or len(wanted) != len(infos):
                return infos
            return tuple(info if want else None for info, want in zip(infos, wanted, strict=True))

        def _retrieve_recv_grads(self, bwd_chunk_id: int):
            return tuple(getattr(info, "buffer", None) for info in self.grad_recv_info[bwd_chunk_id])

        def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
            # as torch's: the next stage's inputs (and so their gradients) may outnumber these outputs
            for info, tensor in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs, strict=False):
                if info is not None:  # an output declared without a gradient has none to take
                    info.buffer = tensor


def _declared_grads(declared) -> list[bool] | None:
    """Whether each tensor a stage declared (``input_args``/``output_args``) takes a gradient; None
    where it declared none (torch's shape inference: every floating tensor does)."""
    if declared is None:
        return None
    metas = (declared,) if isinstance(declared, torch.Tensor) else tuple(declared)
    return [isinstance(m, torch.Tensor) and m.requires_grad for m in metas]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of a new tensor of its shape (``contiguous()`` keeps a slice's strides
    where a dim has size 1, and torch 2.11 compares them)."""
    dense = torch.empty(t.shape, device="meta").stride()
    return t if t.stride() == dense else t.clone(memory_format=torch.contiguous_format)


class DataParallelStage(LaneStage):
    """torch's ``PipelineStage`` of one data-parallel copy: ``PipelineStage``'s arguments, then
    ``dp_group`` (the ranks at this place in every copy) and ``mesh`` (the stage's, for the waits).

    Collective over ``dp_group`` when built (the copies agree that they hold the same stage: its
    modules' classes and tensors' names, shapes and dtypes; then copy 0's parameters and buffers) and
    at the stage's last backward of each step (the average of the gradients); the copies run the
    same schedule, so they meet in the same order.
    """

    def __init__(self, *args, dp_group: dist.ProcessGroup, mesh: Mesh, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dp_group, self.mesh = dp_group, mesh
        # one copy's Tanh for the other's ReLU trained apart (gradients 4.3 off, no error); another
        # parameter count waited in the broadcast to the timeout
        agree_group(mesh, dp_group, "pipeline_stage over the copies", _structure(self.submod), None)
        for t in [*self.submod.parameters(), *self.submod.buffers()]:
            P.broadcast_group(local(t).data, mesh, dp_group, "dp")

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if last_backward:  # every micro-batch's gradient is in: average it over the copies
            average_grads(self.submod, self.dp_group, self.mesh)
        return result


def _structure(module: nn.Module) -> str:
    """What the copies of a stage must hold alike: its tensors and a checksum of its modules and tensors."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    text = ";".join(f"{name}:{type(m).__name__}" for name, m in module.named_modules())
    text += ";".join(f"{name}:{list(t.shape)}:{t.dtype}:{t.requires_grad}" for name, t in tensors)
    elements = sum(t.numel() for _, t in tensors)
    return f"{len(tensors)} tensors of {elements} elements, modules and tensors {zlib.crc32(text.encode()):08x}"


def average_grads(module: nn.Module, group: dist.ProcessGroup, mesh: Mesh) -> None:
    """Each gradient of ``module`` becomes its mean over ``group``: one all-reduce per dtype of the
    flattened gradients (parameters without one are left without one)."""
    grads = [local(p.grad) for p in module.parameters() if p.grad is not None]
    size = dist.get_world_size(group)
    for dtype in dict.fromkeys(g.dtype for g in grads):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        P.all_reduce_group(flat, mesh, group, "dp")
        flat /= size
        for g, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
            g.copy_(part.view_as(g))
