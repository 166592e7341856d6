"""Which unregistered modules ``parallelize`` may keep or convert, judged by what they are and do.

On the mesh the hidden dim of every activation is split (``[b/(d·q), ..., h/q]``), so a module
whose forward is kept must act element by element on that dim, or on whole heads. ``parallelize``
keeps a module it has no converter for only when one of these says so:

- ``acts_elementwise(m)``: a leaf without tensors that, probed with a random ``[2, 3, 8]`` input,
  gives on each half of the last dim what it gives on the whole (an activation, say);
- ``as_norm(m)``: a leaf holding only a 1-D ``weight`` (and ``bias``) that, probed with a random
  weight and inputs of two scales, computes RMSNorm (``w·x̂`` or Gemma's ``(1 + w)·x̂``) or
  LayerNorm with the ``eps`` it stores: it becomes an ``RMSNorm2D``/``LayerNorm2D``;
- ``forward_problems(m)``: a container (no tensors of its own) whose forward, read as code, only
  calls its children, element-wise functions and known per-head helpers (rotary, masks, attention
  kernels), and never reduces, slices, splits or multiplies over the last dim, nor reshapes with
  a global size. Anything it cannot vouch for is a problem, named with its line; the rule is
  conservative: it refuses some correct forwards (declare those with
  ``register_converter(cls, keep=True)``), never accepts one that reads the hidden dim.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import primitives as P

# Methods that reduce, split, reorder or mix elements along a dim (possibly the split hidden one).
_MIXING_METHODS = frozenset(
    "chunk split tensor_split unbind narrow norm mean sum nansum prod softmax log_softmax max min amax amin "
    "argmax argmin topk sort var std var_mean std_mean cumsum cumprod logsumexp matmul mm bmm einsum flip "
    "roll gather scatter scatter_add index_select masked_select take_along_dim unfold diff renorm".split()
)
# Methods of values known to act element by element, on shapes or on non-tensors (caches, dicts,
# configs): any other method called on a value is a problem (an allowlist: unknown means refused).
_SAFE_METHODS = frozenset(
    "view reshape expand expand_as repeat new_empty new_zeros new_ones new_full new_tensor view_as unflatten "
    "flatten transpose permute contiguous to float double half bfloat16 long int bool type type_as unsqueeze "
    "squeeze size dim numel item clone detach masked_fill masked_fill_ exp tanh sigmoid relu pow sqrt rsqrt abs "
    "neg reciprocal mul add sub div mul_ add_ sub_ div_ clamp clamp_ is_floating_point requires_grad_ "
    "get_seq_length get_usable_length get_mask_sizes update get items keys values pop setdefault get_interface "
    "get_text_config format startswith endswith lower append extend insert".split()
)
# Sizes of the whole model: a reshape by one of them assumes the full hidden dim is here.
_GLOBAL_SIZES = frozenset(
    "hidden_size embed_dim all_head_size num_heads num_attention_heads num_key_value_heads n_head n_heads "
    "n_embd d_model inner_dim intermediate_size vocab_size split_size".split()
)
# Functions known to act on whole heads, on masks or on scalars only.
_SAFE_NAMES = frozenset(
    "apply_rotary_pos_emb create_causal_mask create_sliding_window_causal_mask create_bidirectional_mask "
    "create_masks_for_generate eager_attention_forward sdpa_attention_forward repeat_kv attention_interface "
    "isinstance type len range enumerate zip tuple list dict set getattr hasattr slice int float bool str super "
    "any all print DynamicCache EncoderDecoderCache slice_logits_to_keep".split()
)
_SAFE_TORCH = frozenset(
    {
        *(torch.arange, torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.finfo, torch.tanh),
        *(torch.sigmoid, torch.exp, torch.relu, torch.is_autocast_enabled, torch.no_grad, torch.where),
        *(F.gelu, F.silu, F.relu, F.relu6, F.elu, F.selu, F.celu, F.leaky_relu, F.mish, F.softplus, F.hardswish),
        *(F.hardsigmoid, F.hardtanh, F.sigmoid, F.tanh, F.logsigmoid),
        nn.Transformer.generate_square_subsequent_mask,
    }
)


def acts_elementwise(module: nn.Module) -> bool:
    """A parameter-free leaf whose output on each half of the last dim is its output on that half."""
    if list(module.children()) or any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64) * 3
    try:
        with torch.no_grad():
            whole, halves = module(x), [module(x[..., :4].clone()), module(x[..., 4:].clone())]
    except Exception:
        return False
    return (
        isinstance(whole, torch.Tensor)
        and whole.shape == x.shape
        and all(isinstance(h, torch.Tensor) and h.shape == (2, 3, 4) for h in halves)
        and torch.equal(torch.cat(halves, -1), whole)
    )


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
    try:
        with torch.no_grad():
            a, b = (probe(torch.randn(2, 3, n, generator=g), positions) for n in (8, 4))
    except Exception:
        return False
    a, b = (list(t) if isinstance(t, (tuple, list)) else [t] for t in (a, b))
    return len(a) == len(b) > 0 and all(
        isinstance(x, torch.Tensor) and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def _eps(module: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon", "epsilon", "layer_norm_eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
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
    return parent is not None and getattr(parent, "head_dim", None) == norm.weight.shape[0]


def replicated(module: nn.Module, mesh) -> nn.Module:
    """Keep ``module`` whole on every rank (a per-head norm): each rank's gradient covers its own
    heads and batch rows, so the hooks sum them over the whole mesh, as serial sums them."""
    for param in module.parameters():
        param._optimus2d_mesh = mesh
        if param.requires_grad and mesh.size > 1:
            param.register_hook(functools.partial(_summed_over_mesh, mesh=mesh))
    from optimus2d.layers.base import keep_blocks_on_copy

    return keep_blocks_on_copy(module)  # copy.deepcopy keeps the tags and hooks


def _summed_over_mesh(grad: torch.Tensor, mesh) -> torch.Tensor:
    return P.summed_copy(grad, mesh, ("mesh",))


def head_problems(module: nn.Module, mesh) -> list[str]:
    """Head counts of ``module``'s config that do not divide over the q columns of ``mesh``."""
    config = getattr(module, "config", None)
    if getattr(module, "head_dim", None) is None or config is None:
        return []
    counts = {name: getattr(config, name, None) for name in ("num_attention_heads", "num_key_value_heads")}
    return [
        f"has {name}={n}, not divisible by q={mesh.q} ({mesh})"
        for name, n in counts.items()
        if isinstance(n, int) and n % mesh.q
    ]


