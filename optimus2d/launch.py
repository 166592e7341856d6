"""``optimus2d.init()``: bring up torch.distributed from whatever launched the processes.

Launchers, checked in this order:

* torch.distributed already initialised (by the user or another library): adopted as it is.
* ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``): ``env://``.
* ``mpiexec``/``mpirun`` (MPICH, Open MPI, Intel MPI, PMIx): mpi4py. Rank 0 opens a TCPStore and
  broadcasts its address over MPI; the local rank comes from MPI's shared-memory split. MPI is used
  only for this: tensors move over torch.distributed.
* ``srun`` (``SLURM_PROCID``/``SLURM_NTASKS``): the store on the first host of the node list.
* nothing: a world of one process.

Backend NCCL when CUDA is available (device set from the local rank), gloo otherwise. Every
collective gets a finite timeout, so a lost peer raises an error instead of hanging.

Errors end the job. An exception that ends a process is reported to its peers
(``optimus2d.faults.report_failure``, through the store: ``comm/watch.py``), whose waits then raise
``PeerFailedError`` naming this rank and its error within a fraction of a second instead of
waiting out the timeout; and such a process exits at once with status 1, without waiting for
peers at exit or tearing down operations that will never finish (``os._exit``).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optimus2d import faults
from optimus2d._deprecated import moved_attribute
from optimus2d.comm import watch

DEFAULT_TIMEOUT_S = watch.DEFAULT_TIMEOUT_S
_MPI_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
_EXIT_BARRIER_S = 30.0
_STORE_LINGER_S = 1.0  # a failing rank 0 keeps the store up this long for its peers to read the failure
_owned = False  # whether init() created the process group (and so destroys it at exit)
_STEP_KEY = "optimus2d/slurm_step"  # which srun step and start a store serves
_slurm_starts = 0  # this process's starts under srun (init after shutdown: another)
_made: tuple[object, World] | None = None  # (the process group, the World) of init()'s own start
_crashed = False  # an uncaught exception is ending this process: do not wait for peers at exit


@dataclass(frozen=True)
class World:
    """What ``init()`` found: this process's place and how it communicates."""

    rank: int
    size: int
    local_rank: int
    backend: str
    device: torch.device
    launcher: str  # "existing", "torchrun", "mpi", "slurm" or "single"


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> World:
    """Initialise torch.distributed for this process (idempotent) and return the ``World``.

    ``backend``: "nccl" or "gloo" (default: nccl if CUDA is available, else gloo).
    ``timeout``: seconds (or a timedelta) before a collective waiting on a lost peer raises;
    default ``$OPTIMUS2D_TIMEOUT`` or 300 s.
    """
    global _owned, _made
    if timeout is None:
        timeout = float(os.environ.get("OPTIMUS2D_TIMEOUT", DEFAULT_TIMEOUT_S))
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not 0 < seconds < math.inf:  # torch said "timed out after -1000ms" on every rank
        raise ValueError(f"optimus2d.init: the timeout must be a positive number of seconds, got {timeout!r}")
    timeout = datetime.timedelta(seconds=seconds)
    if dist.is_initialized():
        if _made is not None and _made[0] is _default_group():  # init()'s own start: what it found then
            return _made[1]
        rank = dist.get_rank()
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        watch.set_shared_cores(_shares_cores(_node_ranks_said(os.environ)))
        return _world(rank, dist.get_world_size(), local, dist.get_backend(), "existing")

    launcher = detect_launcher()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if launcher == "torchrun":
        rank, size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        node_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        _set_device(backend, local)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, timeout=timeout)
    else:
        if launcher == "mpi":
            rank, size, local, node_ranks, store = _mpi_store(timeout)
        elif launcher == "slurm":
            rank, size, local, node_ranks, store = _slurm_store(timeout)
        else:
            rank, size, local, node_ranks, store = 0, 1, 0, 1, dist.HashStore()
        _set_device(backend, local)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    watch.set_collective_timeout(timeout.total_seconds())
    watch.set_shared_cores(_shares_cores(node_ranks))
    if not _owned:
        atexit.register(shutdown)
        _note_crashes()
    _owned = True
    _made = (_default_group(), _world(rank, size, local, backend, launcher))
    return _made[1]


