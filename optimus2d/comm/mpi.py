"""The MPI transport: the mesh's CPU collectives over mpi4py (MPI's shared memory) instead of gloo.

Under ``mpiexec`` on CPU, a ``Mesh`` may send its tensors through MPI communicators, one per
axis, split from ``MPI.COMM_WORLD`` in the mesh's own member order (torch.distributed still
carries everything else: barriers, checkpoints, other libraries). ``python -m benchmarks
transport`` (every rank busy between sync points; ``benchmarks/RESULTS.md``): a sync point over
MPI costs 1.8–14× less than over gloo with a core per rank, 1.6–4.5× less with 4 ranks on 2
cores. In whole steps (4 and 8 ranks on 2 cores) a transformer block runs 6–22 % faster over MPI,
whose small all-reduces (norm statistics, bias gradients) gain most; a 2×2 MLP, whose large
messages gloo's threads move during the matmuls (MPICH moves a message only inside MPI calls, our
waits), runs between 1 % faster and 12 % slower over five runs. ``Mesh``'s "auto" takes MPI wherever it can run.

* Waits poll ``Testall`` with a 50 µs sleep (``comm/watch.py``): a blocking MPI wait spins a whole
  core that a rank sharing it needs. On shared cores a point-to-point wait sleeps longer as it
  grows; a collective's does not (its schedule advances only inside MPI calls: 1–4 MiB all-reduces
  on 4 ranks on 2 cores took 1.5–1.7× as long when they did). A wait longer than the collective
  timeout, or one a peer's reported failure ends, cancels what it can and raises (``TimeoutError``,
  ``PeerFailedError``), so a lost peer is an error, not a hang. The error is fatal to the mesh: a
  message that arrives late would match a later operation's receive, so do not go on using it. An
  MPI error (a message longer than its receive buffer: ranks that disagree on a shape) is raised as
  a ``RuntimeError`` naming the operation and the mesh, and reported to the peers.
* Broadcasts and point-to-point messages move bytes, any dtype; reductions need an MPI datatype
  (fp32, fp64, int32, int64) and SUM or MAX — the tier-1 helpers send the others (bf16, fp16,
  other ops) and anything not in CPU memory over torch, a choice every rank makes alike.
* Non-contiguous tensors travel through a contiguous copy, copied back when the wait ends.
* In groups of at most ``DIRECT_MEMBERS`` (q ≤ 3) a broadcast or a reduce is sent message by
  message, root to each member or each member to the root: the same messages MPI's trees send
  for so few members, but a message a receiver can take alone, where ``Ibcast``/``Ireduce``
  schedules advance only while every member is inside MPI. SUMMA on the issue's 2×2 MLP, same-run
  A/B: 0.95× the step at batch 8 × 128, 0.75× at batch 2 × 128 (``benchmarks/RESULTS.md``).
* Under ``torch.compile`` the helpers of ``comm/primitives.py`` call the operators of
  ``comm/compiled.py``, whose compiled graph runs this transport on real tensors. Dynamo never
  traces it (it would hand MPI fake tensors): every operation here is ``torch.compiler.disable``d,
  so any other caller gets a graph break, and the operation runs eagerly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from optimus2d.comm import shared_groups, watch

DIRECT_MEMBERS = 3  # broadcasts and reduces in groups up to this size are sent message by message
_BROADCAST_TAG, _REDUCE_TAG = 101, 102  # apart from the point-to-point tags of comm/primitives.py
_ABANDONED: list = []  # timed-out operations: MPI may still write into their buffers


def _mpi():
    from mpi4py import MPI

    return MPI


def available(world_size: int, rank: int) -> bool:
    """Whether this process runs under an initialised MPI whose COMM_WORLD is torch's world, rank for rank."""
    import sys

    if "mpi4py.MPI" not in sys.modules:  # launched without MPI: do not start it now
        return False
    mpi = _mpi()
    world = mpi.COMM_WORLD
    return bool(mpi.Is_initialized() and world.Get_size() == world_size and world.Get_rank() == rank)


