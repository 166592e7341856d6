"""Hugging Face LLaVA cut into pipeline stages: vision-tower chunks and language-model chunks.

``llava_stages(model, encoder_layers, llm_stages)`` cuts a ``LlavaForConditionalGeneration`` (a
CLIP tower, the projector, a LLaMA-shaped language model) into

- encoder chunks (``LlavaEncoderStage``), in order: the patch embedding and ``pre_layrnorm`` on the
  first, ``encoder_layers[j]`` tower layers each, and on the last the feature selection
  (``hidden_states[vision_feature_layer]``, the class token dropped under "default"): images
  ``[n, C, H, W]`` → hidden ``[n, 1 + P, E]`` → features ``[n, P, E]``;
- language-model chunks (``LlavaTextStage``) of equal numbers of decoder layers: the first embeds
  ``input_ids`` ``[b, s]``, projects the features and puts row r of them at the r-th image token
  (``masked_scatter``, as HF does), the last ends with the norm and ``lm_head``: features → hidden
  ``[b, s, T]`` → logits ``[b, s, V]``.

Each is a deep copy keeping the serial names (``model.vision_tower.encoder.layers.3``,
``model.language_model.layers.1``, ``lm_head``), so ``serial_state_dict``, ``save_stages`` and
``load_stages`` need nothing else. Tower layers after the feature layer are left out: serially
their output is not read and they get no gradient. On a mesh, every chunk takes and returns this
rank's blocks (images and ids by ``scatter_batch``, activations ``[·/(d·q), ·, ·/q]``); the images of
a micro-batch must belong to its samples, which holds when every sample has the same number of
images (torch splits the image and id blocks alike along dim 0). Positions and the causal mask are
the serial model's without an ``attention_mask`` (no padding). Run them with
``optimus2d.pipeline.bubbles`` (the encoder in the LLM's bubbles) or any torch schedule on one chain.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from optimus2d.comm.agreement import agree
from optimus2d.comm.mesh import Mesh
from optimus2d.convert.parallelizer import convert_children, register_converter
from optimus2d.pipeline.models.llama import decoder_layers

__all__ = ["LlavaEncoderStage", "LlavaTextStage", "llava_stages"]


class LlavaEncoderStage(nn.Module):
    """Tower layers ``layers`` (global indices) of a LLaVA, with the patch embedding and
    ``pre_layrnorm`` when ``first`` and the feature selection when ``last``.

    forward: images ``[n, C, H, W]`` (first) or hidden ``[n, 1 + P, E]`` → hidden, or features
    ``[n, P, E]`` (last; ``[n, 1 + P, E]`` under "full"); on a mesh the blocks ``[n/(d·q), C, H, W]``,
    ``[n/(d·q), 1 + P, E/q]``, ``[n/(d·q), P, E/q]``. Keyword inputs (``step``'s, meant for the
    language model's first chunk on the same rank) are ignored.
    """

    def __init__(self, llava: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        tower = llava.model.vision_tower
        self.model = nn.Module()
        self.model.vision_tower = nn.Module()
        self.model.vision_tower.embeddings = tower.embeddings if first else None
        self.model.vision_tower.pre_layrnorm = tower.pre_layrnorm if first else None
        self.model.vision_tower.encoder = nn.Module()
        self.model.vision_tower.encoder.layers = nn.ModuleDict({str(n): tower.encoder.layers[n] for n in layers})
        self.drop_class_token = last and llava.config.vision_feature_select_strategy == "default"

    def forward(self, x: torch.Tensor, **_) -> torch.Tensor:
        tower = self.model.vision_tower
        if tower.embeddings is not None:
            x = tower.pre_layrnorm(tower.embeddings(x))
        for layer in tower.encoder.layers.values():
            x = layer(x, None)
        return x[:, 1:] if self.drop_class_token else x


class LlavaTextStage(nn.Module):
    """Decoder layers ``layers`` of a LLaVA's language model, with the token embedding, the projector
    and the merge of the image features when ``first``, and the norm and ``lm_head`` when ``last``.

    forward: features ``[n, P, E]`` and ``input_ids`` ``[b, s]`` (first) or hidden ``[b, s, T]`` →
    hidden, or logits ``[b, s, V]`` (last); on a mesh the blocks ``[n/(d·q), P, E/q]``,
    ``[b/(d·q), s]``, ``[b/(d·q), s, T/q]``, ``[b/(d·q), s, V/q]``. The first chunk checks, with
    every rank of its mesh (one small all-gather; none under ``Mesh(check="off")``), that each
    rank's micro-batch has as many image tokens as rows of features, else every rank raises.
    """

    def __init__(self, llava: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        text = llava.model.language_model
        self.config = text.config
        self.image_token_id = llava.config.image_token_id
        self.model = nn.Module()
        self.model.multi_modal_projector = llava.model.multi_modal_projector if first else None
        self.model.language_model = body = nn.Module()
        body.embed_tokens = text.embed_tokens if first else None
        body.layers = nn.ModuleDict({str(n): text.layers[n] for n in layers})
        body.norm = text.norm if last else None
        body.rotary_emb = text.rotary_emb
        self.lm_head = llava.lm_head if last else None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        body = self.model.language_model
        hidden = x
        if body.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("LlavaTextStage: the first language-model chunk needs input_ids= (step's keyword)")
            hidden = body.embed_tokens(input_ids)
            features = self.model.multi_modal_projector(x)
            placeholders = input_ids == self.image_token_id
            _agree_counts(getattr(self, "_optimus2d_mesh", None), placeholders, features)
            mask = placeholders.unsqueeze(-1).expand_as(hidden)
            hidden = hidden.masked_scatter(mask, features.to(hidden.dtype))
        hidden = decoder_layers(self.config, body.rotary_emb, body.layers.values(), hidden)
        if body.norm is not None:
            hidden = body.norm(hidden)
        return self.lm_head(hidden) if self.lm_head is not None else hidden


def _agree_counts(mesh: Mesh | None, placeholders: torch.Tensor, features: torch.Tensor) -> None:
    """Image tokens = feature rows on this rank's micro-batch, checked by every rank of ``mesh``."""
    tokens, rows = int(placeholders.sum()), features.shape[0] * features.shape[1]
    error = None
    if tokens != rows:
        error = ValueError(
            f"LlavaTextStage: {tokens} image tokens in this rank's micro-batch of input_ids "
            f"{list(placeholders.shape)} but {rows} rows of image features {list(features.shape[:2])}: every sample "
            f"needs a token per feature row of its images, and the same number of images"
        )
    if mesh is None or mesh.check == "off":
        if error is not None:
            raise error
        return
    agree(mesh, "LlavaTextStage: image tokens and features", description="", content=(tokens, rows) if error else (),
          error=error)  # fmt: skip


def _text_stage(stage: LlavaTextStage, mesh: Mesh) -> LlavaTextStage:

    convert_children(stage, mesh)
    stage._optimus2d_mesh = mesh  # the mesh whose ranks check the image-token counts together
    return stage


# Correct on blocks as they are: each calls its (grand)children in turn. The tower chunk slices the
# class token off along the sequence (whole on every rank); the text chunk's merge is hf_llava.py's
# step 5 on a micro-batch (ids and images split alike), its positions and mask come from the
# sequence length (decoder_layers), and the projector is read and kept as in hf_llava.py.
register_converter(LlavaEncoderStage, keep=True)
register_converter(LlavaTextStage, _text_stage, converts_children=True)


def llava_stages(
    llava: nn.Module, encoder_layers: Sequence[int], llm_stages: int
) -> tuple[list[LlavaEncoderStage], list[LlavaTextStage]]:
    """``llava`` (a serial ``LlavaForConditionalGeneration``, left unchanged) cut into encoder chunks
    of ``encoder_layers[j]`` tower layers each (zero allowed; in order, summing to the layers up to
    the feature layer) and ``llm_stages`` language-model chunks of equal layer counts (deep copies)."""
    config = llava.config
    layer = config.vision_feature_layer
    tower_layers = len(llava.model.vision_tower.encoder.layers)
    if not isinstance(layer, int):
        raise ValueError(f"llava_stages: vision_feature_layer={layer!r} is not supported (one layer, an int)")
    needed = layer if layer >= 0 else tower_layers + 1 + layer  # hidden_states[k]: the output after k layers
    counts = [int(c) for c in encoder_layers]
    if not counts or min(counts) < 0 or sum(counts) != needed:
        raise ValueError(
            f"llava_stages: encoder_layers={list(encoder_layers)} must be ≥ 0 and sum to the {needed} tower layers "
            f"before vision_feature_layer={layer} (of {tower_layers})"
        )
    text_layers = len(llava.model.language_model.layers)
    if llm_stages < 1 or text_layers % llm_stages:
        raise ValueError(f"llava_stages: {text_layers} decoder layers do not split into {llm_stages} equal stages")
    if getattr(config.get_text_config(), "tie_word_embeddings", False) and llm_stages > 1:
        raise ValueError("llava_stages: lm_head shares the embedding's weight (tie_word_embeddings) across stages")
    encoders, start = [], 0
    for j, count in enumerate(counts):
        chunk = LlavaEncoderStage(llava, range(start, start + count), j == 0, j == len(counts) - 1)
        encoders.append(copy.deepcopy(chunk))
        start += count
    per = text_layers // llm_stages
    texts = [
        copy.deepcopy(LlavaTextStage(llava, range(s * per, (s + 1) * per), s == 0, s == llm_stages - 1))
        for s in range(llm_stages)
    ]
    return encoders, texts
