"""Converters for model families from other libraries, registered when a model from them is met.

``hf``: Hugging Face ``transformers`` (LLaMA and the decoders shaped like it, GPT-2); ``timm``:
timm's ``VisionTransformer``. Each file's ``register()`` teaches ``parallelize`` its classes.
"""

from __future__ import annotations

import importlib

from torch import nn

_registered: set[str] = set()
# library → the files that register its classes
_FILES = {"transformers": ("hf", "hf_causal_lm", "hf_vision", "hf_bert", "hf_seq2seq", "hf_llava"), "timm": ("timm",)}


def register_for(module: nn.Module) -> bool:
    """Register the converters of the library ``module`` comes from; True if there were any."""
    library = type(module).__module__.split(".")[0]
    if library not in _FILES or library in _registered:
        return False
    _registered.add(library)
    for name in _FILES[library]:
        register = getattr(importlib.import_module(f"optimus2d.families.{name}"), "register", None)
        if register is not None:
            register()
    return True


def finish(root: nn.Module, mesh) -> None:
    """After ``parallelize`` converted ``root``: each registered file's ``finish(root, mesh)``, if it
    has one (e.g. Hugging Face's ``labels=`` and ``generate()`` on the converted model)."""
    for library in sorted(_registered):
        for name in _FILES[library]:
            fn = getattr(importlib.import_module(f"optimus2d.families.{name}"), "finish", None)
            if fn is not None:
                fn(root, mesh)
