"""Parameters as DTensors: what ``parallelize`` hands to torch's own tools.

Every parameter of a converted model (and every buffer that is a block) becomes a DTensor on its
mesh's ``DeviceMesh``, its local tensor the block the layer stores (``comm/dtensor.py`` has the
placements): ``torch.nn.utils.clip_grad_norm_``, optimizers (``foreach``, ``fused``), an EMA, weight
decay by shape, FSDP over replicas and ``torch.distributed.checkpoint`` see the serial tensors, not
one rank's blocks. A plain parameter (a norm's weight run on blocks) is ``Replicate`` everywhere.

The layers keep computing on blocks: while a module runs, its own DTensors are shadowed by their
local tensors, put in the module's ``__dict__`` by a forward pre-hook and taken away after the
forward, even one that raises. A parameter's local tensor is itself a leaf of autograd: C++
accumulates its gradient, and a hook hands that to the parameter as a DTensor of its placements
(``_leaf``). A gradient hook a block had (its sum over a row, say) runs on the block's gradient.

``state_dict()`` gives each tensor as the serial tensor's DTensor: the parameter's where its
blocks are DTensor's shards (``is_canonical``), else (a padded vocabulary, fused q/k/v) a copy laid
out as DTensor lays out its placements, gathered over the mesh (``keep_vars=True`` keeps the tensors
themselves, as torch does: they are the model's). ``load_state_dict`` takes any of
these, a DTensor of another layout (DCP's load onto another mesh) or the serial tensor itself, and
gives every rank its block. An optimizer's state of those tensors: ``convert/dtensor_optimizer.py``.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from optimus2d.comm.dtensor import (
    IN_GRAPH,
    STORED,
    as_dtensor,
    is_canonical,
    like,
    local,
    on_local_grad,
    serial_dtensor,
)
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.replicas import flatten_for_norms
from optimus2d.comm.sharding import shard
from optimus2d.convert.dtensor_optimizer import not_resharded
from optimus2d.layers.base import sharding_of
from optimus2d.megatron.region import runs_split

__all__ = ["distribute_parameters"]


def distribute_parameters(model: nn.Module, mesh: Mesh, whole: DeviceMesh | None = None) -> nn.Module:
    """Make every parameter of ``model`` and every buffer that is a block a DTensor, in place
    (a tied parameter once, shared as before). A tensor marked with its mesh goes on that mesh's
    DeviceMesh, an unmarked parameter on ``mesh``'s, replicated. Nothing is sent but the DeviceMesh's
    creation (collective over the world, once per mesh). Nothing changes without torch.distributed
    (one process), nor on meshes that are not the whole world (``_whole_world``).

    ``whole``: the DeviceMesh ``parallelize`` was given when it has data-parallel dims beside
    ``mesh``'s ("depth", "row", "col" of every replica): every tensor goes on it, ``Replicate`` over
    those dims, as torch's ``fully_shard(..., dp_mesh_dims=)`` takes them (every tensor is on
    ``mesh``: ``parallelize`` checked)."""
    if not (dist.is_available() and dist.is_initialized()):
        return model
    if whole is None and not _whole_world(model, mesh):
        return model
    if whole is not None:
        flatten_for_norms(whole)
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if runs_split(module):  # torch's parallelize_module made its DTensors, and its forward takes them
            continue
        changed = False
        for name, t in list(module._parameters.items()):
            if t is None:
                continue
            if not isinstance(t, DTensor):
                if id(t) not in made:
                    made[id(t)] = _distributed(module, name, t, mesh, whole)
                module._parameters[name] = made[id(t)]
                module.__dict__.setdefault("_optimus2d_marks", {})[name] = _marks(made[id(t)])
            changed = True
        for name, t in list(module._buffers.items()):
            if t is not None and not isinstance(t, DTensor) and sharding_of(module, name)[0] is not None:
                if id(t) not in made:
                    made[id(t)] = _distributed(module, name, t, mesh, whole)
                module._buffers[name] = made[id(t)]
                changed = True
        if changed and not module.__dict__.get("_optimus2d_dtensors"):
            module.__dict__["_optimus2d_dtensors"] = True
            module.register_forward_pre_hook(_expose, prepend=True)
            module.register_forward_hook(_hide, always_call=True)
            module.register_state_dict_post_hook(_serial_state)
            module.register_load_state_dict_pre_hook(_blocks_from_state)
    return model


def _whole_world(model: nn.Module, mesh: Mesh) -> bool:
    """Whether every mesh of the model is the whole world, split over more than one rank: creating a
    DeviceMesh is collective over the world, so a mesh over some ranks only (the others idle) keeps
    plain blocks; so do a mesh of one rank, whose blocks are the serial tensors, and data-parallel
    replicas and pipeline stages (meshes of which each rank builds its own), whose gradients
    ``DistributedDataParallel(process_group=)`` and the stages average on plain tensors."""
    meshes = {id(mesh): mesh}
    for t in (*model.parameters(), *model.buffers()):
        if getattr(t, "_optimus2d_mesh", None) is not None:
            meshes[id(t._optimus2d_mesh)] = t._optimus2d_mesh
    world = dist.get_world_size()
    whole = all(len(m.replicas) == 1 and len(m.replicas[0]) == world for m in meshes.values())
    return whole and any(m.size > 1 for m in meshes.values())


def _distributed(module: nn.Module, name: str, t: torch.Tensor, mesh: Mesh, whole) -> torch.Tensor:
    sharding, own_mesh = _where(module, name, t)  # a tied block: its owner's
    on = own_mesh or getattr(t, "_optimus2d_mesh", None) or mesh
    d = as_dtensor(t.detach(), sharding, on, whole)
    if not isinstance(t, nn.Parameter):
        return d
    new = nn.Parameter(d, requires_grad=t.requires_grad)
    # the detach inside Parameter() goes through DTensor's cache of sharding specs, which may give an
    # equal DeviceMesh of an earlier model: FSDP2 wants the very object it is given (dp_mesh_dims)
    new._spec = d._spec
    for key, value in vars(t).items():
        setattr(new, key, value)
    new._optimus2d_grad_hooks = [on_local_grad(h) for h in (t._backward_hooks or {}).values()]
    if sharding is not None and not is_canonical(sharding, on):
        new._optimus2d_layout = (sharding, on)
    _mark(new, {})
    return new


def _marks(p: torch.Tensor) -> dict:
    """What a parameter carries beyond its values: its optimus2d attributes and gradient hooks."""
    own = ("_optimus2d_leaf", "_optimus2d_owner_box")  # this tensor's own: made again for new contents
    return {k: v for k, v in vars(p).items() if k.startswith("_optimus2d_") and k not in own}


def _block(t: DTensor) -> torch.Tensor:
    """What a forward computes with in place of the DTensor ``t``: its local tensor itself. A
    parameter's is a leaf of autograd (``_leaf``) whose gradient, once accumulated, is added to
    ``t.grad`` as a DTensor of ``t``'s placements; a buffer's is the block. ``to_local()`` instead
    (the parameter itself in the graph, its gradient through DTensor's autograd) under
    ``torch.compile``, within ``parameters_in_graph()``, for a parameter carrying gradient hooks of
    its own (a user's), and for a tensor put in by ``torch.func.functional_call`` (not a leaf)."""
    if not isinstance(t, nn.Parameter) or t.grad_fn is not None:  # a buffer; torch.func's functional_call
        return t.to_local() if t.requires_grad else t._local_tensor
    if torch.compiler.is_compiling() or IN_GRAPH.get() or _hooked_by_user(t):
        return t.to_local()
    block = t._local_tensor
    leaf = t.__dict__.get("_optimus2d_leaf")
    if leaf is None or leaf() is not block:  # new contents (.to(), assign=True, FSDP's, a copy's)
        _leaf(t)
    if block.requires_grad != t.requires_grad:  # frozen, or unfrozen, since
        block.requires_grad_(t.requires_grad)
    return block


def _hooked_by_user(t: DTensor) -> bool:
    """Whether gradient hooks other than optimus2d's own were put on the parameter itself (before
    the forward: one put on between forward and backward is not seen): they run only if the
    parameter is in the graph (``to_local()``)."""
    if getattr(t, "_post_accumulate_grad_hooks", None):
        return True
    return len(t._backward_hooks or ()) > len(t.__dict__.get("_optimus2d_grad_hooks", ()))


class _Owner:
    """What a leaf's hook reaches its parameter through: a weak reference to the parameter itself
    would make ``torch.utils.swap_tensors`` (``.to()``, ``.double()``) refuse it."""

    __slots__ = ("__weakref__", "p")

    def __init__(self, p):
        self.p = p


def _leaf(p: DTensor) -> None:
    """Make ``p``'s local tensor the leaf its gradient reaches: C++ accumulates into its ``.grad``,
    a hook then moves that to ``p.grad`` (no autograd Function per parameter and call, no DTensor
    operation on the gradient); the block's own gradient hooks (its sum over a row, say) run first."""
    block = p._local_tensor
    block.grad = None
    block._backward_hooks = None
    block.requires_grad_(True)
    for hook in p.__dict__.get("_optimus2d_grad_hooks", ()):
        block.register_hook(hook._optimus2d_local_hook)
    owner = _Owner(p)
    p._optimus2d_owner_box = owner  # p -> owner -> p: a cycle of Python objects the collector frees
    block.register_post_accumulate_grad_hook(functools.partial(_grad_to_param, weakref.ref(owner)))
    block.requires_grad_(p.requires_grad)
    p._optimus2d_leaf = weakref.ref(block)


def _grad_to_param(ref: weakref.ref, block: torch.Tensor) -> None:
    grad, block.grad = block.grad, None
    owner = ref()
    p = owner.p if owner is not None else None
    if p is None or grad is None or not p.requires_grad:  # frozen since the forward: no gradient, as torch
        return
    if p.grad is None:
        p.grad = DTensor(grad, p._spec, requires_grad=False)
    else:
        local(p.grad).add_(grad)


def _mark(p: torch.Tensor, marks: dict) -> None:
    """Give ``p`` ``marks`` and register its gradient hooks. ``nn.Module._apply`` (``.to()``,
    ``.double()``) swaps a DTensor parameter's contents with ``torch.utils.swap_tensors``, which
    drops its attributes and leaves its hooks unfired, and ``load_state_dict(assign=True)`` puts in
    another tensor: the module's record gives them back at its next forward (``_expose``)."""
    for key, value in marks.items():
        setattr(p, key, value)
    hooks = p.__dict__.get("_optimus2d_grad_hooks", ())
    if hooks:
        p._backward_hooks = None  # a swapped tensor's hook dict is no longer the one autograd reads
        wanted = p.requires_grad
        p.requires_grad_(True)
        for hook in hooks:
            p.register_hook(hook)
        p.requires_grad_(wanted)
    p._optimus2d_marked = True


def _expose(module: nn.Module, args) -> None:
    """Shadow the DTensors of ``module`` and of its children by their local tensors, in each one's
    ``__dict__`` (a forward may read a child's parameter: CLIP's embeddings interpolate their
    position table's); what another call shows already is left."""
    shown = []
    for m in (module, *module.children()):
        if not m.__dict__.get("_optimus2d_dtensors"):
            continue
        names = []
        _restore_marks(m)
        for name, t in (*m._parameters.items(), *m._buffers.items()):
            if isinstance(t, DTensor) and name not in m.__dict__:
                m.__dict__[name] = _block(t)
                names.append(name)
        if names:
            shown.append((m, names))
    module.__dict__.setdefault("_optimus2d_shown", []).append(shown)


def _restore_marks(module: nn.Module) -> None:
    """After ``.to()`` or ``load_state_dict(assign=True)``: the marks and hooks of ``module``'s own
    DTensor parameters, from its record (at its next forward or ``state_dict()``)."""
    marks = module.__dict__.get("_optimus2d_marks", {})
    for name, t in module._parameters.items():
        if name in marks and isinstance(t, DTensor) and not getattr(t, "_optimus2d_marked", False):
            _mark(t, marks[name])


def _hide(module: nn.Module, args, out) -> None:
    stack = module.__dict__.get("_optimus2d_shown")
    for m, names in stack.pop() if stack else ():
        for name in names:
            m.__dict__.pop(name, None)


def _where(module: nn.Module, name: str, t: torch.Tensor):
    """(Sharding, Mesh) of ``module``'s tensor ``name``, or of its owner's (a tied block)."""
    sharding, mesh = sharding_of(module, name)
    if sharding is None and getattr(t, "_optimus2d_owner", None) is not None:
        sharding, mesh = sharding_of(*t._optimus2d_owner)
    return sharding, mesh


def _serial_state(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    _restore_marks(module)
    if STORED.get():
        return
    for name, t in (*module._parameters.items(), *module._buffers.items()):
        key = prefix + name
        if isinstance(t, DTensor) and key in state and state[key] is not t:  # keep_vars=True: the tensor itself
            sharding, mesh = _where(module, name, t)
            if sharding is not None and not is_canonical(sharding, mesh):
                not_resharded(key, t, sharding)
                state[key] = serial_dtensor(t, sharding, mesh)


def _blocks_from_state(module: nn.Module, state: dict, prefix: str, *_) -> None:
    for name, t in (*module._parameters.items(), *module._buffers.items()):
        key = prefix + name
        if not isinstance(t, DTensor) or key not in state:
            continue
        value = state[key]
        sharding, mesh = _where(module, name, t)
        same = isinstance(value, DTensor) and value.device_mesh == t.device_mesh
        if same and value.placements == t.placements and value.shape == t.shape:
            if STORED.get() or sharding is None or is_canonical(sharding, mesh):
                continue  # the same layout: torch copies block into block
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if sharding is not None and tuple(value.shape) == sharding.full_shape:
            value = shard(value, mesh, sharding)
        block = local(t)
        if tuple(value.shape) == tuple(block.shape):  # else torch names the shape that does not fit
            state[key] = like(t, value.to(block).contiguous())
