"""The sequence layout: the depth axis splits the sequence instead of the batch (context parallelism).

A block of the activation layout (``functional.scatter``) is ``[b/(d·q), s, ..., h/q]``: the batch
split over (depth, col). In the sequence layout it is ``[b/q, s/d, ..., h/q]``: the batch over col,
the sequence (dim 1) over depth, the hidden dim over row. Every token-wise layer (Linear2D,
LayerNorm2D, the MLP, the embedding) computes on either block alike — their depth reductions sum
the weights' gradients over tokens, whichever tokens a depth slice holds — so only what mixes
tokens (attention, ``optimus2d.context.attention``) needs to know. Which tokens depth slice k holds
is the caller's choice: ``optimus2d.context`` permutes the sequence first (``Assignment``) and
hands the permuted tensor here, split contiguously.

A module that runs in the sequence layout inside a model that does not (``context.ContextParallel``
in ``parallelize``'s plan) enters it from the activation layout by ``batch_to_sequence``: on a
(q, d) mesh rank (k, i, j) holds batch block k·q + i of d·q, every position; one all-to-all over
depth gives it the samples of blocks m·q + i for m = 0..d−1 (in m order: every depth slice of a
column the same samples), at the positions of its sequence slice. ``sequence_to_batch`` is the
inverse. Each sends (d − 1)/d of its block and receives as much; the block keeps its size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd import Function

from optimus2d.comm import primitives as P
from optimus2d.comm.agreement import agree, check_replicated, describe
from optimus2d.comm.calls import tag
from optimus2d.comm.counter import record
from optimus2d.comm.first_order import first_order
from optimus2d.comm.functional import _describe, _Gather, _Split, _SplitBatch
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding


def sequence_sharding(shape: Sequence[int]) -> Sharding:
    """``[b, s, ..., h]``: batch over col, sequence over depth, hidden over row."""
    middle = tuple(() for _ in range(len(shape) - 3))
    return Sharding((("col",), ("depth",), *middle, ("row",)), tuple(shape))


def scatter_sequence(x: torch.Tensor, mesh: Mesh, *, check: bool | None = None) -> torch.Tensor:
    """Full ``[b, s, ..., h]`` (the same on every rank) → this rank's block ``[b/q, s/d, ..., h/q]``:
    batch block i (col), sequence block k (depth), hidden block j (row).

    forward: local slice, no communication; backward: all-gather, so a replicated input receives
    its whole gradient on every rank. ``check``: as in ``scatter`` (one 5-word all-gather of the
    input's shape and checksum).
    """
    check_replicated(mesh, "scatter_sequence", x, lambda: _check_sequence("scatter_sequence", x, mesh), check)
    out = _Split.apply(x, mesh, sequence_sharding(x.shape))
    if mesh.size > 1:
        x._optimus2d_full = out._optimus2d_block = True
    tag(out, mesh, agreed=check is not False and mesh.check != "off")
    out._optimus2d_kind = "sequence"  # gather and redistribute refuse it: they read batch blocks
    return out


def scatter_sequence_batch(t: torch.Tensor, mesh: Mesh, *, check: bool | None = None) -> torch.Tensor:
    """Full ``[b, s, ...]`` (token ids, targets, position ids) → ``[b/q, s/d, ...]``: batch block i
    (col), sequence block k (depth), whole over row, as ``scatter_sequence`` splits activations.

    forward: local slice; backward: all-reduce over the row (the q ranks of a row hold the same
    block, and each its part of the gradient, as ``scatter_batch``), then all-gather (only float
    tensors have gradients).
    """
    check_replicated(mesh, "scatter_sequence_batch", t, lambda: _check_ids(t, mesh), check)
    out = _SplitBatch.apply(t, mesh, sequence_batch_sharding(t.shape))
    tag(out, mesh, agreed=check is not False and mesh.check != "off")
    out._optimus2d_kind = "sequence"
    return out


def sequence_batch_sharding(shape: Sequence[int]) -> Sharding:
    """``[b, s, ...]`` (ids, targets): batch over col, sequence over depth, whole over row."""
    return Sharding((("col",), ("depth",), *(() for _ in range(len(shape) - 2))), tuple(shape))


def gather_sequence(x_local: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Block ``[b/q, s/d, ..., h/q]`` → the full ``[b, s, ..., h]`` on every rank.

    forward: all-gather over row (hidden), col (batch) and depth (sequence); backward: keep the
    local block of the gradient (the same on every rank, as when every rank computes the same loss).
    """
    error = None
    if not isinstance(x_local, torch.Tensor) or x_local.dim() < 3:
        error = TypeError(f"gather_sequence expects a local block [b/q, s/d, ..., h/q], got {_describe(x_local)}")
    if mesh.check != "off":  # the same block shape on every rank, or one error on every rank
        agree(mesh, "gather_sequence", description=describe(x_local), error=error)
    elif error is not None:
        raise error
    full = list(x_local.shape)
    full[0] *= mesh.q
    full[1] *= mesh.depth
    full[-1] *= mesh.q
    out = _Gather.apply(x_local, mesh, sequence_sharding(full))
    out._optimus2d_full = mesh.size > 1
    return out


class _Resplit(Function):
    """``batch_to_sequence`` (``to_sequence``) or its inverse; backward is the other direction."""

    @staticmethod
    def forward(ctx, x, mesh, permutation, to_sequence):
        ctx.mesh, ctx.permutation, ctx.to_sequence = mesh, permutation, to_sequence
        return (_to_sequence if to_sequence else _to_batch)(x, mesh, permutation)

    @staticmethod
    @first_order
    def backward(ctx, grad):
        back = _to_batch if ctx.to_sequence else _to_sequence
        return back(grad, ctx.mesh, ctx.permutation), None, None, None


def _to_sequence(x: torch.Tensor, mesh: Mesh, permutation: torch.Tensor) -> torch.Tensor:
    permuted = x.index_select(1, permutation.to(x.device))
    return P.all_to_all(permuted, mesh, "depth", split_dim=1, cat_dim=0)


def _to_batch(y: torch.Tensor, mesh: Mesh, permutation: torch.Tensor) -> torch.Tensor:
    permuted = P.all_to_all(y.contiguous(), mesh, "depth", split_dim=0, cat_dim=1)
    return permuted.index_select(1, torch.argsort(permutation).to(y.device))


def batch_to_sequence(x: torch.Tensor, mesh: Mesh, permutation: torch.Tensor) -> torch.Tensor:
    """A block of the activation or batch layout ``[b/(d·q), s, ...]`` → the sequence layout
    ``[b/q, s/d, ...]``: the positions ``permutation[k·s/d : (k+1)·s/d]`` (k: this rank's depth
    index) of the samples of batch blocks m·q + i, m = 0..d−1 (the layout at the top of this file).

    forward: all-to-all over depth; backward: the inverse all-to-all (``sequence_to_batch``).
    The caller checks the shapes on every rank first: s divisible by d, ``permutation`` of range(s).
    """
    out = _Resplit.apply(x, mesh, permutation, True)
    tag(out, mesh, agreed=False)
    out._optimus2d_kind = "sequence"
    return out


def sequence_to_batch(y: torch.Tensor, mesh: Mesh, permutation: torch.Tensor) -> torch.Tensor:
    """The inverse of ``batch_to_sequence``: ``[b/q, s/d, ...]`` → ``[b/(d·q), s, ...]`` in sequence order.

    forward: all-to-all over depth; backward: ``batch_to_sequence``'s all-to-all.
    """
    out = _Resplit.apply(y, mesh, permutation, False)
    tag(out, mesh, agreed=False)
    return out


def _check_ids(t: torch.Tensor, mesh: Mesh) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise TypeError(f"scatter_sequence_batch expects a full tensor [b, s, ...], got {_describe(t)}")
    for dim, name, axis, n in ((0, "batch", "q", mesh.q), (1, "sequence", "depth", mesh.depth)):
        if t.shape[dim] % n:
            raise ValueError(
                f"scatter_sequence_batch: {name} dim {dim} of tensor {tuple(t.shape)} is not divisible by "
                f"{axis} = {n} ({mesh})"
            )


def _check_sequence(what: str, x: torch.Tensor, mesh: Mesh) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise TypeError(f"{what} expects a full tensor [b, s, ..., h], got {_describe(x)}")
    for dim, name, n in ((0, "batch", mesh.q), (1, "sequence", mesh.depth), (x.dim() - 1, "hidden", mesh.q)):
        if x.shape[dim] % n:
            axis = "depth" if name == "sequence" else "q"
            raise ValueError(
                f"{what}: {name} dim {dim} of tensor {tuple(x.shape)} is not divisible by {axis} = {n} ({mesh})"
            )


RING_TAGS = (3, 4)  # point-to-point tags of the ring's two streams (K/V, and dK/dV in backward)


class Shift:
    """One step round the ``axis`` ring, in the background: ``t`` to the next member (index + 1),
    the previous member's tensor of the same shape into a new buffer; ``wait()`` returns it. Counted
    as "ring" (the tensor sent). Used by ``context.ring`` to pass K/V blocks and their gradients."""

    def __init__(self, t: torch.Tensor, mesh: Mesh, axis: str, stream: int = 0) -> None:
        n, me = mesh.axis_size(axis), mesh.index(axis)
        t = t.contiguous()
        self.out, self._handles = torch.empty_like(t), []
        if n == 1:
            self.out = t
            return
        record("ring", axis, t)
        tag = RING_TAGS[stream]
        self._handles = [
            P.isend(t, mesh, axis, (me + 1) % n, tag),
            P.irecv(self.out, mesh, axis, (me - 1) % n, tag),
        ]

    def wait(self) -> torch.Tensor:
        for handle in self._handles:
            handle.wait()
        self._handles = []
        return self.out
