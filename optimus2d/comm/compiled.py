"""The mesh's collectives under ``torch.compile``: opaque operators, kept in program order.

Dynamo must never trace into a collective: it would run MPI or gloo on fake tensors (MPI then
reads out of bounds, and the ranks that did not crash wait for it). So while compiling, the
tier-1 helpers of ``comm/primitives.py`` and the checks of ``comm/agreement.py`` call the
operators defined here instead of communicating (``comm/traced.py`` calls them through
``torch.ops.optimus2d``): ``torch.library.custom_op``s whose fake implementation gives the
result's shape, and whose real one, run by the compiled graph, is the eager helper itself — the
same transport (MPI or torch.distributed), the same count (``count_comm``), the same watched waits
and the same ``check="every"`` agreement. Every operator is registered as an ordered effect: the
compiled graph keeps it even where its result is unused (a root's broadcast, a reduce's senders)
and never reorders two of them, so every rank issues its collectives in the order of the eager code.

This module sits above the helpers it wraps: it imports ``primitives`` and ``agreement``, which
reach its operators through ``traced`` and never import it; ``comm/__init__.py`` imports it, so
the operators exist before any compile. The operators are functional (they return a new tensor).
Under ``torch.compile`` each collective completes before the graph goes on (no overlap with the
next block's product). The mesh travels as its ``uid`` (``Mesh.uid``: the same on every rank,
unique in a process).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from optimus2d.comm import agreement, primitives, watch
from optimus2d.comm.traced import REDUCE_OPS

_CONTIGUOUS = torch.contiguous_format
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


def _mesh(uid: int):
    mesh = watch.registered(uid)
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


def _backend() -> str | None:
    """The name of the backend dynamo is compiling for ("inductor", "aot_eager", ...), or None where
    it cannot be read (outside dynamo's tracing, or another torch's internals)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        fn = InstructionTranslator.current_tx().output.compiler_fn
    except Exception:  # not tracing, or dynamo's internals moved: nothing to say
        return None
    names = []
    for _ in range(6):  # torch's wrappers (WrapBackendDebug, _TorchCompileWrapper, partials) around it
        if fn is None:
            break
        if str(getattr(fn, "__module__", "")).startswith("torch._inductor"):  # compile_fx given as the backend
            return "inductor"
        name = getattr(fn, "compiler_name", None) or getattr(fn, "_compiler_name", None)
        if isinstance(name, str):
            names.append(name)
        fn = (
            getattr(fn, "_torchdynamo_orig_backend", None)
            or getattr(fn, "compiler_fn", None)
            or getattr(fn, "func", None)
        )
    return "inductor" if "inductor" in names else next(iter(names), None)


def _refuse_inductor() -> None:
    """Inductor was seen to issue one rank's collectives in another order than its peers' despite
    the ordered effects (every rank waited to the timeout): refused while dynamo traces, on every
    rank alike (they compile the same graph), before the graph runs."""
    if _backend() == "inductor":
        raise RuntimeError(
            "optimus2d under torch.compile: the inductor backend (torch.compile's default) is not supported: "
            "it may issue a rank's collectives in another order than its peers' (they wait to the timeout); "
            "compile with backend='aot_eager'"
        )


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
    primitives.broadcast(out, m, axis, root)
    return out


@custom_op("optimus2d::reduce", mutates_args=())
def _reduce(t: torch.Tensor, mesh: int, axis: str, root: int) -> torch.Tensor:
    out = t.clone(memory_format=_CONTIGUOUS)
    primitives.reduce(out, _mesh(mesh), axis, root)
    return out


@custom_op("optimus2d::all_reduce", mutates_args=())
def _all_reduce(t: torch.Tensor, mesh: int, axis: str, op: str) -> torch.Tensor:
    out = t.clone(memory_format=_CONTIGUOUS)
    primitives.all_reduce(out, _mesh(mesh), axis, REDUCE_OPS[op])
    return out


@custom_op("optimus2d::all_gather", mutates_args=())
def _all_gather(t: torch.Tensor, mesh: int, axis: str, dim: int) -> torch.Tensor:
    return primitives.all_gather(t, _mesh(mesh), axis, dim).contiguous()


