"""Hugging Face LLaVA on the mesh: ``LlavaForConditionalGeneration`` and ``LlavaModel`` (a vision
tower, the multimodal projector, a language model).

Inputs, all through ``optimus2d.scatter_batch``: ``pixel_values`` ``[n/(d·q), C, H, W]``,
``input_ids``, ``attention_mask``, ``labels`` ``[b/(d·q), s]``, where the images of a batch block
belong to the samples of the same block (one image per sample does this). Outputs: logits
``[b/(d·q), s, ⌈V/q⌉]``, hidden states ``[b/(d·q), s, T/q]``, ``image_hidden_states``
``[rows/(d·q), T/q]``; ``loss`` (``labels=``, ``hf_causal_lm.py``) the serial scalar on every rank.

The parts convert as they do alone: the CLIP tower (``hf_vision.py``), the projector (two
``nn.Linear`` and an activation: read and kept by ``parallelize``), the LLaMA-shaped language model
and the head (``hf.py``; the root ``LlavaForConditionalGeneration`` is read and kept too). Only
``LlavaModel`` is named here. Why its forward is correct on blocks, step by step:

1. ``get_input_embeddings()(input_ids)``: an ``Embedding2D`` → ``[b/(d·q), s, T/q]``.
2. ``get_image_features``: the tower on the rank's images; ``hidden_states[vision_feature_layer]``
   picks one block ``[n/(d·q), 1 + P, E/q]`` from a tuple; ``[:, 1:]`` ("default") drops the
   class token along the sequence, whole on every rank; the projector → ``[n/(d·q), P, T/q]``;
   ``list(...)`` splits it along the batch. A *list* of feature layers is refused: its
   ``torch.cat(..., dim=-1)`` of hidden blocks would interleave the layers' blocks, not lay them
   out as the projector's serial input; so is ``image_sizes`` (it splits by global sizes).
3. ``torch.cat(features, dim=0)`` → ``[rows/(d·q), T/q]``: this rank's images, in order.
4. ``get_placeholder_mask``: ``input_ids == image_token_id`` ``[b/(d·q), s, 1]``; its count check
   ``tokens · T/q == features.numel()`` is the local ``tokens == rows``.
5. ``inputs_embeds.masked_scatter(mask, features)``: the n-th masked position of the block gets
   the n-th ``T/q`` elements of the features, i.e. row n, block j. Serially the global n'-th
   masked position gets row n'. The blocks are in batch order for ids and images alike
   (``scatter_batch``), so when every rank's placeholder count equals its feature rows, the counts
   before each block agree too and the n-th local token is the same global token as the n-th
   local row: block j of serial's row. The ranks check exactly that, below.
6. The language model on ``inputs_embeds`` blocks, as it runs on its own.

What is added (``_forward``): the image features are computed first and handed to HF's forward as
``mm_encoder_outputs`` (its own merge then runs unchanged), and before the language model runs the
ranks agree (``agree``, one 5-word all-gather) that each has as many placeholders as feature rows,
and that all have images or none: serially HF raises when the global counts differ; on the mesh a
rank whose block differs would raise alone and leave the others waiting in the language model's
collectives, so every rank raises the same ``ValueError`` naming the ranks and their counts (and,
as after any disagreement of the ranks, ``comm/watch.py``, that mesh is not to be used again).
``Mesh(check="off")`` skips the exchange (a mismatch then raises on the offending rank only).
Placeholders found from ``inputs_embeds`` (no ``input_ids``) with images are refused: HF compares
the whole embedding, a rank holds ``T/q`` of it. ``generate()`` (``hf_causal_lm.py``) works on text;
with ``pixel_values`` it is refused (transformers encodes the full batch's images before the
forward that ``hf_causal_lm.py`` splits).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types

from torch import nn

from optimus2d.comm.agreement import agree
from optimus2d.comm.mesh import Mesh
from optimus2d.convert.parallelizer import convert_children, register_converter
from optimus2d.families.hf_causal_lm import generate as generate_text
from optimus2d.families.vision import with_forward

_SUFFIX = "OnMesh"


def _forward(
    self,
    input_ids=None,
    pixel_values=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    vision_feature_layer=None,
    vision_feature_select_strategy=None,
    image_sizes=None,
    mm_encoder_outputs=None,
    **kwargs,
):
    """``LlavaModel.forward`` (transformers 5) with the image features made first and their count
    agreed by every rank before the language model runs."""
    mesh = self._optimus2d_mesh
    where = f"LlavaModel on {mesh}"
    layer = vision_feature_layer if vision_feature_layer is not None else self.config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(
            f"{where}: vision_feature_layer={layer!r} is not supported; its features are concatenated along the "
            f"hidden dim, which is split over q={mesh.q}: use one layer (an int)"
        )
    if image_sizes is not None:
        raise ValueError(f"{where}: image_sizes is not supported (its features are split by global sizes)")
    outputs = dict(mm_encoder_outputs) if mm_encoder_outputs is not None else {}
    if mm_encoder_outputs is None and pixel_values is not None:  # both given: HF's own ValueError, below
        outputs["image"] = self.get_image_features(
            pixel_values=pixel_values,
            vision_feature_layer=vision_feature_layer,
            vision_feature_select_strategy=vision_feature_select_strategy,
            return_dict=True,
            **(kwargs if _tower_takes_kwargs(type(self).__mro__[1]) else {}),  # as serial's: from 5.24
        )
        for features in outputs["image"].pooler_output:  # per image [P, T/q]: no layout a boundary moves
            features._optimus2d_kind = "per-image features"
        pixel_values = None
    _agree_placeholders(self, mesh, where, input_ids, outputs.get("image"))
    serial = type(self).__mro__[1]  # LlavaModel
    if past_key_values is not None:  # transformers 5.24 renames it `cache` (and warns when both are passed)
        kwargs["past_key_values"] = past_key_values
    return serial.forward(
        self,
        input_ids=input_ids,
        pixel_values=pixel_values,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=vision_feature_select_strategy,
        mm_encoder_outputs=outputs,
        **kwargs,
    )


@functools.cache
def _tower_takes_kwargs(cls: type) -> bool:
    """Whether the serial ``LlavaModel.forward`` hands its keyword arguments (interpolate_pos_encoding,
    output_attentions) on to ``get_image_features``, as transformers 5.24 and later do (5.23 does not:
    its tower refuses larger images)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    call = re.search(r"self\.get_image_features\((.*?)\n\s*\)", source, re.S)
    return call is None or "**kwargs" in call.group(1)


