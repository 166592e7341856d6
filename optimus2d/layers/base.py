"""What every optimus2d module shares: its mesh and the Sharding of each tensor it owns."""

from __future__ import annotations

import contextvars
import copy
import time
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from optimus2d.comm.calls import check_call, mark_agreed, refusal, tag
from optimus2d.comm.dtensor import DTensor, like, local, own_part, whole
from optimus2d.comm.mesh import Mesh, as_mesh
from optimus2d.comm.sharding import Sharding, shard, unshard
from optimus2d.comm.watch import PeerFailedError

if TYPE_CHECKING:  # a type only: layers/ calls nothing of torch.distributed
    from torch.distributed.device_mesh import DeviceMesh


def runs_forward_of(module: object, classes: tuple[type, ...]) -> bool:
    """``module`` is an instance of one of ``classes`` and runs that class's own forward (a subclass
    that rewrites the forward is not that class: what it computes is not known)."""
    return any(isinstance(module, cls) and type(module).forward is cls.forward for cls in classes)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a reduction over ``t`` runs in: fp64 for fp64, else fp32 (bf16 and fp16 too)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class ShardedModule(nn.Module):
    """A module whose own parameters are blocks of serial tensors.

    One construction path: ``__init__`` declares each parameter (``declare``: its Sharding and an
    uninitialised block, on meta if asked); ``from_serial`` builds the module on meta and fills it
    from the serial module (``fill_from_serial``), ``reset_parameters`` from a freshly initialised
    serial twin. ``shardings[name]`` is the one place a parameter's Sharding is kept.
    """

    mesh: Mesh
    shardings: dict[str, Sharding]

    def __init__(self, mesh: Mesh | DeviceMesh) -> None:
        super().__init__()
        self.mesh, self.shardings = as_mesh(mesh, f"{type(self).__name__}(mesh=)"), {}

    def declare(self, name: str, sharding: Sharding, param: nn.Parameter | None = None, **device_dtype) -> nn.Parameter:
        """Register the parameter ``name``: this rank's block of a serial tensor laid out as
        ``sharding``, uninitialised, on ``device`` in ``dtype`` (or ``param``, a block held
        elsewhere too: a tied table)."""
        if param is None:
            param = nn.Parameter(torch.empty(sharding.local_shape(self.mesh), **device_dtype))
        self.shardings[name] = sharding
        self.register_parameter(name, param)
        if getattr(param, "_optimus2d_owner", None) is None:
            mark_block(param, self, name, self.mesh)
        return param

    def __call__(self, *args, **kwargs):
        """The outermost optimus2d module of a call checks that every rank passes inputs of the same
        dtypes and shapes, none empty, on meta or a block of another mesh, none that the module's
        ``input_refusal`` refuses (``comm/calls.py``; ``Mesh(check="off")`` skips the exchange,
        not the refusals). Every rank exchanges at every outermost call; the exchange rides beside
        the module's collectives over MPI, and over torch.distributed where the inputs come
        unchanged from the latest module call or ``scatter`` (else it is settled first). Either way
        ranks that disagree all raise the same error and none returns a block. Under
        ``torch.compile`` the check is a step of the graph, settled before the module runs."""
        boundary = self.__dict__.get("_optimus2d_boundary")
        if boundary is None:
            return self._checked_call(args, kwargs)
        # parallelize(plan=): inputs move to this module's mesh first, its outputs (tagged as
        # this mesh's blocks) to its caller's after (layouts.py)
        args, kwargs = boundary.before(self, args, kwargs)
        return boundary.after(self, args, self._checked_call(args, kwargs))

    def input_refusal(self, args: tuple, kwargs: dict) -> BaseException | None:
        """Why this rank refuses the inputs of this call, found without communicating (None: it
        does not). Raised on every rank at the entry of the outermost call, before a block moves; a
        module overrides it to add its own (``Embedding2D``: ids that are not integers)."""
        return None

    def _refusal(self, args: tuple, kwargs: dict) -> BaseException | None:
        if self.mesh.coord is None:  # a mesh over other ranks: no exchange to post (a KeyError in MPI's)
            raise ValueError(
                f"{type(self).__name__}: rank {self.mesh.rank} is not in {self.mesh}: call it on that mesh's ranks"
            )
        what, tensors = type(self).__name__, [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        error = refusal(what, tensors, self.mesh)
        if error is None:
            meta = next((name for name, p in self.named_parameters() if p.is_meta), None)
            if meta is not None:
                error = TypeError(
                    f"{what}: its parameter {meta} is on the meta device, which holds no values ({self.mesh}): "
                    f"materialize the model first (optimus2d.materialize, or load its weights)"
                )
        return error if error is not None else self.input_refusal(args, kwargs)

    def _frozen(self) -> tuple[str, ...]:
        """The names of this module's parameters that do not require grad, and of the mesh's
        parameters kept whole whose gradient a hook sums over it (``mesh.summed``): agreed at each call."""
        own = [name for name, p in self.named_parameters() if not p.requires_grad]
        summed = self.mesh.summed
        if summed:
            live = [(label, ref, name) for label, ref, name in summed if ref() is not None]
            summed[:] = live
            params = [(label, getattr(ref(), name, None)) for label, ref, name in live]
            own += [label for label, p in params if isinstance(p, torch.Tensor) and not p.requires_grad]
        return tuple(own)

    def _checked_call(self, args: tuple, kwargs: dict):
        if torch.compiler.is_compiling():
            return self._traced_call(args, kwargs)
        if _inside.get():
            return super().__call__(*args, **kwargs)
        refused = self._refusal(args, kwargs)
        pending, agreed = check_call(
            self.mesh, type(self).__name__, args, kwargs, refused, self.training, self._frozen()
        )
        token = _inside.set(True)
        try:
            out = super().__call__(*args, **kwargs)
        except Exception as err:
            # Does the ranks' disagreement explain err (a refusal of this rank's own, a message of
            # another size)? Then say that, on every rank: wait for the exchange, which every rank
            # posted on entry. After a lost peer (a timeout, a failure reported) only read it if
            # it is already there: waiting for a lost peer again would double the time to fail.
            # Wait for it a moment without listening for failures first: a peer may have reported
            # the error the disagreement caused (an MPI message of another size), and a wait that
            # hears it abandons the exchange, which the peers then never complete.
            lost = isinstance(err, (PeerFailedError, TimeoutError))
            if pending is not None and self.mesh.pending is pending and (_arrives(pending) or not lost):
                try:
                    pending.resolve()
                except (ValueError, TypeError) as disagreement:
                    raise disagreement from err
            raise
        finally:
            _inside.reset(token)
        if pending is not None and self.mesh.pending is pending:
            _arrives(pending)
            pending.resolve()
        if agreed and self.mesh.size > 1:  # this call's inputs and outputs: fresh for the next call
            mark_agreed([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)], self.mesh)
        tag(out, self.mesh, agreed)
        return out

    def _traced_call(self, args: tuple, kwargs: dict):
        """``__call__`` while dynamo traces: the same check and tags, with the nesting in a plain
        list (dynamo does not trace ``ContextVar.set``) and no error handling (the check runs
        before any collective of the module)."""
        if _traced_depth:
            return super().__call__(*args, **kwargs)
        refused = self._refusal(args, kwargs)
        _, agreed = check_call(self.mesh, type(self).__name__, args, kwargs, refused, self.training, self._frozen())
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

    def load_serial_tensor(self, name: str, full: torch.Tensor) -> None:
        """Give ``name`` this rank's block of the serial tensor ``full`` (no communication)."""
        load_serial_tensor(self, name, full)

    def serial_tensor(self, name: str) -> torch.Tensor:
        """The serial tensor ``name`` on every rank (all-gathers when sharded)."""
        return serial_tensor(self, name)


