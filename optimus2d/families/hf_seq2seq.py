"""Hugging Face BART (``BartModel``, ``BartForConditionalGeneration``) and T5 (``T5Model``,
``T5EncoderModel``, ``T5ForConditionalGeneration``) on the mesh.

Each BART container's forward was read: residual adds, layer norms, activations and dropout act
on the hidden dim element by element, attention on whole heads, so they are kept once their
children are converted (after checking every size and head count under them, before any change).
What is not automatic:

* One table ``model.shared`` [V, E] is the ``weight`` of ``shared``, ``encoder.embed_tokens``,
  ``decoder.embed_tokens`` (``BartScaledWordEmbedding``: lookup · ``embed_scale``) and the tied
  ``lm_head``: ``parallelize`` converts ``shared`` to a ``ScaledEmbedding2D`` and gives the other
  two ``ScaledEmbedding2D``s the same Parameter, and the head a ``TiedHead2D`` on it (logits
  ``[b/(d·q), s, ⌈V/q⌉]``, padded columns −inf).
* ``BartLearnedPositionalEmbedding`` (ids + 2, from the whole sequence) → ``LearnedPositionalEmbedding2D``.
* ``BartAttention`` views its projections with ``-1`` heads: the local heads; ``num_heads`` and
  ``embed_dim`` are set to the local ones (H/q, E/q; refused unless q divides H).
* ``final_logits_bias`` (a ``[1, V]`` buffer added to the logits) becomes its vocabulary block
  ``[1, ⌈V/q⌉]`` (block j, zero-padded); ``serial_state_dict`` gathers it back.
* BART's dropouts are functional (``F.dropout(p=self.dropout)``, attention dropout in SDPA): the
  layers, encoder and decoder run their forward in ``shard_rng`` while training with dropout, so
  each shard draws its own mask. LayerDrop (``encoder_layerdrop``/``decoder_layerdrop`` > 0 while
  training with dropout) would then skip different layers on different ranks: refused.
* ``labels=`` (``scatter_batch``-ed ``[b/(d·q), s]``): decoder inputs made by shifting them (as the
  serial model does), loss by ``optimus2d.cross_entropy`` (−100 ignored).

T5 shares ``shared`` (a plain ``nn.Embedding``) with both stacks and, tied, ``lm_head`` in the same
way; ``T5LayerNorm`` (no mean, no bias) → ``RMSNorm2D``; ``T5Attention`` views with ``-1`` heads
but builds a zero position bias of ``n_heads`` heads: ``n_heads``/``inner_dim`` are set to the local
ones, and its relative position table ``nn.Embedding(buckets, H)``, whose columns are heads,
becomes a ``HeadTable2D`` holding this rank's heads. Its dropouts are ``nn.Dropout`` modules
(→ ``Dropout2D``), attention dropout runs in ``shard_rng``.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import reduce_grad
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding
from optimus2d.convert.parallelizer import convert_children, register_converter
from optimus2d.families.hf_bert import in_shard_rng, refuse_unsplittable, with_vocab_loss
from optimus2d.layers import RMSNorm2D, ShardedModule
from optimus2d.layers.base import fill_from_serial, replace_by_block
from optimus2d.layers.embedding import Embedding2D


class ScaledEmbedding2D(Embedding2D):
    """``Embedding2D`` times ``embed_scale`` (BART's ``BartScaledWordEmbedding``); blocks as
    ``Embedding2D``: ids ``[b/(d·q), s]`` → ``[b/(d·q), s, E/q]``."""

    embed_scale: float = 1.0

    @classmethod
    def from_serial(cls, embedding: nn.Embedding, mesh: Mesh) -> ScaledEmbedding2D:
        module = super().from_serial(embedding, mesh)
        module.embed_scale = embedding.embed_scale
        return module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale


class LearnedPositionalEmbedding2D(Embedding2D):
    """BART's ``BartLearnedPositionalEmbedding``: positions ``past … past + s`` (or ``position_ids``
    ``[s]``) shifted by ``offset`` = 2, looked up in an ``Embedding2D`` of ``max_positions + 2`` rows.
    ``input_ids`` (any ``[b/(d·q), s, ...]`` tensor) gives only the shape: → ``[b/(d·q), s, E/q]``
    (with ``position_ids``: ``[1, s, E/q]``), as the serial module's forward."""

    offset: int = 2

    @classmethod
    def from_serial(cls, embedding: nn.Embedding, mesh: Mesh) -> LearnedPositionalEmbedding2D:
        module = super().from_serial(embedding, mesh)
        module.offset = embedding.offset
        return module

    def forward(
        self, input_ids: torch.Tensor, past_key_values_length: int = 0, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if position_ids is None:
            bsz, seq_len = input_ids.shape[:2]
            start = past_key_values_length
            position_ids = torch.arange(start, start + seq_len, dtype=torch.long, device=self.weight.device)
            position_ids = position_ids.expand(bsz, -1)
        else:
            position_ids = position_ids.unsqueeze(0)
        return super().forward(position_ids + self.offset)


class HeadTable2D(ShardedModule):
    """``nn.Embedding(n, H)`` whose columns are attention heads (T5's relative position bias).

    Global: weight ``[n, H]``; ids of any shape, the same on every rank (buckets of the whole
    sequence) → ``[..., H]``. On rank (k, i, j): weight ``[n, H/q]`` = heads block j (the local heads
    of the attention, split over row), replicated over col and depth (its gradient is summed over
    them: each rank's heads see its own batch block); ids → ``[..., H/q]``. Sends nothing forward.
    """

    def __init__(self, embedding: nn.Embedding, mesh: Mesh) -> None:
        super().__init__(mesh)
        mesh = self.mesh  # a DeviceMesh given: its Mesh
        self.padding_idx = embedding.padding_idx
        self.declare("weight", Sharding(((), ("row",)), tuple(embedding.weight.shape)), device="meta")
        fill_from_serial(self, embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, reduce_grad(self.weight, self.mesh, ("col", "depth")), self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.shardings['weight'].full_shape}, local={list(self.weight.shape)}, mesh={self.mesh}"


def _convert_children(module: nn.Module, mesh: Mesh) -> None:

    convert_children(module, mesh)


def _bart():
    return importlib.import_module("transformers.models.bart.modeling_bart")


def _checked(module: nn.Module, mesh: Mesh) -> nn.Module:
    """A BART container kept, after checking every size and head count under it."""
    refuse_unsplittable(module, mesh, {_bart().BartAttention: "num_heads"}, lambda m: None)
    _convert_children(module, mesh)
    return module


def _attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    if getattr(attn, "_optimus2d_heads", None) is not None:  # converted already
        return attn
    _checked(attn, mesh)
    attn.num_heads //= mesh.q  # forward views with -1 heads; these are for the record
    attn.embed_dim = attn.num_heads * attn.head_dim
    attn._optimus2d_heads = mesh
    return attn


def _dropping(layer: nn.Module) -> bool:
    attentions = [m for m in layer.modules() if isinstance(m, _bart().BartAttention)]
    ps = [layer.dropout, getattr(layer, "activation_dropout", 0.0), *(a.dropout for a in attentions)]
    return layer.training and any(p > 0 for p in ps)


def _layer(layer: nn.Module, mesh: Mesh) -> nn.Module:
    _checked(layer, mesh)
    in_shard_rng(layer, mesh, _dropping)
    return layer


def _stack_dropping(stack: nn.Module) -> bool:
    if not (stack.training and stack.dropout > 0):
        return False
    if stack.layerdrop > 0:
        raise ValueError(
            f"{type(stack).__name__}: LayerDrop ({stack.layerdrop}) while training with dropout on the mesh would skip "
            f"different layers on different ranks (each shard draws its own dropout masks); set the config's "
            f"encoder_layerdrop/decoder_layerdrop to 0"
        )
    return True


def _stack(stack: nn.Module, mesh: Mesh) -> nn.Module:
    _checked(stack, mesh)
    in_shard_rng(stack, mesh, _stack_dropping)
    return stack


def _shift_labels(model: nn.Module):
    def prepare(bound, labels: torch.Tensor) -> None:
        args = bound.arguments
        args["use_cache"] = False
        if args.get("decoder_input_ids") is None and args.get("decoder_inputs_embeds") is None:
            config = model.config
            args["decoder_input_ids"] = _bart().shift_tokens_right(
                labels, config.pad_token_id, config.decoder_start_token_id
            )

    return prepare


def _conditional_generation(model: nn.Module, mesh: Mesh) -> nn.Module:
    _checked(model, mesh)
    if "final_logits_bias" not in getattr(model, "_optimus2d_shardings", {}):
        sharding = Sharding(((), ("row",)), tuple(model.final_logits_bias.shape))  # the logits' vocabulary block j
        replace_by_block(model, "final_logits_bias", sharding, mesh)
    with_vocab_loss(model, mesh, _shift_labels(model))
    return model


def _t5():
    return importlib.import_module("transformers.models.t5.modeling_t5")


def _t5_unsupported(module: nn.Module) -> str | None:
    t5 = _t5()
    if isinstance(module, (t5.T5DenseActDense, t5.T5DenseGatedActDense)) and not isinstance(module.act, nn.Module):
        return f"act is {module.act!r}, not a module known to act element by element"
    return None


def _t5_checked(module: nn.Module, mesh: Mesh) -> nn.Module:
    """A T5 container kept, after checking every size and head count under it."""
    refuse_unsplittable(module, mesh, {_t5().T5Attention: "n_heads"}, _t5_unsupported)
    _convert_children(module, mesh)
    return module


def _t5_attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    if getattr(attn, "_optimus2d_heads", None) is not None:  # converted already
        return attn
    refuse_unsplittable(attn, mesh, {_t5().T5Attention: "n_heads"}, _t5_unsupported)
    if attn.has_relative_attention_bias:  # [buckets, H]: its columns are heads
        attn.relative_attention_bias = HeadTable2D(attn.relative_attention_bias, mesh)
    _convert_children(attn, mesh)
    attn.n_heads //= mesh.q  # the zero position bias of a layer without the table has n_heads heads
    attn.inner_dim = attn.n_heads * attn.key_value_proj_dim
    in_shard_rng(attn, mesh, lambda m: m.training and m.dropout > 0)
    attn._optimus2d_heads = mesh
    return attn


def _t5_norm(norm: nn.Module, mesh: Mesh) -> nn.Module:
    serial = nn.RMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon, device="meta")
    serial.weight = norm.weight  # T5LayerNorm: weight · x / sqrt(mean(x²) + eps), as nn.RMSNorm
    return RMSNorm2D.from_serial(serial, mesh)


