"""parallelize(): a serial torch model → the same model on the mesh, weights and all.

Every submodule is replaced by its 2D twin (``from_serial``) through a registry of converters;
element-wise modules stay as they are; a module that holds parameters (or a leaf that is not
element-wise) and has no converter is refused with its path in the model, never silently left
serial. Like torch's ``parallelize_module``, the conversion happens in place.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from optimus2d import families
from optimus2d.comm.agreement import check_same_tensors
from optimus2d.comm.mesh import Mesh
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
from optimus2d.layers.block import TransformerDecoderBlock2D, TransformerStack2D
from optimus2d.layers.embedding import TiedHead2D

Converter = Callable[[nn.Module, Mesh], nn.Module]
_CONVERTERS: dict[type, Converter] = {}
_CONVERTS_CHILDREN: set = set()  # converters that call convert_children: check() looks inside them

# Leaves that act on each element alone, so a block of the input gives the block of the output.
ELEMENTWISE: tuple[type, ...] = (
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.Softplus,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
)


def keep(module: nn.Module, mesh: Mesh) -> nn.Module:
    """The converter that keeps ``module`` as it is: its children are converted, its forward kept."""
    convert_children(module, mesh)
    return module


def register_converter(
    cls: type, converter: Converter | None = None, *, converts_children: bool = False, keep: bool = False
):
    """Teach ``parallelize`` to convert modules of type ``cls`` (and subclasses that keep its forward).

    ``converter(module, mesh)`` returns the module that replaces ``module``. Use directly or as a
    decorator::

        @optimus2d.register_converter(MyNorm)
        def _(norm, mesh):
            return optimus2d.RMSNorm2D.from_serial(as_rmsnorm(norm), mesh)

    ``keep=True`` (no converter) declares that ``cls``'s forward is correct on blocks as it is —
    it acts element by element on the hidden dim, or only on whole heads, once its children are
    converted — so ``parallelize`` converts its children and keeps it. That is a promise only its
    author can make: a forward that reduces, splits or reshapes the hidden dim by a size gives
    wrong numbers on the mesh.
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


def _stack(module: nn.Module, mesh: Mesh) -> nn.Module:
    convert_children(module, mesh)
    return TransformerStack2D(module.layers, module.norm)


for _cls, _fn in (
    (nn.Linear, Linear2D.from_serial),
    (nn.LayerNorm, LayerNorm2D.from_serial),
    (nn.RMSNorm, RMSNorm2D.from_serial),
    (nn.Embedding, Embedding2D.from_serial),
    (nn.MultiheadAttention, MultiheadAttention2D.from_serial),
    (nn.TransformerEncoderLayer, TransformerBlock2D.from_serial),
    (nn.TransformerDecoderLayer, TransformerDecoderBlock2D.from_serial),
    (nn.TransformerEncoder, _stack),
    (nn.TransformerDecoder, _stack),
    (nn.Dropout, lambda m, mesh: Dropout2D(m.p, mesh=mesh)),
):
    register_converter(_cls, _fn, converts_children=_fn is _stack)


def converter_for(module: nn.Module) -> Converter | None:
    """The registered converter for ``module``'s type or a base class whose forward it keeps."""
    for cls in type(module).__mro__:
        if cls in _CONVERTERS and type(module).forward is cls.forward:
            return _CONVERTERS[cls]
    return None


def parallelize(module: nn.Module, mesh: Mesh, *, check: bool | None = None) -> nn.Module:
    """The model on ``mesh``, converted in place from the serial ``module`` and returned.

    The result takes ``optimus2d.scatter``-ed activations (and ``scatter_batch``-ed ids) and gives
    this rank's blocks; ``serial_state_dict`` of it has ``module``'s keys and values. A module used
    twice is converted once; an ``nn.Linear`` sharing an ``nn.Embedding``'s weight (a tied head)
    becomes a ``TiedHead2D`` on the same Parameter. The whole model is checked before anything is
    changed: ``TypeError`` names the first submodule that cannot be converted, or a parameter
    shared in a way that cannot be kept. Every rank must hold the same serial weights (as torch's
    ``distribute_tensor`` assumes): their checksums are compared over the mesh and the weights that
    differ are named in a ``ValueError`` on every rank (``check=False``, or a mesh built with
    ``check="off"``, skips this one all-gather).
    """
    walk = _Walk(mesh, {}, _tied_embeddings(module))
    walk.check(module, "")
    if _current.get() is None:  # a converter's own parallelize() of a part: the whole was checked
        tensors = [*module.named_parameters(remove_duplicate=True), *module.named_buffers(remove_duplicate=True)]
        check_same_tensors(mesh, "parallelize: the serial weights", tensors, check)
    token = _current.set(walk)
    try:
        out = walk.convert(module, "")
    finally:
        _current.reset(token)
    if _current.get() is None:
        families.finish(out, mesh)
    return out


