"""Context parallelism: the sequence split over the mesh's depth axis (issue 27).

``balance``: which sequence blocks each context-parallel rank holds, balanced by the unmasked
(query, key) pairs of its queries (``assign``: "uniform", "head_tail", "makespan"), and the masks
it is measured on (``causal_mask``, ``image_text_mask``, ``document_mask``). ``attention``: the
sequence layout's ``scatter``/``gather`` (c = depth; batch over col, hidden over row), this rank's
``positions``, and ``attention`` across the shards (K and V all-gathered over depth).
``parallel``: ``ContextParallel``, a ``parallelize`` plan value that runs one module (the LLM) with
its sequence split while the rest of the model (the encoder, the head) keeps the batch layout.
"""

from optimus2d.context.attention import attention, gather, positions, scatter, scatter_batch
from optimus2d.context.balance import (
    METHODS,
    Assignment,
    assign,
    causal_mask,
    document_mask,
    image_text_mask,
    makespan,
)
from optimus2d.context.hf import sequence_parallel
from optimus2d.context.parallel import ContextParallel

__all__ = [
    "METHODS",
    "Assignment",
    "ContextParallel",
    "assign",
    "attention",
    "causal_mask",
    "document_mask",
    "gather",
    "image_text_mask",
    "makespan",
    "positions",
    "scatter",
    "scatter_batch",
    "sequence_parallel",
]
