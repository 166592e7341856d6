"""Models larger than one rank: build on meta, convert, then give each rank only its blocks.

``with torch.device("meta"): model = Serial(...)``; ``parallelize(model, mesh)`` converts it without
a single full tensor (every block is meta too) and records, before converting, how the serial model
initialises each tensor: it runs the serial initialisation (Hugging Face's ``initialize_weights``,
or each module's ``reset_parameters``) on the meta tensors under a ``TorchFunctionMode`` that notes
the in-place calls each tensor receives (``uniform_(a, b)``, ``normal_(mean, std)``, ``fill_``,
``zero_``, element-wise ``mul_``/``add_``/``clamp_``/``erfinv_`` — trunc_normal_ is these — a
``copy_`` of a computed table such as a rotary ``inv_freq``, and the same on a row, as
``weight[padding_idx].zero_()``). ``materialize(model, seed=...)`` then allocates each rank's blocks
and replays those calls on them, drawing every random number from a counter-based generator
addressed by (seed, the tensor's serial name, the call's number, the element's index in the serial
tensor): element e of the serial tensor gets the same value on every mesh, and a rank computes only
the elements of its own blocks (about 30 integer operations each). Anything else an initialiser
does to a tensor (``orthogonal_``'s QR, a copy of a computed meta tensor) is refused by name.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
import zlib
from collections import defaultdict

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from optimus2d.comm.dtensor import DTensor, local
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding, block_slices
from optimus2d.layers.base import sharding_of, swap_block

_RANDOM = ("uniform_", "normal_", "trunc_normal_")
_ELEMENTWISE = ("fill_", "zero_", "mul_", "add_", "sub_", "div_", "clamp_", "erfinv_", "exp_", "copy_")


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def has_real(module: nn.Module) -> bool:
    return any(not t.is_meta for t in (*module.parameters(), *module.buffers()))


def _meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose every tensor is on meta (the same types, shapes and dtypes), made
    without copying a byte of the real ones: what ``record_init`` may run the initialisation on."""
    memo: dict[int, object] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo:
            continue
        if isinstance(t, DTensor):
            raise ValueError(
                "materialize: a model parallelized on real tensors, some then moved to meta, has no record "
                "of how the serial model initialises them: parallelize the model built on meta"
            )
        twin = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin
    return copy.deepcopy(model, memo)


def record_init(model: nn.Module) -> dict[str, list[tuple]]:
    """Serial key → the calls the serial initialisation makes on that tensor (``model`` on meta)."""
    keys: dict[int, str] = {}
    for key, t in [*model.named_parameters(), *model.named_buffers()]:
        keys.setdefault(id(t), key)
    recorder = _Recorder(keys)
    try:
        with torch.no_grad(), recorder:
            for m in _post_order(model):  # as construction runs them: a module's parts, then the module
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
                elif type(m) is nn.MultiheadAttention:
                    m._reset_parameters()
            if hasattr(model, "initialize_weights") and hasattr(model, "_init_weights"):  # then HF's post_init
                for m in model.modules():
                    m.__dict__.pop("_is_hf_initialized", None)
                for t in (*model.parameters(), *model.buffers()):
                    t.__dict__.pop("_is_hf_initialized", None)
                model.initialize_weights()
    finally:
        recorder.frames.clear()  # (they refer back to this call's frame, and through it to the tensors)
    return dict(recorder.ops)


def _post_order(module: nn.Module) -> list[nn.Module]:
    out = []
    for child in module.children():
        out += _post_order(child)
    return [*out, module]


class _Recorder(TorchFunctionMode):
    """Notes the initialising calls made on the tensors of ``keys`` (and on their rows)."""

    def __init__(self, keys: dict[int, str]) -> None:
        super().__init__()
        self.keys, self.ops = keys, defaultdict(list)
        self.views: dict[int, tuple[str, object]] = {}  # id(view) → (key, its index in dim 0 or None)
        self.alive: list[torch.Tensor] = []
        self.depth = 0  # > 0 inside a call already noted: what it calls is not noted again
        self.inits: set[tuple[int, str]] = set()  # the nn.init calls already noted: (id(frame), key)
        self.frames: list = []  # those frames, kept alive while recording: a later call's frame never reuses an id

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = kwargs.get("tensor", args[0] if args else None)
        known = isinstance(target, torch.Tensor) and (id(target) in self.keys or id(target) in self.views)
        if self.depth or not known:
            return func(*args, **kwargs)
        key, index = self.views.get(id(target), (self.keys.get(id(target)), None))
        name = getattr(func, "__name__", "")
        if (
            getattr(func, "__self__", None) is _IS_META
        ):  # torch.nn.init's functions skip meta tensors: note the caller's call
            calls = _skipped_init_call(target)
            if calls:
                self.ops[key].extend((op, index, call) for op, call in calls)
            return func(*args, **kwargs)
        writes = name.endswith("_") and not name.startswith("_")
        frame = _init_frame() if writes else None  # a write inside torch.nn.init that did not dispatch
        if frame is not None and (id(frame), key) not in self.inits:  # torch 2.11's orthogonal_: ops in nn.init
            self.inits.add((id(frame), key))  # noted once, as the call it is
            self.frames.append(frame)
            self.ops[key].extend((op, index, call) for op, call in _skipped_init_call(target, frame))
        if frame is not None:
            self.depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.depth -= 1
        if func is torch.Tensor.__getitem__ or name in ("detach", "__get__"):  # weight[i], weight.data
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and (index is None or name != "__getitem__"):
                self.views[id(out)] = (key, args[1] if name == "__getitem__" else index)
                self.alive.append(out)
            return out
        if getattr(func, "__module__", "") in ("torch.nn.init", "transformers.initialization"):
            calls = _init_calls(func, target, args, kwargs)
        elif name in _RANDOM + _ELEMENTWISE:
            calls = [(name, _tensor_call(name, args, kwargs))]
        elif name.endswith("_") and not name.startswith("_"):
            calls = [("unsupported:" + name, ())]
        else:
            return func(*args, **kwargs)
        self.ops[key].extend((op, index, call) for op, call in calls)
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1