class Request:
    """An MPI operation in flight; ``wait()`` polls it to the end (``comm/watch.py``: it raises
    ``TimeoutError`` after ``timeout`` s, or ``PeerFailedError`` as soon as a peer reports a failure)."""

    def __init__(
        self,
        requests: list,
        what: str,
        transport: MpiTransport,
        buffers: list,
        done: Callable[[], None] | None = None,
        *,
        point_to_point: bool = False,
        expect: list[int] | None = None,
    ) -> None:
        self._requests, self._what, self._transport, self._done = requests, what, transport, done
        self._mesh = transport.mesh  # held: a mesh outlives its operations (shared_groups)
        self._buffers = buffers  # alive until the operation ends
        self._point_to_point = point_to_point
        # receives: the bytes each must bring (a shorter message filled part of its buffer, no error)
        self._expect, self._counts = expect, None
        self._statuses = [_mpi().Status() for _ in requests] if expect is not None else None

    def _testall(self) -> bool:
        done = _mpi().Request.Testall(self._requests, self._statuses)
        if done and self._statuses is not None and self._counts is None:
            self._counts = [status.Get_count(_mpi().BYTE) for status in self._statuses]
        return done

    def test(self) -> bool:
        """Whether the operation has ended (``wait()`` then returns at once); never blocks."""
        return self._requests is None or self._testall()

    def wait(self) -> bool:
        if self._requests is None:
            return True
        mpi, mesh = _mpi(), self._mesh
        try:
            # MPI's collectives advance their schedule only inside MPI calls: tested every 50 µs
            watch.wait(
                self._testall,
                mesh,
                f"MPI {self._what}",
                self._transport.timeout,
                backoff=self._point_to_point,
            )
        except mpi.Exception as err:  # e.g. a message longer than its receive buffer
            self._abandon(mpi)
            error = RuntimeError(
                f"MPI {self._what} on {mesh} failed ({err.Get_error_string()}): the ranks sent messages of "
                f"different sizes; run with OPTIMUS2D_CHECK=every to find the first operation they disagree on"
            )
            watch.report(error, [mesh])
            raise error from None
        except BaseException:
            self._abandon(mpi)
            raise
        self._requests = self._buffers = None
        if self._expect is not None and self._counts != self._expect:
            error = RuntimeError(
                f"MPI {self._what} on {mesh}: received {self._counts} bytes where {self._expect} were due: the "
                f"ranks sent messages of different sizes; run with OPTIMUS2D_CHECK=every to find the first "
                f"operation they disagree on"
            )
            watch.report(error, [mesh])
            raise error
        if self._done is not None:
            self._done()
        return True

    def __del__(self) -> None:
        # Dropped while in flight (an error elsewhere left it unwaited: SUMMA's next broadcast, a
        # module's agreement): MPI may still write into its buffers when a peer's message matches,
        # so they are kept alive, as after an abandoned wait, rather than freed under MPI's feet.
        requests = self.__dict__.get("_requests")
        if requests is not None:
            _ABANDONED.append((requests, self.__dict__.get("_buffers")))
            shared_groups.spoil(self.__dict__.get("_mesh"))  # its communicators may hold the message

    def _abandon(self, mpi) -> None:
        if self._point_to_point:  # cancelling a collective is erroneous in MPI
            for request in self._requests:
                if request != mpi.REQUEST_NULL:
                    request.Cancel()
        _ABANDONED.append((self._requests, self._buffers))
        self._requests = self._buffers = None


