"""Tier 1: plain collectives along a mesh axis. No autograd; every call is counted.

A group of one rank sends nothing: the helpers return at once (async ones return a finished
handle), so a 1-rank mesh is plain torch. Roots are given as an index within the axis group and
turned into a global rank by the mesh (``Mesh.global_rank``); gathers and scatters run in member
order whatever order torch gave the group's ranks (``Mesh.group_order``, ``comm/compat.py``). On a
mesh whose transport is MPI (``comm/mpi.py``) the same calls go through its communicators; a
reduction MPI cannot make (bf16, fp16, an op other than SUM and MAX) and a tensor not in CPU
memory go through torch, the same choice on every rank.

Every wait on CPU is watched (``comm/watch.py``): bounded by the mesh's timeout, and ended at once
by a peer's reported failure. On a mesh built with ``check="every"`` each collective first checks
that the group's members agree on it (``comm/agreement.py``).

Under ``torch.compile`` each helper calls its operator instead (``comm/traced.py``, through
``torch.ops.optimus2d``): the operators, defined in ``comm/compiled.py`` above this module, run
these same helpers in the compiled graph, synchronously, in the order the eager code calls them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from optimus2d.comm import agreement, compat, traced, watch
from optimus2d.comm.counter import record
from optimus2d.comm.mesh import Mesh


def is_transposed_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is the transpose of a contiguous matrix (``weight.t()``): a gradient for it is
    best made in the stored layout, so autograd accumulates it without a strided copy."""
    return t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()


