"""Checkpoints that reshard: written on one mesh, read on any other or in a single process.

Built on ``torch.distributed.checkpoint`` (DCP). Every tensor is stored under its *serial* key
and shape, as a DTensor view of this rank's block (padding removed), so every rank writes only
its own blocks (replicas are written once) and DCP reassembles any other layout on load::

    model/<serial key>                 a parameter (fused q/k/v: one entry per part, "#0", "#1", ...)
    optim/<serial key>/<state name>    optimizer state (exp_avg, exp_avg_sq, step, ...)
    meta                               JSON: optimizer class and hyper-parameters

``save`` is atomic: it writes into a temporary directory beside ``path`` and commits it by
renames only once every rank has written, with a ``manifest.json`` listing every file's size and
crc32 (``checkpoint/files.py`` has the scheme). A rank killed during a save leaves the
previous checkpoint readable. ``load`` and ``read`` verify the manifest first, then check the whole
checkpoint against the model (keys, shapes, optimizer class) before touching it, and read into
fresh tensors: on any error the model and optimizer are unchanged.
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from optimus2d.checkpoint import files as _files
from optimus2d.checkpoint import integrity
from optimus2d.checkpoint.progress import Progress, mib, on
from optimus2d.checkpoint.serial import _owners
from optimus2d.comm import replicas
from optimus2d.comm.dtensor import MESH_DIMS, like, local, stored_state_dict
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding
from optimus2d.layers.base import sharding_of


@dataclass
class _Entry:
    key: str  # serial state_dict key
    tensor: torch.Tensor  # this rank's block (a parameter's or buffer's local tensor)
    param: torch.Tensor  # the parameter or buffer itself (the optimizer's key)
    sharding: Sharding | None  # None: replicated (plain torch)
    mesh: Mesh | None


def _entries(model: nn.Module) -> list[_Entry]:
    owners, out = _owners(model), []
    with stored_state_dict():
        state = model.state_dict()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"optimus2d.checkpoint: {key} is not a tensor (a module's extra state); it would not be resharded"
            )
        owner, name = owners[key]
        sharding, mesh = sharding_of(owner, name)
        param = getattr(owner, name)
        out.append(_Entry(key, local(param), param, sharding, mesh))
    return out


def _model_mesh(entries: list[_Entry]) -> Mesh | None:
    meshes = {id(e.mesh): e.mesh for e in entries if e.mesh is not None}
    if len(meshes) > 1:
        raise ValueError("optimus2d.checkpoint: the model's modules live on more than one Mesh")
    return next(iter(meshes.values()), None)


def _parts(sharding: Sharding | None) -> list[Sharding | None]:
    if sharding is None:
        return [None]
    return sharding._part_shardings() if sharding.parts else [sharding]


def _suffixes(sharding: Sharding | None) -> list[str]:
    return [f"#{n}" for n in range(len(sharding.parts))] if sharding is not None and sharding.parts else [""]


def _split_parts(local: torch.Tensor, sharding: Sharding | None, mesh: Mesh | None) -> list[torch.Tensor]:
    if sharding is None or not sharding.parts:
        return [local]
    return list(local.split(sharding.part_sizes(mesh), sharding.parts_dim))


def _block_index(mesh: Mesh, axes: tuple[str, ...]) -> int:
    index = 0
    for axis in axes:
        index = index * mesh.axis_size(axis) + mesh.index(axis)
    return index


def _stored_views(local: torch.Tensor, sharding: Sharding | None, mesh: Mesh | None, device_mesh) -> list[torch.Tensor]:
    """What goes into the DCP state dict for one tensor: DTensors (or plain full tensors)."""
    parts = _parts(sharding)
    if sharding is None or mesh is None or mesh.size == 1:
        pieces = _split_parts(local, sharding, None)
        if sharding is not None:  # a 1-rank mesh: the block is the padded full tensor
            pieces = [piece[tuple(slice(0, n) for n in p.full_shape)] for piece, p in zip(pieces, parts, strict=True)]
        return list(pieces)
    pieces = _split_parts(local, sharding, mesh)
    views = []
    for piece, part in zip(pieces, parts, strict=True):
        valid = piece
        for d, axes in enumerate(part.dims):
            per = piece.shape[d]
            start = _block_index(mesh, axes) * per
            valid = valid.narrow(d, 0, max(0, min(per, part.full_shape[d] - start)))
        placements = [Replicate(), Replicate(), Replicate()]
        for d, axes in enumerate(part.dims):
            for axis in axes:
                placements[MESH_DIMS[axis]] = Shard(d)
        full = torch.empty(part.full_shape, device="meta")
        views.append(
            DTensor.from_local(
                valid.contiguous(), device_mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
            )
        )
    return views


def _device_mesh(mesh: Mesh | None):
    if mesh is None or mesh.size == 1:
        return None
    ranks = torch.tensor(mesh.ranks).view(mesh.depth, mesh.q, mesh.q)
    # dims named as Mesh.device_mesh's (a dim names the coordinate it indexes); no process groups
    return DeviceMesh(mesh.device.type, ranks, mesh_dim_names=("depth", "row", "col"), _init_backend=False)


def _process_group(mesh: Mesh | None):
    """(process_group, no_dist) for DCP."""
    if not dist.is_initialized():
        return None, True
    if mesh is None:  # a plain torch model: every rank holds all of it, so this rank alone reads/writes
        return None, True
    if mesh.size == 1:
        return None, True
    return mesh.group("mesh"), False


def _first_alias(entries: list[_Entry]) -> dict[int, _Entry]:
    """A tensor under several keys (a tied head) keeps its optimizer state under its first key."""
    by_param: dict[int, _Entry] = {}
    for e in entries:
        by_param.setdefault(id(e.param), e)
    return by_param


def _optimizer_tensors(optimizer, entries: list[_Entry]) -> dict[str, tuple[torch.Tensor, _Entry | None]]:
    by_param = _first_alias(entries)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_param:
                raise ValueError("optimus2d.checkpoint: the optimizer holds a parameter that is not in the model")
            entry = by_param[id(p)]
            for name, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimus2d.checkpoint: optimizer state {name!r} is not a tensor")
                like_param = value.shape == p.shape and value.dim() > 0
                if value.dim() > 0 and not like_param and entry.sharding is not None:
                    raise TypeError(
                        f"optimus2d.checkpoint: optimizer state {name!r} of {entry.key} has shape "
                        f"{tuple(value.shape)}, neither the parameter's block {tuple(p.shape)} nor a scalar: "
                        "it cannot be resharded"
                    )
                out[f"optim/{entry.key}/{name}"] = (local(value), entry if like_param else None)
    return out


def _meta(optimizer, entries: list[_Entry]) -> dict:
    by_param = {k: e.key for k, e in _first_alias(entries).items()}
    groups = [
        {"params": [by_param[id(p)] for p in g["params"]], **{k: v for k, v in g.items() if k != "params"}}
        for g in (optimizer.param_groups if optimizer is not None else [])
    ]
    keys: dict[int, list[str]] = {}
    for e in entries:
        keys.setdefault(id(e.param), []).append(e.key)
    return {
        "format": _files.FORMAT,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "param_groups": groups,
        # a tensor under several keys (a tied head): every other key → the first, which holds its optimizer state
        "aliases": {k: ks[0] for ks in keys.values() for k in ks[1:]},
    }


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    progress: bool | None = None,
) -> None:
    """Write ``model`` (and ``optimizer``) to the directory ``path``; collective over the model's mesh.

    Each rank writes its own blocks; nothing is gathered to one rank. Atomic: ``path`` (an earlier
    checkpoint, an empty directory or nothing) is replaced only once every rank has written, and a
    rank killed meanwhile leaves it as it was. Raises ``ValueError`` before writing if ``path``
    holds files that ``save`` did not write, or on every rank if the ranks name different
    directories (their absolute paths differ). With a plain ``torch.nn`` model, call it on one rank.

    Data-parallel replicas (a model on one of several replica meshes, ``len(mesh.replicas) > 1``,
    e.g. from ``Mesh.from_device_mesh`` of a DeviceMesh with a "dp" dim; a ``DistributedDataParallel``
    model is saved as its module): replicas hold the same blocks, so replica 0 alone writes them.
    Every rank of every replica calls ``save``: the commit is collective over the world, and no rank
    returns before it. The checkpoint is that of one mesh, and loads on any mesh or in one process.
    Meshes of the same shape that hold different tensors are pipeline stages, not replicas: refused
    on every rank, before anything is written (``checkpoint.save_stages`` writes them).

    ``progress``: a bar on the mesh's first rank (None: when stderr is a terminal) over the tensors
    as they are laid out, then one step for DCP's write and the commit; that rank ends with one
    summary line (on stderr with the bar, else logged at INFO to the ``optimus2d`` logger).
    """
    start = time.perf_counter()
    model = _unwrap(model)
    entries = _entries(model)
    mesh = _model_mesh(entries)
    integrity.agree_path(mesh, "checkpoint.save", path)  # before anything is written
    if _replicated(mesh):
        _agree_replicas(entries, mesh)
    device_mesh = _device_mesh(mesh)
    optimizer_tensors = _optimizer_tensors(optimizer, entries) if optimizer is not None else {}
    bar = Progress("checkpoint.save", len(entries) + len(optimizer_tensors) + 1, mesh, progress)
    bar.start = start
    state = _state_to_write(entries, optimizer, optimizer_tensors, device_mesh, bar)
    group, no_dist = _process_group(mesh)

    def write(directory: str) -> int | None:
        if _replicated(mesh) and mesh.replica != 0:  # replica 0 writes these blocks
            return None
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.save(state, checkpoint_id=directory, process_group=group, no_dist=no_dist)
        return 0 if no_dist else dist.get_rank(group)  # DCP names its files after the rank in its group

    bar.note("writing")
    with bar:
        if _replicated(mesh):  # replica 0 writes; the commit waits for every rank of the world
            _files.save_atomically(path, write, None, False)
        else:
            _files.save_atomically(path, write, group, no_dist)
        bar.update()
    if bar.lead:  # the sizes from the manifest the commit wrote: read here, nothing exchanged
        files = _manifest_files(path)
        nbytes = sum(f.get("bytes", 0) for f in files.values())
        where = on(mesh)
        bar.summary(
            f"checkpoint.save: {len(entries)} tensors{' and optimizer state' if optimizer is not None else ''}, "
            f"{mib(nbytes)} in {len(files)} files to {os.fspath(path)} in {bar.seconds():.1f} s{where}"
        )


def _state_to_write(entries: list, optimizer, optimizer_tensors: dict, device_mesh, bar: Progress) -> dict:
    """DCP's state dict of this rank: every stored view of the model's and the optimizer's tensors,
    and the meta (on every rank, so that every rank refuses what does not fit)."""
    state: dict[str, object] = {}
    for e in entries:
        views = _stored_views(e.tensor.detach(), e.sharding, e.mesh, device_mesh)
        for suffix, view in zip(_suffixes(e.sharding), views, strict=True):
            state[f"model/{e.key}{suffix}"] = view
        bar.update()
    for key, (value, entry) in optimizer_tensors.items():
        sharding = entry.sharding if entry is not None else None
        views = _stored_views(value.detach(), sharding, entry.mesh if entry else None, device_mesh)
        for suffix, view in zip(_suffixes(sharding), views, strict=True):
            state[f"{key}{suffix}"] = view
        bar.update()
    meta = _meta(optimizer, entries)
    meta["parts_dim"] = {k.partition("#")[0]: dim for k, dim in _parts_dims(entries, state).items()}
    state["meta"] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    return state


def _manifest_files(path: str | os.PathLike) -> dict:
    """The committed checkpoint's files (name → {"bytes", "crc32"}); empty if unreadable."""
    try:
        with open(os.path.join(_files.locate(path), _files.MANIFEST)) as f:
            return json.load(f).get("files", {})
    except (OSError, ValueError):
        return {}


