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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from optimus2d.comm.rng import shard_rng
from optimus2d.convert.forward_values import (
    DROPOUTS,
    GLOBAL_SIZES,
    MIXING_METHODS,
    SAFE_METHODS,
    SAFE_NAMES,
    SAFE_TORCH,
    TENSOR_FUNCTIONS,
    UNKNOWN,
    WRAPPERS,
    Names,
    dim_is_last,
    in_place,
    is_minus_one,
    last_dim_index,
    resolve,
    shape_of,
    static_value,
    truth,
)


@dataclass
class Reading:
    """What the reader found in one module's forward: problems, guards (if-tests on ``self``'s
    attributes with the value they had), and whether it calls a dropout that may draw."""

    problems: list[str] = field(default_factory=list)
    guards: list[tuple[str, ast.expr, bool]] = field(default_factory=list)
    # the dropout probabilities it passes (None: torch's default, 0.5), read again at each call
    dropout_ps: list[ast.expr | None] = field(default_factory=list)

    @property
    def draws(self) -> bool:
        return bool(self.dropout_ps)

    def may_draw(self, module: nn.Module) -> bool:
        """Whether a dropout of the forward may draw now: a probability that is not 0, or unknown."""
        return any(p is None or static_value(p, module) != 0 for p in self.dropout_ps)


_DICT_METHODS = frozenset({"copy", "get", "items", "keys", "values", "update", "setdefault", "pop"})


def read_forward(module: nn.Module) -> Reading:
    """Read ``type(module).forward`` (and the methods it calls on ``self``) for this instance."""
    reading = Reading()
    _read_method(module, "forward", set(module._modules), reading, set())
    if output_head(module) is not None and hasattr(module, "generate"):  # families/hf_causal_lm replaces it
        reading.problems = [p for p in reading.problems if "self.loss_function()" not in p]
    return reading


def output_head(module: nn.Module) -> nn.Module | None:
    """A language model's head: its ``lm_head``, or what ``get_output_embeddings()`` names (BioGPT's
    ``output_projection``); None if it has neither."""
    head = getattr(module, "lm_head", None)
    if head is None and callable(getattr(module, "get_output_embeddings", None)):
        try:
            head = module.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            return None
    return head if isinstance(head, nn.Module) else None


def forward_problems(module: nn.Module) -> list[str]:
    """What in ``module``'s forward may read the split hidden dim; empty when nothing does."""
    return read_forward(module).problems


def check_guards(module: nn.Module, args, kwargs=None) -> None:
    """A forward pre-hook: the if-tests the reader evaluated still give what they gave."""
    for text, test, value in module._optimus2d_guards:
        now = static_value(test, module)
        if now is UNKNOWN or truth(now) is not value:
            raise RuntimeError(
                f"{type(module).__name__}.forward was judged correct on blocks with `{text}` {value}; it is now "
                f"{now if now is not UNKNOWN else 'unknown'}, so a branch nobody read would run. Set it before "
                f"parallelize, or convert the model again"
            )


def check_guards_after(module: nn.Module, args, output) -> None:
    """A forward hook: the same, after the call (a child that changed a shared config's flag)."""
    check_guards(module, args)


def draw_per_shard(module: nn.Module, mesh, may_draw: Callable[[nn.Module], bool] | None = None) -> None:
    """Run ``module``'s forward, while training, under ``shard_rng``: its dropout draws a mask per
    shard, as ``Dropout2D`` does, not the same mask on every shard. ``may_draw(module)``, asked at
    each call: whether its dropout may draw now (a probability that is not 0); where it says no,
    the forward runs as it is and takes no number from torch's generator (``shard_rng`` takes one),
    which then gives what it gives serially (a sampled token, a shuffle)."""
    module._optimus2d_rng_mesh = mesh
    module._optimus2d_may_draw = may_draw
    module.forward = types.MethodType(_forward_drawing_per_shard, module)


