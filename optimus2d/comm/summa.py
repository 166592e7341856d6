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
matmul of step t, so communication overlaps computation. A backward computes both gradients in
one pass of q steps (``_grads_of_*``): their broadcasts travel together, one sync stage a step,
and a block both products need (dC for A·Bᵀ and Aᵀ·B) is broadcast once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd import Function

from optimus2d.comm import primitives as P
from optimus2d.comm.first_order import first_order
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.recompute import Activation, Recomputed, activated, kept_for_backward

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


class _ProductSum:
    """Σ_t lhs_t · rhs_t over SUMMA's steps, summed in place (in fp32 for 16-bit operands). The first
    product starts the sum: no zero-filled buffer (1.5 ms a step of the issue's MLP, torch.profiler)."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def add(self, lhs: torch.Tensor, rhs: torch.Tensor) -> None:
        if self.total is None:
            product = lhs @ rhs
            self.total = product.float() if product.dtype in _LOW_PRECISION else product
        elif self.total.dtype == lhs.dtype:
            self.total.addmm_(lhs, rhs)
        else:  # low precision: fp32 sum across steps
            self.total.add_(lhs @ rhs)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return self.total.to(dtype)


def _ab(a: torch.Tensor, b: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """C_ij = Σ_t A_it · B_tj; a [m, k/q], b [k/q, n/q] → c [m, n/q]."""
    if mesh.q == 1:  # one step: no accumulator to fill
        return a @ b
    c = _ProductSum()
    for a_t, b_t in _pipelined_broadcasts(mesh, [(a, "row"), (b, "col")]):
        c.add(a_t, b_t)
    return c.result(a.dtype)


def _reduce_partials(mesh: Mesh, partials: Iterator[tuple[torch.Tensor, ...]], axes: tuple[str, ...]) -> list:
    """Step t yields one partial per axis; each is reduced to member t of its axis (all in flight
    together). Returns this rank's reduced block of each axis."""
    mine, in_flight = [None] * len(axes), []
    for step, parts in enumerate(partials):
        for n, (partial, axis) in enumerate(zip(parts, axes, strict=True)):
            in_flight.append(P.reduce(partial, mesh, axis, step, async_op=True))
            if mesh.index(axis) == step:
                mine[n] = partial
        while len(in_flight) > 2 * len(axes):
            in_flight.pop(0).wait()
    for h in in_flight:
        h.wait()
    return mine


