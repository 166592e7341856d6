"""Tiers 2 and 3: autograd collectives (backward is the reverse collective) and public helpers.

Each public function's docstring says what it sends forward and backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd import Function

from optimus2d.comm import primitives as P
from optimus2d.comm.agreement import agree_distinct, check_replicated, describe
from optimus2d.comm.calls import layout, other_mesh, tag
from optimus2d.comm.first_order import first_order
from optimus2d.comm.mesh import Mesh, as_mesh
from optimus2d.comm.sharding import Sharding, shard, unshard


# ---- tier 2: private autograd Functions -----------------------------------------------------
class _Split(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, sharding: Sharding) -> torch.Tensor:
        ctx.mesh, ctx.sharding = mesh, sharding
        return shard(x, mesh, sharding).contiguous()

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        return unshard(grad.contiguous(), ctx.mesh, ctx.sharding), None, None


class _SplitBatch(_Split):
    """``_Split`` of a batch tensor, replicated over the row: its gradient is the sum of the row's
    (``reduce_grad``'s convention), then gathered."""

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        summed = P.summed_copy(grad.contiguous(), ctx.mesh, ("row",))
        return unshard(summed, ctx.mesh, ctx.sharding), None, None


class _Gather(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, sharding: Sharding) -> torch.Tensor:
        ctx.mesh, ctx.sharding = mesh, sharding
        return unshard(x.contiguous(), mesh, sharding)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        return shard(grad, ctx.mesh, ctx.sharding).contiguous(), None, None


class _ReduceGrad(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...]) -> torch.Tensor:
        ctx.mesh, ctx.axes = mesh, axes
        return x.view_as(x)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        return P.summed_copy(grad, ctx.mesh, ctx.axes), None, None


class _OneHolder(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...]) -> torch.Tensor:
        ctx.first = all(mesh.index(a) == 0 for a in axes)
        return x.view_as(x)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.first else torch.zeros_like(grad)), None, None


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...]) -> torch.Tensor:
        return P.summed_copy(x, mesh, axes)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _SumAcross(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, axes: tuple[str, ...]) -> torch.Tensor:
        ctx.mesh, ctx.axes = mesh, axes
        return P.summed_copy(x, mesh, axes)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        return P.summed_copy(grad, ctx.mesh, ctx.axes), None, None


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return P.all_gather(x, mesh, axis, dim)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        return P.reduce_scatter(grad, ctx.mesh, ctx.axis, ctx.dim), None, None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return P.reduce_scatter(x, mesh, axis, dim)

    @staticmethod
    @first_order
    def backward(ctx, grad: torch.Tensor):
        return P.all_gather(grad, ctx.mesh, ctx.axis, ctx.dim), None, None, None


# ---- tier 3: public functions -----------------------------------------------------------------
def activation_sharding(shape: Sequence[int]) -> Sharding:
    """``[b, ..., h]``: batch over (depth, col) as block k·q + i, hidden over row as block j."""
    middle = tuple(() for _ in range(len(shape) - 2))
    return Sharding((("depth", "col"), *middle, ("row",)), tuple(shape))


def batch_sharding(shape: Sequence[int]) -> Sharding:
    """``[b, ...]``: batch over (depth, col) as in ``activation_sharding``; replicated over rows."""
    return Sharding((("depth", "col"), *(() for _ in range(len(shape) - 1))), tuple(shape))


def scatter(x: torch.Tensor, mesh: Mesh, *, check: bool | None = None) -> torch.Tensor:
    """Full ``[b, ..., h]`` (the same on every rank) → this rank's block ``[b/(d·q), ..., h/q]``.

    forward: local slice, no communication; backward: all-gather, so a replicated input receives
    its whole gradient on every rank. ``check``: verify that ``x`` is the same on every rank (one
    5-word all-gather of its shape and checksum; default: unless the mesh's check is "off").
    """
    mesh = as_mesh(mesh, "scatter's mesh")  # a torch DeviceMesh: its Mesh
    check_replicated(mesh, "scatter", x, lambda: _check_activation("scatter", x, mesh), check)
    out = _Split.apply(x, mesh, activation_sharding(x.shape))
    if mesh.size > 1:  # a later gather(x) or scatter(out) is refused: x is not a block, out is one
        x._optimus2d_full = out._optimus2d_block = True
    tag(out, mesh, agreed=check is not False and mesh.check != "off")  # a module on another mesh refuses it
    out._optimus2d_kind = "activation"  # its layout, for redistribute
    return out


