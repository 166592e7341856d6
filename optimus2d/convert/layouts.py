"""Per-module layouts: a submodule on a mesh of its own over the same ranks (colocated), and the
boundaries where tensors cross from one mesh's layout to another's.

``parallelize(model, mesh, plan={"model.vision_tower": Mesh(1, depth=4)})`` converts the named
submodule, and everything inside it, on the plan's mesh; the rest on ``mesh``. A plan key is a
module path, exact or a glob matched atom by atom (``"encoders.*"``); the innermost match wins.
A container without a forward of its own (``nn.ModuleList``) is never called: the boundary is
then at each of its children, which its parent calls. At the boundary of a planned module:

* going in, every tensor of its arguments (inside tuples, lists and dicts) that is a block of
  another mesh moves to the module's mesh by ``redistribute``, in the layout it carries (from
  ``scatter``, ``scatter_batch``, ``redistribute``; a module's output is an activation). A tensor
  of one dim or more that carries no layout (computed by plain torch from blocks) cannot be
  placed: it is refused, on every rank, before anything is sent. A 0-dim tensor and other
  arguments pass unchanged;
* coming out, every tensor of its output (tuples, lists, dicts, ``ModelOutput``s) is a block of the
  module's mesh — an activation ``[b, ..., h]`` when floating, a batch tensor ``[b, ...]``
  otherwise, unless it carries its own layout — and moves to the parent's mesh. A tuple or list
  of tensors (Hugging Face's ``hidden_states``) moves each tensor when it is read, so only the
  layers the caller uses are sent. Per-head outputs (``attentions``) have no activation layout:
  a planned module must not return them (refused).

Gradients flow back through the same boundaries (``redistribute``'s backward).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Mapping, Sequence

import torch
from torch import nn

from optimus2d.comm.agreement import agree
from optimus2d.comm.calls import layout, tag
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.redistribution import redistribute
from optimus2d.comm.whole import from_whole, is_whole, take_whole, to_whole, whole_of
from optimus2d.context.parallel import ContextParallel
from optimus2d.layers.base import ShardedModule
from optimus2d.megatron.region import Megatron

_PER_HEAD = ("attentions", "cross_attentions", "encoder_attentions", "decoder_attentions")


def check_plan(plan: Mapping[str, Mesh | ContextParallel | Megatron] | None, mesh: Mesh) -> dict[str, Mesh]:
    """The plan's meshes, checked: every value a ``Mesh`` (or a ``context.ContextParallel`` or a
    ``megatron.Megatron`` on one) over the same ranks as ``mesh`` (``ValueError`` otherwise)."""
    if plan is None:
        return {}
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize: plan= must map module paths to meshes, got {type(plan).__name__}")
    meshes = {}
    for path, other in plan.items():
        if not isinstance(path, str) or not isinstance(other, (Mesh, ContextParallel, Megatron)):
            raise TypeError(
                f"parallelize: plan= maps module paths (str) to Mesh, context.ContextParallel or megatron.Megatron, "
                f"got {path!r}: {type(other).__name__}"
            )
        meshes[path] = other if isinstance(other, Mesh) else other.mesh
        if sorted(meshes[path].ranks) != sorted(mesh.ranks):
            raise ValueError(
                f"parallelize: plan[{path!r}] is over ranks {sorted(meshes[path].ranks)}, not over the model mesh's "
                f"{sorted(mesh.ranks)}: a planned module shares the ranks of the model (colocated)"
            )
    return meshes


def context_plan(plan: Mapping[str, object] | None) -> dict[str, ContextParallel]:
    """The plan's keys whose module runs with its sequence split (``context.ContextParallel``)."""
    return {key: value for key, value in (plan or {}).items() if isinstance(value, ContextParallel)}


def megatron_plan(plan: Mapping[str, object] | None) -> dict[str, Megatron]:
    """The plan's keys whose module runs with 1D tensor parallelism (``megatron.Megatron``)."""
    return {key: value for key, value in (plan or {}).items() if isinstance(value, Megatron)}


def describe_plan(plan: object) -> str:
    """The plan as text, the same on ranks whose plans are the same: each key and its mesh's shape
    and ranks (sorted by key), or the type of what was given."""
    if plan is None:
        return "no plan"
    if not isinstance(plan, Mapping):
        return f"plan of type {type(plan).__name__}"
    items = sorted(plan.items(), key=lambda item: repr(item[0]))
    parts = [f"{key!r}: {_meshed(value)}" for key, value in items]
    return "plan {" + ", ".join(parts) + "}"


