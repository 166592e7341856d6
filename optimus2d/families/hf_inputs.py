"""A converted Hugging Face model's inputs hold the same rows: this rank's block of the batch.

``model(input_ids=scatter_batch(ids, mesh), attention_mask=mask)``, the mask left whole, ran with no
error and gave wrong outputs: transformers' mask functions index the mask by the block's rows, so
every rank read rows 0..b/(d·q)−1 of the whole batch's mask (LLaMA's logits 0.09 off, BERT's hidden
states 3e-3). ``finish`` gives every ``PreTrainedModel`` in a converted model a forward pre-hook
that checks the inputs that have a batch dim against ``input_ids`` (or ``inputs_embeds``) before
anything runs: a ``ValueError`` naming both, their rows and the mesh, on every rank alike (the
ranks hold the same shapes; a rank whose shapes differ is refused by the first module's check).
``position_ids`` (Qwen2-VL's are ``[3, b, s]``) and ``labels`` (``hf_causal_lm`` checks them) are
not among them; a tensor of one row broadcasts, as in the serial model.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from optimus2d.comm.mesh import Mesh

# Inputs whose first dim is the batch's, checked against the first of _ROWS given.
_ROWS = ("input_ids", "inputs_embeds")
_BATCH = (
    "attention_mask",
    "token_type_ids",
    "decoder_input_ids",
    "decoder_inputs_embeds",
    "decoder_attention_mask",
    "encoder_attention_mask",
)
_MARK = "_optimus2d_rows_checked"


def finish(root: nn.Module, mesh: Mesh) -> None:
    """Check the rows of the inputs of every Hugging Face model in the converted ``root``."""
    from transformers import PreTrainedModel

    for module in root.modules():
        if isinstance(module, PreTrainedModel) and not module.__dict__.get(_MARK):
            module.register_forward_pre_hook(functools.partial(_check_rows, mesh=mesh), with_kwargs=True)
            module.__dict__[_MARK] = True


def _check_rows(model: nn.Module, args: tuple, kwargs: dict, *, mesh: Mesh) -> None:
    given = kwargs
    if args:  # positional inputs: input_ids first, as every model's forward takes them
        given = {**kwargs, "input_ids": args[0]}
    ref = next((name for name in _ROWS if isinstance(given.get(name), torch.Tensor)), None)
    if ref is None or given[ref].dim() == 0:
        return
    rows = given[ref].shape[0]
    for name in _BATCH:
        value = given.get(name)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] in (1, rows):
            continue
        whole = value.shape[0] == rows * mesh.depth * mesh.q and mesh.size > 1
        hint = (
            f": it looks like the whole batch's; pass optimus2d.scatter_batch({name}, mesh) as {ref} is"
            if whole
            else ""
        )
        raise ValueError(
            f"{type(model).__name__}: {name} {list(value.shape)} has {value.shape[0]} rows where {ref} "
            f"{list(given[ref].shape)} has {rows} (this rank's block of the batch on {mesh}){hint}"
        )
