"""Hugging Face vision transformers on the mesh: ViT (``ViTModel``, ``ViTForImageClassification``) and
CLIP (``CLIPModel`` with its contrastive head, ``CLIPVisionModel``, ``CLIPTextModel``, their
``...WithProjection`` variants and ``CLIPForImageClassification``).

Inputs: ``pixel_values`` ``[b/(d·q), C, H, W]`` and ``input_ids``/``attention_mask``
``[b/(d·q), s]`` through ``optimus2d.scatter_batch``; classification ``labels`` ``[b/(d·q)]`` too.
Every hidden state is a block ``[b/(d·q), s, E/q]`` (the sequence whole), pooled outputs and
projections ``[b/(d·q), E/q]``, logits ``[b/(d·q), L/q]``; ``attentions`` hold the rank's heads.

- The patch convolution becomes a ``PatchConv2D`` (output channels split over the row group, run
  on the rank's own images); the class token, ViT's position table (a Parameter) and its mask
  token become hidden blocks ``[..., E/q]`` (``vision.split_hidden``); CLIP's position tables
  become ``PositionEmbedding2D`` (rows whole: ``weight.shape[0]`` is the serial number of
  positions). Their gradients are summed over col and depth. ``interpolate_pos_encoding=True``
  works as it is: bicubic interpolation acts on each hidden channel alone.
- Attention: q/k/v/o are ``Linear2D``; the forward reshapes with ``-1`` heads of ``head_dim``, so
  it runs on the rank's H/q heads; the head counts (and CLIP's ``embed_dim``) are set to the local
  ones. Attention dropout draws its mask under ``shard_rng`` (each shard its own).
- Kept as they are, after reading their forwards (element-wise on the hidden dim, whole heads, or
  a pick of tokens over the whole sequence): ViTModel, ViTLayer, ViTMLP, ViTPooler,
  ViTPatchEmbeddings, CLIPTextModel, CLIPVisionModel, CLIPEncoder, CLIPEncoderLayer, CLIPMLP and the
  two ``...WithProjection`` models.
- ``ViTForImageClassification`` and ``CLIPForImageClassification`` (its mean over the patch
  tokens is over the sequence, whole on every rank) with ``labels=``: the single-label loss is
  ``optimus2d.cross_entropy`` (the same scalar on every rank); regression and multi-label losses
  are refused (``ValueError``).
- Not converted (refused by ``parallelize``): ``ViTForMaskedImageModeling`` (its decoder's
  ``Conv2d`` over the hidden channels) and attention other than "sdpa"/"eager".
- ``CLIPModel.forward``: the projected embeddings are gathered to full ``[B, D]`` on every rank,
  then normalised, multiplied and (``return_loss``) turned into the CLIP loss exactly as serial
  code does, replicated: ``logits_per_image`` ``[B_img, B_txt]``, ``logits_per_text``,
  ``image_embeds``/``text_embeds`` ``[B, D]`` and ``loss`` are full and the same on every rank;
  ``vision_model_output``/``text_model_output`` are blocks. ``gather``'s backward keeps the local
  block of the gradient, so a loss made from these outputs must be the same on every rank (as the
  CLIP loss is). ``logit_scale`` stays a replicated scalar (its gradient is whole on every rank).
  ``get_image_features``/``get_text_features`` return blocks ``[b/(d·q), D/q]``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re

import torch
from torch import nn

from optimus2d.comm import gather
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.rng import shard_rng
from optimus2d.comm.whole import mark_whole
from optimus2d.convert.parallelizer import convert_children, register_converter
from optimus2d.families.vision import PatchConv2D, PositionEmbedding2D, split_hidden, with_forward
from optimus2d.layers.loss import cross_entropy

_SUFFIX = "OnMesh"


def _converted(module: nn.Module) -> bool:
    return getattr(module, "_optimus2d_mesh", None) is not None


# ---- attention: the rank's heads --------------------------------------------------------------
def _attention_forward(self, *args, **kwargs):
    p = getattr(self, self._optimus2d_dropout_attr)
    with shard_rng(self._optimus2d_mesh, enabled=self.training and p > 0):  # each shard its own mask
        return type(self).__mro__[1].forward(self, *args, **kwargs)


def _attention(heads_attr: str, dropout_attr: str, width_attrs: tuple[str, ...] = ()):
    def convert(attn: nn.Module, mesh: Mesh) -> nn.Module:

        if _converted(attn):
            return attn
        heads = getattr(attn, heads_attr)
        if heads % mesh.q:
            raise ValueError(
                f"parallelize: {type(attn).__name__} {heads_attr}={heads} is not divisible by q={mesh.q} ({mesh})"
            )
        if getattr(attn.config, "_attn_implementation", None) not in (None, "eager", "sdpa"):
            raise TypeError(
                f"parallelize: {type(attn).__name__} with attn_implementation="
                f"{attn.config._attn_implementation!r} is not supported (use 'sdpa' or 'eager')"
            )
        convert_children(attn, mesh)  # q/k/v/o_proj → Linear2D: output block j holds heads block j
        setattr(attn, heads_attr, heads // mesh.q)  # the forward reshapes with -1 heads of head_dim
        for name in width_attrs:
            setattr(attn, name, getattr(attn, name) // mesh.q)
        attn._optimus2d_mesh, attn._optimus2d_dropout_attr = mesh, dropout_attr
        return with_forward(attn, _attention_forward, _SUFFIX)

    return convert


# ---- embeddings ------------------------------------------------------------------------------
def _vit_patch_embeddings(embed: nn.Module, mesh: Mesh) -> nn.Module:
    if not isinstance(embed.projection, PatchConv2D):
        embed.projection = PatchConv2D.from_serial(embed.projection, mesh)  # forward: .flatten(2).transpose(1, 2)
    return embed


def _vit_embeddings(embed: nn.Module, mesh: Mesh) -> nn.Module:

    convert_children(embed, mesh)  # patch_embeddings, dropout
    split_hidden(embed, ("cls_token", "mask_token", "position_embeddings"), mesh)
    return embed


def _clip_vision_embeddings(embed: nn.Module, mesh: Mesh) -> nn.Module:
    if not isinstance(embed.patch_embedding, PatchConv2D):
        embed.patch_embedding = PatchConv2D.from_serial(embed.patch_embedding, mesh)
    if not isinstance(embed.position_embedding, PositionEmbedding2D):
        embed.position_embedding = PositionEmbedding2D.from_serial(embed.position_embedding, mesh)
    split_hidden(embed, ("class_embedding",), mesh)
    return embed


def _clip_text_embeddings(embed: nn.Module, mesh: Mesh) -> nn.Module:

    if not isinstance(embed.position_embedding, PositionEmbedding2D):
        embed.position_embedding = PositionEmbedding2D.from_serial(embed.position_embedding, mesh)
    convert_children(embed, mesh)  # token_embedding → Embedding2D
    return embed


# ---- heads -----------------------------------------------------------------------------------
def _problem_type(config, labels: torch.Tensor) -> str:
    """As transformers' ``ForSequenceClassificationLoss`` decides (and records) it."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif config.num_labels > 1 and labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    return config.problem_type


