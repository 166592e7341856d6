"""A pipelined model's checkpoint: every stage writes its blocks into one checkpoint of the whole model.

``save_stages``/``load_stages``: ``optimus2d.checkpoint``'s format, written by every stage at once
(one checkpoint of the whole model: it loads with ``optimus2d.checkpoint.load`` into the whole
model on any one mesh, or ``read`` in one process) and read into each stage (from any checkpoint of
the whole model). ``optimus2d.checkpoint.save`` itself cannot: it takes the stage meshes for
data-parallel replicas, which hold the same blocks, and writes only stage 0's.
"""

from __future__ import annotations

import copy
import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from optimus2d.checkpoint import files as _files
from optimus2d.checkpoint import sharded as _ckpt
from optimus2d.comm import replicas, watch

__all__ = ["load_stages", "save_stages"]


def _state(chunks: list[nn.Module], optimizer) -> tuple[dict, dict, list]:
    """(DCP state of this rank's chunks, their meta, their entries), as ``optimus2d.checkpoint.save``."""
    entries = [e for c in chunks for e in _ckpt._entries(_ckpt._unwrap(c))]
    mesh = _ckpt._model_mesh(entries)
    device_mesh = _ckpt._device_mesh(mesh)
    state: dict[str, object] = {}
    for e in entries:
        views = _ckpt._stored_views(e.tensor.detach(), e.sharding, e.mesh, device_mesh)
        for suffix, view in zip(_ckpt._suffixes(e.sharding), views, strict=True):
            state[f"model/{e.key}{suffix}"] = view
    if optimizer is not None:
        for key, (value, entry) in _ckpt._optimizer_tensors(optimizer, entries).items():
            sharding = entry.sharding if entry is not None else None
            views = _ckpt._stored_views(value.detach(), sharding, entry.mesh if entry else None, device_mesh)
            for suffix, view in zip(_ckpt._suffixes(sharding), views, strict=True):
                state[f"{key}{suffix}"] = view
    meta = _ckpt._meta(optimizer, entries)
    meta["parts_dim"] = {k.partition("#")[0]: dim for k, dim in _ckpt._parts_dims(entries, state).items()}
    return state, meta, entries


def _merged_meta(metas: list[dict]) -> dict:
    """One meta from every rank's: the stages' parameter groups joined group by group."""
    meta = copy.deepcopy(metas[0])
    kinds = {m["optimizer"] for m in metas}
    if len(kinds) > 1:
        raise ValueError(f"save_stages: the stages hold different optimizers: {sorted(map(str, kinds))}")
    for m in metas[1:]:
        meta["parts_dim"].update(m["parts_dim"])
        meta["aliases"].update(m["aliases"])
        for group, other in zip(meta["param_groups"], m["param_groups"], strict=True):
            group["params"] += [p for p in other["params"] if p not in group["params"]]
    return meta


def save_stages(path: str | os.PathLike, chunks: nn.Module | list[nn.Module], optimizer=None, *, pipe=None) -> None:
    """Write every stage's ``chunks`` (this rank's, converted on its stage mesh; a list for several
    stages per rank) and ``optimizer`` as ONE checkpoint of the whole model, in ``optimus2d.checkpoint``'s
    format: it loads with ``optimus2d.checkpoint.load`` into the whole model on any mesh (or ``read``).

    Collective over the world: every rank of every stage calls it. The stages' keys must be disjoint
    (``llama_stages`` keeps the serial names); their optimizers of one class, with the same groups.
    Data-parallel copies (``stage_meshes(dp=)``): pass ``pipe``, this rank's ``StageMesh``; the copies
    of a stage must hold the same keys, and copy 0 writes them. Without it, every stage mesh is a stage.
    """
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    state, meta, entries = _state(chunks, optimizer)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = _ckpt._model_mesh(entries)
    where = mesh.ranks[0] if mesh is not None else (dist.get_rank() if world > 1 else 0)  # the stage mesh
    if world > 1:  # the same directory on every rank, before anything is exchanged or written
        timeout = mesh.timeout if mesh is not None else watch.collective_timeout()
        directory = f"checkpoint.save_stages of the directory {os.path.abspath(path)!r}"
        replicas.agree_world("checkpoint.save_stages", directory, None, timeout)
    mine = (meta, where if pipe is None else pipe.stage, sorted(k for k in state if k.startswith("model/")))
    metas = [mine]
    if world > 1:
        metas = [None] * world
        dist.all_gather_object(metas, mine)
    by_stage: dict[object, set[tuple[str, ...]]] = {}  # a stage's data-parallel copies share its id
    for _, stage, keys in metas:
        by_stage.setdefault(stage, set()).add(tuple(keys))
    differ = [stage for stage, held in by_stage.items() if len(held) > 1]
    if differ:  # on every rank alike, before anything is written
        raise ValueError(f"save_stages: the data-parallel copies of stage {differ[0]} hold different tensors")
    holders: dict[str, set[object]] = {}
    for stage, (keys,) in by_stage.items():
        for k in keys:
            holders.setdefault(k, set()).add(stage)
    shared = sorted(k for k, h in holders.items() if len(h) > 1)
    if shared:
        copies = "" if pipe is not None else "; data-parallel copies: pass pipe="
        held = f"{shared[:5]} are held by more than one stage mesh"
        raise ValueError(f"save_stages: {held} (they would overwrite{copies})")
    if pipe is not None and pipe.dp_rank != 0:  # copy 0 of this stage writes these blocks
        state = {}
    state["meta"] = torch.tensor(list(json.dumps(_merged_meta([m for m, _, _ in metas])).encode()), dtype=torch.uint8)
    no_dist = world == 1

    def write(directory: str) -> int:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.save(state, checkpoint_id=directory, process_group=None, no_dist=no_dist)
        return 0 if no_dist else dist.get_rank()

    _files.save_atomically(path, write, None, no_dist)


