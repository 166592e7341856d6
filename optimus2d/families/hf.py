"""Converters for model families from other libraries, registered when a model from them is met.

Hugging Face ``transformers`` LLaMA (``LlamaForCausalLM``): its attention, MLP and decoder layers
are compositions of ``nn.Linear`` and element-wise code that reshape with ``-1`` heads, so once
their ``nn.Linear`` children are ``Linear2D`` they run on the local heads as they are; this module
adds what ``parallelize`` cannot infer: ``LlamaRMSNorm`` → ``RMSNorm2D``, the rotary embedding
(a replicated table of cos/sin per position, kept as it is) and the library's element-wise
activation modules.

GPT-2 (``GPT2LMHeadModel``): ``Conv1D`` (weights stored [in, out]) → ``TransposedLinear2D``; the
attention's fused ``c_attn`` is split per q/k/v part and its ``split_size`` set to the local width,
so its ``.split(self.split_size)`` yields this rank's heads; the tied ``lm_head`` becomes a
``TiedHead2D`` (in ``parallelize``).
"""

from __future__ import annotations

import importlib

from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.layers import RMSNorm2D
from optimus2d.layers.linear import TransposedLinear2D
from optimus2d.random import Dropout2D

_HF_ELEMENTWISE = (
    "SiLUActivation",
    "GELUActivation",
    "NewGELUActivation",
    "FastGELUActivation",
    "QuickGELUActivation",
    "GELUTanh",
    "PytorchGELUTanh",
    "AccurateGELUActivation",
    "MishActivation",
    "LinearActivation",
    "ReLUSquaredActivation",
)


def _hf_rmsnorm(norm: nn.Module, mesh: Mesh) -> nn.Module:
    serial = nn.RMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon, device="meta")
    serial.weight = norm.weight  # LlamaRMSNorm: weight · x / sqrt(mean(x²) + eps), as nn.RMSNorm
    return RMSNorm2D.from_serial(serial, mesh)


def _gpt2_attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    if isinstance(attn.c_attn, TransposedLinear2D):  # converted already
        return attn
    if getattr(attn, "is_cross_attention", False) or hasattr(attn, "q_attn"):
        raise TypeError("parallelize: GPT-2 cross-attention (q_attn) is not supported")
    e = attn.embed_dim
    if attn.num_heads % mesh.q:
        raise ValueError(f"parallelize: GPT-2 num_heads={attn.num_heads} is not divisible by q={mesh.q} ({mesh})")
    attn.c_attn = TransposedLinear2D.from_serial(attn.c_attn, mesh, parts=(e, e, e))
    attn.c_proj = TransposedLinear2D.from_serial(attn.c_proj, mesh)
    attn.attn_dropout = Dropout2D(attn.attn_dropout.p, mesh=mesh)
    attn.resid_dropout = Dropout2D(attn.resid_dropout.p, mesh=mesh)
    attn.split_size = e // mesh.q  # forward splits the fused output by this: local q, k, v
    return attn


def register() -> None:
    """Register the Hugging Face converters (needs ``transformers``)."""
    from optimus2d.parallelize import register_converter

    activations = importlib.import_module("transformers.activations")
    for name in _HF_ELEMENTWISE:
        if hasattr(activations, name):
            register_converter(getattr(activations, name), keep=True)
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    register_converter(llama.LlamaRMSNorm, _hf_rmsnorm)
    register_converter(llama.LlamaRotaryEmbedding, keep=True)
    pytorch_utils = importlib.import_module("transformers.pytorch_utils")
    register_converter(pytorch_utils.Conv1D, TransposedLinear2D.from_serial)
    gpt2 = importlib.import_module("transformers.models.gpt2.modeling_gpt2")
    register_converter(gpt2.GPT2Attention, _gpt2_attention)
