"""What the values in a forward hold, read from its code: the reader's vocabulary (methods and
functions that mix a dim, act element by element, or wrap), constant folding of ``self``'s
attributes (``static_value``), and the local names' kinds (``Names``: a child, no hidden dim, whole
heads on the last dim). ``forward_reader.py`` judges a forward with these."""

from __future__ import annotations

import ast
import builtins
import re

import torch
import torch.nn.functional as F
from torch import nn

MIXING_METHODS = frozenset(
    "chunk split tensor_split unbind narrow norm mean sum nansum prod softmax log_softmax max min amax amin "
    "argmax argmin topk sort var std var_mean std_mean cumsum cumprod logsumexp matmul mm bmm einsum flip "
    "roll gather scatter scatter_add index_select masked_select take_along_dim unfold diff renorm all any".split()
)
SAFE_METHODS = frozenset(
    "view reshape expand expand_as repeat new_empty new_zeros new_ones new_full new_tensor view_as unflatten "
    "flatten transpose permute contiguous to float double half bfloat16 long int bool type type_as unsqueeze "
    "squeeze size dim numel item clone detach masked_fill masked_fill_ exp tanh sigmoid relu pow sqrt rsqrt abs "
    "neg reciprocal mul add sub div mul_ add_ sub_ div_ clamp clamp_ is_floating_point requires_grad_ "
    "get_seq_length get_usable_length get_mask_sizes update get items keys values pop setdefault get_interface "
    "get_text_config format startswith endswith lower append extend insert".split()
)
GLOBAL_SIZES = frozenset(
    "hidden_size embed_dim all_head_size num_heads num_attention_heads num_key_value_heads n_head n_heads "
    "n_embd d_model inner_dim intermediate_size vocab_size split_size".split()
)
ELEMENTWISE_METHODS = frozenset(
    "contiguous to float double half bfloat16 clone detach type_as mul add sub div neg exp tanh sigmoid relu pow "
    "sqrt rsqrt abs reciprocal clamp masked_fill".split()
)
SIZE_KEEPING = frozenset("softmax log_softmax cumsum cumprod flip".split())  # keep the dim's size
# Tensor methods, and torch.nn leaves, whose result is a tuple (``y.max(-1)[0]``, ``self.lstm(x)[0]``).
_TUPLE_METHODS = frozenset("chunk split tensor_split unbind max min topk sort median mode kthvalue aminmax".split())
_TUPLE_METHODS |= frozenset("var_mean std_mean frexp".split())
_TUPLE_MODULES = (nn.MultiheadAttention, nn.RNNBase, nn.AdaptiveLogSoftmaxWithLoss)
SPLITTING = frozenset("chunk split unbind narrow".split())
# Where a method's dim argument sits, when not first (``dims`` for roll and flip).
DIM_POSITIONS = {"chunk": 1, "split": 1, "tensor_split": 1, "cat": 1, "roll": 1, "topk": 1, "take_along_dim": 1,
                 "renorm": 1, "diff": 1, "unfold": 0}  # fmt: skip
# Helpers that rotate within each head's features: per-head inputs give per-head outputs.
ROTARY = frozenset({"apply_rotary_pos_emb"})
HEAD_SIZES = frozenset("head_dim attention_head_size head_size d_head kv_channels".split())
# Inputs that never carry the hidden dim (Hugging Face's names for ids, masks and positions).
NO_HIDDEN_INPUTS = frozenset(
    "input_ids attention_mask position_ids cache_position token_type_ids decoder_input_ids decoder_attention_mask "
    "encoder_attention_mask labels pixel_mask head_mask image_sizes image_grid_thw num_items_in_batch "
    "logits_to_keep".split()
)
SAFE_NAMES = frozenset(
    "apply_rotary_pos_emb create_causal_mask create_sliding_window_causal_mask create_bidirectional_mask "
    "create_masks_for_generate eager_attention_forward sdpa_attention_forward repeat_kv attention_interface "
    "isinstance type len range enumerate zip tuple list dict set getattr hasattr slice int float bool str super "
    "any all print DynamicCache EncoderDecoderCache slice_logits_to_keep".split()
)
SAFE_TORCH = frozenset(
    {
        *(torch.arange, torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.finfo, torch.tanh),
        *(torch.sigmoid, torch.exp, torch.relu, torch.is_autocast_enabled, torch.no_grad, torch.where),
        *(F.gelu, F.silu, F.relu, F.relu6, F.elu, F.selu, F.celu, F.leaky_relu, F.mish, F.softplus, F.hardswish),
        *(F.hardsigmoid, F.hardtanh, F.sigmoid, F.tanh, F.logsigmoid),
        nn.Transformer.generate_square_subsequent_mask,
    }
)
DROPOUTS = frozenset({F.dropout, torch.dropout})
_ELEMENTWISE_FUNCTIONS = SAFE_TORCH - {torch.arange, torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty}
TENSOR_FUNCTIONS = frozenset({torch.cumsum, torch.cumprod, torch.sum, torch.mean, torch.amax, torch.amin})
# Decorators whose wrappers only rename arguments, document, or reshape the returned container.
WRAPPERS = frozenset(
    "deprecate_kwarg can_return_tuple auto_docstring capture_outputs check_model_inputs merge_with_config_defaults "
    "filter_output_hidden_states no_grad enable_grad inference_mode disable".split()
)
UNKNOWN = object()


