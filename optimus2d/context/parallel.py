"""Context parallelism for one module of a model: ``parallelize(model, mesh, plan={path: ContextParallel(mesh)})``.

Real multimodal systems split the LLM's sequence and not the encoder's: the encoder's inputs are
bounded, the fused sequence is long. A plan entry ``ContextParallel(mesh, mask=..., balance=...)``
converts the named module on ``mesh`` (as a ``Mesh`` entry does) and runs it in the sequence layout
(``comm/sequence.py``, c = ``mesh.depth``), while the rest of the model keeps the activation layout:

* going in, its ``inputs_embeds`` (``[b/(c·q), s, h/q]``) or ``input_ids`` (``[b/(c·q), s]``) move
  to ``[b/q, s/c, ...]`` by one all-to-all over depth (``batch_to_sequence``), laid out by the
  ``Assignment`` that ``balance`` makes from the mask for this s (cached per s); ``position_ids``
  become the tokens' own (``context.positions``), or move alike when given;
* inside, every attention module computes ``context.attention`` under the mask
  (``sequence_parallel``); token-wise layers need nothing;
* coming out, ``last_hidden_state`` and any ``hidden_states`` move back to ``[b/(c·q), s, h/q]`` in
  sequence order (the inverse all-to-all): the head, the labels and the loss are the whole
  sequence's, unchanged.

Gradients take the same all-to-alls back. Per rank and boundary crossing it sends (c − 1)/c of its
block, ``(c − 1)/c · b/(c·q) · s · h/q`` elements, and receives as much; the layout never holds
more than a block. The module is a Hugging Face base model (``LlamaModel``, ``Qwen2Model``, a
LLaVA's ``language_model``) called with keywords, whose forward takes ``position_ids`` (one that
makes its own positions, as BART's encoder, T5's relative bias or BLOOM's ALiBi, is refused by
``parallelize``). Refused, with the same error on every rank: a sequence the balance cannot split
(pad it), a padding ``attention_mask`` (not all ones: packed documents are a ``mask=``), a cache
(``past_key_values`` or ``cache``; ``use_cache`` is turned off), per-head ``attentions``, a mask of
another size than the sequence, ``position_ids`` of another shape, any other tensor argument (it
would stay in the batch layout), gradient checkpointing or torch's
``checkpoint_wrapper``/``checkpoint`` inside the module (its recompute would run outside the split),
``position_ids`` that restart inside a row (packed documents, which transformers masks apart when no
``attention_mask`` is given) under a mask that attends across those documents, outputs other than
hidden states, an ``attention_mask`` other than a ``[b, s]`` padding mask (a 4D mask of the model's
own), shapes that differ between ranks (agreed before the all-to-all), a layer (an element of the
module's outermost ``ModuleList``s) that ran but never called the context-parallel attention (its
attention is its own, as BLOOM's ALiBi or a user's class, or it mixes tokens another way; found
after the call, whose output is discarded), and (``context/hf.py``) an attention module that attends
both ways (``is_causal=False``) under a causal-only mask or that gives its attention another tensor
(T5's ``position_bias``, sinks).
"""

from __future__ import annotations

import inspect
import itertools
import types
from collections.abc import Callable

import torch
from torch import nn

from optimus2d.comm import Mesh
from optimus2d.comm.agreement import agree
from optimus2d.comm.mesh import as_mesh
from optimus2d.comm.sequence import batch_to_sequence, sequence_to_batch
from optimus2d.context.attention import ATTENTION_METHODS
from optimus2d.context.balance import METHODS, Assignment, assign, causal_mask
from optimus2d.context.hf import sequence_parallel

Mask = str | torch.Tensor | Callable[[int], torch.Tensor]


