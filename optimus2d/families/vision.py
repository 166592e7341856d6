"""What the vision transformers of several libraries share on the mesh (timm's ``VisionTransformer``,
Hugging Face's ViT and CLIP): hidden-split parameters summed over their replicas, the patch
convolution with its output channels split, and a position table whose rows stay whole.

Each holds ``[..., E/q]`` = hidden block j (this rank's index in its row group), the same block on
every rank of the column and depth groups; the gradient of that block is summed over col and depth
(each rank saw its own batch block). For a full activation ``[b, s, E]`` held as the block
``[b/(d·q), s, E/q]`` that is exactly what a token, a position or a patch embedding must add.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import primitives as P
from optimus2d.comm import reduce_grad
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding
from optimus2d.layers.base import ShardedModule, fill_from_serial, replace_by_block

REPLICAS = ("col", "depth")  # the axes over which a hidden block [..., E/q] is replicated


def hidden_sharding(shape: tuple[int, ...], dim: int = -1) -> Sharding:
    """``shape`` with dim ``dim`` split over the row group (block j), every other dim whole."""
    dim %= len(shape)
    return Sharding(tuple(("row",) if d == dim else () for d in range(len(shape))), tuple(shape))


def _sum_over_replicas(mesh: Mesh):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return P.summed_copy(grad, mesh, REPLICAS)

    return hook


def sum_grad_over_replicas(param: nn.Parameter, mesh: Mesh) -> nn.Parameter:
    """Hook ``param`` (a hidden block) so that its gradient is summed over col and depth.

    The hook is registered whether or not ``param`` requires grad (a frozen parameter has no
    gradient and the hook never runs), so a parameter unfrozen later still gets the serial
    gradient. A hook, not ``reduce_grad`` in a forward: the libraries' own forwards read these
    tensors directly (a class token, a table interpolated to another image size).
    """
    if any(mesh.axis_size(a) > 1 for a in REPLICAS):
        wanted = param.requires_grad
        param.requires_grad_(True).register_hook(_sum_over_replicas(mesh))
        param.requires_grad_(wanted)
    return param


def split_hidden(module: nn.Module, names: tuple[str, ...], mesh: Mesh) -> None:
    """Replace ``module``'s parameters ``names`` (``[..., E]``; absent or None ones are skipped) by
    their hidden blocks ``[..., E/q]``, recorded in ``module._optimus2d_shardings`` so that
    ``serial_state_dict`` and ``load_serial_state_dict`` see the serial tensors."""
    for name in names:
        full = getattr(module, name, None)
        if full is None or name in getattr(module, "_optimus2d_shardings", {}):
            continue
        if full.shape[-1] % mesh.q:
            raise ValueError(
                f"parallelize: {type(module).__name__}.{name} of shape {tuple(full.shape)}: hidden dim -1 is not "
                f"divisible by q={mesh.q} ({mesh})"
            )
        sum_grad_over_replicas(replace_by_block(module, name, hidden_sharding(tuple(full.shape)), mesh), mesh)


class PatchConv2D(ShardedModule):
    """``nn.Conv2d`` (groups 1) with its output channels split over the row group: the patch
    embedding of a vision transformer, run on the rank's own images.

    On rank (k, i, j): ``weight`` ``[E/q, C, kh, kw]`` and ``bias`` ``[E/q]`` = output channels
    block j, replicated over col and depth (gradients summed there). forward: images
    ``[b/(d·q), C, H, W]`` (``optimus2d.scatter_batch``) → ``[b/(d·q), E/q, H', W']``, so the usual
    ``.flatten(2).transpose(1, 2)`` gives the activation block ``[b/(d·q), H'·W', E/q]``. Sends
    nothing forward; backward all-reduces the weight and bias gradients over col and depth.
    """

    def __init__(self, conv: nn.Conv2d, mesh: Mesh) -> None:
        super().__init__(mesh)
        mesh = self.mesh  # a DeviceMesh given: its Mesh
        if conv.groups != 1 or conv.padding_mode != "zeros":
            raise ValueError(
                f"PatchConv2D: only groups=1 and padding_mode='zeros' are supported, got groups={conv.groups}, "
                f"padding_mode={conv.padding_mode!r}"
            )
        if conv.out_channels % mesh.q:
            raise ValueError(f"PatchConv2D: out_channels={conv.out_channels} is not divisible by q={mesh.q} ({mesh})")
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
            setattr(self, attr, getattr(conv, attr))
        self.declare("weight", hidden_sharding(tuple(conv.weight.shape), 0), device="meta")
        if conv.bias is not None:
            self.declare("bias", hidden_sharding(tuple(conv.bias.shape), 0), device="meta")
        else:
            self.register_parameter("bias", None)
        fill_from_serial(self, conv)

    @classmethod
    def from_serial(cls, conv: nn.Module, mesh: Mesh) -> PatchConv2D:
        if type(conv) is not nn.Conv2d:
            raise TypeError(f"PatchConv2D.from_serial expects nn.Conv2d, got {type(conv).__name__}")
        return cls(conv, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != self.in_channels:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"PatchConv2D(in_channels={self.in_channels}): expects images [b/(d·q), {self.in_channels}, H, W] "
                f"(optimus2d.scatter_batch), got {got} on {self.mesh}"
            )
        weight = reduce_grad(self.weight, self.mesh, REPLICAS)
        bias = reduce_grad(self.bias, self.mesh, REPLICAS) if self.bias is not None else None
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"local out_channels={self.out_channels // self.mesh.q}, mesh={self.mesh}"
        )


class PositionEmbedding2D(ShardedModule):
    """``nn.Embedding`` ``[P, E]`` of positions: every row whole, the hidden dim split over the row group.

    On rank (k, i, j): ``weight`` ``[P, E/q]`` = hidden block j, replicated over col and depth (a
    hook sums its gradient there: the libraries also read ``weight`` directly, e.g. to
    interpolate it). ``weight.shape[0]`` is ``P``, as serial code expects. forward: position ids
    (any shape, the same on every rank or ``scatter_batch``-ed) → ``[..., E/q]``; sends nothing.
    """

    def __init__(self, embedding: nn.Embedding, mesh: Mesh) -> None:
        super().__init__(mesh)
        mesh = self.mesh  # a DeviceMesh given: its Mesh
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("PositionEmbedding2D: max_norm, scale_grad_by_freq and sparse are not supported")
        if embedding.embedding_dim % mesh.q:
            raise ValueError(
                f"PositionEmbedding2D: embedding_dim={embedding.embedding_dim} is not divisible by q={mesh.q} ({mesh})"
            )
        self.num_embeddings, self.embedding_dim, self.padding_idx = (
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
        )
        weight = self.declare("weight", hidden_sharding(tuple(embedding.weight.shape)), device="meta")
        sum_grad_over_replicas(weight, mesh)
        fill_from_serial(self, embedding)

    @classmethod
    def from_serial(cls, embedding: nn.Module, mesh: Mesh) -> PositionEmbedding2D:
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"PositionEmbedding2D.from_serial expects nn.Embedding, got {type(embedding).__name__}")
        return cls(embedding, mesh)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n, mesh = self.num_embeddings, self.mesh
        outside = torch.tensor([int(((ids < 0) | (ids >= n)).sum())], dtype=torch.int64, device=ids.device)
        if ids.dim() > 1 and ids.shape[0] > 1 and mesh.size > 1:  # each sample's own: this rank's rows
            P.all_reduce_max(outside, mesh, "mesh")  # every rank refuses, not only those whose rows hold them
        if outside.item():
            raise ValueError(
                f"PositionEmbedding2D(num_embeddings={n}): position ids outside [0, {n}) ({outside.item()} in a "
                f"rank's block of ids {list(ids.shape)} on {mesh}): give positions the table holds"
            )
        return F.embedding(ids, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local=[{self.num_embeddings}, " + (
            f"{self.embedding_dim // self.mesh.q}], mesh={self.mesh}"
        )


_SUBCLASSES: dict[tuple[type, str], type] = {}


def with_forward(module: nn.Module, forward, suffix: str) -> nn.Module:
    """``module`` made an instance of a subclass of its class whose ``forward`` is ``forward`` (one
    subclass per class and suffix), so ``isinstance`` and the library's hooks still see it."""
    base = type(module)
    key = (base, suffix)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"{base.__name__}{suffix}", (base,), {"forward": forward, "__module__": __name__})
    module.__class__ = _SUBCLASSES[key]
    return module
