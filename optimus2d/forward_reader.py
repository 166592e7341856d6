"""The forward reader: may a container's forward run as it is on blocks of the split hidden dim?

On the mesh every activation's hidden (last) dim is split, ``[b/(d·q), ..., h/q]``. A container
(a module whose tensors all live in its children) keeps its forward only when that forward, read as
code, does nothing that depends on the whole hidden dim. The reader judges what *runs*, for this
module instance:

- **Decorators** that only wrap (Hugging Face's ``deprecate_kwarg``, ``can_return_tuple``,
  ``auto_docstring``, ``capture_outputs``, ``merge_with_config_defaults``; ``torch.no_grad``) are
  known by identity and skipped; any other decorator is a problem, as its wrapper is not read.
- **Dead branches** are not read: an ``if`` whose test depends only on ``self``'s attributes (not on
  ``self.training``) and constants is evaluated on the instance. Each such test becomes a guard,
  checked before every forward: if a flag later changes (``config.use_qk_norm = True``), the forward
  raises rather than run code nobody read.
- **Tensors without a hidden dim**: masks, ids and positions (``attention_mask``, ``position_ids``,
  ...) and what is computed only from them may be reduced, summed or sliced freely
  (``attention_mask.cumsum(dim=1)``).
- **Per-head tensors**: a reshape whose last size is a per-head size (``view(b, s, -1,
  self.head_dim)``) puts whole heads on the last dim; chunks, splits, slices and ``torch.cat`` over
  ``dim=-1`` of such a tensor are per head, and fine.
- **Dropout** (``F.dropout``) is element-wise; when its probability may be non-zero the module's
  forward runs under ``shard_rng`` (each shard its own mask, as ``Dropout2D``).

Anything else that reduces, slices, splits or multiplies over the last dim, reads its size, or
reshapes with a global size is a problem, named with its line. The rule is conservative: it refuses
some correct forwards (declare them with ``register_converter(cls, keep=True)``), never accepts one
that reads the hidden dim.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.random import shard_rng

_MIXING_METHODS = frozenset(
    "chunk split tensor_split unbind narrow norm mean sum nansum prod softmax log_softmax max min amax amin "
    "argmax argmin topk sort var std var_mean std_mean cumsum cumprod logsumexp matmul mm bmm einsum flip "
    "roll gather scatter scatter_add index_select masked_select take_along_dim unfold diff renorm all any".split()
)
_SAFE_METHODS = frozenset(
    "view reshape expand expand_as repeat new_empty new_zeros new_ones new_full new_tensor view_as unflatten "
    "flatten transpose permute contiguous to float double half bfloat16 long int bool type type_as unsqueeze "
    "squeeze size dim numel item clone detach masked_fill masked_fill_ exp tanh sigmoid relu pow sqrt rsqrt abs "
    "neg reciprocal mul add sub div mul_ add_ sub_ div_ clamp clamp_ is_floating_point requires_grad_ "
    "get_seq_length get_usable_length get_mask_sizes update get items keys values pop setdefault get_interface "
    "get_text_config format startswith endswith lower append extend insert".split()
)
_GLOBAL_SIZES = frozenset(
    "hidden_size embed_dim all_head_size num_heads num_attention_heads num_key_value_heads n_head n_heads "
    "n_embd d_model inner_dim intermediate_size vocab_size split_size".split()
)
_ELEMENTWISE_METHODS = frozenset(
    "contiguous to float double half bfloat16 clone detach type_as mul add sub div neg exp tanh sigmoid relu pow "
    "sqrt rsqrt abs reciprocal clamp masked_fill".split()
)
_HEAD_SIZES = frozenset("head_dim attention_head_size head_size d_head kv_channels".split())
# Inputs that never carry the hidden dim (Hugging Face's names for ids, masks and positions).
_NO_HIDDEN_INPUTS = frozenset(
    "input_ids attention_mask position_ids cache_position token_type_ids decoder_input_ids decoder_attention_mask "
    "encoder_attention_mask labels pixel_mask head_mask image_sizes image_grid_thw num_items_in_batch "
    "logits_to_keep".split()
)
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
_DROPOUTS = frozenset({F.dropout, torch.dropout})
_TENSOR_FUNCTIONS = frozenset({torch.cumsum, torch.cumprod, torch.sum, torch.mean, torch.amax, torch.amin})
# Decorators whose wrappers only rename arguments, document, or reshape the returned container.
_WRAPPERS = frozenset(
    "deprecate_kwarg can_return_tuple auto_docstring capture_outputs check_model_inputs merge_with_config_defaults "
    "filter_output_hidden_states no_grad enable_grad inference_mode disable".split()
)
_UNKNOWN = object()


@dataclass
class Reading:
    """What the reader found in one module's forward: problems, guards (if-tests on ``self``'s
    attributes with the value they had), and whether it calls a dropout that may draw."""

    problems: list[str] = field(default_factory=list)
    guards: list[tuple[str, ast.expr, bool]] = field(default_factory=list)
    draws: bool = False


def read_forward(module: nn.Module) -> Reading:
    """Read ``type(module).forward`` (and the methods it calls on ``self``) for this instance."""
    reading = Reading()
    _read_method(module, "forward", set(module._modules), reading, set())
    if hasattr(module, "lm_head") and hasattr(module, "generate"):  # families/hf_causal_lm replaces it
        reading.problems = [p for p in reading.problems if "self.loss_function()" not in p]
    return reading


def forward_problems(module: nn.Module) -> list[str]:
    """What in ``module``'s forward may read the split hidden dim; empty when nothing does."""
    return read_forward(module).problems


