"""Moving a tensor from one mesh's layout to another's over the same ranks (colocated meshes).

A tensor in a layout is a set of boxes of the global tensor, one per rank:

    "activation" [b, ..., h]: rank (k, i, j) of a (q, d) mesh holds batch block k·q + i of d·q and
                              hidden block j of q: [b/(d·q), ..., h/q] (``optimus2d.scatter``)
    "batch"      [b, ...]:    batch block k·q + i of d·q, every other dim whole: [b/(d·q), ...],
                              the same box on the q ranks of a row (``optimus2d.scatter_batch``)

``redistribute`` gives every rank its box in the destination layout. Each element a destination
rank r needs comes from exactly one source rank: r itself when it holds the element, else one
holder, picked as ``holders[position of r in dst % len(holders)]`` (the q replicas of a batch box
share the sending). Rank r sends, point to point, Σ_{r' ≠ r} |box_src(r) ∩ box_dst(r')| elements
over the pairs where it is the chosen holder, and receives |box_dst(r)| minus what it holds: only
what the destination needs; nothing at all when the boxes are the same (2×2 "batch" → 1×1×4
"batch" halves each box in place).

Gradients follow ``reduce_grad``'s convention: the gradient of a box held by several replicas is
the sum of the replicas' gradients. Backward sends each destination's gradient part to the one
holder it read from (the other replicas get zeros there), and a holder read by several
destinations (a replicated destination) sums their parts: backward is the transpose of forward.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd import Function

from optimus2d.comm import primitives as P
from optimus2d.comm.agreement import agree, describe
from optimus2d.comm.calls import layout, tag
from optimus2d.comm.counter import record
from optimus2d.comm.first_order import first_order
from optimus2d.comm.functional import ALIKE, give_alike, take_alike
from optimus2d.comm.mesh import Mesh

LAYOUTS = ("activation", "batch")
_TAG = 2605  # point-to-point tag of redistribute's messages
Box = tuple[tuple[int, int], ...]  # (start, stop) of each dim of the global tensor


def boxes(mesh: Mesh, kind: str, shape: tuple[int, ...]) -> list[Box]:
    """The box of the global ``shape`` each rank of ``mesh`` holds, in ``mesh.ranks`` order."""
    q, d, out = mesh.q, mesh.depth, []
    for n in range(len(mesh.ranks)):
        k, i, j = n // (q * q), (n % (q * q)) // q, n % q
        per = shape[0] // (d * q)
        box = [(0, size) for size in shape]
        box[0] = ((k * q + i) * per, (k * q + i + 1) * per)
        if kind == "activation":
            h = shape[-1] // q
            box[-1] = (j * h, (j + 1) * h)
        out.append(tuple(box))
    return out


@functools.lru_cache(maxsize=256)
def plan_moves(src_ranks, src_qd, dst_ranks, dst_qd, kind, shape) -> list[tuple[int, int, Box]]:
    """Every (source rank, destination rank, global box) moved, the same list on every rank."""
    src = _Shape(src_ranks, *src_qd)
    dst = _Shape(dst_ranks, *dst_qd)
    src_boxes, dst_boxes = boxes(src, kind, shape), boxes(dst, kind, shape)
    holders: dict[Box, list[int]] = {}
    for rank, box in zip(src_ranks, src_boxes, strict=True):
        holders.setdefault(box, []).append(rank)
    moves = []
    for position, (to, want) in enumerate(zip(dst_ranks, dst_boxes, strict=True)):
        for box, owners in holders.items():
            part = tuple((max(a, c), min(b, e)) for (a, b), (c, e) in zip(box, want, strict=True))
            if any(start >= stop for start, stop in part):
                continue
            sender = to if to in owners else owners[position % len(owners)]
            moves.append((sender, to, part))
    return moves


class _Shape:
    """What ``boxes`` reads of a mesh (ranks, q, depth), for the cached plan."""

    def __init__(self, ranks: tuple[int, ...], q: int, depth: int) -> None:
        self.ranks, self.q, self.depth = ranks, q, depth


def _local(part: Box, box: Box) -> tuple[slice, ...]:
    return tuple(slice(a - start, b - start) for (a, b), (start, _) in zip(part, box, strict=True))


def _transfer(src: Mesh, t: torch.Tensor, out: torch.Tensor, sends, recvs, add: bool) -> torch.Tensor:
    """Send ``t[slices]`` to each (peer, slices) of ``sends``; receive each of ``recvs`` into
    ``out[slices]`` (added when ``add``), all at once over ``src``'s "mesh" group."""
    handles, landed = [], []
    for peer, slices in recvs:
        buf = torch.empty(tuple(s.stop - s.start for s in slices), dtype=out.dtype, device=out.device)
        handles.append(P.irecv(buf, src, "mesh", src.ranks.index(peer), _TAG))
        landed.append((buf, slices))
    for peer, slices in sends:
        piece = t[slices].contiguous()
        record("send", "mesh", piece)
        handles.append(P.isend(piece, src, "mesh", src.ranks.index(peer), _TAG))
    for handle in handles:
        handle.wait()
    for buf, slices in landed:
        if add:
            out[slices] += buf
        else:
            out[slices] = buf
    return out


