"""A model that takes its inputs whole and gives its outputs whole: ``parallelize(..., io="whole")``.

By default a parallelized model takes blocks of its mesh (``scatter``, ``scatter_batch``) and gives
blocks (``gather`` them). With ``io="whole"`` it takes every tensor argument whole, the same on every
rank (as torch's ``parallelize_module`` takes a ``Replicate`` input: each rank loads the whole batch),
and gives every tensor of its output whole on every rank (as DTensor's 1D layout gives it):

* entry: each tensor argument of one dim or more → this rank's block of the model's mesh
  (``from_whole``: nothing sent; backward, where it needs a gradient, the blocks' gradients
  all-gathered). A Hugging Face keyword (or the name of the ``forward`` parameter a positional
  argument fills) says what it is: ``inputs_embeds`` an activation ``[b, s, h]`` (cut as
  ``scatter`` cuts it); ids, labels, images, and every ``*mask*`` a batch tensor ``[b, ...]`` (cut
  as ``scatter_batch`` cuts it); ``cache_position``, ``logits_to_keep`` and ``position_ids`` of one
  row ``[1, s]`` (the same for every row) given as they are. Any other: a floating tensor of 3
  dims an activation, of 2 refused (an activation ``[b, h]`` or a value a token ``[b, s]``: its name
  does not say), anything else a batch tensor. ``io={name: "batch" | "activation" | "whole"}``
  (whole, as "whole") declares what an argument is, before any of these rules: ``io={"weights":
  "batch"}``; "whole" gives it as it is (a wrapper's own argument that reaches torch.nn's attention
  as its ``attn_mask``: ``io={"mask": "whole"}``).
  A planned module that takes such a block unchanged does not move it: a 1D region
  (``megatron.Megatron``) takes the whole tensor itself, a module on another mesh shape cuts its
  own block of it; nothing sent either way.
* exit: each output tensor, a block of a mesh → the whole tensor (``to_whole``: one all-gather
  forward, nothing backward). A 1D region's whole output, cut into blocks at its boundary
  (``from_whole``) and returned unchanged, is given whole as it was: nothing sent either way. A
  tensor without a layout is a block of the model's mesh (the model's own forward ran on its
  blocks), as at every boundary; a Hugging Face causal LM's logits are given ``[b, s, V]``, as
  serial's (the columns that pad its vocabulary to divide the mesh, −inf where no soft cap follows
  the head, dropped; ``gather`` keeps them). Hidden states asked for are made whole when read. A
  Hugging Face KV cache (``past_key_values``, ``use_cache=True``) is not a tensor output but the
  model's state: it holds this rank's blocks ``[b/(d·q), kv_heads/q, s, head_dim]``, to be handed
  back as it is to the next call (exact); a serial cache given in is refused (its shapes).

A block a module took whole is out of the backward graph: a gradient hook or ``retain_grad`` asked
of it after the module read it is refused (it would never fire; ``comm.whole.take_whole``).

So a model that is one 1D region sends exactly what torch's ``parallelize_module`` sends for it,
and a model on a mesh pays one all-gather of each output to give it whole. While a call runs, a
1D region's whole output is kept beside the blocks cut from it; all are let go when the call
returns (a block no longer referenced frees it earlier). Whole inputs that differ between ranks
are not detected (as DTensor assumes of a ``Replicate`` input): every rank must load the same
batch. ``generate`` (Hugging Face) takes and gives whole tensors itself: the hooks step aside
(``paused``) while it runs.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping

import torch
from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.comm.whole import forget_whole, from_whole, is_whole, keep_whole, mark_whole, take_whole, to_whole
from optimus2d.convert.layouts import Boundary, _kind, _tensors
from optimus2d.layers.base import ShardedModule

IO = ("blocks", "whole")
KINDS = ("batch", "activation", "whole")  # what io={name: kind} may declare an argument to be
_BATCH = ("input_ids", "position_ids", "token_type_ids", "labels", "pixel_values", "image_sizes")
_AS_IS = ("cache_position", "logits_to_keep")  # positions the same for every row
# torch.nn's attention masks, [L, S] or [b·H, L, S] (not batch-major alone): the converted attention
# takes them whole; so does a converted nn.TransformerEncoder its ``mask``
_TORCH_MASKS = ("attn_mask", "src_mask", "tgt_mask", "memory_mask")
VOCABULARY = "_optimus2d_vocabulary"  # on a causal LM's logits block: its vocabulary V (families/hf_causal_lm.py)


def io_refusal(io: object) -> Exception | None:
    """Why ``parallelize(io=)`` refuses ``io`` (None: it takes it)."""
    if isinstance(io, Mapping):
        bad = {k: v for k, v in io.items() if not isinstance(k, str) or not isinstance(v, str) or v not in KINDS}
        if bad:
            return ValueError(f"parallelize: io={{name: kind}} takes kinds {KINDS} by argument name, got {bad}")
        return None
    if not isinstance(io, str) or io not in IO:
        return ValueError(
            f"parallelize: io= is 'blocks' (the default: blocks of the mesh in and out), 'whole', or "
            f"{{argument name: 'batch' | 'activation' | 'whole'}} (whole, those arguments declared), got {io!r}"
        )
    return None


class WholeIO(Boundary):
    """The hooks of a model converted with ``io="whole"``: whole tensors in, whole tensors out.

    ``active`` while a call runs (a 1D region's boundary then keeps its whole output beside the
    blocks it cuts, ``keep``); ``kept``: those blocks and the inputs' blocks (weakly), forgotten on
    return; ``paused``: the hooks pass everything as it is (while ``generate`` runs)."""

    def __init__(self, mesh: Mesh, meshes: list[Mesh], kinds: Mapping[str, str] | None = None) -> None:
        super().__init__("the model", mesh, mesh, meshes)
        self.kinds = dict(kinds or {})  # io={name: kind}: what the user declared
        self.active = self.paused = self.torch_stack = False
        self.kept: list[weakref.ref] = []

    def install(self, module: nn.Module) -> None:
        module.__dict__["_optimus2d_whole_io"] = self
        if isinstance(module, ShardedModule):  # its __call__ calls before and after around its own check
            module.__dict__["_optimus2d_boundary"] = self
        else:
            module.register_forward_pre_hook(self.before, with_kwargs=True)
            module.register_forward_hook(self.after, always_call=True)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._forget()
        if self.paused:
            return args, kwargs
        named = [(f"argument {n}", a) for n, a in enumerate(args)] + list(kwargs.items())
        for name, t in (hit for key, value in named for hit in _tensors(value, key)):  # refuse before cutting
            if t.dim() and getattr(t, "_optimus2d_layout", None) is not None:
                raise ValueError(
                    f"parallelize(io='whole'): the model takes its inputs whole on every rank, but {name} of shape "
                    f"{tuple(t.shape)} is a block of a mesh (from scatter, scatter_batch or a module): give the whole "
                    f"tensor, or convert the model with io='blocks'"
                )
        self.active = True
        self.torch_stack = hasattr(module, "serial_arguments")
        names = [name or f"argument {n}" for n, name in enumerate(_positional_names(module, len(args)))]
        args = tuple(_map_named(a, name, self._cut) for a, name in zip(args, names, strict=True))
        return args, {key: _map_named(value, key, self._cut) for key, value in kwargs.items()}

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        try:
            return super().after(module, args, output) if output is not None and not self.paused else output
        finally:
            self.active = False
            self._forget()

    def keep(self, block: torch.Tensor, whole: torch.Tensor) -> None:
        """Note on ``block`` the whole tensor it was cut from, until this call returns."""
        keep_whole(block, whole)
        self.kept.append(weakref.ref(block))

    def _forget(self) -> None:
        for ref in self.kept:
            block = ref()
            if block is not None:
                forget_whole(block)
        self.kept.clear()

    def _cut(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """The whole argument ``t`` → this rank's block. ``name``: its keyword, or its path inside one
        (``batch['w']``, as ``io={name: kind}`` declares it); the argument's own name (``batch``)
        applies the rules by name to the tensors inside it."""
        if t.dim() == 0:
            return t
        base = name.split("[", 1)[0]
        kind = self.kinds.get(name)
        torch_mask = base in _TORCH_MASKS or (base == "mask" and self.torch_stack)
        if (
            kind == "whole"
            or (kind is None and (base in _AS_IS or torch_mask))
            or (kind is None and base == "position_ids" and t.shape[0] == 1)
        ):  # the same for every row, or whole wherever it goes (a 1D region takes it as it is)
            same = mark_whole(t.view_as(t))  # (a module taking blocks refuses it)
            self.keep(same, t)
            return same
        if kind is not None:  # declared: this tensor itself (a container's leaves each by its path)
            pass
        elif base in _BATCH or "mask" in name:
            kind = "batch"
        elif base == "inputs_embeds":
            kind = "activation"
        elif t.is_floating_point() and t.dim() == 2:
            raise ValueError(
                f"parallelize(io='whole'): {name} of shape {tuple(t.shape)} is a floating "
                f"tensor of 2 dims whose name does not say what it is: an activation [b, h] (its hidden dim split "
                f"over the mesh's q = {self.inner.q}) or a value per token [b, s] (split by batch alone); declare it: "
                f"io={{{name!r}: 'activation'}} or io={{{name!r}: 'batch'}}"
            )
        else:
            kind = "activation" if t.is_floating_point() and t.dim() == 3 else "batch"
        block = from_whole(t, self.inner, kind)
        self.keep(block, t)
        return block

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or is_whole(t):  # (whole already: CLIP's logits from gathered embeddings)
            return t
        whole = take_whole(t)
        if whole is None:
            given = getattr(t, "_optimus2d_layout", None)
            src = self.meshes.get(given, self.inner) if given is not None else self.inner
            whole = to_whole(t, src, _kind(t))
        vocab = getattr(t, VOCABULARY, None)  # a causal LM's logits: serial's width, the padding dropped
        return whole[..., :vocab] if vocab is not None and whole.shape[-1] > vocab else whole


def _map_named(obj: object, name: str, fn) -> object:
    """``_map``, ``fn(tensor, name)`` given each tensor's own name: the argument's, or its path inside
    it (``batch['w']``, ``xs[0]``), as ``io={name: kind}`` declares it and a refusal names it."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, name)
    if isinstance(obj, Mapping):
        return type(obj)({key: _map_named(value, f"{name}[{key!r}]", fn) for key, value in obj.items()})
    if isinstance(obj, (tuple, list)):
        items = [_map_named(value, f"{name}[{n}]", fn) for n, value in enumerate(obj)]
        return type(obj)(*items) if isinstance(obj, tuple) and hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _positional_names(module: nn.Module, count: int) -> list[str]:
    """The names of ``module.forward``'s first ``count`` positional parameters ("" past them, as for
    ``*args``): a positional argument is cut by its keyword's rule as well. A converted torch.nn stack
    (``*args``) names them as the serial class does (``serial_arguments``)."""
    serial = getattr(module, "serial_arguments", None)
    if serial is not None:
        return [serial[n] if n < len(serial) else "" for n in range(count)]
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in kinds]
    return [names[n] if n < len(names) else "" for n in range(count)]
