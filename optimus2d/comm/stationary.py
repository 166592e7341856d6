"""Weight-stationary products on the mesh: the same blocks as SUMMA, but only activations travel.

SUMMA (``summa.py``) moves every weight block q times a product, 3·in·out/q elements per rank
for forward + backward however small the batch. When the rows of a batch are fewer than about
1–1.5 × the smaller feature size, moving activations instead is cheaper: each rank gathers the activation
rows its weight block needs, multiplies locally, and reduce-scatters the partial output over the
ranks that hold the other blocks of the same output columns. No weight ever moves (its gradient
is summed over depth only, as in SUMMA).

Both forms keep SUMMA's weight blocks, so a layer can switch per call (``Linear2D`` picks the one
that moves fewer elements, ``optimus2d.cost.linear_2d_algorithm``). Rows split over depth·q as
activations are; R = the rows of one depth slice, r = R/q this rank's rows. On rank (k, i, j):

    ab   C = A·B,  B block (i, j) [in/q, out/q] (= SUMMA ab's):
         forward:  Aᵀ-exchange (A block of rank (k, j, i)), all-gather over row → A[:, blk i] [R, in/q];
                   times B_ij → partial [R, out/q]; reduce-scatter over col → C_ij [r, out/q]
         backward: all-gather dC over col → dC[:, blk j]; dA: times B_ijᵀ, reduce-scatter over row,
                   exchange back; dB = A[:, blk i]ᵀ·dC[:, blk j] (A regathered), summed over depth
    abt  C = A·Bᵀ, B block (i, j) [out/q, in/q] (= SUMMA abt's):
         forward:  all-gather A over col → A[:, blk j] [R, in/q]; times B_ijᵀ → partial [R, out/q];
                   reduce-scatter over row, exchange → C_ij [r, out/q]
         backward: exchange dC, all-gather over row → dC[:, blk i]; dA: times B_ij, reduce-scatter over
                   col; dB = dC[:, blk i]ᵀ·A[:, blk j] (A regathered), summed over depth

The exchange ("transpose") swaps blocks between ranks (k, i, j) and (k, j, i) and always carries
the narrower of the input and output (in ≤ out for ab, the output for abt). Only the local
input block is saved for backward, so activation memory is the same as SUMMA's.

The gathers and reduce-scatters are streamed per batch block (``primitives.Blocks`` and
``PartialSums``): block t's product is computed while block t+1 arrives, and each partial leaves
for its owner as soon as it is made.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from optimus2d.comm import primitives as P
from optimus2d.comm.first_order import first_order
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.recompute import Activation, Recomputed, activated, kept_for_backward

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _products(
    blocks: P.Blocks,
    matrix: torch.Tensor,
    sums: P.PartialSums | None,
    weight: tuple[_WeightGrad, P.Blocks, bool] | None = None,
) -> None:
    """For every batch block t as it arrives: ``sums.put(t, block_t · matrix)``; and with ``weight``
    = (gradient, other blocks, blocks on the left), the gradient adds block_tᵀ·other_t (or
    other_tᵀ·block_t)."""
    for t in blocks.order:
        block = blocks.get(t)
        if sums is not None:
            sums.put(t, block @ matrix)
        if weight is not None:
            grad, others, on_left = weight
            other = others.get(t)
            grad.add(*((block, other) if on_left else (other, block)))
    blocks.finish()
    if weight is not None:
        weight[1].finish()


class _WeightGrad:
    """Σ_t lhs_tᵀ · rhs_t over the batch blocks t (fp32 accumulation for 16-bit), summed over depth.

    Made in ``like``'s memory layout: for a weight's transposed view it sums rhs_tᵀ · lhs_t and
    returns the transpose, so ``weight.grad`` accumulates a contiguous tensor."""

    def __init__(self, like: torch.Tensor) -> None:
        self.dtype = like.dtype
        self.acc = torch.float32 if like.dtype in _LOW_PRECISION else like.dtype
        self.transposed = P.is_transposed_view(like)
        self.total: torch.Tensor | None = None

    def add(self, lhs: torch.Tensor, rhs: torch.Tensor) -> None:
        if self.transposed:
            lhs, rhs = rhs, lhs
        lhs, rhs = lhs.t().to(self.acc), rhs.to(self.acc)
        if self.total is None:
            self.total = lhs @ rhs
        else:
            self.total.addmm_(lhs, rhs)

    def result(self, mesh: Mesh) -> torch.Tensor:
        grad = self.total.to(self.dtype)
        P.all_reduce(grad, mesh, "depth")
        return grad.t() if self.transposed else grad


class _StationaryAB(Function):
    @staticmethod
    def forward(ctx, a, b, mesh, activation):
        ctx.mesh, ctx.activation = mesh, activation
        a_swapped = P.transpose(a.contiguous(), mesh)  # A[batch blk j, blk i] on rank (k, i, j)
        ctx.a_shape = a_swapped.shape
        # before the activation (comm/recompute.py)
        ctx.save_for_backward(kept_for_backward(ctx, a_swapped, activation), b)
        out = P.PartialSums(mesh, "col", (a.shape[0], b.shape[1]), a)  # batch block t → col member t
        _products(P.Blocks(activated(a_swapped, activation), mesh, "row"), b, out)  # row member t: batch block t
        return out.result()

    @staticmethod
    @first_order
    def backward(ctx, grad_c):
        pre_swapped, b = ctx.saved_tensors
        mesh, need_a, need_b = ctx.mesh, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        a_swapped = Recomputed(pre_swapped, ctx.activation)
        grads = P.Blocks(grad_c.contiguous(), mesh, "col")  # dC[batch blk t, blk j]
        inputs = P.Blocks(a_swapped.value, mesh, "row") if need_b else None  # A[batch blk t, blk i]
        grad_a = P.PartialSums(mesh, "row", ctx.a_shape, grad_c) if need_a else None
        grad_b = _WeightGrad(b) if need_b else None
        _products(grads, b.t(), grad_a, (grad_b, inputs, False) if need_b else None)
        inputs = None  # frees the recomputed activation before its input gradient (comm/recompute.py)
        return (
            P.transpose(a_swapped.grad(grad_a.result()), mesh) if need_a else None,
            grad_b.result(mesh) if need_b else None,
            None,
            None,
        )


class _StationaryABT(Function):
    @staticmethod
    def forward(ctx, a, b, mesh, activation):
        ctx.mesh, ctx.activation = mesh, activation
        a = a.contiguous()
        ctx.a_shape = a.shape
        ctx.save_for_backward(kept_for_backward(ctx, a, activation), b)  # before the activation (comm/recompute.py)
        out = P.PartialSums(mesh, "row", (a.shape[0], b.shape[0]), a)  # batch block t → row member t
        _products(P.Blocks(activated(a, activation), mesh, "col"), b.t(), out)  # col member t: batch block t
        return P.transpose(out.result(), mesh)

    @staticmethod
    @first_order
    def backward(ctx, grad_c):
        pre, b = ctx.saved_tensors
        mesh, need_a, need_b = ctx.mesh, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        a = Recomputed(pre, ctx.activation)
        grads = P.Blocks(P.transpose(grad_c.contiguous(), mesh), mesh, "row")  # dC[batch blk t, blk i]
        inputs = P.Blocks(a.value, mesh, "col") if need_b else None  # A[batch blk t, blk j]
        grad_a = P.PartialSums(mesh, "col", ctx.a_shape, grad_c) if need_a else None
        grad_b = _WeightGrad(b) if need_b else None
        _products(grads, b, grad_a, (grad_b, inputs, True) if need_b else None)
        inputs = None  # frees the recomputed activation before its input gradient (comm/recompute.py)
        return a.grad(grad_a.result()) if need_a else None, grad_b.result(mesh) if need_b else None, None, None


def _check(name: str, a: torch.Tensor, b: torch.Tensor, mesh: Mesh, b_dim: int) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{name} takes 2-D local blocks, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.shape[1] != b.shape[b_dim]:
        raise ValueError(
            f"{name}: local blocks a {tuple(a.shape)} (dim 1) and b {tuple(b.shape)} (dim {b_dim}) "
            f"must share the contracted size on {mesh}"
        )


def stationary_ab(a: torch.Tensor, b: torch.Tensor, mesh: Mesh, *, activation: Activation = None) -> torch.Tensor:
    """C = A·B with B's blocks staying put. a: [M/(d·q), K/q]; b: block (i, j) of B [K, N] as [K/q, N/q].

    forward: exchange with rank (k, j, i), all-gather over row, reduce-scatter over col;
    backward: all-gather over col, reduce-scatter over row and exchange (dA), all-gather over row
    (dB), all-reduce of dB over depth.
    ``activation``: C = act(A)·B, keeping A and recomputing act(A) in backward (comm/recompute.py).
    """
    _check("stationary_ab", a, b, mesh, 0)
    return _StationaryAB.apply(a, b, mesh, activation)


def stationary_abt(a: torch.Tensor, b: torch.Tensor, mesh: Mesh, *, activation: Activation = None) -> torch.Tensor:
    """C = A·Bᵀ with B's blocks staying put. a: [M/(d·q), K/q]; b: block (i, j) of B [N, K] as [N/q, K/q].

    forward: all-gather over col, reduce-scatter over row, exchange with rank (k, j, i);
    backward: exchange and all-gather over row, reduce-scatter over col (dA), all-gather over col
    (dB), all-reduce of dB over depth.
    ``activation``: C = act(A)·Bᵀ, keeping A and recomputing act(A) in backward.
    """
    _check("stationary_abt", a, b, mesh, 1)
    return _StationaryABT.apply(a, b, mesh, activation)
