"""TransformerBlock2D: ``nn.TransformerEncoderLayer`` (batch_first) on the mesh, pre- or post-norm."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from optimus2d.comm import primitives as P
from optimus2d.comm.mesh import Mesh
from optimus2d.layers.attention import MultiheadAttention2D
from optimus2d.layers.base import fill_from_serial, refuse_dropped, runs_forward_of
from optimus2d.layers.dropout import Dropout2D
from optimus2d.layers.linear import Linear2D
from optimus2d.layers.mlp import activation_fn, feed_forward
from optimus2d.layers.norm import LayerNorm2D


def _declare(block, d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, norm_first, bias, *,
             cross: bool, num_kv_heads, kw) -> None:  # fmt: skip
    """The submodules of torch's encoder layer, or decoder layer (``cross``: with ``multihead_attn`` and
    a third norm), in torch's order, which is their ``state_dict``'s."""
    mesh = kw["mesh"]
    block.self_attn = MultiheadAttention2D(d_model, nhead, dropout, bias, num_kv_heads=num_kv_heads, **kw)
    if cross:
        block.multihead_attn = MultiheadAttention2D(d_model, nhead, dropout, bias, **kw)
    block.linear1 = Linear2D(d_model, dim_feedforward, bias, **kw)
    block.dropout = Dropout2D(dropout, mesh=mesh)
    block.linear2 = Linear2D(dim_feedforward, d_model, bias, **kw)
    block.norm_first = norm_first
    for n in range(1, 4 if cross else 3):
        setattr(block, f"norm{n}", LayerNorm2D(d_model, layer_norm_eps, bias=bias, **kw))
        setattr(block, f"dropout{n}", Dropout2D(dropout, mesh=mesh))
    block.activation = activation_fn(activation)


class TransformerBlock2D(nn.Module):
    """Self-attention and feed-forward with residuals, as ``nn.TransformerEncoderLayer(batch_first=True)``.

    ``norm_first=True``: ``x + attn(norm1(x))``, then ``x + ff(norm2(x))``; ``False``: post-norm.
    Submodules carry ``nn.TransformerEncoderLayer``'s names (``self_attn``, ``linear1``, ``linear2``,
    ``norm1``, ``norm2``), so ``serial_state_dict`` gives that module's keys.
    Global ``[b, s, d_model]``; on rank (k, i, j) ``[b/(d·q), s, d_model/q]``.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[torch.Tensor], torch.Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        norm_first: bool = False,
        bias: bool = True,
        *,
        num_kv_heads: int | None = None,
        mesh: Mesh,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"mesh": mesh, "device": device, "dtype": dtype}
        _declare(self, d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, norm_first, bias,
                 cross=False, num_kv_heads=num_kv_heads, kw=kw)  # fmt: skip

    @classmethod
    def from_serial(cls, layer: nn.TransformerEncoderLayer, mesh: Mesh) -> TransformerBlock2D:
        """The same block with ``layer``'s weights (its activation function is kept as it is)."""
        if not isinstance(layer, nn.TransformerEncoderLayer):
            raise TypeError(
                f"TransformerBlock2D.from_serial expects nn.TransformerEncoderLayer, got {type(layer).__name__}"
            )
        return _from_serial(cls, layer, mesh)

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff_block(x))

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        out = self.self_attn(
            x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False, is_causal=is_causal
        )[0]
        return self.dropout1(out)

    def _ff_block(self, x):
        return self.dropout2(feed_forward(x, self.linear1, self.activation, self.linear2, self.dropout))


