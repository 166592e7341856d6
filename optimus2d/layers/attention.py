"""MultiheadAttention2D: ``nn.MultiheadAttention`` (batch_first) with the heads split over columns."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import all_reduce, reduce_grad
from optimus2d.comm.functional import grad_alike
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.rng import shard_rng
from optimus2d.comm.sharding import Sharding
from optimus2d.layers.base import ShardedModule, fill_from_serial
from optimus2d.layers.linear import Linear2D, linear_2d


class MultiheadAttention2D(ShardedModule):
    """Multi-head attention whose q/k/v projection, heads and output projection are split over the mesh.

    Global: x ``[b, s, E]``; ``in_proj_weight`` ``[E + 2·KV, E]`` (rows: q, k, v; KV = E for
    ordinary attention, ``num_kv_heads·E/num_heads`` for grouped-query attention);
    ``in_proj_bias`` ``[E + 2·KV]``; ``out_proj`` a ``Linear2D(E, E)``.
    On rank (k, i, j): x ``[b/(d·q), s, E/q]``; the fused projection gives, in column j, whole
    heads ``j·H/q .. (j+1)·H/q − 1`` of q, k and v, so attention itself is local
    (``F.scaled_dot_product_attention``); ``in_proj_weight`` ``[(E + 2·KV)/q, E/q]``.

    Called like ``nn.MultiheadAttention(batch_first=True)``: ``(query, key, value,
    key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)`` returns
    ``(output, weights or None)``. Masks may be given whole (``[b, S]``, ``[L, S]``, ``[b·H, L, S]``)
    or as this rank's block (``[b/(d·q), S]``, ``[b/(d·q)·H/q, L, S]``). Attention weights, when
    asked for, are this rank's batch block ``[b/(d·q), L, S]`` (averaged over all heads, the same
    on the q ranks of a row) or ``[b/(d·q), H/q, L, S]`` (this column's heads: no layout a plan's
    boundary moves). Their gradient is taken as a loss computed from them alone gives it: each rank
    of the row passes the whole gradient of its block, not a part of it (``grad_alike``: moved by a
    boundary, ``io="whole"`` or a plan's, they are still so; an activation block's product with
    them, whose gradient would be a part, is refused by the reader of a forward).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        num_kv_heads: int | None = None,
        mesh: Mesh,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(mesh)
        mesh = self.mesh  # a DeviceMesh given: its Mesh
        q = mesh.q
        num_kv_heads = num_kv_heads or num_heads
        if embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention2D: embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("embed_dim", embed_dim)):
            if n % q:
                raise ValueError(f"MultiheadAttention2D: {name}={n} is not divisible by q={q} ({mesh})")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"MultiheadAttention2D: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.embed_dim, self.num_heads, self.num_kv_heads, self.dropout = embed_dim, num_heads, num_kv_heads, dropout
        self.head_dim = embed_dim // num_heads
        self.batch_first = True
        kv = num_kv_heads * self.head_dim
        parts = (embed_dim, kv, kv)
        self.summa = "ab"  # E → E + 2·KV never shrinks: weight = W[out blk j, in blk i]
        kw = {"device": device, "dtype": dtype}
        self.declare("in_proj_weight", Sharding((("row",), ("col",)), (sum(parts), embed_dim), parts), **kw)
        if bias:
            self.declare("in_proj_bias", Sharding((("row",),), (sum(parts),), parts), **kw)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear2D(embed_dim, embed_dim, bias=bias, mesh=mesh, **kw)
        self._reset_in_proj()

    def _reset_in_proj(self) -> None:
        """nn.MultiheadAttention's init: xavier_uniform_ on the whole [3E, E], zero biases."""
        w = self.in_proj_weight
        if w.is_meta:
            return
        full = nn.init.xavier_uniform_(torch.empty(self.shardings["in_proj_weight"].full_shape, dtype=w.dtype))
        self.load_serial_tensor("in_proj_weight", full)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_serial(cls, mha: nn.MultiheadAttention, mesh: Mesh) -> MultiheadAttention2D:
        cls.check_serial(mha)
        module = cls(mha.embed_dim, mha.num_heads, mha.dropout, mha.in_proj_bias is not None, mesh=mesh, device="meta")
        fill_from_serial(module, mha)
        return module

    @staticmethod
    def check_serial(mha: nn.MultiheadAttention) -> None:
        """Refuse what ``from_serial`` cannot convert (before anything is built)."""
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"MultiheadAttention2D.from_serial expects nn.MultiheadAttention, got {type(mha).__name__}")
        unsupported = {
            "batch_first=False": not mha.batch_first,
            "kdim/vdim != embed_dim": not mha._qkv_same_embed_dim,
            "add_bias_kv": mha.bias_k is not None,
            "add_zero_attn": mha.add_zero_attn,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"MultiheadAttention2D.from_serial: unsupported {', '.join(bad)}")

    # ---- forward ----------------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = query if key is None else key
        value = key if value is None else value
        mesh, local_e = self.mesh, self.embed_dim // self.mesh.q
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 3 or t.shape[-1] != local_e:
                raise ValueError(
                    f"MultiheadAttention2D(embed_dim={self.embed_dim}): {name} of shape {tuple(t.shape)} must be "
                    f"[b/(d·q), seq, embed_dim/q = {local_e}] on {mesh}"
                )
        b, tgt_len, src_len = query.shape[0], query.shape[1], key.shape[1]
        mask = self._combined_mask(key_padding_mask, attn_mask, b, tgt_len, src_len, query.dtype)
        q, k, v = self._project(query, key, value)
        heads, kv_heads, hd = self.num_heads // mesh.q, self.num_kv_heads // mesh.q, self.head_dim
        q = q.view(b, tgt_len, heads, hd).transpose(1, 2)  # (b', H/q, L, hd)
        k = k.view(b, src_len, kv_heads, hd).transpose(1, 2)
        v = v.view(b, src_len, kv_heads, hd).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        causal = is_causal and mask is None
        if is_causal and mask is not None and attn_mask is None:  # padding and causality together
            mask = mask + causal_mask(tgt_len, src_len, query)
        with shard_rng(mesh, enabled=dropout > 0):
            if need_weights:
                out, weights = attention_with_weights(q, k, v, mask, dropout, causal)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, enable_gqa=heads != kv_heads
                )
                weights = None
        out = out.transpose(1, 2).reshape(b, tgt_len, heads * hd)
        out = self.out_proj(out)
        if weights is not None and average_attn_weights:
            # replicated over the row and used alike there: backward is the identity (a boundary
            # moving them hands every replica the whole gradient back: grad_alike)
            weights = grad_alike(all_reduce(weights.sum(1), mesh, ("row",)) / self.num_heads, mesh, ("row",))
            weights._optimus2d_kind = "batch"  # [b, L, S]: a boundary moves it by batch, not as an activation
        elif weights is not None:  # this column's heads: no layout a boundary can move (it refuses them)
            weights._optimus2d_kind = "per-head weights"
        return out, weights

    def _project(self, query, key, value):
        e, kv = self.embed_dim // self.mesh.q, self.num_kv_heads * self.head_dim // self.mesh.q
        w, b = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:  # self-attention: one SUMMA for q, k and v
            return linear_2d(query, w, b, self.mesh, self.summa).split([e, kv, kv], -1)
        ws, bs = w.split([e, kv, kv]), b.split([e, kv, kv]) if b is not None else (None, None, None)
        if key is value:
            q = linear_2d(query, ws[0], bs[0], self.mesh, self.summa)
            k, v = linear_2d(
                key, torch.cat(ws[1:]), torch.cat(bs[1:]) if b is not None else None, self.mesh, self.summa
            ).split([kv, kv], -1)
            return q, k, v
        return tuple(
            linear_2d(x, wp, bp, self.mesh, self.summa) for x, wp, bp in zip((query, key, value), ws, bs, strict=True)
        )

    def _combined_mask(self, key_padding_mask, attn_mask, b, tgt_len, src_len, dtype):
        """Additive float mask of shape broadcastable to (b', H/q, L, S), this rank's block; None if none."""
        mesh, split = self.mesh, self.mesh.depth * self.mesh.q
        block = mesh.index("depth") * mesh.q + mesh.index("col")
        heads = self.num_heads // mesh.q
        mask = None
        if attn_mask is not None:
            attn_mask = additive_mask(attn_mask, dtype, "attn_mask")
            if attn_mask.dim() == 2:
                expect_shape(attn_mask, (tgt_len, src_len), "attn_mask", "[L, S]")
                mask = _whole(attn_mask, mesh)
            elif attn_mask.dim() == 3 and attn_mask.shape[0] == b * split * self.num_heads:
                expect_shape(attn_mask, (b * split * self.num_heads, tgt_len, src_len), "attn_mask", "[b·H, L, S]")
                full = _whole(attn_mask, mesh).view(b * split, self.num_heads, tgt_len, src_len)
                mask = full[block * b : (block + 1) * b, mesh.index("row") * heads : (mesh.index("row") + 1) * heads]
            else:
                expect_shape(
                    attn_mask,
                    (b * heads, tgt_len, src_len),
                    "attn_mask",
                    "[b·H, L, S] or its block [b/(d·q)·H/q, L, S]",
                )
                mask = attn_mask.view(b, heads, tgt_len, src_len)
        if key_padding_mask is not None:
            kpm = additive_mask(key_padding_mask, dtype, "key_padding_mask")
            if kpm.dim() == 2 and kpm.shape[0] == b * split and split > 1:
                kpm = _whole(kpm, mesh)[block * b : (block + 1) * b]
            expect_shape(kpm, (b, src_len), "key_padding_mask", "[b, S] or its block [b/(d·q), S]")
            kpm = kpm.view(b, 1, 1, src_len)
            mask = kpm if mask is None else mask + kpm
        return mask

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, dropout={self.dropout}, mesh={self.mesh}"