class _Redistribute(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, src: Mesh, dst: Mesh, kind: str) -> torch.Tensor:
        shape = global_shape(x.shape, src, kind)
        moves = plan_moves(src.ranks, (src.q, src.depth), dst.ranks, (dst.q, dst.depth), kind, shape)
        me = src.rank
        mine_src = boxes(src, kind, shape)[src.ranks.index(me)]
        mine_dst = boxes(dst, kind, shape)[dst.ranks.index(me)]
        ctx.src, ctx.x_shape = src, tuple(x.shape)
        ctx.local = [(_local(p, mine_src), _local(p, mine_dst)) for s, r, p in moves if s == me and r == me]
        ctx.sends = [(r, _local(p, mine_src), _local(p, mine_dst)) for s, r, p in moves if s == me and r != me]
        ctx.recvs = [(s, _local(p, mine_dst), _local(p, mine_src)) for s, r, p in moves if r == me and s != me]
        out = x.new_empty(tuple(b - a for a, b in mine_dst))
        for at_src, at_dst in ctx.local:
            out[at_dst] = x[at_src]
        sends = [(peer, at) for peer, at, _ in ctx.sends]
        recvs = [(peer, at) for peer, at, _ in ctx.recvs]
        return _transfer(src, x, out, sends, recvs, add=False)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad.new_zeros(ctx.x_shape)
        for at_src, at_dst in ctx.local:
            grad_x[at_src] += grad[at_dst]
        sends = [(peer, at_dst) for peer, at_dst, _ in ctx.recvs]
        recvs = [(peer, at_src) for peer, at_src, _ in ctx.sends]
        return _transfer(ctx.src, grad.contiguous(), grad_x, sends, recvs, add=True), None, None, None


def global_shape(local: torch.Size | tuple[int, ...], mesh: Mesh, kind: str) -> tuple[int, ...]:
    """The global shape of a block ``local`` of ``mesh``'s ``kind`` layout."""
    shape = list(local)
    shape[0] *= mesh.depth * mesh.q
    if kind == "activation":
        shape[-1] *= mesh.q
    return tuple(shape)


