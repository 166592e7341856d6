"""A mesh's block to the whole tensor on every rank, and back: the boundary of a module that runs
with Megatron's 1D tensor parallelism over the mesh's ranks (``optimus2d/megatron/``).

Inside such a module every rank holds the whole activation ``[b, ..., h]`` (as in Megatron-LM and
torch's ``parallelize_module``) and the gradient of a whole tensor is the same on every rank (a
``Replicate`` DTensor's, all-reduced by ``ColwiseParallel``'s input). Outside, a tensor is a block of
a ``Mesh``'s layout ("activation" or "batch", ``comm/redistribution.py`` gives each rank's box):

    to_whole:   forward: one all-gather over the mesh of every rank's box (the whole tensor on every
                rank); backward: this rank's box of the (identical) gradient, nothing sent — the q
                replicas of a "batch" box: the first holder keeps it, the others zeros (the sum of a
                box's replicas' gradients is its gradient, as in ``reduce_grad``)
    from_whole: forward: this rank's box of the whole tensor, nothing sent; backward: one all-gather
                of every rank's box gradient, summed where a box has replicas: the whole gradient,
                the same on every rank

A rank sends (p−1)/p of the global tensor in an all-gather ((p−1)·|box| elements), once per boundary
and direction where the other direction sends nothing.

``keep_whole``/``whole_of``: a block cut by ``from_whole`` may remember the whole tensor it was cut
from, so that a consumer wanting the whole again takes it as it is, nothing sent (a model whose
inputs and outputs are whole, ``parallelize(io="whole")``). Only while neither tensor has changed
in place since (torch's version counters; a write through ``.data``, which autograd does not see
either, is not seen) and the block's gradient has nothing of its own: otherwise the block is
all-gathered as usual (``take_whole``).
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from optimus2d.comm import primitives as P
from optimus2d.comm.agreement import agree, describe
from optimus2d.comm.calls import WHOLE, tag
from optimus2d.comm.first_order import first_order
from optimus2d.comm.functional import take_alike
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.redistribution import LAYOUTS, boxes, global_shape

__all__ = ["forget_whole", "from_whole", "keep_whole", "take_whole", "to_whole", "whole_of"]


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _first_holder(mesh: Mesh, box_list: list) -> bool:
    """Whether this rank is the first (in mesh order) of the ranks holding its box."""
    mine = box_list[mesh.ranks.index(mesh.rank)]
    return box_list.index(mine) == mesh.ranks.index(mesh.rank)


def _assemble(chunks: torch.Tensor, box_list: list, shape: tuple[int, ...], add: bool) -> torch.Tensor:
    """The whole tensor from every rank's box (``chunks[n]``: rank n's, in mesh order): each box
    written once (``add=False``: its replicas hold the same values) or summed over its replicas."""
    out = chunks.new_zeros(shape)
    written = set()
    for n, box in enumerate(box_list):
        if add:
            out[_slices(box)] += chunks[n]
        elif box not in written:
            out[_slices(box)] = chunks[n]
            written.add(box)
    return out


def _gather_boxes(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Every rank's ``t`` (same shape everywhere), stacked in mesh order: ``[p, *t.shape]``."""
    return P.all_gather(t.contiguous().unsqueeze(0), mesh, "mesh", 0)


class _ToWhole(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, kind: str) -> torch.Tensor:
        shape = global_shape(x.shape, mesh, kind)
        box_list = boxes(mesh, kind, shape)
        ctx.box = box_list[mesh.ranks.index(mesh.rank)]
        ctx.keep = _first_holder(mesh, box_list)
        return _assemble(_gather_boxes(x, mesh), box_list, shape, add=False)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        own = grad[_slices(ctx.box)]
        return (own.clone() if ctx.keep else torch.zeros_like(own)), None, None


class _FromWhole(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, kind: str) -> torch.Tensor:
        box_list = boxes(mesh, kind, tuple(x.shape))
        ctx.mesh, ctx.boxes, ctx.shape = mesh, box_list, tuple(x.shape)
        return x[_slices(box_list[mesh.ranks.index(mesh.rank)])].clone()

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        return _assemble(_gather_boxes(grad, ctx.mesh), ctx.boxes, ctx.shape, add=True), None, None


def _refusal(x: object, mesh: Mesh, kind: str, whole: bool) -> Exception | None:
    what = "from_whole" if whole else "to_whole"
    if not isinstance(x, torch.Tensor):
        return TypeError(f"{what} expects a tensor, got {type(x).__name__}")
    if kind not in LAYOUTS:
        return ValueError(f"{what}: layout must be one of {LAYOUTS}, got {kind!r}")
    need = 2 if kind == "activation" else 1
    if x.dim() < need or 0 in x.shape:
        return ValueError(f"{what}: tensor {tuple(x.shape)} is not a non-empty {kind} tensor ({mesh})")
    if whole and x.shape[0] % (mesh.depth * mesh.q):
        return ValueError(
            f"{what}: batch dim 0 of tensor {tuple(x.shape)} is not divisible by depth·q = {mesh.depth * mesh.q} "
            f"of {mesh}"
        )
    if whole and kind == "activation" and x.shape[-1] % mesh.q:
        return ValueError(
            f"{what}: hidden dim -1 of tensor {tuple(x.shape)} is not divisible by q = {mesh.q} of {mesh}"
        )
    return None