def forward_problems(module: nn.Module) -> list[str]:
    """What in ``module``'s forward may read the split hidden dim; empty when nothing does. A Hugging
    Face causal LM's ``self.loss_function`` is fine: ``families/hf_causal_lm.py`` replaces it."""
    problems = _class_problems(type(module), tuple(sorted(module._modules)))
    if hasattr(module, "lm_head") and hasattr(module, "generate"):
        problems = [p for p in problems if "self.loss_function()" not in p]
    return list(problems)


@functools.cache
def _class_problems(cls: type, children: tuple[str, ...]) -> tuple[str, ...]:
    problems: list[str] = []
    seen: set[str] = set()
    _read_method(cls, "forward", set(children), problems, seen)
    return tuple(problems)


def _read_method(cls: type, name: str, children: set[str], problems: list[str], seen: set[str]) -> None:
    if name in seen:
        return
    seen.add(name)
    fn = getattr(cls, name, None)
    fn = inspect.unwrap(getattr(fn, "__func__", fn))  # the code under Hugging Face's decorators
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        _, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        problems.append(f"{cls.__name__}.{name}: its source cannot be read")
        return
    tree = ast.parse(source).body[0]
    for node in ast.walk(tree):  # type annotations (tuple[Tensor, Tensor]) are not code that runs
        if isinstance(node, (ast.arg, ast.AnnAssign)):
            node.annotation = ast.Constant(None)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
    where = f"{cls.__name__}.{name}, line {{}}"
    reshapes = _names_holding_minus_one(tree)
    local_children = _names_of_children(tree, children)
    for node in ast.walk(tree):
        line = where.format(first + getattr(node, "lineno", 1) - 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            problems.append(f"{line}: multiplies matrices (@)")
        elif isinstance(node, ast.Subscript):
            problem = _subscript_problem(node)
            if problem:
                problems.append(f"{line}: {problem}")
        elif isinstance(node, ast.Call):
            problem = _call_problem(node, cls, children | local_children, fn, reshapes, problems, seen)
            if problem:
                problems.append(f"{line}: {problem}")


def _names_holding_minus_one(tree: ast.AST) -> set[str]:
    """Local names assigned a tuple with a literal -1 (``hidden_shape = (*input_shape, -1, d)``)."""
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Tuple)
            and any(map(_is_minus_one, node.value.elts))
        ):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _names_of_children(tree: ast.AST, children: set[str]) -> set[str]:
    """Local names bound to a child or a safe function: ``for layer in self.layers[:n]``,
    ``mask_function = create_causal_mask if ... else create_sliding_window_causal_mask``."""

    def safe(expr: ast.AST) -> bool:
        refs = [n for n in ast.walk(expr) if isinstance(n, (ast.Name, ast.Attribute))]
        children_used = any(isinstance(n, ast.Attribute) and n.attr in children for n in refs)
        names = {n.id for n in refs if isinstance(n, ast.Name)} - {"self"}
        return children_used or (bool(names) and names <= _SAFE_NAMES | {"config"})

    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and safe(node.iter):
            names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.IfExp) and safe(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _is_minus_one(node: ast.AST) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and getattr(node.operand, "value", None) == 1


def _subscript_problem(node: ast.Subscript) -> str | None:
    index = node.slice
    last = index.elts[-1] if isinstance(index, ast.Tuple) and index.elts else index
    if isinstance(node.value, ast.Attribute) and node.value.attr == "shape" and _is_minus_one(last):
        return "reads the size of the last dim (.shape[-1])"
    if isinstance(index, ast.Tuple) and isinstance(last, ast.Slice) and (last.lower or last.upper or last.step):
        return f"slices the last dim ({ast.unparse(node)})"
    whole = isinstance(last, ast.Slice) or (isinstance(last, ast.Constant) and last.value in (None, Ellipsis))
    if isinstance(index, ast.Tuple) and not whole:
        return f"indexes the last dim ({ast.unparse(node)[:60]})"
    return None


def _call_problem(node, cls, children, fn, reshapes, problems, seen) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        base = func.value
        if isinstance(base, ast.Name) and base.id == "self":
            if func.attr in children:
                return None
            if callable(getattr(cls, func.attr, None)) and not isinstance(getattr(cls, func.attr), type):
                _read_method(cls, func.attr, children, problems, seen)
                return None
            return f"calls self.{func.attr}(), which is neither a child nor a method"
        if func.attr in _MIXING_METHODS:
            return f"calls .{func.attr}() ({ast.unparse(node)[:60]})"
        if func.attr == "size" and node.args and _is_minus_one(node.args[0]):
            return "reads the size of the last dim (.size(-1))"
        if func.attr in ("view", "reshape", "expand", "repeat", "new_empty", "new_zeros", "view_as"):
            return _reshape_problem(node, reshapes)
        if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
            return f"calls super().{func.attr}(), which is not read"
        resolved = _resolve(func, fn)
        if resolved is not None and resolved is not _UNKNOWN:
            return None if resolved in _SAFE_TORCH else f"calls {ast.unparse(func)}"
        if func.attr in _SAFE_METHODS:
            return None
        return f"calls .{func.attr}(), not known to act on blocks ({ast.unparse(node)[:60]})"
    if isinstance(func, ast.Name):
        if func.id in _SAFE_NAMES or func.id in children:
            return None
        resolved = fn.__globals__.get(func.id, getattr(builtins, func.id, _UNKNOWN))
        if resolved in _SAFE_TORCH or (isinstance(resolved, type) and issubclass(resolved, Exception)):
            return None
        if isinstance(resolved, type) and any(c.__name__ == "ModelOutput" for c in resolved.__mro__):
            return None  # a Hugging Face output: a dataclass of the tensors
        return f"calls {func.id}(), not known to act on blocks"
    return f"calls {ast.unparse(func)[:40]}"


_UNKNOWN = object()


def _resolve(func: ast.Attribute, fn) -> object:
    """``torch.tanh``, ``F.gelu``, ``nn.functional.silu`` → the object; anything else → None."""
    parts = []
    node = func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    root = fn.__globals__.get(node.id, _UNKNOWN)
    if root not in (torch, F, nn):
        return None
    obj = root
    for part in reversed(parts):
        obj = getattr(obj, part, _UNKNOWN)
    return obj


def _reshape_problem(node: ast.Call, reshapes: set[str]) -> str | None:
    args = node.args
    sizes = {a.attr for arg in args for a in ast.walk(arg) if isinstance(a, ast.Attribute)} & _GLOBAL_SIZES
    if sizes:
        return f"reshapes by a global size ({ast.unparse(node)[:60]})"
    if len(args) == 1 and isinstance(args[0], ast.Name) and args[0].id in reshapes:
        return None
    if any(map(_is_minus_one, args)) or not args:
        return None
    if len(args) == 1 and isinstance(args[0], ast.Name):  # view_as(x), expand_as-like, or an unknown shape
        return None if node.func.attr == "view_as" else f"reshapes to a shape it computes ({ast.unparse(node)[:60]})"
    return f"reshapes without -1 in the hidden place ({ast.unparse(node)[:60]})"