def _unwrap(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wraps (its state dict keys, without "module.")."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _replicated(mesh: Mesh | None) -> bool:
    """Whether ``mesh`` is one of several data-parallel replicas (``Mesh.replicas``)."""
    return mesh is not None and dist.is_initialized() and len(mesh.replicas) > 1


def _agree_replicas(entries: list[_Entry], mesh: Mesh) -> None:
    """Every replica of ``mesh`` saves a model of the same serial keys and shapes, or every rank
    raises ``ValueError`` naming each group's tensors. One all-gather of 8 words over the world."""
    keys = [f"{e.key}{list(e.sharding.full_shape) if e.sharding else list(e.tensor.shape)}" for e in entries]
    digest = zlib.crc32("\n".join(keys).encode())
    shown = f"{keys[0]} … {keys[-1]}" if len(keys) > 1 else (keys[0] if keys else "nothing")
    description = f"a model of {len(keys)} tensors ({shown}; crc {digest:08x})"
    where = "checkpoint.save over replica meshes (pipeline stages hold different parts: checkpoint.save_stages)"
    replicas.agree_world(where, description, None, mesh.timeout)


def _parts_dims(entries: list[_Entry], state: dict) -> dict[str, int]:
    """For every stored key that is one part of a fused tensor: the dim the parts concatenate on."""
    dims = {f"model/{e.key}": e.sharding.parts_dim for e in entries if e.sharding is not None and e.sharding.parts}
    for key in state:  # optimizer state of a fused parameter: optim/<param key>/<name>#n
        base = key.partition("#")[0]
        if key.startswith("optim/") and "#" in key:
            dims[base] = dims.get(f"model/{base[len('optim/') :].rpartition('/')[0]}", 0)
    return dims


def _read_metadata(path: str | os.PathLike):
    try:
        return FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    except Exception as err:
        raise ValueError(f"optimus2d.checkpoint: no readable checkpoint at {os.fspath(path)!r} ({err})") from err


def _read_meta(path, metadata) -> dict:
    if "meta" not in metadata:
        raise ValueError(f"optimus2d.checkpoint: {os.fspath(path)!r} was not written by optimus2d.checkpoint.save")
    buf = torch.empty(metadata["meta"].size, dtype=torch.uint8)
    _dcp_load({"meta": buf}, path, None, True)
    return json.loads(bytes(buf.tolist()).decode())


def _dcp_load(state: dict, path, group, no_dist: bool) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.load(state, checkpoint_id=os.fspath(path), process_group=group, no_dist=no_dist)
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(f"optimus2d.checkpoint: could not read {os.fspath(path)!r}: {first}") from err


def read(path: str | os.PathLike, *, verify: bool = True) -> dict:
    """The whole checkpoint as plain full tensors, in this process alone (no communication).

    Returns ``{"model": serial state_dict, "optimizer": {serial key: {state: tensor}}, "meta": {...}}``;
    ``read(path)["model"]`` loads into the serial ``torch.nn`` model with ``load_state_dict``.
    Verifies every file against the manifest first (see ``load`` for the errors; ``verify=False``
    only for a checkpoint written before manifests, optimus2d 0.1.0).
    """
    path = _files.verified(path, None, True, verify)
    metadata = _read_metadata(path)
    flat = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if isinstance(m, TensorStorageMetadata) and k != "meta"
    }
    _dcp_load(flat, path, None, True)
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in flat.items():
        base, _, part = key.partition("#")
        parts.setdefault(base, {})[int(part) if part else 0] = tensor
    meta = _read_meta(path, metadata)
    part_dims = meta.get("parts_dim", {})
    joined = {
        base: torch.cat([p[n] for n in sorted(p)], part_dims.get(base, 0)) if len(p) > 1 else p[0]
        for base, p in parts.items()
    }
    model = {k[len("model/") :]: v for k, v in joined.items() if k.startswith("model/")}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in joined.items():
        if key.startswith("optim/"):
            pkey, _, state_name = key[len("optim/") :].rpartition("/")
            optim.setdefault(pkey, {})[state_name] = value
    return {"model": model, "optimizer": optim, "meta": meta}