def check_guards(module: nn.Module, args, kwargs=None) -> None:
    """A forward pre-hook: the if-tests the reader evaluated still give what they gave."""
    for text, test, value in module._optimus2d_guards:
        now = _static(test, module)
        if now is _UNKNOWN or _truth(now) is not value:
            raise RuntimeError(
                f"{type(module).__name__}.forward was judged correct on blocks with `{text}` {value}; it is now "
                f"{now if now is not _UNKNOWN else 'unknown'}, so a branch nobody read would run. Set it before "
                f"parallelize, or convert the model again"
            )


def draw_per_shard(module: nn.Module, mesh) -> None:
    """Run ``module``'s forward, while training, under ``shard_rng``: its dropout draws a mask per
    shard, as ``Dropout2D`` does, not the same mask on every shard."""
    module._optimus2d_rng_mesh = mesh
    module.forward = types.MethodType(_forward_drawing_per_shard, module)


def _forward_drawing_per_shard(self, *args, **kwargs):
    with shard_rng(self._optimus2d_rng_mesh, enabled=self.training):
        return type(self).forward(self, *args, **kwargs)


@functools.cache
def _parsed(fn) -> tuple[ast.FunctionDef, int]:
    source = textwrap.dedent(inspect.getsource(fn))
    _, first = inspect.getsourcelines(fn)
    tree = ast.parse(source).body[0]
    for node in ast.walk(tree):  # type annotations (tuple[Tensor, Tensor]) are not code that runs
        if isinstance(node, (ast.arg, ast.AnnAssign)):
            node.annotation = ast.Constant(None)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
    return tree, first