class ContextParallel:
    """A plan value: the module on ``mesh`` with its sequence split over ``mesh.depth`` ranks.

    ``mask``: "causal", a boolean ``[s, s]`` tensor (query, key; sequence order), or a function of
    s giving one. ``balance``: how sequence blocks go to ranks (``context.assign``: "head_tail",
    the default, for causal masks; "makespan" for any mask; "uniform"); ``block``: makespan's
    block size. ``attention``: "all_gather", "ring" or "auto" (the cost model's pick per layer,
    given ``memory``: the bytes a rank can spare for one layer's attention; ``sequence_parallel``)."""

    def __init__(
        self,
        mesh: Mesh,
        *,
        mask: Mask = "causal",
        balance: str = "head_tail",
        block: int | None = None,
        attention: str = "auto",
        memory: float | None = None,
    ):
        mesh = as_mesh(mesh, "ContextParallel's mesh")  # a torch DeviceMesh: its Mesh
        if not (mask == "causal" if isinstance(mask, str) else isinstance(mask, torch.Tensor) or callable(mask)):
            raise ValueError(
                f"ContextParallel: mask must be 'causal', a [s, s] bool tensor or a function of s, got {mask!r}"
            )
        if balance not in METHODS:
            raise ValueError(f"ContextParallel: balance {balance!r} is not one of {METHODS}")
        if attention not in ("auto", *ATTENTION_METHODS):
            raise ValueError(f"ContextParallel: attention {attention!r} is not 'auto' or one of {ATTENTION_METHODS}")
        self.mesh, self.mask, self.balance, self.block = mesh, mask, balance, block
        self.attention, self.memory = attention, memory
        self._splits: dict[int, tuple[tuple, Assignment, torch.Tensor]] = {}

    def __repr__(self) -> str:
        mask = self.mask if isinstance(self.mask, str) else type(self.mask).__name__
        return (
            f"ContextParallel(Mesh(q={self.mesh.q}, depth={self.mesh.depth}, ranks={list(self.mesh.ranks)}), "
            f"mask={mask}, balance={self.balance}, block={self.block}, attention={self.attention}, "
            f"memory={self.memory})"
        )

    def split(self, s: int) -> tuple[Assignment, torch.Tensor]:
        """The assignment and the mask of a sequence of ``s`` tokens (``ValueError`` if it does not split);
        made again when ``mask``, ``balance`` or ``block`` was set to another since."""
        given = (self.mask, self.balance, self.block)
        made = self._splits.get(s)
        if made is None or any(a is not b for a, b in zip(made[0], given, strict=True)):
            if isinstance(self.mask, str):
                mask = causal_mask(s)
            else:
                mask = self.mask(s) if callable(self.mask) else self.mask
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (s, s):
                got = f"{mask.dtype}{list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(
                    f"ContextParallel: the mask for a sequence of {s} tokens must be bool[{s}, {s}], got {got}"
                )
            self._splits[s] = (given, assign(mask, self.mesh.depth, self.balance, block=self.block), mask)
        return self._splits[s][1:]

    @staticmethod
    def refusal(module: nn.Module) -> str | None:
        """Why ``module`` cannot run with its sequence split (None: it can), read from its class:
        its forward must take ``position_ids``, which give each token its own position (a module
        that makes its positions itself, as BART's encoder, would number this rank's slice)."""
        try:
            takes = inspect.signature(type(module).forward).parameters
        except (TypeError, ValueError):
            takes = {}
        if "position_ids" not in takes:
            return (
                "its forward takes no position_ids parameter, so the positions it makes (learned, rotary or a "
                "bias) would be this rank's slice's, not the tokens' own (a wrapper that passes **kwargs on: plan "
                "the module it wraps)"
            )
        return None

    def install(self, module: nn.Module, path: str) -> None:
        """Run ``module``'s forward in the sequence layout (called by ``parallelize`` once it is converted)."""
        if "_optimus2d_context_parallel" in module.__dict__:
            return
        func = getattr(module.forward, "__func__", None)  # the class's: a deep copy of the module calls its own
        if func is None:
            raise TypeError(
                f"ContextParallel: {path or type(module).__name__}'s forward is wrapped on the instance "
                f"({type(module.forward).__name__}): context parallelism cannot wrap it in turn"
            )
        names = list(inspect.signature(module.forward).parameters)

        def forward(self_, *args, **kwargs):
            if args:  # bind positional arguments to their names: the hook reads them by name
                kwargs.update(zip(names, args, strict=False))
            spec = self_.__dict__["_optimus2d_context_parallel"]  # the copy's own, read at the call
            return _run(spec, path, self_, types.MethodType(func, self_), kwargs)

        module.forward = types.MethodType(forward, module)
        module.__dict__["_optimus2d_context_parallel"] = self
        layers = _layers(module)  # each notes that it ran (a deep copy's layers, their own)
        module.__dict__["_optimus2d_context_layers"] = [where for where, _ in layers]
        for _, layer in layers:
            layer.register_forward_pre_hook(_note_ran)


