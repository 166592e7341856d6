"""Learned position tables whose forward computes the ids it looks up (OPT's, BioGPT's).

A recogniser, registered for every model (``convert/__init__.py``).

Such a table is an ``nn.Embedding`` subclass whose forward takes a mask (or positions) and ends in
``return super().forward(ids)``: the positions come from the mask (``cumsum`` along the sequence,
an offset), the lookup is the table's. On the mesh the table is an ``Embedding2D`` (``[⌈P/q⌉, h/q]``
per rank) and the ids are computed by the *library's own forward*, run on a stand-in of the module
whose ``super().forward(ids)`` hands the ids back instead of looking them up. So no line of the
position arithmetic is rewritten here, and what the stand-in may do is narrow:

- it holds no tensor (``self.weight`` is not there: a forward that reads the table is refused);
- its forward must return exactly what ``super().forward`` returned (anything computed from the
  looked-up rows fails, loudly, on the marker it gets instead);
- the ids of a row may depend only on that row (the batch is split over the mesh): probed when the
  model is converted, on random masks, whole against in halves.

forward: ``(mask [b/(d·q), s], ...)`` as the library's → ``[b/(d·q), s, h/q]``; the lookup sends
what ``Embedding2D``'s does.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.convert.parallelizer import Converter
from optimus2d.layers.embedding import Embedding2D


class _Lookup:
    """What the stand-in's ``super().forward(ids)`` returns: the ids, and nothing to compute with."""

    __slots__ = ("ids",)

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids


class _HandsIdsBack(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> _Lookup:  # type: ignore[override]
        return _Lookup(ids)


class PositionsFromInputs2D(Embedding2D):
    """``Embedding2D`` whose ids are computed from its inputs by a library's forward (``_stand_in``)."""

    _ids_of: nn.Module

    @classmethod
    def from_serial(cls, table: nn.Embedding, mesh: Mesh) -> PositionsFromInputs2D:
        """``table`` (an ``nn.Embedding`` subclass computing its ids) on the mesh."""
        out = super().from_serial(table, mesh)
        out.__dict__["_ids_of"] = _stand_in(table)  # not a child: it holds nothing
        return out

    def input_refusal(self, args: tuple, kwargs: dict) -> BaseException | None:
        return None  # the inputs are a mask and positions; the ids are checked in the lookup

    def forward(self, *args, **kwargs) -> torch.Tensor:
        self._ids_of.training = self.training
        return super().forward(_ids(self._ids_of, args, kwargs))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ids from {type(self._ids_of).__mro__[1].__name__}.forward"


def _ids(stand_in: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    out = stand_in(*args, **kwargs)
    if not isinstance(out, _Lookup):
        name = type(stand_in).__mro__[1].__name__
        raise TypeError(f"{name}.forward returned something other than its table's rows: not known to be exact")
    return out.ids


def _stand_in(module: nn.Module) -> nn.Module:
    """A tensorless copy of ``module`` whose ``super().forward(ids)`` returns ``_Lookup(ids)``."""
    cls = type(module)
    stand_in_cls = type(f"{cls.__name__}Ids", (cls, _HandsIdsBack), {})
    stand_in = stand_in_cls.__new__(stand_in_cls)
    nn.Module.__init__(stand_in)
    for key, value in vars(module).items():
        if not key.startswith("_") and not isinstance(value, (torch.Tensor, nn.Module)):
            stand_in.__dict__[key] = value
    return stand_in


def _returns_only_super_lookup(cls: type) -> bool:
    """Every ``return`` of ``cls.forward`` is ``super().forward(x)``, and the forward names neither
    ``self.weight`` nor ``super()`` otherwise."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
    returns = [n for n in ast.walk(tree) if isinstance(n, ast.Return)]
    lookups = [
        r.value
        for r in returns
        if isinstance(r.value, ast.Call) and ast.unparse(r.value.func) == "super().forward" and len(r.value.args) == 1
    ]
    supers = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "super"]
    weights = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "weight"]
    return bool(returns) and len(lookups) == len(returns) == len(supers) and not weights


def _rows_independent(stand_in: nn.Module) -> bool:
    """The ids of a row depend on that row only: a batch of random masks (ones first, then a random
    tail of zeros and ones) gives the same ids whole as in two halves."""
    generator = torch.Generator().manual_seed(0)
    mask = (torch.rand(4, 9, generator=generator) > 0.3).long()
    mask[:, :3] = 1
    try:
        whole = _ids(stand_in, (mask,), {})
        halves = torch.cat([_ids(stand_in, (mask[:2],), {}), _ids(stand_in, (mask[2:],), {})])
    except Exception:
        return False
    return whole.shape[0] == 4 and torch.equal(whole, halves)


def positions_from_inputs(module: nn.Module) -> Converter | None:
    """Recognise a learned position table computing its own ids (see the module docstring)."""
    cls = type(module)
    if not isinstance(module, nn.Embedding) or cls.__bases__ != (nn.Embedding,) or cls.forward is nn.Embedding.forward:
        return None
    if set(dict(module.named_parameters(recurse=False))) != {"weight"} or list(module.buffers(recurse=False)):
        return None
    if list(module.children()) or not _returns_only_super_lookup(cls):
        return None
    if not _rows_independent(_stand_in(module)):
        return None

    return PositionsFromInputs2D.from_serial
