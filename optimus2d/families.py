"""Converters for model families from other libraries, registered when a model from them is met.

Hugging Face ``transformers`` LLaMA (``LlamaForCausalLM``): its attention, MLP and decoder layers
are compositions of ``nn.Linear`` and element-wise code that reshape with ``-1`` heads, so once
their ``nn.Linear`` children are ``Linear2D`` they run on the local heads as they are; this module
adds what ``parallelize`` cannot infer: ``LlamaRMSNorm`` → ``RMSNorm2D``, the rotary embedding
(a replicated table of cos/sin per position, kept as it is) and the library's element-wise
activation modules.
"""

from __future__ import annotations

import importlib

from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.layers import RMSNorm2D

_registered: set[str] = set()

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


def _keep(module: nn.Module, mesh: Mesh) -> nn.Module:
    return module


def _hf_rmsnorm(norm: nn.Module, mesh: Mesh) -> nn.Module:
    serial = nn.RMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon, device="meta")
    serial.weight = norm.weight  # LlamaRMSNorm: weight · x / sqrt(mean(x²) + eps), as nn.RMSNorm
    return RMSNorm2D.from_serial(serial, mesh)


def register_transformers() -> None:
    """Register the Hugging Face converters (idempotent; needs ``transformers``)."""
    if "transformers" in _registered:
        return
    from optimus2d.parallelize import register_converter

    activations = importlib.import_module("transformers.activations")
    for name in _HF_ELEMENTWISE:
        if hasattr(activations, name):
            register_converter(getattr(activations, name), _keep)
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    register_converter(llama.LlamaRMSNorm, _hf_rmsnorm)
    register_converter(llama.LlamaRotaryEmbedding, _keep)
    _registered.add("transformers")


def register_for(module: nn.Module) -> bool:
    """Register the converters of the library ``module`` comes from; True if there were any."""
    library = type(module).__module__.split(".")[0]
    if library == "transformers" and "transformers" not in _registered:
        register_transformers()
        return True
    return False