def shutdown() -> None:
    """Destroy the process group that ``init()`` created (registered to run at exit).

    After an uncaught exception the process exits at once with status 1: its peers were told,
    and waiting for them (or for operations a lost peer will never finish) could hang the exit.
    """
    global _owned, _made
    if _owned and _crashed and dist.is_initialized() and dist.get_world_size() > 1:
        _owned = False
        if dist.get_rank() == 0:  # rank 0 hosts the store (mpiexec, srun): let the peers read why
            time.sleep(_STORE_LINGER_S)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if _owned and dist.is_initialized():
        if watch.failed_here():  # a collective failed: a peer may be gone, operations abandoned
            _owned = False
            return
        if not _crashed and dist.get_world_size() > 1:
            # Every rank finishes before any tears its connections down: without this, gloo
            # aborts ("terminate called without an active exception") in about 1 exit in 3.
            try:
                if dist.get_backend() == "gloo":
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=_EXIT_BARRIER_S))
                else:
                    dist.barrier()
            except Exception:  # a peer is gone: tear down anyway
                pass
        _made = None  # nor its group, whose store holds the port a next start under srun takes
        dist.destroy_process_group()
    _owned = False


def _note_crashes() -> None:
    previous = sys.excepthook

    def hook(*exc_info):
        global _crashed
        _crashed = True
        if not isinstance(exc_info[1], watch.PeerFailedError):  # the peers already know
            watch.report(exc_info[1])
        previous(*exc_info)

    sys.excepthook = hook


def detect_launcher() -> str:
    """One of "torchrun", "mpi", "slurm" or "single", from the environment."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return "torchrun"
    if any(v in env for v in _MPI_VARS):
        return "mpi"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return "slurm"
    return "single"


def _default_group() -> object:
    """The default process group now (another object after a shutdown and a new start)."""
    return dist.distributed_c10d._get_default_group()


def _world(rank: int, size: int, local: int, backend: str, launcher: str) -> World:
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return World(rank, size, local, backend, device, launcher)


def _set_device(backend: str, local_rank: int) -> None:
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


_HEAVY_YIELD = ("MPICH_ENABLE_HEAVY_YIELD", "MPIR_PARAM_ENABLE_HEAVY_YIELD", "MPIR_CVAR_ENABLE_HEAVY_YIELD")


def _usable_cores() -> int:
    """The cores this rank's node may give its ranks: this process's affinity, or its parent's (the
    launcher's proxy) where the launcher bound each rank to its own cores."""
    cores = len(os.sched_getaffinity(0))
    try:
        return max(cores, len(os.sched_getaffinity(os.getppid())))
    except OSError:  # the parent is gone, or not ours to ask
        return cores


def _shares_cores(node_ranks: int) -> bool:
    """Whether this node runs more ranks than the cores they may use (``watch.set_shared_cores``:
    long waits back off); False where the cores cannot be read (no ``sched_getaffinity``)."""
    try:
        return node_ranks > 1 and node_ranks > _usable_cores()
    except (AttributeError, OSError):
        return False


def _node_ranks_said(env: Mapping[str, str]) -> int:
    """How many ranks run on this node, for a process group made by the caller: as torchrun
    (``LOCAL_WORLD_SIZE``), MPICH's hydra (``MPI_LOCALNRANKS``) or Open MPI (``OMPI_COMM_WORLD_LOCAL_SIZE``)
    says, in that order; 1 where none does."""
    for name in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return 1