def _meshed(value: object) -> str:
    if isinstance(value, Mesh):
        return f"Mesh(q={value.q}, depth={value.depth}, ranks={list(value.ranks)})"
    if isinstance(value, (ContextParallel, Megatron)):
        return repr(value)
    return type(value).__name__


def agree_plan(mesh: Mesh, plan: object, error: BaseException | None, check: bool | None, io: str = "blocks") -> None:
    """Every rank of ``mesh`` passes ``parallelize`` the same plan and refuses (``error``: this rank's
    refusal of the plan or the model, found without communicating) the same way: one all-gather of
    5 words (``agree``) whose description is the plan and the refusal, so a plan that differs on one
    rank (a key missing, another module, a bad key, another mesh) is a ``ValueError`` on every rank
    naming each rank's plan, and a refusal every rank makes is raised by each (the caller raises
    ``error``). ``check=False``, or a mesh checked "off", skips it."""
    if check is False or (check is None and mesh.check == "off") or mesh.size == 1:
        return
    refused = f"; refused: {type(error).__name__}: {error}" if error is not None else ""
    refused = re.sub(r", coord\(k,i,j\)=\([^)]*\)", "", refused)  # a mesh named in it: not this rank's place
    refused = re.sub(r" at 0x[0-9a-f]+", "", refused)  # an object's address (a function's repr): this process's
    given = describe_io(io)  # whole tensors in and out (whole_io.py)
    agree(mesh, "parallelize", description=describe_plan(plan) + given + refused)


def describe_io(io: object) -> str:
    """``parallelize(io=)`` as agreed over the mesh: "" for blocks, a declaration in sorted order."""
    return "" if io == "blocks" else f", io={sorted(io.items()) if isinstance(io, Mapping) else io!r}"


def matches(key: str, path: str) -> bool:
    """``key`` names ``path``: equal, or a glob matching it atom by atom (``"layers.*"`` names
    ``layers.0``, not ``layers.0.mlp``), as torch's ``parallelize_module`` reads its plan."""
    atoms, parts = key.split("."), path.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms, strict=True))


def planned_mesh(plan: dict[str, Mesh], path: str) -> tuple[str, Mesh] | None:
    """(key, mesh) of the plan entry naming ``path`` itself, or None: of several, the most specific
    (the most atoms without a glob, then the longest: ``layers.0.mlp`` over ``layers.*.mlp``, a glob
    and its exception). The model itself (path "") is on the model's mesh: no key names it."""
    hits = [(key, m) for key, m in plan.items() if path and matches(key, path)]
    return max(hits, key=lambda hit: _specificity(hit[0])) if hits else None


def shadowed_keys(plan: dict[str, Mesh], path: str) -> list[str]:
    """The plan's keys that name ``path`` but lose it to a more specific one (``planned_mesh``)."""
    hit = planned_mesh(plan, path)
    return [key for key in plan if hit is not None and key != hit[0] and matches(key, path)]


def _specificity(key: str) -> tuple[int, int]:
    return sum(not any(c in atom for c in "*?[") for atom in key.split(".")), len(key)


def mesh_aliases(model: nn.Module, plan: dict[str, Mesh], mesh: Mesh, regions: Collection[str] = ()) -> list[str]:
    """``"path (Class): ..."`` for each module holding tensors reached at two paths that the plan puts
    on meshes of different layouts, or whose callers' meshes differ (``mesh``: the model's): it would
    be converted for one mesh, and its boundary (the move of its inputs onto its mesh) made for one
    caller, and be handed the other's blocks. Likewise a tensor held by two modules on meshes of
    different layouts (an embedding table tied to another's, or to a head). A 1D region's keys
    (``regions``) are checked by the walk itself."""
    if not plan:
        return []

    def placed(path: str) -> tuple[str, Mesh] | None:  # the plan entry of the path or of its nearest ancestor
        parts = path.split(".") if path else []
        return next((hit for n in range(len(parts), 0, -1) if (hit := planned_mesh(plan, ".".join(parts[:n])))), None)

    first: dict[int, tuple[str, Mesh, Mesh]] = {}
    tensors: dict[int, tuple[str, Mesh]] = {}  # a tensor held by two modules (a tied embedding table)
    found = []
    for path, sub in model.named_modules(remove_duplicate=False):
        hit = placed(path)
        held = next(sub.parameters(), None) is not None or next(sub.buffers(), None) is not None
        if (hit is not None and hit[0] in regions) or not held:
            continue  # a 1D region's (its own check), or no tensors (a GELU: the same on any mesh's blocks)
        on = hit[1] if hit is not None else mesh
        caller = (placed(path.rpartition(".")[0]) or (None, mesh))[1] if path else mesh
        other, there, their_caller = first.setdefault(id(sub), (path, on, caller))
        if (layout(there), layout(their_caller)) != (layout(on), layout(caller)):
            found.append(
                f"{path} ({type(sub).__name__}): on {_shape(on)} called from {_shape(caller)}, and is also {other}, "
                f"on {_shape(there)} called from {_shape(their_caller)}: a module runs on one mesh, called from one "
                f"(give both paths and their callers one plan entry, or make them two modules)"
            )
        if other != path:  # the module itself at a second path: said above, or on one mesh
            continue
        for name, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            key = f"{path}.{name}" if path else name
            held_by, held_on = tensors.setdefault(id(t), (key, on))
            if layout(held_on) != layout(on):
                found.append(
                    f"{key} ({type(sub).__name__}'s {name}): on {_shape(on)}, and is also {held_by}, on "
                    f"{_shape(held_on)}: one tensor is split for one mesh (put its holders under one plan entry, "
                    f"or untie them)"
                )
    return found