def load(
    path: str | os.PathLike,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
) -> dict[str, torch.Tensor] | None:
    """Read a checkpoint into ``model`` (and ``optimizer``) on whatever mesh they live on.

    Collective over the model's mesh (each data-parallel replica reads on its own, at the same
    time; a ``DistributedDataParallel`` model loads into its module). With no model, returns the
    serial ``state_dict`` (see ``read``). Raises ``ValueError`` if there is no checkpoint at
    ``path`` or it has no manifest (a save did not finish) or it does not fit (other keys or
    shapes, another optimizer), and ``RuntimeError`` if a file is missing, truncated or damaged
    (its size or crc32 differs from the manifest's). Files are verified on every rank (each
    checksums a share) and every rank raises the same error. In every case nothing is changed.
    ``verify=False`` skips the manifest: only for a checkpoint written before manifests (optimus2d
    0.1.0).
    """
    if model is None:
        return read(path, verify=verify)["model"]
    model = _unwrap(model)
    entries = _entries(model)
    mesh = _model_mesh(entries)
    group, no_dist = _process_group(mesh)
    path = _files.verified(path, group, no_dist, verify)  # collective; the directory to read
    metadata = _read_metadata(path)
    meta = _read_meta(path, metadata)
    device_mesh = _device_mesh(mesh)

    targets, expected = _model_targets(entries)
    optim_targets = []
    if optimizer is not None:
        if meta["optimizer"] != type(optimizer).__name__:
            raise ValueError(
                f"optimus2d.checkpoint: {os.fspath(path)!r} holds {meta['optimizer'] or 'no'} optimizer state, "
                f"not {type(optimizer).__name__}"
            )
        optim_targets = _optimizer_targets(optimizer, entries, metadata, expected)
    _check_fits(path, metadata, expected)
    state, views = _views_by_key(entries, targets, optim_targets, device_mesh)
    _dcp_load(state, path, group, no_dist)
    _apply_loaded(views, targets, optimizer, optim_targets, meta)
    return None


