"""The mesh's collectives under ``torch.compile``: opaque operators, kept in program order.

Dynamo must never trace into a collective: it would run MPI or gloo on fake tensors (MPI then
reads out of bounds, and the ranks that did not crash wait for it). So while compiling, the
tier-1 helpers of ``comm/primitives.py`` call the operators below instead of communicating:
``torch.library.custom_op``s whose fake implementation gives the result's shape, and whose real
one, run by the compiled graph, is the eager helper itself — the same transport (MPI or
torch.distributed), the same count (``count_comm``), the same watched waits and the same
``check="every"`` agreement. Every operator is registered as an ordered effect: the compiled
graph keeps it even where its result is unused (a root's broadcast, a reduce's senders) and
never reorders two of them, so every rank issues its collectives in the order of the eager code.

The operators are functional (they return a new tensor); an in-place helper copies the result
into its tensor. Under ``torch.compile`` each collective completes before the graph goes on (no
overlap with the next block's product). The mesh travels as its ``uid`` (``Mesh.uid``: the
same on every rank, unique in a process).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.library import custom_op

from optimus2d.comm import watch

_CONTIGUOUS = torch.contiguous_format
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


def _mesh(uid: int):
    mesh = watch._meshes.get(uid)
    if mesh is None:
        raise RuntimeError(f"optimus2d: a compiled graph uses mesh #{uid}, which no longer exists on this rank")
    return mesh


def _ordered(op):
    """``op`` as an ordered side effect: never dropped, never reordered with another one."""
    effect = getattr(torch.library, "EffectType", None)
    if effect is not None and hasattr(op, "register_effect"):
        op.register_effect(effect.ORDERED)
    else:  # older torch
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(op._opoverload, _EffectType.ORDERED)
    return op


def _primitives():
    from optimus2d.comm import primitives

    return primitives


def _empty(t: torch.Tensor, shape=None) -> torch.Tensor:
    return t.new_empty(t.shape if shape is None else shape).contiguous(memory_format=_CONTIGUOUS)


def _resized(t: torch.Tensor, dim: int, times: int = 1, parts: int = 1) -> list:
    """``t``'s shape with dim ``dim`` ``times`` as long, or cut in ``parts`` (symbolic sizes stay so)."""
    shape = list(t.shape)
    shape[dim] = shape[dim] * times // parts
    return shape


# ---- the operators (real implementations: the eager helpers) -------------------------------------
@custom_op("optimus2d::broadcast", mutates_args=())
def _broadcast(t: torch.Tensor, mesh: int, axis: str, root: int) -> torch.Tensor:
    m = _mesh(mesh)
    out = torch.empty_like(t, memory_format=_CONTIGUOUS)
    if m.index(axis) == root:
        out.copy_(t)
    _primitives().broadcast(out, m, axis, root)
    return out


@custom_op("optimus2d::reduce", mutates_args=())
def _reduce(t: torch.Tensor, mesh: int, axis: str, root: int) -> torch.Tensor:
    out = t.clone(memory_format=_CONTIGUOUS)
    _primitives().reduce(out, _mesh(mesh), axis, root)
    return out


@custom_op("optimus2d::all_reduce", mutates_args=())
def _all_reduce(t: torch.Tensor, mesh: int, axis: str, op: str) -> torch.Tensor:
    out = t.clone(memory_format=_CONTIGUOUS)
    _primitives().all_reduce(out, _mesh(mesh), axis, _REDUCE_OPS[op])
    return out


@custom_op("optimus2d::all_gather", mutates_args=())
def _all_gather(t: torch.Tensor, mesh: int, axis: str, dim: int) -> torch.Tensor:
    return _primitives().all_gather(t, _mesh(mesh), axis, dim).contiguous()


@custom_op("optimus2d::reduce_scatter", mutates_args=())
def _reduce_scatter(t: torch.Tensor, mesh: int, axis: str, dim: int) -> torch.Tensor:
    return _primitives().reduce_scatter(t, _mesh(mesh), axis, dim).contiguous()


@custom_op("optimus2d::transpose", mutates_args=())
def _transpose(t: torch.Tensor, mesh: int) -> torch.Tensor:
    out = _primitives().transpose(t, _mesh(mesh))
    return out.clone(memory_format=_CONTIGUOUS) if out is t else out.contiguous()


@custom_op("optimus2d::blocks", mutates_args=())
def _blocks(t: torch.Tensor, mesh: int, axis: str) -> torch.Tensor:
    m = _mesh(mesh)
    blocks = _primitives().Blocks(t, m, axis)
    out = torch.stack([blocks.get(member) for member in range(m.axis_size(axis))])
    blocks.finish()
    return out


