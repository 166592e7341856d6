"""A model's and its optimizer's state as torch's ``get_state_dict`` lays it out, for DCP to store.

The keys ``dcp.save({"model": msd, "optim": osd})`` writes for ``msd, osd = get_state_dict(model, optim)``::

    model.<serial key>                        the serial tensor: a DTensor of this rank's block
    optim.state.<serial key>.<state name>     optimizer state (exp_avg, step, ...), laid out as its parameter
    optim.param_groups.<n>.<setting>          each group's settings; "params": the serial keys
    optimus2d.format, optimus2d.optimizer     what wrote it (absent from a checkpoint DCP wrote alone)

so a checkpoint of ``optimus2d.checkpoint.save`` loads with DCP's ``load`` and ``set_state_dict``, and
one DCP wrote that way loads with ``optimus2d.checkpoint.load``. A DTensor parameter gives its state
through its own ``state_dict`` (``convert/dtensor_params.py``: the serial tensor's DTensor). A model
that keeps plain blocks (a mesh over some ranks only, data-parallel replicas, pipeline stages, one
rank) gives the same: each block as a view of the serial tensor's DTensor on a ``DeviceMesh`` built
without process groups (only DCP's planner reads it), fused q/k/v gathered over the mesh first.

This module does not touch the optimizer's private structures beyond what ``get_state_dict`` does,
and unlike ``get_state_dict`` it does not step an optimizer that has no state yet (torch does so with
zero gradients and lr 0, which counts a step in Adam's bias correction).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from optimus2d.checkpoint.serial import _owners
from optimus2d.comm.dtensor import is_canonical, local, placements, serial_dtensor, stored_state_dict
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding, block_slices, shard
from optimus2d.layers.base import sharding_of

FORMAT = 3


@dataclass
class Held:
    """One key of the model's state dict on this rank."""

    key: str  # serial state_dict key
    tensor: torch.Tensor  # the parameter or buffer (a DTensor, or a plain block)
    sharding: Sharding | None  # None: replicated (plain torch)
    mesh: Mesh | None

    @property
    def shape(self) -> tuple[int, ...]:
        """The serial tensor's shape."""
        return self.sharding.full_shape if self.sharding is not None else tuple(self.tensor.shape)

    @property
    def block(self) -> torch.Tensor:
        """This rank's block as stored (padding included), outside autograd."""
        return local(self.tensor)