def _model_targets(entries: list[_Entry]) -> tuple[list, dict[str, tuple[int, ...]]]:
    """Each model tensor with a fresh buffer to read into, and the serial shape of every key it is stored under."""
    targets: list[tuple[torch.Tensor, torch.Tensor, Sharding | None, Mesh | None]] = []  # (dest, buffer, ...)
    expected: dict[str, tuple[int, ...]] = {}
    for e in entries:
        for suffix, part in zip(_suffixes(e.sharding), _parts(e.sharding), strict=True):
            expected[f"model/{e.key}{suffix}"] = part.full_shape if part is not None else tuple(e.tensor.shape)
        targets.append((e.tensor, torch.zeros_like(e.tensor), e.sharding, e.mesh))
    return targets, expected


def _views_by_key(entries: list[_Entry], targets: list, optim_targets: list, device_mesh) -> tuple[dict, list]:
    """DCP's state to load (stored key → a view of a buffer), and each buffer with its views, to write back."""
    state: dict[str, torch.Tensor] = {}
    views: list[tuple[torch.Tensor, list[torch.Tensor], Sharding | None, Mesh | None]] = []
    for e, (_, buffer, sharding, m) in zip(entries, targets, strict=True):
        vs = _stored_views(buffer, sharding, m, device_mesh)
        for suffix, v in zip(_suffixes(sharding), vs, strict=True):
            state[f"model/{e.key}{suffix}"] = v
        views.append((buffer, vs, sharding, m))
    for key, buffer, sharding, m, _ in optim_targets:
        vs = _stored_views(buffer, sharding, m, device_mesh)
        for suffix, v in zip(_suffixes(sharding), vs, strict=True):
            state[f"{key}{suffix}"] = v
        views.append((buffer, vs, sharding, m))
    return state, views


