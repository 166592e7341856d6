"""The converter registry: what ``parallelize`` knows how to convert, and how it learns more.

The converters by class (filled by ``walk.register_converter``: its ``keep=True`` converts children
through the walk), ``register_recogniser`` (a structure recognised by its children and forward),
``register_library`` (a library's converters, registered when its first module is met);
``converter_for`` finds the one for a module. The walk that uses them is ``convert/walk.py``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.layers.base import runs_forward_of

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


def elementwise(module: nn.Module) -> bool:
    """``module`` is one of ``ELEMENTWISE`` and runs that class's forward (a subclass that rewrites
    the forward is not trusted: what it computes is not known)."""
    return runs_forward_of(module, ELEMENTWISE)


Recogniser = Callable[[nn.Module], "Converter | None"]
_RECOGNISERS: list[Recogniser] = []


def register_recogniser(recognise: Recogniser) -> Recogniser:
    """Teach ``parallelize`` a structure: ``recognise(module)`` returns a converter for a module it
    recognises (by the children it holds and how its forward uses them), else None. Asked, in order of
    registration, about each module with no converter of its class."""
    _RECOGNISERS.append(recognise)
    return recognise


Finish = Callable[[nn.Module, Mesh], None]
# library → (its registration, not run yet or None once run; what runs on each converted model)
_LIBRARIES: dict[str, tuple[Callable[[], None] | None, Finish | None]] = {}


def register_library(name: str, register: Callable[[], None], finish: Finish | None = None) -> None:
    """Register the converters of the library ``name`` (a top-level package, e.g. ``"transformers"``)
    lazily: ``register()`` runs when ``parallelize`` first meets a module of a class defined there,
    so its classes are imported only when used; from then on ``finish(model, mesh)`` runs on every
    model ``parallelize`` converts (e.g. Hugging Face's ``labels=`` and ``generate()``)."""
    _LIBRARIES[name] = (register, finish)


def _load_library_of(module: nn.Module) -> bool:
    """Run the registration of ``module``'s library, if it has one not run yet; True if it ran."""
    library = type(module).__module__.split(".")[0]
    register, finish = _LIBRARIES.get(library, (None, None))
    if register is None:
        return False
    _LIBRARIES[library] = (None, finish)
    register()
    return True


def converter_for(module: nn.Module) -> Converter | None:
    """The registered converter for ``module``'s type or a base class whose forward it keeps."""
    for cls in type(module).__mro__:
        if cls in _CONVERTERS and type(module).forward is cls.forward:
            return _CONVERTERS[cls]
    return None