def truth(value) -> bool | None:
    try:
        return bool(value)
    except Exception:  # a tensor of many elements, a meta tensor
        return None


def static_value(expr: ast.expr, module: nn.Module):
    """The value of ``expr`` from constants and ``self``'s attributes (never ``self.training``)."""
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.Name):
        return module if expr.id == "self" else UNKNOWN
    if isinstance(expr, ast.Attribute):
        base = static_value(expr.value, module)
        if base is UNKNOWN or expr.attr == "training" or isinstance(base, torch.Tensor):
            return UNKNOWN
        try:
            return getattr(base, expr.attr, UNKNOWN)
        except Exception:  # a property that raises
            return UNKNOWN
    if isinstance(expr, ast.IfExp):  # `0.0 if not self.training else self.attention_dropout`: both 0
        test = static_value(expr.test, module)
        if test is not UNKNOWN and truth(test) is not None:
            return static_value(expr.body if truth(test) else expr.orelse, module)
        body, orelse = static_value(expr.body, module), static_value(expr.orelse, module)
        return body if body is not UNKNOWN and orelse is not UNKNOWN and _same(body, orelse) else UNKNOWN
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        value = static_value(expr.operand, module)
        return UNKNOWN if value is UNKNOWN or truth(value) is None else not truth(value)
    if isinstance(expr, ast.BoolOp):
        values = [static_value(v, module) for v in expr.values]
        stop = isinstance(expr.op, ast.Or)  # `or` stops at the first true value, `and` at the first false
        if any(v is not UNKNOWN and truth(v) is stop for v in values):  # `self.training and self.p > 0`, p 0
            return stop  # its truth, whatever the unknown operands hold (they are read, as the test is)
        for value in values:
            if value is UNKNOWN or truth(value) is None:
                return UNKNOWN
            if truth(value) is stop:
                return value
        return values[-1]
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        left, right = static_value(expr.left, module), static_value(expr.comparators[0], module)
        if left is UNKNOWN or right is UNKNOWN:
            return UNKNOWN
        ops = {ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b, ast.Eq: lambda a, b: a == b}
        ops |= {ast.NotEq: lambda a, b: a != b, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
        ops |= {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b}
        ops |= {ast.GtE: lambda a, b: a >= b}
        op = ops.get(type(expr.ops[0]))
        try:
            return UNKNOWN if op is None else op(left, right)
        except Exception:
            return UNKNOWN
    return UNKNOWN


def _names_only_caches(annotation) -> bool:
    """An annotation naming KV caches and nothing else (``Cache | None``, ``EncoderDecoderCache``; not
    ``Cache | torch.Tensor``), as an object or as the text of a postponed annotation."""
    if annotation is None:
        return False
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) or str(annotation)
    names = [n.rpartition(".")[2] for n in re.findall(r"[A-Za-z_][\w.]*", text)]
    names = [n for n in names if n not in ("None", "NoneType", "Optional", "Union", "typing")]
    return bool(names) and all(n.endswith("Cache") for n in names)


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