class TransformerDecoderBlock2D(nn.Module):
    """``nn.TransformerDecoderLayer(batch_first=True)`` on the mesh: self-attention, cross-attention
    over ``memory``, feed-forward; pre- or post-norm. Submodules carry the torch names.

    ``tgt`` ``[b/(d·q), t, d_model/q]`` and ``memory`` ``[b/(d·q), s, d_model/q]`` → like ``tgt``.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[torch.Tensor], torch.Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        norm_first: bool = False,
        bias: bool = True,
        *,
        mesh: Mesh,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"mesh": mesh, "device": device, "dtype": dtype}
        _declare(self, d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, norm_first, bias,
                 cross=True, num_kv_heads=None, kw=kw)  # fmt: skip

    @classmethod
    def from_serial(cls, layer: nn.TransformerDecoderLayer, mesh: Mesh) -> TransformerDecoderBlock2D:
        if not isinstance(layer, nn.TransformerDecoderLayer):
            raise TypeError(
                f"TransformerDecoderBlock2D.from_serial expects nn.TransformerDecoderLayer, got {type(layer).__name__}"
            )
        MultiheadAttention2D.check_serial(layer.multihead_attn)
        return _from_serial(cls, layer, mesh)

    def forward(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        tgt_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        tgt_key_padding_mask: torch.Tensor | None = None,
        memory_key_padding_mask: torch.Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> torch.Tensor:
        x = tgt
        sa = (tgt_mask, tgt_key_padding_mask, tgt_is_causal)
        ca = (memory_mask, memory_key_padding_mask, memory_is_causal)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), *sa)
            x = x + self._mha_block(self.norm2(x), memory, *ca)
            return x + self._ff_block(self.norm3(x))
        x = self.norm1(x + self._sa_block(x, *sa))
        x = self.norm2(x + self._mha_block(x, memory, *ca))
        return self.norm3(x + self._ff_block(x))

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        out = self.self_attn(
            x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False, is_causal=is_causal
        )[0]
        return self.dropout1(out)

    def _mha_block(self, x, memory, attn_mask, key_padding_mask, is_causal):
        out = self.multihead_attn(
            x, memory, memory, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False,
            is_causal=is_causal,
        )[0]  # fmt: skip
        return self.dropout2(out)

    def _ff_block(self, x):
        return self.dropout3(feed_forward(x, self.linear1, self.activation, self.linear2, self.dropout))


_PARTS = {  # what torch's constructors make, by name
    nn.MultiheadAttention: ("self_attn", "multihead_attn"),
    nn.Linear: ("linear1", "linear2"),
    nn.LayerNorm: ("norm1", "norm2", "norm3"),
    nn.Dropout: ("dropout", "dropout1", "dropout2", "dropout3"),
}


def _from_serial(cls: type, layer: nn.Module, mesh: Mesh) -> nn.Module:
    """An encoder or decoder block built like ``layer`` on meta, then given its blocks, dropouts and
    eps. A part replaced after the layer was built (a norm by ``nn.Identity`` or ``nn.RMSNorm``, a
    linear by a ``Sequential``) is refused: the block is built as torch's constructor builds it."""
    for torch_cls, names in _PARTS.items():
        for name in names:
            part = getattr(layer, name, None)
            if name in layer._modules and not runs_forward_of(part, (torch_cls,)):
                raise TypeError(
                    f"{cls.__name__}.from_serial: {type(layer).__name__}.{name} is a {type(part).__name__}, not the "
                    f"{torch_cls.__name__} its constructor makes"
                )
    MultiheadAttention2D.check_serial(layer.self_attn)
    attn, linear1 = layer.self_attn, layer.linear1
    args = (attn.embed_dim, attn.num_heads, linear1.out_features, layer.dropout.p, layer.activation)
    args += (layer.norm1.eps, layer.norm_first, linear1.bias is not None)
    module = cls(*args, mesh=mesh, device="meta")
    refuse_dropped(module, layer)
    fill_from_serial(module, layer)
    own = {Dropout2D: "p", MultiheadAttention2D: "dropout", LayerNorm2D: "eps"}  # one value each in torch's
    for name, sub in module.named_modules():  # constructor: kept if the layer's were changed after
        if type(sub) in own:
            setattr(sub, own[type(sub)], getattr(layer.get_submodule(name), own[type(sub)]))
    return module