class MpiTransport:
    """One MPI communicator per mesh axis (members in mesh order); every call returns a ``Request``."""

    def __init__(self, layouts: dict[str, list[list[int]]], mesh, timeout: float, taking) -> None:
        """Collective over COMM_WORLD: every rank splits every axis, in the same order."""
        mpi, rank = _mpi(), mesh.rank
        self._mesh, self.timeout = weakref.ref(mesh), timeout  # weak: no cycle keeps a mesh alive
        self.comms: dict[str, object] = {}
        for axis, groups in layouts.items():  # a gone mesh's, where free everywhere (shared_groups.Taking)
            comm = taking.split(mpi.COMM_WORLD, groups, rank)
            if comm != mpi.COMM_NULL:
                self.comms[axis] = comm

    @property
    def mesh(self):
        return self._mesh()

    @staticmethod
    def carries(t: torch.Tensor) -> bool:
        """Whether MPI moves ``t`` (CPU memory); the same answer on every rank of a mesh."""
        return t.device.type == "cpu"

    @staticmethod
    def reducible(t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> bool:
        """Whether MPI can reduce ``t`` with ``op``: CPU, fp32/fp64/int32/int64, SUM or MAX."""
        dtypes = (torch.float32, torch.float64, torch.int32, torch.int64)
        return t.device.type == "cpu" and t.dtype in dtypes and op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX)

    def broadcast(self, t: torch.Tensor, axis: str, root: int) -> Request:
        comm, what = self.comms[axis], f"broadcast over {axis}"
        buf, done = _contiguous(t)
        if comm.Get_size() > DIRECT_MEMBERS:
            return Request([comm.Ibcast(_bytes(buf), root=root)], what, self, [buf], done)
        if comm.Get_rank() == root:
            others = (m for m in range(comm.Get_size()) if m != root)
            requests = [comm.Isend(_bytes(buf), m, _BROADCAST_TAG) for m in others]
        else:
            requests = [comm.Irecv(_bytes(buf), root, _BROADCAST_TAG)]
        return Request(requests, what, self, [buf], done, point_to_point=True)

    def reduce(self, t: torch.Tensor, axis: str, root: int, op: dist.ReduceOp) -> Request:
        mpi, comm = _mpi(), self.comms[axis]
        buf, done = _contiguous(t)
        if comm.Get_size() <= DIRECT_MEMBERS:
            return self._direct_reduce(comm, buf, done, axis, root, op)
        data = [_bytes(buf), _datatype(buf)]
        if comm.Get_rank() == root:
            request = comm.Ireduce(mpi.IN_PLACE, data, op=_op(op), root=root)
        else:
            request = comm.Ireduce(data, None, op=_op(op), root=root)
        return Request([request], f"reduce over {axis}", self, [buf], done)

    def _direct_reduce(self, comm, buf: torch.Tensor, done, axis: str, root: int, op: dist.ReduceOp) -> Request:
        """Each member sends its ``buf`` to the root, which adds the others' to its own in member order."""
        what = f"reduce over {axis}"
        _op(op)  # SUM or MAX, else a ValueError
        if comm.Get_rank() != root:
            request = comm.Isend(_bytes(buf), root, _REDUCE_TAG)
            return Request([request], what, self, [buf], done, point_to_point=True)
        others = [m for m in range(comm.Get_size()) if m != root]
        parts = [torch.empty_like(buf) for _ in others]
        requests = [comm.Irecv(_bytes(part), m, _REDUCE_TAG) for part, m in zip(parts, others, strict=True)]
        expect = [part.numel() * part.element_size() for part in parts]
        combine = torch.Tensor.add_ if op == dist.ReduceOp.SUM else lambda a, b: torch.maximum(a, b, out=a)

        def finish() -> None:
            for part in parts:  # in place, as MPI writes: not an autograd op
                combine(buf.detach(), part)
            if done is not None:
                done()

        return Request(requests, what, self, [buf, *parts], finish, point_to_point=True, expect=expect)

    def all_reduce(self, t: torch.Tensor, axis: str, op: dist.ReduceOp) -> Request:
        buf, done = _contiguous(t)
        request = self.comms[axis].Iallreduce(_mpi().IN_PLACE, [_bytes(buf), _datatype(buf)], op=_op(op))
        return Request([request], f"all-reduce over {axis}", self, [buf], done)

    def all_gather(self, t: torch.Tensor, out: torch.Tensor, axis: str) -> Request:
        """``out`` (contiguous, member-major) receives every member's ``t`` as bytes."""
        request = self.comms[axis].Iallgather(_bytes(t.contiguous()), _bytes(out))
        return Request([request], f"all-gather over {axis}", self, [t, out])

    def isend(self, t: torch.Tensor, axis: str, member: int, tag: int) -> Request:
        buf = t.contiguous()
        request = self.comms[axis].Isend(_bytes(buf), member, tag)
        return Request([request], f"send over {axis}", self, [buf], point_to_point=True)

    def irecv(self, t: torch.Tensor, axis: str, member: int, tag: int) -> Request:
        buf, done = _contiguous(t)
        request = self.comms[axis].Irecv(_bytes(buf), member, tag)
        expect = [buf.numel() * buf.element_size()]
        return Request([request], f"receive over {axis}", self, [buf], done, point_to_point=True, expect=expect)


for _cls, _names in (
    (Request, ("test", "wait")),
    (MpiTransport, ("broadcast", "reduce", "all_reduce", "all_gather", "isend", "irecv")),
):
    for _name in _names:
        setattr(_cls, _name, torch.compiler.disable(getattr(_cls, _name)))


def _contiguous(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A contiguous buffer for in-place ``t``, and what copies it back when the operation ends."""
    if t.is_contiguous():
        return t, None
    buf = t.contiguous()
    return buf, lambda: t.copy_(buf)


def _bytes(t: torch.Tensor):
    """The memory of contiguous ``t`` for MPI, by address: not ``t.numpy()``, which marks the
    storage as not resizable for good (FSDP frees and reallocates its all-gathered parameters'
    storage, and could not after a layer had sent a block of one). The caller keeps ``t`` alive
    until the operation ends (``Request``'s buffers)."""
    return _mpi().buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size())


def _datatype(t: torch.Tensor):
    mpi = _mpi()
    return {torch.float32: mpi.FLOAT, torch.float64: mpi.DOUBLE, torch.int32: mpi.INT32_T, torch.int64: mpi.INT64_T}[
        t.dtype
    ]


def _op(op: dist.ReduceOp):
    mpi = _mpi()
    if op == dist.ReduceOp.SUM:
        return mpi.SUM
    if op == dist.ReduceOp.MAX:
        return mpi.MAX
    raise ValueError(f"the MPI transport reduces with SUM or MAX, not {op}")
