"""The walk of ``parallelize``: every module of the model checked, then converted, in place.

``_Walk.check`` notes how each module converts (``_plan``: its converter, or what ``blockwise.py``
and ``forward_reader.py`` know to be correct on blocks) or why it cannot, before anything changes;
``_rehearse`` converts a meta copy first; ``_Walk.convert`` replaces each module, once however many
times it is used, with shared embedding tables kept shared (``_convert_tied``) and each planned
module's boundary installed (``layouts.py``). ``register_converter`` lives here, beside ``keep``
and ``convert_children``, which convert a module's children through the walk in progress; the
tables it fills are ``convert/registry.py``'s.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from optimus2d.comm.calls import layout
from optimus2d.comm.mesh import Mesh
from optimus2d.context.parallel import ContextParallel
from optimus2d.convert import blockwise, dynamic_rope, forward_reader, layouts
from optimus2d.convert.attached import attached
from optimus2d.convert.instance_forward import replaced_forward
from optimus2d.convert.registry import (
    _CONVERTERS,
    _CONVERTS_CHILDREN,
    _RECOGNISERS,
    Converter,
    _load_library_of,
    converter_for,
    elementwise,
)
from optimus2d.convert.tied import tied_embeddings
from optimus2d.layers import (
    Dropout2D,
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    MultiheadAttention2D,
    RMSNorm2D,
    ShardedModule,
    TransformerBlock2D,
)
from optimus2d.layers.base import keep_blocks_on_copy
from optimus2d.layers.block import TransformerDecoderBlock2D, TransformerStack2D
from optimus2d.layers.embedding import TiedHead2D
from optimus2d.megatron.region import Megatron

_current: contextvars.ContextVar[_Walk | None] = contextvars.ContextVar("optimus2d_parallelize", default=None)


def convert_children(module: nn.Module, mesh: Mesh) -> None:
    """Convert every child of ``module`` in place (for converters of modules that hold tensors too)."""
    walk = _current.get() or _Walk(mesh, {}, tied_embeddings(module))
    prefix = walk.paths.get(id(module), "")  # the model's path of module: refusals name the full path
    for name, child in _children(module):
        setattr(module, name, walk.convert(child, f"{prefix}.{name}" if prefix else name, mesh))


def keep(module: nn.Module, mesh: Mesh) -> nn.Module:
    """The converter that keeps ``module`` as it is: its children are converted, its forward kept.
    Its own parameters (a scale it multiplies by) stay whole on every rank, each gradient summed over
    the mesh in backward (each rank's covers its own blocks alone), as ``blockwise.replicated``'s."""
    convert_children(module, mesh)
    own = [n for n, p in module.named_parameters(recurse=False) if getattr(p, "_optimus2d_mesh", None) is None]
    if own:
        blockwise.summed_over_mesh(module, own, mesh)
        keep_blocks_on_copy(module)
    return module


def register_converter(
    cls: type, converter: Converter | None = None, *, converts_children: bool = False, keep: bool = False
):
    """Teach ``parallelize`` to convert modules of type ``cls`` (and subclasses that keep its forward).

    ``converter(module, mesh)`` returns the module that replaces ``module``. Use directly or as a
    decorator::

        @optimus2d.convert.register_converter(MyNorm)
        def _(norm, mesh):
            return optimus2d.layers.RMSNorm2D.from_serial(as_rmsnorm(norm), mesh)

    ``keep=True`` (no converter) declares that ``cls``'s forward is correct on blocks as it is —
    it acts element by element on the hidden dim, or only on whole heads, once its children are
    converted — so ``parallelize`` converts its children and keeps it. That is a promise only its
    author can make: a forward that reduces, splits or reshapes the hidden dim by a size gives
    wrong numbers on the mesh, and so does one that reduces over the batch or the sequence (a loss
    of ``labels=``, a mean over tokens): each rank holds its rows only, so on 1×1×4 its loss is
    its rows' mean (``BertForSequenceClassification`` kept so: 0.6887 for 0.6928, no error). Its
    own parameters (a 0-d scale) stay whole on every rank, their gradients summed over the mesh.
    """
    if keep:
        if converter is not None:
            raise TypeError("register_converter: give a converter or keep=True, not both")
        converter, converts_children = _keep, True

    def add(fn: Converter) -> Converter:
        _CONVERTERS[cls] = fn
        if converts_children:  # it calls convert_children: parallelize checks inside it beforehand
            _CONVERTS_CHILDREN.add(fn)
        return fn

    return add(converter) if converter is not None else add


_keep = keep
_CONVERTS_CHILDREN.add(_keep)


def _stack(module: nn.Module, mesh: Mesh) -> nn.Module:
    convert_children(module, mesh)
    names = tuple(inspect.signature(type(module).forward).parameters)[1:]
    if isinstance(module, nn.TransformerEncoder):  # torch's nested-tensor path, taken where torch takes it
        return TransformerStack2D(module.layers, module.norm, module.use_nested_tensor, module.mask_check, names)
    return TransformerStack2D(module.layers, module.norm, serial_arguments=names)


def _layer(cls: type, layer: nn.Module, mesh: Mesh) -> nn.Module:
    """torch's encoder or decoder layer, its activation applied to blocks: refused unless element-wise."""
    if (why := blockwise.activation_refusal(layer.activation)) is not None:
        raise TypeError(f"{cls.__name__}.from_serial: {why}")
    return cls.from_serial(layer, mesh)


for _cls, _fn in (
    (nn.Linear, Linear2D.from_serial),
    (nn.LayerNorm, LayerNorm2D.from_serial),
    (nn.RMSNorm, RMSNorm2D.from_serial),
    (nn.Embedding, Embedding2D.from_serial),
    (nn.MultiheadAttention, MultiheadAttention2D.from_serial),
    (nn.TransformerEncoderLayer, lambda layer, mesh: _layer(TransformerBlock2D, layer, mesh)),
    (nn.TransformerDecoderLayer, lambda layer, mesh: _layer(TransformerDecoderBlock2D, layer, mesh)),
    (nn.TransformerEncoder, _stack),
    (nn.TransformerDecoder, _stack),
    (nn.Dropout, lambda m, mesh: Dropout2D(m.p, mesh=mesh)),
):
    register_converter(_cls, _fn, converts_children=_fn is _stack)


def _rehearse(module: nn.Module, mesh: Mesh, walk: _Walk) -> None:
    """Convert a copy of ``module`` whose tensors are on the meta device first, so that whatever a
    converter refuses (a size that does not divide the mesh, a head count, a vocabulary) is raised
    before the model itself changes: a refused model stays whole and runs as before. The copy
    shares no storage and allocates nothing; the random state is restored after. What only meta
    tensors cannot do (an error other than ``ValueError``/``TypeError``) is left to the conversion
    itself."""
    memo: dict = {}
    for t in (*module.parameters(), *module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    rehearsal = _Walk(mesh, {}, {}, plan=walk.plan, rehearsing=True)
    rehearsal.contexts, rehearsal.megatron = walk.contexts, walk.megatron
    token = _current.set(rehearsal)
    try:
        with torch.random.fork_rng(devices=[]):
            twin = copy.deepcopy(module, memo)
            rehearsal.tied = tied_embeddings(twin)
            rehearsal.check(twin, "")
            rehearsal.convert(twin, "")
    except (TypeError, ValueError):
        raise
    except Exception:  # meta tensors cannot do it: the conversion itself will tell
        return
    finally:
        _current.reset(token)
    errors = rehearsal.errors
    if len(errors) == 1 and str(errors[0]).startswith("parallelize"):
        raise errors[0]  # a converter's own walk refused its part: its error names the modules
    if errors:
        lines = "\n  ".join(dict.fromkeys(rehearsal.refused))
        kind = TypeError if all(isinstance(e, TypeError) for e in errors) else ValueError
        raise kind(f"parallelize: {len(errors)} module(s) do not fit the mesh; nothing was changed:\n  {lines}")


def _convert_tied(walk: _Walk, module: nn.Module, mesh: Mesh) -> nn.Module:
    """A module holding a shared embedding table, not its owner: a head → ``TiedHead2D`` on the
    owner's ``Embedding2D`` Parameter (its bias a vocabulary block, shared with the bias's other
    holders); another embedding → converted by its own converter, then given the owner's Parameter."""
    owner = walk.tied[id(module.weight)]
    table = walk.convert(owner, "(tied embedding)")
    if not isinstance(table, Embedding2D):
        raise TypeError(
            f"parallelize: {type(owner).__name__}'s weight is shared with {type(module).__name__}, but its converter "
            f"made a {type(table).__name__}, not an Embedding2D whose table could be shared"
        )
    if isinstance(module, nn.Embedding):  # its own forward (BART's scaled embedding), the owner's table
        converter = converter_for(module)
        converted = converter(module, mesh) if converter is not None else None
        if not isinstance(converted, Embedding2D) or converted.shardings["weight"] != table.shardings["weight"]:
            raise TypeError(
                f"parallelize: {type(module).__name__} shares the weight of {type(owner).__name__}, but its "
                f"converter does not make an Embedding2D of the same table"
            )
        converted.weight = table.weight
        return converted
    bias = module.bias
    if bias is None or id(bias) not in walk.tied.co_holders:  # no bias, or a bias of its own
        return TiedHead2D.from_serial(module, table)
    if id(bias) in walk.tied.blocks:  # another head of this table converted the shared bias already
        return TiedHead2D(table, walk.tied.blocks[id(bias)])
    head = TiedHead2D.from_serial(module, table)
    walk.tied.blocks[id(bias)] = head.bias
    for holder, name in walk.tied.co_holders[id(bias)]:  # e.g. BERT's cls.predictions.bias
        holder._parameters[name] = head.bias
        shardings = getattr(holder, "_optimus2d_shardings", None) or {}
        shardings[name] = head.shardings["bias"]
        holder._optimus2d_shardings, holder._optimus2d_mesh = shardings, walk.mesh
    return head


@dataclass
class _Walk:
    mesh: Mesh
    done: dict[int, nn.Module]  # id(serial module) → its conversion: a module used twice converts once
    tied: dict[int, nn.Embedding]  # id(shared weight) → the embedding that owns it

    refused: list[str] = field(default_factory=list)  # "path (Class): why", every offender of the model
    plans: dict[int, Converter] = field(default_factory=dict)  # id(module) → how it converts
    seen: list[nn.Module] = field(default_factory=list)  # the modules of those ids, kept alive: no id reused
    plan: dict[str, Mesh] = field(default_factory=dict)  # parallelize(plan=): path → the mesh of that module
    meshes: dict[int, Mesh] = field(default_factory=dict)  # id(module) → its mesh, where the plan names one
    boundaries: dict[int, layouts.Boundary] = field(default_factory=dict)  # id(planned module) → its hooks
    planned: set[str] = field(default_factory=set)  # the plan's keys that named a module
    contexts: dict[str, ContextParallel] = field(default_factory=dict)  # plan key → its sequence split
    split: dict[int, tuple[ContextParallel, str]] = field(default_factory=dict)  # id(module) → (split, path)
    megatron: dict[str, Megatron] = field(default_factory=dict)  # plan key → its 1D tensor parallelism
    regions: dict[int, tuple[Megatron, str]] = field(default_factory=dict)  # id(module) → (1D spec, path)
    unfit: list[str] = field(default_factory=list)  # "path (Class): why" a 1D region does not fit
    unsplit: list[str] = field(default_factory=list)  # modules that cannot run with context parallelism
    aliased: list[str] = field(default_factory=list)  # modules reached at two paths on two meshes
    rehearsing: bool = False  # converting a meta copy first: collect the refusals (_rehearse)
    errors: list[Exception] = field(default_factory=list)  # what they raised, in order
    outside: list = field(default_factory=list)  # (holder, key, name): modules outside it holding its parameters
    paths: dict[int, str] = field(default_factory=dict)  # id(module) → its path in the model, as converted
    shadowed: dict[str, list[str]] = field(default_factory=dict)  # plan key → paths it names that another takes

    def check(
        self,
        module: nn.Module,
        path: str,
        parent: nn.Module | None = None,
        outer: Mesh | None = None,
        caller: Mesh | None = None,
    ) -> None:
        """Note in ``refused`` everything that would be refused, before any module is changed.

        ``outer``: the mesh of the parent; ``caller``: of the module whose forward calls this one
        (the parent, or the parent's caller for a container without a forward of its own)."""
        outer = outer or self.mesh
        caller = caller or outer
        hit = layouts.planned_mesh(self.plan, path) if self.plan else None
        for key in layouts.shadowed_keys(self.plan, path) if hit is not None else ():
            self.shadowed.setdefault(key, []).append(f"{path} (given {hit[0]!r})")
        mesh = hit[1] if hit is not None else outer
        if hit is not None:
            self.planned.add(hit[0])
            if hit[0] in self.contexts:
                self.split[id(module)] = (self.contexts[hit[0]], path)
                if (why := ContextParallel.refusal(module)) is not None:
                    self.unsplit.append(f"{path} ({type(module).__name__}): {why}")
        if mesh is not self.mesh or hit is not None:  # (planned back on the model's mesh inside another: that)
            self.meshes[id(module)] = mesh
        called = type(module).forward is not nn.Module.forward  # a ModuleList is never called itself
        if hit is not None and hit[0] in self.megatron:  # 1D tensor parallelism: torch splits it as it is
            self._check_region(module, path, self.megatron[hit[0]], called, caller)
            return
        if called and layout(mesh) != layout(caller):
            self.boundaries[id(module)] = layouts.Boundary(path, mesh, caller, [self.mesh, *self.plan.values()])
        if isinstance(module, (ShardedModule, Dropout2D)) or getattr(module, "_optimus2d_mesh", None) is not None:
            return
        if isinstance(module, nn.Linear) and id(module.weight) in self.tied:
            self._check_attached(module, path, inside=True)
            return
        how = _plan(module, parent, mesh)
        if isinstance(how, str):
            self.refused.append(f"{path or 'the model itself'} ({type(module).__name__}): {how}")
        else:
            self.plans[id(module)] = how
            self.seen.append(module)
        # a refused container, or one whose children convert: look inside
        inside = not (isinstance(how, str) or how in _CONVERTS_CHILDREN or isinstance(how, _KeepAsRead))
        if not isinstance(how, str):  # (refused already: its own reason)
            self._check_attached(module, path, inside)
        if not inside:
            for name, child in _children(module):
                self.check(child, f"{path}.{name}" if path else name, module, mesh, mesh if called else caller)

    def _check_attached(self, module: nn.Module, path: str, inside: bool) -> None:
        """Refuse hooks and parametrizations set on ``module`` (``attached.py``), and, where its
        converter takes its children itself (``inside``), on those too."""
        for rel, sub in module.named_modules() if inside else [("", module)]:
            why = attached(sub)
            if why is not None:
                where = ".".join(p for p in (path, rel) if p) or "the model itself"
                self.refused.append(f"{where} ({type(sub).__name__}): {why}")

    def _check_region(self, module: nn.Module, path: str, spec: Megatron, called: bool, caller: Mesh) -> None:
        """A module under 1D tensor parallelism: its refusals noted (``unfit``), its boundary made."""
        where = f"{path} ({type(module).__name__})"
        if not called:
            self.unfit.append(f"{where}: has no forward of its own (name the modules its parent calls)")
        if len(spec.mesh.replicas) > 1:
            self.unfit.append(f"{where}: 1D over a mesh with data-parallel replicas ({spec.mesh}) is not built")
        tied = [name for name, p in module.named_parameters() if id(p) in self.tied]
        if tied:
            self.unfit.append(f"{where}: shares {', '.join(tied)} with an embedding (tied): not split in 1D")
        if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            self.unfit.append(f"{where}: on the meta device (load its weights before a 1D split)")
        self.unfit += spec.refusals(module, path)
        self.regions[id(module)] = (spec, path)
        self.seen.append(module)
        if called:
            self.boundaries[id(module)] = layouts.WholeBoundary(
                path, spec.mesh, caller, [self.mesh, *self.plan.values()]
            )

    def check_region_aliases(self, model: nn.Module) -> None:
        """A module or parameter of a 1D region also reachable at a path outside it (one module at two
        paths) would be split there and converted here: refused (``unfit``), the other path named."""
        if not self.regions:
            return
        inside: dict[int, str] = {}
        for _, where in self.regions.values():
            region = model.get_submodule(where)
            for rel, sub in region.named_modules(remove_duplicate=False):
                inside.setdefault(id(sub), f"{where}.{rel}" if rel else where)
            for rel, t in region.named_parameters(remove_duplicate=False):
                inside.setdefault(id(t), f"{where}.{rel}")
        roots = tuple(where for _, where in self.regions.values())
        outside = lambda path: not any(path == r or path.startswith(r + ".") for r in roots)  # noqa: E731
        for path, sub in model.named_modules(remove_duplicate=False):
            if path and outside(path) and id(sub) in inside:
                self.unfit.append(f"{path} ({type(sub).__name__}): is also {inside[id(sub)]}, inside a 1D region")
        for path, t in model.named_parameters(remove_duplicate=False):
            owner = path.rpartition(".")[0]
            if outside(path) and id(t) in inside and not (owner and id(model.get_submodule(owner)) in inside):
                self.unfit.append(f"{path}: is also {inside[id(t)]}, inside a 1D region (a shared parameter)")

    def raise_refused(self) -> None:
        missing = [key for key in self.plan if key not in self.planned]
        regions = [where for _, where in self.regions.values()]
        nested = [(key, r) for key in missing for r in regions if matches_inside(key, r)]
        if nested:
            lines = ", ".join(f"{key!r} inside {r!r}" for key, r in nested)
            raise ValueError(f"parallelize: a 1D region (megatron.Megatron) holds no other plan entry: {lines}")
        if missing:
            shadowed = [
                f"{key!r} names only {', '.join(self.shadowed[key])}" for key in missing if key in self.shadowed
            ]
            shadowed = f" ({'; '.join(shadowed)}, each given a more specific key)" if shadowed else ""
            raise ValueError(
                f"parallelize: plan= names no module of the model at {', '.join(map(repr, missing))}{shadowed}"
            )
        if self.unfit:
            lines = "\n  ".join(self.unfit)
            raise ValueError(
                f"parallelize: {len(self.unfit)} module(s) cannot run with 1D tensor parallelism:\n  {lines}"
            )
        if self.aliased:
            lines = "\n  ".join(self.aliased)
            n = len(self.aliased)
            raise ValueError(f"parallelize: {n} module(s) or tensor(s) reached on two meshes:\n  {lines}")
        if self.unsplit:
            lines = "\n  ".join(self.unsplit)
            raise ValueError(
                f"parallelize: {len(self.unsplit)} module(s) cannot run with context parallelism:\n  {lines}"
            )
        if self.refused:
            lines = "\n  ".join(self.refused)
            raise TypeError(
                f"parallelize: {len(self.refused)} module(s) cannot be converted, as nothing says they are correct "
                f"on blocks of the split hidden dim:\n  {lines}\nTeach parallelize with "
                f"optimus2d.convert.register_converter(cls, converter), or, for a forward that acts element by "
                f"element or on whole heads once its children are converted, and reduces over no split dim (no "
                f"loss or mean over the batch or tokens), optimus2d.convert.register_converter(cls, keep=True)"
            )

    def convert(self, module: nn.Module, path: str, mesh: Mesh | None = None) -> nn.Module:
        if id(module) not in self.done:
            self.paths.setdefault(id(module), path)
            on = self.meshes.get(id(module), mesh or self.mesh)
            if self.rehearsing:  # note every module that refuses, and go on with the others
                try:
                    self.done[id(module)] = self._convert(module, path, on)
                except (TypeError, ValueError, AttributeError) as err:  # (an attribute a converter reads: missing)
                    if isinstance(err, AttributeError):  # a part replaced by another kind: refused, not half-converted
                        err = TypeError(f"its converter cannot read it: {err}")
                    self.refused.append(f"{path or 'the model itself'} ({type(module).__name__}): {err}")
                    self.errors.append(err)
                    self.done[id(module)] = module
                self.seen.append(module)
                return self.done[id(module)]
            self.done[id(module)] = self._convert(module, path, on)
            self.seen.append(module)
            if id(module) in self.split:  # inside the boundary's hooks: its forward in the sequence layout
                spec, where = self.split[id(module)]
                spec.install(self.done[id(module)], where)
            if id(module) in self.boundaries:
                self.boundaries[id(module)].install(self.done[id(module)])
        return self.done[id(module)]

    def _convert(self, module: nn.Module, path: str, mesh: Mesh) -> nn.Module:
        if isinstance(module, (ShardedModule, Dropout2D)):
            return module
        if id(module) in self.regions:  # split by torch's parallelize_module (a meta rehearsal: as it is)
            spec, where = self.regions[id(module)]
            return module if self.rehearsing else spec.apply(module, where)
        if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) in self.tied:
            if module is not self.tied[id(module.weight)]:  # the owner itself converts as usual
                return _convert_tied(self, module, mesh)
        how = self.plans.get(id(module))
        if how is None:  # reached through a converter's convert_children without check()
            how = _plan(module, None, mesh)
            if isinstance(how, str):
                raise TypeError(f"parallelize: {path or 'the model itself'} ({type(module).__name__}): {how}")
        return how(module, mesh)


def matches_inside(key: str, region: str) -> bool:
    """Whether the plan key (a path or a glob) names a module inside ``region``'s path."""
    atoms = key.split(".")
    depth = len(region.split("."))
    return len(atoms) > depth and layouts.matches(".".join(atoms[:depth]), region)


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every child slot, a module used twice included (``named_children`` yields it once)."""
    return [(name, child) for name, child in module._modules.items() if child is not None]


def _as_is(module: nn.Module, mesh: Mesh) -> nn.Module:
    return module


def _plan(module: nn.Module, parent: nn.Module | None, mesh: Mesh) -> Converter | str:
    """How ``module`` converts, or why it cannot (``convert/blockwise.py`` says what is known to be correct)."""
    if (why := replaced_forward(module)) is not None:  # what runs is not what the class says (and no probe)
        return why
    if type(module) in (nn.LayerNorm, nn.RMSNorm) and blockwise.per_head(module, parent):  # Phi's q_layernorm
        return blockwise.replicated  # over one head's features, whole on every rank
    converter = converter_for(module)
    if converter is None and _load_library_of(module):  # e.g. the first transformers module met
        converter = converter_for(module)
    if converter is None:
        converter = next((c for r in _RECOGNISERS if (c := r(module)) is not None), None)
    if converter is not None:
        return converter
    if elementwise(module):
        return _as_is
    norm = blockwise.as_norm(module)
    if norm is not None:
        if blockwise.per_head(norm, parent):  # over head_dim, which is whole on every rank: replicated
            return blockwise.replicated
        norm_2d = RMSNorm2D if isinstance(norm, nn.RMSNorm) else LayerNorm2D
        return lambda _module, mesh: norm_2d.from_serial(norm, mesh)
    if not module._modules and blockwise.independent_of_hidden(module):  # a rotary table: replicated
        return dynamic_rope.over_the_mesh if dynamic_rope.follows_positions(module) else _as_is
    if blockwise.acts_elementwise_with_scalars(module):  # xIELU: scalars summed over the mesh in backward
        return blockwise.replicated
    weightless = blockwise.as_weightless_norm(module)
    if weightless is not None:  # OLMo's LayerNorm with no weight
        norm_2d = RMSNorm2D if isinstance(weightless, nn.RMSNorm) else LayerNorm2D
        return lambda _module, mesh: norm_2d.from_serial(weightless, mesh)
    own = [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]
    if own:
        return f"holds {', '.join(own)} and has no converter (a module that reads the full hidden size)"
    if not module._modules:
        if type(module).forward is nn.Module.forward:  # an empty holder (a ModuleDict of no layers): never called
            return _keep
        if blockwise.acts_elementwise(module):
            return _as_is
        if blockwise.acts_elementwise(module, modes=(False,)):  # timm's DropPath: it draws in training
            return blockwise.eval_only
        return "is not known to act element by element (a probe with a random input says it does not)"
    if type(module).forward is nn.Module.forward or type(module).forward is nn.Sequential.forward:
        return _keep  # no forward (a ModuleList, a holder of parts), or a chain of children
    reading = forward_reader.read_forward(module)
    problems = reading.problems + blockwise.head_problems(module, mesh)
    if problems:
        return (
            "its forward " + "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        )
    heads = mesh.q > 1 and blockwise.holds_heads(module)
    if reading.guards or reading.draws or heads:
        return _KeepAsRead(reading, heads)
    return _keep


class _KeepAsRead:
    """``keep``, for a forward the reader judged on this instance's flags: the flags it relied on are
    checked before every call, a forward whose dropout may draw runs under ``shard_rng``, and one
    that splits heads (q > 1) refuses the 4D masks it cannot take on blocks."""

    converts_children = True

    def __init__(self, reading: forward_reader.Reading, heads: bool = False) -> None:
        self.reading, self.heads = reading, heads

    def __call__(self, module: nn.Module, mesh: Mesh) -> nn.Module:
        keep(module, mesh)
        if self.reading.guards:
            module._optimus2d_guards = self.reading.guards
            module.register_forward_pre_hook(forward_reader.check_guards)
            module.register_forward_hook(forward_reader.check_guards_after)  # a flag the forward itself changed
        if self.reading.draws:
            forward_reader.draw_per_shard(module, mesh, self.reading.may_draw)
        if self.heads:  # a per-head or full-batch 4D mask: a clear error, not torch's
            blockwise.refuse_head_masks(module, mesh)
        return module
