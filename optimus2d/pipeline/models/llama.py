"""LLaMA-shaped causal LMs cut into pipeline stages, and their loss (``pipeline/stages.py`` runs them).

``llama_stages(lm, stages)`` cuts a Hugging Face LLaMA-shaped causal LM the way torchtitan's
``pipeline_module_split`` does: each stage is a deep copy that keeps only what it owns, under the
full model's names, so a stage's ``state_dict`` keys are the serial model's keys (the checkpoint
below needs nothing else). On 4 layers, 2 stages::

    stage 0: model.embed_tokens, model.layers.0, model.layers.1          ids [b, s] → hidden [b, s, h]
    stage 1: model.layers.2, model.layers.3, model.norm, lm_head      hidden [b, s, h] → logits [b, s, V]

(every stage also holds ``model.rotary_emb``, a table with no parameters). On a mesh a stage takes
this rank's block ``[b/(d·q), s]`` of the ids (``scatter_batch``) or ``[b/(d·q), s, h/q]`` of the
hidden states, and returns the same block of its output::

    pipe = optimus2d.pipeline.stage_meshes(2, q=2)
    chunk = optimus2d.parallelize(llama_stages(lm, 2)[pipe.stage], pipe.mesh)
    stage = pipeline_stage(chunk, pipe, microbatch_shape=..., token_ids=pipe.stage == 0)
    target, count = causal_lm_targets(ids, pipe.mesh)                 # the last stage's target block
    schedule = Schedule1F1B(stage, n, loss_fn=causal_lm_loss(pipe.mesh, count), scale_grads=False)

``causal_lm_loss``: each micro-batch's summed cross-entropy over the *global* target count, so the
micro-batch losses add up to Hugging Face's ``labels=`` loss of the whole batch (a mean over its
targets), whatever the micro-batches hold. With data-parallel copies (``stage_meshes(..., dp=2)``),
each copy passing its own share of the labels, the count is summed over the copies and each copy's
loss scaled by their number: the copies' averaged gradients are the serial model's on the whole batch.

A stage's checkpoint: ``optimus2d.checkpoint.save_stages``/``load_stages`` (``checkpoint/stages.py``).
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import scatter_batch
from optimus2d.comm.agreement import describe
from optimus2d.comm.mesh import Mesh
from optimus2d.context.attention import scatter_batch as context_scatter_batch
from optimus2d.context.hf import sequence_parallel
from optimus2d.context.parallel import ContextParallel
from optimus2d.convert.parallelizer import register_converter
from optimus2d.layers.loss import cross_entropy
from optimus2d.pipeline.agreement import copies_sum
from optimus2d.pipeline.data_parallel import copies_of
from optimus2d.pipeline.layouts import scatter_microbatches
from optimus2d.pipeline.stages import StageMesh

__all__ = ["LlamaStage", "causal_lm_loss", "causal_lm_targets", "decoder_layers", "llama_stages"]


class LlamaStage(nn.Module):
    """Layers ``model.layers.<first> .. <last>`` of a LLaMA-shaped causal LM, with the embedding on
    the first stage and the final norm and ``lm_head`` on the last (None elsewhere).

    forward: ids ``[b, s]`` (first stage) or hidden ``[b, s, h]`` → hidden ``[b, s, h]`` or logits
    ``[b, s, V]`` (last stage); on a mesh, the blocks ``[b/(d·q), s]``, ``[b/(d·q), s, h/q]``,
    ``[b/(d·q), s, V/q]``. Positions ``0 .. s-1`` and the causal mask, as the serial model makes
    them without an ``attention_mask`` (no padding, no cache).
    """

    def __init__(self, lm: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        body = lm.model
        self.config = lm.config
        self.model = nn.Module()  # a container: the serial names model.*, no forward of its own
        self.model.embed_tokens = body.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(n): body.layers[n] for n in layers})  # global indices kept
        self.model.norm = body.norm if last else None
        self.model.rotary_emb = body.rotary_emb
        self.lm_head = lm.lm_head if last else None
        self.context: ContextParallel | None = None  # pipeline_stage(..., context=): sequence blocks in and out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context is None:
            return self._forward(x, None)
        mesh = self.context.mesh  # a sequence block [b/q, s/c(, h/q)]: the positions are this rank's tokens'
        split, mask = self.context.split(x.shape[1] * mesh.depth)
        positions = split.positions[mesh.index("depth")].to(x.device).unsqueeze(0)
        with sequence_parallel(self, mesh, split, mask, attention=self.context.attention, memory=self.context.memory):
            return self._forward(x, positions)

    def _forward(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        hidden = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        hidden = decoder_layers(self.config, self.model.rotary_emb, self.model.layers.values(), hidden, positions)
        if self.model.norm is not None:
            hidden = self.model.norm(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        return hidden


def causal_mask(config, hidden: torch.Tensor, positions: torch.Tensor):
    """Hugging Face's causal mask for ``hidden`` at ``positions``, with no padding and no cache (the
    cache argument is ``past_key_values`` up to transformers 5.23, ``cache`` from 5.24; 5.25 takes both
    and warns when both are given)."""
    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    no_cache = {"cache" if "cache" in params else "past_key_values": None}
    return create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, position_ids=positions, **no_cache
    )


def decoder_layers(
    config, rotary_emb: nn.Module, layers, hidden: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """LLaMA-shaped decoder ``layers`` in turn on ``hidden`` ``[b, s, h]`` (a block ``[b/(d·q), s, h/q]``),
    at positions ``0 .. s-1`` under the causal mask, as the serial model runs them without an
    ``attention_mask`` (no padding, no cache). ``positions`` ``[1, s/c]`` (context parallelism: the
    attention kernel is ``context.attention``, which brings its own mask): the tokens' own."""
    if positions is not None:
        rotary = rotary_emb(hidden, position_ids=positions)
        for layer in layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return hidden
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = causal_mask(config, hidden, positions)
    rotary = rotary_emb(hidden, position_ids=positions)
    for layer in layers:
        hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
    return hidden


