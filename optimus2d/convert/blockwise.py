"""Which unregistered modules ``parallelize`` may keep or convert, judged by what they are and do.

On the mesh the hidden dim of every activation is split (``[b/(d·q), ..., h/q]``), so a module
whose forward is kept must act element by element on that dim, or on whole heads. ``parallelize``
keeps a module it has no converter for only when one of these says so:

- ``acts_elementwise(m)``: a leaf without tensors that, probed with random ``[2, 3, 8]`` and
  ``[2, 8]`` inputs, gives on each half of the last dim and of the first what it gives on the
  whole (an activation, say: not a softmax or a norm over the hidden dim, nor a mean over the batch);
- ``as_norm(m)``: a leaf holding only a 1-D ``weight`` (and ``bias``) that, probed with a random
  weight and inputs of two scales, computes RMSNorm (``w·x̂`` or Gemma's ``(1 + w)·x̂``) or
  LayerNorm with the ``eps`` it stores: it becomes an ``RMSNorm2D``/``LayerNorm2D``;
- ``forward_problems(m)`` (``forward_reader.py``): a container (no tensors of its own) whose
  forward, read as code for this instance, only calls its children, element-wise functions and
  known per-head helpers, and never mixes the split last dim. Anything it cannot vouch for is a
  problem, named with its line.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import primitives as P
from optimus2d.convert.forward_reader import forward_problems
from optimus2d.convert.forward_values import HEAD_SIZES
from optimus2d.convert.registry import elementwise
from optimus2d.layers.base import keep_blocks_on_copy

__all__ = [
    "activation_refusal",
    "acts_elementwise",
    "as_norm",
    "forward_problems",
    "head_problems",
    "independent_of_hidden",
    "per_head",
]


def acts_elementwise(module: nn.Module, modes: tuple[bool, ...] = (False, True)) -> bool:
    """A parameter-free leaf whose output on each half of the last dim, and of the first, is its
    output on that half (``_halves_agree``), in eval and in training mode (``modes``: those
    probed). A training-mode probe draws from a fork of torch's generator, leaving the caller's
    stream as it was."""
    if list(module.children()) or any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return False
    was = module.training
    try:
        for training in modes:
            module.train(training)
            with torch.random.fork_rng(devices=[]):
                if not _halves_agree(module):
                    return False
    finally:
        module.train(was)
    return True


def eval_only(module: nn.Module, mesh) -> nn.Module:
    """Kept as it is (element-wise in eval), refusing to run in training, where it draws (timm's
    ``DropPath``: one draw a sample): each rank would draw for its own block from the same stream, so
    the batch blocks would repeat each other's decisions, not serial's draws."""
    module.register_forward_pre_hook(_refuse_training)
    return module


def _refuse_training(module: nn.Module, args: tuple) -> None:
    if module.training:
        raise ValueError(
            f"{type(module).__name__}: acts element by element in eval only; in training it draws (per sample or "
            f"per element), which on blocks would not be serial's draws: call .eval() on it, or register a "
            f"converter for it (optimus2d.convert.register_converter)"
        )


def acts_elementwise_with_scalars(module: nn.Module) -> bool:
    """A leaf whose parameters and buffers each hold one value (xIELU's alphas, beta and eps) and whose
    output on each half of the last dim is its output on that half: kept whole on every rank
    (``replicated``: each rank's gradient of a scalar covers its own elements, summed over the mesh)."""
    tensors = [*module.parameters(), *module.buffers()]
    if list(module.children()) or not tensors or any(t.numel() != 1 for t in tensors):
        return False
    if any(t.is_meta for t in tensors):  # built on meta: probe a copy holding values
        g = torch.Generator().manual_seed(0)
        params, buffers = (
            {n: torch.rand(t.shape, generator=g).to(t.dtype) for n, t in named}
            for named in (module.named_parameters(recurse=False), module.named_buffers(recurse=False))
        )
        module = _copy_with(module, params, buffers)
    return _halves_agree(module)


_FUNCTIONS = (F.relu, F.gelu, F.silu, F.mish, F.elu, F.selu, F.celu, F.leaky_relu, F.relu6, F.softplus,
              F.hardswish, F.hardsigmoid, F.tanh, F.sigmoid, torch.relu, torch.tanh, torch.sigmoid)  # fmt: skip


class _Called(nn.Module):
    """A function as a module, for the probe."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def activation_refusal(activation: object) -> str | None:
    """Why a layer's ``activation`` (``nn.TransformerEncoderLayer``'s: a function or a module, set by
    the constructor or after) cannot be applied to the hidden blocks, or None: torch's element-wise
    functions and modules pass, so does another callable that the probe finds element-wise (a
    softmax, a mean over the batch do not)."""
    if any(activation is fn for fn in _FUNCTIONS):
        return None
    if isinstance(activation, nn.Module):
        if elementwise(activation) or acts_elementwise(activation):
            return None
    elif callable(activation) and acts_elementwise(_Called(activation)):
        return None
    name = getattr(activation, "__qualname__", None) or type(activation).__qualname__
    return f"its activation {name} is not known to act element by element (a probe with a random input says not)"


def _halves_agree(module: nn.Module) -> bool:
    """Its output on each half of a random input is its output on that half of the whole: halves of
    the last dim (the split hidden dim) and of the first (the split batch), of ``[rows, 3, 8]`` and
    of ``[rows, 8]`` (where dim 1 is the hidden dim: a softmax over it); an input of 2 dims it
    cannot take at all is not asked (a serial model never gives it one)."""
    g = torch.Generator().manual_seed(0)
    rows = 64 if module.training else 2  # in training: enough rows that draws cannot agree by chance
    for shape in ((rows, 3, 8), (rows, 8)):
        x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
        try:
            with torch.no_grad():
                whole = module(x)
        except Exception:
            if len(shape) == 2:
                continue
            return False
        if not isinstance(whole, torch.Tensor) or whole.shape != x.shape:
            return False
        for dim in (-1, 0):
            try:
                with torch.no_grad():
                    halves = [module(part.clone()) for part in x.chunk(2, dim)]
            except Exception:
                return False
            parts = x.chunk(2, dim)
            if not all(isinstance(h, torch.Tensor) and h.shape == p.shape for h, p in zip(halves, parts, strict=True)):
                return False
            if not torch.allclose(torch.cat(halves, dim), whole, rtol=1e-10, atol=1e-12):  # (fp64: a kernel's
                return False  # vector and scalar paths differ in the last bits; a mix of halves by far more)
    return True


def independent_of_hidden(module: nn.Module) -> bool:
    """A leaf with buffers and no parameters whose output, called as ``module(x, position_ids)``,
    is the same for inputs of 8 and of 4 features (a rotary embedding's cos/sin table, say)."""
    if list(module.children()) or list(module.parameters()) or not list(module.buffers()):
        return False
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(3).expand(2, 3)
    probe = module
    if any(t.is_meta for t in module.buffers()):  # built on meta: probe a copy with values
        buffers = {n: torch.rand(t.shape, generator=g).to(t.dtype) for n, t in module.named_buffers(recurse=False)}
        probe = _copy_with(module, {}, buffers)
    # A table per layer type (OLMo 3's ``forward(x, position_ids, layer_type)`` reads the buffer
    # ``{layer_type}_inv_freq``): probed for every type its buffers name
    keys = [n.removesuffix("_inv_freq") for n, _ in module.named_buffers(recurse=False) if n.endswith("_inv_freq")]
    needs_key = len([p for p in inspect.signature(module.forward).parameters.values() if p.default is p.empty]) == 3
    extra = [(k,) for k in keys if k and not k.endswith("original")] if needs_key else [()]
    if not extra:
        return False
    for more in extra:
        try:
            with torch.no_grad():
                a, b = (probe(torch.randn(2, 3, n, generator=g), positions, *more) for n in (8, 4))
        except Exception:
            return False
        a, b = (list(t) if isinstance(t, (tuple, list)) else [t] for t in (a, b))
        if not (len(a) == len(b) > 0 and all(
            isinstance(x, torch.Tensor) and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
        )):  # fmt: skip
            return False
    return True


def _eps(module: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon", "epsilon", "layer_norm_eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def as_weightless_norm(module: nn.Module) -> nn.Module | None:
    """The serial ``nn.LayerNorm``/``nn.RMSNorm`` without weight (``elementwise_affine=False``) that
    computes what ``module`` computes, or None: a leaf holding no tensors whose ``normalized_shape``
    names the width (OLMo's LayerNorm), probed at two scales (where eps shows) against torch's."""
    shape = getattr(module, "normalized_shape", None)
    if list(module.children()) or [*module.parameters(), *module.buffers()] or not isinstance(shape, (tuple, list)):
        return None
    if len(shape) != 1 or not isinstance(shape[0], int):
        return None
    n, found = shape[0], _eps(module)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, n, generator=g) * s for s in (1.0, 1e-3)]
    try:
        with torch.no_grad():
            outs = [module(x) for x in xs]
    except Exception:
        return None
    for eps in [found] if found is not None else [1e-5, 1e-6, 1e-8]:
        for cls, fn in ((nn.LayerNorm, lambda x, e=eps: F.layer_norm(x, (n,), None, None, e)),
                        (nn.RMSNorm, lambda x, e=eps: F.rms_norm(x, (n,), None, e))):  # fmt: skip
            if all(
                isinstance(o, torch.Tensor) and o.shape == x.shape and torch.allclose(o, fn(x), 1e-5, 1e-5)
                for o, x in zip(outs, xs, strict=True)
            ):
                return cls(n, eps=eps, elementwise_affine=False, device="meta")
    return None


def as_norm(module: nn.Module) -> nn.Module | None:
    """The serial ``nn.RMSNorm``/``nn.LayerNorm`` (sharing ``module``'s tensors) that computes what
    ``module`` computes, or None. An RMSNorm of ``(1 + w)`` comes back with ``weight_offset = 1``."""
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if list(module.children()) or list(module.buffers()) or weight is None or set(params) - {"weight", "bias"}:
        return None
    eps = _eps(module)
    if weight.dim() != 1 or (bias is not None and bias.shape != weight.shape) or eps is None:
        return None
    n = weight.shape[0]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g)  # fp32: Hugging Face norms compute in fp32 whatever they are given
    b = torch.randn(n, generator=g) if bias is not None else None
    xs = [torch.randn(2, 3, n, generator=g) * s for s in (1.0, 1e-3)]  # at 1e-3, eps shows
    probe = _copy_with(module, {"weight": w} | ({"bias": b} if b is not None else {}), {})
    candidates = {
        (nn.RMSNorm, 0.0): lambda x: F.rms_norm(x, (n,), w, eps),
        (nn.RMSNorm, 1.0): lambda x: F.rms_norm(x, (n,), 1.0 + w, eps),
        (nn.LayerNorm, 0.0): lambda x: F.layer_norm(x, (n,), w, b, eps),
        (nn.LayerNorm, 1.0): lambda x: F.layer_norm(x, (n,), 1.0 + w, b, eps),
    }
    try:
        with torch.no_grad():
            outs = [probe(x) for x in xs]
    except Exception:
        return None
    for (cls, offset), fn in candidates.items():
        if cls is nn.RMSNorm and bias is not None:
            continue
        if all(
            isinstance(o, torch.Tensor) and o.shape == x.shape and torch.allclose(o, fn(x), 1e-5, 1e-5)
            for o, x in zip(outs, xs, strict=True)
        ):
            norm = (
                cls(n, eps=eps, device="meta")
                if cls is nn.RMSNorm
                else cls(n, eps=eps, bias=bias is not None, device="meta")
            )
            norm.weight = weight
            if bias is not None:
                norm.bias = bias
            norm.weight_offset = offset
            return norm
    return None