def _agree_placeholders(model: nn.Module, mesh: Mesh, where: str, input_ids, image) -> None:
    """Every rank: as many image tokens in its ``input_ids`` block as rows in its image features
    (and every rank with images, or none); else the same ``ValueError`` on every rank."""
    error, counts = None, ()
    if image is not None:
        rows = sum(f.shape[0] for f in image.pooler_output)  # per image [P, T/q] (or one [n, P, T/q])
        if input_ids is None:
            error = ValueError(
                f"{where}: images with inputs_embeds and no input_ids are not supported: the image tokens are "
                f"found by comparing whole embeddings, and a rank holds 1/{mesh.q} of each; pass input_ids"
            )
        else:
            tokens = int((input_ids == model.config.image_token_id).sum())
            if tokens != rows:
                counts = (tokens, rows)
                error = ValueError(
                    f"{where}: image tokens and image features do not match in this rank's block of the batch: "
                    f"{tokens} image tokens (id {model.config.image_token_id}) in input_ids {list(input_ids.shape)}, "
                    f"{rows} rows of features from {len(image.pooler_output)} image(s); each sample needs a token per "
                    f"row of its images' features, its images in its batch block (scatter_batch)"
                )
    if mesh.check == "off":
        if error is not None:
            raise error
        return
    agree(  # the counts of refusing ranks differ: every rank then names each refusing rank and its counts
        mesh,
        "LlavaModel: image tokens and features",
        description="images" if image is not None else "no images",
        content=counts,
        error=error,
    )


def _llava_model(model: nn.Module, mesh: Mesh) -> nn.Module:

    if getattr(model, "_optimus2d_mesh", None) is not None:
        return model
    layer = model.config.vision_feature_layer
    if not isinstance(layer, int):  # before any child is converted
        raise ValueError(
            f"parallelize: {type(model).__name__} with vision_feature_layer={layer!r} is not supported: its features "
            f"are concatenated along the hidden dim, which is split over q={mesh.q} ({mesh}); use one layer (an int)"
        )
    convert_children(model, mesh)  # vision_tower, multi_modal_projector, language_model
    model._optimus2d_mesh = mesh
    generic = importlib.import_module("transformers.utils.generic")
    return with_forward(model, generic.can_return_tuple(_forward), _SUFFIX)


def _generate(self, *args, **kwargs):
    """``generate`` (``hf_causal_lm.py``: full inputs, serial tokens) for text; images refused."""
    given = [name for name in ("pixel_values", "mm_encoder_outputs", "image_sizes") if kwargs.get(name) is not None]
    if given:
        raise ValueError(
            f"generate on {type(self).__name__} converted by optimus2d.parallelize: {', '.join(given)} not supported "
            f"(generate encodes the full batch's images before splitting the text); text-only generation is"
        )
    return generate_text(self, *args, **kwargs)


def finish(root: nn.Module, mesh: Mesh) -> None:
    """On every converted ``LlavaForConditionalGeneration`` in ``root``: ``generate`` for text only."""
    llava = importlib.import_module("transformers.models.llava.modeling_llava")
    for module in root.modules():
        if isinstance(module, llava.LlavaForConditionalGeneration) and "generate" in vars(module):
            module.generate = types.MethodType(_generate, module)  # after hf_causal_lm.finish installed its own


def register() -> None:
    """Register the converter of transformers' ``LlavaModel``."""

    llava = importlib.import_module("transformers.models.llava.modeling_llava")
    register_converter(llava.LlavaModel, _llava_model, converts_children=True)
