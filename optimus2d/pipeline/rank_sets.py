"""Pipeline stages on rank sets of different sizes (non-colocated modules), on torch's schedules.

Every stage has its own ranks and its own mesh, of any size: a frozen vision encoder on 1 rank and
the LLM on 8 as 2×2×2, or the encoder on 2 ranks and the LLM on 6 as 1×1×6. On 9 ranks::

    rank_sets([[0], [1, 2, 3, 4, 5, 6, 7, 8]], q=(1, 2), depth=(1, 2))

    stage 0: Mesh(1, 1)            stage 1: Mesh(2, 2)
      rank 0: features of a   ──▶    ranks 1..8: each its block [b/4, P, E/2] of them
      micro-batch [b, P, E]          (batch block k·2 + i, hidden block j)

A stage's output is the next stage's input laid out on another mesh, over other ranks, with another
data-parallel size: the batch is split d·q ways on each (MIMO's fan-in and fan-out). Each element
of a micro-batch's activation goes from the one rank of the sender's mesh that holds it to the one
rank of the receiver's that needs it (``redistribution.plan_moves``, here between disjoint rank
sets): rank r sends, per micro-batch, exactly its output block, in one message per receiving rank
whose block its own meets, and receives exactly its input block. Backward sends the gradient of
every piece back the same way; a frozen stage whose output needs no gradient gets none.

torch's ``PipelineStage`` sends each activation to one rank, the stage's peer in its group. Here the
stage declares its output, and the next its input, as a flat tensor of the block's elements ordered
by peer (``Packed``: the chunk's output block flattened piece by piece, one piece per receiving
rank; ``Unpacked``: the received pieces put back into the input block, autograd through both), and
``RankSetStage`` replaces each of torch's send and receive ops (forward and backward) by one op per
peer on a contiguous slice of that flat tensor, over one group of every rank. Everything else is
torch's: the schedules (``ScheduleGPipe``, ``Schedule1F1B``: while the LLM's ranks compute
micro-batch m, the encoder's compute m + 1), micro-batch splitting, losses, the backward. Each rank
runs one stage; its torch group (which torch reads for bookkeeping only) is a lane of one rank of
every set. Feed the first stage, and the last stage's keyword inputs and targets, with
``scatter_microbatches`` on their own mesh, so that micro-batch m is serial ``x.chunk(n)[m]`` on
every set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from optimus2d.comm import compat, replicas, watch
from optimus2d.comm.counter import record
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.redistribution import Box, boxes, plan_moves
from optimus2d.pipeline.data_parallel import LaneStage

__all__ = ["Packed", "RankSetStage", "RankSets", "Unpacked", "rank_set_stage", "rank_sets"]


@dataclass(frozen=True)
class RankSets:
    """This rank's place among stages on disjoint rank sets: ``meshes[s]`` is stage s's mesh over its
    own ranks (built on every rank; ``meshes[s].coord`` is None off its ranks), ``stage`` this rank's
    stage, ``lane`` torch's group for its ``PipelineStage``, ``bridge`` the group over every rank
    that carries the activations between stages."""

    meshes: tuple[Mesh, ...]
    stage: int
    lane: dist.ProcessGroup
    bridge: dist.ProcessGroup
    dp: int = 1  # the agreement's word for data-parallel copies of the whole pipeline: none here

    @property
    def mesh(self) -> Mesh:
        """This rank's stage's mesh."""
        return self.meshes[self.stage]

    @property
    def stages(self) -> int:
        return len(self.meshes)


def _refusal(ranks, q, depth, world: int) -> tuple[list[tuple[int, ...]], list[tuple[int, int]], ValueError | None]:
    """The sets, each set's (q, depth), and why they are not a pipeline of this world (None if they are)."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or len(ranks) < 2:
        return [], [], ValueError(f"rank_sets needs two or more sets of ranks, one per stage, got {ranks!r}")
    sets = []
    for s, members in enumerate(ranks):
        members = list(members) if isinstance(members, (Sequence, range)) else None
        if not members or not all(isinstance(r, int) and not isinstance(r, bool) for r in members):
            return [], [], ValueError(f"rank_sets: set {s} ({ranks[s]!r}) is not a non-empty sequence of ranks")
        sets.append(tuple(members))
    shapes = []
    for name, value in (("q", q), ("depth", depth)):
        values = [value] * len(sets) if isinstance(value, int) else list(value) if isinstance(value, Sequence) else []
        fits = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
        if len(values) != len(sets) or not fits:
            why = f"must be a positive int or one per set ({len(sets)})"
            return sets, [], ValueError(f"rank_sets: {name}={value!r} {why}")
        shapes.append(values)
    shapes = list(zip(*shapes, strict=True))
    owner: dict[int, int] = {}
    for s, members in enumerate(sets):
        for r in members:
            if not 0 <= r < world:
                why = f"set {s} names rank {r}, not a rank of the world of {world}"
                return sets, shapes, ValueError(f"rank_sets: {why}")
            if r in owner:
                where = f"sets {owner[r]} and {s}" if owner[r] != s else f"set {s} twice"
                return sets, shapes, ValueError(f"rank_sets: the sets overlap: rank {r} is in {where}")
            owner[r] = s
    missing = [r for r in range(world) if r not in owner]
    if missing:
        return (
            sets,
            shapes,
            ValueError(
                f"rank_sets: the sets must cover the world of {world} ranks; rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} in none"
            ),
        )
    for s, (members, (qs, ds)) in enumerate(zip(sets, shapes, strict=True)):
        if ds * qs * qs != len(members):
            return (
                sets,
                shapes,
                ValueError(
                    f"rank_sets: set {s} has {len(members)} ranks, but Mesh(q={qs}, depth={ds}) needs depth·q² = "
                    f"{ds * qs * qs}"
                ),
            )
    return sets, shapes, None