def _read_method(module: nn.Module, name: str, children: set[str], reading: Reading, seen: set[str]) -> None:
    if name in seen:
        return
    seen.add(name)
    cls = type(module)
    fn = getattr(cls, name, None)
    wrapped = getattr(fn, "__func__", fn)
    fn = inspect.unwrap(wrapped)  # the code under the decorators, which are judged below
    try:
        tree, first = _parsed(fn)
    except (OSError, TypeError):
        reading.problems.append(f"{cls.__name__}.{name}: its source cannot be read")
        return
    where = f"{cls.__name__}.{name}, line {{}}"
    for deco in tree.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        obj = _resolve(target, fn, roots=None)
        if getattr(obj, "__name__", None) not in _WRAPPERS or not _from_known_library(obj):
            line = where.format(first + deco.lineno - 1)
            reading.problems.append(f"{line}: is decorated by {ast.unparse(target)}, whose wrapper is not read")
    env = _Names(tree, module, fn)
    for node in _live(tree.body, module, reading, name):
        line = where.format(first + getattr(node, "lineno", 1) - 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            if not (env.clean(node.left) and env.clean(node.right)):
                reading.problems.append(f"{line}: multiplies matrices (@)")
        elif isinstance(node, ast.Subscript):
            problem = _subscript_problem(node, env)
            if problem:
                reading.problems.append(f"{line}: {problem}")
        elif isinstance(node, ast.Call):
            problem = _call_problem(node, module, children | env.children, fn, env, reading, seen)
            if problem:
                reading.problems.append(f"{line}: {problem}")


def _from_known_library(obj) -> bool:
    return str(getattr(obj, "__module__", "")).split(".")[0] in ("transformers", "torch")


def _live(body: list[ast.stmt], module: nn.Module, reading: Reading, method: str):
    """Every node of ``body`` that may run: an ``if`` on ``self``'s attributes reads only its branch."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.If, ast.IfExp)):
            value = _static(node.test, module)
            yield from ast.walk(node.test)
            if value is not _UNKNOWN:
                taken = _truth(value)
                if taken is not None:
                    reading.guards.append((ast.unparse(node.test), node.test, taken))
                    branch = node.body if taken else node.orelse
                    stack.extend(reversed(branch if isinstance(branch, list) else [branch]))
                    continue
            rest = [*node.body, *node.orelse] if isinstance(node, ast.If) else [node.body, node.orelse]
            stack.extend(reversed(rest))
            continue
        yield node
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _truth(value) -> bool | None:
    try:
        return bool(value)
    except Exception:  # a tensor of many elements, a meta tensor
        return None


def _static(expr: ast.expr, module: nn.Module):
    """The value of ``expr`` from constants and ``self``'s attributes (never ``self.training``)."""
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.Name):
        return module if expr.id == "self" else _UNKNOWN
    if isinstance(expr, ast.Attribute):
        base = _static(expr.value, module)
        if base is _UNKNOWN or expr.attr == "training" or isinstance(base, torch.Tensor):
            return _UNKNOWN
        try:
            return getattr(base, expr.attr, _UNKNOWN)
        except Exception:  # a property that raises
            return _UNKNOWN
    if isinstance(expr, ast.IfExp):  # `0.0 if not self.training else self.attention_dropout`: both 0
        test = _static(expr.test, module)
        if test is not _UNKNOWN and _truth(test) is not None:
            return _static(expr.body if _truth(test) else expr.orelse, module)
        body, orelse = _static(expr.body, module), _static(expr.orelse, module)
        return body if body is not _UNKNOWN and orelse is not _UNKNOWN and _same(body, orelse) else _UNKNOWN
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        value = _static(expr.operand, module)
        return _UNKNOWN if value is _UNKNOWN or _truth(value) is None else not _truth(value)
    if isinstance(expr, ast.BoolOp):
        values = [_static(v, module) for v in expr.values]
        stop = isinstance(expr.op, ast.Or)  # `or` stops at the first true value, `and` at the first false
        for value in values:
            if value is _UNKNOWN or _truth(value) is None:
                return _UNKNOWN
            if _truth(value) is stop:
                return value
        return values[-1]
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        left, right = _static(expr.left, module), _static(expr.comparators[0], module)
        if left is _UNKNOWN or right is _UNKNOWN:
            return _UNKNOWN
        ops = {ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b, ast.Eq: lambda a, b: a == b}
        ops |= {ast.NotEq: lambda a, b: a != b, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
        op = ops.get(type(expr.ops[0]))
        try:
            return _UNKNOWN if op is None else op(left, right)
        except Exception:
            return _UNKNOWN
    return _UNKNOWN


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


class _Names:
    """What the local names of one forward hold: a child or safe function (``for layer in
    self.layers``), no hidden dim (ids, masks and what is computed only from them), or whole heads
    on the last dim (a reshape into ``head_dim``)."""

    def __init__(self, tree: ast.FunctionDef, module: nn.Module, fn) -> None:
        self.module, self.fn = module, fn
        params = {a.arg for a in [*tree.args.posonlyargs, *tree.args.args, *tree.args.kwonlyargs]}
        self.reshapes = _names_holding_minus_one(tree)
        self.children = _names_of_children(tree, set(module._modules))
        assigned: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            targets, value = _assignment(node)
            for target in targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        assigned.setdefault(n.id, []).append(value)
        self.assigned = assigned
        candidates = {n for n in assigned if n not in params or n in _NO_HIDDEN_INPUTS}
        self._clean = candidates | {p for p in params if p in _NO_HIDDEN_INPUTS}
        self._heads = set(candidates)
        changed = True
        while changed:  # the greatest fixed point: a name is clean (or per head) when every value it is given is
            changed = False
            for name in candidates:
                values = assigned[name]
                if name in self._clean and not all(v is not None and self.clean(v) for v in values):
                    self._clean.discard(name)
                    changed = True
                if name in self._heads and not all(v is not None and self.per_head(v) for v in values):
                    self._heads.discard(name)
                    changed = True

    def leading(self, sizes: list[ast.expr]) -> bool:
        """Do ``sizes``, before a final -1, keep every dim but the last apart? Two or more explicit
        sizes (``view(b, s, -1)``), or a spread of a shape without its last size
        (``reshape(*input_shape, -1)``, ``input_shape = hidden_states.shape[:-1]``)."""
        if len(sizes) >= 2 and not any(isinstance(a, ast.Starred) for a in sizes):
            return True
        if len(sizes) != 1 or not isinstance(sizes[0], ast.Starred):
            return False
        spread = sizes[0].value
        values = self.assigned.get(spread.id, []) if isinstance(spread, ast.Name) else [spread]
        return bool(values) and all(v is not None and _shape_but_last(v) for v in values)

    def clean(self, expr: ast.expr) -> bool:
        """Computed only from ids, masks, positions, constants and ``self``'s non-tensor attributes."""
        for node in ast.walk(expr):
            if isinstance(node, ast.Name) and node.id not in self._clean and node.id != "self":
                if node.id not in ("torch", "F", "nn", "math") and not hasattr(builtins, node.id):
                    return False
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if node.attr in self.module._modules:
                    return False
        return True

    def per_head(self, expr: ast.expr) -> bool:
        """A tensor whose last dim holds one head's features, whole on every rank."""
        if isinstance(expr, ast.Name):
            return expr.id in self._heads
        if isinstance(expr, ast.Subscript):  # q[..., :rot], or one part of a per-head split
            return self.per_head(expr.value)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            method, base, args = expr.func.attr, expr.func.value, expr.args
            if method in ("view", "reshape") and len(args) == 1 and isinstance(args[0], (ast.Name, ast.Starred)):
                spread = args[0].value if isinstance(args[0], ast.Starred) else args[0]
                args = self.reshapes.get(getattr(spread, "id", None), args)  # view(hidden_shape), view(*shape)
            if method in ("view", "reshape") and args and _head_size(args[-1]):
                return True
            if method == "unflatten" and len(args) == 2 and isinstance(args[1], ast.Tuple) and args[1].elts:
                return _head_size(args[1].elts[-1])
            if method in ("chunk", "split", "unbind", "narrow") and _dim_is_last(expr):
                return self.per_head(base)
            if method in _ELEMENTWISE_METHODS or (method in _MIXING_METHODS and _dim_is_last(expr)):
                return self.per_head(base)
        if isinstance(expr, ast.Call) and _resolve(expr.func, self.fn) is torch.cat and expr.args:
            parts = expr.args[0].elts if isinstance(expr.args[0], (ast.List, ast.Tuple)) else []
            return _dim_is_last(expr) and bool(parts) and all(self.per_head(p) or self.clean(p) for p in parts)
        if isinstance(expr, ast.BinOp):  # q * k.sigmoid(), q * 2
            sides = (expr.left, expr.right)
            return any(map(self.per_head, sides)) and all(self.per_head(e) or self.clean(e) for e in sides)
        return False


def _shape_but_last(expr: ast.expr) -> bool:
    """``x.shape[:-1]`` or ``x.size()[:-1]``."""
    if not (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Slice)):
        return False
    sl, base = expr.slice, expr.value
    shape = (isinstance(base, ast.Attribute) and base.attr == "shape") or (
        isinstance(base, ast.Call) and isinstance(base.func, ast.Attribute) and base.func.attr == "size"
    )
    return shape and sl.lower is None and sl.step is None and sl.upper is not None and _is_minus_one(sl.upper)


