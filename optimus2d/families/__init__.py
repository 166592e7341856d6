"""Converters for model families from other libraries, registered when a model from them is met.

``hf``: Hugging Face ``transformers`` (LLaMA and the decoders shaped like it, GPT-2, BERT, T5/BART,
ViT/CLIP, LLaVA, OPT, BLOOM and MPT); ``timm``: timm's ``VisionTransformer``. Importing this package registers each
library with ``convert.register_library``: the files of a library are imported, and their
``register()`` run, only when ``parallelize`` first meets a module of that library.
"""

from __future__ import annotations

import importlib

from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.convert.parallelizer import register_library

# library → the files that register its classes
_FILES = {
    "transformers": (
        "hf",
        "hf_causal_lm",
        "hf_vision",
        "hf_bert",
        "hf_seq2seq",
        "hf_llava",
        "hf_opt",
        "hf_alibi",
        "hf_inputs",
        "hf_methods",
    ),
    "timm": ("timm",),
}


def _each(library: str, what: str):
    for name in _FILES[library]:
        fn = getattr(importlib.import_module(f"optimus2d.families.{name}"), what, None)
        if fn is not None:
            yield fn


def _library(library: str) -> None:
    def register() -> None:
        for fn in _each(library, "register"):
            fn()

    def finish(root: nn.Module, mesh: Mesh) -> None:
        for fn in _each(library, "finish"):
            fn(root, mesh)

    register_library(library, register, finish)


for _name in _FILES:
    _library(_name)
