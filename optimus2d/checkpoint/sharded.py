"""Checkpoints that reshard: torch's DCP, committed atomically, checksummed, readable in one process.

A checkpoint is what ``dcp.save({"model": msd, "optim": osd})`` writes for torch's
``msd, osd = get_state_dict(model, optimizer)`` (``torch_state.py`` has the keys), plus a
``manifest.json``: DCP writes every rank's blocks and reshards on load, here and in DCP's own
``load``/``set_state_dict``. This module adds what DCP lacks:

- an atomic commit (``files.py``): ``save`` writes into a directory beside ``path`` and renames it
  into place only once every rank has written, with the size and crc32 of every file; a rank killed
  meanwhile leaves the previous checkpoint readable. ``async_save`` stages the tensors (DCP's
  ``async_save``), returns, and commits in a thread once DCP's has written;
- ``load`` and ``read`` verify the manifest first, check the whole checkpoint against the model
  (keys, shapes, optimizer class) before touching it, and read into fresh tensors: on any error the
  model and optimizer are unchanged. ``read`` gives the serial state dict in one process;
- models that keep plain blocks (``torch_state.py``) and checkpoints of format 2
  (``model/<key>``, ``optim/<key>/<name>``; ``reading.py``) load as the others do.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from optimus2d.checkpoint import files as _files
from optimus2d.checkpoint import integrity, reading, torch_state
from optimus2d.checkpoint.progress import Progress, mib, on
from optimus2d.comm import replicas, shared_groups, watch
from optimus2d.comm.mesh import Mesh

__all__ = ["async_save", "load", "read", "save"]


_WORLD_GROUPS: dict = {}  # a save's own groups where no mesh holds them (``_Ranks.own_groups``)


class _Ranks:
    """Who writes and who commits: DCP's group (None: the world) and the commit's, each with
    ``no_dist`` (this process alone); ``writes``: whether this rank writes (replica 0 of several)."""

    def __init__(self, entries: list[torch_state.Held], mesh: Mesh | None) -> None:
        self.dcp = self.commit = self.read = None
        self.dcp_alone = self.commit_alone = self.read_alone = True
        self.writes, self.everyone = True, False  # everyone: every rank of the world takes part
        spans = {t.tensor.device_mesh.size() for t in entries if isinstance(t.tensor, DTensor)}
        if not dist.is_initialized():
            return
        world = dist.get_world_size()
        replicated = mesh is not None and len(mesh.replicas) > 1
        self.everyone = bool(spans and max(spans) == world) or replicated or (mesh is not None and mesh.size == world)
        self.everyone = self.everyone and world > 1
        if spans and max(spans) > (mesh.size if mesh is not None else 1):  # DTensors over replicas (FSDP2)
            self.dcp_alone = self.commit_alone = self.read_alone = False  # the world; DCP writes a block once
        elif mesh is not None and len(mesh.replicas) > 1:  # plain-block replicas: replica 0 writes
            self.writes = mesh.replica == 0
            if mesh.size > 1:  # each replica reads on its own
                self.dcp = self.read = mesh.group("mesh")
                self.dcp_alone = self.read_alone = False
            self.commit_alone = False  # the commit waits for every rank of the world
        elif mesh is not None and mesh.size > 1:
            self.dcp = self.commit = self.read = mesh.group("mesh")
            self.dcp_alone = self.commit_alone = self.read_alone = False

    def own_groups(self, mesh: Mesh | None) -> _Ranks:
        """DCP's write and the commit each on a gloo group of its own over the same ranks, where
        every rank of the world takes part in the save (a mesh over the world, its replicas, DTensors
        over the world), created at its first save (collective over the world, as ``new_group`` is).
        DCP's waits the mesh's timeout; the commit's three times that: a rank that fails before DCP's
        first collective waits in the commit while the others' DCP collectives time out, then every
        rank raises. An ``async_save``'s thread therefore never meets the training's collectives. A
        mesh over some ranks only keeps its own groups (``self.everyone`` False)."""
        if not self.everyone:
            return self
        # no mesh (DTensors alone: a model in 1D): the world's, kept here
        cache = mesh.__dict__.setdefault("_optimus2d_checkpoint_groups", {}) if mesh is not None else _WORLD_GROUPS
        if not cache:
            seconds = mesh.timeout if mesh is not None else watch.collective_timeout()
            cache["commit"] = dist.new_group(timeout=timedelta(seconds=3 * seconds), backend="gloo")
            wait = timedelta(seconds=seconds)
            if self.dcp is not None and mesh is not None and len(mesh.replicas) > 1:  # one per replica, by every rank
                cache["dcp"], _ = dist.new_subgroups_by_enumeration(
                    [list(r) for r in mesh.replicas], timeout=wait, backend="gloo"
                )
            elif not self.dcp_alone:
                cache["dcp"] = dist.new_group(timeout=wait, backend="gloo")
        if not self.commit_alone:
            self.commit = cache["commit"]
        if not self.dcp_alone:
            self.dcp = cache["dcp"]
        return self

    def writer_rank(self) -> int:
        """The rank DCP names this rank's files after (its rank in DCP's group)."""
        return 0 if self.dcp_alone else dist.get_rank(self.dcp)


def _prepare(path, model, optimizer, what: str, progress):
    mods = torch_state.modules(model)
    entries = torch_state.held(mods)
    mesh = torch_state.model_mesh(entries)
    wait_for_async_save(mesh)  # one of this mesh still in flight commits first
    integrity.agree_path(mesh, what, path, optimizer)  # the same directory on every rank, before anything is written
    if mesh is not None and dist.is_initialized() and len(mesh.replicas) > 1:
        _agree_replicas(entries, mesh)
    bar = Progress(what, len(entries) + 1, mesh, progress)
    state = torch_state.to_save(entries, optimizer, torch_state.device_mesh(mesh))
    bar.update(len(entries))
    return entries, mesh, _Ranks(entries, mesh).own_groups(mesh), bar, state


def save(path: str | os.PathLike, model: nn.Module, optimizer=None, *, progress: bool | None = None) -> None:
    """Write ``model`` (and ``optimizer``) to the directory ``path``; collective over the model's mesh.

    Each rank writes its own blocks (DCP); nothing is gathered to one rank but fused q/k/v. Atomic:
    ``path`` (an earlier checkpoint, an empty directory or nothing) is replaced only once every rank
    has written, and a rank killed meanwhile leaves it as it was. Raises ``ValueError`` before
    writing if ``path`` holds files that ``save`` did not write, or on every rank if the ranks name
    different directories. A plain ``torch.nn`` model: call it on one rank. ``model`` may be wrapped
    in ``DistributedDataParallel`` or ``torch.compile``; its keys are its module's.

    Data-parallel replicas (a model on one of several replica meshes, ``len(mesh.replicas) > 1``,
    with plain blocks): replica 0 writes, and every rank of every replica calls ``save``: the commit
    is collective over the world. Parameters that are DTensors over the replicas too (``parallelize``
    given a DeviceMesh with a "dp" dim, FSDP2): every rank calls it and DCP writes each block once.
    Meshes of the same shape that hold different tensors are pipeline stages: refused on every rank
    before anything is written (``checkpoint.save_stages`` writes them).

    ``progress``: a bar on the mesh's first rank (None: when stderr is a terminal), then one summary
    line (on stderr with the bar, else logged at INFO to the ``optimus2d`` logger).
    """
    start = time.perf_counter()
    entries, mesh, ranks, bar, state = _prepare(path, model, optimizer, "checkpoint.save", progress)
    bar.start = start
    bar.note("writing")
    with bar, _fresh_groups_after_failure(mesh):
        _files.save_atomically(
            path, lambda directory: _write(state, directory, ranks, dcp.save), ranks.commit, ranks.commit_alone
        )
        bar.update()
    _summary(bar, path, entries, optimizer, mesh)


def async_save(
    path: str | os.PathLike, model: nn.Module, optimizer=None, *, progress: bool | None = None
) -> concurrent.futures.Future:
    """``save``, returning once the state is staged (DCP's ``async_save`` copies it to host memory):
    training may change the model and optimizer at once. The write and the atomic commit run in the
    background, on process groups of their own (gloo, created at the first call, collective over
    the world: a mesh over some ranks only is refused). Returns a ``Future``: ``result()`` returns
    once the checkpoint is committed, or raises ``save``'s error, on every rank. A later ``save``,
    ``async_save`` or ``load`` on the same mesh (for a model with no Mesh, of any such model in this
    process) waits for it first (and raises its error); so should the end of the program. Where
    DCP writes alone (no mesh, or a mesh of one rank) and torch's default group has no CPU backend
    (NCCL alone), DCP's ``async_save`` refuses: the files are written before it returns, the
    commit behind."""
    start = time.perf_counter()
    entries, mesh, ranks, bar, state = _prepare(path, model, optimizer, "checkpoint.async_save", progress)
    bar.start = start
    if not ranks.everyone and not (ranks.dcp_alone and ranks.commit_alone):  # the same on every rank of the mesh
        raise ValueError(
            f"checkpoint.async_save: {mesh} is over some ranks of the world only; its background groups are "
            "created over the world (every rank calls it): use checkpoint.save here"
        )
    tmp = _files.begin(path, ranks.commit, ranks.commit_alone)
    try:
        staged = _write(state, tmp, ranks, dcp.async_save)  # a Future of DCP's write, or None
        own = None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        staged, own = None, err

    def finish() -> None:
        error = own
        if staged is not None:
            try:
                staged.result()
            except BaseException as err:
                error = err
        wrote = None if error is not None or not ranks.writes else ranks.writer_rank()
        with _fresh_groups_after_failure(mesh):
            _files.commit(path, ranks.commit, ranks.commit_alone, wrote, error)
        _summary(bar, path, entries, optimizer, mesh)

    future = _SaveFuture()

    def run() -> None:
        try:
            finish()
            future.set_result(None)
        except BaseException as err:
            future.set_exception(err)

    threading.Thread(target=run, name="optimus2d-checkpoint", daemon=False).start()
    if mesh is not None:
        mesh.__dict__["_optimus2d_checkpoint_pending"] = future
    else:  # a model with no Mesh (plain torch.nn, 1D DTensors): this process's own
        _PENDING_WITHOUT_MESH.append(future)
    return future


# async saves of models with no Mesh, still to be waited for: a later save replaced the directory the
# background write and commit still used (the checkpoint before it lost, the Future's success false)
_PENDING_WITHOUT_MESH: list[concurrent.futures.Future] = []


@contextlib.contextmanager
def _fresh_groups_after_failure(mesh: Mesh | None):
    """A save that failed (every rank raises) may leave its groups broken (gloo closes a pair that
    timed out): the next one creates new ones."""
    try:
        yield
    except BaseException:
        if mesh is not None:
            mesh.__dict__.pop("_optimus2d_checkpoint_groups", None)
            shared_groups.spoil(mesh)  # a mesh over some ranks saves on its own group: never handed on
        raise


class _SaveFuture(concurrent.futures.Future):
    """``async_save``'s Future; it knows whether its result (or error) was asked for."""

    asked = False

    def result(self, timeout: float | None = None):
        self.asked = True
        return super().result(timeout)


def wait_for_async_save(mesh: Mesh | None) -> None:
    """Wait for the ``async_save`` of ``mesh`` still in flight, if any (``mesh`` None: every one of a
    model with no Mesh in this process); raise its error if it failed and nobody asked its Future (a
    failed save is not lost silently)."""
    if mesh is not None:
        pending = [mesh.__dict__.pop("_optimus2d_checkpoint_pending", None)]
    else:
        pending, _PENDING_WITHOUT_MESH[:] = list(_PENDING_WITHOUT_MESH), []
    for future in (f for f in pending if f is not None):
        concurrent.futures.wait([future])
        if not future.asked:
            future.result()


def _write(state: dict, directory: str, ranks: _Ranks, how):
    """DCP's ``save`` (or ``async_save``) of ``state`` into ``directory``; the rank DCP names this
    rank's files after (``save``), DCP's Future (``async_save``), or None where it writes nothing."""
    if not ranks.writes:
        return None
    written = None
    if how is dcp.async_save and ranks.dcp_alone and _no_cpu_backend():
        # DCP's async_save asks the default group for a CPU backend even where it writes alone (an
        # NCCL-only group, on GPUs): written here, before returning; the commit still runs behind
        how, written = dcp.save, concurrent.futures.Future()
        written.set_result(None)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process")
        out = how(state, checkpoint_id=directory, process_group=ranks.dcp, no_dist=ranks.dcp_alone)
    if written is not None:
        return written
    return out if how is dcp.async_save else ranks.writer_rank()


def _no_cpu_backend() -> bool:
    """Whether torch's default process group has no CPU backend (NCCL alone), which DCP's
    ``async_save`` refuses."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    types = getattr(dist.distributed_c10d._get_default_group(), "_device_types", None)
    return types is not None and torch.device("cpu") not in types


def _summary(bar: Progress, path, entries, optimizer, mesh) -> None:
    if not bar.lead:  # the sizes from the manifest the commit wrote: read here, nothing exchanged
        return
    files = _manifest_files(path)
    nbytes = sum(f.get("bytes", 0) for f in files.values())
    bar.summary(
        f"{bar.what}: {len(entries)} tensors{' and optimizer state' if optimizer is not None else ''}, "
        f"{mib(nbytes)} in {len(files)} files to {os.fspath(path)} in {bar.seconds():.1f} s{on(mesh)}"
    )


def _manifest_files(path) -> dict:
    import json

    try:
        with open(os.path.join(_files.locate(path), _files.MANIFEST)) as f:
            return json.load(f).get("files", {})
    except (OSError, ValueError):
        return {}


def _agree_replicas(entries: list[torch_state.Held], mesh: Mesh) -> None:
    """Every replica of ``mesh`` saves a model of the same serial keys and shapes, or every rank
    raises ``ValueError`` naming each group's tensors. One all-gather of 8 words over the world."""
    import zlib

    keys = [f"{e.key}{list(e.shape)}" for e in entries]
    digest = zlib.crc32("\n".join(keys).encode())
    shown = f"{keys[0]} … {keys[-1]}" if len(keys) > 1 else (keys[0] if keys else "nothing")
    description = f"a model of {len(keys)} tensors ({shown}; crc {digest:08x})"
    where = "checkpoint.save over replica meshes (pipeline stages hold different parts: checkpoint.save_stages)"
    replicas.agree_world(where, description, None, mesh.timeout)


# ---- read and load -------------------------------------------------------------------------------
def read_metadata(path) -> dict:
    try:
        return FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    except Exception as err:
        raise ValueError(f"optimus2d.checkpoint: no readable checkpoint at {os.fspath(path)!r} ({err})") from err


def dcp_load(state: dict, path, group, no_dist: bool) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.load(state, checkpoint_id=os.fspath(path), process_group=group, no_dist=no_dist)
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(f"optimus2d.checkpoint: could not read {os.fspath(path)!r}: {first}") from err


def read(path: str | os.PathLike, *, verify: bool = True) -> dict:
    """The whole checkpoint as plain full tensors, in this process alone (no communication).

    Returns ``{"model": serial state_dict, "optimizer": {serial key: {state: tensor}}, "meta": {...}}``
    (``meta``: ``format``, ``optimizer`` (its class name), ``param_groups``); ``read(path)["model"]``
    loads into the serial ``torch.nn`` model with ``load_state_dict``. Reads a checkpoint DCP wrote
    alone too (``verify=False``: it has no manifest). Verifies every file against the manifest first
    (see ``load`` for the errors).
    """
    path = _files.verified(path, None, True, verify)
    metadata = read_metadata(path)
    fmt = reading.scheme(path, metadata, dcp_load)
    flat: dict[str, object] = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    flat.update({k: None for k, m in metadata.items() if isinstance(m, BytesStorageMetadata)})
    dcp_load(flat, path, None, True)
    return fmt.serial(flat)


def load(
    path: str | os.PathLike,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
) -> dict[str, torch.Tensor] | None:
    """Read a checkpoint into ``model`` (and ``optimizer``) on whatever mesh they live on.

    Collective over the model's mesh (each data-parallel replica reads on its own, at the same
    time; a ``DistributedDataParallel`` or compiled model loads into its module). With no model,
    returns the serial ``state_dict`` (see ``read``). Raises ``ValueError`` if there is no checkpoint
    at ``path`` or it has no manifest (a save did not finish) or it does not fit (other keys or
    shapes, another optimizer), and ``RuntimeError`` if a file is missing, truncated or damaged (its
    size or crc32 differs from the manifest's), or if the model ties two keys (a head that is its
    embedding) that the checkpoint holds with other values (an untied model's). Files are verified on
    every rank (each checksums a share) and every rank raises the same error. In every case nothing
    is changed. ``verify=False``
    skips the manifest: for a checkpoint DCP wrote alone (``get_state_dict``'s keys, as here).
    """
    if model is None:
        return read(path, verify=verify)["model"]
    mods = torch_state.modules(model)
    entries = torch_state.held(mods)
    mesh = torch_state.model_mesh(entries)
    wait_for_async_save(mesh)
    integrity.agree_optimizer(mesh, "checkpoint.load", optimizer)  # one rank's None: its state left fresh
    ranks = _Ranks(entries, mesh)
    try:
        path = _files.verified(path, ranks.read, ranks.read_alone, verify)  # collective; the directory to read
        metadata = read_metadata(path)
        fmt = reading.scheme(path, metadata, dcp_load)
        plan = reading.Reading(path, metadata, fmt, entries, optimizer, torch_state.device_mesh(mesh))
        plan.check_fits()
        dcp_load(plan.state, path, ranks.read, ranks.read_alone)
    except BaseException:
        shared_groups.spoil(mesh)  # the read may have run on the mesh's own group
        raise
    plan.apply(None if ranks.read_alone else functools.partial(_gathered, group=ranks.read))
    return None


def _gathered(obj: object, group) -> list:
    """``obj`` of every rank of ``group`` (the readers'), in rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