def _assignment(node: ast.AST) -> tuple[list[ast.expr], ast.expr | None]:
    if isinstance(node, ast.Assign):
        return node.targets, node.value
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target], None if isinstance(node, ast.AugAssign) else node.value
    if isinstance(node, (ast.For, ast.comprehension)):
        return [node.target], None
    if isinstance(node, ast.NamedExpr):
        return [node.target], node.value
    return [], None


def _head_size(expr: ast.expr) -> bool:
    """``self.head_dim``, ``head_dim``, ``3 * self.head_dim``: a size of whole heads' features."""
    names = {n.attr for n in ast.walk(expr) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    return bool(names & _HEAD_SIZES) and not (names & _GLOBAL_SIZES)


def _dim_is_last(call: ast.Call, position: int | None = None) -> bool:
    """The call's ``dim`` (keyword, or positional: second for ``chunk``/``split``/``torch.cat``,
    first for the others) is -1."""
    if position is None:
        method = call.func.attr if isinstance(call.func, ast.Attribute) else ""
        position = 1 if method in ("chunk", "split", "tensor_split", "cat") else 0
    dims = [k.value for k in call.keywords if k.arg == "dim"] or call.args[position : position + 1]
    return bool(dims) and _is_minus_one(dims[0])


def _names_holding_minus_one(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """Local names assigned a tuple with a literal -1 (``hidden_shape = (*input_shape, -1, d)``),
    with the tuple's sizes."""
    names = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Tuple)
            and any(map(_is_minus_one, node.value.elts))
        ):
            names.update((t.id, node.value.elts) for t in node.targets if isinstance(t, ast.Name))
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