class Names:
    """What the local names of one forward hold: a child or safe function (``for layer in
    self.layers``), no hidden dim (ids, masks and what is computed only from them), or whole heads
    on the last dim (a reshape into ``head_dim``)."""

    def __init__(self, tree: ast.FunctionDef, module: nn.Module, fn, live: list[ast.AST], entry: bool = True) -> None:
        """``live``: the nodes that may run (dead branches left out): only their assignments count."""
        self.module, self.fn = module, fn
        # every name the code binds (a parameter, a local of any kind): never taken for a builtin
        self._bound = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
        self._bound |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        self._unknown = set()  # bound to values the reader does not follow: match captures, nested defs' arguments
        for n in ast.walk(tree):
            if isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
                self._bound.add(n.name)
                self._unknown.add(n.name)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and n is not tree:
                self._unknown |= {a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)}
        self.bound = self._bound

        self.loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        self.stored = {  # self.<attr> the forward assigns: what they hold is not followed
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
        }
        params = {a.arg for a in [*tree.args.posonlyargs, *tree.args.args, *tree.args.kwonlyargs]}
        self.reshapes = _names_holding_minus_one(tree)
        self.children = _names_of_children(tree, set(module._modules))
        assigned: dict[str, list[ast.expr]] = {}
        self.direct: dict[str, list[ast.expr]] = {}  # the same, without item assignments (name[key] = v)
        for node in live:
            targets, value = _assignment(node)
            for target in targets:
                for name, part in _pairs(target, value):
                    assigned.setdefault(name, []).append(part)
                    if not isinstance(target, ast.Subscript):  # mapping[key] = v fills a container
                        self.direct.setdefault(name, []).append(part)
        self.assigned = assigned
        notes = getattr(fn, "__annotations__", None) or {}  # the parsed tree has none (_parsed)
        self._caches = {p for p in params if _names_only_caches(notes.get(p)) and p not in self.direct}
        grown = True
        while grown:  # curr_cache = cache.self_attention_cache (or cache): a cache too
            grown = False
            for name, values in self.direct.items():
                if (
                    name not in self._caches
                    and name not in params
                    and values
                    and all(v is not None and self.of_cache(v) for v in values)
                ):
                    self._caches.add(name)
                    grown = True
        sizes = _leading_size_names(live).items()
        self.leading_sizes = {n: p for n, p in sizes if len(assigned.get(n, ())) == 1}
        # the inputs' names are trusted in forward alone: a helper method is passed whatever its caller has
        trusted = {p for p in params if p in NO_HIDDEN_INPUTS} if entry else set()
        candidates = {n for n in assigned if n not in params or n in trusted}
        self._clean = candidates | trusted
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
        self._head_at = self._heads_positions(candidates, assigned)
        self._tensors = {n for n in self.direct if n not in params}
        changed = True
        while changed:  # the greatest fixed point, as above: y = self.proj(x); y = y * 2
            changed = False
            for name in list(self._tensors):
                if not all(v is not None and self.holds_tensor(v) for v in self.direct[name]):
                    self._tensors.discard(name)
                    changed = True

    def _heads_positions(self, candidates: set[str], assigned: dict[str, list[ast.expr]]) -> dict[str, int | None]:
        """Where each per-head name holds its heads: the least fixed point of ``heads_at`` over its
        values, from names not yet seen (``y = y * 2`` keeps ``y``'s place); None where the values
        disagree or do not settle."""
        self._head_at = dict.fromkeys((n for n in candidates if n in self._heads), _UNSEEN)
        for _ in range(4 * len(self._head_at) + 2):
            changed = False
            for name in self._head_at:
                now = _agreed([self.heads_at(v) for v in assigned[name]])
                if now != self._head_at[name]:
                    self._head_at[name], changed = now, True
            if not changed:
                return {n: None if at is _UNSEEN else at for n, at in self._head_at.items()}
        return dict.fromkeys(self._head_at)

    def heads_at(self, expr: ast.expr) -> int | None:
        """Of a per-head tensor, which dim holds the heads, counted in 4 dims: 2 after the reshape
        into heads (``[b, s, heads, head_dim]``; -2, from the end, after one to a spread shape), 1 after
        ``transpose(1, 2)``. Only from 2 (or -2) do the heads
        merge back into the split hidden dim (``reshape(b, s, -1)``, ``flatten(-2)``) or leave it when
        ``head_dim`` is reduced; None where it is not known."""
        if not self.per_head(expr):
            return None
        if isinstance(expr, ast.Name):
            return self._head_at.get(expr.id)
        if isinstance(expr, ast.Subscript):
            return self.heads_at(expr.value)
        return self._heads_at_call(expr)

    def _heads_at_call(self, expr: ast.expr):
        """``heads_at`` of a call or arithmetic (a per-head one: ``per_head`` has said which)."""
        if isinstance(expr, ast.Call) and _elementwise_function(expr, self.fn):
            return _agreed([self.heads_at(a) for a in expr.args if not self.clean(a)])
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            method, base, args = expr.func.attr, expr.func.value, expr.args
            if method in ("view", "reshape"):  # (b, s, -1, head_dim): dim 2 of 4; (*shape, -1, head_dim): -2
                sizes = self.reshapes.get(getattr(args[0], "id", None), args) if len(args) == 1 else args
                if any(isinstance(a, ast.Starred) for a in sizes):
                    return -2  # counted from the end: how many dims there are is not known
                return 2 if len(sizes) == 4 else None
            if method == "unflatten":
                return None
            if method in ("transpose", "permute"):
                at = self.heads_at(base)
                if at is None or at is _UNSEEN:
                    return at
                if at < 0:  # from the end: only dims counted from the end can be followed
                    ends = [_int_literal(a) for a in args]
                    if method == "permute" or any(i >= 0 for i in ends):
                        return None
                    return ends[1] if at == ends[0] else ends[0] if at == ends[1] else at
                ints = [_int_literal(a) % 4 for a in args]
                if method == "transpose":
                    return ints[1] if at == ints[0] else ints[0] if at == ints[1] else at
                return ints.index(at)
            if method == "update":
                return _agreed([self.heads_at(a) for a in args[:2]])
            if method in SPLITTING | ELEMENTWISE_METHODS | MIXING_METHODS:
                return self.heads_at(base)
        if isinstance(expr, ast.Call) and _self_child(expr, self.module) is not None:
            return self.heads_at(expr.args[0])
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ROTARY:
            return _agreed([self.heads_at(a) for a in expr.args[:2]])
        if isinstance(expr, ast.Compare):
            return _agreed([self.heads_at(e) for e in (expr.left, *expr.comparators) if not self.clean(e)])
        if isinstance(expr, ast.Call) and resolve(expr.func, self.fn) is torch.cat:  # on the last dim
            return _agreed([self.heads_at(p) for p in expr.args[0].elts if not self.clean(p)])
        if isinstance(expr, ast.BinOp):
            return _agreed([self.heads_at(e) for e in (expr.left, expr.right) if not self.clean(e)])
        return None

    def holds_tensor(self, expr: ast.expr) -> bool:
        """``expr`` is surely one tensor, not a tuple or dict of outputs (whose ``[0]`` is an item,
        not a row): a leaf ``torch.nn`` child's output, a tensor method's or a ``torch``/``F``
        function's result on one, arithmetic with one, or a local name only ever given such values.
        Inputs are not followed (a module may be handed a tuple)."""
        if isinstance(expr, ast.Name):
            return expr.id in self._tensors
        if isinstance(expr, ast.BinOp):
            return self.holds_tensor(expr.left) or self.holds_tensor(expr.right)
        if isinstance(expr, ast.UnaryOp):
            return self.holds_tensor(expr.operand)
        if not isinstance(expr, ast.Call):
            return False
        child = _self_child(expr, self.module)
        if child is not None:
            return (
                not list(child.children())
                and type(child).__module__.startswith("torch.nn.modules")
                and not (isinstance(child, _TUPLE_MODULES))
            )
        if isinstance(expr.func, ast.Attribute) and expr.func.attr not in _TUPLE_METHODS:
            if expr.func.attr in SAFE_METHODS | MIXING_METHODS and self.holds_tensor(expr.func.value):
                return expr.func.attr not in ("size", "dim", "numel", "item", "tolist")
        function = resolve(expr.func, self.fn)
        return (
            getattr(F, getattr(function, "__name__", ""), None) is function  # F.gelu: from torch._C, named in F
            and function is not F.multi_head_attention_forward
            and any(self.holds_tensor(a) for a in expr.args)
        )

    def of_cache(self, expr: ast.expr) -> bool:
        """``expr`` is a KV cache's attribute (``cache.layers``, ``curr_cache.is_updated``): rooted at
        an argument annotated as a ``Cache`` (a name only ever given it or its attributes)."""
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return isinstance(expr, ast.Name) and expr.id in self._caches

    def containers(self) -> set[str]:
        """Names given only dict, list or tuple displays (or clean values): their items, not rows."""
        displays = (ast.Dict, ast.List, ast.Tuple, ast.DictComp, ast.ListComp)
        return {
            n
            for n, vs in self.direct.items()
            if vs and all(v is not None and (isinstance(v, displays) or self.clean(v)) for v in vs)
        }

    def leading(self, sizes: list[ast.expr]) -> bool:
        """Do ``sizes``, before a final -1, keep every dim but the last apart? They are a spread of a
        shape without its last size (``reshape(*input_shape, -1)``, ``input_shape =
        hidden_states.shape[:-1]``), or every target but the last of one unpacked shape, in order
        (``bsz, q_len, _ = hidden_states.size()``, then ``view(bsz, q_len, -1)``). Anything else may
        cut or merge the split dim (Moshi's ``view(b, s, 2, -1)`` of a fused gate/up projection;
        ``reshape(x.shape[0], -1)``) and is refused."""
        if len(sizes) == 1 and isinstance(sizes[0], ast.Starred):
            spread = sizes[0].value
            values = self.assigned.get(spread.id, []) if isinstance(spread, ast.Name) else [spread]
            return bool(values) and all(v is not None and _shape_but_last(v) for v in values)
        places = [self.leading_sizes.get(a.id) if isinstance(a, ast.Name) else None for a in sizes]
        if not places or None in places:
            return False
        unpacks = {unpack for unpack, _, _ in places}
        return len(unpacks) == 1 and [p for _, p, _ in places] == list(range(places[0][2] - 1))

    def clean(self, expr: ast.expr) -> bool:
        """Computed only from ids, masks, positions, constants and ``self``'s non-tensor attributes."""
        for node in ast.walk(expr):
            if isinstance(node, ast.Name) and (node.id in self._unknown or node.id in self.stored):
                return False
            if isinstance(node, ast.Name) and node.id not in self._clean and node.id != "self":
                free = node.id not in self._bound  # `input`, `max` as parameters or locals are not builtins
                if not (free and (node.id in ("torch", "F", "nn", "math") or hasattr(builtins, node.id))):
                    return False
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if node.attr in self.module._modules or node.attr in self.stored:
                    return False
        return True

    def per_head(self, expr: ast.expr) -> bool:
        """A tensor whose last dim holds one head's features, whole on every rank."""
        if isinstance(expr, ast.Name):
            return expr.id in self._heads and expr.id not in self._unknown
        if isinstance(expr, ast.Call) and _elementwise_function(expr, self.fn):  # F.gelu(q), torch.where(q > 0, q, 0)
            sides = [a for a in expr.args if not self.clean(a)]
            return bool(sides) and all(self.per_head(a) for a in sides)
        if isinstance(expr, ast.Subscript):  # q[..., :rot], or one part of a per-head split (not q[..., 0])
            return last_dim_index(expr) and isinstance(expr.slice.elts[-1], ast.Slice) and self.per_head(expr.value)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            method, base, args = expr.func.attr, expr.func.value, expr.args
            if method in ("view", "reshape") and len(args) == 1 and isinstance(args[0], (ast.Name, ast.Starred)):
                spread = args[0].value if isinstance(args[0], ast.Starred) else args[0]
                args = self.reshapes.get(getattr(spread, "id", None), args)  # view(hidden_shape), view(*shape)
            if method in ("view", "reshape") and args and _head_size(args[-1]):  # (*leading, -1, head_dim)
                return len(args) >= 2 and is_minus_one(args[-2]) and self.leading(list(args[:-2]))
            if method in MIXING_METHODS and method not in SIZE_KEEPING and method not in SPLITTING:
                return False  # a reduction over head_dim leaves the heads on the last dim
            if method == "unflatten" and len(args) == 2 and isinstance(args[1], ast.Tuple) and args[1].elts:
                return _head_size(args[1].elts[-1])
            if method == "unbind":  # unbind(-1) drops head_dim: [b, s, heads] is no longer per head
                return False
            if method in SPLITTING and dim_is_last(expr):
                return self.per_head(base)
            if method in ELEMENTWISE_METHODS or (method in MIXING_METHODS and dim_is_last(expr)):
                return self.per_head(base)
            if method in ("transpose", "permute") and _keeps_last_of_4d(method, args):
                return self.per_head(base)
            if method == "update" and len(args) >= 2:  # a KV cache: keys and values, longer along the sequence
                return all(self.per_head(a) for a in args[:2])
        if _self_child(expr, self.module) is not None and expr.args and self.per_head(expr.args[0]):
            child = _self_child(expr, self.module)  # Qwen3's q_norm: a norm over one head's features
            weight = getattr(child, "weight", None)
            head_dim = getattr(self.module, "head_dim", None)
            return not list(child.children()) and weight is not None and tuple(weight.shape) == (head_dim,)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ROTARY:
            return len(expr.args) >= 2 and all(self.per_head(a) for a in expr.args[:2])
        if isinstance(expr, ast.Compare):
            sides = [expr.left, *expr.comparators]
            return any(map(self.per_head, sides)) and all(self.per_head(e) or self.clean(e) for e in sides)
        if isinstance(expr, ast.Call) and resolve(expr.func, self.fn) is torch.cat and expr.args:
            parts = expr.args[0].elts if isinstance(expr.args[0], (ast.List, ast.Tuple)) else []
            return dim_is_last(expr) and bool(parts) and all(self.per_head(p) or self.clean(p) for p in parts)
        if isinstance(expr, ast.BinOp):  # q * k.sigmoid(), q * 2
            sides = (expr.left, expr.right)
            return any(map(self.per_head, sides)) and all(self.per_head(e) or self.clean(e) for e in sides)
        return False