def _forward_drawing_per_shard(self, *args, **kwargs):
    may_draw = self._optimus2d_may_draw
    with shard_rng(self._optimus2d_rng_mesh, enabled=self.training and (may_draw is None or may_draw(self))):
        return type(self).forward(self, *args, **kwargs)


@functools.cache
def _parsed(fn, method: bool = True) -> tuple[ast.FunctionDef, int]:
    """``fn``'s syntax tree without annotations, and its first line. ``method``: its first parameter
    is the instance, renamed ``self`` where it has another name (``def forward(mod, x)``), as the
    reader knows the instance by that name (not where ``self`` also names something else)."""
    source = textwrap.dedent(inspect.getsource(fn))
    _, first = inspect.getsourcelines(fn)
    tree = ast.parse(source).body[0]
    for node in ast.walk(tree):  # type annotations (tuple[Tensor, Tensor]) are not code that runs
        if isinstance(node, (ast.arg, ast.AnnAssign)):
            node.annotation = ast.Constant(None)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
    params = [*tree.args.posonlyargs, *tree.args.args] if isinstance(tree, ast.FunctionDef) else []
    named = {getattr(n, "id", None) or getattr(n, "arg", None) for n in ast.walk(tree)}
    if method and params and params[0].arg != "self" and "self" not in named:
        instance = params[0].arg
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == instance:
                node.id = "self"
            elif isinstance(node, ast.arg) and node.arg == instance:
                node.arg = "self"
    return tree, first