def _abt(a: torch.Tensor, b: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """C_it = Σ_j A_ij · B_tjᵀ; a [m, k/q], b [n/q, k/q] → c [m, n/q]."""
    blocks = _pipelined_broadcasts(mesh, [(b, "col")])
    return _reduce_partials(mesh, ((a @ b_t.t(),) for (b_t,) in blocks), ("row",))[0]


def _weight_grad_product(a_t: torch.Tensor, grad_c: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A_tᵀ·dC, made as (dCᵀ·A_t)ᵀ's contiguous factor when ``transposed``: contiguous in the weight's
    own layout, so accumulating it into ``weight.grad`` is a plain add, not a strided copy (2.4 ms
    a step for the issue's MLP, measured with torch.profiler). Every rank of a mesh holds its
    weight alike, so every rank makes the same choice and the reduced partials agree."""
    return grad_c.t() @ a_t if transposed else a_t.t() @ grad_c


def _atb(a: torch.Tensor, b: torch.Tensor, mesh: Mesh, transposed: bool = False) -> torch.Tensor:
    """C_tj = Σ_i A_itᵀ · B_ij, summed over depth; a [m, k/q], b [m, n/q] → c [k/q, n/q].

    ``transposed``: c is returned as the transpose of a contiguous [n/q, k/q] (see
    ``_weight_grad_product``)."""
    blocks = _pipelined_broadcasts(mesh, [(a, "row")])
    (c,) = _reduce_partials(mesh, ((_weight_grad_product(a_t, b, transposed),) for (a_t,) in blocks), ("col",))
    P.all_reduce(c, mesh, "depth")
    return c.t() if transposed else c


def _grads_of_ab(grad_c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mesh: Mesh, need_a: bool, need_b: bool):
    """dA = dC·Bᵀ (abt) and dB = Aᵀ·dC (atb) of C = A·B, both in one pass of q steps.

    Step t broadcasts B_tj along the column and A_it along the row together (one sync stage a
    step, not two); dC_ij·B_tjᵀ is reduced to row member t and A_itᵀ·dC_ij to column member t.
    """
    transposed = P.is_transposed_view(b)  # dB in B's own layout
    if not (need_a and need_b):
        return _abt(grad_c, b, mesh) if need_a else None, _atb(a, grad_c, mesh, transposed) if need_b else None
    if mesh.q == 1:
        grad_a, grad_b = grad_c @ b.t(), _weight_grad_product(a, grad_c, transposed)
    else:
        blocks = _pipelined_broadcasts(mesh, [(b, "col"), (a, "row")])
        partials = ((grad_c @ b_t.t(), _weight_grad_product(a_t, grad_c, transposed)) for b_t, a_t in blocks)
        grad_a, grad_b = _reduce_partials(mesh, partials, ("row", "col"))
    P.all_reduce(grad_b, mesh, "depth")
    return grad_a, grad_b.t() if transposed else grad_b


def _grads_of_abt(grad_c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mesh: Mesh, need_a: bool, need_b: bool):
    """dA = dC·B (ab) and dB = dCᵀ·A (atb) of C = A·Bᵀ: each dC block is broadcast once for both.

    Step t broadcasts dC_it along the row and B_tj along the column; dA += dC_it·B_tj, and
    dC_itᵀ·A_ij is reduced to column member t. Saves q broadcasts of dC and q sync stages.
    """
    transposed = P.is_transposed_view(b)  # dB in B's own layout (TransposedLinear2D's weight.t())
    if not (need_a and need_b):
        return _ab(grad_c, b, mesh) if need_a else None, _atb(grad_c, a, mesh, transposed) if need_b else None
    if mesh.q == 1:
        grad_a, grad_b = grad_c @ b, _weight_grad_product(grad_c, a, transposed)
    else:
        sum_a = _ProductSum()

        def partials():
            for c_t, b_t in _pipelined_broadcasts(mesh, [(grad_c, "row"), (b, "col")]):
                sum_a.add(c_t, b_t)
                yield (_weight_grad_product(c_t, a, transposed),)

        (grad_b,) = _reduce_partials(mesh, partials(), ("col",))
        grad_a = sum_a.result(grad_c.dtype)
    P.all_reduce(grad_b, mesh, "depth")
    return grad_a, grad_b.t() if transposed else grad_b


def _grads_of_atb(grad_c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mesh: Mesh, need_a: bool, need_b: bool):
    """dA = B·dCᵀ (abt) and dB = A·dC (ab) of C = Aᵀ·B: each dC block is broadcast once for both.

    Step t broadcasts dC_tj along the column and A_it along the row; dB += A_it·dC_tj, and
    B_ij·dC_tjᵀ is reduced to row member t.
    """
    if not (need_a and need_b):
        return _abt(b, grad_c, mesh) if need_a else None, _ab(a, grad_c, mesh) if need_b else None
    if mesh.q == 1:
        return b @ grad_c.t(), a @ grad_c
    sum_b = _ProductSum()

    def partials():
        for c_t, a_t in _pipelined_broadcasts(mesh, [(grad_c, "col"), (a, "row")]):
            sum_b.add(a_t, c_t)
            yield (b @ c_t.t(),)

    (grad_a,) = _reduce_partials(mesh, partials(), ("row",))
    return grad_a, sum_b.result(a.dtype)


def _sum_over_depth(grad: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    return P.summed_copy(grad, mesh, ("depth",))


class _SummaAB(Function):
    @staticmethod
    def forward(ctx, a, b, mesh, activation):
        ctx.mesh, ctx.activation = mesh, activation
        ctx.save_for_backward(kept_for_backward(ctx, a, activation), b)  # a before the activation (comm/recompute.py)
        return _ab(activated(a, activation), b, mesh)

    @staticmethod
    @first_order
    def backward(ctx, grad_c):
        pre, b = ctx.saved_tensors
        a = Recomputed(pre, ctx.activation)
        need_a, need_b = ctx.needs_input_grad[:2]
        grad_a, grad_b = _grads_of_ab(grad_c.contiguous(), a.value if need_b else None, b, ctx.mesh, need_a, need_b)
        return a.grad(grad_a) if need_a else None, grad_b, None, None


class _SummaABT(Function):
    @staticmethod
    def forward(ctx, a, b, mesh, activation):
        ctx.mesh, ctx.activation = mesh, activation
        ctx.save_for_backward(kept_for_backward(ctx, a, activation), b)  # a before the activation (comm/recompute.py)
        return _abt(activated(a, activation), b, mesh)

    @staticmethod
    @first_order
    def backward(ctx, grad_c):
        pre, b = ctx.saved_tensors
        a = Recomputed(pre, ctx.activation)
        need_a, need_b = ctx.needs_input_grad[:2]
        grad_a, grad_b = _grads_of_abt(grad_c.contiguous(), a.value if need_b else None, b, ctx.mesh, need_a, need_b)
        return a.grad(grad_a) if need_a else None, grad_b, None, None


class _SummaATB(Function):
    @staticmethod
    def forward(ctx, a, b, mesh):
        ctx.mesh = mesh
        ctx.save_for_backward(a, b)
        return _atb(a, b, mesh)

    @staticmethod
    @first_order
    def backward(ctx, grad_c):
        a, b = ctx.saved_tensors
        grad_c = _sum_over_depth(grad_c, ctx.mesh)  # C is replicated over depth
        grad_a, grad_b = _grads_of_atb(grad_c, a, b, ctx.mesh, *ctx.needs_input_grad[:2])
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
    backward: q steps, each broadcasting a B block along the column and an A block along the row,
    reducing dA = dC·Bᵀ partials along rows and dB = Aᵀ·dC partials along columns (dB then
    all-reduced over depth).
    ``activation``: C = act(A)·B, keeping A and recomputing act(A) in backward (comm/recompute.py).
    """
    _check("summa_ab", a, b, mesh, 1, 0)
    return _SummaAB.apply(a, b, mesh, activation)


def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh: Mesh, *, activation: Activation = None) -> torch.Tensor:
    """C = A·Bᵀ. a: block of A [M, K] as [M/(d·q), K/q]; b: block of B [N, K] as [N/q, K/q].

    forward: q broadcasts of B blocks along columns, q reduces of C partials along rows;
    backward: q steps, each broadcasting a dC block along the row (once for both gradients) and a
    B block along the column, reducing dB = dCᵀ·A partials along columns (then over depth).
    ``activation``: C = act(A)·Bᵀ, keeping A and recomputing act(A) in backward.
    """
    _check("summa_abt", a, b, mesh, 1, 1)
    return _SummaABT.apply(a, b, mesh, activation)


def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """C = Aᵀ·B. a: block of A [M, K] as [M/(d·q), K/q]; b: block of B [M, N] as [M/(d·q), N/q].

    C [K, N] is replicated over depth, as [K/q, N/q].
    forward: q broadcasts of A blocks along rows, q reduces along columns, all-reduce over depth;
    backward: all-reduce of dC over depth, then q steps, each broadcasting a dC block along the
    column (once for both gradients) and an A block along the row, reducing dA = B·dCᵀ partials
    along rows.
    """
    _check("summa_atb", a, b, mesh, 0, 0)
    return _SummaATB.apply(a, b, mesh)