def in_place(at: int | None) -> bool:
    """``heads_at``'s answer for ``[..., heads, head_dim]``: dim 2 of 4, or -2 from the end."""
    return at in (2, -2)


def _elementwise_function(call: ast.Call, fn) -> bool:
    """``F.gelu(x)``, ``torch.where(c, x, y)``, ``F.dropout(x, p)``: a function acting element by element."""
    resolved = resolve(call.func, fn)
    return resolved in _ELEMENTWISE_FUNCTIONS or resolved in DROPOUTS


_UNSEEN = object()  # a name's heads' place before its values are read (Names._heads_positions)


def _agreed(positions: list) -> int | None:
    """The one place every value gives (those not yet seen aside), or None."""
    seen = {p for p in positions if p is not _UNSEEN}
    if not seen:
        return _UNSEEN if positions else None
    return seen.pop() if len(seen) == 1 else None


def _int_literal(a: ast.expr) -> int:
    """A literal dim, ``1`` or ``-1`` (``_keeps_last_of_4d`` has checked that it is one)."""
    return a.value if isinstance(a, ast.Constant) else -a.operand.value


def _keeps_last_of_4d(method: str, args: list[ast.expr]) -> bool:
    """``transpose(1, 2)`` or ``permute(0, 2, 1, 3)`` of a ``[b, s, heads, head_dim]`` tensor (a
    reshape into heads gives 4 dims) leaves ``head_dim`` last."""
    ints = [a.value if isinstance(a, ast.Constant) else -a.operand.value if _negative(a) else None for a in args]
    if None in ints or not all(isinstance(i, int) for i in ints):
        return False
    if method == "transpose":
        return len(ints) == 2 and all(i % 4 != 3 for i in ints) and all(-4 <= i < 4 for i in ints)
    return len(ints) == 4 and ints[-1] % 4 == 3 and sorted(i % 4 for i in ints) == [0, 1, 2, 3]