def _classification_forward(self, pixel_values=None, labels=None, *args, **kwargs):
    """``...ForImageClassification.forward`` with the loss made from the logits blocks."""
    mesh = self._optimus2d_mesh
    if labels is not None and _problem_type(self.config, labels) != "single_label_classification":
        name = type(self).__mro__[1].__name__
        raise ValueError(
            f"{name}: labels= with problem_type={self.config.problem_type!r} is not supported on {mesh}; only "
            "single-label classification (integer labels [b/(d·q)] from optimus2d.scatter_batch). "
            "Compute the loss from the logits blocks [b/(d·q), num_labels/q] instead"
        )
    num_items = kwargs.pop("num_items_in_batch", None)
    if not _loss_takes_kwargs(type(self).__mro__[1]):  # CLIP's: the mean, whatever it is given
        num_items = None
    kwargs["return_dict"] = True
    out = type(self).__mro__[1].forward(self, pixel_values, None, *args, **kwargs)
    if labels is None:
        return out
    if num_items is None:
        loss = cross_entropy(out.logits, labels, mesh)
    else:  # as transformers' fixed_cross_entropy: a sum over the targets / num_items_in_batch
        loss = cross_entropy(out.logits, labels, mesh, reduction="sum") / num_items
    return type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})  # first, as serial's


