"""Hugging Face habits on a converted causal LM: ``labels=``, ``generate()``, serial answers.

``finish(root, mesh)`` (called by ``parallelize`` once the model is converted) finds every
transformers causal LM in ``root`` — a decoder-only ``PreTrainedModel`` with ``GenerationMixin``, an
``lm_head`` and a ``loss_function`` — and installs on that instance:

* ``loss_function``: transformers' ``ForCausalLMLoss`` on blocks. ``model(input_ids=ids_local,
  labels=labels_local)`` with ``labels_local = scatter_batch(labels, mesh)`` ``[b/(d·q), s]`` and
  logits ``[b/(d·q), s, ⌈V/q⌉]``: labels shifted inside each sequence, ``ignore_index`` (−100)
  honoured, the mean over the non-ignored targets of the whole global batch (or their sum over
  ``num_items_in_batch``, the global count), the same scalar on every rank (``cross_entropy``).
* ``generate``: takes the *full* inputs, the same on every rank, and returns the serial model's
  tokens ``[b, s + new]`` on every rank. While it runs, the model's forward scatters its inputs
  (``input_ids``, ``attention_mask``, ``position_ids``, ``token_type_ids`` with ``scatter_batch``;
  ``inputs_embeds`` with ``scatter``; a batch that does not divide by d·q is padded with copies of
  its last row), runs on blocks (the KV cache holds ``[b/(d·q), heads/q, s, head_dim]``) and
  gathers the logits to ``[b, s, V]`` (vocabulary padding and padded rows dropped), so HF's
  logits processors, sampling and stopping see what they would see serially. Greedy search and
  sampling with a dynamic cache; other modes are refused.
* (``num_parameters``, ``save_pretrained`` and a refusing ``resize_token_embeddings``: ``hf_methods``,
  on every converted Hugging Face model.)

``Embedding2D.num_embeddings``/``embedding_dim`` and ``Linear2D.in_features``/``out_features`` are
the global sizes already; a parameter's ``.shape`` is its local block.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import gather, scatter, scatter_batch
from optimus2d.comm.mesh import Mesh
from optimus2d.convert.forward_reader import output_head
from optimus2d.convert.whole_io import VOCABULARY
from optimus2d.families.hf_bert import head_vocabulary
from optimus2d.layers.embedding import TiedHead2D
from optimus2d.layers.linear import Linear2D
from optimus2d.layers.loss import cross_entropy

_BATCH_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")  # [b, ...] → scatter_batch
_AS_IS_INPUTS = ("cache_position", "logits_to_keep")  # 1-D positions: the same for every row


def register() -> None:
    """No converters here (``hf.py`` has them); this file only finishes converted models."""


def finish(root: nn.Module, mesh: Mesh) -> None:
    """Install the mesh-aware loss and ``generate`` on every Hugging Face causal LM in the converted
    ``root`` (``hf_methods`` gives every converted model ``num_parameters`` and the rest)."""
    for module in root.modules():
        if _is_causal_lm(module):
            _install(module)


def _is_causal_lm(module: nn.Module) -> bool:
    from transformers import GenerationMixin, PreTrainedModel

    return (
        isinstance(module, PreTrainedModel)
        and isinstance(module, GenerationMixin)
        and isinstance(output_head(module), nn.Module)
        and hasattr(type(module), "loss_function")
        and not getattr(module.config, "is_encoder_decoder", False)  # decoder-only: no encoder inputs to split
    )


def _install(lm: nn.Module) -> None:
    from transformers.loss.loss_utils import LOSS_MAPPING

    current = lm.loss_function
    if getattr(current, "__func__", None) not in (_causal_lm_loss, _refused_loss):  # not installed already
        serial_is_causal = current is LOSS_MAPPING.get("ForCausalLM")
        lm.loss_function = types.MethodType(_causal_lm_loss if serial_is_causal else _refused_loss, lm)
    head = output_head(lm)
    if isinstance(head, (Linear2D, TiedHead2D)) and not getattr(lm, "_optimus2d_notes_vocabulary", False):
        lm.register_forward_hook(functools.partial(_note_vocabulary, _head(lm, "io='whole'")[1]))
        lm._optimus2d_notes_vocabulary = True
    for name, fn in (("generate", generate),):
        setattr(lm, name, types.MethodType(fn, lm))


def _head(lm: nn.Module, what: str) -> tuple[Mesh, int]:
    """(mesh, vocabulary V) of the converted ``lm_head``, whose logits are ``[b/(d·q), s, ⌈V/q⌉]``."""
    vocab = head_vocabulary(lm)
    if vocab is not None:
        return output_head(lm).mesh, vocab
    head = output_head(lm)
    raise TypeError(
        f"{what} on {type(lm).__name__}: its lm_head ({type(head).__name__}) is not a Linear2D or TiedHead2D, "
        f"so which vocabulary block its logits hold is not known"
    )


def _note_vocabulary(vocab: int, module: nn.Module, args: tuple, output: object) -> None:
    """Note the vocabulary V on the logits block this LM returns (its output's ``logits``, or the first
    tensor past the loss, a 0-d tensor, of its tuple): ``io="whole"`` gives them whole ``[b, s, V]``,
    serial's width, wherever they leave the model (``convert/whole_io.py``)."""
    if isinstance(output, Mapping):
        logits = output.get("logits")
    elif isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        logits = output[1 if output[0].dim() == 0 and len(output) > 1 else 0]
    else:
        return
    if isinstance(logits, torch.Tensor) and logits.dim() >= 2:
        setattr(logits, VOCABULARY, vocab)