# Correct on blocks as it is: it calls its (grand)children in turn, and builds positions and the mask
# from the sequence length and the local batch, and the rotary table from the dtype (no hidden-dim work).
register_converter(LlamaStage, keep=True)


def llama_stages(lm: nn.Module, stages: int) -> list[LlamaStage]:
    """``lm`` (a serial ``LlamaForCausalLM``-shaped model, left unchanged) cut into ``stages``
    consecutive stages of equal numbers of decoder layers (each a deep copy: convert only yours)."""
    n = len(lm.model.layers)
    if not isinstance(stages, int) or stages < 1 or n % stages:
        raise ValueError(f"llama_stages: {n} decoder layers do not split into {stages!r} equal stages")
    if getattr(lm.config, "tie_word_embeddings", False) and stages > 1:
        raise ValueError(
            "llama_stages: the lm_head shares the embedding's weight (tie_word_embeddings); the first and last "
            "stages would each hold a copy that drifts apart"
        )
    window = getattr(lm.config, "sliding_window", None)
    kinds = set(getattr(lm.config, "layer_types", None) or ()) - {"full_attention"}
    if window is not None or kinds:  # the stages build LLaMA's causal mask, not a sliding window's
        raise ValueError(
            f"llama_stages: {type(lm).__name__} attends within a sliding window (sliding_window={window}, layer "
            f"types {sorted(kinds) or 'all full'}), and the stages build LLaMA's full causal mask: for sequences no "
            f"longer than the window the two agree (set config.sliding_window = None); else it is not supported"
        )
    per = n // stages
    out = []
    for s in range(stages):
        stage = LlamaStage(lm, range(s * per, (s + 1) * per), s == 0, s == stages - 1)
        out.append(copy.deepcopy(stage))
    return out