def _negative(a: ast.expr) -> bool:
    return isinstance(a, ast.UnaryOp) and isinstance(a.op, ast.USub) and isinstance(a.operand, ast.Constant)


def shape_of(expr: ast.expr) -> bool:
    """``x.shape`` or ``x.size()``."""
    return (isinstance(expr, ast.Attribute) and expr.attr == "shape") or (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == "size"
        and not expr.args
    )


def _leading_size_names(live: list[ast.AST]) -> dict[str, tuple[int, int, int]]:
    """Names given the leading sizes of a tensor by ``b, s, _ = x.shape`` (or ``x.size()``): each
    name's (unpacking, position, number of targets), the last target (the hidden size) left out."""
    names = {}
    for node in live:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and shape_of(node.value):
            target = node.targets[0]
            if isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
                k = len(target.elts)
                names.update((t.id, (id(node), i, k)) for i, t in enumerate(target.elts[:-1]))
    return names


def _shape_but_last(expr: ast.expr) -> bool:
    """``x.shape[:-1]`` or ``x.size()[:-1]``."""
    if not (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Slice)):
        return False
    sl, base = expr.slice, expr.value
    shape = (isinstance(base, ast.Attribute) and base.attr == "shape") or (
        isinstance(base, ast.Call) and isinstance(base.func, ast.Attribute) and base.func.attr == "size"
    )
    return shape and sl.lower is None and sl.step is None and sl.upper is not None and is_minus_one(sl.upper)