def modules(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The modules whose state is saved: a ``DistributedDataParallel`` or ``torch.compile`` wrapper's
    own module (its keys without "module." or "_orig_mod."); a list of pipeline chunks as they are."""
    out = []
    for m in model if isinstance(model, (list, tuple)) else [model]:
        while isinstance(m, nn.parallel.DistributedDataParallel) or hasattr(m, "_orig_mod"):
            m = m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m._orig_mod
        out.append(m)
    return out


def held(mods: list[nn.Module]) -> list[Held]:
    """Every key of the modules' state dicts, in order; ``TypeError`` for a module's extra state."""
    out = []
    for module in mods:
        owners = _owners(module)
        with stored_state_dict():
            state = module.state_dict(keep_vars=True)
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"optimus2d.checkpoint: {key} is not a tensor (a module's extra state); it would not be resharded"
                )
            owner, name = owners[key]
            sharding, mesh = sharding_of(owner, name)
            if sharding is None and getattr(value, "_optimus2d_owner", None) is not None:  # a tied block
                sharding, mesh = sharding_of(*value._optimus2d_owner)
            out.append(Held(key, value, sharding, mesh))
    return out


def model_mesh(entries: list[Held]) -> Mesh | None:
    meshes = {id(e.mesh): e.mesh for e in entries if e.mesh is not None}
    if len(meshes) > 1:
        raise ValueError("optimus2d.checkpoint: the model's modules live on more than one Mesh")
    return next(iter(meshes.values()), None)


def device_mesh(mesh: Mesh | None) -> DeviceMesh | None:
    """A DeviceMesh of ``mesh``'s ranks with dims named as ``Mesh.device_mesh``'s, and no process
    groups: what DCP's planner reads from a plain block's view (creating one sends nothing)."""
    if mesh is None or mesh.size == 1:
        return None
    ranks = torch.tensor(mesh.ranks).view(mesh.depth, mesh.q, mesh.q)
    return DeviceMesh(mesh.device.type, ranks, mesh_dim_names=("depth", "row", "col"), _init_backend=False)


def _simple(sharding: Sharding, mesh: Mesh) -> bool:
    """Whether each rank's block, padding aside, is the DTensor chunk of the serial tensor
    (``serial_dtensor`` then takes a view, nothing sent): no fused parts, one axis per dim."""
    return not sharding.parts and all(sum(mesh.axis_size(a) > 1 for a in axes) <= 1 for axes in sharding.dims)


def serial(value: torch.Tensor, e: Held, dm: DeviceMesh | None) -> torch.Tensor:
    """The serial tensor of ``value`` (``e``'s tensor as stored, or optimizer state laid out like
    it), as DCP stores it: a DTensor whose blocks are DTensor's shards is that already (FSDP2's
    further sharding included); one padded or fused gets ``serial_dtensor`` (gathered for fused
    parts); a plain block on one rank is the serial tensor (padding cut), on several a DTensor view
    on ``dm`` (gathered first only for fused parts or two axes on one dim)."""
    if e.sharding is None or (isinstance(value, DTensor) and is_canonical(e.sharding, e.mesh)):
        return value
    if isinstance(value, DTensor):
        if tuple(value.placements) != placements(e.sharding, tuple(value.device_mesh.mesh_dim_names)):
            raise ValueError(
                f"optimus2d.checkpoint: {e.key} is stored as blocks that are not DTensor's shards of the serial "
                f"tensor ({e.sharding}) and is sharded again by another tool, now {value.placements}: its serial "
                "layout cannot be written"
            )
        return serial_dtensor(value, e.sharding, e.mesh)
    if e.mesh.size == 1:
        return value[tuple(slice(0, n) for n in e.sharding.full_shape)]
    return serial_dtensor(value.detach(), e.sharding, e.mesh, device_mesh=dm)


def to_save(entries: list[Held], optimizer, dm: DeviceMesh | None) -> dict:
    """``{"model": ..., "optim": ...}`` of this rank, as DCP stores it (see the module docstring)."""
    model = {e.key: serial(e.tensor.detach(), e, dm) for e in entries}
    state: dict[str, object] = {"model": model, "optimus2d": {"format": FORMAT}}
    if optimizer is not None:
        state["optim"] = optimizer_state(entries, optimizer, dm)
        state["optimus2d"]["optimizer"] = type(optimizer).__name__
    aliases = {e.key: first.key for e in entries if (first := first_keys(entries)[id(e.tensor)]) is not e}
    state["optimus2d"]["aliases"] = json.dumps(aliases)  # a tied key → the key holding its optimizer state
    return state


def first_keys(entries: list[Held]) -> dict[int, Held]:
    """A tensor under several keys (a tied head) keeps its optimizer state under its first key."""
    out: dict[int, Held] = {}
    for e in entries:
        out.setdefault(id(e.tensor), e)
    return out


def optimizer_state(entries: list[Held], optimizer, dm: DeviceMesh | None) -> dict:
    """``get_state_dict``'s optimizer state: ``{"state": {key: {name: tensor}}, "param_groups": [...]}``."""
    by_param = first_keys(entries)
    with stored_state_dict():  # each state tensor as the optimizer holds it: laid out here, by ``serial``
        flat = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in flat["param_groups"] for i in group["params"]]
    key_of = {}
    for i, p in zip(ids, params, strict=True):
        if id(p) not in by_param:
            raise ValueError("optimus2d.checkpoint: the optimizer holds a parameter that is not in the model")
        key_of[i] = by_param[id(p)]
    out: dict[str, dict] = {}
    for i, per in flat["state"].items():
        e, p = key_of[i], params[ids.index(i)]
        out[e.key] = {}
        for name, value in per.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimus2d.checkpoint: optimizer state {name!r} of {e.key} is not a tensor")
            like_param = value.dim() > 0 and value.shape == p.shape
            if value.dim() > 0 and not like_param and e.sharding is not None:
                raise TypeError(
                    f"optimus2d.checkpoint: optimizer state {name!r} of {e.key} has shape {tuple(value.shape)}, "
                    f"neither the parameter's {tuple(p.shape)} nor a scalar: it cannot be resharded"
                )
            out[e.key][name] = serial(value, e, dm) if like_param else value
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [key_of[i].key for i in g["params"]]}
        for g in flat["param_groups"]
    ]
    return {"state": out, "param_groups": groups}


# ---- load ----------------------------------------------------------------------------------------
def target(e: Held, like: torch.Tensor, dm: DeviceMesh | None, dtype=None) -> torch.Tensor:
    """A fresh tensor for DCP to read the serial tensor of ``e`` into (``like``: the block, or the
    parameter's state): a DTensor like the parameter where its blocks are DTensor's shards, a view of
    a fresh block where they are that but padded, else (fused parts, two axes on a dim) the whole
    serial tensor on every rank."""
    dtype = dtype or like.dtype
    if e.sharding is None or (isinstance(e.tensor, DTensor) and is_canonical(e.sharding, e.mesh)):
        if isinstance(e.tensor, DTensor):
            return torch.empty_like(e.tensor, dtype=dtype)
        return torch.empty(local(like).shape, dtype=dtype, device=local(like).device)
    block = torch.zeros(local(like).shape, dtype=dtype, device=local(like).device)
    if e.mesh.size > 1 and _simple(e.sharding, e.mesh):
        where = e.tensor.device_mesh if isinstance(e.tensor, DTensor) else dm
        return serial_dtensor(block, e.sharding, e.mesh, device_mesh=where)
    return torch.zeros(e.sharding.full_shape, dtype=dtype, device=block.device)


def to_block(e: Held, loaded: torch.Tensor) -> torch.Tensor:
    """This rank's block (padding zero) of what DCP read into ``target(e, ...)``."""
    if isinstance(loaded, DTensor) and (e.sharding is None or is_canonical(e.sharding, e.mesh)):
        return loaded.to_local()
    if not isinstance(loaded, DTensor):
        return shard(loaded, e.mesh, e.sharding) if e.sharding is not None and e.mesh is not None else loaded
    block = torch.zeros(e.sharding.local_shape(e.mesh), dtype=loaded.dtype, device=loaded.device)
    ((_, valid),) = block_slices(e.sharding, e.mesh)
    block[valid] = loaded.to_local()
    return block
