"""What the eager helpers do while dynamo traces: call the ``optimus2d::`` operators, never a transport.

``comm/primitives.py`` (the collectives) and ``comm/agreement.py`` (the checks) call these
functions instead of communicating when ``torch.compiler.is_compiling()``. Each one reaches its
operator through ``torch.ops.optimus2d.<name>.default``, the registry torch keeps: the operators are
defined in ``comm/compiled.py``, whose real implementations are those eager helpers, so this module
imports neither (``comm/__init__.py`` imports ``compiled``, so they exist before any compile). The
mesh travels as its ``uid``, a reduction as its name (``REDUCE_OPS``). The operators are
functional; an in-place helper copies the result into its tensor here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_CONTIGUOUS = torch.contiguous_format


def reduce_op_name(op: dist.ReduceOp) -> str:
    for name, value in REDUCE_OPS.items():
        if op == value:
            return name
    raise ValueError(f"optimus2d: under torch.compile a reduction is SUM, MAX or MIN, not {op}")


def broadcast(t: torch.Tensor, mesh, axis: str, root: int) -> None:
    out = torch.ops.optimus2d.broadcast.default(t, mesh.uid, axis, root)
    if mesh.index(axis) != root:  # the root's tensor stays as it is (it may be a weight)
        t.copy_(out)


def reduce(t: torch.Tensor, mesh, axis: str, root: int) -> None:
    out = torch.ops.optimus2d.reduce.default(t, mesh.uid, axis, root)
    if mesh.index(axis) == root:
        t.copy_(out)


def all_reduce(t: torch.Tensor, mesh, axis: str, op: dist.ReduceOp) -> None:
    t.copy_(torch.ops.optimus2d.all_reduce.default(t, mesh.uid, axis, reduce_op_name(op)))


def summed(t: torch.Tensor, mesh, axes: tuple[str, ...]) -> torch.Tensor:
    out = t.clone(memory_format=_CONTIGUOUS)
    for axis in axes:
        if mesh.axis_size(axis) > 1:
            out = torch.ops.optimus2d.all_reduce.default(out, mesh.uid, axis, "sum")
    return out


def all_gather(t: torch.Tensor, mesh, axis: str, dim: int) -> torch.Tensor:
    return torch.ops.optimus2d.all_gather.default(t, mesh.uid, axis, dim % t.dim())


def reduce_scatter(t: torch.Tensor, mesh, axis: str, dim: int) -> torch.Tensor:
    return torch.ops.optimus2d.reduce_scatter.default(t, mesh.uid, axis, dim % t.dim())


def transpose(t: torch.Tensor, mesh) -> torch.Tensor:
    return torch.ops.optimus2d.transpose.default(t, mesh.uid)


def blocks(t: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """Every member's ``t`` along ``axis``, stacked in member order: ``[n, *t.shape]``."""
    return torch.ops.optimus2d.blocks.default(t, mesh.uid, axis)


def partial_sums(stacked: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """Member m receives the sum of every member's ``stacked[m]`` (``primitives.PartialSums``)."""
    return torch.ops.optimus2d.partial_sums.default(stacked, mesh.uid, axis)


def agree(mesh, what: str, axis: str, description: str, t: torch.Tensor | None, error: BaseException | None) -> None:
    """``agreement.agree`` (with ``t``'s checksum as content when given) as a step of the graph."""
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    torch.ops.optimus2d.agree.default(t, mesh.uid, what, axis, description, text)


def refuse_if(flag: torch.Tensor, error: str) -> None:
    """Raise ``error`` (its text: "ValueError: ..." or "TypeError: ...", a constant of the graph)
    where ``flag`` holds a nonzero entry when the graph runs: a refusal found by a collective (the
    same flag on every rank) without a value read on the host while tracing, so without a graph
    break. Eager code raises its own error from the value instead."""
    torch.ops.optimus2d.refuse_if.default(flag, error)