@custom_op("optimus2d::partial_sums", mutates_args=())
def _partial_sums(stacked: torch.Tensor, mesh: int, axis: str) -> torch.Tensor:
    m = _mesh(mesh)
    sums = _primitives().PartialSums(m, axis, tuple(stacked.shape[1:]), stacked)
    for member in range(m.axis_size(axis)):
        sums.put(member, stacked[member])
    return sums.result()


@custom_op("optimus2d::agree", mutates_args=())
def _agree(t: torch.Tensor | None, mesh: int, what: str, axis: str, description: str, error: str) -> torch.Tensor:
    from optimus2d.comm import agreement

    kind, _, message = error.partition(": ")
    refusal = _ERRORS.get(kind, ValueError)(message) if error else None
    content = agreement.fingerprint(t) if t is not None and refusal is None else ()
    agreement.agree(_mesh(mesh), what, axis, description=description, content=content, error=refusal)
    return torch.empty(0)  # nothing: a tensor only because inductor handles effectful ops with outputs best


for _op in (_broadcast, _reduce, _all_reduce, _all_gather, _reduce_scatter, _transpose, _blocks, _partial_sums, _agree):
    _ordered(_op)


# ---- their fake implementations: shapes only ------------------------------------------------------
@_broadcast.register_fake
def _(t, mesh, axis, root):
    return _empty(t)


@_reduce.register_fake
def _(t, mesh, axis, root):
    return _empty(t)


@_all_reduce.register_fake
def _(t, mesh, axis, op):
    return _empty(t)


@_all_gather.register_fake
def _(t, mesh, axis, dim):
    return _empty(t, _resized(t, dim, times=_mesh(mesh).axis_size(axis)))


@_reduce_scatter.register_fake
def _(t, mesh, axis, dim):
    return _empty(t, _resized(t, dim, parts=_mesh(mesh).axis_size(axis)))


@_transpose.register_fake
def _(t, mesh):
    return _empty(t)


@_blocks.register_fake
def _(t, mesh, axis):
    return _empty(t, [_mesh(mesh).axis_size(axis), *t.shape])


@_partial_sums.register_fake
def _(stacked, mesh, axis):
    return _empty(stacked, stacked.shape[1:])


@_agree.register_fake
def _(t, mesh, what, axis, description, error):
    return torch.empty(0)


# ---- what the helpers call while compiling -------------------------------------------------------
def reduce_op_name(op: dist.ReduceOp) -> str:
    for name, value in _REDUCE_OPS.items():
        if op == value:
            return name
    raise ValueError(f"optimus2d: under torch.compile a reduction is SUM, MAX or MIN, not {op}")


def broadcast(t: torch.Tensor, mesh, axis: str, root: int) -> None:
    out = _broadcast(t, mesh.uid, axis, root)
    if mesh.index(axis) != root:  # the root's tensor stays as it is (it may be a weight)
        t.copy_(out)


def reduce(t: torch.Tensor, mesh, axis: str, root: int) -> None:
    out = _reduce(t, mesh.uid, axis, root)
    if mesh.index(axis) == root:
        t.copy_(out)


def all_reduce(t: torch.Tensor, mesh, axis: str, op: dist.ReduceOp) -> None:
    t.copy_(_all_reduce(t, mesh.uid, axis, reduce_op_name(op)))


def summed(t: torch.Tensor, mesh, axes: tuple[str, ...]) -> torch.Tensor:
    out = t.clone(memory_format=_CONTIGUOUS)
    for axis in axes:
        if mesh.axis_size(axis) > 1:
            out = _all_reduce(out, mesh.uid, axis, "sum")
    return out


def all_gather(t: torch.Tensor, mesh, axis: str, dim: int) -> torch.Tensor:
    return _all_gather(t, mesh.uid, axis, dim % t.dim())


def reduce_scatter(t: torch.Tensor, mesh, axis: str, dim: int) -> torch.Tensor:
    return _reduce_scatter(t, mesh.uid, axis, dim % t.dim())


def transpose(t: torch.Tensor, mesh) -> torch.Tensor:
    return _transpose(t, mesh.uid)


def blocks(t: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """Every member's ``t`` along ``axis``, stacked in member order: ``[n, *t.shape]``."""
    return _blocks(t, mesh.uid, axis)


def partial_sums(stacked: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """Member m receives the sum of every member's ``stacked[m]`` (``primitives.PartialSums``)."""
    return _partial_sums(stacked, mesh.uid, axis)


def agree(mesh, what: str, axis: str, description: str, t: torch.Tensor | None, error: BaseException | None) -> None:
    """``agreement.agree`` (with ``t``'s checksum as content when given) as a step of the graph."""
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    _agree(t, mesh.uid, what, axis, description, text)
