"""optimus2d's autograd Functions differentiate once: a backward under ``create_graph=True`` is refused.

Their backwards communicate (a SUMMA's broadcasts and reductions, a norm's row all-reduce, ...) or
feed backwards that do. Run with ``create_graph=True`` (a gradient penalty, a Hessian-vector
product), a backward's graph would hold only its local arithmetic: the second-order gradients came
back silently wrong (a weight's gradient 362 off, 497 in scale, on a 2×2 mesh), or one rank raised
inside a collective while its peers waited. ``first_order`` refuses it before anything is sent:
autograd runs every backward with grad mode on exactly when ``create_graph=True``, and every rank runs
the same backward, so each raises at its first such Function, before its collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def first_order(backward: Callable) -> Callable:
    """Decorate an autograd ``Function``'s ``backward`` (below ``@staticmethod``): a ``RuntimeError``
    where it runs with grad mode on (``create_graph=True``, double backward), unless its ``ctx.mesh``
    is of one rank (nothing is sent: its graph is the whole computation's)."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        mesh = getattr(ctx, "mesh", None)
        if torch.is_grad_enabled() and getattr(mesh, "size", None) != 1:  # one rank: its part is the whole
            raise RuntimeError(
                f"optimus2d: double backward (create_graph=True: a gradient differentiated again) through "
                f"{type(ctx).__name__.removesuffix('Backward')} is not supported: its backward communicates "
                f"between ranks, and a graph of it would hold this rank's part only; compute second-order "
                f"terms on the serial model"
            )
        return backward(ctx, *grads)

    return checked
