"""SUMMA matrix products on the mesh: C = A·B, A·Bᵀ and Aᵀ·B, as autograd Functions.

Every matrix is held as q×q blocks: rank (k, i, j) holds block (i, j) of its depth slice. The rows
of A (and of C for A·B and A·Bᵀ) are split over depth·q, as activations are; B (and C of Aᵀ·B) is
replicated over depth, as weights are, so its gradient (or its value, for Aᵀ·B) is summed over
the depth group. One code path serves 2D (depth=1) and 2.5D.

The three kernels, step t = 0..q-1 (block (i, j) of a matrix X is X_ij):

    ab:   C_ij += A_it · B_tj           broadcast A_it along the row, B_tj along the column
    abt:  C_it  = Σ_j A_ij · B_tjᵀ      broadcast B_tj along the column, reduce to column t
    atb:  C_tj  = Σ_i A_itᵀ · B_ij      broadcast A_it along the row, reduce to row t

The broadcasts of step t+1 are issued (async, into the second of two buffers) before the local
matmul of step t, so communication overlaps computation.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd import Function

from optimus2d.comm import primitives as P
from optimus2d.comm.mesh import Mesh
from optimus2d.recompute import Activation, Recomputed, activated

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _sendable(t: torch.Tensor):
    """A contiguous tensor to send for ``t`` and how to view a received buffer like ``t``."""
    if t.is_contiguous():
        return t, lambda buf: buf
    if t.dim() == 2 and t.t().is_contiguous():  # a transposed view (a weight's .t()): send as stored
        return t.t(), lambda buf: buf.t()
    return t.contiguous(), lambda buf: buf


def _pipelined_broadcasts(mesh: Mesh, operands: list[tuple[torch.Tensor, str]]) -> Iterator[list]:
    """For t = 0..q-1 yields every operand's block from member t of its axis group.

    The broadcasts of step t+1 are in flight while the caller computes with step t's blocks.
    """
    prepared = [(_sendable(t.detach()), axis) for t, axis in operands]
    buffers = [[torch.empty_like(send) for (send, _), _ in prepared] for _ in range(2)]

    def issue(step: int):
        blocks, handles = [], []
        for n, ((send, view), axis) in enumerate(prepared):
            buf = send if mesh.index(axis) == step else buffers[step % 2][n]
            handles.append(P.broadcast(buf, mesh, axis, step, async_op=True))
            blocks.append(view(buf))
        return blocks, handles

    pending = issue(0)
    for step in range(mesh.q):
        blocks, handles = pending
        for h in handles:
            h.wait()
        if step + 1 < mesh.q:
            pending = issue(step + 1)
        yield blocks


def _ab(a: torch.Tensor, b: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """C_ij = Σ_t A_it · B_tj; a [m, k/q], b [k/q, n/q] → c [m, n/q]."""
    if mesh.q == 1:  # one step: no accumulator to fill
        return a @ b
    acc_dtype = torch.float32 if a.dtype in _LOW_PRECISION else a.dtype
    c = torch.zeros(a.shape[0], b.shape[1], dtype=acc_dtype, device=a.device)
    for a_t, b_t in _pipelined_broadcasts(mesh, [(a, "row"), (b, "col")]):
        if acc_dtype == a.dtype:
            c.addmm_(a_t, b_t)
        else:  # low precision: fp32 accumulator across steps
            c.add_(a_t @ b_t)
    return c.to(a.dtype)


def _reduce_partials(mesh: Mesh, partials: Iterator[torch.Tensor], axis: str) -> torch.Tensor:
    """Reduce the t-th partial to member t of ``axis``; returns this rank's reduced block."""
    mine, in_flight = None, []
    for step, partial in enumerate(partials):
        in_flight.append(P.reduce(partial, mesh, axis, step, async_op=True))
        if mesh.index(axis) == step:
            mine = partial
        if len(in_flight) > 2:
            in_flight.pop(0).wait()
    for h in in_flight:
        h.wait()
    return mine


