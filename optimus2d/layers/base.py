"""What every optimus2d module shares: its mesh and the Sharding of each tensor it owns."""

from __future__ import annotations

import contextvars
import copy
import weakref

import torch
from torch import nn

from optimus2d.comm.agreement import check_call, tag
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding, shard, unshard
from optimus2d.comm.watch import PeerFailedError


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a reduction over ``t`` runs in: fp64 for fp64, else fp32 (bf16 and fp16 too)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class ShardedModule(nn.Module):
    """A module whose own parameters/buffers are blocks of serial tensors.

    ``shardings[name]`` says which block of the serial tensor ``name`` this rank holds; tensors
    without an entry are replicated. ``optimus2d.serial_state_dict`` and ``from_serial`` use it.
    """

    mesh: Mesh
    shardings: dict[str, Sharding]

    def __call__(self, *args, **kwargs):
        """The outermost optimus2d module of a call checks that every rank passes inputs of the same
        dtypes and shapes, none empty (``comm/agreement.py``; ``Mesh(check="off")`` skips), unless
        they come unchanged from another optimus2d module or ``scatter`` (its outputs are tagged as
        agreed). On an MPI mesh the check rides beside the module's collectives and is settled
        before the output is returned; over torch.distributed it is settled first. Either way ranks
        that disagree all raise the same ``ValueError`` and none returns a block. Under
        ``torch.compile`` the check is a step of the graph, settled before the module runs."""
        boundary = self.__dict__.get("_optimus2d_boundary")
        if boundary is not None:  # parallelize(plan=): inputs move to this module's mesh first (layouts.py)
            args, kwargs = boundary.before(self, args, kwargs)
        if torch.compiler.is_compiling():
            return self._traced_call(args, kwargs)
        if _inside.get():
            return super().__call__(*args, **kwargs)
        pending, agreed = check_call(self.mesh, type(self).__name__, args, kwargs)
        token = _inside.set(True)
        try:
            if pending is not None and pending.error is not None:  # this rank refuses its input
                pending.resolve()
            out = super().__call__(*args, **kwargs)
        except Exception as err:
            # Does the ranks' disagreement explain err (a refusal of this rank's own, a message of
            # another size)? Then say that, on every rank: wait for the exchange, which every rank
            # posted on entry. After a lost peer (a timeout, a failure reported) only read it if
            # it is already there: waiting for a lost peer again would double the time to fail.
            lost = isinstance(err, (PeerFailedError, TimeoutError))
            if pending is not None and self.mesh.pending is pending and (not lost or pending.ready()):
                try:
                    pending.resolve()
                except (ValueError, TypeError) as disagreement:
                    raise disagreement from err
            raise
        finally:
            _inside.reset(token)
        if pending is not None and self.mesh.pending is pending:
            pending.resolve()
        tag(out, self.mesh, agreed)
        return out

    def _traced_call(self, args: tuple, kwargs: dict):
        """``__call__`` while dynamo traces: the same check and tags, with the nesting in a plain
        list (dynamo does not trace ``ContextVar.set``) and no error handling (the check runs
        before any collective of the module)."""
        if _traced_depth:
            return super().__call__(*args, **kwargs)
        _, agreed = check_call(self.mesh, type(self).__name__, args, kwargs)
        _traced_depth.append(self)
        try:
            out = super().__call__(*args, **kwargs)
        finally:
            _traced_depth.pop()
        tag(out, self.mesh, agreed)
        return out

    def __deepcopy__(self, memo: dict) -> ShardedModule:
        """``copy.deepcopy`` as torch makes it, on the same mesh (``Mesh.__deepcopy__``), and with
        each parameter's optimus2d attributes and gradient hooks, which ``nn.Parameter``'s own
        deep copy drops: the copy (an EMA twin, say) trains as the original does."""
        return deepcopy_keeping_blocks(self, memo)

    def tag_parameters(self) -> None:
        """Mark each own parameter with its Sharding (``clip_grad_norm_`` counts replicas once)."""
        for name, param in self.named_parameters(recurse=False):
            param._optimus2d_sharding = self.shardings.get(name)
            param._optimus2d_mesh = self.mesh

    def load_serial_tensor(self, name: str, full: torch.Tensor) -> None:
        """Copy this rank's block of the serial tensor ``full`` into ``name`` (no communication)."""
        load_serial_tensor(self, name, full)

    def serial_tensor(self, name: str) -> torch.Tensor:
        """The serial tensor ``name`` on every rank (all-gathers when sharded)."""
        return serial_tensor(self, name)