class TransformerStack2D(nn.Module):
    """``nn.TransformerEncoder``/``nn.TransformerDecoder`` on the mesh: ``layers`` then ``norm``.

    Calls each layer as torch does (``mask``/``src_key_padding_mask``/``is_causal`` for an encoder;
    the decoder's arguments passed through). ``nested``: the serial encoder's ``use_nested_tensor``
    (``mask_check`` its own): where torch would take its nested-tensor path (in eval, without grad,
    given a padding mask and no attention mask, ``_nested_padding``), it runs the layers on each
    sample's first n tokens, n those its mask keeps, and returns zeros past them, before ``norm``;
    so does this, the layers given "past the first n" as their padding mask. ``serial_arguments``:
    the names of the serial class's ``forward`` arguments (``("src", "mask", ...)``), read by
    ``io="whole"``.
    """

    def __init__(
        self,
        layers: nn.ModuleList,
        norm: nn.Module | None,
        nested: bool = False,
        mask_check: bool = True,
        serial_arguments: tuple[str, ...] = (),
    ):
        super().__init__()
        self.layers, self.norm = layers, norm
        self.serial_arguments = serial_arguments  # the serial forward's positional names, past self
        self.nested, self.mask_check = nested, mask_check

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        kwargs = _encoder_kwargs(kwargs)
        past = None
        if self.nested:
            names = ("src_mask", "src_key_padding_mask", "is_causal")[: len(args)]  # torch's encoder's order
            kwargs, args = {**dict(zip(names, args, strict=True)), **kwargs}, ()
            past = self._nested_padding(x, kwargs)
            if past is not None:  # torch's fast path on a nested tensor: no is_causal (it ignores it)
                kwargs["src_key_padding_mask"] = past
                kwargs.pop("is_causal", None)
        for layer in self.layers:
            x = layer(x, *args, **kwargs)
        if past is not None:
            x = x.masked_fill(self._rows(past, x)[..., None], 0.0)
        return self.norm(x) if self.norm is not None else x

    def _nested_padding(self, x: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
        """``nested_padding`` on this rank's block: torch's left-alignment check is over the whole
        batch, every block's (summed over col and depth where the mask is this rank's block)."""
        mesh = self.layers[0].self_attn.mesh

        def anywhere(apart: torch.Tensor) -> bool:
            if kwargs["src_key_padding_mask"].shape[0] == x.shape[0]:  # this rank's block of the batch
                for axis in ("col", "depth"):
                    P.all_reduce(apart, mesh, axis)
            return bool(apart.item())

        return nested_padding(self.layers[0], x, kwargs, self.mask_check, anywhere)

    def _rows(self, past: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``past``, given whole ``[b, S]`` or as this rank's block."""
        if past.shape[0] == x.shape[0]:
            return past
        mesh = self.layers[0].self_attn.mesh
        block = mesh.index("depth") * mesh.q + mesh.index("col")
        return past[block * x.shape[0] : (block + 1) * x.shape[0]]


def nested_padding(first: nn.Module, x: torch.Tensor, kwargs: dict, mask_check: bool, anywhere=None):
    """``[b, S]`` True past each sample's first n tokens where torch's ``nn.TransformerEncoder``
    (``use_nested_tensor``) would run its layers on a nested tensor of those tokens (its own
    conditions, in its order; the serial parameters are plain tensors: no ``has_torch_function``),
    None where it would not. ``first``: its first layer; ``kwargs``: the layers' (``src_mask``,
    ``src_key_padding_mask``); ``anywhere(flag)``: whether a float flag ``[1]`` is set on any
    rank's part of the batch (default: this tensor's own)."""
    mask, kpm = kwargs.get("src_mask"), kwargs.get("src_key_padding_mask")
    devices = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
    grads = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in first.parameters()))
    if (
        not torch.backends.mha.get_fastpath_enabled()
        or first.training
        or x.dim() != 3
        or kpm is None
        or (mask_check and torch.compiler.is_compiling())
        or mask is not None
        or torch.is_autocast_enabled()
        or x.device.type not in devices
        or grads
    ):
        return None
    padded = kpm != 0  # as torch reads it: True where padded (a float mask pads at its non-zeros)
    n = (~padded).sum(-1, keepdim=True)
    past = torch.arange(padded.shape[-1], device=padded.device) >= n
    if mask_check:  # not left-aligned: torch runs the layers on the whole tensor
        apart = (past != padded).any().to(torch.float32).reshape(1)
        if anywhere(apart) if anywhere is not None else bool(apart.item()):
            return None
    return past


def _encoder_kwargs(kwargs: dict) -> dict:
    """nn.TransformerEncoder's names → nn.TransformerEncoderLayer's (mask → src_mask, ...)."""
    renamed = {"mask": "src_mask"}
    out = {renamed.get(k, k): v for k, v in kwargs.items()}
    if out.get("is_causal") is None:
        out.pop("is_causal", None)
    return out