def convert_children(module: nn.Module, mesh: Mesh) -> None:
    """Convert every child of ``module`` in place (for converters of modules that hold tensors too)."""
    walk = _current.get() or _Walk(mesh, {}, _tied_embeddings(module))
    for name, child in _children(module):
        setattr(module, name, walk.convert(child, name))


_current: contextvars.ContextVar[_Walk | None] = contextvars.ContextVar("optimus2d_parallelize", default=None)


def _tied_embeddings(root: nn.Module) -> dict[int, nn.Embedding]:
    """Parameters held by more than one module: only an Embedding's weight shared with bias-free
    Linear heads is supported (returned: weight id → embedding); any other sharing is refused."""
    owners: dict[int, dict[int, tuple[str, nn.Module, str]]] = {}
    for path, sub in root.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is not None:
                owners.setdefault(id(param), {})[id(sub)] = (path or "the model itself", sub, name)
    tied = {}
    for pid, holders in owners.items():
        if len(holders) < 2:
            continue
        subs = [sub for _, sub, _ in holders.values()]
        embeddings = [m for m in subs if isinstance(m, nn.Embedding)]
        heads = [m for m in subs if isinstance(m, nn.Linear) and m.bias is None and id(m.weight) == pid]
        if len(embeddings) == 1 and len(heads) == len(subs) - 1:
            tied[pid] = embeddings[0]
        else:
            where = ", ".join(f"{path}.{name}" for path, _, name in holders.values())
            raise TypeError(f"parallelize: one parameter is shared by {where}; only a tied embedding/head is supported")
    return tied


@dataclass
class _Walk:
    mesh: Mesh
    done: dict[int, nn.Module]  # id(serial module) → its conversion: a module used twice converts once
    tied: dict[int, nn.Embedding]  # id(shared weight) → the embedding that owns it

    def check(self, module: nn.Module, path: str) -> None:
        """Raise for anything that would be refused, before any module is changed."""
        if isinstance(module, (ShardedModule, Dropout2D)) or getattr(module, "_optimus2d_mesh", None) is not None:
            return
        if isinstance(module, nn.Linear) and id(module.weight) in self.tied:
            return
        converter = converter_for(module)
        if converter is None and families.register_for(module):  # e.g. the first transformers module met
            converter = converter_for(module)
        if converter is not None:
            if converter in _CONVERTS_CHILDREN:
                for name, child in _children(module):
                    self.check(child, f"{path}.{name}" if path else name)
            return
        _refuse_unconvertible(module, path)
        for name, child in _children(module):
            self.check(child, f"{path}.{name}" if path else name)

    def convert(self, module: nn.Module, path: str) -> nn.Module:
        if id(module) not in self.done:
            self.done[id(module)] = self._convert(module, path)
        return self.done[id(module)]

    def _convert(self, module: nn.Module, path: str) -> nn.Module:
        if isinstance(module, (ShardedModule, Dropout2D)):
            return module
        if isinstance(module, nn.Linear) and id(module.weight) in self.tied:
            return TiedHead2D(self.convert(self.tied[id(module.weight)], "(tied embedding)"))
        converter = converter_for(module)
        if converter is not None:
            return converter(module, self.mesh)
        if isinstance(module, ELEMENTWISE):
            return module
        _refuse_unconvertible(module, path)
        for child_name, child in _children(module):
            setattr(module, child_name, self.convert(child, f"{path}.{child_name}" if path else child_name))
        return module


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every child slot, a module used twice included (``named_children`` yields it once)."""
    return [(name, child) for name, child in module._modules.items() if child is not None]


def _refuse_unconvertible(module: nn.Module, path: str) -> None:
    if isinstance(module, ELEMENTWISE):
        return
    where, name = path or "the model itself", type(module).__name__
    own = [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]
    if own:
        raise TypeError(
            f"parallelize: {where} ({name}) holds {', '.join(own)} and has no converter; a module that reads "
            f"the full hidden size would give wrong results on the mesh. Register one with "
            f"optimus2d.register_converter({name})"
        )
    if not list(module.children()) and not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        raise TypeError(
            f"parallelize: {where} ({name}) is not known to act element by element and has no converter; "
            f"register one with optimus2d.register_converter({name})"
        )
