"""timm ``VisionTransformer``: the patch embedding runs whole on every rank (its convolution is
replicated, its output scattered); the class token and positions become blocks ``[..., E/q]``
whose gradients are summed over col and depth by a hook; ``Attention``'s fused ``qkv`` is split
per part and its ``num_heads``/``attn_dim`` set to the local ones, so its reshapes see local heads.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from optimus2d.comm import primitives as P
from optimus2d.comm import scatter
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding, shard
from optimus2d.layers import LayerNorm2D, Linear2D
from optimus2d.random import Dropout2D


def _timm_patch_embed(embed: nn.Module, mesh: Mesh) -> nn.Module:
    if hasattr(embed, "_scatter_mesh"):  # converted already
        return embed
    base = type(embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter(base.forward(self, x), self._scatter_mesh)  # whole on every rank, then the block

    embed.__class__ = type(f"{base.__name__}Scattered", (base,), {"forward": forward})
    embed._scatter_mesh = mesh
    return embed


def _timm_attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    from optimus2d.parallelize import parallelize

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
    return attn


def _sum_over_replicas(mesh: Mesh):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return P.summed_copy(grad, mesh, ("col", "depth"))

    return hook


def _timm_vit(vit: nn.Module, mesh: Mesh) -> nn.Module:
    from optimus2d.parallelize import convert_children

    if getattr(vit, "dynamic_img_size", False):
        raise TypeError("parallelize: timm VisionTransformer with dynamic_img_size is not supported")
    convert_children(vit, mesh)
    if getattr(vit, "_optimus2d_mesh", None) is not None:  # converted already
        return vit
    vit._optimus2d_shardings, vit._optimus2d_mesh = {}, mesh
    for name in ("cls_token", "reg_token", "pos_embed"):
        full = getattr(vit, name, None)
        if full is None:
            continue
        sharding = Sharding((*(() for _ in full.shape[:-1]), ("row",)), tuple(full.shape))
        block = nn.Parameter(shard(full.detach(), mesh, sharding).clone(), requires_grad=full.requires_grad)
        if block.requires_grad:
            block.register_hook(_sum_over_replicas(mesh))  # replicated over col and depth
        block._optimus2d_sharding, block._optimus2d_mesh = sharding, mesh
        setattr(vit, name, block)
        vit._optimus2d_shardings[name] = sharding
    return vit


def register() -> None:
    """Register the timm converters (needs ``timm``)."""
    from optimus2d.parallelize import register_converter

    vision_transformer = importlib.import_module("timm.models.vision_transformer")
    layers = importlib.import_module("timm.layers")
    register_converter(vision_transformer.VisionTransformer, _timm_vit, converts_children=True)
    register_converter(layers.PatchEmbed, _timm_patch_embed)
    register_converter(layers.Attention, _timm_attention)
    if hasattr(layers, "LayerNorm"):  # timm's own nn.LayerNorm subclass (a faster forward, same result)
        register_converter(layers.LayerNorm, LayerNorm2D.from_serial)
