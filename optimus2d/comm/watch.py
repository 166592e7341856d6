"""Waiting on peers without trusting them forever: a deadline, and an ear for their failures.

Every wait of a mesh collective (MPI requests, torch.distributed works on CPU) polls its operation
and, every ``_LISTEN_S``, the job's **failure channel**: a key per mesh in torch.distributed's
store. A rank that fails (an uncaught exception, ``optimus2d.faults.report_failure``, a timeout of its
own) writes ``"rank r: Type: message"`` under the key of every mesh it built; its peers, waiting in that
mesh's collectives, read it within ``_LISTEN_S`` and raise ``PeerFailedError`` naming the rank and its
error, instead of waiting out the timeout. A wait longer than the collective timeout raises
``TimeoutError`` and reports it on the channel too.

After either error the mesh is dead (an abandoned operation may still match a later one): build a
new one, or let the process end (``optimus2d.init`` makes every process exit non-zero at once).
"""

from __future__ import annotations

import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from optimus2d.comm import shared_groups

_POLL_S = 5e-5  # between tests of an operation: short, and frees the core for a rank sharing it
_POLL_MAX_S = 1e-3  # on shared cores a wait that has lasted t sleeps t/16, from _POLL_S up to this
_shared_cores = False  # more ranks on this node than cores (optimus2d.init): long waits back off
_LISTEN_S = 0.2  # between reads of the failure channel (a round trip to the store)
# a peer's failure heard while this operation runs: it may still complete (an agreement's last
# all-gather, after which every rank raises the same refusal and the quickest reports it): tested
# this long before PeerFailedError
_GRACE_S = 1.0
_meshes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # uid → Mesh, built on this rank
_failed: list[str] = []  # what this process reported: a fatal error happened here
_waiters: ThreadPoolExecutor | None = None  # blocks in the waits that cannot be polled
_timeout_s: float | None = None  # what optimus2d.init() gave the process group
DEFAULT_TIMEOUT_S = 300.0


def collective_timeout() -> float:
    """Seconds a wait may last: what ``optimus2d.init()`` gave the process group, else
    ``$OPTIMUS2D_TIMEOUT`` or 300 s."""
    if _timeout_s is not None:
        return _timeout_s
    return float(os.environ.get("OPTIMUS2D_TIMEOUT", DEFAULT_TIMEOUT_S))


def set_collective_timeout(seconds: float) -> None:
    """Called by ``optimus2d.init()`` with the timeout it gave the process group."""
    global _timeout_s
    _timeout_s = float(seconds)


def set_shared_cores(shared: bool) -> None:
    """Called by ``optimus2d.init()``: whether this node runs more ranks than it has cores. Then a
    wait that has lasted t sleeps t/16 between tests of its operation (``_POLL_S`` to
    ``_POLL_MAX_S``): the waiting ranks leave the cores to those that compute, and a wait ends at
    most max(50 µs, t/16) ≤ 1 ms after its operation. With a core a rank it sleeps ``_POLL_S``.
    Measured in benchmarks/RESULTS.md (2026-12-06, thirty-seventh session)."""
    global _shared_cores
    _shared_cores = bool(shared)


class PeerFailedError(RuntimeError):
    """A peer reported a failure while this rank waited for it in a collective of the same mesh."""


def register(mesh) -> None:
    """Make ``mesh``'s failures reportable (``Mesh`` calls this once its uid is agreed)."""
    _meshes[mesh.uid] = mesh


def registered(uid: int):
    """The mesh of this ``uid`` built on this rank (``register``), or None once it is gone."""
    return _meshes.get(uid)


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # a process group given without a store
        return None


def _key(uid: int) -> str:
    return f"optimus2d/failed/{uid}"


def report(error: BaseException | str, meshes=None) -> None:
    """Tell the peers of ``meshes`` (default: every mesh of this rank) that this rank failed.

    Idempotent per mesh; never raises (it runs on the way out of a failing process).
    """
    if isinstance(error, BaseException):
        error = f"{type(error).__name__}: {error}"
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    text = f"rank {rank}: {error}"
    _failed.append(text)
    targets = list(_meshes.values()) if meshes is None else list(meshes)
    for mesh in targets:
        shared_groups.spoil(mesh)
    store = _store()
    if store is None:
        return
    for mesh in targets:
        if mesh.size > 1 and getattr(mesh, "uid", None) is not None:
            try:
                if not store.check([_key(mesh.uid)]):  # the first report of a mesh wins
                    store.set(_key(mesh.uid), text[:4000])
            except Exception:  # the store is gone with its host: nothing more to tell
                return