@custom_op("optimus2d::reduce_scatter", mutates_args=())
def _reduce_scatter(t: torch.Tensor, mesh: int, axis: str, dim: int) -> torch.Tensor:
    return primitives.reduce_scatter(t, _mesh(mesh), axis, dim).contiguous()


@custom_op("optimus2d::transpose", mutates_args=())
def _transpose(t: torch.Tensor, mesh: int) -> torch.Tensor:
    out = primitives.transpose(t, _mesh(mesh))
    return out.clone(memory_format=_CONTIGUOUS) if out is t else out.contiguous()


@custom_op("optimus2d::blocks", mutates_args=())
def _blocks(t: torch.Tensor, mesh: int, axis: str) -> torch.Tensor:
    m = _mesh(mesh)
    blocks = primitives.Blocks(t, m, axis)
    out = torch.stack([blocks.get(member) for member in range(m.axis_size(axis))])
    blocks.finish()
    return out


@custom_op("optimus2d::partial_sums", mutates_args=())
def _partial_sums(stacked: torch.Tensor, mesh: int, axis: str) -> torch.Tensor:
    m = _mesh(mesh)
    sums = primitives.PartialSums(m, axis, tuple(stacked.shape[1:]), stacked)
    for member in range(m.axis_size(axis)):
        sums.put(member, stacked[member])
    return sums.result()


@custom_op("optimus2d::agree", mutates_args=())
def _agree(t: torch.Tensor | None, mesh: int, what: str, axis: str, description: str, error: str) -> torch.Tensor:
    kind, _, message = error.partition(": ")
    refusal = _ERRORS.get(kind, ValueError)(message) if error else None
    content = agreement.fingerprint(t) if t is not None and refusal is None else ()
    agreement.agree(_mesh(mesh), what, axis, description=description, content=content, error=refusal)
    return torch.empty(0)  # nothing: a tensor only because inductor handles effectful ops with outputs best


@custom_op("optimus2d::refuse_if", mutates_args=())
def _refuse_if(flag: torch.Tensor, error: str) -> torch.Tensor:
    if bool(flag.any()):  # a value of this rank, the same on every rank (the caller reduced it)
        kind, _, message = error.partition(": ")
        raise _ERRORS.get(kind, ValueError)(message)
    return torch.empty(0)


_OPERATORS = (_broadcast, _reduce, _all_reduce, _all_gather, _reduce_scatter, _transpose, _blocks, _partial_sums)
for _op in (*_OPERATORS, _agree, _refuse_if):
    _ordered(_op)


# ---- their fake implementations: shapes only ------------------------------------------------------
@_broadcast.register_fake
def _(t, mesh, axis, root):
    _refuse_inductor()
    return _empty(t)


@_reduce.register_fake
def _(t, mesh, axis, root):
    _refuse_inductor()
    return _empty(t)


@_all_reduce.register_fake
def _(t, mesh, axis, op):
    _refuse_inductor()
    return _empty(t)


@_all_gather.register_fake
def _(t, mesh, axis, dim):
    _refuse_inductor()
    return _empty(t, _resized(t, dim, times=_mesh(mesh).axis_size(axis)))


@_reduce_scatter.register_fake
def _(t, mesh, axis, dim):
    _refuse_inductor()
    return _empty(t, _resized(t, dim, parts=_mesh(mesh).axis_size(axis)))


@_transpose.register_fake
def _(t, mesh):
    _refuse_inductor()
    return _empty(t)


@_blocks.register_fake
def _(t, mesh, axis):
    _refuse_inductor()
    return _empty(t, [_mesh(mesh).axis_size(axis), *t.shape])


@_partial_sums.register_fake
def _(stacked, mesh, axis):
    _refuse_inductor()
    return _empty(stacked, stacked.shape[1:])


@_agree.register_fake
def _(t, mesh, what, axis, description, error):
    _refuse_inductor()
    return torch.empty(0)


@_refuse_if.register_fake
def _(flag, error):
    _refuse_inductor()
    return torch.empty(0)
