"""A serial model → the same model on the mesh: ``parallelize`` and what it is built from.

``parallelizer.py`` checks the model and the plan over the mesh, and ``walk.py`` replaces each
module through the converter registry of ``registry.py`` (``register_converter``,
``register_recogniser``, ``register_library`` for a library's converters registered when its first
module is met); ``blockwise.py``, ``forward_reader.py`` and
``forward_values.py`` judge which forwards are correct on blocks as they are; ``positions.py``
converts a learned position table that computes its ids from a mask; ``tied.py`` keeps
shared embedding tables shared; ``layouts.py`` moves tensors between per-module meshes
(``plan=``); ``meta_init.py`` initialises a model built on the meta device block by block.

This is the API for writing converters; a training script needs only ``optimus2d.parallelize``.
"""

from optimus2d.convert.auto import Auto
from optimus2d.convert.blockwise import as_norm, forward_problems
from optimus2d.convert.meta_init import materialize
from optimus2d.convert.parallelizer import (
    ELEMENTWISE,
    Converter,
    choose_plan,
    convert_children,
    converter_for,
    keep,
    parallelize,
    register_converter,
    register_library,
    register_recogniser,
)
from optimus2d.convert.positions import positions_from_inputs

register_recogniser(positions_from_inputs)  # a learned position table computing its ids (OPT's, BioGPT's)

__all__ = [
    "ELEMENTWISE",
    "Auto",
    "Converter",
    "as_norm",
    "choose_plan",
    "convert_children",
    "converter_for",
    "forward_problems",
    "keep",
    "materialize",
    "parallelize",
    "register_converter",
    "register_library",
    "register_recogniser",
]