def _run(spec: ContextParallel, path: str, module: nn.Module, original, kwargs: dict):
    mesh = spec.mesh
    where = f"{path or type(module).__name__} with context parallelism on Mesh(q={mesh.q}, depth={mesh.depth})"
    x = kwargs.get("inputs_embeds")
    x = kwargs.get("input_ids") if x is None else x
    error, split = None, None
    try:
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ValueError(f"{where}: needs input_ids [b, s] or inputs_embeds [b, s, h] by keyword")
        if any(kwargs.get(k) is not None for k in ("past_key_values", "cache", "past_key_value")):
            raise ValueError(f"{where}: a cache (past_key_values) is not supported: it holds the whole sequence's keys")
        if kwargs.get("output_attentions"):
            raise ValueError(f"{where}: per-head attentions cannot be returned; do not ask for them")
        unknown = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _INPUTS]
        if unknown:
            raise ValueError(
                f"{where}: {unknown} would stay in the batch layout while the sequence is split; give only "
                f"{list(_INPUTS)}"
            )
        given = kwargs.get("position_ids")
        if given is not None and (
            given.dim() != 2 or given.shape[0] not in (1, x.shape[0]) or given.shape[1] != x.shape[1]
        ):
            raise ValueError(
                f"{where}: position_ids {list(given.shape)} must be [1, s] or this rank's block [b, s] of the "
                f"ids {list(x.shape[:2])}"
            )
        recomputed = _recomputed(module) if module.training and torch.is_grad_enabled() else []
        if recomputed:
            raise ValueError(
                f"{where}: {recomputed} recompute their layers in backward, outside the sequence split (their "
                f"attention would see this rank's tokens alone): turn it off (gradient_checkpointing_disable(), or no "
                f"checkpoint_wrapper / checkpoint inside the module)"
            )
        split = spec.split(x.shape[1])
        padding = kwargs.get("attention_mask")
        if padding is not None and not isinstance(padding, torch.Tensor):
            raise ValueError(
                f"{where}: attention_mask is a {type(padding).__name__} (a mapping of the model's own masks), not "
                f"this rank's block [b, s] {list(x.shape[:2])} of a padding mask: give the mask as "
                f"ContextParallel(mask=...) and drop attention_mask"
            )
        if given is not None and padding is None and _makes_cache(module, kwargs) and _packed(given):
            if _crossed_documents(given, split[1]) is None:  # serial makes a cache: it attends across them
                raise ValueError(
                    f"{where}: position_ids restart inside a row (packed documents), and the mask given keeps them "
                    f"apart, but transformers masks documents apart only without a cache, and this call makes one "
                    f"(use_cache, or the config's use_cache=True): the serial model attends across them. Call it "
                    f"with use_cache=False to keep them apart, or give the causal mask"
                )
        elif given is not None and padding is None:
            crossed = _crossed_documents(given, split[1])
            if crossed is not None:
                raise ValueError(
                    f"{where}: position_ids restart inside a row (packed documents: row {crossed[0]}, at token "
                    f"{crossed[1]}), and transformers then masks each document apart when no attention_mask is "
                    f"given, but the context-parallel mask attends across them: give the documents' mask as "
                    f"ContextParallel(mask=...) (the same for every row), or an attention_mask of ones (attention "
                    f"over the whole row, as transformers gives it then)"
                )
        if padding is not None and tuple(padding.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"{where}: attention_mask {list(padding.shape)} is not this rank's block [b, s] "
                f"{list(x.shape[:2])} of a padding mask (a mask of the model's own, as a 4D one, is not taken): give "
                f"the mask as ContextParallel(mask=...) and drop attention_mask"
            )
        if padding is not None and not bool(padding.all()):
            raise ValueError(
                f"{where}: a padding attention_mask (zeros in this rank's block {list(padding.shape)}) is not "
                f"supported; give packed documents as ContextParallel(mask=...) and drop attention_mask"
            )
    except ValueError as err:
        error = err
    # a refusal may read what is this rank's own (its samples' padding, a sequence padded here to
    # another length): agreed with the shapes, so that no rank is left waiting in the all-to-all
    if mesh.check != "off" and mesh.size > 1:
        shapes = {
            k: f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
            for k, v in kwargs.items()
            if isinstance(v, torch.Tensor)
        }
        agree(mesh, "context parallel", description=f"inputs {shapes}", error=error)
    elif error is not None:
        raise error
    assignment, mask = split
    order = assignment.permutation()
    key = "inputs_embeds" if kwargs.get("inputs_embeds") is not None else "input_ids"
    kwargs[key] = batch_to_sequence(x, mesh, order)
    given = kwargs.get("position_ids")
    if given is not None and given.shape[0] == x.shape[0]:  # this rank's samples' own: laid out alike
        kwargs["position_ids"] = batch_to_sequence(given, mesh, order)
    else:  # none (the tokens' own) or one row for every sample
        mine = assignment.positions[mesh.index("depth")].to(x.device)
        kwargs["position_ids"] = (given[:, mine] if given is not None else mine).reshape(1, -1)
    kwargs["attention_mask"] = None
    kwargs["use_cache"] = False
    if "cache_position" in kwargs:  # the whole sequence's numbering: the model numbers its own slice (no cache)
        kwargs["cache_position"] = None
    layers = [(at, module.get_submodule(at)) for at in module.__dict__.get("_optimus2d_context_layers", ())]
    for _, layer in layers:
        layer.__dict__["_optimus2d_context_ran"] = False
    with sequence_parallel(module, mesh, assignment, mask, attention=spec.attention, memory=spec.memory) as callers:
        out = original(**kwargs)
    silent = [
        at
        for at, layer in layers
        if layer.__dict__["_optimus2d_context_ran"] and not any(id(m) in callers for m in layer.modules())
    ]
    if silent:  # the same modules ran on every rank: the same verdict
        raise ValueError(
            f"{where}: {silent} ran, but not through the context-parallel attention (transformers' "
            f"AttentionInterface): an attention of their own (BLOOM's ALiBi, a user's class) or another mixing of "
            f"tokens (a recurrence) would see this rank's tokens alone. Refused (this call's output is discarded)"
        )
    return _back(out, mesh, order)