def _refusal(x: object, src: Mesh, dst: Mesh, kind: str | None) -> Exception | None:
    """Why ``x`` cannot move from ``src`` to ``dst`` (the same verdict on every rank), or None."""
    if not isinstance(x, torch.Tensor):
        return TypeError(f"redistribute expects a tensor, got {type(x).__name__}")
    if kind is None:
        return ValueError(
            f"redistribute: cannot know the layout of tensor {tuple(x.shape)}: it comes from neither scatter, "
            f"scatter_batch, redistribute nor an optimus2d module; pass layout='activation' or 'batch' ({src})"
        )
    if kind not in LAYOUTS:
        return ValueError(f"redistribute: layout must be one of {LAYOUTS}, got {kind!r}")
    if sorted(src.ranks) != sorted(dst.ranks):
        return ValueError(f"redistribute: {src} and {dst} are not over the same ranks")
    given = getattr(x, "_optimus2d_layout", None)
    if given is not None and given != layout(src) and src.size > 1:
        return ValueError(
            f"redistribute: tensor {tuple(x.shape)} is a block of Mesh(q={given[0]}, depth={given[1]}), not of {src}"
        )
    need = 2 if kind == "activation" else 1
    if x.dim() < need or 0 in x.shape:
        return ValueError(f"redistribute: tensor {tuple(x.shape)} is not a non-empty {kind} block ({src})")
    full = global_shape(x.shape, src, kind)
    if full[0] % (dst.depth * dst.q):
        return ValueError(
            f"redistribute: batch dim 0 of tensor {full} (global) is not divisible by depth·q = "
            f"{dst.depth * dst.q} of {dst}"
        )
    if kind == "activation" and full[-1] % dst.q:
        return ValueError(
            f"redistribute: hidden dim -1 of tensor {full} (global) is not divisible by q = {dst.q} of {dst}"
        )
    return None


def redistribute(x: torch.Tensor, src: Mesh, dst: Mesh, *, layout: str | None = None) -> torch.Tensor:
    """This rank's block of ``x`` in ``src``'s layout → its block in ``dst``'s, over the same ranks.

    ``layout`` "activation": ``[b/(d_s·q_s), ..., h/q_s]`` → ``[b/(d_d·q_d), ..., h/q_d]`` (global
    ``[b, ..., h]``, as ``scatter`` splits it); "batch": ``[b/(d_s·q_s), ...]`` →
    ``[b/(d_d·q_d), ...]`` (as ``scatter_batch``). Default: the layout ``x`` carries from
    ``scatter``, ``scatter_batch``, ``redistribute`` or an optimus2d module's output; a tensor
    with none is refused, and so is a ``layout`` other than the one it carries.

    forward: point-to-point over the ranks, each rank receiving only the parts of its new block it
    does not hold (the formula in the module docstring); backward: the reverse, a gradient part
    summed where several destinations read one element. Refusals (layout, ranks, a batch or hidden
    dim the destination does not divide) are raised on every rank before anything is sent.
    """
    carried = getattr(x, "_optimus2d_kind", None)
    kind = layout if layout is not None else carried
    error = _refusal(x, src, dst, kind)
    if error is None and layout is not None and carried in LAYOUTS and carried != layout:
        error = ValueError(  # the wrong boxes moved: an activation block taken as a batch one lost h/q columns
            f"redistribute: tensor {tuple(x.shape)} is a{'n' if carried[0] == 'a' else ''} {carried} block (its "
            f"tag), not {layout!r}: drop layout=, or pass the layout it has ({src})"
        )
    if src.check != "off" and src.size > 1:
        agree(
            src,
            "redistribute",
            description=f"{kind} {describe(x)} to Mesh(q={dst.q}, depth={dst.depth}, ranks={list(dst.ranks)})",
            error=error,
        )
    elif error is not None:
        raise error
    same = (src.q, src.depth, src.ranks) == (dst.q, dst.depth, dst.ranks)
    alike = getattr(x, ALIKE, None)  # every replica takes the whole gradient: so they do at dst
    if alike is not None and not same:
        x = take_alike(x, src)
    out = x if same or src.size == 1 else _Redistribute.apply(x, src, dst, kind)
    if out is x and not same:
        out = x.view_as(x)
    if alike is not None and not same:
        out = give_alike(out, dst, ("row",))
    tag(out, dst, agreed=src.check != "off")
    out._optimus2d_kind = kind
    return out