def _apply_loaded(views: list, targets: list, optimizer, optim_targets: list, meta: dict) -> None:
    """Once DCP filled the views: the buffers into the model's blocks, and the optimizer's state."""
    for buffer, vs, sharding, m in views:  # write the views back into the buffers
        _write_back(buffer, vs, sharding, m)
    with torch.no_grad():
        for tensor, buffer, _, _ in targets:
            tensor.copy_(buffer)
    if optimizer is not None:
        _install_optimizer_state(optimizer, optim_targets, meta)


def _optimizer_targets(optimizer, entries, metadata, expected, tied: dict[str, str] | None = None) -> list:
    """What to read into ``optimizer``'s state. ``tied``: the checkpoint's aliases (key → the key
    holding its tensor's state): a copy of a tied table held without its first key (the head on
    the last pipeline stage) reads the state stored under that key."""
    aliases: dict[int, list[_Entry]] = {}
    for e in entries:
        aliases.setdefault(id(e.param), []).append(e)
    targets = []
    for group in optimizer.param_groups:
        on_device = bool(group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            if id(p) not in aliases:
                raise ValueError("optimus2d.checkpoint: the optimizer holds a parameter that is not in the model")
            candidates = [(e, e.key) for e in aliases[id(p)]]
            candidates += [(e, (tied or {})[e.key]) for e in aliases[id(p)] if e.key in (tied or {})]
            stored = [(e, key) for e, key in candidates if any(k.startswith(f"optim/{key}/") for k in metadata)]
            if not stored:
                continue  # no state saved for it (never stepped)
            entry, key = stored[0]
            prefix = f"optim/{key}/"
            names = sorted({k[len(prefix) :].partition("#")[0] for k in metadata if k.startswith(prefix)})
            serial_shape = entry.sharding.full_shape if entry.sharding is not None else tuple(p.shape)
            for name in names:
                split = f"{prefix}{name}#0" in metadata
                first = metadata[f"{prefix}{name}#0"] if split else metadata[f"{prefix}{name}"]
                if split or tuple(first.size) == serial_shape:  # laid out like the parameter: its dtype
                    for suffix, part in zip(_suffixes(entry.sharding), _parts(entry.sharding), strict=True):
                        expected[f"{prefix}{name}{suffix}"] = part.full_shape if part is not None else tuple(p.shape)
                    buffer = torch.zeros(local(p).shape, dtype=p.dtype, device=p.device)
                    targets.append((f"{prefix}{name}", buffer, entry.sharding, entry.mesh, p))
                else:  # a scalar such as Adam's step: on the CPU, as torch keeps it, unless capturable/fused
                    expected[f"{prefix}{name}"] = tuple(first.size)
                    device = p.device if on_device else torch.device("cpu")
                    buffer = torch.zeros(tuple(first.size), dtype=first.properties.dtype, device=device)
                    targets.append((f"{prefix}{name}", buffer, None, None, p))
    return targets


def _check_fits(path, metadata, expected: dict[str, tuple[int, ...]]) -> None:
    stored = {k: tuple(m.size) for k, m in metadata.items() if k.startswith("model/")}
    wanted = {k: v for k, v in expected.items() if k.startswith("model/")}
    missing = sorted(set(wanted) - set(stored))
    unexpected = sorted(set(stored) - set(wanted))
    shapes = sorted(
        f"{k}: checkpoint {stored[k]}, model {wanted[k]}"
        for k in set(stored) & set(wanted)
        if stored[k] != tuple(wanted[k])
    )
    optim_missing = sorted(k for k in expected if k.startswith("optim/") and k not in metadata)
    fused = [k for k in missing if f"{k}#0" in stored]
    if fused:
        raise ValueError(
            f"optimus2d.checkpoint: {os.fspath(path)!r} stores {fused[0]} in parts (a fused q/k/v of a parallel "
            "model) and this model holds it whole: load a serial torch model with "
            "model.load_state_dict(optimus2d.checkpoint.read(path)['model']), or resume training in one process "
            "on optimus2d.parallelize(model, optimus2d.Mesh(1))"
        )
    if missing or unexpected or shapes or optim_missing:
        raise ValueError(
            f"optimus2d.checkpoint: {os.fspath(path)!r} does not fit this model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, shapes {shapes[:5]}, optimizer state missing {optim_missing[:5]}"
        )


def _write_back(buffer: torch.Tensor, views: list[torch.Tensor], sharding: Sharding | None, mesh: Mesh | None) -> None:
    locals_ = [v.to_local() if isinstance(v, DTensor) else v for v in views]
    if sharding is None:
        buffer.copy_(locals_[0])
        return
    pieces = _split_parts(buffer, sharding, None if mesh is None or mesh.size == 1 else mesh)
    for piece, piece_local in zip(pieces, locals_, strict=True):
        piece[tuple(slice(0, n) for n in piece_local.shape)].copy_(
            piece_local.clone()
        )  # piece_local may alias the buffer


def _install_optimizer_state(optimizer, optim_targets, meta) -> None:
    for group in optimizer.param_groups:  # the checkpoint's state replaces all of the old one
        for p in group["params"]:
            optimizer.state.pop(p, None)
    for key, buffer, _, _, param in optim_targets:
        name = key.rpartition("/")[2]
        like_param = isinstance(param, DTensor) and buffer.dim() > 0  # a DTensor's state is one too
        optimizer.state[param][name] = like(param, buffer) if like_param else buffer
    saved_groups = meta.get("param_groups", [])
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=False):
        for k, v in saved.items():
            if k != "params" and k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