def gather(x_local: torch.Tensor, mesh: Mesh, *, check: bool | None = None) -> torch.Tensor:
    """Block ``[b/(d·q), ..., h/q]`` → the full ``[b, ..., h]`` on every rank.

    forward: all-gather over row (hidden), col and depth (batch); backward: keep the local block of
    the gradient (which must be the same on every rank, as when every rank computes the same loss).

    Refused on every rank (level "entry" and up, or ``check=True``), in one 5-word all-gather: blocks
    of other shapes; a tensor given to ``scatter`` or returned by ``gather`` (a full one); a block of
    another mesh or of ``scatter_batch``; and a tensor that is the same, and not constant, on every
    rank while none carries a block's tag (made by plain torch, ``detach()`` included): that is the
    full tensor, which gather would tile. Blocks that really are the same on every rank pass with
    ``check=False``, which skips every check.
    """
    mesh = as_mesh(mesh, "gather's mesh")  # a torch DeviceMesh: its Mesh
    error, tagged = _gather_refusal(x_local, mesh), False
    if error is None:
        tagged = getattr(x_local, "_optimus2d_layout", None) == layout(mesh)
    checking = check is True or (check is None and mesh.check != "off")
    if checking and mesh.size > 1:
        summed = error is None and not tagged and x_local.numel() > 0 and not torch.compiler.is_compiling()
        same = agree_distinct(mesh, "gather", describe(x_local), error, x_local if summed else None)
        if same:
            full = [x_local.shape[0] * mesh.depth * mesh.q, *x_local.shape[1:-1], x_local.shape[-1] * mesh.q]
            raise ValueError(
                f"gather on {mesh}: every rank passes the same tensor {describe(x_local)} (its values are not "
                f"constant), and none carries the tag of a block of this mesh: it is the full tensor, which "
                f"gather would tile to {full}. Pass this rank's block (optimus2d.scatter(x, mesh) makes it; an "
                f"optimus2d module returns it); if the blocks really are the same on every rank, pass check=False"
            )
    elif error is not None:
        raise error
    full = list(x_local.shape)
    full[0] *= mesh.depth * mesh.q
    full[-1] *= mesh.q
    out = _Gather.apply(x_local, mesh, activation_sharding(full))
    out._optimus2d_full = mesh.size > 1
    return out


def _gather_refusal(x: object, mesh: Mesh) -> BaseException | None:
    """Why ``gather`` refuses this rank's ``x``, found without communicating, or None."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return TypeError(f"gather expects a local block [b/(d·q), ..., h/q], got {_describe(x)}")
    if mesh.size == 1:
        return None
    if getattr(x, "_optimus2d_full", False):
        return ValueError(
            f"gather expects a local block, but this tensor {tuple(x.shape)} is a full one (it was "
            f"given to scatter or returned by gather) ({mesh})"
        )
    other = other_mesh(x, mesh)
    if other is not None:
        return ValueError(
            f"gather expects a block of {mesh}, but this tensor {tuple(x.shape)} is a block of {other}: "
            f"gather it on that mesh, or redistribute it to this one first"
        )
    if getattr(x, "_optimus2d_kind", None) == "sequence":
        return ValueError(
            f"gather expects an activation block [b/(d·q), ..., h/q], but this tensor {tuple(x.shape)} is a "
            f"sequence block [b/q, s/d, ..., h/q] (from optimus2d.context.scatter): gather it with "
            f"optimus2d.context.gather ({mesh})"
        )
    if getattr(x, "_optimus2d_layout", None) is not None and getattr(x, "_optimus2d_kind", None) == "batch":
        return ValueError(
            f"gather expects an activation block [b/(d·q), ..., h/q], but this tensor {tuple(x.shape)} is a "
            f"batch block [b/(d·q), ...] (from scatter_batch), whole along its last dim ({mesh})"
        )
    return None


def scatter_batch(t: torch.Tensor, mesh: Mesh, *, check: bool | None = None) -> torch.Tensor:
    """Full ``[b, ...]`` (token ids, targets) → ``[b/(d·q), ...]``: batch block k·q + i, like scatter.

    forward: local slice; backward: all-reduce over the row (the q ranks of a row hold the same
    block, and each its part of the gradient, as ``reduce_grad`` sums), then all-gather (only
    float tensors have gradients). ``check``: as in ``scatter``.
    """
    mesh = as_mesh(mesh, "scatter_batch's mesh")  # a torch DeviceMesh: its Mesh
    check_replicated(mesh, "scatter_batch", t, lambda: _check_batch(t, mesh), check)
    out = _SplitBatch.apply(t, mesh, batch_sharding(t.shape))
    tag(out, mesh, agreed=check is not False and mesh.check != "off")
    out._optimus2d_kind = "batch"  # its layout, for redistribute
    return out


def reduce_grad(x: torch.Tensor, mesh: Mesh, axes: Sequence[str]) -> torch.Tensor:
    """forward: identity; backward: all-reduce the gradient over ``axes``.

    Wrap a tensor replicated over ``axes`` (a weight over depth, a bias over col and depth) before
    use, so its gradient sums every replica's contribution.
    """
    if mesh.size == 1 or not torch.is_grad_enabled() or not x.requires_grad:
        return x
    axes = tuple(a for a in axes if mesh.axis_size(a) > 1)
    return _ReduceGrad.apply(x, mesh, axes) if axes else x


ALIKE = "_optimus2d_grad_alike"  # a block's attribute: the axes whose replicas each take its whole gradient


def grad_alike(x: torch.Tensor, mesh: Mesh, axes: Sequence[str]) -> torch.Tensor:
    """Note on ``x``, a block replicated over ``axes`` whose every replica takes the whole gradient
    (``all_reduce``'s output, a loss computed alike on each: attention's averaged weights, the
    per-target losses), that a boundary moving it must hand each replica the whole gradient back,
    not the part every other block's convention gives one holder (``take_alike``). Returns ``x``.
    The note is on ``x`` itself: a tensor computed from it (``x * mask``) has none, and a boundary
    moves that as any batch block (move the marked tensor, then compute)."""
    setattr(x, ALIKE, tuple(axes))  # kept where an axis has one rank: a later boundary may meet more
    return x


def take_alike(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """forward: identity; backward: all-reduce over the axes ``grad_alike`` noted on ``x`` (none: ``x``).

    Before a boundary moves such a block (``to_whole``, ``redistribute``): their backward gives a
    replicated box's gradient to one holder (the sum of the replicas' is the gradient), which the
    all-reduce hands to every replica, as its producer takes it."""
    axes = getattr(x, ALIKE, None)
    return reduce_grad(x, mesh, axes) if axes else x


def give_alike(x: torch.Tensor, mesh: Mesh, axes: Sequence[str]) -> torch.Tensor:
    """forward: identity, ``x`` noted ``grad_alike`` over ``axes``; backward: the gradient on the
    first rank of ``axes``, zeros on the others, nothing sent.

    After a boundary moved a ``grad_alike`` block: its consumers give each replica the whole
    gradient, the boundary's backward takes a replicated box's gradient as its replicas' sum."""
    split = tuple(a for a in axes if mesh.axis_size(a) > 1)
    out = _OneHolder.apply(x, mesh, split) if split and torch.is_grad_enabled() and x.requires_grad else x
    return grad_alike(out, mesh, axes)