class Boundary:
    """The hooks of a planned module: its inputs moved to ``inner``, its outputs to ``outer``."""

    def __init__(self, path: str, inner: Mesh, outer: Mesh, meshes: Sequence[Mesh]) -> None:
        self.path, self.inner, self.outer = path, inner, outer
        self.meshes = {layout(m): m for m in meshes}

    agrees = True  # its refusals agreed over the model's mesh (5 words a call)

    def install(self, module: nn.Module) -> None:
        if not isinstance(module, ShardedModule):  # a ShardedModule's __call__ calls both itself, around
            module.register_forward_pre_hook(self.before, with_kwargs=True)  # its input check and its tags
            module.register_forward_hook(self.after)
        module.__dict__["_optimus2d_boundary"] = self

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.adopt(kwargs)
        named = [(f"argument {n}", a) for n, a in enumerate(args)] + list(kwargs.items())
        error, count = None, 0
        for name, t in (hit for key, value in named for hit in _tensors(value, key)):  # refuse before sending
            count += 1
            if error is None and t.dim() and getattr(t, "_optimus2d_layout", None) is None and whole_of(t) is None:
                error = ValueError(
                    f"parallelize: {self.path} (on {_shape(self.inner)}) receives {name} of shape {tuple(t.shape)} "
                    f"whose layout cannot be known (computed by plain torch, not given by scatter, scatter_batch, "
                    f"redistribute or an optimus2d module): it cannot be moved from the model's mesh to the module's"
                )
        if self.agrees and self.outer.check != "off":  # on every rank: a tensor some ranks' data made
            agree(self.outer, f"{self.path}'s boundary", description=f"{count} tensors", error=error)
        elif error is not None:
            raise error
        try:  # redistribute refuses (on every rank, before sending) what the module's mesh cannot hold
            return _map((args, kwargs), self._in)
        except ValueError as err:
            raise ValueError(f"parallelize: {self.path} (on {_shape(self.inner)}), its input: {err}") from err

    def adopt(self, kwargs: dict) -> None:
        """Tensors whose layout their keyword says (none here; ``WholeBoundary`` knows one)."""

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        if isinstance(output, Mapping):
            for key in _PER_HEAD:
                if output.get(key) is not None:
                    raise ValueError(
                        f"parallelize: {self.path} (on {_shape(self.inner)}) returns {key}, per-head tensors that "
                        f"have no activation layout to move to {_shape(self.outer)}: do not ask for them"
                    )
        try:
            return self._fields(output)
        except ValueError as err:
            raise ValueError(f"parallelize: {self.path}'s output, moved to {_shape(self.outer)}: {err}") from err

    def _fields(self, output: object) -> object:
        """A ModelOutput's fields moved in place (a nested one's too: LLaVA's ``image_outputs``), a
        tuple of tensors when read; anything else moved now."""
        if isinstance(output, Mapping) and hasattr(output, "to_tuple"):
            for key in list(output.keys()):
                value = output[key]
                lazy = isinstance(value, MovedOnRead) or (
                    isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value)
                )  # (a planned module's inside, moved when read: moved on from there when read)
                output[key] = MovedOnRead(value, self._out) if lazy else self._fields(value)
            return output
        return _map(output, self._out)

    def _in(self, t: torch.Tensor) -> torch.Tensor:
        given = getattr(t, "_optimus2d_layout", None)
        if t.dim() == 0 or given is None or given == layout(self.inner):
            return t
        whole = take_whole(t)  # cut from a whole tensor (a model's whole input): this mesh's block of it
        if whole is not None:
            return from_whole(whole, self.inner, _kind(t))
        src = self.meshes.get(given)
        if src is None:
            raise ValueError(f"parallelize: {self.path} receives a block of a mesh that is not in the plan")
        return redistribute(t, src, self.inner, layout=_kind(t))

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        given = getattr(t, "_optimus2d_layout", None)
        if t.dim() == 0 or given == layout(self.outer) or is_whole(t):  # (CLIP's logits: whole already)
            return t
        src = self.meshes.get(given, self.inner) if given is not None else self.inner
        return redistribute(t, src, self.outer, layout=_kind(t))