def _subscript_problem(node: ast.Subscript, env: _Names) -> str | None:
    if env.clean(node.value) or env.per_head(node.value):
        return None
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


def _call_problem(node, module, children, fn, env: _Names, reading: Reading, seen) -> str | None:
    func, cls = node.func, type(module)
    for keyword in node.keywords:  # attention_interface(..., dropout=self.attention_dropout)
        if keyword.arg in ("dropout", "dropout_p") and _static(keyword.value, module) != 0:
            reading.draws = True
    if isinstance(func, ast.Attribute):
        base = func.value
        if isinstance(base, ast.Name) and base.id == "self":
            if func.attr in children:
                return None
            if callable(getattr(cls, func.attr, None)) and not isinstance(getattr(cls, func.attr), type):
                _read_method(module, func.attr, children, reading, seen)
                return None
            return f"calls self.{func.attr}(), which is neither a child nor a method"
        resolved = _resolve(func, fn)
        if resolved is not None and resolved is not _UNKNOWN:
            return _function_problem(node, resolved, module, env, reading)
        if func.attr in _MIXING_METHODS:
            if env.clean(base) or (env.per_head(base) and _dim_is_last(node)):
                return None
            return f"calls .{func.attr}() ({ast.unparse(node)[:60]})"
        if func.attr == "size" and node.args and _is_minus_one(node.args[0]):
            return None if env.clean(base) or env.per_head(base) else "reads the size of the last dim (.size(-1))"
        if func.attr in ("view", "reshape", "expand", "repeat", "new_empty", "new_zeros", "view_as"):
            return None if env.clean(base) else _reshape_problem(node, env)
        if func.attr == "flatten" and not env.clean(base):
            return _flatten_problem(node, env.per_head(base))
        if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
            return f"calls super().{func.attr}(), which is not read"
        if func.attr in _SAFE_METHODS:
            return None
        return f"calls .{func.attr}(), not known to act on blocks ({ast.unparse(node)[:60]})"
    if isinstance(func, ast.Name):
        if func.id in _SAFE_NAMES or func.id in children:
            return None
        resolved = fn.__globals__.get(func.id, getattr(builtins, func.id, _UNKNOWN))
        if resolved in _SAFE_TORCH or resolved in _DROPOUTS or resolved in _TENSOR_FUNCTIONS:
            return _function_problem(node, resolved, module, env, reading)
        if isinstance(resolved, type) and issubclass(resolved, Exception):
            return None
        if isinstance(resolved, type) and any(c.__name__ == "ModelOutput" for c in resolved.__mro__):
            return None  # a Hugging Face output: a dataclass of the tensors
        return f"calls {func.id}(), not known to act on blocks"
    return f"calls {ast.unparse(func)[:40]}"


