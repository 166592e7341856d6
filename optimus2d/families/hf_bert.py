"""Hugging Face BERT (``BertModel``, ``BertForMaskedLM``) on the mesh.

Every BERT container's forward was read and acts on the hidden dim element by element (residual
adds, activations, dropout) or on whole heads, once its ``nn.Linear``/``nn.LayerNorm``/
``nn.Embedding`` children are converted: the leaves' parents are declared with
``register_converter(cls, keep=True)`` (``_KEEP``), the others with a converter that keeps them
after checking, before anything changes, every head count and split size under them
(``refuse_unsplittable``: one error naming each module path). What is not automatic:

* ``BertSelfAttention`` reshapes its projections with ``view(..., -1, head_size)``: on the mesh its
  query/key/value blocks (output block j = heads block j) give the local heads. ``num_attention_heads``
  and ``all_head_size`` are set to the local ones (H/q; refused unless q divides H). Its attention
  dropout runs in ``shard_rng`` (each shard its own mask).
* ``BertEmbeddings`` holds index buffers (``position_ids``, ``token_type_ids``): whole on every
  rank, they index the sequence (whole) and the local batch; the three lookups are ``Embedding2D``s
  (a ``[1, s]`` position lookup broadcasts over the batch block).
* ``BertPooler`` takes ``hidden_states[:, 0]``: the sequence dim is whole, so the [CLS] row block.
* ``BertForMaskedLM``'s head: ``cls.predictions.decoder`` shares the word embeddings' table and
  its bias *is* ``cls.predictions.bias``; ``parallelize`` makes it a biased ``TiedHead2D`` and gives
  ``cls.predictions`` the same bias block (logits ``[b/(d·q), s, ⌈V/q⌉]``, padded columns −inf).
  ``labels=`` (``scatter_batch``-ed, −100 ignored) gives ``optimus2d.cross_entropy``'s loss.

Refused: cross-attention (``add_cross_attention``), heads or hidden sizes not divisible by q, an
activation given as a function (not a module). Shared with ``hf_seq2seq``: ``refuse_unsplittable``,
``in_shard_rng``, ``with_vocab_loss``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import weakref
from collections.abc import Callable

import torch
from torch import nn

from optimus2d.comm.mesh import Mesh
from optimus2d.comm.rng import shard_rng
from optimus2d.comm.sharding import Sharding
from optimus2d.convert.forward_reader import output_head
from optimus2d.convert.parallelizer import convert_children, register_converter
from optimus2d.layers.base import replace_by_block
from optimus2d.layers.embedding import TiedHead2D
from optimus2d.layers.linear import Linear2D
from optimus2d.layers.loss import cross_entropy

# Forwards read: element-wise on the hidden dim, or on whole heads, once the children are converted.
_KEEP = (
    "BertSelfOutput",  # dense → dropout → LayerNorm(x + residual)
    "BertOutput",  # dense → dropout → LayerNorm(x + residual)
    "BertPooler",  # hidden_states[:, 0] (the sequence is whole) → dense → tanh
    "BertOnlyMLMHead",  # predictions(x)
)
_CHECKED = (  # the same, kept after checking every size and head count under them (before any change)
    "BertEmbeddings",  # word + token-type + position lookups (index buffers whole), LayerNorm, dropout
    "BertAttention",  # self-attention, then BertSelfOutput
    "BertLayer",  # attention, feed-forward (apply_chunking_to_forward chunks the whole sequence dim)
    "BertEncoder",  # the layers in turn
    "BertModel",  # embeddings, attention masks from the local batch, encoder, pooler
)
_WITH_ACTIVATION = {  # dense → act (→ LayerNorm): kept if the activation is a module parallelize checks
    "BertIntermediate": "intermediate_act_fn",
    "BertPredictionHeadTransform": "transform_act_fn",
}


def _convert_children(module: nn.Module, mesh: Mesh) -> None:

    convert_children(module, mesh)


def refuse_unsplittable(
    root: nn.Module, mesh: Mesh, heads: dict[type, str], unsupported: Callable[[nn.Module], str | None]
) -> None:
    """Raise, before anything under ``root`` is converted, what its conversion would refuse: a head
    count (``heads``: class → attribute) or a split dim (Linear in/out, Embedding and LayerNorm
    width; a head tied to an embedding table needs no divisible vocabulary) that q does not divide,
    and modules for which ``unsupported(module)`` says why not. ``ValueError``/``TypeError`` names
    each module path, on every rank alike (the model is the same everywhere). Checked once, at the
    outermost module converted (it sees the embeddings that the heads under it share)."""
    if _checked_on.get(root) is mesh:
        return
    q, tables = mesh.q, {id(m.weight) for m in root.modules() if isinstance(m, nn.Embedding)}
    sizes, refused = [], []
    for path, m in root.named_modules():
        where = f"{path or 'the model itself'} ({type(m).__name__})"
        why = unsupported(m)
        if why:
            refused.append(f"{where}: {why}")
        dims = [(heads[type(m)], getattr(m, heads[type(m)]))] if type(m) in heads else []
        if isinstance(m, nn.Linear):
            dims = [("in_features", m.in_features)] + [("out_features", m.out_features)] * (id(m.weight) not in tables)
        elif isinstance(m, nn.Embedding):
            dims = [("embedding_dim", m.embedding_dim)]
        elif isinstance(m, nn.LayerNorm):
            dims = [("normalized_shape", m.normalized_shape[-1])]
        sizes += [f"{where}: {name}={n}" for name, n in dims if n % q]
    if refused:
        raise TypeError(f"parallelize: not supported on the mesh {mesh}:\n  " + "\n  ".join(refused))
    if sizes:
        raise ValueError(
            f"parallelize: these sizes are not divisible by q={q} ({mesh}); heads and the hidden dims are split "
            f"over the q columns:\n  " + "\n  ".join(sizes)
        )
    for m in root.modules():
        _checked_on[m] = mesh


_checked_on: weakref.WeakKeyDictionary[nn.Module, Mesh] = weakref.WeakKeyDictionary()


def in_shard_rng(module: nn.Module, mesh: Mesh, active: Callable[[nn.Module], bool]) -> None:
    """Run ``module``'s forward inside ``shard_rng`` while ``active(module)``: the functional dropouts
    of its forward (attention probabilities, ``F.dropout``) then draw a mask per shard, not the same
    mask on every rank."""
    if "_optimus2d_rng" in module.__dict__:
        return
    forward = module.forward

    @functools.wraps(forward)
    def sharded(*args, **kwargs):
        with shard_rng(mesh, enabled=active(module)):
            return forward(*args, **kwargs)

    module.forward, module._optimus2d_rng = sharded, mesh


def with_vocab_loss(
    model: nn.Module, mesh: Mesh, prepare: Callable[[inspect.BoundArguments, torch.Tensor], None] | None = None
) -> None:
    """``model(..., labels=...)`` on the mesh: the model runs without ``labels`` (``prepare(bound,
    labels)`` may first set inputs made from them, e.g. BART's decoder ids), then the loss is
    ``optimus2d.cross_entropy`` of the logits block ``[b/(d·q), s, ⌈V/q⌉]`` against the labels block
    ``[b/(d·q), s]`` (``scatter_batch``; −100 ignored, mean over the rest, as the serial model's
    ``CrossEntropyLoss``), put first in the output as the serial model does. The classes are the
    head's V: a label in the padded columns of a vocabulary q does not divide is refused (its loss
    was inf, where serial raises)."""
    if "_optimus2d_loss" in model.__dict__:
        return
    forward = model.forward
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def with_loss(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None:
            return forward(*args, **kwargs)
        bound.arguments["labels"] = None
        if prepare is not None:
            prepare(bound, labels)
        out = forward(*bound.args, **bound.kwargs)
        logits = out[0] if isinstance(out, tuple) else out.logits
        loss = cross_entropy(logits, labels.to(logits.device), mesh, num_classes=head_vocabulary(model))
        if isinstance(out, tuple):
            return (loss, *out)
        return type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})

    model.forward, model._optimus2d_loss = with_loss, mesh


def head_vocabulary(model: nn.Module) -> int | None:
    """The vocabulary V of ``model``'s converted output head, a ``Linear2D`` or ``TiedHead2D`` (its
    logits are ``⌈V/q⌉`` wide); None for another head."""
    head = output_head(model)
    if isinstance(head, Linear2D):
        return head.out_features
    return head.num_embeddings if isinstance(head, TiedHead2D) else None


def _unsupported(module: nn.Module) -> str | None:
    name = type(module).__name__
    if name == "BertCrossAttention":
        return "BERT cross-attention (add_cross_attention=True) is not supported"
    attr = _WITH_ACTIVATION.get(name)
    if attr is not None and not isinstance(getattr(module, attr), nn.Module):
        act = getattr(module, attr)
        return f"{attr} is {act!r}, not a module known to act element by element (give hidden_act by name)"
    return None


def _checked(module: nn.Module, mesh: Mesh) -> nn.Module:
    """A BERT container (read: see ``_KEEP``) kept, after checking everything under it converts."""
    bert = importlib.import_module("transformers.models.bert.modeling_bert")
    refuse_unsplittable(module, mesh, {bert.BertSelfAttention: "num_attention_heads"}, _unsupported)
    _convert_children(module, mesh)
    return module


def _self_attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    if "_optimus2d_rng" in attn.__dict__:  # converted already
        return attn
    _checked(attn, mesh)
    attn.num_attention_heads //= mesh.q  # forward views with -1 heads; these are for the record
    attn.all_head_size = attn.num_attention_heads * attn.attention_head_size
    in_shard_rng(attn, mesh, lambda m: m.training and m.dropout.p > 0)
    return attn


def _cross_attention(attn: nn.Module, mesh: Mesh) -> nn.Module:
    raise TypeError(f"parallelize: {_unsupported(attn)} (on {mesh})")


def _prediction_head(head: nn.Module, mesh: Mesh) -> nn.Module:
    """``BertLMPredictionHead``: transform → decoder. Its ``bias`` is the decoder's bias (tied: the
    same block, given by ``parallelize``); an untied one (``tie_word_embeddings=False``), which its
    forward never reads, becomes a vocabulary block too."""
    bias = head.bias
    _checked(head, mesh)
    if head.bias is head.decoder.bias or "bias" in getattr(head, "_optimus2d_shardings", {}):
        return head
    replace_by_block(head, "bias", Sharding((("row",),), tuple(bias.shape)), mesh)
    return head


def _masked_lm(model: nn.Module, mesh: Mesh) -> nn.Module:
    _checked(model, mesh)
    with_vocab_loss(model, mesh)
    return model


def register() -> None:
    """Register the BERT converters (needs ``transformers``)."""

    bert = importlib.import_module("transformers.models.bert.modeling_bert")
    for name in _KEEP:
        register_converter(getattr(bert, name), keep=True)
    for name in (*_CHECKED, *_WITH_ACTIVATION):
        register_converter(getattr(bert, name), _checked, converts_children=True)
    register_converter(bert.BertSelfAttention, _self_attention, converts_children=True)
    register_converter(bert.BertCrossAttention, _cross_attention)  # refused before any change, by _checked
    register_converter(bert.BertLMPredictionHead, _prediction_head, converts_children=True)
    register_converter(bert.BertForMaskedLM, _masked_lm, converts_children=True)