class Done:
    """The handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True


def _mpi_reduces(mesh: Mesh, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> bool:
    return mesh.mpi is not None and mesh.mpi.reducible(t, op)


def _compiling() -> bool:
    """While dynamo traces: call the operators (``comm/traced.py``), never a transport."""
    return torch.compiler.is_compiling()


def _finished(handle, async_op: bool):
    """``handle`` for an async call; otherwise wait here (an MPI request) and return None."""
    if async_op:
        return handle
    handle.wait()
    return None


def _watched(work, mesh: Mesh, what: str, async_op: bool = False, pollable: bool = True):
    """A torch.distributed work, waited on with ``comm/watch.py`` on CPU (NCCL's waits do not block)."""
    if mesh.backend != "nccl":
        work = watch.Watched(work, mesh, what, mesh.timeout, pollable=pollable)
    return _finished(work, async_op)


def _check(mesh: Mesh, kind: str, axis: str, t: torch.Tensor, extra: str = "") -> None:
    """On a ``check="every"`` mesh: the members of ``axis`` agree on this collective before it runs."""
    if mesh.check == "every":
        agreement.agree(mesh, kind, axis, description=f"{agreement.describe(t)}{extra}")


def broadcast(t: torch.Tensor, mesh: Mesh, axis: str, root: int, async_op: bool = False):
    """In place: ``t`` takes the value of member ``root`` of this rank's ``axis`` group."""
    group = mesh.group(axis)
    if group is None:
        return Done() if async_op else None
    if _compiling():
        traced.broadcast(t, mesh, axis, root)
        return Done() if async_op else None
    _check(mesh, "broadcast", axis, t, f" from member {root}")
    record("broadcast", axis, t)
    if mesh.mpi is not None and mesh.mpi.carries(t):
        return _finished(mesh.mpi.broadcast(t, axis, root), async_op)
    work = dist.broadcast(t, src=mesh.global_rank(axis, root), group=group, async_op=True)
    return _watched(work, mesh, f"broadcast over {axis}", async_op)


def reduce(t: torch.Tensor, mesh: Mesh, axis: str, root: int, async_op: bool = False):
    """In place: member ``root`` of the ``axis`` group receives the sum of everyone's ``t``."""
    group = mesh.group(axis)
    if group is None:
        return Done() if async_op else None
    if _compiling():
        traced.reduce(t, mesh, axis, root)
        return Done() if async_op else None
    _check(mesh, "reduce", axis, t, f" to member {root}")
    record("reduce", axis, t)
    if _mpi_reduces(mesh, t):
        return _finished(mesh.mpi.reduce(t, axis, root, dist.ReduceOp.SUM), async_op)
    work = dist.reduce(t, dst=mesh.global_rank(axis, root), group=group, async_op=True)
    return _watched(work, mesh, f"reduce over {axis}", async_op)


def all_reduce(t: torch.Tensor, mesh: Mesh, axis: str, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False):
    """In place: ``t`` becomes the reduction (sum by default) over the ``axis`` group."""
    group = mesh.group(axis)
    if group is None:
        return Done() if async_op else None
    if _compiling():
        traced.all_reduce(t, mesh, axis, op)
        return Done() if async_op else None
    _check(mesh, "all_reduce", axis, t, f" {op}")
    record("all_reduce", axis, t)
    if _mpi_reduces(mesh, t, op):
        return _finished(mesh.mpi.all_reduce(t, axis, op), async_op)
    work = dist.all_reduce(t, op=op, group=group, async_op=True)
    return _watched(work, mesh, f"all-reduce over {axis}", async_op)


def all_reduce_max(t: torch.Tensor, mesh: Mesh, axis: str) -> None:
    """In place: ``t`` becomes the element-wise maximum over the ``axis`` group."""
    all_reduce(t, mesh, axis, op=dist.ReduceOp.MAX)


def all_reduce_group(
    t: torch.Tensor, mesh: Mesh, group: dist.ProcessGroup | None, name: str, op=dist.ReduceOp.SUM
) -> None:
    """In place: ``t`` becomes the sum (or ``op``) over ``group``, a torch process group across meshes (a
    pipeline's lanes, ``pipeline/stages.py``) rather than one of ``mesh``'s axes; None (one rank) sends
    nothing. Carried by torch.distributed, waited on like ``mesh``'s collectives, counted under ``name``."""
    if group is None:
        return
    record("all_reduce", name, t)
    _watched(dist.all_reduce(t, op=op, group=group, async_op=True), mesh, f"all-reduce over {name}")


def broadcast_group(t: torch.Tensor, mesh: Mesh, group: dist.ProcessGroup | None, name: str) -> None:
    """In place: ``t`` becomes that of the first rank of ``group`` (its group rank 0), a torch process
    group across meshes like ``all_reduce_group``'s; None (one rank) sends nothing."""
    if group is None:
        return
    record("broadcast", name, t)
    _watched(dist.broadcast(t, group_src=0, group=group, async_op=True), mesh, f"broadcast over {name}")


def summed_copy(t: torch.Tensor, mesh: Mesh, axes: tuple[str, ...]) -> torch.Tensor:
    """A contiguous copy of ``t`` summed over each of ``axes`` (``t`` itself is left alone: autograd
    may hand one gradient tensor to two branches)."""
    if _compiling():
        return traced.summed(t, mesh, axes)
    out = t.clone(memory_format=torch.contiguous_format)
    for axis in axes:
        all_reduce(out, mesh, axis)
    return out


def all_gather(t: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    """Concatenation along ``dim`` of every member's ``t``, in group order (same shape everywhere)."""
    group = mesh.group(axis)
    if group is None:
        return t
    if _compiling():
        return traced.all_gather(t, mesh, axis, dim)
    n = mesh.axis_size(axis)
    t = t.movedim(dim, 0).contiguous()
    out = t.new_empty((n * t.shape[0], *t.shape[1:]))
    _check(mesh, "all_gather", axis, t, f" along dim {dim}")
    record("all_gather", axis, out)
    if _direct(mesh):
        chunks = out.chunk(n)
        chunks[mesh.index(axis)].copy_(t)
        _exchange(mesh, axis, [t] * n, chunks)
    else:
        out = _gather_single(t, mesh, axis)
    return out.movedim(0, dim)


def reduce_scatter(t: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    """Sum over the ``axis`` group, keeping this rank's chunk along ``dim``."""
    group = mesh.group(axis)
    if group is None:
        return t
    if _compiling():
        return traced.reduce_scatter(t, mesh, axis, dim)
    n, me = mesh.axis_size(axis), mesh.index(axis)
    t = t.movedim(dim, 0).contiguous()
    _check(mesh, "reduce_scatter", axis, t, f" along dim {dim}")
    record("reduce_scatter", axis, t)
    if _direct(mesh):
        received = [t.new_empty((t.shape[0] // n, *t.shape[1:])) for _ in range(n)]
        _exchange(mesh, axis, t.chunk(n), received)
        out = t.chunk(n)[me].clone()
        for member in range(n):  # in member order, the same on every rank
            if member != me:
                out += received[member]
    else:
        out = _scatter_single(t, mesh, axis)
    return out.movedim(0, dim)


@torch.compiler.disable  # point-to-point exchanges: run eagerly under torch.compile (a graph break)
def all_to_all(t: torch.Tensor, mesh: Mesh, axis: str, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Chunk m of ``t`` along ``split_dim`` to member m of the ``axis`` group; what every member m
    sends this rank, concatenated along ``cat_dim`` in member order. Counted as the input ``t``."""
    if mesh.group(axis) is None:
        return t
    n, me = mesh.axis_size(axis), mesh.index(axis)
    _check(mesh, "all_to_all", axis, t, f" from dim {split_dim} to dim {cat_dim}")
    send = [chunk.contiguous() for chunk in t.chunk(n, split_dim)]
    received = [torch.empty_like(send[me]) for _ in range(n)]
    received[me] = send[me]
    record("all_to_all", axis, t)
    _exchange(mesh, axis, send, received)
    return torch.cat(received, cat_dim)


def transpose(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The ``t`` of rank (k, j, i), received in exchange for this rank's (k, i, j); same shape everywhere.

    Ranks on the diagonal (i = j) keep their own and send nothing.
    """
    k, i, j = mesh.k, mesh.i, mesh.j
    if _compiling() and (i != j or mesh.check == "every"):
        return traced.transpose(t, mesh)
    _check(mesh, "transpose", "mesh", t)
    if i == j:
        return t
    t = t.contiguous()
    out = torch.empty_like(t)
    record("transpose", "mesh", t)
    partner = (k * mesh.q + j) * mesh.q + i
    for handle in (isend(t, mesh, "mesh", partner), irecv(out, mesh, "mesh", partner)):
        handle.wait()
    return out


_BLOCKS_TAG, _PARTIALS_TAG = 1, 2


class Blocks:
    """Every member's ``t`` along ``axis``, received in the background: ``get(m)`` waits for member m's.

    ``order`` lists the members own first, then in the order their blocks are due, so a caller that
    computes on ``get(m)`` for m in ``order`` overlaps each receive with the previous block's
    computation. Counted as an all-gather. Call ``finish()`` when done (it waits for the sends).
    """

    def __init__(self, t: torch.Tensor, mesh: Mesh, axis: str) -> None:
        self.group, n = mesh.group(axis), mesh.axis_size(axis)
        self.me = mesh.index(axis) if self.group is not None else 0
        self.order = [(self.me + s) % n for s in range(n)]
        self.blocks: dict[int, torch.Tensor] = {self.me: t}
        self._handles: dict[int, object] = {}
        self._sends: list = []
        if self.group is None:
            return
        if _compiling():  # one operator: every block at once
            self.blocks = dict(enumerate(traced.blocks(t, mesh, axis).unbind(0)))
            return
        t = t.contiguous()
        _check(mesh, "all_gather (blocks)", axis, t)
        record("all_gather", axis, t, times=n)
        if not _direct(mesh):  # NCCL: one all-gather; the blocks are its chunks
            self.blocks = dict(enumerate(_gather_single(t, mesh, axis).chunk(n)))
            return
        for member in self.order[1:]:
            self._sends.append(isend(t, mesh, axis, member, _BLOCKS_TAG))
            self.blocks[member] = torch.empty_like(t)
            self._handles[member] = irecv(self.blocks[member], mesh, axis, member, _BLOCKS_TAG)

    def get(self, member: int) -> torch.Tensor:
        handle = self._handles.pop(member, None)
        if handle is not None:
            handle.wait()
        return self.blocks[member]

    def finish(self) -> None:
        for member in list(self._handles):
            self.get(member)
        for handle in self._sends:
            handle.wait()
        self._sends = []


class PartialSums:
    """Member m of ``axis`` receives the sum of everyone's partial m; partials leave as they are made.

    ``put(m, partial)`` for every member m (any order), then ``result()`` is this rank's sum, added
    in member order. Counted as a reduce-scatter.
    """

    def __init__(self, mesh: Mesh, axis: str, shape: tuple[int, ...], like: torch.Tensor) -> None:
        self.mesh, self.axis, self.group = mesh, axis, mesh.group(axis)
        n = mesh.axis_size(axis)
        self.me = mesh.index(axis) if self.group is not None else 0
        self.partials: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self._traced = self.group is not None and _compiling()  # result(): one operator on every partial
        if self.group is None or self._traced:
            return
        _check(mesh, "reduce_scatter (partial sums)", axis, like.new_empty(shape, device="meta"))
        record("reduce_scatter", axis, like.new_empty(shape, device="meta"), times=n)
        if not _direct(mesh):
            return
        for member in range(n):
            if member != self.me:
                self.partials[member] = like.new_empty(shape)
                self._handles.append(irecv(self.partials[member], mesh, axis, member, _PARTIALS_TAG))

    def put(self, member: int, partial: torch.Tensor) -> None:
        if self._traced:
            self.partials[member] = partial
            return
        if member == self.me or not _direct(self.mesh):
            self.partials[member if member != self.me else -1] = partial
            return
        self._handles.append(isend(partial, self.mesh, self.axis, member, _PARTIALS_TAG))

    def result(self) -> torch.Tensor:
        if self._traced:
            stacked = torch.stack([self.partials[m] for m in range(self.mesh.axis_size(self.axis))])
            return traced.partial_sums(stacked, self.mesh, self.axis)
        own = self.partials.pop(-1)
        if self.group is None:
            return own
        if not _direct(self.mesh):  # NCCL: one reduce-scatter of the partials in member order
            self.partials[self.me] = own
            stacked = torch.cat([self.partials[m] for m in range(self.mesh.axis_size(self.axis))])
            return _scatter_single(stacked, self.mesh, self.axis).view_as(own)
        for handle in self._handles:
            handle.wait()
        for member in sorted(self.partials):
            own = own + self.partials[member]
        return own


def _gather_single(t: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
    """Every member's ``t`` (contiguous), concatenated along dim 0 in member order: one all-gather."""
    out = t.new_empty((mesh.axis_size(axis) * t.shape[0], *t.shape[1:]))
    work = compat.all_gather_single(out, t, group=mesh.group(axis), async_op=True)
    _watched(work, mesh, f"all-gather over {axis}")
    order = mesh.group_order(axis)  # chunk g is group rank g's: member order[g]
    if order is None:
        return out
    chunks = out.chunk(len(order))
    return torch.cat([chunks[order.index(m)] for m in range(len(order))])


def _scatter_single(t: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
    """The sum over the members of chunk ``mesh.index(axis)`` (along dim 0; chunks in member order)
    of everyone's ``t`` (contiguous): one reduce-scatter."""
    n, order = mesh.axis_size(axis), mesh.group_order(axis)
    if order is not None:  # the collective splits in group rank order
        chunks = t.chunk(n)
        t = torch.cat([chunks[m] for m in order])
    out = t.new_empty((t.shape[0] // n, *t.shape[1:]))
    work = compat.reduce_scatter_single(out, t, group=mesh.group(axis), async_op=True)
    _watched(work, mesh, f"reduce-scatter over {axis}", pollable=False)  # gloo's, in torch 2.11, completes in wait()
    return out


def _direct(mesh: Mesh) -> bool:
    """Gloo's all-gather and reduce-scatter (``compat.all_gather_single``, ...) are slower than
    direct sends on CPU (2 ranks, 4M B chunks: 7.4 ms and 41 ms against 3.3 ms for one exchange);
    NCCL's are not."""
    return mesh.backend == "gloo"


def _exchange(mesh: Mesh, axis: str, send: list[torch.Tensor], recv: list[torch.Tensor]) -> None:
    """Send ``send[m]`` to and receive ``recv[m]`` from every other member m of ``axis``, all at once."""
    me, handles = mesh.index(axis), []
    for member in range(mesh.axis_size(axis)):
        if member != me:
            handles += [isend(send[member], mesh, axis, member), irecv(recv[member], mesh, axis, member)]
    for handle in handles:
        handle.wait()


def isend(t: torch.Tensor, mesh: Mesh, axis: str, member: int, tag: int = 0):
    """Send ``t`` to member ``member`` of this rank's ``axis`` group (over MPI on an MPI mesh)."""
    if mesh.mpi is not None and mesh.mpi.carries(t):
        return mesh.mpi.isend(t, axis, member, tag)
    work = dist.isend(t.contiguous(), mesh.global_rank(axis, member), group=mesh.group(axis), tag=tag)
    return _watched(work, mesh, f"send over {axis}", async_op=True, pollable=False)


def irecv(t: torch.Tensor, mesh: Mesh, axis: str, member: int, tag: int = 0):
    """Receive into ``t`` (contiguous) from member ``member`` of this rank's ``axis`` group."""
    if mesh.mpi is not None and mesh.mpi.carries(t):
        return mesh.mpi.irecv(t, axis, member, tag)
    work = dist.irecv(t, mesh.global_rank(axis, member), group=mesh.group(axis), tag=tag)
    return _watched(work, mesh, f"receive over {axis}", async_op=True, pollable=False)


def split(t: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    """This rank's chunk of ``t`` along ``dim`` (no communication; dim must divide evenly)."""
    n = mesh.axis_size(axis)
    if n == 1:
        return t
    size = t.shape[dim] // n
    return t.narrow(dim, mesh.index(axis) * size, size)