def rank_sets(
    ranks: Sequence[Sequence[int]],
    q: int | Sequence[int],
    depth: int | Sequence[int] = 1,
    *,
    transport: str | None = None,
    check: str | None = None,
) -> RankSets:
    """Stage s of a pipeline on the global ranks ``ranks[s]``, as ``Mesh(q_s, depth_s)`` over them
    (``q``, ``depth``: every set's, or one per set; depth_s·q_s² = len(ranks[s])). The sets may have
    different sizes; they must not overlap and must cover the world.

    Collective over the world: every rank calls it with the same arguments (one all-gather checks
    that first). A refusal (sets that overlap, leave a rank out, name a rank outside the world, or do
    not fit their mesh shapes; ranks that disagree) is the same ``ValueError`` on every rank, before
    any mesh or group is built. Then builds every set's mesh, one lane per position (rank n of the
    largest set with rank n mod size of each other set: torch's group for a stage) and the bridge.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    sets, shapes, error = _refusal(ranks, q, depth, world)
    if world > 1:
        options = f"transport={transport!r}, check={check!r}"
        asked = f"rank_sets({sets or ranks!r}, shapes={shapes or (q, depth)!r}, {options})"
        replicas.agree_world("rank_sets", asked, error, watch.collective_timeout())
    elif error is not None:
        raise error
    meshes = tuple(Mesh(qs, ds, ranks=members, transport=transport, check=check) for members, (qs, ds) in
                   zip(sets, shapes, strict=True))  # fmt: skip
    if len(set(shapes)) > 1:  # each boundary re-splits a micro-batch as serial chunk(n)[m]: noted for the targets
        for made in meshes:
            made.__dict__["_optimus2d_stage_shapes"] = tuple(shapes)
    me = dist.get_rank()
    stage = next(s for s, members in enumerate(sets) if me in members)
    lane = None
    for n in range(max(len(members) for members in sets)):  # every lane on every rank: creating one is collective
        group = compat.new_group([members[n % len(members)] for members in sets])
        if lane is None and sets[stage][n % len(sets[stage])] == me:
            lane = group
    bridge = compat.new_group(range(world))
    return RankSets(meshes, stage, lane, bridge)


def _segments(pipe: RankSets, sender: int, shape: tuple[int, ...], mine: int) -> list[tuple[int, Box, Box]]:
    """The pieces of the activation ``shape`` (one micro-batch's, global) moving from stage ``sender``
    to stage ``sender + 1``, this rank's side of them: (peer global rank, the piece's box in the
    global tensor, this rank's block box), in the order both sides agree on."""
    src, dst = pipe.meshes[sender], pipe.meshes[sender + 1]
    moves = plan_moves(src.ranks, (src.q, src.depth), dst.ranks, (dst.q, dst.depth), "activation", shape)
    if mine == sender:
        block = boxes(src, "activation", shape)[src.ranks.index(pipe.mesh.rank)]
        return [(to, part, block) for frm, to, part in moves if frm == pipe.mesh.rank]
    block = boxes(dst, "activation", shape)[dst.ranks.index(pipe.mesh.rank)]
    return [(frm, part, block) for frm, to, part in moves if to == pipe.mesh.rank]


def _local(part: Box, block: Box) -> tuple[slice, ...]:
    return tuple(slice(a - start, b - start) for (a, b), (start, _) in zip(part, block, strict=True))


def _numel(part: Box) -> int:
    n = 1
    for a, b in part:
        n *= b - a
    return n


class Packed(nn.Module):
    """``chunk`` whose output block ``[b/(d·q), ..., h/q]`` leaves flat, piece by piece in the order
    of its receivers (``pieces``: the slices of the block each receiver gets). forward: slicing and
    one ``cat``; backward: the flat gradient put back into the block. ``self.chunk`` is ``chunk``."""

    def __init__(self, chunk: nn.Module, shape: tuple[int, ...], pieces: list[tuple[slice, ...]]) -> None:
        super().__init__()
        self.chunk, self.shape, self.pieces = chunk, shape, pieces

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.chunk(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"Packed: the chunk returned {type(out).__name__}, not one activation tensor")
        if tuple(out.shape) != self.shape:  # slicing a larger block would send a part of it, silently
            raise ValueError(
                f"pipeline_stage: the chunk's output block is {list(out.shape)}, but its output_shape declares the "
                f"block {list(self.shape)} on this rank"
            )
        return torch.cat([out[at].reshape(-1) for at in self.pieces])


class Unpacked(nn.Module):
    """``chunk`` whose input block ``shape`` arrives flat, piece by piece in the order of its senders
    (``pieces``: the slices of the block each sender fills). forward: the block assembled, then
    ``chunk``; backward: the block's gradient flattened in the same order. ``self.chunk`` is ``chunk``."""

    def __init__(self, chunk: nn.Module, shape: tuple[int, ...], pieces: list[tuple[slice, ...]]) -> None:
        super().__init__()
        self.chunk, self.shape, self.pieces = chunk, shape, pieces

    def forward(self, flat: torch.Tensor, *args, **kwargs):
        if flat.shape != (sum(_numel(tuple((0, s.stop - s.start) for s in at)) for at in self.pieces),):
            raise ValueError(f"Unpacked: received {list(flat.shape)} elements, not the block {list(self.shape)}")
        block = flat.new_empty(self.shape)
        start = 0
        for at in self.pieces:
            size = tuple(s.stop - s.start for s in at)
            n = _numel(tuple((0, k) for k in size))
            block[at] = flat[start : start + n].view(size)
            start += n
        return self.chunk(block, *args, **kwargs)


class RankSetStage(LaneStage):
    """torch's ``PipelineStage`` (``LaneStage``) of a stage on its own rank set: each send or receive
    torch makes of the flat activation (or its gradient) becomes one per peer rank over ``bridge``,
    on the slice that peer's piece occupies. ``incoming``/``outgoing``: (peer, start, stop) of the
    flat input and output; empty at the pipeline's ends."""

    def __init__(self, *args, bridge, incoming, outgoing, **kwargs) -> None:
        if kwargs.get("input_args") is None or kwargs.get("output_args") is None:
            # torch would infer the shapes by messages over the lanes, which a rank of a smaller set
            # shares with other ranks (they would wait for ever): both ends are declared here
            raise ValueError("RankSetStage: give input_args and output_args (rank_set_stage declares both)")
        super().__init__(*args, **kwargs)
        self.bridge, self.incoming, self.outgoing = bridge, incoming, outgoing
        # torch 2.15 may give each pair of lane ranks a communicator of its own (TorchComms, or
        # TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P): every op goes over the bridge here instead
        self.p2p_per_edge = False

    def _route(self, ops: list[dist.P2POp], segments: list[tuple[int, int, int]]) -> list[dist.P2POp]:
        routed = []
        for op in ops:
            for peer, start, stop in segments:
                piece = op.tensor[start:stop]
                if op.op is dist.isend:
                    piece = piece.contiguous()
                    record("send", "bridge", piece)
                routed.append(dist.P2POp(op.op, piece, peer, self.bridge))
        return routed

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._route(super().get_fwd_recv_ops(fwd_chunk_id), self.incoming)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._route(super().get_fwd_send_ops(fwd_chunk_id), self.outgoing)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._route(super().get_bwd_recv_ops(bwd_chunk_id), self.outgoing)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._route(super().get_bwd_send_ops(bwd_chunk_id), self.incoming)

    def _handshake(self) -> None:
        """Each pair of neighbouring ranks swaps what it declared of the piece between them, before any
        activation: its elements a micro-batch, whether a gradient comes back and its dtype (bf16 read
        as fp16 would be other numbers, silently; fp32 as fp64 aborts gloo), then
        both raise the same ``ValueError`` if the two differ (stages that declared different shapes
        or gradients would otherwise hang, or pair the wrong elements). This is also the first message
        on each pair (opening NCCL's communicators)."""
        declared_in, declared_out = self.declared
        sides = [(peer, stop - start, declared_in, "receives from") for peer, start, stop in self.incoming]
        sides += [(peer, stop - start, declared_out, "sends to") for peer, start, stop in self.outgoing]
        ops, exchanged = [], []
        for peer, size, meta, how in sides:
            grad = int(bool(getattr(meta, "requires_grad", False)))
            dtype = getattr(meta, "dtype", None)
            code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
            mine = torch.tensor([size, grad, code], dtype=torch.float64, device=self.device)
            theirs = torch.empty_like(mine)
            ops += [dist.P2POp(dist.isend, mine, peer, self.bridge), dist.P2POp(dist.irecv, theirs, peer, self.bridge)]
            exchanged.append((peer, how, mine, theirs))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for peer, how, mine, theirs in exchanged:
            if not torch.equal(mine, theirs):
                me, other = (int(v) for v in mine.tolist()), (int(v) for v in theirs.tolist())
                raise ValueError(
                    f"pipeline_stage: rank {dist.get_rank()} (stage {self.stage_index}) {how} rank {peer} a piece of "
                    f"{next(me)} elements a micro-batch, rank {peer} declared {next(other)}; gradient back: "
                    f"{_grad(next(me))} here, {_grad(next(other))} there; dtype {_dtype(next(me))} here, "
                    f"{_dtype(next(other))} there. Neighbouring stages must declare the same activation (output_shape "
                    f"of one = microbatch_shape of the next; output_grad = input_grad; one dtype: dtype=)"
                )

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        """torch 2.11's first message of a schedule (a word to and from each neighbour stage's peer,
        which opens NCCL's communicators): the handshake with every peer of the bridge instead."""
        self._handshake()
        return []

    # torch 2.13's warm-up vote passes a word between neighbouring stages' peers in the lane; here the
    # neighbours are many, and every stage is declared static (``rank_set_stage`` gives both ends), so
    # the vote's outcome, static, is known on every rank: the handshake goes to every peer instead.
    def _warmup_forward_vote(self, has_backward: bool, received_acc: torch.Tensor | None = None) -> torch.Tensor:
        self._handshake()
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32, device=self.device)

    if compat.SCHEDULE_INITIALIZES:
        # torch 2.15's schedule opens the pipeline over the stages' parent group: an all-reduce, then a
        # message between the pairs of group ranks its stage-to-rank map names. A rank of a smaller set
        # is in several lanes and would join one of them (the others wait for it for ever): here the
        # parent is the bridge, which every rank joins once (its pairs, bridge ranks 0..stages-1, swap
        # a word: harmless), and the handshake goes to every real peer as the stage prepares.
        @property
        def _parent_group(self) -> dist.ProcessGroup:
            return self.bridge

        def _prepare_forward_infra(self, *args, **kwargs):
            self._handshake()
            return super()._prepare_forward_infra(*args, **kwargs)


