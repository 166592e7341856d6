"""OPT (``OPTForCausalLM``): learned positions, heads counted in the attention, LayerDrop.

Read and declared here, class by class, as for GPT-2 (``hf.py``); each is exact against the serial
model in ``tests/test_families_positions_mpi.py``:

- ``OPTAttention`` reshapes with ``self.num_heads`` (``view(bsz, -1, self.num_heads,
  self.head_dim)``): its projections become ``Linear2D`` and the instance is given its local count,
  ``num_heads / q``, so the reshape yields this rank's heads (the heads q does not divide: refused).
- ``OPTDecoderLayer``: norms, residuals, ``F.dropout`` (drawn per shard, as ``Dropout2D``), and a
  flatten to ``[b·s, h]`` that keeps the last dim (``reshape(-1, x.size(-1))``) and is undone by
  the shape it saved: all element by element on the local block.
- ``OPTDecoder``: positions from the mask along the sequence (per row), the learned table
  (``positions.py``), the layers. LayerDrop draws one number per layer from the global RNG, which
  ranks do not share: a model with ``layerdrop > 0`` is refused, and its forward checks it still is 0.
- ``OPTModel``, ``OPTForCausalLM``: their decoder, the head and ``loss_function`` (``hf_causal_lm``).
"""

from __future__ import annotations

import importlib

from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.convert.parallelizer import keep, register_converter
from optimus2d.families.hf import keep_drawing_per_shard, local_heads


def _attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    heads = local_heads(attn, "num_heads", mesh)
    keep(attn, mesh)
    attn.num_heads = heads  # this instance's heads: the reshape then yields the local ones
    return attn


def _decoder(decoder: nn.Module, mesh: Mesh) -> nn.Module:
    if decoder.layerdrop:
        raise ValueError(
            f"parallelize: {type(decoder).__name__} has layerdrop={decoder.layerdrop}: each rank would skip "
            f"layers by its own draw ({mesh}); set config.layerdrop = 0"
        )
    keep(decoder, mesh)
    decoder.register_forward_pre_hook(_no_layerdrop)
    return decoder


def _no_layerdrop(decoder: nn.Module, args) -> None:
    if decoder.training and decoder.layerdrop:
        name = type(decoder).__name__
        raise ValueError(f"{name}: layerdrop={decoder.layerdrop} on the mesh (it was 0 when converted)")


def register() -> None:
    """Register OPT's classes (needs ``transformers``)."""
    opt = importlib.import_module("transformers.models.opt.modeling_opt")
    register_converter(opt.OPTAttention, _attention, converts_children=True)
    register_converter(opt.OPTDecoderLayer, keep_drawing_per_shard("dropout"), converts_children=True)
    register_converter(opt.OPTDecoder, _decoder, converts_children=True)
    for cls in (opt.OPTModel, opt.OPTForCausalLM):
        register_converter(cls, keep=True)
