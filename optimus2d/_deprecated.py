"""The import paths of release 0.1, kept working for one more release with a ``DeprecationWarning``.

The package was laid out as rooms (``comm/ layers/ convert/ families/ checkpoint/ pipeline/
cost/``; docs/ARCHITECTURE.md). An old module path (``optimus2d.pipeline_models``) imports a
stand-in module whose every attribute warns once and comes from the new home; an old top-level
name (``optimus2d.Linear2D``) does the same through ``optimus2d.__getattr__``. Nothing here imports
the rest of the package until an old name is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old module → (its new module, {name: the module it went to instead, where it differs})
MODULES: dict[str, tuple[str, dict[str, str]]] = {
    "optimus2d.blockwise": ("optimus2d.convert.blockwise", {}),
    "optimus2d.forward_reader": ("optimus2d.convert.forward_reader", {}),
    "optimus2d.forward_values": ("optimus2d.convert.forward_values", {}),
    "optimus2d.layouts": ("optimus2d.convert.layouts", {}),
    "optimus2d.meta_init": ("optimus2d.convert.meta_init", {}),
    "optimus2d.parallelize": ("optimus2d.convert.parallelizer", {}),
    "optimus2d.checkpoint_files": ("optimus2d.checkpoint.files", {}),
    "optimus2d.serial": ("optimus2d.checkpoint.serial", {}),
    "optimus2d.pretrained": ("optimus2d.checkpoint.pretrained", {}),
    "optimus2d.pipeline_bubbles": ("optimus2d.pipeline.bubbles", {}),
    "optimus2d.pipeline_data_parallel": ("optimus2d.pipeline.data_parallel", {}),
    "optimus2d.pipeline_layouts": ("optimus2d.pipeline.layouts", {}),
    "optimus2d.pipeline_partition": ("optimus2d.pipeline.partition", {}),
    "optimus2d.pipeline_simulator": ("optimus2d.pipeline.simulator", {}),
    "optimus2d.pipeline_gpt2": ("optimus2d.pipeline.models.gpt2", {}),
    "optimus2d.pipeline_llava": ("optimus2d.pipeline.models.llava", {}),
    "optimus2d.pipeline_models": (
        "optimus2d.pipeline.models.llama",
        {"save_stages": "optimus2d.checkpoint.stages", "load_stages": "optimus2d.checkpoint.stages"},
    ),
    "optimus2d.memory": ("optimus2d.cost.memory", {}),
    "optimus2d.plan": ("optimus2d.cost.planner", {}),
    "optimus2d.plan.scale": ("optimus2d.cost.scale", {}),
    "optimus2d.random": ("optimus2d.comm.rng", {"Dropout2D": "optimus2d.layers.dropout"}),
    "optimus2d.recompute": ("optimus2d.comm.recompute", {}),
}

# names that left the top of the package → their new module
TOP: dict[str, str] = {
    **dict.fromkeys(
        ("MLP2D", "Dropout2D", "Embedding2D", "LayerNorm2D", "Linear2D", "MultiheadAttention2D", "RMSNorm2D"),
        "optimus2d.layers",
    ),
    "TransformerBlock2D": "optimus2d.layers",
    "PeerFailedError": "optimus2d.faults",
    "report_failure": "optimus2d.faults",
    **dict.fromkeys(
        ("as_norm", "convert_children", "forward_problems", "keep", "register_converter", "register_recogniser"),
        "optimus2d.convert",
    ),
}
TOP_MODULES = {"blockwise": "optimus2d.convert.blockwise"}


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn at the user's line: ``stacklevel`` counts this function, its caller, and so on."""
    message = f"{old} is deprecated: use {new} (the old path goes in the next release)"
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def moved_attribute(module: str, name: str, new: types.ModuleType, names: tuple[str, ...]):
    """``module.name`` for a module's ``__getattr__``: ``new.name`` with a warning, if ``name`` moved there."""
    if name not in names:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{new.__name__}.{name}", stacklevel=4)  # past the module's __getattr__
    return getattr(new, name)


def top_attribute(name: str):
    """``optimus2d.<name>`` for a name that left the top of the package."""
    if name in TOP_MODULES:
        _warn(f"optimus2d.{name}", TOP_MODULES[name], stacklevel=4)
        return importlib.import_module(TOP_MODULES[name])
    if name not in TOP:
        raise AttributeError(f"module 'optimus2d' has no attribute {name!r}")
    _warn(f"optimus2d.{name}", f"{TOP[name]}.{name}", stacklevel=4)
    return getattr(importlib.import_module(TOP[name]), name)


class _Moved(types.ModuleType):
    """A module that moved: each attribute read warns and comes from the new home."""

    def __init__(self, old: str) -> None:
        super().__init__(old, f"Deprecated: {old} moved to {MODULES[old][0]}.")
        self._optimus2d_moved = MODULES[old]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        new, elsewhere = self._optimus2d_moved
        home = elsewhere.get(name, new)
        _warn(f"{self.__name__}.{name}", f"{home}.{name}")
        return getattr(importlib.import_module(home), name)

    def __dir__(self) -> list[str]:
        new, elsewhere = self._optimus2d_moved
        return sorted({*dir(importlib.import_module(new)), *elsewhere})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "optimus2d.plan")

    def create_module(self, spec):
        return _Moved(spec.name)

    def exec_module(self, module) -> None:
        if module.__name__ == "optimus2d.plan":
            module.__path__ = []  # so that optimus2d.plan.scale can be found under it


def install() -> None:
    """Let the old module paths import (called once by ``optimus2d/__init__.py``)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())  # before the path finder: a stale folder must not win
    # optimus2d.parallelize is also the function at the top: the stand-in is made now, so that an
    # `import optimus2d.parallelize` finds it made and never replaces the function with it
    sys.modules.setdefault("optimus2d.parallelize", _Moved("optimus2d.parallelize"))