def _self_child(expr: ast.expr, module: nn.Module):
    """The child ``self.<name>(...)`` calls, or None."""
    if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)):
        return None
    base = expr.func.value
    if isinstance(base, ast.Name) and base.id == "self":
        return module._modules.get(expr.func.attr)
    return None


def last_dim_index(node: ast.Subscript) -> bool:
    """``t[..., i]`` or ``t[..., a:b]``: an index of the last dim alone (HF's ``q[..., :rot]``)."""
    index = node.slice
    elts = index.elts if isinstance(index, ast.Tuple) else [index]
    return len(elts) == 2 and isinstance(elts[0], ast.Constant) and elts[0].value is Ellipsis


def _pairs(target: ast.expr, value: ast.expr | None):
    """(name, the value it is given): ``a, b = (x, y)`` pairs a with x; ``a, b = f()`` gives both f()."""
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
        if len(target.elts) == len(value.elts) and not any(isinstance(e, ast.Starred) for e in value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                yield from _pairs(t, v)
            return
    for n in ast.walk(target):
        if isinstance(n, ast.Name):
            yield n.id, value


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
    return bool(names & HEAD_SIZES) and not (names & GLOBAL_SIZES)


def dim_is_last(call: ast.Call, position: int | None = None) -> bool:
    """The call's ``dim`` (keyword ``dim``/``dims``/``dimension``, or positional: see
    ``DIM_POSITIONS``, first for the others) is -1."""
    method = call.func.attr if isinstance(call.func, ast.Attribute) else ""
    if position is None:
        position = DIM_POSITIONS.get(method, 0)
    names = ("dim", "dims", "dimension")
    dims = [k.value for k in call.keywords if k.arg in names] or call.args[position : position + 1]
    return bool(dims) and is_minus_one(dims[0])


def _names_holding_minus_one(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """Local names assigned a tuple with a literal -1 (``hidden_shape = (*input_shape, -1, d)``),
    with the tuple's sizes."""
    names = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Tuple)
            and any(map(is_minus_one, node.value.elts))
        ):
            names.update((t.id, node.value.elts) for t in node.targets if isinstance(t, ast.Name))
    return names


