"""The optimizer's state of a converted model in the serial layout, as the model's ``state_dict`` gives it.

A parameter whose blocks are not DTensor's shards of the serial tensor (a padded vocabulary, fused
q/k/v: marked ``_optimus2d_layout`` by ``convert/dtensor_params.py``) has optimizer state shaped
like it, in the stored layout. Before an optimizer's first step (torch's ``get_state_dict`` and
``set_state_dict`` take one on an optimizer without state), one holding such a parameter gets two
hooks: ``state_dict()`` gives that state as the serial tensor's DTensor, and ``load_state_dict``
takes the serial tensor (or any DTensor of it) back to blocks. State loaded before the first step
(into a fresh optimizer, without the hooks) is taken to blocks at that step, before it runs. Every
optimizer holding DTensor parameters gets the load hook: a serial optimizer's state (plain tensors)
of a parameter that is DTensor's shard becomes that DTensor (torch's step cannot mix the two).
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from optimus2d.comm.dtensor import STORED, like, local, placements, serial_dtensor
from optimus2d.comm.sharding import shard

__all__ = ["attach", "not_resharded"]

# Optimizers given the hooks (weakly: an optimizer's life is its own)
_ATTACHED: weakref.WeakSet = weakref.WeakSet()


def not_resharded(key: str, t: DTensor, sharding) -> None:
    """A tensor whose blocks are not DTensor's shards, further sharded by another tool (FSDP over
    the data-parallel dims): its serial layout cannot be read from the shard. Refused, named."""
    if tuple(t.placements) != placements(sharding, tuple(t.device_mesh.mesh_dim_names)):
        raise ValueError(
            f"state_dict: {key} is stored as blocks that are not DTensor's shards of the serial tensor (a padded "
            f"vocabulary or fused parts: {sharding}) and is sharded again by another tool, now {t.placements} on "
            f"{t.device_mesh}; its serial layout cannot be given. Use a vocabulary that divides the mesh, or "
            f"leave that module out of fully_shard"
        )


def attach(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` its hooks now, before a load that puts state in as blocks
    (``checkpoint.load``): its first step then takes that state as it is, not as the serial layout."""
    _attach_to_optimizer(optimizer, (), {})