def _copy_with(module: nn.Module, params: dict, buffers: dict) -> nn.Module:
    """A shallow copy of a leaf ``module`` holding these tensors: the probe never touches the model
    (whose tensors may be on meta, with no values)."""
    probe = torch.nn.Module.__new__(type(module))
    probe.__dict__ = {**module.__dict__, "_parameters": {}, "_buffers": dict(buffers), "_modules": {}}
    for name, t in params.items():
        probe._parameters[name] = nn.Parameter(t, requires_grad=False)
    return probe


def per_head(norm: nn.Module, parent: nn.Module | None) -> bool:
    """Is ``norm`` (a child of ``parent``) over one head's features, as Qwen3's q_norm and k_norm are?
    Its input's last dim is then ``head_dim``, whole on every rank."""
    shape = getattr(norm, "normalized_shape", None)  # torch's norms, with or without a weight
    size = shape[-1] if isinstance(shape, tuple) and len(shape) == 1 else getattr(norm.weight, "shape", (None,))[0]
    return parent is not None and size is not None and getattr(parent, "head_dim", None) == size


def replicated(module: nn.Module, mesh) -> nn.Module:
    """Keep ``module`` whole on every rank (a per-head norm): each rank's gradient covers its own
    heads and batch rows, so the hooks sum them over the whole mesh, as serial sums them."""
    for holder in module.modules():
        summed_over_mesh(holder, list(holder._parameters), mesh)
    return keep_blocks_on_copy(module)  # copy.deepcopy keeps the tags and hooks