def _whole(mask: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """A mask given whole, the same on every rank: each rank uses its part (its batch block, its
    heads), so a mask that needs a gradient (a learned bias) gets the sum of theirs on every rank,
    as a whole tensor's (``reduce_grad`` over the mesh; nothing sent where none is needed)."""
    return reduce_grad(mask, mesh, ("row", "col", "depth")) if mask.requires_grad else mask


def additive_mask(mask: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """nn.MultiheadAttention's convention: a bool mask is True where attention is *not* allowed."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"{name} must be bool or floating point, got {mask.dtype}")
    return mask.to(dtype)


def expect_shape(
    t: torch.Tensor, shape: tuple[int, ...], name: str, what: str, owner: str = "MultiheadAttention2D"
) -> None:
    """``ValueError`` naming ``owner``, the tensor, its shape and the one expected, where they differ."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{owner}: {name} of shape {tuple(t.shape)} does not fit {what} = {tuple(shape)}")


def causal_mask(tgt_len: int, src_len: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((tgt_len, src_len), float("-inf"), dtype=like.dtype, device=like.device).triu_(1)


def attention_with_weights(q, k, v, mask, dropout, causal):
    """softmax(q·kᵀ/√d + mask)·v, also returning the weights (b', H/q, L, S)."""
    if k.shape[1] != q.shape[1]:  # grouped-query: repeat kv heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores + causal_mask(q.shape[2], k.shape[2], scores)
    if mask is not None:
        scores = scores + mask
    weights = scores.softmax(-1)
    if dropout > 0:  # as nn.MultiheadAttention: the weights returned are the dropped-out ones
        weights = F.dropout(weights, dropout)
    return weights @ v, weights
