"""An element-wise activation applied inside a product: the product keeps its input, not its output.

``fc2(act(h))`` in torch keeps both h (for act's backward) and act(h) (for fc2's weight gradient):
2·ffn elements per row of the MLP's widest tensor. A product given ``activation=act`` takes h,
applies act in its forward and saves h alone; its backward recomputes act(h) (the same function
on the same tensor: bit-identical) for the weight gradient and carries the input gradient through
act. Only the MLP's ffn-wide tensor is then kept once per row: half its memory, for one more
element-wise op in backward.

The activation must be element-wise and deterministic (GELU, ReLU, SiLU, tanh, ...). Being
element-wise, it commutes with moving blocks between ranks, so a product may move h and apply
act on arrival.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Activation = Callable[[torch.Tensor], torch.Tensor] | None


def activated(pre: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``activation(pre)`` (or ``pre`` when there is none), in a product's forward."""
    return pre if activation is None else activation(pre)


def _input_derivative(activation: Activation):
    """``(grad, pre) -> grad through activation`` for activations whose derivative needs only their
    input (the aten ops their own autograd formulas call, so bit-identical); None for the others.
    Modules match by exact type: a subclass may compute something else in its ``forward``."""
    kind = type(activation)
    if activation is F.gelu or kind is nn.GELU:
        approximate = getattr(activation, "approximate", "none")
        return lambda grad, pre: torch.ops.aten.gelu_backward(grad, pre, approximate=approximate)
    if activation is F.silu or kind is nn.SiLU:
        return torch.ops.aten.silu_backward
    if activation in (F.relu, torch.relu) or kind is nn.ReLU:
        return lambda grad, pre: torch.ops.aten.threshold_backward(grad, pre, 0)
    return None


def kept_for_backward(ctx, a: torch.Tensor, activation: Activation) -> torch.Tensor | None:
    """``a`` (A of a product A·B, before its activation) where backward reads it: for B's gradient,
    or for A's through an activation; else None. A frozen weight (B needs no gradient) under a
    plain input keeps no activation at all."""
    need_a, need_b = ctx.needs_input_grad[:2]
    return a if need_b or (need_a and activation is not None) else None


class Recomputed:
    """In backward: ``value`` = activation(pre) again (made when first read), and ``grad`` takes
    dL/d(value) to dL/d(pre).

    ``grad`` drops ``value`` first: for GELU, SiLU and ReLU, whose derivative reads the input alone,
    the recomputed activation is freed before the input gradient is made (if the caller holds no
    other reference), so backward's peak holds pre, dL/d(value) and dL/d(pre) — what torch's holds.
    A caller that needs no weight gradient never reads ``value``, and it is never made.
    """

    def __init__(self, pre: torch.Tensor, activation: Activation) -> None:
        self._pre, self._activation = pre, activation
        self._derivative = _input_derivative(activation)
        self._leaf = self._out = self._value = None

    @property
    def value(self) -> torch.Tensor:
        if self._activation is None:
            return self._pre
        if self._value is None:
            if self._derivative is not None:
                with torch.no_grad():
                    self._value = self._activation(self._pre)
            else:
                self._record()
                self._value = self._out.detach()
        return self._value

    def _record(self) -> None:
        with torch.enable_grad():
            self._leaf = self._pre.detach().requires_grad_()
            self._out = self._activation(self._leaf)

    def grad(self, grad_value: torch.Tensor) -> torch.Tensor:
        self._value = None
        if self._activation is None:
            return grad_value
        if self._derivative is not None:
            return self._derivative(grad_value, self._pre)
        if self._out is None:
            self._record()
        grad = torch.autograd.grad(self._out, self._leaf, grad_value)[0]
        self._leaf = self._out = None
        return grad