def _abt(a: torch.Tensor, b: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """C_it = Σ_j A_ij · B_tjᵀ; a [m, k/q], b [n/q, k/q] → c [m, n/q]."""
    blocks = _pipelined_broadcasts(mesh, [(b, "col")])
    return _reduce_partials(mesh, (a @ b_t.t() for (b_t,) in blocks), "row")


def _atb(a: torch.Tensor, b: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """C_tj = Σ_i A_itᵀ · B_ij, summed over depth; a [m, k/q], b [m, n/q] → c [k/q, n/q]."""
    blocks = _pipelined_broadcasts(mesh, [(a, "row")])
    c = _reduce_partials(mesh, (a_t.t() @ b for (a_t,) in blocks), "col")
    P.all_reduce(c, mesh, "depth")
    return c


def _sum_over_depth(grad: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    return P.summed_copy(grad, mesh, ("depth",))


class _SummaAB(Function):
    @staticmethod
    def forward(ctx, a, b, mesh, activation):
        ctx.mesh, ctx.activation = mesh, activation
        ctx.save_for_backward(a, b)  # a before the activation (optimus2d/recompute.py)
        return _ab(activated(a, activation), b, mesh)

    @staticmethod
    def backward(ctx, grad_c):
        pre, b = ctx.saved_tensors
        a = Recomputed(pre, ctx.activation)
        grad_c = grad_c.contiguous()
        grad_a = a.grad(_abt(grad_c, b, ctx.mesh)) if ctx.needs_input_grad[0] else None  # dC·Bᵀ
        grad_b = _atb(a.value, grad_c, ctx.mesh) if ctx.needs_input_grad[1] else None  # Aᵀ·dC
        return grad_a, grad_b, None, None


class _SummaABT(Function):
    @staticmethod
    def forward(ctx, a, b, mesh, activation):
        ctx.mesh, ctx.activation = mesh, activation
        ctx.save_for_backward(a, b)  # a before the activation (optimus2d/recompute.py)
        return _abt(activated(a, activation), b, mesh)

    @staticmethod
    def backward(ctx, grad_c):
        pre, b = ctx.saved_tensors
        a = Recomputed(pre, ctx.activation)
        grad_c = grad_c.contiguous()
        grad_a = a.grad(_ab(grad_c, b, ctx.mesh)) if ctx.needs_input_grad[0] else None  # dC·B
        grad_b = _atb(grad_c, a.value, ctx.mesh) if ctx.needs_input_grad[1] else None  # dCᵀ·A
        return grad_a, grad_b, None, None


class _SummaATB(Function):
    @staticmethod
    def forward(ctx, a, b, mesh):
        ctx.mesh = mesh
        ctx.save_for_backward(a, b)
        return _atb(a, b, mesh)

    @staticmethod
    def backward(ctx, grad_c):
        a, b = ctx.saved_tensors
        grad_c = _sum_over_depth(grad_c, ctx.mesh)  # C is replicated over depth
        grad_a = _abt(b, grad_c, ctx.mesh) if ctx.needs_input_grad[0] else None  # B·dCᵀ
        grad_b = _ab(a, grad_c, ctx.mesh) if ctx.needs_input_grad[1] else None  # A·dC
        return grad_a, grad_b, None


def _check(name: str, a: torch.Tensor, b: torch.Tensor, mesh: Mesh, a_dim: int, b_dim: int) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{name} takes 2-D local blocks, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.shape[a_dim] != b.shape[b_dim]:
        raise ValueError(
            f"{name}: local blocks a {tuple(a.shape)} (dim {a_dim}) and b {tuple(b.shape)} (dim {b_dim}) "
            f"must share the contracted size on {mesh}"
        )


def summa_ab(a: torch.Tensor, b: torch.Tensor, mesh: Mesh, *, activation: Activation = None) -> torch.Tensor:
    """C = A·B. a: block of A [M, K] as [M/(d·q), K/q]; b: block of B [K, N] as [K/q, N/q].

    forward: q broadcasts of A blocks along rows and of B blocks along columns;
    backward: dA = dC·Bᵀ (abt), dB = Aᵀ·dC (atb, all-reduced over depth).
    ``activation``: C = act(A)·B, keeping A and recomputing act(A) in backward (optimus2d/recompute.py).
    """
    _check("summa_ab", a, b, mesh, 1, 0)
    return _SummaAB.apply(a, b, mesh, activation)


def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh: Mesh, *, activation: Activation = None) -> torch.Tensor:
    """C = A·Bᵀ. a: block of A [M, K] as [M/(d·q), K/q]; b: block of B [N, K] as [N/q, K/q].

    forward: q broadcasts of B blocks along columns, q reduces of C partials along rows;
    backward: dA = dC·B (ab), dB = dCᵀ·A (atb, all-reduced over depth).
    ``activation``: C = act(A)·Bᵀ, keeping A and recomputing act(A) in backward.
    """
    _check("summa_abt", a, b, mesh, 1, 1)
    return _SummaABT.apply(a, b, mesh, activation)


def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """C = Aᵀ·B. a: block of A [M, K] as [M/(d·q), K/q]; b: block of B [M, N] as [M/(d·q), N/q].

    C [K, N] is replicated over depth, as [K/q, N/q].
    forward: q broadcasts of A blocks along rows, q reduces along columns, all-reduce over depth;
    backward: all-reduce of dC over depth, then dA = B·dCᵀ (abt), dB = A·dC (ab).
    """
    _check("summa_atb", a, b, mesh, 0, 0)
    return _SummaATB.apply(a, b, mesh)