def _read_method(module: nn.Module, name: str, children: set[str], reading: Reading, seen: set[str]) -> None:
    if name in seen:
        return
    seen.add(name)
    cls = type(module)
    fn = getattr(cls, name, None)
    wrapped = getattr(fn, "__func__", fn)
    fn = inspect.unwrap(wrapped)  # the code under the decorators, which are judged below
    method = not isinstance(inspect.getattr_static(cls, name, None), (staticmethod, classmethod))
    try:
        tree, first = _parsed(fn, method)
    except (OSError, TypeError):
        reading.problems.append(f"{cls.__name__}.{name}: its source cannot be read")
        return
    where = f"{cls.__name__}.{name}, line {{}}"
    for deco in tree.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        obj = resolve(target, fn, roots=None)
        if getattr(obj, "__name__", None) not in WRAPPERS or not _from_known_library(obj):
            line = where.format(first + deco.lineno - 1)
            reading.problems.append(f"{line}: is decorated by {ast.unparse(target)}, whose wrapper is not read")
    live = list(_live(tree.body, module, reading, name))
    env = Names(tree, module, fn, live, entry=name == "forward")
    for size in _sizes_used_as_numbers(tree, env):
        line = where.format(first + getattr(size, "lineno", 1) - 1)
        what = size.id if isinstance(size, ast.Name) else ast.unparse(size)
        reading.problems.append(f"{line}: uses the local size {what} as a number (its dim is split over the mesh)")
    for node in live:
        line = where.format(first + getattr(node, "lineno", 1) - 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            if not (env.clean(node.left) and env.clean(node.right)):
                reading.problems.append(f"{line}: multiplies matrices (@)")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            reading.problems.append(f"{line}: assigns {ast.unparse(node)} (state the reader does not follow)")
        elif isinstance(node, ast.Attribute) and node.attr in ("T", "mT", "H", "mH") and not env.clean(node.value):
            what = "a head's features off the last dim" if env.per_head(node.value) else "the split last dim"
            reading.problems.append(f"{line}: moves {what} ({ast.unparse(node)[:60]})")
        elif isinstance(node, ast.Assign) and _unpacks_last_size(node, env):
            reading.problems.append(f"{line}: reads the split dim's size ({ast.unparse(node)[:60]})")
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
            value = static_value(node.test, module)
            yield from ast.walk(node.test)
            if value is not UNKNOWN:
                taken = truth(value)
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


def _subscript_problem(node: ast.Subscript, env: Names) -> str | None:
    if env.clean(node.value):
        return None
    if env.per_head(node.value):
        if not last_dim_index(node):
            return f"indexes a per-head tensor off its last dim ({ast.unparse(node)[:60]})"
        if not env.per_head(node) and not in_place(env.heads_at(node.value)):  # q[..., 0]: head_dim dropped
            return _heads_out_of_place(node, env.heads_at(node.value))
        return None
    index = node.slice
    last = index.elts[-1] if isinstance(index, ast.Tuple) and index.elts else index
    if shape_of(node.value):  # x.shape[k], x.size()[k]: only the batch and sequence sizes, or all but the last
        return None if _leading_index(index) else f"reads a size that may be the split dim's ({ast.unparse(node)[:60]})"
    if _rooted_at_self(node.value):  # self.layers[:n]: a child's slice, a config's entry
        return None
    if isinstance(node.value, ast.Name) and node.value.id in env.containers():  # causal_mask_mapping[kind]
        return None
    if env.of_cache(node.value):  # cache.layers[self.layer_idx]: a layer of a KV cache, not a row
        return None
    rows = not isinstance(index, ast.Tuple) and (not _plain_item(index) or env.holds_tensor(node.value))
    if isinstance(node.value, ast.Subscript) or rows:  # y[:1], and y[0] of a tensor, not of a tuple of outputs
        return f"indexes rows, which are split over the mesh ({ast.unparse(node)[:60]})"
    if isinstance(index, ast.Tuple) and isinstance(last, ast.Slice) and (last.lower or last.upper or last.step):
        return f"slices the last dim ({ast.unparse(node)})"
    whole = isinstance(last, ast.Slice) or (isinstance(last, ast.Constant) and last.value in (None, Ellipsis))
    if isinstance(index, ast.Tuple) and not whole:
        return f"indexes the last dim ({ast.unparse(node)[:60]})"
    return None


def _unpacks_last_size(node: ast.Assign, env: Names) -> bool:
    """``b, s, h = x.shape`` with ``h`` used: the split dim's local size taken for the whole."""
    target, value = node.targets[0], node.value
    if len(node.targets) != 1 or not isinstance(target, ast.Tuple) or not shape_of(value) or not target.elts:
        return False
    last = target.elts[-1]
    base = value.value if isinstance(value, ast.Attribute) else value.func.value
    if not isinstance(last, ast.Name) or last.id == "_" or env.clean(base) or env.per_head(base):
        return False
    return last.id in env.loaded


@functools.cache
def _own_methods(cls: type) -> frozenset[str]:
    """Methods defined by ``cls`` and its bases up to ``nn.Module`` (not torch's own)."""
    names = set()
    for base in cls.__mro__:
        if base in (nn.Module, object) or base.__module__.startswith("torch."):
            continue
        names.update(n for n, v in vars(base).items() if callable(v) and not n.startswith("__"))
    return frozenset(names)


def _not_over_rows(call: ast.Call, position: int = 0) -> bool:
    """A reduction given an explicit dim (keyword ``dim`` or positional) that is not 0, the batch."""
    dims = [k.value for k in call.keywords if k.arg == "dim"] or call.args[position : position + 1]
    if not dims:
        return False
    value = _literal(dims[0])
    return value is not None and value != 0


def _attention_kernel(value: ast.expr | None) -> bool:
    """``ALL_ATTENTION_FUNCTIONS.get_interface(...)``: Hugging Face's registry of attention kernels."""
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "get_interface"


def _rooted_at_self(node: ast.expr) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _leading_index(index: ast.expr) -> bool:
    """``[0]``, ``[1]``, ``[:-1]``, ``[:1]``, ``[:2]``: sizes before the last (of a 3-D activation)."""
    if isinstance(index, ast.Constant):
        return index.value in (0, 1)
    if isinstance(index, ast.Slice) and index.lower is None and index.step is None:
        upper = index.upper
        return is_minus_one(upper) or (isinstance(upper, ast.Constant) and upper.value in (1, 2))
    return False


def _plain_item(index: ast.expr) -> bool:
    """``out[0]``, ``outputs["logits"]``: an item of a tuple or dict (a literal key), not a slice."""
    return isinstance(index, ast.Constant) and isinstance(index.value, (int, str))


def _call_problem(node, module, children, fn, env: Names, reading: Reading, seen) -> str | None:
    func, cls = node.func, type(module)
    for keyword in node.keywords:  # attention_interface(..., dropout=self.attention_dropout)
        if keyword.arg in ("dropout", "dropout_p") and static_value(keyword.value, module) != 0:
            reading.dropout_ps.append(keyword.value)
        elif keyword.arg in ("dropout", "dropout_p") and not isinstance(keyword.value, ast.Constant):
            zero = ast.Compare(keyword.value, [ast.Eq()], [ast.Constant(0)])  # 0 now: a later p must draw per shard
            reading.guards.append((ast.unparse(zero), zero, True))
    if isinstance(func, ast.Attribute):
        base = func.value
        if isinstance(base, ast.Name) and base.id == "self":
            if func.attr in children:
                return None
            if callable(getattr(cls, func.attr, None)) and not isinstance(getattr(cls, func.attr), type):
                _read_method(module, func.attr, children, reading, seen)
                return None
            return f"calls self.{func.attr}(), which is neither a child nor a method"
        if func.attr in _own_methods(cls):  # me = self; me.helper(x), type(self).helper(self, x): not read
            return f"calls {ast.unparse(func)}(), a method of {cls.__name__} not called through self"
        resolved = resolve(func, fn)
        if resolved is not None and resolved is not UNKNOWN:
            return _function_problem(node, resolved, module, env, reading)
        if func.attr in _DICT_METHODS and isinstance(base, ast.Name) and env.direct.get(base.id):
            if all(isinstance(v, ast.Dict) for v in env.direct[base.id]):
                return None  # a dict this forward builds (Cwm's mask_kwargs.copy()): its values are judged where used
        if func.attr in MIXING_METHODS:
            if env.clean(base) and (func.attr in ("any", "all") or _not_over_rows(node)):
                return None  # a mask's own dims, not its rows (split over the mesh): cumsum(dim=1), sum(-1)
            if env.per_head(base) and dim_is_last(node):  # over head_dim: what is left of the heads must be in place
                at = env.heads_at(base)
                return None if env.per_head(node) or in_place(at) else _heads_out_of_place(node, at)
            return f"calls .{func.attr}() ({ast.unparse(node)[:60]})"
        if func.attr in ("size", "numel") and not (env.clean(base) or env.per_head(base)):
            if func.attr == "size" and (not node.args or _leading_index(node.args[0])):
                return None  # x.size() (its items are judged as x.shape's), x.size(0), x.size(1)
            return f"reads a size that may be the split dim's ({ast.unparse(node)[:60]})"
        if func.attr in ("transpose", "permute", "swapaxes", "movedim", "mT", "T") and not env.clean(base):
            if not env.per_head(base):
                return f"moves the split last dim ({ast.unparse(node)[:60]})"
            if not env.per_head(node):  # transpose(2, 3): the heads' features interleaved with the heads
                return f"moves a head's features off the last dim ({ast.unparse(node)[:60]})"
        shaped = func.attr in ("view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "repeat")
        shaped = shaped and not env.clean(base)
        if shaped and env.per_head(base) and not in_place(env.heads_at(base)):
            return _heads_out_of_place(
                node, env.heads_at(base)
            )  # [b, heads, s, head_dim].reshape(b, s, -1): heads and tokens mixed
        if func.attr in ("view", "reshape", "expand", "repeat", "new_empty", "new_zeros", "view_as"):
            return None if env.clean(base) else _reshape_problem(node, env)
        if func.attr == "flatten" and not env.clean(base):
            return _flatten_problem(node, env.per_head(base))
        if func.attr == "unflatten" and not env.clean(base) and not env.per_head(base) and not env.per_head(node):
            return f"unflattens a dim that may be the split one ({ast.unparse(node)[:60]})"  # (into heads: per head)
        if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
            return f"calls super().{func.attr}(), which is not read"
        if func.attr in SAFE_METHODS:
            return None
        return f"calls .{func.attr}(), not known to act on blocks ({ast.unparse(node)[:60]})"
    if isinstance(func, ast.Name):
        if func.id in children:
            return None
        if func.id in SAFE_NAMES and func.id not in env.bound:  # and what the name is: transformers' or a builtin
            known = fn.__globals__.get(func.id, getattr(builtins, func.id, None))
            if str(getattr(known, "__module__", "")).split(".")[0] in ("transformers", "builtins"):
                return None
        if (
            func.id in SAFE_NAMES
            and env.assigned.get(func.id)
            and all(_attention_kernel(v) for v in env.assigned[func.id])
        ):
            return None  # attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(...): HF's kernels
        resolved = fn.__globals__.get(func.id, getattr(builtins, func.id, UNKNOWN))
        if resolved in SAFE_TORCH or resolved in DROPOUTS or resolved in TENSOR_FUNCTIONS:
            return _function_problem(node, resolved, module, env, reading)
        if isinstance(resolved, type) and issubclass(resolved, Exception):
            return None
        if isinstance(resolved, type) and any(c.__name__ == "ModelOutput" for c in resolved.__mro__):
            return None  # a Hugging Face output: a dataclass of the tensors
        return f"calls {func.id}(), not known to act on blocks"
    return f"calls {ast.unparse(func)[:40]}"


def _function_problem(node: ast.Call, resolved, module, env: Names, reading: Reading) -> str | None:
    """A torch function: safe, a dropout (element-wise; drawing under ``shard_rng`` when p may be
    non-zero), a reduction over ids and masks, ``torch.cat`` of per-head parts on the last dim."""
    if resolved in SAFE_TORCH:
        return None
    if resolved in DROPOUTS:
        p = [k.value for k in node.keywords if k.arg == "p"] or node.args[1:2]
        if not p or static_value(p[0], module) != 0:
            reading.dropout_ps.append(p[0] if p else None)
        elif not isinstance(p[0], ast.Constant):  # 0 now: a guard, as a later non-zero p must draw per shard
            zero = ast.Compare(p[0], [ast.Eq()], [ast.Constant(0)])
            reading.guards.append((ast.unparse(zero), zero, True))
        return None
    tensors = [a for a in node.args if not isinstance(a, ast.Constant)]
    if resolved in TENSOR_FUNCTIONS and tensors and env.clean(tensors[0]) and _not_over_rows(node, 1):
        return None
    if resolved is torch.cat and node.args and isinstance(node.args[0], (ast.List, ast.Tuple)):
        parts = node.args[0].elts
        if dim_is_last(node) and parts and all(env.per_head(p) or env.clean(p) for p in parts):
            return None
    return f"calls {ast.unparse(node.func)}"


_SHAPED = frozenset("view reshape expand repeat unflatten new_empty new_zeros new_ones new_full".split())


def _sizes_used_as_numbers(tree: ast.AST, env: Names) -> list[ast.expr]:
    """Loads of ``b, s, _ = x.shape``'s names anywhere but as sizes of a reshape (``view(b, s, -1)``,
    ``hidden_shape = (b, s, -1, d)``): ``y / b`` divides by this rank's share of the batch; and so
    of ``x.shape[0]`` / ``x.size(0)`` written where they are used (``y / y.shape[0]``: 1.0 off)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        named = isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in env.leading_sizes
        if not (named or _batch_size_read(node, env)):
            continue
        up = parents.get(node)
        while isinstance(up, (ast.BinOp, ast.Tuple, ast.List, ast.Starred)):
            up = parents.get(up)
        call_ok = isinstance(up, ast.Call) and isinstance(up.func, ast.Attribute) and up.func.attr in _SHAPED
        shape_ok = isinstance(up, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in env.reshapes for t in up.targets
        )
        # ``batch = x.shape[0]``: a name, followed no further (``b, s, _ = x.shape``'s are)
        named_alone = not named and isinstance(parents.get(node), ast.Assign)
        if not (call_ok or shape_ok or named_alone):
            found.append(node)
    return found


def _batch_size_read(node: ast.AST, env: Names) -> bool:
    """``x.shape[0]``, ``x.size(0)`` or ``len(x)`` of a tensor that may hold the split batch (not ids,
    masks or positions, not ``self``'s)."""
    if isinstance(node, ast.Subscript) and shape_of(node.value):
        base = node.value.value if isinstance(node.value, ast.Attribute) else node.value.func.value
        index = node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" and node.args:
        base, index = node.func.value, node.args[0]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len" and node.args:
        return "len" not in env.bound and env.holds_tensor(node.args[0])  # len(y): y's rows, this rank's share
    else:
        return False
    return _literal(index) == 0 and not env.clean(base) and not _rooted_at_self(base)


def _literal(node: ast.expr):
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        value = None  # ~0 is not a literal: unknown
    return value if isinstance(value, int) else None


def _heads_out_of_place(node: ast.expr, at: int | None) -> str:
    """A per-head tensor's heads merged into (or left as) the hidden dim from another place than
    ``[b, s, heads, head_dim]``, or from a place the reader does not know."""
    if at is None:
        return f"may merge the split last dim with another ({ast.unparse(node)[:60]})"
    return (
        f"merges or reduces a per-head tensor whose heads are not in place [b, s, heads, head_dim] "
        f"(transpose them back first) ({ast.unparse(node)[:60]})"
    )


def _flatten_problem(node: ast.Call, per_head: bool) -> str | None:
    """``flatten(start, end)`` keeps the split last dim apart unless its range reaches it (the end
    defaults to -1); ``flatten(-2)`` of a per-head tensor merges the local heads with their features."""
    args = {**dict(zip(("start_dim", "end_dim"), node.args, strict=False)), **{k.arg: k.value for k in node.keywords}}
    start, end = args.get("start_dim"), args.get("end_dim")
    ends_early = end is not None and _literal(end) not in (None, -1) and _literal(end) < 0
    heads = per_head and isinstance(start, ast.UnaryOp) and getattr(start.operand, "value", None) == 2
    if ends_early or heads or (start is not None and is_minus_one(start)):
        return None
    return f"flattens the split last dim with another ({ast.unparse(node)[:60]})"


def _reshape_problem(node: ast.Call, env: Names) -> str | None:
    args = node.args
    if len(args) == 1 and isinstance(args[0], (ast.Name, ast.Starred)):  # view(hidden_shape), view(*shape)
        name = getattr(args[0].value if isinstance(args[0], ast.Starred) else args[0], "id", None)
        args = env.reshapes.get(name, args)
    sizes = {a.attr for arg in args for a in ast.walk(arg) if isinstance(a, ast.Attribute)} & GLOBAL_SIZES
    if sizes:
        return f"reshapes by a global size ({ast.unparse(node)[:60]})"
    if node.func.attr in ("view", "reshape") and args and is_minus_one(args[-1]) and not env.leading(args[:-1]):
        return f"may merge the split last dim with another ({ast.unparse(node)[:60]})"
    if any(map(is_minus_one, args)) or not args:
        return None
    if len(args) == 1 and isinstance(args[0], ast.Name):  # view_as(x), expand_as-like, or an unknown shape
        return None if node.func.attr == "view_as" else f"reshapes to a shape it computes ({ast.unparse(node)[:60]})"
    return f"reshapes without -1 in the hidden place ({ast.unparse(node)[:60]})"
