"""``nn.MultiheadAttention`` inside a 1D region: its heads split over the region's ranks.

torch's ``parallelize_module`` splits a module's child linears, but ``nn.MultiheadAttention`` packs
q, k and v in one ``in_proj_weight`` ``[3E, E]`` and its forward reads the embedding size from the
input (a column split of that tensor would not run). Megatron's split of it is written here, once:
``SplitMultiheadAttention`` takes the whole activation on every rank, as everything in a 1D
region does, and returns the whole output.

Global: query ``[b, L, E]`` (``[L, b, E]`` without ``batch_first``; ``[L, E]`` unbatched), key
and value ``[b, S, E]``; ``in_proj_weight`` ``[3E, E]`` (rows: q, k, v), ``in_proj_bias`` ``[3E]``,
``out_proj.weight`` ``[E, E]``, ``out_proj.bias`` ``[E]``.
On rank n of the region's p (its mesh's "mesh" index; a ``Sharding`` over the axes depth, col,
row): ``in_proj_weight`` ``[3E/p, E]``, the rows of heads n·H/p … (n+1)·H/p − 1 of q, of k and of
v (three parts, each split on its own: the rank holds whole heads); ``in_proj_bias`` ``[3E/p]``
alike; ``out_proj.weight`` ``[E, E/p]``, the same heads' columns; ``out_proj.bias`` ``[E]``, whole.

Forward: each distinct input as it is (``reduce_grad``: its gradient all-reduced backward, none
sent for an input that needs none), the rank's heads attended locally, the out projection's
partial sums all-reduced (``all_reduce``: nothing backward), then the bias. One all-reduce of
``[b, L, E]`` forward, one per distinct input backward: Megatron's column-then-row split.
Attention weights, when asked for, are the average over every head (all-reduced); per-head weights
(``average_attn_weights=False``) are refused, as are dropout (the region refuses p > 0: ranks
would draw apart), ``add_bias_kv``, ``add_zero_attn`` and ``kdim``/``vdim`` (``refusals``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import all_reduce, reduce_grad
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding
from optimus2d.layers.attention import additive_mask, attention_with_weights, expect_shape
from optimus2d.layers.base import keep_blocks_on_copy, load_serial_tensor, mark_block

AXES = ("depth", "col", "row")  # outermost first: block n of a dim split over them is the "mesh" index n
_ALL = ("mesh",)
_NAME = "SplitMultiheadAttention"


def splits(module: nn.Module) -> bool:
    """Whether ``module`` is torch's own ``nn.MultiheadAttention`` (its forward unchanged), which a
    1D region splits by heads."""
    return isinstance(module, nn.MultiheadAttention) and type(module).forward is nn.MultiheadAttention.forward


def refusals(mha: nn.MultiheadAttention, where: str, ranks: int) -> list[str]:
    """Why ``mha`` (at ``where``) cannot run with its heads split over ``ranks`` ranks."""
    out = []
    if mha.num_heads % ranks:
        out.append(
            f"{where} (MultiheadAttention): num_heads = {mha.num_heads} not divisible by the {ranks} ranks of the "
            f"1D split"
        )
    unsupported = {
        "kdim/vdim != embed_dim": not mha._qkv_same_embed_dim,
        "add_bias_kv": mha.bias_k is not None,
        "add_zero_attn": mha.add_zero_attn,
    }
    bad = [what for what, yes in unsupported.items() if yes]
    if bad:
        out.append(f"{where} (MultiheadAttention): {', '.join(bad)} is not split in 1D")
    return out


class SplitMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with whole heads on each rank of a 1D region (module docstring).
    Its state_dict keys and serial tensors are ``nn.MultiheadAttention``'s."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = True,
        batch_first: bool = False,
        *,
        mesh: Mesh,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        p = mesh.size
        if embed_dim % num_heads or num_heads % p:
            raise ValueError(
                f"SplitMultiheadAttention: embed_dim = {embed_dim}, num_heads = {num_heads}: the heads must divide "
                f"the embedding and the {p} ranks of {mesh} the heads"
            )
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
        self.head_dim, self.mesh = embed_dim // num_heads, mesh
        # read by torch's encoder layer and encoder for their fused fast path, which would take
        # in_proj_weight as the whole [3E, E]: this rank holds a block, so the path stays off
        self._qkv_same_embed_dim = False
        kw = {"device": device, "dtype": dtype}
        parts = (embed_dim, embed_dim, embed_dim)
        shardings = {"in_proj_weight": Sharding((AXES, ()), (3 * embed_dim, embed_dim), parts)}
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim // p, embed_dim, **kw))
        if bias:
            shardings["in_proj_bias"] = Sharding((AXES,), (3 * embed_dim,), parts)
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim // p, **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        linear = nn.modules.linear.NonDynamicallyQuantizableLinear  # torch's class: its keys, nothing drawn on meta
        self.out_proj = linear(embed_dim // p, embed_dim, bias=bias, device="meta", dtype=dtype)
        _blocks(self, shardings, mesh)
        _blocks(self.out_proj, {"weight": Sharding(((), AXES), (embed_dim, embed_dim))}, mesh)
        if not self.in_proj_weight.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each rank's blocks of a freshly initialised ``nn.MultiheadAttention`` (torch's own init, in
        its order: with the same seed, the serial module's values)."""
        t = self.in_proj_weight
        twin = nn.MultiheadAttention(
            self.embed_dim, self.num_heads, bias=self.in_proj_bias is not None, batch_first=self.batch_first,
            device=t.device, dtype=t.dtype,
        )  # fmt: skip
        self._load(twin)

    def _load(self, mha: nn.MultiheadAttention) -> None:
        """This rank's blocks of ``mha``'s tensors, with their ``requires_grad`` (nothing sent)."""
        for owner, name, full in (
            (self, "in_proj_weight", mha.in_proj_weight),
            (self, "in_proj_bias", mha.in_proj_bias),
            (self.out_proj, "weight", mha.out_proj.weight),
            (self.out_proj, "bias", mha.out_proj.bias),
        ):
            if full is not None:
                load_serial_tensor(owner, name, full)
                getattr(owner, name).requires_grad_(full.requires_grad)

    @classmethod
    def from_serial(cls, mha: nn.MultiheadAttention, mesh: Mesh) -> SplitMultiheadAttention:
        """This rank's heads of ``mha`` (nothing sent), with its ``requires_grad`` and mode."""
        problems = refusals(mha, type(mha).__name__, mesh.size) if splits(mha) else ["not nn.MultiheadAttention"]
        if problems:
            raise ValueError("SplitMultiheadAttention.from_serial: " + "; ".join(problems))
        bias = mha.in_proj_bias is not None
        module = cls(mha.embed_dim, mha.num_heads, bias, mha.batch_first, mesh=mesh, device="meta")
        module._load(mha)
        return module.train(mha.training)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.MultiheadAttention.forward``, on whole tensors, every rank alike."""
        self._check(query, key, value, need_weights, average_attn_weights, is_causal, attn_mask)
        entered: dict[int, torch.Tensor] = {}  # an input used twice (self-attention) is entered once
        for t in (query, key, value):
            if id(t) not in entered:
                entered[id(t)] = reduce_grad(t, self.mesh, _ALL)
        query, key, value = (entered[id(t)] for t in (query, key, value))
        unbatched = query.dim() == 2
        query, key, value = (_batch_first(t, unbatched, self.batch_first) for t in (query, key, value))
        b, tgt_len, src_len = query.shape[0], query.shape[1], key.shape[1]
        q, k, v = self._project(query, key, value)
        heads, hd = self.num_heads // self.mesh.size, self.head_dim
        q = q.view(b, tgt_len, heads, hd).transpose(1, 2)  # (b, H/p, L, hd)
        k = k.view(b, src_len, heads, hd).transpose(1, 2)
        v = v.view(b, src_len, heads, hd).transpose(1, 2)
        mask = self._mask(key_padding_mask, attn_mask, b, tgt_len, src_len, query.dtype, unbatched)
        if need_weights:
            out, weights = attention_with_weights(q, k, v, mask, 0.0, False)
            weights = all_reduce(weights.sum(1), self.mesh, _ALL) / self.num_heads  # replicated, used alike
        else:
            out, weights = F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None
        out = out.transpose(1, 2).reshape(b, tgt_len, heads * hd)
        out = all_reduce(F.linear(out, self.out_proj.weight), self.mesh, _ALL)
        if self.out_proj.bias is not None:
            out = out + self.out_proj.bias
        if unbatched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _check(self, query, key, value, need_weights, average_attn_weights, is_causal, attn_mask) -> None:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.is_nested or t.dim() not in (2, 3) or t.shape[-1] != self.embed_dim or t.dim() != query.dim():
                raise ValueError(
                    f"SplitMultiheadAttention(embed_dim={self.embed_dim}): {name} of shape {tuple(t.shape)} must be "
                    f"the whole [b, seq, {self.embed_dim}] (or unbatched [seq, {self.embed_dim}]) on every rank of "
                    f"{self.mesh}"
                )
        if key.shape != value.shape:
            raise ValueError(
                f"SplitMultiheadAttention: key of shape {tuple(key.shape)} and value of shape {tuple(value.shape)} "
                f"must match (as nn.MultiheadAttention's), on every rank of {self.mesh}"
            )
        batch = 0 if self.batch_first else 1
        if query.dim() == 3 and query.shape[batch] != key.shape[batch]:
            raise ValueError(
                f"SplitMultiheadAttention: query of shape {tuple(query.shape)} and key of shape {tuple(key.shape)} "
                f"differ in their batch (dim {batch}, batch_first={self.batch_first}), on every rank of {self.mesh}"
            )
        if need_weights and not average_attn_weights and self.mesh.size > 1:
            raise ValueError(
                f"SplitMultiheadAttention: per-head attention weights (average_attn_weights=False) are not gathered "
                f"over the {self.mesh.size} ranks of the 1D split; ask for their average or none"
            )
        if is_causal and attn_mask is None:  # torch's own rule: is_causal is a hint about attn_mask
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")

    def _project(self, query, key, value):
        e = self.embed_dim // self.mesh.size
        w, b = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:
            return F.linear(query, w, b).split(e, -1)
        ws, bs = w.split(e), b.split(e) if b is not None else (None, None, None)
        return tuple(F.linear(x, wp, bp) for x, wp, bp in zip((query, key, value), ws, bs, strict=True))

    def _mask(self, key_padding_mask, attn_mask, b, tgt_len, src_len, dtype, unbatched):
        """nn.MultiheadAttention's masks as one additive mask broadcastable to (b, H/p, L, S), this
        rank's heads of a per-head ``[b·H, L, S]`` one; None without masks."""
        heads, n = self.num_heads // self.mesh.size, self.mesh.index("mesh")
        mask = None
        if attn_mask is not None:  # whole, each rank using its heads: a gradient summed over them
            attn_mask = reduce_grad(additive_mask(attn_mask, dtype, "attn_mask"), self.mesh, _ALL)
            if attn_mask.dim() == 2:
                expect_shape(attn_mask, (tgt_len, src_len), "attn_mask", "[L, S]", _NAME)
                mask = attn_mask
            else:
                expect_shape(attn_mask, (b * self.num_heads, tgt_len, src_len), "attn_mask", "[b·H, L, S]", _NAME)
                mask = attn_mask.view(b, self.num_heads, tgt_len, src_len)[:, n * heads : (n + 1) * heads]
        if key_padding_mask is not None:
            kpm = reduce_grad(additive_mask(key_padding_mask, dtype, "key_padding_mask"), self.mesh, _ALL)
            kpm = kpm.unsqueeze(0) if unbatched else kpm
            expect_shape(kpm, (b, src_len), "key_padding_mask", "[b, S]", _NAME)
            kpm = kpm.view(b, 1, 1, src_len)
            mask = kpm if mask is None else mask + kpm
        return mask

    def extra_repr(self) -> str:
        e, h = self.embed_dim, self.num_heads
        return f"embed_dim={e}, num_heads={h}, batch_first={self.batch_first}, mesh={self.mesh}"