_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("optimus2d_in_module", default=False)
_traced_depth: list[ShardedModule] = []  # the optimus2d modules dynamo is tracing, outermost first


def deepcopy_keeping_blocks(module: nn.Module, memo: dict) -> nn.Module:
    """The deep copy ``copy.deepcopy`` makes of ``module`` (its state, copied with ``memo``), whose
    parameters keep the originals' ``_optimus2d_*`` attributes (their Sharding and mesh, which
    ``clip_grad_norm_`` reads) and gradient hooks (a replicated block's sum over its replicas).
    A tied parameter is copied once and given them once."""
    new = type(module).__new__(type(module))
    memo[id(module)] = new
    state = module.__getstate__()
    state.pop("__deepcopy__", None)  # the copy gets its own (keep_blocks_on_copy)
    new.__setstate__(copy.deepcopy(state, memo))
    for name, param in module._parameters.items():
        twin = new._parameters.get(name)
        if param is None or twin is None or twin is param:
            continue
        for key, value in vars(param).items():
            if key.startswith("_optimus2d_") and key not in vars(twin):
                setattr(twin, key, copy.deepcopy(value, memo))
        if param._backward_hooks and not twin._backward_hooks:
            for hook in param._backward_hooks.values():
                twin.register_hook(hook)
    if "__deepcopy__" in module.__dict__:
        keep_blocks_on_copy(new)
    return new


class _KeepBlocks:
    """A foreign module's ``__deepcopy__`` (``keep_blocks_on_copy``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)

    def __call__(self, memo: dict) -> nn.Module:
        return deepcopy_keeping_blocks(self.module(), memo)


def keep_blocks_on_copy(module: nn.Module) -> nn.Module:
    """Make ``copy.deepcopy`` of ``module`` — a library's module whose parameters a converter
    replaced by blocks, tagged and hooked (``_optimus2d_sharding``, a gradient hook summing over
    replicas) — keep those tags and hooks, as ``ShardedModule`` does. Returns ``module``."""
    module.__dict__["__deepcopy__"] = _KeepBlocks(module)
    return module


def sharding_of(module: nn.Module, name: str) -> tuple[Sharding | None, Mesh | None]:
    """(Sharding, mesh) of ``module``'s own tensor ``name``; (None, None) when it is plain torch.

    ``ShardedModule``s carry ``shardings``; a foreign module whose tensors a converter replaced by
    blocks (timm's ViT class token, say) carries ``_optimus2d_shardings`` and ``_optimus2d_mesh``.
    """
    if isinstance(module, ShardedModule):
        sharding = module.shardings.get(name)
        return sharding, module.mesh if sharding is not None else None
    sharding = getattr(module, "_optimus2d_shardings", {}).get(name)
    return sharding, getattr(module, "_optimus2d_mesh", None) if sharding is not None else None


def serial_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The serial tensor ``name`` of ``module`` on every rank (all-gathers its blocks)."""
    sharding, mesh = sharding_of(module, name)
    local = getattr(module, name).detach()
    return unshard(local.contiguous(), mesh, sharding) if sharding is not None else local


def load_serial_tensor(module: nn.Module, name: str, full: torch.Tensor) -> None:
    """Copy this rank's block of the serial tensor ``full`` into ``module.name`` (no communication)."""
    sharding, mesh = sharding_of(module, name)
    block = shard(full.detach(), mesh, sharding) if sharding is not None else full
    with torch.no_grad():
        getattr(module, name).copy_(block)


def serial_shape(module: nn.Module, name: str) -> tuple[int, ...]:
    sharding, _ = sharding_of(module, name)
    return sharding.full_shape if sharding is not None else tuple(getattr(module, name).shape)