def summed_over_mesh(module: nn.Module, names: list[str], mesh) -> None:
    """Tag each parameter ``names`` of ``module`` (whole on every rank, used on the mesh's blocks)
    with ``mesh`` and sum its gradient over the mesh in backward: each rank's covers its own blocks
    alone. The hook is registered frozen or not (frozen when converted and unfrozen later, a
    parameter got its own blocks' gradient alone: 0.09 for 0.41, another on every rank), and the
    mesh notes the parameter: each module call on it agrees which of them are frozen (one rank's
    frozen scalar skipped its sum: the others waited to the timeout)."""
    for name in names:
        param = module._parameters[name]
        if param is None:
            continue
        param._optimus2d_mesh = mesh
        if mesh.size > 1:
            wanted = param.requires_grad
            param.requires_grad_(True).register_hook(functools.partial(_summed_over_mesh, mesh=mesh))
            param.requires_grad_(wanted)
            mesh.summed.append((f"{type(module).__name__}.{name}", weakref.ref(module), name))


def _summed_over_mesh(grad: torch.Tensor, mesh) -> torch.Tensor:
    return P.summed_copy(grad, mesh, ("mesh",))


def head_problems(module: nn.Module, mesh) -> list[str]:
    """Head counts of ``module`` (its own, else its config's) that do not divide over the q columns of
    ``mesh``, for a module that holds a head size (``head_dim``, ``attention_head_size``, ...): its
    projections' columns split the heads. (RoBERTa's and DistilBERT's attention, which hold
    ``attention_head_size``, took 3 heads on q = 2 and failed in torch's view at the forward.)"""
    if not holds_heads(module):
        return []
    config = getattr(module, "config", None)
    counts = {}
    for name in _HEAD_COUNTS:
        n = _count(getattr(module, name, None)) or _count(getattr(config, name, None))
        if n:
            counts[name] = n
    return [f"has {name}={n}, not divisible by q={mesh.q} ({mesh})" for name, n in counts.items() if n % mesh.q]


