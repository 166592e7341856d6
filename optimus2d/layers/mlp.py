"""MLP2D: Linear2D → activation → Linear2D (→ dropout), the transformer's feed-forward block."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.layers.base import fill_from_serial
from optimus2d.layers.dropout import Dropout2D
from optimus2d.layers.linear import Linear2D

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


_RANDOM_ACTIVATIONS = (nn.RReLU, nn.modules.dropout._DropoutNd)  # recomputing them would draw anew


def activation_fn(activation: str | Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The element-wise function for ``activation`` (a name or a callable without parameters).

    An activation with parameters (``nn.PReLU``) is refused: applied block by block its gradient
    would need a sum over the mesh that nothing here makes.
    """
    if isinstance(activation, nn.Module) and any(True for _ in activation.parameters()):
        raise TypeError(
            f"activation {type(activation).__name__} has parameters: a 2D feed-forward cannot sum their "
            "gradient over the mesh; use a parameter-free activation"
        )
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)} or a callable")
    return ACTIVATIONS[activation]


def feed_forward(
    x: torch.Tensor,
    fc1: Linear2D,
    activation: Callable[[torch.Tensor], torch.Tensor],
    fc2: Linear2D,
    dropout: Dropout2D | None = None,
    *,
    recompute: bool = True,
) -> torch.Tensor:
    """``fc2(dropout(activation(fc1(x))))``, with the same gradients whether or not ``recompute``.

    ``recompute``: fc2 keeps fc1's output for backward and recomputes the activation there
    (``Linear2D``'s ``input_activation``), so the ffn-wide tensor is kept once a row instead of
    twice (torch keeps the activation's input and its output). Not when a dropout is active
    between the two, nor for an activation that draws random numbers (``nn.RReLU``) or works in
    place (``inplace=True``): those run as torch.
    """
    h = fc1(x)
    if recompute and _recomputable(activation, dropout):
        return fc2(h, input_activation=activation)
    g = activation(h)
    return fc2(dropout(g) if dropout is not None else g)


def _recomputable(activation: Callable[[torch.Tensor], torch.Tensor], dropout: Dropout2D | None) -> bool:
    if dropout is not None and dropout.training and dropout.p > 0:
        return False
    return not isinstance(activation, _RANDOM_ACTIVATIONS) and not getattr(activation, "inplace", False)


class MLP2D(nn.Module):
    """``fc2(dropout(act(fc1(x))))``: ``[b, ..., h]`` → ``[b, ..., h]`` through ``[b, ..., ffn]``.

    On rank (k, i, j): ``[b/(d·q), ..., h/q]`` → ``[b/(d·q), ..., ffn/q]`` → ``[b/(d·q), ..., h/q]``.
    fc1 is an "ab" SUMMA (it broadcasts the h-wide input), fc2 an "abt" one (it reduces the h-wide
    output), so the ffn-wide activation never travels.

    ``recompute_activation`` (default): the activation's output is not kept for backward but
    recomputed there from fc1's output (``feed_forward``): saved activations per rank
    ``(h + ffn)/p`` a row instead of ``(h + 2·ffn)/p``, for one element-wise op more; gradients
    are bit-identical. The activation must be element-wise and deterministic.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        activation: str | Callable[[torch.Tensor], torch.Tensor] = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
        *,
        mesh: Mesh,
        recompute_activation: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.fc1 = Linear2D(hidden, ffn_hidden, bias, mesh=mesh, device=device, dtype=dtype)
        self.fc2 = Linear2D(ffn_hidden, hidden, bias, mesh=mesh, device=device, dtype=dtype)
        self.activation = activation_fn(activation)
        self.dropout = Dropout2D(dropout, mesh=mesh)
        self.recompute_activation = recompute_activation

    @classmethod
    def from_serial(cls, mlp: nn.Sequential, mesh: Mesh, *, recompute_activation: bool = True) -> MLP2D:
        """From ``nn.Sequential(nn.Linear(h, ffn), activation, nn.Linear(ffn, h)[, nn.Dropout])``."""
        layers = list(mlp) if isinstance(mlp, nn.Sequential) else []
        shape_ok = len(layers) in (3, 4) and isinstance(layers[0], nn.Linear) and isinstance(layers[2], nn.Linear)
        if not shape_ok or (len(layers) == 4 and not isinstance(layers[3], nn.Dropout)):
            raise TypeError(
                "MLP2D.from_serial expects nn.Sequential(nn.Linear, activation, nn.Linear[, nn.Dropout]), "
                f"got {type(mlp).__name__}"
            )
        fc1, act, fc2 = layers[:3]
        dropout = layers[3].p if len(layers) == 4 else 0.0
        kw = {"mesh": mesh, "recompute_activation": recompute_activation, "device": "meta"}
        module = cls(fc1.in_features, fc1.out_features, act, dropout, fc1.bias is not None, **kw)
        if (fc2.bias is None) != (fc1.bias is None):  # one layer biased, the other not
            module.fc2 = Linear2D(fc2.in_features, fc2.out_features, fc2.bias is not None, mesh=mesh, device="meta")
        fill_from_serial(module.fc1, fc1)
        fill_from_serial(module.fc2, fc2)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = feed_forward(x, self.fc1, self.activation, self.fc2, recompute=self.recompute_activation)
        return self.dropout(y)