def _recomputed(module: nn.Module) -> list[str]:
    """The modules inside ``module`` that recompute their forward in backward: Hugging Face's
    ``gradient_checkpointing``, torch's ``checkpoint_wrapper`` and composable ``checkpoint``."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    found = []
    for path, m in module.named_modules():
        if (
            getattr(m, "gradient_checkpointing", False)
            or isinstance(m, ActivationWrapper)
            or "checkpoint" in (_get_registry(m) or {})
        ):
            found.append(path or type(module).__name__)
    return found


def _crossed_documents(position_ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, int] | None:
    """Where ``mask`` (``[s, s]``, query × key, True: attends) attends across the documents that
    ``position_ids`` (``[rows, s]``) pack in a row, as transformers reads them when no attention mask
    is given (``masking_utils.find_packed_sequence_indices``: a document starts where the position
    does not go up by 1): (row, first token of the document) of the first such; None where none."""
    steps = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    for row in range(position_ids.shape[0]):
        starts = [int(n) for n in steps[row].nonzero().flatten()]
        bounds = [0, *(n for n in starts if n > 0), position_ids.shape[1]]
        for a, b in itertools.pairwise(bounds):
            if len(bounds) > 2 and (mask[a:b, :a].any() or mask[a:b, b:].any()):
                return row, a
    return None


def _makes_cache(module: nn.Module, kwargs: dict) -> bool:
    """Whether the serial call would make a cache: ``use_cache`` given, else the config's (as
    transformers' ``merge_with_config_defaults`` reads it). With one, transformers does not look for
    packed documents in the position ids (``masking_utils``: only without a cache)."""
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(module, "config", None), "use_cache", False)
    return bool(use_cache)


def _packed(position_ids: torch.Tensor) -> bool:
    """Some row's positions restart (go up by other than 1) after its first token."""
    return bool((torch.diff(position_ids, dim=-1) != 1).any())


def _note_ran(layer: nn.Module, args: tuple) -> None:
    """A forward pre-hook on each layer of a context-parallel module: it ran in this call."""
    layer.__dict__["_optimus2d_context_ran"] = True


def _layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The module's layers: every element holding parameters of its outermost ``nn.ModuleList``s
    (not of one inside a layer, as a layer's experts)."""
    layers: list[tuple[str, nn.Module]] = []
    for path, held in module.named_modules():  # outer modules first
        if isinstance(held, nn.ModuleList) and not any(path.startswith(f"{outer}.") for outer, _ in layers):
            for name, layer in held.named_children():
                if next(layer.parameters(), None) is not None:
                    layers.append((f"{path}.{name}" if path else name, layer))
    return layers


_HIDDEN = ("last_hidden_state", "hidden_states")
_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask", "cache_position")


def _back(out, mesh: Mesh, order: torch.Tensor):
    """The module's hidden states in the activation layout again; any other output is refused
    (its layout is not known: a router's logits, a cache)."""
    if isinstance(out, torch.Tensor):
        return sequence_to_batch(out, mesh, order)
    if not hasattr(out, "keys"):
        raise ValueError(f"ContextParallel: the module returned a {type(out).__name__}; a model output is expected")
    others = [key for key in out.keys() if key not in _HIDDEN and out[key] is not None]
    if others:
        raise ValueError(
            f"ContextParallel: the module returned {others}, whose layout on the sequence split is not known; "
            f"only last_hidden_state and hidden_states come back"
        )
    for key in _HIDDEN:
        value = out.get(key)
        if isinstance(value, torch.Tensor):
            out[key] = sequence_to_batch(value, mesh, order)
        elif isinstance(value, (tuple, list)):
            out[key] = type(value)(sequence_to_batch(t, mesh, order) for t in value)
    return out