def failure(mesh) -> str | None:
    """What a peer reported for ``mesh`` ("rank r: Type: message"), or None."""
    store = _store()
    if store is None or mesh is None or mesh.size == 1:
        return None
    try:
        if store.check([_key(mesh.uid)]):
            return store.get(_key(mesh.uid)).decode(errors="replace")
    except Exception:  # the store's host is gone: a peer is lost, the timeout will say so
        return None
    return None


def failed_here() -> bool:
    """Whether this process reported a failure (then it must not wait for peers at exit)."""
    return bool(_failed)


def wait(done, mesh, what: str, timeout: float, *, backoff: bool = True) -> None:
    """Poll ``done()`` until it is true; raise ``PeerFailedError`` or ``TimeoutError`` instead of hanging.
    A wait that raises leaves its operation abandoned: the mesh's groups are never handed on to a
    later mesh (``shared_groups.spoil``). ``backoff=False`` for an operation that advances only
    while it is tested (an MPI collective's schedule): it is tested every ``_POLL_S`` even on
    shared cores."""
    try:
        _wait(done, mesh, what, timeout, backoff and _shared_cores)
    except BaseException:
        shared_groups.spoil(mesh)
        raise


def _wait(done, mesh, what: str, timeout: float, backoff: bool) -> None:
    if done():
        return
    start = time.monotonic()
    heard = start
    while not done():
        pending = getattr(mesh, "pending", None)
        if pending is not None and pending.ready():  # a module's agreement: raises if the ranks disagree
            pending.resolve()
        now = time.monotonic()
        if now - heard > _LISTEN_S:
            heard = now
            peer = failure(mesh)
            if peer is not None:
                if _completes(done, _GRACE_S):
                    return
                raise PeerFailedError(f"{what} on {mesh} stopped: {peer}")
        if now - start > timeout:
            err = TimeoutError(f"{what} on {mesh} did not complete within {timeout:g} s: is a peer lost?")
            report(err, [mesh] if mesh is not None else [])
            raise err
        time.sleep(min(_POLL_MAX_S, max(_POLL_S, (now - start) / 16)) if backoff else _POLL_S)


def _completes(done, seconds: float) -> bool:
    """Whether ``done()`` turns true within ``seconds`` (tested every ``_POLL_S``)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if done():
            return True
        time.sleep(_POLL_S)
    return done()


class Watched:
    """A torch.distributed work whose ``wait()`` polls (see ``wait``) instead of blocking.

    ``pollable=False`` for works that report completion only from ``wait()`` (gloo's point-to-point
    sends and receives): a helper thread blocks in it while this thread polls.
    """

    def __init__(self, work, mesh, what: str, timeout: float, *, pollable: bool = True) -> None:
        self._work, self._mesh, self._what, self._timeout = work, mesh, what, timeout
        self._pollable = pollable

    def __del__(self) -> None:
        if self.__dict__.get("_work") is not None:  # dropped in flight: its groups may hold the message
            shared_groups.spoil(self.__dict__.get("_mesh"))

    def wait(self) -> bool:
        global _waiters
        if self._work is None:
            return True
        work, self._work = self._work, None
        try:
            if self._pollable:
                wait(work.is_completed, self._mesh, self._what, self._timeout)
                return work.wait()
            if _waiters is None:
                _waiters = ThreadPoolExecutor(max_workers=4, thread_name_prefix="optimus2d-wait")
            future = _waiters.submit(work.wait)
            wait(future.done, self._mesh, self._what, self._timeout)
            return future.result()
        except (PeerFailedError, TimeoutError, ValueError, TypeError):  # lost peers, disagreements
            raise
        except Exception as err:  # gloo's own error (a peer's connection closed, its timeout)
            shared_groups.spoil(self._mesh)
            peer = failure(self._mesh)  # a peer that failed and exited: name it and its error
            if peer is not None:
                raise PeerFailedError(f"{self._what} on {self._mesh} stopped: {peer}") from err
            report(err, [self._mesh])
            raise