class WholeBoundary(Boundary):
    """The hooks of a module under 1D tensor parallelism (``megatron.Megatron``): each block of a
    plan's mesh it receives becomes the whole tensor on every rank (``to_whole``), and each whole
    tensor it returns becomes a block of ``outer`` (``from_whole``). A Hugging Face base model's
    ``inputs_embeds`` is by its contract the hidden states ``[b, s, h]``: given without a layout
    (LLaVA merges its image features into it with plain torch, on the caller's blocks), it is the
    caller's activation block. ``io``: the model's ``WholeIO`` (``parallelize(io="whole")``): while
    its call runs, each whole output is kept beside its blocks, so that the model gives it whole
    without gathering it again."""

    agrees = False  # a 1D region sends what torch's parallelize_module sends, nothing of its own

    io = None

    def adopt(self, kwargs: dict) -> None:
        t = kwargs.get("inputs_embeds")
        if isinstance(t, torch.Tensor) and t.dim() == 3 and getattr(t, "_optimus2d_layout", None) is None:
            tag(t, self.outer, agreed=False)
            t._optimus2d_kind = "activation"

    def _in(self, t: torch.Tensor) -> torch.Tensor:
        given = getattr(t, "_optimus2d_layout", None)
        if t.dim() == 0 or given is None:
            return t
        whole = take_whole(t)  # cut from a whole tensor (a model's whole input): take it as it is
        if whole is not None:
            return whole
        src = self.meshes.get(given)
        if src is None:
            raise ValueError(f"parallelize: {self.path} receives a block of a mesh that is not in the plan")
        return to_whole(t, src, _kind(t))

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        block = from_whole(t, self.outer, _kind(t))
        if self.io is not None and self.io.active:
            self.io.keep(block, t)
        return block


class MovedOnRead(Sequence):
    """A tuple of a planned module's output tensors, each moved to the outer mesh when first read."""

    def __init__(self, items: Sequence, move) -> None:
        self._items = items if isinstance(items, MovedOnRead) else list(items)  # an inner one: read when read
        self._move, self._moved = move, {}

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[n] for n in range(len(self))[index])
        n = range(len(self))[index]
        if torch.is_inference_mode_enabled():  # an inference tensor is no one's to keep
            return self._moved[n] if n in self._moved else _map(self._items[n], self._move)
        if n not in self._moved:  # moved with its graph, whatever the mode of this first read
            with torch.enable_grad():
                self._moved[n] = _map(self._items[n], self._move)
        moved = self._moved[n]
        return moved if torch.is_grad_enabled() else _map(moved, torch.Tensor.detach)

    def __repr__(self) -> str:
        return f"MovedOnRead({len(self)} items)"


def moved_whole(module: nn.Module, args: tuple, output: object) -> object:
    """A forward hook on the converted model: the fields its planned modules left to be moved when
    read (``MovedOnRead``, read inside the model as LLaVA reads one of its tower's hidden states)
    leave the model as tuples, moved now, on every rank: the user's code reads a tuple (``torch.stack``
    of it), on any rank alone."""
    if isinstance(output, Mapping) and hasattr(output, "to_tuple"):
        for key in list(output.keys()):
            if isinstance(output[key], MovedOnRead):
                output[key] = tuple(output[key])
    return output


def _kind(t: torch.Tensor) -> str:
    given = getattr(t, "_optimus2d_kind", None)
    if given is not None:
        return given
    return "activation" if t.is_floating_point() and t.dim() >= 2 else "batch"


def _shape(mesh: Mesh) -> str:
    return f"Mesh(q={mesh.q}, depth={mesh.depth})"


def _tensors(obj: object, name: str):
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{name}[{key!r}]")
    elif isinstance(obj, (tuple, list)):
        for n, value in enumerate(obj):
            yield from _tensors(value, f"{name}[{n}]")


def _map(obj: object, fn) -> object:
    """``obj`` with ``fn`` applied to each tensor inside it (tuples, lists, dicts, namedtuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)({key: _map(value, fn) for key, value in obj.items()})
    if isinstance(obj, (tuple, list)):
        items = [_map(value, fn) for value in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    return obj
