"""timm ``VisionTransformer``: the patch embedding runs whole on every rank (its convolution is
replicated, its output scattered); the class token and positions become blocks ``[..., E/q]``
whose gradients are summed over col and depth by a hook; ``Attention``'s fused ``qkv`` is split
per part and its ``num_heads``/``attn_dim`` set to the local ones, so its reshapes see local heads.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from optimus2d.comm import scatter
from optimus2d.comm.mesh import Mesh
from optimus2d.convert.forward_reader import draw_per_shard
from optimus2d.convert.parallelizer import convert_children, parallelize, register_converter
from optimus2d.families.vision import split_hidden, with_forward
from optimus2d.layers import LayerNorm2D, Linear2D
from optimus2d.layers.dropout import Dropout2D


def _scattered_forward(self, x: torch.Tensor) -> torch.Tensor:
    return scatter(type(self).__mro__[1].forward(self, x), self._scatter_mesh)  # whole on every rank, then the block


def _timm_patch_embed(embed: nn.Module, mesh: Mesh) -> nn.Module:
    if hasattr(embed, "_scatter_mesh"):  # converted already
        return embed
    embed._scatter_mesh = mesh
    return with_forward(embed, _scattered_forward, "Scattered")


def _timm_attention(attn: nn.Module, mesh: Mesh) -> nn.Module:

    if isinstance(attn.qkv, Linear2D):  # converted already
        return attn
    if getattr(attn, "gate", None) is not None:
        raise TypeError("parallelize: timm Attention with a gate is not supported")
    if not isinstance(attn.q_norm, nn.Identity) or not isinstance(attn.k_norm, nn.Identity):
        raise TypeError("parallelize: timm Attention with qk_norm is not supported (its per-head norms' weights)")
    if attn.num_heads % mesh.q:
        raise ValueError(f"parallelize: timm Attention num_heads={attn.num_heads} is not divisible by q={mesh.q}")
    width = attn.qkv.out_features // 3
    attn.qkv = Linear2D.from_serial(attn.qkv, mesh, parts=(width, width, width))
    attn.proj = Linear2D.from_serial(attn.proj, mesh)
    attn.norm = parallelize(attn.norm, mesh)  # over the attention width (split); q_norm/k_norm are per head
    attn.attn_drop = Dropout2D(attn.attn_drop.p, mesh=mesh)
    attn.proj_drop = Dropout2D(attn.proj_drop.p, mesh=mesh)
    attn.num_heads //= mesh.q
    if hasattr(attn, "attn_dim"):
        attn.attn_dim //= mesh.q
    # fused: SDPA's dropout_p=attn_drop.p, not the module (one mask on every rank)
    draw_per_shard(attn, mesh, lambda a: a.attn_drop.p > 0)
    return attn


def _timm_vit(vit: nn.Module, mesh: Mesh) -> nn.Module:

    if getattr(vit, "dynamic_img_size", False):
        raise TypeError("parallelize: timm VisionTransformer with dynamic_img_size is not supported")
    convert_children(vit, mesh)
    if getattr(vit, "_optimus2d_mesh", None) is not None:  # converted already
        return vit
    split_hidden(vit, ("cls_token", "reg_token", "pos_embed"), mesh)  # blocks [..., E/q], summed over col, depth
    return vit


def register() -> None:
    """Register the timm converters (needs ``timm``)."""

    vision_transformer = importlib.import_module("timm.models.vision_transformer")
    layers = importlib.import_module("timm.layers")
    register_converter(vision_transformer.VisionTransformer, _timm_vit, converts_children=True)
    register_converter(layers.PatchEmbed, _timm_patch_embed)
    register_converter(layers.Attention, _timm_attention)
    if hasattr(layers, "LayerNorm"):  # timm's own nn.LayerNorm subclass (a faster forward, same result)
        register_converter(layers.LayerNorm, LayerNorm2D.from_serial)