def to_whole(x: torch.Tensor, mesh: Mesh, kind: str) -> torch.Tensor:
    """This rank's block ``x`` of ``mesh``'s ``kind`` layout ("activation" ``[b/(d·q), ..., h/q]``,
    "batch" ``[b/(d·q), ...]``) → the whole global tensor ``[b, ..., h]``, on every rank.

    forward: all-gather over the mesh; backward: this rank's box of the gradient (the gradient of
    the whole tensor is the same on every rank), nothing sent. Refusals are raised on every rank
    before anything is sent (the blocks' shapes are agreed first)."""
    error = _refusal(x, mesh, kind, whole=False)
    if mesh.size > 1 and mesh.check != "off":
        agree(mesh, "to_whole", description=f"{kind} {describe(x)}", error=error)
    elif error is not None:
        raise error
    x = take_alike(x, mesh)  # a block every replica of which takes the whole gradient
    out = x.view_as(x) if mesh.size == 1 else _ToWhole.apply(x, mesh, kind)  # a new tensor: no block's tags
    out._optimus2d_kind = kind  # no layout (it is no block), but its kind, should it leave unchanged
    return out


def from_whole(x: torch.Tensor, mesh: Mesh, kind: str) -> torch.Tensor:
    """The whole tensor ``x`` (the same on every rank) → this rank's block of ``mesh``'s ``kind``
    layout, tagged as a block of ``mesh`` (``redistribute`` and planned modules read it).

    forward: this rank's box, nothing sent; backward: all-gather over the mesh of the boxes'
    gradients, summed over a box's replicas (the whole gradient, the same on every rank). A shape
    the mesh does not divide is refused on every rank alike (the whole tensor is the same)."""
    error = _refusal(x, mesh, kind, whole=True)
    if error is not None:
        raise error
    out = x.view_as(x) if mesh.size == 1 else _FromWhole.apply(x, mesh, kind)
    tag(out, mesh, agreed=False)
    out._optimus2d_kind = kind
    return out


def mark_whole(t: torch.Tensor) -> torch.Tensor:
    """Note that ``t`` is whole, the same on every rank (made so inside a model: CLIP's logits from
    gathered embeddings): ``io="whole"`` gives it as it is. Returns ``t``."""
    setattr(t, WHOLE, True)
    return t


def is_whole(t: torch.Tensor) -> bool:
    """Whether ``t`` was noted whole (``mark_whole``)."""
    return getattr(t, WHOLE, False)


def keep_whole(block: torch.Tensor, whole: torch.Tensor) -> None:
    """Note on ``block`` (``from_whole(whole, ...)``'s output) the whole tensor it was cut from."""
    block._optimus2d_whole = (whole, whole._version, block._version)


def whole_of(block: torch.Tensor) -> torch.Tensor | None:
    """The whole tensor ``block`` was cut from (``keep_whole``), the same on every rank, where neither
    has changed in place since and the block's gradient has nothing of its own (a hook, a retained
    gradient, another ``requires_grad``) that taking the whole tensor would skip; else None."""
    kept = getattr(block, "_optimus2d_whole", None)
    if kept is None:
        return None
    whole, whole_version, block_version = kept
    if whole._version != whole_version or block._version != block_version:
        return None
    if block.requires_grad != whole.requires_grad or block._backward_hooks or block.retains_grad:
        return None
    return whole


def take_whole(block: torch.Tensor) -> torch.Tensor | None:
    """``whole_of(block)``, for a consumer that takes the whole tensor instead of the block: the block
    then leaves the backward graph (nothing flows through it), so a gradient hook or ``retain_grad``
    asked of it later is refused (it would never fire), not silently ignored."""
    whole = whole_of(block)
    if whole is not None:
        block.register_hook = _bypassed
        block.retain_grad = _bypassed
    return whole


def _bypassed(*args, **kwargs):
    raise RuntimeError(
        "this block was handed whole to the next module (parallelize(io='whole')): no gradient flows through "
        "it, so a hook or retain_grad on it would never fire; register it during the forward, before the next "
        "module reads the block, or convert with io='blocks'"
    )


def forget_whole(block: torch.Tensor) -> None:
    """Drop what ``keep_whole`` noted (the whole tensor is freed with its last other reference)."""
    if getattr(block, "_optimus2d_whole", None) is not None:
        block._optimus2d_whole = None  # (not del: dynamo traces setting an attribute, not deleting one)
