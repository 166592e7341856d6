"""LayerNorm2D and RMSNorm2D: statistics over a hidden dim that is split over the row group."""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from optimus2d.comm import primitives as P
from optimus2d.comm import reduce_grad
from optimus2d.comm.first_order import first_order
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding
from optimus2d.layers.base import ShardedModule, compute_dtype, fill_from_serial


class _Norm2D(Function):
    """y = x̂·w + b with x̂ = (x − μ)·r (LayerNorm) or x·r (RMSNorm), over the full hidden size.

    forward, LayerNorm: one all-gather over the row of each block's [mean, M2] per row, combined
    as Chan et al. do (no cancellation when the mean is large); RMSNorm: one all-reduce of Σx².
    backward: one all-reduce over the row of [Σg, Σg·x̂] (RMS: [Σg·x̂]), g = dy·w.
    Saves x and two numbers a row. Computes in fp32 (fp64 for fp64 inputs).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mesh: Mesh, hidden: int, eps: float, rms: bool):
        xf = x.to(compute_dtype(x))
        if rms:
            sum_sq = xf.square().sum(-1, keepdim=True)
            P.all_reduce(sum_sq, mesh, "row")
            mean, var = torch.zeros_like(sum_sq), sum_sq / hidden
        else:
            local_mean = xf.mean(-1, keepdim=True)
            local_m2 = (xf - local_mean).square().sum(-1, keepdim=True)
            blocks = P.all_gather(torch.stack([local_mean, local_m2], -1), mesh, "row", -2)  # [..., q, 2]
            means, m2s = blocks[..., 0], blocks[..., 1]  # [..., q]
            mean = means.mean(-1, keepdim=True)
            m2 = m2s.sum(-1, keepdim=True) + x.shape[-1] * (means - mean).square().sum(-1, keepdim=True)
            var = m2 / hidden
        rstd = torch.rsqrt(var + eps)
        y = (xf - mean) * rstd
        if weight is not None:
            y = y * weight.to(xf.dtype)
        if bias is not None:
            y = y + bias.to(xf.dtype)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.mesh, ctx.hidden, ctx.rms, ctx.has_bias = mesh, hidden, rms, bias is not None
        return y.to(x.dtype)

    @staticmethod
    @first_order
    def backward(ctx, grad_y):
        x, weight, mean, rstd = ctx.saved_tensors
        x_hat = (x.to(mean.dtype) - mean) * rstd
        dy = grad_y.to(mean.dtype)
        g = dy * weight.to(mean.dtype) if weight is not None else dy
        lead = tuple(range(x.dim() - 1))
        grad_w = (dy * x_hat).sum(lead).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = dy.sum(lead).to(grad_y.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            gx = (g * x_hat).sum(-1, keepdim=True)
            stats = gx if ctx.rms else torch.cat([g.sum(-1, keepdim=True), gx], -1)
            P.all_reduce(stats, ctx.mesh, "row")
            means = stats / ctx.hidden
            grad_x = g - x_hat * means[..., -1:]
            if not ctx.rms:
                grad_x = grad_x - means[..., :1]
            grad_x = (grad_x * rstd).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class _Norm2DBase(ShardedModule):
    def __init__(self, normalized_shape, eps, elementwise_affine, bias, *, mesh, device, dtype) -> None:
        super().__init__(mesh)
        mesh = self.mesh  # a DeviceMesh given: its Mesh
        shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)
        name = type(self).__name__
        if len(shape) != 1:
            raise ValueError(f"{name} normalises the last dim only; got normalized_shape={shape}")
        (hidden,) = shape
        if hidden % mesh.q:
            raise ValueError(f"{name}: hidden size {hidden} is not divisible by q={mesh.q} ({mesh})")
        self.normalized_shape, self.eps = shape, eps
        self.elementwise_affine = elementwise_affine
        self.weight_offset = 0.0  # the scale is weight + weight_offset (1.0: Gemma's RMSNorm)
        for pname, wanted in (("weight", elementwise_affine), ("bias", elementwise_affine and bias)):
            if wanted:
                self.declare(pname, Sharding((("row",),), shape), device=device, dtype=dtype)
            else:
                self.register_parameter(pname, None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def input_refusal(self, args: tuple, kwargs: dict) -> BaseException | None:
        """A block that is not floating: on q > 1 it was normalised in fp32 and cast back to its
        integers (no error, where torch's norm and q = 1 raise)."""
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor) and not x.is_floating_point():
            return TypeError(f"{type(self).__name__} expects a floating activation block, got {x.dtype}{list(x.shape)}")
        return None

    def _normalise(self, x: torch.Tensor, eps: float, rms: bool) -> torch.Tensor:
        local = self.normalized_shape[0] // self.mesh.q
        if x.shape[-1] != local:
            raise ValueError(
                f"{type(self).__name__}({self.normalized_shape[0]}): input of shape {tuple(x.shape)} must end in "
                f"hidden/q = {local} on {self.mesh}"
            )
        weight = reduce_grad(self.weight, self.mesh, ("col", "depth")) if self.weight is not None else None
        if weight is not None and self.weight_offset:  # Gemma's RMSNorm scales by (1 + w)
            weight = weight + self.weight_offset
        bias = reduce_grad(self.bias, self.mesh, ("col", "depth")) if self.bias is not None else None
        if self.mesh.q == 1:  # the hidden dim is whole here: torch's own fused kernel
            if rms:
                return F.rms_norm(x, self.normalized_shape, weight, eps)
            return F.layer_norm(x, self.normalized_shape, weight, bias, eps)
        return _Norm2D.apply(x, weight, bias, self.mesh, self.normalized_shape[0], eps, rms)

    def _from_serial(self, module: nn.Module) -> None:
        self.weight_offset = float(getattr(module, "weight_offset", 0.0))
        fill_from_serial(self, module)

    def extra_repr(self) -> str:
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{offset}, "
            f"mesh={self.mesh}"
        )


class LayerNorm2D(_Norm2DBase):
    """``nn.LayerNorm`` over the last dim, which is split over the row group.

    Global: x ``[b, ..., h]``; weight, bias ``[h]``. On rank (k, i, j): x ``[b/(d·q), ..., h/q]``;
    weight, bias ``[h/q]`` = block j, replicated over col and depth.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        mesh: Mesh,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, mesh=mesh, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._normalise(x, self.eps, rms=False)

    @classmethod
    def from_serial(cls, norm: nn.LayerNorm, mesh: Mesh) -> LayerNorm2D:
        if not isinstance(norm, nn.LayerNorm):
            raise TypeError(f"LayerNorm2D.from_serial expects nn.LayerNorm, got {type(norm).__name__}")
        module = cls(
            norm.normalized_shape,
            norm.eps,
            norm.elementwise_affine,
            norm.bias is not None,
            mesh=mesh,
            device="meta",
        )
        module._from_serial(norm)
        return module


class RMSNorm2D(_Norm2DBase):
    """``nn.RMSNorm`` over the last dim, which is split over the row group.

    Global: x ``[b, ..., h]``; weight ``[h]``. On rank (k, i, j): x ``[b/(d·q), ..., h/q]``; weight
    ``[h/q]`` = block j, replicated over col and depth. ``eps=None`` is the eps of the dtype it
    computes in, as torch's kernel takes it: float32's for bf16 and fp16 inputs, float64's for float64.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        mesh: Mesh,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, False, mesh=mesh, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(compute_dtype(x)).eps  # as torch's kernel
        return self._normalise(x, eps, rms=True)

    @classmethod
    def from_serial(cls, norm: nn.RMSNorm, mesh: Mesh) -> RMSNorm2D:
        if not isinstance(norm, nn.RMSNorm):
            raise TypeError(f"RMSNorm2D.from_serial expects nn.RMSNorm, got {type(norm).__name__}")
        module = cls(norm.normalized_shape, norm.eps, norm.elementwise_affine, mesh=mesh, device="meta")
        module._from_serial(norm)
        return module