_GRACE_S = 2.0  # how long a rank waits for a module's exchange before it listens for failures


def _arrives(pending) -> bool:
    """Whether the exchange of ``pending`` arrives within ``_GRACE_S``, polled without reading the
    failures reported: a rank that failed in a collective because the ranks disagree (an MPI message
    of another size) reports it at once, while the exchange that says why may still be on its way
    (a rank descheduled on a shared core); a lost peer never completes it."""
    start = time.monotonic()
    while not pending.ready():
        if time.monotonic() - start > _GRACE_S:
            return False
        time.sleep(1e-4)
    return True


_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("optimus2d_in_module", default=False)
_traced_depth: list[ShardedModule] = []  # the optimus2d modules dynamo is tracing, outermost first


def deepcopy_keeping_blocks(module: nn.Module, memo: dict) -> nn.Module:
    """The deep copy ``copy.deepcopy`` makes of ``module`` (its state, copied with ``memo``), whose
    parameters keep the originals' ``_optimus2d_*`` attributes (their owner, copied too, and mesh,
    which ``clip_grad_norm_`` reads) and gradient hooks (a replicated block's sum over its replicas).
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
    replaced by blocks, marked and hooked (``mark_block``, a gradient hook summing over
    replicas) — keep those tags and hooks, as ``ShardedModule`` does. Returns ``module``."""
    module.__dict__["__deepcopy__"] = _KeepBlocks(module)
    return module


def mark_block(param: nn.Parameter, owner: nn.Module, name: str, mesh: Mesh) -> None:
    """Note on ``param`` the mesh it lives on and the module that keeps its Sharding (``owner``'s
    ``shardings``, or ``_optimus2d_shardings`` for a library's module whose tensors a converter
    replaced by blocks): ``clip_grad_norm_`` and ``param_sharding`` look it up there."""
    param._optimus2d_owner, param._optimus2d_mesh = (owner, name), mesh


def param_sharding(param: torch.Tensor) -> Sharding | None:
    """The Sharding of a parameter, read from its owner (None: replicated, or plain torch)."""
    owner = getattr(param, "_optimus2d_owner", None)
    return sharding_of(*owner)[0] if owner is not None else None


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
    if sharding is None:  # a replicated tensor, or one torch's parallelize_module split (1D)
        return whole(getattr(module, name)).detach()
    return unshard(local(getattr(module, name)).detach().contiguous(), mesh, sharding)