@functools.cache
def _loss_takes_kwargs(cls: type) -> bool:
    """Whether the serial class's forward hands its keyword arguments (``num_items_in_batch``) on to
    its loss, as ViT's does (``self.loss_function(labels, logits, self.config, **kwargs)``) and
    CLIP's does not (its loss is the mean whatever it is given)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    calls = re.findall(r"self\.loss_function\(([^)]*)\)", source)
    return any("**kwargs" in call for call in calls) if calls else True


def _classification(model: nn.Module, mesh: Mesh) -> nn.Module:

    convert_children(model, mesh)
    if _converted(model):
        return model
    model._optimus2d_mesh = mesh
    generic = importlib.import_module("transformers.utils.generic")
    return with_forward(model, generic.can_return_tuple(_classification_forward), _SUFFIX)


def _clip_forward(
    self,
    input_ids=None,
    pixel_values=None,
    attention_mask=None,
    position_ids=None,
    return_loss=None,
    interpolate_pos_encoding=False,
    **kwargs,
):
    """``CLIPModel.forward`` (transformers 5) with the projected embeddings gathered first."""
    clip = importlib.import_module("transformers.models.clip.modeling_clip")
    mesh = self._optimus2d_mesh
    vision_outputs = self.get_image_features(
        pixel_values=pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs
    )
    text_outputs = self.get_text_features(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
    )
    image_embeds = gather(vision_outputs.pooler_output, mesh)  # [B_img, D] on every rank
    text_embeds = gather(text_outputs.pooler_output, mesh)  # [B_txt, D]

    image_embeds = image_embeds / clip._get_vector_norm(image_embeds)
    text_embeds = text_embeds / clip._get_vector_norm(text_embeds)
    logits_per_text = torch.matmul(text_embeds, image_embeds.t().to(text_embeds.device))
    logits_per_text = logits_per_text * self.logit_scale.exp().to(text_embeds.device)
    logits_per_image = logits_per_text.t()
    for whole in (image_embeds, text_embeds, logits_per_text, logits_per_image):  # io="whole": as they are
        mark_whole(whole)
    loss = clip.image_text_contrastive_loss(logits_per_text) if return_loss else None
    return clip.CLIPOutput(
        loss=loss,
        logits_per_image=logits_per_image,
        logits_per_text=logits_per_text,
        text_embeds=text_embeds,
        image_embeds=image_embeds,
        text_model_output=text_outputs,
        vision_model_output=vision_outputs,
    )


def _clip_model(model: nn.Module, mesh: Mesh) -> nn.Module:

    convert_children(model, mesh)  # the towers, visual_projection, text_projection; logit_scale stays whole
    if _converted(model):
        return model
    model._optimus2d_mesh = mesh
    generic = importlib.import_module("transformers.utils.generic")
    return with_forward(model, generic.can_return_tuple(_clip_forward), _SUFFIX)


def register() -> None:
    """Register the converters of transformers' ViT and CLIP."""

    vit = importlib.import_module("transformers.models.vit.modeling_vit")
    for cls in (vit.ViTModel, vit.ViTLayer, vit.ViTMLP, vit.ViTPooler):
        register_converter(cls, keep=True)
    register_converter(vit.ViTPatchEmbeddings, _vit_patch_embeddings)
    register_converter(vit.ViTEmbeddings, _vit_embeddings, converts_children=True)
    register_converter(vit.ViTAttention, _attention("num_attention_heads", "attention_dropout"), converts_children=True)
    register_converter(vit.ViTForImageClassification, _classification, converts_children=True)

    clip = importlib.import_module("transformers.models.clip.modeling_clip")
    for cls in (
        clip.CLIPTextModel,
        clip.CLIPVisionModel,
        clip.CLIPTextModelWithProjection,
        clip.CLIPVisionModelWithProjection,
        clip.CLIPEncoder,
        clip.CLIPEncoderLayer,
        clip.CLIPMLP,
    ):
        register_converter(cls, keep=True)
    register_converter(clip.CLIPVisionEmbeddings, _clip_vision_embeddings)
    register_converter(clip.CLIPTextEmbeddings, _clip_text_embeddings, converts_children=True)
    register_converter(clip.CLIPAttention, _attention("num_heads", "dropout", ("embed_dim",)), converts_children=True)
    register_converter(clip.CLIPModel, _clip_model, converts_children=True)
    register_converter(clip.CLIPForImageClassification, _classification, converts_children=True)  # mean over s