def holds_heads(module: nn.Module) -> bool:
    """Whether ``module`` holds a head size (``head_dim``, ...): its projections' columns split heads."""
    return any(_count(getattr(module, name, None)) for name in HEAD_SIZES)


def refuse_head_masks(module: nn.Module, mesh) -> None:
    """Check each call of ``module`` (a forward kept as read that holds a head size, on q > 1) for a
    4D mask it cannot take on blocks: one per head ``[b, H, s, s]`` (a rank holds H/q heads: torch's
    broadcast failed, or a later Linear2D's said "the full tensor") or the whole batch's where the
    hidden states are this rank's block. Every rank holds the same shapes, so
    every rank raises at once, between two collectives."""
    names = list(inspect.signature(type(module).forward).parameters)[1:]
    module.register_forward_pre_hook(functools.partial(_check_masks, names=names, mesh=mesh), with_kwargs=True)


_MASKS = ("attention_mask", "encoder_attention_mask", "attn_mask")


def _check_masks(module: nn.Module, args: tuple, kwargs: dict, names: list[str], mesh) -> None:
    inputs = {**dict(zip(names, args, strict=False)), **kwargs}
    hidden = inputs.get("hidden_states", args[0] if args else None)
    rows = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() > 1 else None
    for key in _MASKS:
        mask = inputs.get(key)
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            continue
        where = f"{type(module).__name__}: {key} {list(mask.shape)}"
        if mask.shape[1] != 1:
            raise ValueError(
                f"{where} holds a mask per head (dim 1: {mask.shape[1]}); on {mesh} a rank holds heads/q of "
                f"them (its columns split the heads), and a per-head mask is not supported: give [b, 1, s, s]"
            )
        if rows is not None and mask.shape[0] != rows and mask.shape[0] == rows * mesh.depth * mesh.q:
            raise ValueError(
                f"{where} is the whole batch's, not this rank's block (its hidden states have {rows} rows on "
                f"{mesh}): pass optimus2d.scatter_batch(mask, mesh) with the inputs' blocks"
            )


_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "num_heads", "n_head", "n_heads")


def _count(value: object) -> int | None:
    """``value`` if it is a positive int (not a flag), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
