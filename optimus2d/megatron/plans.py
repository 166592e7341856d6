"""Which modules split, and how, under Megatron's 1D tensor parallelism: torch's ``parallelize_module``
plan for a module and everything inside it.

Only module classes whose forward is known to be correct with their linears split by column then
by row are split (``SPLITS``: the class, its forward, the role of each child linear, the head counts
its attention splits); every other module inside a 1D region runs whole on every rank on the
whole activation (replicated), which is always the serial computation. A class is recognised by
its qualified name and only when its forward is that class's own (a subclass that rewrites the
forward is not trusted): the forwards listed read the head count from the tensors' shapes
(``view(*shape, -1, head_dim)``), so they run on their local heads. ``register_split`` teaches
another class. torch's ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer`` split
linear1 by column and linear2 by row (their activation must act element by element), and their
``nn.MultiheadAttention``, whose packed q/k/v ``parallelize_module`` cannot split, is split by heads
in ``megatron/attention.py``. An ``nn.Sequential`` of ``Linear``, element-wise activations and ``Linear`` splits
its first linear by column and its last by row.

Refused (``ValueError``, the module named): a split whose linear's output size or head count the
ranks do not divide; another child of a split module that holds parameters (an activation with
weights, ``PReLU``: it would run on this rank's shard and get a part of its gradient); and a
region where dropout may draw (a ``Dropout`` of p > 0, an ``attention_dropout``, ``dropout`` or
``drop_prob`` > 0): the ranks of a replicated module would draw different masks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.layers.base import runs_forward_of
from optimus2d.megatron import attention

COLWISE, ROWWISE = "colwise", "rowwise"


@dataclass(frozen=True)
class Split:
    """How one module class splits: each child linear's role, the head counts to divide, the
    children its forward calls on the whole activation (not on a linear's shard), and what else it
    refuses (each line naming what, without the module's path)."""

    roles: dict[str, str]
    heads: Callable[[nn.Module], dict[str, int]] = lambda module: {}
    whole: tuple[str, ...] = ()
    refuse: Callable[[nn.Module], list[str]] = lambda module: []


def _config_heads(module: nn.Module) -> dict[str, int]:
    config = module.config
    heads = {"num_attention_heads": config.num_attention_heads}
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None:
        heads["num_key_value_heads"] = kv
    return heads


_QKV_O = {"q_proj": COLWISE, "k_proj": COLWISE, "v_proj": COLWISE, "o_proj": ROWWISE}
_QKV_OUT = {"q_proj": COLWISE, "k_proj": COLWISE, "v_proj": COLWISE, "out_proj": ROWWISE}
_GATED = {"gate_proj": COLWISE, "up_proj": COLWISE, "down_proj": ROWWISE}
_FC = {"fc1": COLWISE, "fc2": ROWWISE}


def _torch_layer_refusals(layer: nn.Module) -> list[str]:
    """torch's encoder and decoder layers apply ``activation`` to linear1's output: on this rank's
    shard of it, so it must act element by element."""
    act = layer.activation
    if act in _ELEMENTWISE_FUNCTIONS or (_elementwise(act) and not isinstance(act, nn.Dropout)):
        return []
    what = act if isinstance(act, nn.Module) else getattr(act, "__qualname__", type(act).__name__)
    return [f"activation {what} is not known to act element by element (it would run on a shard of linear1's output)"]


_TORCH_LAYER = {"linear1": COLWISE, "linear2": ROWWISE}

SPLITS: dict[str, Split] = {
    "torch.nn.modules.transformer.TransformerEncoderLayer": Split(
        _TORCH_LAYER, whole=("self_attn", "norm1", "norm2"), refuse=_torch_layer_refusals
    ),
    "torch.nn.modules.transformer.TransformerDecoderLayer": Split(
        _TORCH_LAYER, whole=("self_attn", "multihead_attn", "norm1", "norm2", "norm3"), refuse=_torch_layer_refusals
    ),
    "transformers.models.llama.modeling_llama.LlamaAttention": Split(_QKV_O, _config_heads),
    "transformers.models.llama.modeling_llama.LlamaMLP": Split(_GATED),
    "transformers.models.clip.modeling_clip.CLIPAttention": Split(_QKV_OUT, _config_heads),
    "transformers.models.clip.modeling_clip.CLIPMLP": Split(_FC),
    "transformers.models.siglip.modeling_siglip.SiglipAttention": Split(_QKV_OUT, _config_heads),
    "transformers.models.siglip.modeling_siglip.SiglipMLP": Split(_FC),
    "transformers.models.llava.modeling_llava.LlavaMultiModalProjector": Split(
        {"linear_1": COLWISE, "linear_2": ROWWISE}
    ),
}

# parameter-free modules that act element by element (an nn.Sequential's middle; a Dropout of p > 0 is refused)
_ELEMENTWISE = (
    nn.GELU,
    nn.ReLU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Identity,
    nn.Mish,
    nn.LeakyReLU,
    nn.ReLU6,
    nn.Dropout,
)
# functions torch's layers may be given as ``activation``, each element by element as they call it (one argument)
_ELEMENTWISE_FUNCTIONS = (F.relu, F.gelu, F.silu, F.mish, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.softplus)
_ELEMENTWISE_FUNCTIONS += (F.hardswish, F.hardsigmoid, F.hardtanh, F.tanh, F.sigmoid)
_ELEMENTWISE_FUNCTIONS += (torch.tanh, torch.sigmoid, torch.relu)


def _elementwise(module: object) -> bool:
    """One of ``_ELEMENTWISE`` running that class's forward (a subclass that rewrites it is not trusted)."""
    return runs_forward_of(module, _ELEMENTWISE)


def register_split(
    cls: type, roles: dict[str, str], heads: Callable[[nn.Module], dict[str, int]] | None = None
) -> None:
    """Teach 1D tensor parallelism a module class whose forward is correct with the child linears
    ``roles`` names split by column (``"colwise"``: output features) and by row (``"rowwise"``),
    and on its local heads (``heads(module)``: each head count that must divide the ranks)."""
    bad = {name: role for name, role in roles.items() if role not in (COLWISE, ROWWISE)}
    if bad:
        raise ValueError(f"register_split: roles must be {COLWISE!r} or {ROWWISE!r}, got {bad}")
    SPLITS[_name(cls)] = Split(dict(roles), heads or (lambda module: {}))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def split_of(module: nn.Module) -> Split | None:
    """The split of ``module``'s class, or of a base class whose forward it keeps; an ``nn.Sequential``
    of Linear, element-wise activations, another Linear; else None (the module runs replicated)."""
    for cls in type(module).__mro__:
        split = SPLITS.get(_name(cls))
        if split is not None and type(module).forward is cls.forward:
            return split
    if type(module).forward is nn.Sequential.forward:
        names = list(module._modules)
        children = list(module._modules.values())
        middle_ok = all(_elementwise(c) for c in children[1:-1])
        ends = (children[0], children[-1]) if children else ()
        if len(children) >= 2 and middle_ok and ends[0] is not ends[1] and all(isinstance(c, nn.Linear) for c in ends):
            if all(type(c).forward is nn.Linear.forward for c in (children[0], children[-1])):
                return Split({names[0]: COLWISE, names[-1]: ROWWISE})
    return None


def tensor_parallel_plan(region: nn.Module, path: str, ranks: int) -> tuple[dict[str, str], list[str]]:
    """``{relative path of a linear: "colwise" | "rowwise"}`` for ``region`` split over ``ranks``
    ranks, and the reasons it is refused (each naming the module at ``path``…)."""
    roles: dict[str, str] = {}
    refused: list[str] = []
    for rel, module in region.named_modules():
        where = ".".join(p for p in (path, rel) if p) or "the model itself"
        refused += _dropout_refusals(module, where)
        if attention.splits(module):  # torch's packed attention: split by heads (megatron/attention.py)
            refused += attention.refusals(module, where, ranks)
            continue
        split = split_of(module)
        if split is None:
            continue
        for name, role in split.roles.items():
            linear = module._modules.get(name)
            if not isinstance(linear, nn.Linear):
                refused.append(f"{where}.{name} ({type(linear).__name__}): expected an nn.Linear to split {role}")
                continue
            size = linear.out_features if role == COLWISE else linear.in_features
            if size % ranks:
                dim = "output" if role == COLWISE else "input"
                refused.append(
                    f"{where}.{name} (Linear): {dim} features {size} not divisible by the {ranks} ranks of the "
                    f"1D split ({role})"
                )
            roles[f"{rel}.{name}" if rel else name] = role
        refused += [f"{where} ({type(module).__name__}): {why}" for why in split.refuse(module)]
        for name, child in module.named_children():  # a child with parameters (PReLU, xIELU) would see a shard
            held = [n for n, _ in child.named_parameters()] if name not in (*split.roles, *split.whole) else []
            if held:
                refused.append(
                    f"{where}.{name} ({type(child).__name__}): holds {', '.join(held)} and would run on this rank's "
                    f"shard of the split (its gradient a part on each rank)"
                )
        for what, count in split.heads(module).items():
            if count % ranks:
                refused.append(
                    f"{where} ({type(module).__name__}): {what} = {count} not divisible by the {ranks} ranks of "
                    f"the 1D split"
                )
    return roles, refused


def _dropout_refusals(module: nn.Module, where: str) -> list[str]:
    if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
        return [f"{where} ({type(module).__name__}): dropout p={module.p} inside a 1D region (ranks would draw apart)"]
    out = []
    for attr in ("attention_dropout", "dropout", "drop_prob"):
        value = module.__dict__.get(attr)
        if isinstance(value, float) and value > 0:
            out.append(f"{where} ({type(module).__name__}): {attr}={value} inside a 1D region (ranks would draw apart)")
    return out