# ---- labels= -------------------------------------------------------------------------------------
def _causal_lm_loss(
    self: nn.Module,
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of the full batch, from this rank's blocks.

    logits ``[b/(d·q), s, ⌈V/q⌉]`` (vocabulary block j); labels (or shift_labels) ``[b/(d·q), s]``
    (``scatter_batch``). Returns the global loss, the same fp32 scalar on every rank.
    """
    mesh, vocab = _head(self, "labels=")
    if vocab_size is not None and vocab_size != vocab:
        raise ValueError(
            f"labels= on {type(self).__name__}: vocab_size={vocab_size} (config) but its lm_head has {vocab} "
            f"classes ({mesh})"
        )
    if shift_labels is None:
        if labels is None:
            raise TypeError(f"labels= on {type(self).__name__}: neither labels nor shift_labels given")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # tokens < n predict n, per sequence
    if tuple(shift_labels.shape) != tuple(logits.shape[:-1]):
        full = tuple(shift_labels.shape[:1]) == (logits.shape[0] * mesh.depth * mesh.q,) and mesh.size > 1
        hint = "; it looks like the full labels: pass optimus2d.scatter_batch(labels, mesh)" if full else ""
        raise ValueError(
            f"labels= on {type(self).__name__}: labels of shape {tuple(shift_labels.shape)} must be this rank's "
            f"block {tuple(logits.shape[:-1])}, like input_ids, on {mesh}{hint}"
        )
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = cross_entropy(
        logits.float(),
        shift_labels.to(logits.device),
        mesh,
        ignore_index=ignore_index,
        reduction=reduction,
        num_classes=vocab,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch  # the global count of targets, as serial training would pass
    return loss


def _refused_loss(self: nn.Module, *args, **kwargs) -> torch.Tensor:
    raise TypeError(
        f"labels= on {type(self).__name__} converted by optimus2d.parallelize: its loss_function is not "
        f"transformers' ForCausalLMLoss, the one optimus2d computes on blocks; compute the loss from "
        f".logits (this rank's block) with optimus2d.cross_entropy"
    )


# ---- generate() ----------------------------------------------------------------------------------
def generate(self: nn.Module, *args, **kwargs):
    """``GenerationMixin.generate`` on full inputs (the same on every rank): the serial tokens on every rank."""
    if getattr(self, "_optimus2d_generating", False):  # nested (token healing): the hooks are in place
        return type(self).generate(self, *args, **kwargs)
    mesh, _ = _head(self, "generate")
    _check_generation(self, mesh, args, kwargs)
    handles = [
        self.register_forward_pre_hook(_scatter_inputs, with_kwargs=True, prepend=True),
        self.register_forward_hook(_gather_outputs, prepend=True),
    ]
    self._optimus2d_generating = True
    whole_io = self.__dict__.get("_optimus2d_whole_io")  # parallelize(io="whole"): these hooks cut and gather
    if whole_io is not None:
        whole_io.paused = True
    try:
        return type(self).generate(self, *args, **kwargs)
    finally:
        self._optimus2d_generating = False
        if whole_io is not None:
            whole_io.paused = False
        for handle in handles:
            handle.remove()


def _check_generation(lm: nn.Module, mesh: Mesh, args: tuple, kwargs: dict) -> None:
    """Refuse, on every rank alike (the arguments are the same everywhere), what is not supported."""
    from transformers.generation.configuration_utils import GenerationMode

    bound = inspect.signature(type(lm).generate).bind(lm, *args, **kwargs).arguments
    extra = dict(bound.pop("kwargs", {}))
    where = f"generate on {type(lm).__name__} converted by optimus2d.parallelize ({mesh})"
    if bound.get("custom_generate") is not None or bound.get("assistant_model") is not None:
        raise ValueError(f"{where}: custom_generate and assistant_model are not supported")
    for name in ("tokenizer", "assistant_tokenizer"):
        extra.pop(name, None)
    config, _ = lm._prepare_generation_config(bound.get("generation_config"), **extra)
    mode = config.get_generation_mode(None)
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            f"{where}: {mode.value} is not supported, only greedy search and sampling (num_beams=1, no "
            f"assistant): the KV cache holds this rank's block of the batch, which beams would reorder across ranks"
        )
    if config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"{where}: cache_implementation={config.cache_implementation!r} is not supported; the dynamic "
            f"cache holds this rank's blocks [b/(d·q), heads/q, s, head_dim]"
        )
    if config.output_attentions:
        raise ValueError(f"{where}: output_attentions is not supported (the attention weights stay blocks)")
    embeds = extra.get("inputs_embeds")
    if embeds is not None and embeds.shape[-1] % mesh.q:
        raise ValueError(f"{where}: inputs_embeds {tuple(embeds.shape)}: hidden dim not divisible by q={mesh.q}")


def _scatter_inputs(lm: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook while generating: full inputs [b, ...] → this rank's blocks [b/(d·q), ...]."""
    mesh, _ = _head(lm, "generate")
    if args:  # a logits processor calling the model itself (classifier-free guidance: model(input_ids, ...))
        kwargs = _named(lm, args, kwargs)
    from transformers.cache_utils import Cache

    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5.24+ names it cache
    if isinstance(cache, Cache) and cache.is_compileable:
        raise ValueError(
            f"generate on {type(lm).__name__}: {type(cache).__name__} is not supported on {mesh}; its buffers "
            f"are sized for the full batch and heads, a rank holds [b/(d·q), heads/q, s, head_dim]"
        )
    first = kwargs.get("input_ids")
    first = first if first is not None else kwargs.get("inputs_embeds")
    rows = first.shape[0]
    pad = -rows % (mesh.depth * mesh.q)  # rows added (copies of the last) so the batch divides by d·q
    out = dict(kwargs)
    for key, value in kwargs.items():
        if not isinstance(value, torch.Tensor) or key in _AS_IS_INPUTS:
            continue
        if key not in (*_BATCH_INPUTS, "inputs_embeds"):
            raise ValueError(
                f"generate on {type(lm).__name__}: the forward input {key} {tuple(value.shape)} is not one optimus2d "
                f"knows how to split ({', '.join((*_BATCH_INPUTS, 'inputs_embeds'))}) on {mesh}"
            )
        if value.shape[0] != rows:
            if value.shape[0] != 1:
                raise ValueError(
                    f"generate on {type(lm).__name__}: {key} {tuple(value.shape)} does not have the batch's {rows} rows"
                )
            value = value.expand(rows, *value.shape[1:])
        if pad:
            value = torch.cat([value, value[-1:].expand(pad, *value.shape[1:])])
        out[key] = scatter(value, mesh) if key == "inputs_embeds" else scatter_batch(value.contiguous(), mesh)
    lm._optimus2d_rows = rows
    return (), out


def _named(lm: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The forward's positional inputs under their names (its signature's), with the keywords."""
    try:
        bound = inspect.signature(lm.forward).bind_partial(*args)
    except TypeError as err:
        raise TypeError(
            f"generate on {type(lm).__name__}: the forward's positional inputs do not bind: {err}"
        ) from None
    named = {}
    for name, value in bound.arguments.items():
        if bound.signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL or name in kwargs:
            raise TypeError(
                f"generate on {type(lm).__name__}: the forward got {len(args)} positional inputs that do not name "
                f"its parameters ({name}); pass them by keyword"
            )
        named[name] = value
    return {**named, **kwargs}


def _gather_outputs(lm: nn.Module, args: tuple, output):
    """Forward hook while generating: logits [b/(d·q), s, ⌈V/q⌉] → [b, s, V] on every rank (and the
    hidden states, if asked for, [b/(d·q), s, h/q] → [b, s, h])."""
    mesh, vocab = _head(lm, "generate")
    rows = lm._optimus2d_rows
    output.logits = gather(output.logits.contiguous(), mesh)[:rows, ..., :vocab]
    hidden = getattr(output, "hidden_states", None)
    if hidden is not None:
        # blocks, though untagged where plain torch made them (rows alike on a depth mesh: not refused)
        output.hidden_states = tuple(gather(h.contiguous(), mesh, check=False)[:rows] for h in hidden)
    return output