def causal_lm_targets(
    labels: torch.Tensor,
    mesh: Mesh | StageMesh,
    ignore_index: int = -100,
    *,
    context: ContextParallel | None = None,
    microbatches: int | None = None,
) -> tuple[torch.Tensor, int]:
    """(this rank's block ``[b/(d·q), s]`` of the next-token targets, the number of targets of the whole batch).

    ``labels``: the full ``[b, s]`` (``labels=`` of Hugging Face: usually the ids) of this copy of the
    pipeline, the same on every rank of ``mesh`` (the last stage's, or the pipeline, ``StageMesh``);
    target t of a row is its label t + 1 (the last is ``ignore_index``). The count is that of every
    micro-batch and, with data-parallel copies (``stage_meshes(..., dp=n)``, each fed its own share of
    the batch), of every copy: summed over ``pipe.dp_group`` in one all-gather of 6 words, after which
    the copies agree on the labels' dtype and shape (then collective over the copies: every copy's
    ranks call it at the same point; a disagreement is the same ``ValueError`` on each).
    ``context``: the stages' ``ContextParallel``: the block is the sequence block ``[b/q, s/c]`` of the
    shifted targets (``context.scatter_batch``), shifted in sequence order first. ``microbatches``: n,
    the block ``scatter_microbatches(targets, mesh, n)`` gives, whose micro-batch m is this rank's block
    of the serial ``targets.chunk(n)[m]`` (stages of different shapes, or on rank sets): refused
    without it on a pipeline ``stage_meshes`` built of different shapes (given it, or its mesh).
    """
    shapes = mesh.shapes if isinstance(mesh, StageMesh) else mesh.__dict__.get("_optimus2d_stage_shapes", ())
    mesh = mesh.mesh if isinstance(mesh, StageMesh) else mesh
    if len(set(shapes)) > 1 and microbatches is None and context is None:
        raise ValueError(
            f"causal_lm_targets: the stages have different shapes {list(shapes)}, so each boundary splits a "
            f"micro-batch as the serial chunk(n)[m]: give microbatches=n (the schedule's), or the targets pair "
            f"with other samples than the logits"
        )
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    copies, error, block = copies_of(mesh), None, None
    try:  # refused on every rank of this copy's mesh: on every copy's too (the others waited in the sum)
        if context is not None:
            block = context_scatter_batch(shifted.contiguous(), mesh, context.split(labels.shape[1])[0])
        elif microbatches is not None:
            block = scatter_microbatches(shifted.contiguous(), mesh, microbatches, layout="batch")
        else:
            block = scatter_batch(shifted.contiguous(), mesh)
    except (ValueError, TypeError) as err:
        if copies[0] == 1:
            raise
        error = err
    count = int((shifted != ignore_index).sum())
    if copies[0] > 1:
        described = f"labels {describe(labels)}, ignore_index={ignore_index}"
        count = copies_sum(mesh, copies, "causal_lm_targets", described, count, error)
    return block, count


def causal_lm_loss(mesh: Mesh | StageMesh, num_items: int, *, ignore_index: int = -100):
    """``loss_fn(logits_block, target_block)`` for a schedule (``scale_grads=False``): the micro-batch's
    summed cross-entropy ``/ num_items``, the same on every rank of ``mesh`` (or of the ``StageMesh``'s).

    ``num_items``: the number of targets of the whole batch, every micro-batch's and every copy's
    (``causal_lm_targets``'s count), so that the serial model's loss is the mean over all the batch's
    targets (Hugging Face's ``labels=`` loss), however unevenly the micro-batches and the copies hold
    them (padding). With data-parallel copies the loss is also multiplied by their number ``dp``, as
    ``DataParallelStage`` averages the copies' gradients: each copy's loss is ``dp`` times its part of
    the whole batch's, the mean of the copies' losses is the serial loss, every gradient the serial
    model's (with as many targets in every copy: each copy's mean over its own targets, as before).
    """
    mesh = mesh.mesh if isinstance(mesh, StageMesh) else mesh
    dp = copies_of(mesh)[0]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        summed = cross_entropy(logits, target, mesh, ignore_index=ignore_index, reduction="sum")
        return summed * dp / num_items if dp > 1 else summed / num_items

    return loss_fn


# ---- checkpoints ---------------------------------------------------------------------------------
