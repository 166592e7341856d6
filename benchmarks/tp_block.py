"""The transformer block laid out for Megatron's 1D tensor parallelism, so DTensor's plans apply.

``nn.TransformerEncoderLayer`` keeps q, k and v in one fused ``in_proj_weight`` that
``ColwiseParallel`` cannot split by heads; ``TPBlock`` holds the same weights as separate
``nn.Linear``s (torchtitan's layout) and computes the same function. ``block_plan`` is the plan:
q, k, v and fc1 column-parallel, out and fc2 row-parallel; with sequence parallelism the norms
and residuals work on sequence shards and each sub-block gathers its input once.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


class _Attention(nn.Module):
    def __init__(self, attn: nn.MultiheadAttention) -> None:
        super().__init__()
        h = attn.embed_dim
        self.head_dim = h // attn.num_heads
        ws = attn.in_proj_weight.detach().chunk(3)
        bs = attn.in_proj_bias.detach().chunk(3) if attn.in_proj_bias is not None else (None,) * 3
        self.q, self.k, self.v = (_linear(w, b) for w, b in zip(ws, bs, strict=True))
        self.out = _linear(attn.out_proj.weight.detach(), attn.out_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:  # [b, s, H·d] (H: this rank's heads) → [b, H, s, d]
            return t.view(t.shape[0], t.shape[1], -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.out(y.transpose(1, 2).flatten(2))


class _MLP(nn.Module):
    def __init__(self, layer: nn.TransformerEncoderLayer) -> None:
        super().__init__()
        self.fc1, self.fc2 = copy.deepcopy(layer.linear1), copy.deepcopy(layer.linear2)
        self.activation = layer.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class TPBlock(nn.Module):
    """A pre-norm ``nn.TransformerEncoderLayer`` (batch_first, no dropout, no mask), same weights.

    ``[b, s, h]`` → ``[b, s, h]``: x + out(attention(norm1(x))), then + fc2(act(fc1(norm2(·)))).
    """

    def __init__(self, layer: nn.TransformerEncoderLayer) -> None:
        super().__init__()
        if not (layer.norm_first and layer.self_attn.batch_first):
            raise ValueError("TPBlock copies a pre-norm, batch-first nn.TransformerEncoderLayer")
        self.norm1, self.norm2 = copy.deepcopy(layer.norm1), copy.deepcopy(layer.norm2)
        self.attention, self.mlp = _Attention(layer.self_attn), _MLP(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def block_plan(sequence_parallel: bool) -> dict:
    """Megatron's 1D plan for ``TPBlock`` (with sequence parallelism: torchtitan's)."""
    plan = {
        "attention.q": ColwiseParallel(),
        "attention.k": ColwiseParallel(),
        "attention.v": ColwiseParallel(),
        "attention.out": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel(), "attention": gather})
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan
