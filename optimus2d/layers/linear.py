"""Linear2D: ``nn.Linear`` with the weight and the activations split over the q×q mesh."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import reduce_grad, stationary_ab, stationary_abt, summa_ab, summa_abt
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.primitives import is_transposed_view
from optimus2d.comm.recompute import Activation
from optimus2d.comm.sharding import Sharding
from optimus2d.cost.volume import linear_2d_algorithm
from optimus2d.layers.base import ShardedModule, fill_from_serial


class Linear2D(ShardedModule):
    """``y = x·Wᵀ + b`` with x, y, W and b split over the mesh; same init and weights as ``nn.Linear``.

    Global shapes: x ``[b, ..., in]`` → y ``[b, ..., out]``; W ``[out, in]``; b ``[out]``.
    On rank (k, i, j): x ``[b/(d·q), ..., in/q]`` → y ``[b/(d·q), ..., out/q]`` (batch block
    k·q + i, feature block j); ``weight`` ``[out/q, in/q]`` in torch's layout; ``bias`` ``[out/q]`` =
    b[block j], replicated over col and depth.

    Which weight block a rank holds depends on the cheaper SUMMA form (each moves
    3·B·f/(d·q) activation elements per rank, B = rows, f = the feature size it broadcasts):

    * ``summa="ab"``  (in ≤ out): weight = W[out block j, in block i]; y = summa_ab(x, Wᵀ).
    * ``summa="abt"`` (in > out): weight = W[out block i, in block j]; y = summa_abt(x, W).

    ``parts`` (e.g. ``(E, E, E)`` for a fused q/k/v projection): each part of the output is split
    on its own, so the output block j is [q block j, k block j, v block j].

    ``algorithm``: how the product travels (see ``linear_2d``): "auto" (default) takes, per call,
    SUMMA or the weight-stationary form, whichever moves fewer elements for the batch at hand.

    On a mesh with q=1 the layer is ``F.linear`` (plus the depth all-reduce of its gradients).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        mesh: Mesh,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parts: tuple[int, ...] | None = None,
        algorithm: str = "auto",
    ) -> None:
        super().__init__(mesh)
        mesh = self.mesh  # a DeviceMesh given: its Mesh
        if algorithm not in ALGORITHMS:
            raise ValueError(f"Linear2D: algorithm {algorithm!r} is not one of {ALGORITHMS}")
        self.algorithm = algorithm
        for name, n in (
            ("in_features", in_features),
            ("out_features", out_features),
            *(("a part", p) for p in parts or ()),
        ):
            if n % mesh.q:
                raise ValueError(f"Linear2D: {name}={n} is not divisible by q={mesh.q} ({mesh})")
        if parts is not None and sum(parts) != out_features:
            raise ValueError(f"Linear2D: parts {parts} do not add up to out_features={out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.summa = "ab" if in_features <= out_features else "abt"
        w_dims = (("row",), ("col",)) if self.summa == "ab" else (("col",), ("row",))
        self.declare("weight", Sharding(w_dims, (out_features, in_features), parts), device=device, dtype=dtype)
        if bias:
            self.declare("bias", Sharding((("row",),), (out_features,), parts), device=device, dtype=dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The blocks of ``nn.Linear(in, out)`` initialised with the same RNG state (same on every rank)."""
        full = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        for name in self.shardings:
            self.load_serial_tensor(name, getattr(full, name))

    @classmethod
    def from_serial(cls, linear: nn.Linear, mesh: Mesh, parts: tuple[int, ...] | None = None) -> Linear2D:
        """This rank's blocks of ``linear``'s weight and bias (no communication).

        ``parts``: the output is a concatenation of parts (a fused q/k/v projection), each split
        on its own, so that output block j holds block j of every part (whole heads).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Linear2D.from_serial expects nn.Linear, got {type(linear).__name__}")
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None, mesh=mesh, device="meta", parts=parts
        )
        fill_from_serial(module, linear)
        return module

    def forward(self, x: torch.Tensor, *, input_activation: Activation = None) -> torch.Tensor:
        """``input_activation``: y = linear(act(x)) keeping x, not act(x), for backward, where act(x)
        is recomputed (``comm/recompute.py``; act element-wise and deterministic)."""
        self._check_input(x)
        return linear_2d(x, self.weight, self.bias, self.mesh, self.summa, self.algorithm, input_activation)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Linear2D expects a tensor, got {type(x).__name__}")
        local_in = self.in_features // self.mesh.q
        if x.dim() < 2 or x.shape[-1] != local_in:
            hint = ""
            if x.dim() >= 1 and x.shape[-1] == self.in_features and self.mesh.q > 1:
                hint = "; it looks like the full tensor: pass this rank's block (optimus2d.scatter)"
            raise ValueError(
                f"Linear2D(in_features={self.in_features}): input of shape {tuple(x.shape)} must be "
                f"[rows..., in_features/q = {local_in}] on {self.mesh}{hint}"
            )

    def extra_repr(self) -> str:
        q = self.mesh.q
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"local=[{self.out_features // q}, {self.in_features // q}], summa={self.summa}, "
            f"algorithm={self.algorithm}, mesh={self.mesh}"
        )


class TransposedLinear2D(ShardedModule):
    """``y = x·W + b`` with W stored ``[in, out]`` (GPT-2's ``Conv1D``), split like ``Linear2D``'s.

    On rank (k, i, j): ``weight`` ``[in/q, out/q]`` (the transpose of the block ``Linear2D`` would
    hold), ``bias`` ``[out/q]``. ``parts``: the output is a concatenation of parts (GPT-2's fused
    q, k, v), each split on its own so that column j holds whole heads.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        parts: tuple[int, ...] | None = None,
        mesh: Mesh,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(mesh)
        mesh = self.mesh  # a DeviceMesh given: its Mesh
        if parts is not None and sum(parts) != out_features:
            raise ValueError(f"TransposedLinear2D: parts {parts} do not add up to out_features={out_features}")
        for name, n in (("in_features", in_features), *(("a part", p) for p in parts or (out_features,))):
            if n % mesh.q:
                raise ValueError(f"TransposedLinear2D: {name}={n} is not divisible by q={mesh.q} ({mesh})")
        self.in_features, self.out_features = in_features, out_features
        self.summa = "ab" if in_features <= out_features else "abt"
        dims = (("col",), ("row",)) if self.summa == "ab" else (("row",), ("col",))
        self.declare(
            "weight", Sharding(dims, (in_features, out_features), parts, parts_dim=1), device=device, dtype=dtype
        )
        if bias:
            self.declare("bias", Sharding((("row",),), (out_features,), parts), device=device, dtype=dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """transformers' Conv1D init: weight N(0, 0.02²) drawn whole (the same on every rank), bias 0."""
        full = torch.empty(self.shardings["weight"].full_shape, device=self.weight.device, dtype=self.weight.dtype)
        self.load_serial_tensor("weight", nn.init.normal_(full, std=0.02))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @classmethod
    def from_serial(cls, conv1d: nn.Module, mesh: Mesh, parts: tuple[int, ...] | None = None) -> TransposedLinear2D:
        """From any module with ``weight`` ``[in, out]`` and ``bias`` ``[out]`` (transformers' Conv1D)."""
        w, b = conv1d.weight, getattr(conv1d, "bias", None)
        module = cls(w.shape[0], w.shape[1], b is not None, parts=parts, mesh=mesh, device="meta")
        fill_from_serial(module, conv1d)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local_in = self.in_features // self.mesh.q
        if x.dim() < 2 or x.shape[-1] != local_in:
            raise ValueError(
                f"TransposedLinear2D(in_features={self.in_features}): input of shape {tuple(x.shape)} must be "
                f"[rows..., in_features/q = {local_in}] on {self.mesh}"
            )
        refuse_meta("TransposedLinear2D", x, self.weight, self.mesh)
        if x.dtype != self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"TransposedLinear2D: input dtype {x.dtype} differs from weight dtype {self.weight.dtype}")
        if self.mesh.q == 1:
            return _stored_in_out(x, self.weight, self.bias, self.mesh)
        return linear_2d(x, self.weight.t(), self.bias, self.mesh, self.summa)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, summa={self.summa}, mesh={self.mesh}"


def refuse_meta(what: str, x: torch.Tensor, weight: torch.Tensor, mesh: Mesh) -> None:
    """A product on meta tensors has no values to send (and autocast knows no meta device): refused
    here too, for a call inside another module (an outermost call refuses at its entry, on every rank)."""
    for name, t in (("input", x), ("weight", weight)):
        if t.is_meta:
            raise TypeError(
                f"{what}: its {name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)} is on the meta device, "
                f"which holds no values ({mesh}): pass real tensors, and materialize a model built on meta first "
                f"(optimus2d.materialize)"
            )


def _stored_in_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mesh: Mesh) -> torch.Tensor:
    """``x·W + b`` on a mesh with q = 1, W stored ``[in, out]``: multiplied as Conv1D does (one
    addmm, autocast by torch), so dW is made in W's layout; weight and bias reduced over depth.
    The caller has checked the dtypes."""
    weight = reduce_grad(weight, mesh, ("depth",))
    if bias is None:
        return x @ weight
    bias = reduce_grad(bias, mesh, ("depth",))
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[1])


ALGORITHMS = ("auto", "summa", "stationary")


def linear_2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mesh: Mesh,
    summa: str,
    algorithm: str = "auto",
    input_activation: Activation = None,
) -> torch.Tensor:
    """``F.linear`` on the mesh: x ``[rows..., in/q]``, weight ``[out/q, in/q]``, bias ``[out/q]``.

    ``summa`` says which block the weight is ("ab": W[out blk j, in blk i]; "abt": W[out blk i,
    in blk j]). ``algorithm``: "summa" moves weight and activation blocks (``comm/summa.py``),
    "stationary" only activations (``comm/stationary.py``); "auto" takes the one that moves fewer
    elements for this call's rows and the gradients it will need (none under ``no_grad``;
    ``optimus2d.cost.linear_2d_algorithm``). Under autocast the
    three are cast as autocast casts F.linear's inputs, so the collectives move the low-precision
    tensors. ``input_activation``: F.linear(act(x), ...) with x kept for backward instead of act(x)
    (on q = 1 too, through the products, which then send nothing).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"linear_2d: algorithm {algorithm!r} is not one of {ALGORITHMS}")
    refuse_meta("Linear2D", x, weight, mesh)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return linear_2d(x, weight, bias, mesh, summa, algorithm, input_activation)
    if x.dtype != weight.dtype:
        raise TypeError(f"Linear2D: input dtype {x.dtype} differs from weight dtype {weight.dtype}")
    if mesh.q == 1 and input_activation is None:
        if is_transposed_view(weight):  # stored [in, out]
            return _stored_in_out(x, weight.t(), bias, mesh)
        bias = reduce_grad(bias, mesh, ("depth",)) if bias is not None else None
        return F.linear(x, reduce_grad(weight, mesh, ("depth",)), bias)
    rows = x.reshape(-1, x.shape[-1])
    if algorithm == "auto":  # by what this call moves: its rows, and the gradients backward will make
        fin, fout = x.shape[-1] * mesh.q, weight.shape[0] * mesh.q
        grad = torch.is_grad_enabled()
        needs = {"dx": grad and x.requires_grad, "dw": grad and weight.requires_grad}
        algorithm = linear_2d_algorithm(rows.shape[0] * mesh.depth * mesh.q, fin, fout, mesh.q, mesh.depth, **needs)
    act = {"activation": input_activation}
    if algorithm == "stationary":
        y = stationary_ab(rows, weight.t(), mesh, **act) if summa == "ab" else stationary_abt(rows, weight, mesh, **act)
    else:
        y = summa_ab(rows, weight.t(), mesh, **act) if summa == "ab" else summa_abt(rows, weight, mesh, **act)
    y = y.view(*x.shape[:-1], y.shape[-1])
    if bias is not None:
        y = y + reduce_grad(bias, mesh, ("col", "depth"))
    return y
