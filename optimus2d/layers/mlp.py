"""MLP2D: Linear2D → activation → Linear2D (→ dropout), the transformer's feed-forward block."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.layers.linear import Linear2D
from optimus2d.random import Dropout2D

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def activation_fn(activation: str | Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)} or a callable")
    return ACTIVATIONS[activation]


class MLP2D(nn.Module):
    """``fc2(dropout(act(fc1(x))))``: ``[b, ..., h]`` → ``[b, ..., h]`` through ``[b, ..., ffn]``.

    On rank (k, i, j): ``[b/(d·q), ..., h/q]`` → ``[b/(d·q), ..., ffn/q]`` → ``[b/(d·q), ..., h/q]``.
    fc1 is an "ab" SUMMA (it broadcasts the h-wide input), fc2 an "abt" one (it reduces the h-wide
    output), so the ffn-wide activation never travels.
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
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.fc1 = Linear2D(hidden, ffn_hidden, bias, mesh=mesh, device=device, dtype=dtype)
        self.fc2 = Linear2D(ffn_hidden, hidden, bias, mesh=mesh, device=device, dtype=dtype)
        self.activation = activation_fn(activation)
        self.dropout = Dropout2D(dropout, mesh=mesh)

    @classmethod
    def from_serial(cls, mlp: nn.Sequential, mesh: Mesh) -> MLP2D:
        """From ``nn.Sequential(nn.Linear(h, ffn), activation, nn.Linear(ffn, h)[, nn.Dropout])``."""
        layers = list(mlp) if isinstance(mlp, nn.Sequential) else []
        shape_ok = len(layers) in (3, 4) and isinstance(layers[0], nn.Linear) and isinstance(layers[2], nn.Linear)
        if not shape_ok or (len(layers) == 4 and not isinstance(layers[3], nn.Dropout)):
            raise TypeError(
                "MLP2D.from_serial expects nn.Sequential(nn.Linear, activation, nn.Linear[, nn.Dropout]), "
                f"got {type(mlp).__name__}"
            )
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.fc1 = Linear2D.from_serial(layers[0], mesh)
        module.fc2 = Linear2D.from_serial(layers[2], mesh)
        module.activation = layers[1]
        module.dropout = Dropout2D(layers[3].p if len(layers) == 4 else 0.0, mesh=mesh)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.activation(self.fc1(x))))