def _names_of_children(tree: ast.AST, children: set[str]) -> set[str]:
    """Local names bound to a child or a safe function: ``for layer in self.layers[:n]``,
    ``mask_function = create_causal_mask if ... else create_sliding_window_causal_mask``. Every
    candidate must be one (``for f in (self.proj, centre)`` binds no child)."""

    def child(expr: ast.AST) -> bool:  # self.layers, self.layers[:n], self.layers.values(), enumerate(...)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "enumerate":
            expr = expr.args[0] if len(expr.args) == 1 else None
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in ("values",):
            expr = expr.func.value
        while isinstance(expr, ast.Subscript):
            expr = expr.value
        return (
            isinstance(expr, ast.Attribute)
            and isinstance(expr.value, ast.Name)
            and expr.value.id == "self"
            and (expr.attr in children)
        )

    def function(expr: ast.AST) -> bool:
        if isinstance(expr, ast.IfExp):
            return function(expr.body) and function(expr.orelse)
        return (isinstance(expr, ast.Name) and expr.id in SAFE_NAMES) or child(expr)

    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and child(node.iter):
            names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.IfExp) and function(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def is_minus_one(node: ast.AST) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and getattr(node.operand, "value", None) == 1


def resolve(func: ast.expr, fn, roots=(torch, F, nn)) -> object:
    """``torch.tanh``, ``F.gelu``, ``nn.functional.silu`` → the object; anything else → None.
    With ``roots=None`` any global name is followed (a decorator)."""
    parts = []
    node = func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    root = fn.__globals__.get(node.id, getattr(builtins, node.id, UNKNOWN))
    if roots is not None and root not in roots:
        return None
    obj = root
    for part in reversed(parts):
        obj = getattr(obj, part, UNKNOWN)
    return obj
