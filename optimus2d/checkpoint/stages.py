"""A pipelined model's checkpoint: every stage writes its blocks into one checkpoint of the whole model.

``save_stages``/``load_stages``: ``optimus2d.checkpoint``'s format, written by every stage at once
(one checkpoint of the whole model: it loads with ``optimus2d.checkpoint.load`` into the whole
model on any one mesh, ``read`` in one process, or DCP's own ``load``) and read into each stage
(from any checkpoint of the whole model). ``optimus2d.checkpoint.save`` itself cannot: it takes the stage meshes for
data-parallel replicas, which hold the same blocks, and writes only stage 0's.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from optimus2d.checkpoint import files as _files
from optimus2d.checkpoint import reading, torch_state
from optimus2d.checkpoint.integrity import describe_optimizer
from optimus2d.checkpoint.sharded import _gathered, dcp_load, read_metadata, wait_for_async_save
from optimus2d.comm import replicas, watch

__all__ = ["load_stages", "save_stages"]


def _merged(objects: list[dict]) -> dict:
    """Every rank's settings (optimizer class, parameter groups, tied keys) as one: the stages'
    parameter groups joined group by group."""
    held = [o for o in objects if o["optimizer"] is not None]  # a frozen stage may have none
    kinds = {o["optimizer"] for o in held}
    if len(kinds) > 1:
        raise ValueError(f"save_stages: the stages hold different optimizers: {sorted(map(str, kinds))}")
    groups = [dict(g) for g in held[0]["param_groups"]] if held else []
    settings = lambda g: {k: v for k, v in g.items() if k != "params"}  # noqa: E731
    for o in held:  # one group of the whole model: every stage's n-th, with the same settings
        theirs = o["param_groups"]
        if len(theirs) != len(groups) or any(settings(a) != settings(b) for a, b in zip(groups, theirs, strict=False)):
            raise ValueError(
                f"save_stages: the stages' optimizers have different parameter groups ({len(groups)} with "
                f"{[settings(g) for g in groups]}; {len(theirs)} with {[settings(g) for g in theirs]}): one checkpoint "
                f"holds one optimizer, whose n-th group joins every stage's n-th"
            )
        for group, other in zip(groups, theirs, strict=True):
            group["params"] = group["params"] + [p for p in other["params"] if p not in group["params"]]
    aliases: dict[str, str] = {}
    for o in objects:
        aliases.update(json.loads(o["aliases"]))
    return {"optimizer": held[0]["optimizer"] if held else None, "param_groups": groups, "aliases": json.dumps(aliases)}


def save_stages(path: str | os.PathLike, chunks: nn.Module | list[nn.Module], optimizer=None, *, pipe=None) -> None:
    """Write every stage's ``chunks`` (this rank's, converted on its stage mesh; a list for several
    stages per rank) and ``optimizer`` as ONE checkpoint of the whole model, in ``optimus2d.checkpoint``'s
    format: it loads with ``optimus2d.checkpoint.load`` into the whole model on any mesh (or ``read``).

    Collective over the world: every rank of every stage calls it. The stages' keys must be disjoint
    (``llama_stages`` keeps the serial names); their optimizers of one class, with the same groups.
    Data-parallel copies (``stage_meshes(dp=)``): pass ``pipe``, this rank's ``StageMesh``; the copies
    of a stage must hold the same keys, and copy 0 writes them. Without it, every stage mesh is a stage.
    """
    mods = torch_state.modules(list(chunks) if isinstance(chunks, (list, tuple)) else [chunks])
    error, entries, mesh, state = None, [], None, None
    try:  # a stage's refusal (extra state, an optimizer state that cannot be laid out) is every rank's
        entries = torch_state.held(mods)
        mesh = torch_state.model_mesh(entries)
        wait_for_async_save(mesh)
        state = torch_state.to_save(entries, optimizer, torch_state.device_mesh(mesh))
    except (TypeError, ValueError) as err:
        error = err
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups = (None, None)
    if world > 1:  # the same directory on every rank, before anything is exchanged or written
        timeout = mesh.timeout if mesh is not None else watch.collective_timeout()
        directory = f"checkpoint.save_stages of the directory {os.path.abspath(path)!r}"
        replicas.agree_world("checkpoint.save_stages", directory, error, timeout)
        groups = _own_groups(timeout)
    elif error is not None:
        raise error
    try:
        _save_stages(path, state, mesh, pipe, world, *groups)
    except BaseException:  # every rank raises (the commit shares a rank's failure): a group that
        _groups.clear()  # timed out may be broken, so the next save creates new ones, everywhere
        raise


_groups: dict = {}  # save_stages's own gloo groups over the world (``_own_groups``)


def _own_groups(timeout: float) -> tuple:
    """DCP's write and the commit on gloo groups of their own over the world, as ``checkpoint.save``'s
    (``sharded._Ranks.own_groups``): created at the first ``save_stages`` (collective over the world,
    as it is), DCP's waiting ``timeout``, the commit's three times that, so a rank that fails before
    DCP's first collective waits in the commit while the others' DCP collectives time out, and every
    rank raises; never the default group, whose operations a failure would leave broken."""
    if not _groups:
        _groups["commit"] = dist.new_group(timeout=timedelta(seconds=3 * timeout), backend="gloo")
        _groups["dcp"] = dist.new_group(timeout=timedelta(seconds=timeout), backend="gloo")
    return _groups["dcp"], _groups["commit"]


def _save_stages(path, state: dict, mesh, pipe, world: int, dcp_group, commit_group) -> None:
    where = mesh.ranks[0] if mesh is not None else (dist.get_rank() if world > 1 else 0)  # the stage mesh
    optim = state.get("optim", {"param_groups": []})
    objects = {"optimizer": state["optimus2d"].get("optimizer"), "param_groups": optim["param_groups"]}
    objects["aliases"] = state["optimus2d"]["aliases"]
    mine = (objects, where if pipe is None else pipe.stage, sorted(state["model"]))
    metas = [mine]
    if world > 1:
        metas = [None] * world
        dist.all_gather_object(metas, mine, group=dcp_group)
    by_stage: dict[object, set[tuple[str, ...]]] = {}  # a stage's data-parallel copies share its id
    for _, stage, keys in metas:
        by_stage.setdefault(stage, set()).add(tuple(keys))
    differ = [stage for stage, held in by_stage.items() if len(held) > 1]
    if differ:  # on every rank alike, before anything is written
        raise ValueError(f"save_stages: the data-parallel copies of stage {differ[0]} hold different tensors")
    given: dict[object, set[bool]] = {}  # one rank's None: its blocks' optimizer state not written
    for objects, stage, _ in metas:
        given.setdefault(stage, set()).add(objects["optimizer"] is None)
    unlike = [stage for stage, kinds in given.items() if len(kinds) > 1]
    if unlike:
        raise ValueError(f"save_stages: some ranks of stage {unlike[0]} pass an optimizer and others None")
    holders: dict[str, set[object]] = {}
    for stage, (keys,) in by_stage.items():
        for k in keys:
            holders.setdefault(k, set()).add(stage)
    shared = sorted(k for k, h in holders.items() if len(h) > 1)
    if shared:
        copies = "" if pipe is not None else "; data-parallel copies: pass pipe="
        held = f"{[f'model.{k}' for k in shared[:5]]} are held by more than one stage mesh"
        raise ValueError(f"save_stages: {held} (they would overwrite{copies})")
    merged = _merged([m for m, _, _ in metas])  # the same on every rank: DCP writes it once
    if pipe is not None and pipe.dp_rank != 0:  # copy 0 of this stage writes these blocks
        state = {"model": {}, "optim": {"state": {}}}
    state["optimus2d"] = {"format": torch_state.FORMAT, "aliases": merged["aliases"]}
    if merged["optimizer"] is not None:  # on every rank alike, a frozen stage's without an optimizer too
        state["optimus2d"]["optimizer"] = merged["optimizer"]
        state.setdefault("optim", {"state": {}})["param_groups"] = merged["param_groups"]
    no_dist = world == 1

    def write(directory: str) -> int:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.save(state, checkpoint_id=directory, process_group=dcp_group, no_dist=no_dist)
        return 0 if no_dist else dist.get_rank(dcp_group)

    _files.save_atomically(path, write, commit_group, no_dist)


def load_stages(path: str | os.PathLike, chunks: nn.Module | list[nn.Module], optimizer=None) -> None:
    """Read a checkpoint of the whole model (``save_stages``, or ``optimus2d.checkpoint.save`` on any
    one mesh) into this rank's stage ``chunks`` (and ``optimizer``): each stage reads its own keys.

    Collective over the world. Raises ``ValueError`` on every rank, before anything changes, if a
    stage's key is missing from the checkpoint or has another shape, or if the stages together do not
    hold every key of the checkpoint.
    """
    mods = torch_state.modules(list(chunks) if isinstance(chunks, (list, tuple)) else [chunks])
    entries, mesh, problem = [], None, None
    try:  # a stage's extra state: every rank's refusal, shared below
        entries = torch_state.held(mods)
        mesh = torch_state.model_mesh(entries)
    except (TypeError, ValueError) as err:
        problem = f"{type(err).__name__}: {err}"
    wait_for_async_save(mesh)
    group, no_dist = (mesh.group("mesh"), False) if mesh is not None and mesh.size > 1 else (None, True)
    path = _files.verified(path, group, no_dist, True)
    metadata = read_metadata(path)
    fmt = reading.scheme(path, metadata, dcp_load)
    mine, plan = set(), None
    try:  # this stage's keys and shapes; the verdicts are shared below, so every rank raises alike
        if problem is None:
            plan = reading.Reading(
                path, metadata, fmt, entries, optimizer, torch_state.device_mesh(mesh), only_mine=True
            )
            mine = {fmt.model_key(e.key) for e in entries}
            plan.check_fits()
    except (TypeError, ValueError) as err:
        problem = str(err).replace("optimus2d.checkpoint: ", "load_stages: ", 1)
    stage = tuple(mesh.ranks) if mesh is not None else None
    entry = (mine, problem, stage, describe_optimizer(optimizer))
    everyone = [entry]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, entry)
    for _, theirs, _, _ in everyone:
        if theirs is not None:
            raise ValueError(theirs)
    by_stage: dict[object, set[str]] = {}  # one rank's None left its blocks' state fresh: the copies parted
    for _, _, ranks, given in everyone:
        by_stage.setdefault(ranks, set()).add(given)
    for ranks, given in by_stage.items():
        if ranks is not None and len(given) > 1:
            raise ValueError(f"load_stages: the ranks {list(ranks)} of one stage pass {sorted(given)}, not one alike")
    missing = sorted(set(fmt.model_keys(metadata)) - set().union(*(keys for keys, _, _, _ in everyone)))
    if missing:
        raise ValueError(f"load_stages: no stage holds {missing[:5]} of {os.fspath(path)!r}")
    dcp_load(plan.state, path, group, no_dist)
    plan.apply(None if no_dist else functools.partial(_gathered, group=group))  # within the stage