def _attach_to_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Before an optimizer's first step (DCP's ``get_state_dict`` takes one to make the state): one
    holding a parameter marked ``_optimus2d_layout`` gets state_dict hooks giving that state in the
    serial layout, and taking it back to blocks, as the model's ``state_dict`` does. An optimizer
    that reads a parameter's shape is refused on a padded one (``_refuse_padded``)."""
    _refuse_padded(optimizer)
    if optimizer in _ATTACHED:
        return
    _ATTACHED.add(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(isinstance(p, DTensor) for p in params):
        return  # a plain torch model's: nothing to do
    optimizer.register_state_dict_post_hook(_optimizer_serial_state)
    optimizer.register_load_state_dict_pre_hook(_optimizer_blocks)
    # State before the first step was loaded without these hooks (``load_state_dict`` into a
    # fresh optimizer, the usual resume): it is in the serial layout, as every ``state_dict()``
    # gives it (an optimizer is attached at its first step, before it has state of its own), or
    # a serial optimizer's plain tensors.
    for p in params:
        if p in optimizer.state:
            optimizer.state[p] = {k: _state_to_blocks(p, v) for k, v in optimizer.state[p].items()}


def _state_to_blocks(p: torch.Tensor, v: object) -> object:
    """A state tensor of parameter ``p`` in the serial layout as ``p`` holds its values: blocks in
    the stored layout (``_to_blocks``), or, for a parameter that is DTensor's shard of the serial
    tensor, the serial tensor as that DTensor (a serial optimizer's state: plain tensors, which
    torch's step could not mix with DTensors); anything else as it is."""
    layout = p.__dict__.get("_optimus2d_layout")
    if layout is not None:
        return _to_blocks(p, *layout, v)
    plain = isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0
    if isinstance(p, DTensor) and plain and tuple(v.shape) == tuple(p.shape):
        # every rank holds the same serial tensor: each takes its own shard (src_data_rank=None: no collective)
        return distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    return v


# Optimizers whose step reads a parameter's shape, not only its values (torch.optim.Muon scales its
# step by max(1, rows / cols)): a padded parameter's stored shape is not the serial one
_SHAPE_READING = tuple(c for c in (getattr(torch.optim, "Muon", None),) if c is not None)


def _refuse_padded(optimizer: torch.optim.Optimizer) -> None:
    """Before every step, on every rank alike (the parameters are the same everywhere): an optimizer
    that reads the shape, holding a parameter stored padded (a vocabulary q does not divide), is
    refused, naming the parameters' shapes (its step was 1.2e-3 off serial's after 3 steps)."""
    if not isinstance(optimizer, _SHAPE_READING):
        return
    padded = [
        f"{tuple(p.shape)} (serial {p._optimus2d_layout[0].full_shape})"
        for group in optimizer.param_groups
        for p in group["params"]
        if "_optimus2d_layout" in p.__dict__ and tuple(p.shape) != tuple(p._optimus2d_layout[0].full_shape)
    ]
    if padded:
        raise ValueError(
            f"{type(optimizer).__name__}: {len(padded)} parameter(s) are stored padded, {', '.join(padded)} (a "
            f"vocabulary the mesh's q does not divide), and this optimizer reads a parameter's shape: its step would "
            f"not be serial's. Use a vocabulary divisible by q, or leave these parameters to another optimizer"
        )


def _to_blocks(p: torch.Tensor, sharding, mesh, v: object) -> object:
    """``v``, a state tensor of ``p`` in the serial layout (a DTensor of the serial tensor, or the
    serial tensor: a serial optimizer's), as blocks laid out like ``p``; anything else as it is."""
    if isinstance(v, torch.Tensor) and tuple(v.shape) == sharding.full_shape:
        whole = v.full_tensor() if isinstance(v, DTensor) else v
        return like(p, shard(whole, mesh, sharding).to(local(p)).contiguous())
    return v


def _params_by_key(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """The state dict's keys (ints from state_dict(); DCP's names) → the optimizer's parameters, in
    its order, as torch's own load_state_dict pairs them."""
    keys = [key for group in state["param_groups"] for key in group["params"]]
    return dict(zip(keys, (p for group in optimizer.param_groups for p in group["params"]), strict=False))


def _laid_out(optimizer: torch.optim.Optimizer, state: dict):
    """(key, parameter, its (Sharding, Mesh), its state) for each parameter with ``_optimus2d_layout``."""
    # keyed as the state dict's groups list them (ints from state_dict(); DCP loads by names), in
    # the optimizer's order, as torch's own load_state_dict pairs them
    by_key = _params_by_key(optimizer, state)
    for key, per in state["state"].items():
        layout = by_key[key].__dict__.get("_optimus2d_layout") if key in by_key else None
        if layout is not None:
            yield key, by_key[key], layout, per


def _optimizer_serial_state(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    if STORED.get():
        return state
    for index, p, (sharding, mesh), per in list(_laid_out(optimizer, state)):
        out = {}  # a new dict: the optimizer's own state is left as it is
        for k, v in per.items():
            if isinstance(v, DTensor) and v.shape == p.shape and v.placements == p.placements:
                not_resharded(f"the optimizer's state {k!r} of a parameter", v, sharding)
                v = serial_dtensor(v, sharding, mesh)
            out[k] = v
        state["state"][index] = out
    return state


def _optimizer_blocks(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """Before ``load_state_dict``: the state of every parameter as the parameter holds its values."""
    by_key = _params_by_key(optimizer, state)
    for key, per in list(state["state"].items()):
        if key in by_key:
            state["state"][key] = {k: _state_to_blocks(by_key[key], v) for k, v in per.items()}
    return state


register_optimizer_step_pre_hook(_attach_to_optimizer)