def _slurm_node_ranks(env: Mapping[str, str]) -> int:
    """This node's tasks in the step: ``SLURM_STEP_TASKS_PER_NODE`` (else the job's
    ``SLURM_TASKS_PER_NODE``), "2(x3),1" meaning 2, 2, 2 and 1, at ``SLURM_NODEID``; 1 if unsaid."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts = []
    for part in filter(None, spec.split(",")):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if found is None:
            return 1
        counts += [int(found[1])] * int(found[2] or 1)
    node = int(env["SLURM_NODEID"]) if env.get("SLURM_NODEID", "").isdigit() else 0
    return counts[node] if node < len(counts) else 1


def yield_when_oversubscribed(env: MutableMapping[str, str] = os.environ) -> bool:
    """Before MPI starts: where MPICH's launcher (hydra: ``MPI_LOCALNRANKS``) puts more ranks on this
    node than it has cores for them, have MPICH's blocking waits sleep (``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``)
    rather than ``sched_yield`` between polls, unless the user chose (under any of MPICH's three names
    for it). With sched_yield, a blocking MPI call (``Comm.Split`` for a mesh's communicators, a
    barrier) beside a few hundred gloo groups takes seconds instead of milliseconds (8 ranks on 2
    cores, MPICH 5.0, mpi4py's thread level "multiple", 200 groups held: a barrier 0.8–1.0 s, a split
    1.4–14 s, a 2×2×2 mesh built in 45 s; with it 2 ms, 6 ms and 177 ms: ``python -m benchmarks
    meshes``). Our own waits poll with a sleep already (``comm/watch.py``); this is for MPI's own
    blocking calls. Other launchers (Open MPI's, srun, torchrun) are left as they are (not measured).
    True where it set the variable."""
    try:
        ranks, cores = int(env.get("MPI_LOCALNRANKS", 0)), _usable_cores()
    except (ValueError, AttributeError):  # not a number; no sched_getaffinity (not Linux)
        return False
    if ranks <= cores or any(name in env for name in _HEAVY_YIELD):
        return False  # a core a rank; the user's choice
    if "mpi4py.MPI" in sys.modules:  # MPI read its variables when it started: too late
        logging.getLogger(__name__).info(
            "optimus2d: %d ranks on %d cores and MPI started before init(): export MPIR_CVAR_ENABLE_HEAVY_YIELD=1 "
            "before it starts, or MPICH's blocking calls may take seconds (launch.yield_when_oversubscribed)",
            ranks,
            cores,
        )
        return False
    env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    return True


def _mpi_store(timeout: datetime.timedelta):
    yield_when_oversubscribed()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local, local_size = node.Get_rank(), node.Get_size()  # the node's ranks, under any MPI
    node.Free()
    buf = bytearray(512)
    store = None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if local_size == size else socket.getfqdn())
        port = int(os.environ.get("MASTER_PORT", 0))
        store = dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False)
        address = f"{host}:{store.port}".encode()
        buf[: len(address)] = address
    # Poll a non-blocking broadcast: a blocking MPI wait would spin a whole core.
    request, deadline = comm.Ibcast(buf, root=0), time.monotonic() + timeout.total_seconds()
    while not request.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no store address from MPI rank 0 within {timeout}")
        time.sleep(0.002)
    host, port = bytes(buf).rstrip(b"\0").decode().rsplit(":", 1)
    if store is None:
        store = dist.TCPStore(host, int(port), size, is_master=False, timeout=timeout)
    return rank, size, local, local_size, store


def _slurm_store(timeout: datetime.timedelta):
    """The step's rank 0 hosts the store on a port of the job and step (``MASTER_PORT`` if set; the
    next one for each start after a ``shutdown``); the others connect and check that it is their
    step's and start's: two steps of one job at once had the same port, and ranks of each joined the
    other's world with no error (or waited forever on a port something else held)."""
    global _slurm_starts
    env = os.environ
    rank, size, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    host = env.get("MASTER_ADDR") or first_host(nodes)
    job, step = int(env.get("SLURM_JOB_ID", 0)), int(env.get("SLURM_STEP_ID", 0))
    _slurm_starts += 1  # every rank starts as often: a store left by a shutdown start is not this one's
    # the next port for each start after a shutdown: the meshes of the last hold its store (and port)
    port = int(env.get("MASTER_PORT", 20000 + (job * 97 + step) % 20000)) + _slurm_starts - 1
    mine = f"job {job}, step {step}, start {_slurm_starts}, {size} tasks"
    if rank == 0:
        store = dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False)
        store.set(_STEP_KEY, mine)
        return rank, size, local, _slurm_node_ranks(env), store
    store, theirs = _within(
        timeout, f"rank {rank}: the store of Slurm rank 0 at {host}:{port}", lambda: _joined(host, port, size, timeout)
    )
    if theirs != mine:
        raise RuntimeError(
            f"optimus2d.init: rank {rank} ({mine}) reached the store at {host}:{port} of another start "
            f"({theirs}): set MASTER_PORT to a port of its own for each srun step that runs at once"
        )
    return rank, size, local, _slurm_node_ranks(env), store


def _joined(host: str, port: int, size: int, timeout: datetime.timedelta):
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    return store, store.get(_STEP_KEY).decode()


def _within(timeout: datetime.timedelta, what: str, fn):
    """``fn()`` in a daemon thread, or a ``TimeoutError`` after ``timeout``: torch's store client
    waits with no limit on a port that something other than a store holds."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as err:  # raised below, in the caller's thread
            result.append((False, err))

    thread = threading.Thread(target=run, name="optimus2d-store", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    if not result:
        raise TimeoutError(f"{what}: no answer within {timeout}")
    ok, value = result[0]
    if not ok:
        raise value
    return value


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: "gpu[07-09,12],cpu1" → "gpu07"."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def __getattr__(name: str):  # optimus2d.launch.report_failure and collective_timeout: now in optimus2d.faults
    return moved_attribute(__name__, name, faults, ("collective_timeout", "report_failure"))