def _t5_shift_labels(model: nn.Module):
    def prepare(bound, labels: torch.Tensor) -> None:
        args = bound.arguments
        if args.get("decoder_input_ids") is None and args.get("decoder_inputs_embeds") is None:
            args["decoder_input_ids"] = model._shift_right(labels)

    return prepare


def _t5_conditional_generation(model: nn.Module, mesh: Mesh) -> nn.Module:
    _t5_checked(model, mesh)
    with_vocab_loss(model, mesh, _t5_shift_labels(model))
    return model


_T5_KEEP = (  # forwards read: element-wise on the hidden dim, or whole heads
    "T5DenseActDense",  # wi → act → dropout → wo
    "T5DenseGatedActDense",  # act(wi_0) · wi_1 → dropout → wo
    "T5LayerFF",  # x + dropout(ff(norm(x)))
    "T5LayerSelfAttention",  # x + dropout(attention(norm(x))), the position bias passed on
    "T5LayerCrossAttention",  # the same over the encoder's output
    "T5Block",  # the sublayers in turn (fp16: clamps each block, element-wise)
    "T5Stack",  # embedding, masks from the local batch, blocks sharing the first one's bias, norm
    "T5Model",
    "T5EncoderModel",
)


def register() -> None:
    """Register the BART and T5 converters (needs ``transformers``)."""

    bart = _bart()
    register_converter(bart.BartScaledWordEmbedding, ScaledEmbedding2D.from_serial)
    register_converter(bart.BartLearnedPositionalEmbedding, LearnedPositionalEmbedding2D.from_serial)
    register_converter(bart.BartAttention, _attention, converts_children=True)
    for cls in (bart.BartEncoderLayer, bart.BartDecoderLayer):
        register_converter(cls, _layer, converts_children=True)
    for cls in (bart.BartEncoder, bart.BartDecoder):
        register_converter(cls, _stack, converts_children=True)
    register_converter(bart.BartModel, _checked, converts_children=True)
    register_converter(bart.BartForConditionalGeneration, _conditional_generation, converts_children=True)

    t5 = _t5()
    register_converter(t5.T5LayerNorm, _t5_norm)
    register_converter(t5.T5Attention, _t5_attention, converts_children=True)
    for name in _T5_KEEP:
        register_converter(getattr(t5, name), _t5_checked, converts_children=True)
    register_converter(t5.T5ForConditionalGeneration, _t5_conditional_generation, converts_children=True)
