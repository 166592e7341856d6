"""Context parallelism: the sequence split over ranks (issue 27; in progress).

``balance``: which sequence blocks each context-parallel rank holds, balanced by the unmasked
(query, key) pairs of its queries (``assign``: "uniform", "head_tail", "makespan"), and the masks
it is measured on (``causal_mask``, ``image_text_mask``, ``document_mask``).
"""

from optimus2d.context.balance import (
    METHODS,
    Assignment,
    assign,
    causal_mask,
    document_mask,
    image_text_mask,
    makespan,
)

__all__ = ["METHODS", "Assignment", "assign", "causal_mask", "document_mask", "image_text_mask", "makespan"]