def load_serial_tensor(module: nn.Module, name: str, full: torch.Tensor) -> None:
    """Give ``module.name`` this rank's block of the serial tensor ``full`` (no communication).

    A block still on meta (declared, not allocated) becomes a copy of that block, with ``full``'s
    dtype and device (meta for a meta ``full``: nothing is allocated); an allocated one is copied
    into, keeping its own. The tensor stays the same Python object (ties, attributes, hooks)."""
    sharding, mesh = sharding_of(module, name)
    target = getattr(module, name)
    if sharding is None and isinstance(target, DTensor) and not target.is_meta:  # torch's own split (1D)
        block = own_part(target, full)
    else:
        block = shard(full.detach(), mesh, sharding) if sharding is not None else full.detach()
    with torch.no_grad():
        if target.is_meta:
            swap_block(target, block.clone(memory_format=torch.contiguous_format))
        else:
            local(target).copy_(block)


def refuse_dropped(module: nn.Module, serial: nn.Module) -> None:
    """Refuse a parameter of ``serial`` that ``module``, its whole conversion, has no place for (a
    bias given to one of a torch layer's linears alone: dropped, 0.10 off), rather than drop it."""
    held = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    dropped = [name for name, _ in serial.named_parameters(remove_duplicate=False) if name not in held]
    if dropped:
        raise TypeError(
            f"{type(module).__name__}.from_serial: {type(serial).__name__} holds {', '.join(dropped)}, which the "
            f"converted module has no place for (it is built like torch's {type(serial).__name__} with its own "
            f"settings): not converted, rather than dropped"
        )


def fill_from_serial(module: nn.Module, serial: nn.Module) -> None:
    """Fill every ``ShardedModule`` in ``module`` from the module at the same path in ``serial``:
    each declared parameter gets its block of the serial tensor of the same name, and that tensor's
    ``requires_grad``. A parameter owned by another module (a tied head's table) is left to it.
    ``serial`` may hold more (``module`` a part of it); ``refuse_dropped`` says where it may not."""
    for path, sub in module.named_modules():
        if not isinstance(sub, ShardedModule):
            continue
        source = serial.get_submodule(path)
        for name in sub.shardings:
            param = getattr(sub, name)
            if getattr(param, "_optimus2d_owner", (sub,))[0] is not sub:
                continue
            full = getattr(source, name, None)
            if not isinstance(full, torch.Tensor):
                where = f"{path}.{name}" if path else name
                raise TypeError(
                    f"{type(module).__name__}.from_serial: {type(serial).__name__} has no {where}, which the "
                    f"converted module holds (a bias, say, that one part has and another not)"
                )
            load_serial_tensor(sub, name, full)
            param.requires_grad_(full.requires_grad)


def replace_by_block(module: nn.Module, name: str, sharding: Sharding, mesh: Mesh) -> torch.Tensor:
    """Replace the tensor ``name`` of a library's module (not a ``ShardedModule``: timm's class
    token, BART's ``final_logits_bias``) by this rank's block of it, its Sharding recorded in
    ``module._optimus2d_shardings``, the one place for such a module. A parameter stays a parameter
    (its ``requires_grad`` kept, marked, kept by ``copy.deepcopy``), a buffer a buffer."""
    full = getattr(module, name)
    module.__dict__.setdefault("_optimus2d_shardings", {})[name] = sharding
    module._optimus2d_mesh = mesh
    block = shard(full.detach(), mesh, sharding).clone(memory_format=torch.contiguous_format)
    if isinstance(full, nn.Parameter):
        block = nn.Parameter(block, requires_grad=full.requires_grad)
        mark_block(block, module, name, mesh)
        keep_blocks_on_copy(module)  # copy.deepcopy keeps the block's marks and hooks
    setattr(module, name, block)
    return block


def swap_block(t: torch.Tensor, block: torch.Tensor) -> None:
    """Give the tensor ``t`` (on meta, say) the values, dtype and device of ``block``, keeping the
    object (ties, an optimizer-to-be), its attributes and its gradient hooks."""
    hooks = list(t._backward_hooks.values()) if getattr(t, "_backward_hooks", None) else []
    if isinstance(t, DTensor):  # a parameter told to torch as a DTensor: the block is its local tensor
        block = like(t, block)
    new = nn.Parameter(block, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else block
    new.__dict__.update(t.__dict__)
    torch.utils.swap_tensors(t, new)
    if hooks:
        t._backward_hooks = None
        wanted = t.requires_grad  # a frozen parameter keeps its hooks for when it is unfrozen
        for hook in hooks:
            t.requires_grad_(True).register_hook(hook)
        t.requires_grad_(wanted)


def serial_shape(module: nn.Module, name: str) -> tuple[int, ...]:
    sharding, _ = sharding_of(module, name)
    return sharding.full_shape if sharding is not None else tuple(getattr(module, name).shape)