def _blocks(module: nn.Module, shardings: dict[str, Sharding], mesh: Mesh) -> None:
    """Mark ``module``'s tensors named in ``shardings`` as blocks of ``mesh`` laid out so (the
    serial views, the checkpoints and ``clip_grad_norm_`` read them there)."""
    module._optimus2d_shardings, module._optimus2d_mesh = shardings, mesh
    keep_blocks_on_copy(module)
    for name in shardings:
        mark_block(getattr(module, name), module, name, mesh)


def _batch_first(t: torch.Tensor, unbatched: bool, batch_first: bool) -> torch.Tensor:
    if unbatched:
        return t.unsqueeze(0)
    return t if batch_first else t.transpose(0, 1)


def split_attention(region: nn.Module, mesh: Mesh) -> None:
    """Every ``nn.MultiheadAttention`` inside ``region`` replaced by its ``SplitMultiheadAttention``
    over ``mesh``'s ranks (in place; each module once, wherever it sits)."""
    made: dict[int, SplitMultiheadAttention] = {}
    for parent in list(region.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and splits(child):
                if id(child) not in made:
                    made[id(child)] = SplitMultiheadAttention.from_serial(child, mesh)
                parent._modules[name] = made[id(child)]


__all__ = ["SplitMultiheadAttention", "refusals", "split_attention", "splits"]
