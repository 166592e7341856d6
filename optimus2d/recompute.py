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
    input (the aten ops their own autograd formulas call, so bit-identical); None for the others."""
    approximate = getattr(activation, "approximate", "none")
    if activation is F.gelu or isinstance(activation, nn.GELU):
        return lambda grad, pre: torch.ops.aten.gelu_backward(grad, pre, approximate=approximate)
    if activation is F.silu or isinstance(activation, nn.SiLU):
        return torch.ops.aten.silu_backward
    if activation in (F.relu, torch.relu) or isinstance(activation, nn.ReLU):
        return lambda grad, pre: torch.ops.aten.threshold_backward(grad, pre, 0)
    return None


class Recomputed:
    """In backward: ``value`` = activation(pre) again, and ``grad`` takes dL/d(value) to dL/d(pre).

    ``grad`` drops ``value`` first: for GELU, SiLU and ReLU, whose derivative reads the input alone,
    the recomputed activation is freed before the input gradient is made (if the caller holds no
    other reference), so backward's peak holds pre, dL/d(value) and dL/d(pre) — what torch's holds.
    """

    def __init__(self, pre: torch.Tensor, activation: Activation) -> None:
        self._leaf = self._out = None
        self._pre, self._derivative = pre, _input_derivative(activation)
        if activation is None:
            self.value = pre
        elif self._derivative is not None:
            with torch.no_grad():
                self.value = activation(pre)
        else:
            with torch.enable_grad():
                self._leaf = pre.detach().requires_grad_()
                self._out = activation(self._leaf)
            self.value = self._out.detach()

    def grad(self, grad_value: torch.Tensor) -> torch.Tensor:
        self.value = None
        if self._derivative is not None:
            return self._derivative(grad_value, self._pre)
        if self._leaf is None:
            return grad_value
        return torch.autograd.grad(self._out, self._leaf, grad_value)[0]