_IS_META = torch.Tensor.is_meta  # the descriptor whose __get__ a meta check calls


def _init_frame():
    """The frame of the outermost ``torch.nn.init`` function running now (``trunc_normal_``, not
    ``_no_grad_trunc_normal_``), or None."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") != "torch.nn.init":
        frame = frame.f_back
    while frame is not None and frame.f_back is not None and frame.f_back.f_globals.get("__name__") == "torch.nn.init":
        frame = frame.f_back
    return frame


def _skipped_init_call(tensor: torch.Tensor, frame=None) -> list[tuple[str, tuple]]:
    """The ``torch.nn.init`` function (``trunc_normal_``, ``orthogonal_``, ...) that just asked whether
    ``tensor`` is meta, to skip it, or (torch 2.11) runs ops on it without dispatching as a whole:
    its call, read from its frame."""
    frame = frame or _init_frame()
    if frame is None:
        return []
    func = getattr(nn.init, frame.f_code.co_name, None)
    if func is None:
        return [("unsupported:nn.init." + frame.f_code.co_name, ())]
    names = inspect.signature(func).parameters
    return _init_calls(func, tensor, (), {k: frame.f_locals[k] for k in names if k in frame.f_locals})


def _uniform_or_normal(name: str, std: float) -> list[tuple[str, tuple]]:
    """``*_uniform_``: U(−√3·std, √3·std); ``*_normal_``: N(0, std)."""
    if "uniform" in name:
        return [("uniform_", (-math.sqrt(3.0) * std, math.sqrt(3.0) * std))]
    return [("normal_", (0.0, std))]


def _tensor_call(name: str, args: tuple, kwargs: dict) -> tuple:
    if name == "copy_":
        src = args[1]
        return (src.detach().clone() if isinstance(src, torch.Tensor) and not src.is_meta else "meta",)
    names = {"uniform_": ("from", "to"), "normal_": ("mean", "std"), "clamp_": ("min", "max")}.get(name, ())
    return tuple(args[1:]) + tuple(kwargs[k] for k in names[len(args) - 1 :] if k in kwargs)


def _init_calls(func, tensor: torch.Tensor, args: tuple, kwargs: dict) -> list[tuple[str, tuple]]:
    """A ``torch.nn.init`` function as the element-wise calls it amounts to, with its sizes taken
    from the (serial, meta) tensor's shape, as torch computes them."""
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    name = func.__name__
    init = nn.init
    if name == "uniform_":
        return [("uniform_", (a["a"], a["b"]))]
    if name == "normal_":
        return [("normal_", (a["mean"], a["std"]))]
    if name == "trunc_normal_":
        return [("trunc_normal_", (a["mean"], a["std"], a["a"], a["b"]))]
    if name == "copy_":
        return [("copy_", _tensor_call("copy_", (tensor, a["other"]), {}))]
    if name in ("constant_", "ones_", "zeros_"):
        return [("fill_", ({"ones_": 1.0, "zeros_": 0.0}.get(name, a.get("val")),))]
    if name in ("kaiming_uniform_", "kaiming_normal_"):
        fan = init._calculate_correct_fan(tensor, a["mode"])
        std = init.calculate_gain(a["nonlinearity"], a["a"]) / math.sqrt(fan)
        return _uniform_or_normal(name, std)
    if name in ("xavier_uniform_", "xavier_normal_"):
        fan_in, fan_out = init._calculate_fan_in_and_fan_out(tensor)
        std = a["gain"] * math.sqrt(2.0 / float(fan_in + fan_out))
        return _uniform_or_normal(name, std)
    return [("unsupported:nn.init." + name, ())]