def _grad(flag: int) -> str:
    return "yes" if flag else "no"


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)


def _dtype(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "another"


def _block(what: str, shape: Sequence[int], meshes: tuple[Mesh, ...], kind: str) -> tuple[int, ...]:
    """This rank's block of ``shape`` on ``meshes[0]``, checked to split on every mesh of ``meshes``."""
    shape = tuple(int(n) for n in shape)
    for mesh in meshes:
        splits = [(0, mesh.depth * mesh.q)] + ([(len(shape) - 1, mesh.q)] if kind == "activation" else [])
        if len(shape) < 1 + (kind == "activation") or any(shape[dim] % n for dim, n in splits):
            dims = " and h (the last dim) by q" if kind == "activation" else ""
            raise ValueError(
                f"pipeline_stage: {what}={list(shape)} must be [b, ...] with b divisible by depth·q{dims} of "
                f"{mesh} ({kind} blocks)"
            )
    return boxes(meshes[0], kind, shape)[meshes[0].ranks.index(meshes[0].rank)]


def rank_set_stage(
    chunk: nn.Module,
    pipe: RankSets,
    *,
    microbatch_shape: Sequence[int],
    output_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    input_layout: str = "activation",
    input_dtype: torch.dtype | None = None,
    input_grad: bool | None = None,
    output_grad: bool = True,
) -> RankSetStage:
    """``pipeline_stage`` for ``RankSets`` (the same arguments; one torch stage per set, stage index =
    set index): the chunk (converted on ``pipe.mesh``) takes its block of ``microbatch_shape`` and
    returns its block of ``output_shape``, both ``[b/(d·q), ..., h/q]`` (the first stage's input
    ``[b/(d·q), ...]`` with ``input_layout="batch"``); between stages they travel flat (module
    docstring). ``input_grad``: whether a gradient goes back from the input (default: every stage but
    the first); ``output_grad``: whether one comes back to the output (False: a frozen encoder)."""
    s, mesh = pipe.stage, pipe.mesh
    last = s == pipe.stages - 1
    if input_layout not in ("activation", "batch") or (input_layout == "batch" and s > 0):
        raise ValueError(f"pipeline_stage: input_layout={input_layout!r}: 'activation', or 'batch' for the first stage")
    if dtype is None:
        floats = [p.dtype for p in chunk.parameters() if p.is_floating_point()]
        dtype = floats[0] if floats else torch.get_default_dtype()
    output_shape = tuple(output_shape or microbatch_shape)
    incoming, outgoing = [], []
    if s == 0:
        block = _block("microbatch_shape", microbatch_shape, (mesh,), input_layout)
        kind = input_dtype or dtype
        grad = bool(input_grad) and kind.is_floating_point
        inputs = torch.empty([b - a for a, b in block], dtype=kind, device="meta", requires_grad=grad)
    else:
        block = _block("microbatch_shape", microbatch_shape, (mesh, pipe.meshes[s - 1]), "activation")
        pieces, start = [], 0
        for peer, part, _ in _segments(pipe, s - 1, tuple(int(n) for n in microbatch_shape), s):
            pieces.append(_local(part, block))
            incoming.append((peer, start, start + _numel(part)))
            start += _numel(part)
        chunk = Unpacked(chunk, tuple(b - a for a, b in block), pieces)
        grad = True if input_grad is None else bool(input_grad)
        inputs = torch.empty(start, dtype=dtype, device="meta", requires_grad=grad)
    if last:
        block = _block("output_shape", output_shape, (mesh,), "activation")
        outputs = torch.empty([b - a for a, b in block], dtype=dtype, device="meta", requires_grad=output_grad)
    else:
        block = _block("output_shape", output_shape, (mesh, pipe.meshes[s + 1]), "activation")
        pieces, start = [], 0
        for peer, part, _ in _segments(pipe, s, output_shape, s):
            pieces.append(_local(part, block))
            outgoing.append((peer, start, start + _numel(part)))
            start += _numel(part)
        chunk = Packed(chunk, tuple(b - a for a, b in block), pieces)
        outputs = torch.empty(start, dtype=dtype, device="meta", requires_grad=output_grad)
    return RankSetStage(
        chunk, s, pipe.stages, mesh.device, input_args=inputs, output_args=outputs, group=pipe.lane, pipe=pipe,
        bridge=pipe.bridge, incoming=incoming, outgoing=outgoing,
    )  # fmt: skip