def _function_problem(node: ast.Call, resolved, module, env: _Names, reading: Reading) -> str | None:
    """A torch function: safe, a dropout (element-wise; drawing under ``shard_rng`` when p may be
    non-zero), a reduction over ids and masks, ``torch.cat`` of per-head parts on the last dim."""
    if resolved in _SAFE_TORCH:
        return None
    if resolved in _DROPOUTS:
        p = [k.value for k in node.keywords if k.arg == "p"] or node.args[1:2]
        if not p or _static(p[0], module) != 0:
            reading.draws = True
        return None
    tensors = [a for a in node.args if not isinstance(a, ast.Constant)]
    if resolved in _TENSOR_FUNCTIONS and tensors and env.clean(tensors[0]):
        return None
    if resolved is torch.cat and node.args and isinstance(node.args[0], (ast.List, ast.Tuple)):
        parts = node.args[0].elts
        if _dim_is_last(node) and parts and all(env.per_head(p) or env.clean(p) for p in parts):
            return None
    return f"calls {ast.unparse(node.func)}"


def _resolve(func: ast.expr, fn, roots=(torch, F, nn)) -> object:
    """``torch.tanh``, ``F.gelu``, ``nn.functional.silu`` → the object; anything else → None.
    With ``roots=None`` any global name is followed (a decorator)."""
    parts = []
    node = func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    root = fn.__globals__.get(node.id, getattr(builtins, node.id, _UNKNOWN))
    if roots is not None and root not in roots:
        return None
    obj = root
    for part in reversed(parts):
        obj = getattr(obj, part, _UNKNOWN)
    return obj


def _flatten_problem(node: ast.Call, per_head: bool) -> str | None:
    """``flatten(start, end)`` keeps the split last dim apart unless its range reaches it (the end
    defaults to -1); ``flatten(-2)`` of a per-head tensor merges the local heads with their features."""
    args = {**dict(zip(("start_dim", "end_dim"), node.args, strict=False)), **{k.arg: k.value for k in node.keywords}}
    start, end = args.get("start_dim"), args.get("end_dim")
    ends_early = end is not None and not _is_minus_one(end) and isinstance(end, ast.UnaryOp)
    heads = per_head and isinstance(start, ast.UnaryOp) and getattr(start.operand, "value", None) == 2
    if ends_early or heads or (start is not None and _is_minus_one(start)):
        return None
    return f"flattens the split last dim with another ({ast.unparse(node)[:60]})"


def _reshape_problem(node: ast.Call, env: _Names) -> str | None:
    args = node.args
    if len(args) == 1 and isinstance(args[0], (ast.Name, ast.Starred)):  # view(hidden_shape), view(*shape)
        name = getattr(args[0].value if isinstance(args[0], ast.Starred) else args[0], "id", None)
        args = env.reshapes.get(name, args)
    sizes = {a.attr for arg in args for a in ast.walk(arg) if isinstance(a, ast.Attribute)} & _GLOBAL_SIZES
    if sizes:
        return f"reshapes by a global size ({ast.unparse(node)[:60]})"
    if node.func.attr in ("view", "reshape") and args and _is_minus_one(args[-1]) and not env.leading(args[:-1]):
        return f"may merge the split last dim with another ({ast.unparse(node)[:60]})"
    if any(map(_is_minus_one, args)) or not args:
        return None
    if len(args) == 1 and isinstance(args[0], ast.Name):  # view_as(x), expand_as-like, or an unknown shape
        return None if node.func.attr == "view_as" else f"reshapes to a shape it computes ({ast.unparse(node)[:60]})"
    return f"reshapes without -1 in the hidden place ({ast.unparse(node)[:60]})"
