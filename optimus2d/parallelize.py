"""parallelize(): a serial torch model → the same model on the mesh, weights and all.

Every submodule is replaced by its 2D twin (``from_serial``) through a registry of converters;
element-wise modules stay as they are; a module that holds parameters (or a leaf that is not
element-wise) and has no converter is refused with its path in the model, never silently left
serial. Like torch's ``parallelize_module``, the conversion happens in place.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from optimus2d import families
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


def register_converter(cls: type, converter: Converter | None = None):
    """Teach ``parallelize`` to convert modules of type ``cls`` (and subclasses that keep its forward).

    ``converter(module, mesh)`` returns the module that replaces ``module``. Use directly or as a
    decorator::

        @optimus2d.register_converter(MyNorm)
        def _(norm, mesh):
            return optimus2d.RMSNorm2D.from_serial(as_rmsnorm(norm), mesh)
    """

    def add(fn: Converter) -> Converter:
        _CONVERTERS[cls] = fn
        return fn

    return add(converter) if converter is not None else add


def _stack(module: nn.Module, mesh: Mesh) -> nn.Module:
    layers = nn.ModuleList(_convert(layer, mesh, f"layers.{n}", {}) for n, layer in enumerate(module.layers))
    norm = _convert(module.norm, mesh, "norm", {}) if module.norm is not None else None
    return TransformerStack2D(layers, norm)


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
    register_converter(_cls, _fn)


def converter_for(module: nn.Module) -> Converter | None:
    """The registered converter for ``module``'s type or a base class whose forward it keeps."""
    for cls in type(module).__mro__:
        if cls in _CONVERTERS and type(module).forward is cls.forward:
            return _CONVERTERS[cls]
    return None


def parallelize(module: nn.Module, mesh: Mesh) -> nn.Module:
    """The model on ``mesh``, converted in place from the serial ``module`` and returned.

    The result takes ``optimus2d.scatter``-ed activations (and ``scatter_batch``-ed ids) and gives
    this rank's blocks; ``serial_state_dict`` of it has ``module``'s keys and values.
    Raises ``TypeError`` naming the submodule's path when a part cannot be converted.
    """
    return _convert(module, mesh, "", {})


def convert_children(module: nn.Module, mesh: Mesh) -> None:
    """Convert every child of ``module`` in place (for converters of containers with own tensors)."""
    for name, child in module.named_children():
        setattr(module, name, _convert(child, mesh, name, {}))


def _convert(module: nn.Module, mesh: Mesh, path: str, tied: dict[int, Embedding2D]) -> nn.Module:
    """``tied`` maps the serial weight of every converted nn.Embedding to its Embedding2D, so that an
    output head sharing that weight (a tied LM head) becomes a TiedHead2D on the same Parameter."""
    where = path or "the model itself"
    if isinstance(module, (ShardedModule, Dropout2D)):
        return module
    if isinstance(module, nn.Linear) and id(module.weight) in tied:
        if module.bias is not None:
            raise TypeError(f"parallelize: {where} shares an embedding's weight but has a bias; not supported")
        return TiedHead2D(tied[id(module.weight)])
    converter = converter_for(module)
    if converter is None and families.register_for(module):  # e.g. the first transformers module met
        converter = converter_for(module)
    if converter is not None:
        converted = converter(module, mesh)
        if isinstance(module, nn.Embedding) and isinstance(converted, Embedding2D):
            tied[id(module.weight)] = converted
        return converted
    if isinstance(module, ELEMENTWISE):
        return module
    own = [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]
    name = type(module).__name__
    if own:
        raise TypeError(
            f"parallelize: {where} ({name}) holds {', '.join(own)} and has no converter; a module that reads "
            f"the full hidden size would give wrong results on the mesh. Register one with "
            f"optimus2d.register_converter({name})"
        )
    children = list(module.named_children())
    if not children and not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        raise TypeError(
            f"parallelize: {where} ({name}) is not known to act element by element and has no converter; "
            f"register one with optimus2d.register_converter({name})"
        )
    for child_name, child in children:
        setattr(module, child_name, _convert(child, mesh, f"{path}.{child_name}" if path else child_name, tied))
    return module