def load_stages(path: str | os.PathLike, chunks: nn.Module | list[nn.Module], optimizer=None) -> None:
    """Read a checkpoint of the whole model (``save_stages``, or ``optimus2d.checkpoint.save`` on any
    one mesh) into this rank's stage ``chunks`` (and ``optimizer``): each stage reads its own keys.

    Collective over the world. Raises ``ValueError`` on every rank, before anything changes, if a
    stage's key is missing from the checkpoint or has another shape, or if the stages together do not
    hold every key of the checkpoint.
    """
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    entries = [e for c in chunks for e in _ckpt._entries(_ckpt._unwrap(c))]
    mesh = _ckpt._model_mesh(entries)
    group, no_dist = _ckpt._process_group(mesh)
    path = _files.verified(path, group, no_dist, True)
    metadata = _ckpt._read_metadata(path)
    meta = _ckpt._read_meta(path, metadata)
    device_mesh = _ckpt._device_mesh(mesh)
    targets, expected = [], {}
    for e in entries:
        for suffix, part in zip(_ckpt._suffixes(e.sharding), _ckpt._parts(e.sharding), strict=True):
            expected[f"model/{e.key}{suffix}"] = part.full_shape if part is not None else tuple(e.tensor.shape)
        targets.append((e.tensor, torch.zeros_like(e.tensor), e.sharding, e.mesh))
    optim_targets, problem = [], None
    stored = {k for k in metadata if k.startswith("model/")}
    mine = {k for k in expected if k.startswith("model/")}
    try:  # this stage's keys and shapes; the verdicts are shared below, so every rank raises alike
        if optimizer is not None:
            if meta["optimizer"] != type(optimizer).__name__:
                raise ValueError(
                    f"load_stages: {os.fspath(path)!r} holds {meta['optimizer']} state, not {type(optimizer).__name__}"
                )
            optim_targets = _ckpt._optimizer_targets(optimizer, entries, metadata, expected, meta.get("aliases"))
        _ckpt._check_fits(
            path, {k: v for k, v in metadata.items() if k in mine or not k.startswith("model/")}, expected
        )
    except ValueError as err:
        problem = str(err)
    everyone = [(mine, problem)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, problem))
    for _, theirs in everyone:
        if theirs is not None:
            raise ValueError(theirs)
    missing = sorted(stored - set().union(*(keys for keys, _ in everyone)))
    if missing:
        raise ValueError(f"load_stages: no stage holds {missing[:5]} of {os.fspath(path)!r}")
    state, views = {}, []
    for e, (_, buffer, sharding, m) in zip(entries, targets, strict=True):
        vs = _ckpt._stored_views(buffer, sharding, m, device_mesh)
        for suffix, v in zip(_ckpt._suffixes(sharding), vs, strict=True):
            state[f"model/{e.key}{suffix}"] = v
        views.append((buffer, vs, sharding, m))
    for key, buffer, sharding, m, _ in optim_targets:
        vs = _ckpt._stored_views(buffer, sharding, m, device_mesh)
        for suffix, v in zip(_ckpt._suffixes(sharding), vs, strict=True):
            state[f"{key}{suffix}"] = v
        views.append((buffer, vs, sharding, m))
    _ckpt._dcp_load(state, path, group, no_dist)
    for buffer, vs, sharding, m in views:
        _ckpt._write_back(buffer, vs, sharding, m)
    with torch.no_grad():
        for tensor, buffer, _, _ in targets:
            tensor.copy_(buffer)
    if optimizer is not None:
        _ckpt._install_optimizer_state(optimizer, optim_targets, meta)