def materialize(model: nn.Module, *, seed: int, device: torch.device | str | None = None) -> nn.Module:
    """Allocate every meta tensor of ``model`` (converted by ``parallelize`` or serial) as this rank's
    block on ``device`` (default CPU) and initialise it as the serial model would, from ``seed``:
    the global tensors are the same on every mesh. Tensors already allocated are left alone. Raises
    ``ValueError`` naming each tensor whose initialisation cannot be replayed, before allocating."""
    records = getattr(model, "_optimus2d_init", None)
    if records is None:  # replayed on a meta twin: the initialisation would overwrite what is loaded
        records = record_init(model if not has_real(model) else _meta_twin(model))
    owners = {}
    for prefix, sub in model.named_modules(remove_duplicate=False):
        for name, t in [*sub._parameters.items(), *sub._buffers.items()]:
            if t is not None and t.is_meta:
                owners.setdefault(id(t), (f"{prefix}.{name}" if prefix else name, sub, name, t))
    problems = []
    for key, _, _, _ in owners.values():
        ops = records.get(key)
        if ops is None:
            problems.append(f"{key}: nothing initialises it (load it: optimus2d.load_pretrained)")
        elif bad := [op for op, _, call in ops if op.startswith("unsupported") or call == ("meta",)]:
            problems.append(f"{key}: its initialisation calls {', '.join(sorted(set(bad)))}")
    if problems:
        raise ValueError("materialize: cannot initialise on blocks:\n  " + "\n  ".join(problems))
    for key, sub, name, t in owners.values():
        sharding, mesh = sharding_of(sub, name)
        block = _replay(records[key], key, seed, t, sharding, mesh).to(device or "cpu")
        swap_block(t, block)
    return model


def _replay(ops, key: str, seed: int, t: torch.Tensor, sharding: Sharding | None, mesh: Mesh | None):
    t = local(t)  # a DTensor parameter: its block
    index, full_shape = _global_index(t, sharding, mesh)  # int64 [local shape]; -1 on padding
    valid = index >= 0
    flat = index.clamp(min=0)
    out = torch.zeros(t.shape, dtype=torch.float64)
    stream = zlib.crc32(key.encode())
    row = flat // max(1, math.prod(full_shape[1:])) if full_shape else flat
    for n, (op, where, call) in enumerate(ops):
        mask = valid if where is None else valid & (row == int(where))
        value = _value(op, call, out, flat, (seed, stream, n), full_shape)
        out = torch.where(mask, value, out)
    return torch.where(valid, out, 0.0).to(t.dtype)


def _value(op: str, call: tuple, out: torch.Tensor, flat: torch.Tensor, counter: tuple, full_shape) -> torch.Tensor:
    if op == "uniform_":
        a, b = (list(call) + [0.0, 1.0][len(call) :])[:2]
        return a + (b - a) * _uniform(flat, *counter, 0)
    if op == "normal_":
        mean, std = (list(call) + [0.0, 1.0][len(call) :])[:2]
        u1, u2 = _uniform(flat, *counter, 1), _uniform(flat, *counter, 2)
        return mean + std * torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    if op == "trunc_normal_":  # torch's way: the inverse normal CDF of a uniform between the bounds
        mean, std, a, b = call
        cdf = lambda v: (1.0 + math.erf((v - mean) / std / math.sqrt(2.0))) / 2.0  # noqa: E731
        low, high = 2 * cdf(a) - 1, 2 * cdf(b) - 1
        x = torch.special.erfinv(low + (high - low) * _uniform(flat, *counter, 0))
        return (x * std * math.sqrt(2.0) + mean).clamp(a, b)
    if op == "copy_":
        src = call[0].to(torch.float64).reshape(-1)
        return src[flat % src.numel()] if src.numel() == math.prod(full_shape) else src.expand_as(out)
    if op == "zero_":
        return torch.zeros_like(out)
    if op == "fill_":
        return torch.full_like(out, float(call[0]))
    if op == "erfinv_":
        return torch.special.erfinv(out)
    if op == "exp_":
        return out.exp()
    if op == "clamp_":
        low, high = [*call, None, None][:2]
        return out.clamp(min=low, max=high)
    other = call[0]
    return {"mul_": out.mul, "add_": out.add, "sub_": out.sub, "div_": out.div}[op](other)


def _global_index(t: torch.Tensor, sharding: Sharding | None, mesh: Mesh | None):
    """Each local element's flat index in the serial tensor (−1 where the block is padding)."""
    if sharding is None:
        shape = tuple(t.shape)
        return torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape), shape
    full = sharding.full_shape
    strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
    out = torch.full(sharding.local_shape(mesh), -1, dtype=torch.int64)
    for src, dst in block_slices(sharding, mesh):  # only this block's indices, dim by dim
        flat = torch.zeros((), dtype=torch.int64)
        for d, part in enumerate(src):
            view = [1] * len(full)
            view[d] = -1
            flat = flat + (torch.arange(part.start, part.stop, dtype=torch.int64) * strides[d]).view(view)
        out[dst] = flat
    return out, full


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # a logical shift of the 64 bits


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words whose outputs look independent."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def _uniform(flat: torch.Tensor, seed: int, stream: int, call: int, draw: int) -> torch.Tensor:
    """U(0, 1) in float64 (53 bits, never 0 or 1) for each element index, from the counter."""
    head = (seed * 1_000_003 + stream) * 4_099 + call * 8 + draw
    x = _mix(_mix(flat + _mix(torch.tensor(_signed(head % (1 << 64)), dtype=torch.int64))))
    return (_shr(x, 11).to(torch.float64) + 0.5) / float(1 << 53)