def all_reduce(x: torch.Tensor, mesh: Mesh, axes: Sequence[str]) -> torch.Tensor:
    """forward: all-reduce (sum) over ``axes``; backward: identity.

    For a sum whose result feeds computations replicated over ``axes``.
    """
    axes = tuple(a for a in axes if mesh.axis_size(a) > 1)
    if not axes:
        return x
    return _AllReduce.apply(x, mesh, axes)


def sum_across(x: torch.Tensor, mesh: Mesh, axes: Sequence[str]) -> torch.Tensor:
    """forward: all-reduce (sum) over ``axes``; backward: all-reduce.

    For a sum whose result feeds different computations on each rank of ``axes`` (LayerNorm's
    statistics over the row feed every hidden block), so the gradients must be summed back.
    """
    axes = tuple(a for a in axes if mesh.axis_size(a) > 1)
    if not axes:
        return x
    return _SumAcross.apply(x, mesh, axes)


def all_gather(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    """forward: all-gather along ``dim`` over ``axis``; backward: reduce-scatter."""
    if mesh.axis_size(axis) == 1:
        return x
    return _AllGather.apply(x, mesh, axis, dim)


def reduce_scatter(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    """forward: reduce-scatter (sum, keep this rank's chunk of ``dim``) over ``axis``; backward: all-gather."""
    if mesh.axis_size(axis) == 1:
        return x
    return _ReduceScatter.apply(x, mesh, axis, dim)


def _check_activation(what: str, x: torch.Tensor, mesh: Mesh) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise TypeError(f"{what} expects a full tensor [b, ..., h], got {_describe(x)}")
    if getattr(x, "_optimus2d_block", False) and mesh.size > 1:
        raise ValueError(f"{what} expects a full tensor, but {tuple(x.shape)} is a block (from scatter) ({mesh})")
    n = mesh.depth * mesh.q
    if x.shape[0] % n:
        raise ValueError(f"{what}: batch dim 0 of tensor {tuple(x.shape)} is not divisible by depth·q = {n} ({mesh})")
    if x.shape[-1] % mesh.q:
        raise ValueError(f"{what}: hidden dim -1 of tensor {tuple(x.shape)} is not divisible by q = {mesh.q} ({mesh})")
    if 0 in x.shape:
        raise ValueError(f"{what}: tensor {tuple(x.shape)} is empty along dim {list(x.shape).index(0)} ({mesh})")


def _check_batch(t: torch.Tensor, mesh: Mesh) -> None:
    n = mesh.depth * mesh.q
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        raise TypeError(f"scatter_batch expects a tensor [b, ...], got {_describe(t)}")
    if t.shape[0] % n:
        raise ValueError(
            f"scatter_batch: batch dim 0 of tensor {tuple(t.shape)} is not divisible by depth·q = {n} ({mesh})"
        )
    if 0 in t.shape:
        raise ValueError(f"scatter_batch: tensor {tuple(t.shape)} is empty along dim {list(t.shape).index(0)} ({mesh})")


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__}"
