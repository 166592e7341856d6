"""Hugging Face GPT-2 (``GPT2LMHeadModel``) cut into pipeline stages, its tied embedding kept as Megatron does.

``gpt2_stages(lm, stages)`` cuts like ``pipeline.models.llama.llama_stages``: each stage is a deep copy that
keeps only what it owns, under the full model's names (its ``state_dict`` keys are the serial keys, so
``save_stages``/``load_stages`` need nothing else). On 4 blocks, 2 stages::

    stage 0: transformer.wte, transformer.wpe, transformer.drop, transformer.h.0, transformer.h.1
             ids [b, s] → hidden [b, s, h]
    stage 1: transformer.h.2, transformer.h.3, transformer.ln_f, lm_head
             hidden [b, s, h] → logits [b, s, V]

On a mesh a stage takes this rank's block ``[b/(d·q), s]`` of the ids (``scatter_batch``) or
``[b/(d·q), s, h/q]`` of the hidden states and returns the same block of its output (the logits
``[b/(d·q), s, ⌈V/q⌉]`` of a tied head: give ``pipeline_stage`` ``output_shape=(b/n, s, q·⌈V/q⌉)``).
Loss and targets: ``pipeline.models.llama.causal_lm_loss`` and ``causal_lm_targets``.

Tied embeddings (GPT-2's default: ``lm_head.weight`` *is* ``transformer.wte.weight``): the first and
the last stage each hold a copy, ``transformer.wte.weight`` and ``lm_head.weight``, both laid out as
``Embedding2D``'s table (rows: vocabulary block i, columns: hidden block j, replicated over depth), so
the ranks at the same mesh position of the two stage meshes (a *tied pair*, part of a lane) hold the
same block. Serial backward sums the gradients of the embedding and of the head into the one table;
here each copy gets one of the two, and ``sum_tied_grads`` adds them over the pair, so both copies
hold the serial gradient, take the same optimizer step and stay equal (Megatron's embedding group)::

    pair = tied_pair(pipe)                                  # collective over the world, once
    schedule.step(...)
    sum_tied_grads(chunks, pair)                            # after backward, before the step
    optimizer.step()
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from optimus2d.comm import compat
from optimus2d.comm import primitives as P
from optimus2d.comm.mesh import Mesh
from optimus2d.convert.parallelizer import keep, register_converter
from optimus2d.layers import Embedding2D
from optimus2d.layers.base import mark_block
from optimus2d.layers.embedding import TiedHead2D
from optimus2d.pipeline.models.llama import causal_mask
from optimus2d.pipeline.stages import StageMesh

__all__ = ["GPT2Stage", "TiedPair", "gpt2_stages", "shared_copies", "sum_tied_grads", "tied_pair"]


class GPT2Stage(nn.Module):
    """Blocks ``transformer.h.<first> .. <last>`` of a GPT-2, with the token and position embeddings
    (and the embedding dropout) on the first stage and the final norm and ``lm_head`` on the last
    (None elsewhere). ``tied``: ``lm_head.weight`` is the table of ``transformer.wte`` in the serial
    model; a stage holding only one of them holds a copy (``tied_copies``).

    forward: ids ``[b, s]`` (first stage) or hidden ``[b, s, h]`` → hidden ``[b, s, h]`` or logits
    ``[b, s, V]`` (last stage); on a mesh the blocks ``[b/(d·q), s]``, ``[b/(d·q), s, h/q]``,
    ``[b/(d·q), s, V/q]`` (``⌈V/q⌉`` for a tied head). Positions ``0 .. s-1`` and the causal mask, as
    ``GPT2Model`` makes them without an ``attention_mask`` (no padding, no cache, no token types).
    """

    def __init__(self, lm: nn.Module, blocks: range, first: bool, last: bool, tied: bool) -> None:
        super().__init__()
        body = lm.transformer
        self.config = lm.config
        self.tied = tied
        self.transformer = nn.Module()  # a container: the serial names transformer.*, no forward of its own
        self.transformer.wte = body.wte if first else None
        self.transformer.wpe = body.wpe if first else None
        self.transformer.drop = body.drop if first else None
        self.transformer.h = nn.ModuleDict({str(n): body.h[n] for n in blocks})  # global indices kept
        self.transformer.ln_f = body.ln_f if last else None
        self.lm_head = lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # [1, s]
        hidden = x
        if t.wte is not None:  # as GPT2Model: token + position embeddings, then dropout
            hidden = t.drop(t.wte(x) + t.wpe(positions))
        mask = causal_mask(self.config, hidden, positions)
        for block in t.h.values():
            hidden = block(hidden, attention_mask=mask, position_ids=positions)
        if t.ln_f is not None:
            hidden = t.ln_f(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        return hidden

    def tied_copies(self) -> list[nn.Parameter]:
        """This stage's copies of the tied table: ``transformer.wte.weight``, ``lm_head.weight`` (one
        Parameter when the stage holds both: nothing to sum), or none when the model is not tied."""
        if not self.tied:
            return []
        found = [m.weight for m in (self.transformer.wte, self.lm_head) if m is not None]
        return list({id(p): p for p in found}.values())


def _convert_stage(stage: GPT2Stage, mesh: Mesh) -> GPT2Stage:
    """The stage on ``mesh``. Its forward is correct on blocks as it is (``keep``): it calls its
    (grand)children in turn, adds the position embedding ``[1, s, h/q]`` (``Embedding2D`` of the
    positions, broadcast over the local batch) element-wise to the token embedding's block, and builds
    positions and the mask from the sequence length, the local batch and the dtype (no hidden-dim work);
    the blocks convert as in the whole model (``families/hf.py``: ``GPT2Block`` kept, ``GPT2Attention``
    split per head). One change: a tied head without its embedding (the last stage) becomes a
    ``TiedHead2D`` on a table of ``Embedding2D``'s layout, not a ``Linear2D``, so that it holds the same
    block as the first stage's embedding at the same mesh position, padded vocabulary included."""
    if stage.tied and stage.lm_head is not None and stage.transformer.wte is None:
        head = stage.lm_head
        serial = nn.Embedding.from_pretrained(head.weight.detach(), freeze=not head.weight.requires_grad)
        table = Embedding2D.from_serial(serial, mesh)
        stage.lm_head = TiedHead2D(table)  # the table's Parameter: the head owns it, the table is dropped
        mark_block(stage.lm_head.weight, stage.lm_head, "weight", mesh)
    return keep(stage, mesh)


register_converter(GPT2Stage, _convert_stage, converts_children=True)


def gpt2_stages(lm: nn.Module, stages: int) -> list[GPT2Stage]:
    """``lm`` (a serial ``GPT2LMHeadModel``, left unchanged) cut into ``stages`` consecutive stages of
    equal numbers of blocks (each a deep copy: convert only yours). A tied head (``lm_head.weight is
    transformer.wte.weight``) leaves a copy of the table on the first and on the last stage: sum their
    gradients with ``sum_tied_grads`` before each optimizer step."""
    n = len(lm.transformer.h)
    if not isinstance(stages, int) or stages < 1 or n % stages:
        raise ValueError(f"gpt2_stages: {n} blocks do not split into {stages!r} equal stages")
    if getattr(lm.config, "add_cross_attention", False):
        raise ValueError("gpt2_stages: cross-attention (add_cross_attention) needs encoder states no stage carries")
    tied = lm.lm_head.weight is lm.transformer.wte.weight
    per = n // stages
    out = []
    for s in range(stages):
        stage = GPT2Stage(lm, range(s * per, (s + 1) * per), s == 0, s == stages - 1, tied)
        out.append(copy.deepcopy(stage))
    return out


@dataclass(frozen=True)
class TiedPair:
    """This rank's share in keeping a tied table's copies equal.

    ``ranks``: the global ranks of this rank's lane on the stage mesh of the first chunk (stage mesh
    0) and on that of the last (one rank when the same stage mesh runs both); ``group``: their process
    group, None when they are one rank or when this rank is on neither stage mesh (it holds no copy).
    """

    mesh: Mesh
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None


def tied_pair(pipe: StageMesh, *, last: int | None = None) -> TiedPair:
    """The tied pairs of ``pipe``: the ranks at the same mesh position of stage mesh 0 (the first chunk,
    the embedding) and of stage mesh ``last`` (the last chunk, the head: ``pipe.stages - 1`` by default,
    as for GPipe, 1F1B and Interleaved1F1B; 0 for the V-shaped ZBVZeroBubble and DualPipeV).

    Collective over the world: creates one group per mesh position, on every rank, in the same order
    (``dist.new_group``); call it once, at the same point on every rank.
    """
    last = pipe.stages - 1 if last is None else last
    if not isinstance(last, int) or not 0 <= last < pipe.stages:
        raise ValueError(f"tied_pair: last={last!r} is not a stage mesh of a pipeline of {pipe.stages}")
    mesh = pipe.mesh
    position = mesh.ranks.index(mesh.rank)
    ranks = tuple(dict.fromkeys((pipe.stage_ranks(0)[position], pipe.stage_ranks(last)[position])))
    group = None
    if last != 0:
        for r in range(pipe.dp):  # every pair of every data-parallel copy on every rank: creating a group is collective
            for n in range(mesh.size):
                made = compat.new_group([pipe.stage_ranks(0, r)[n], pipe.stage_ranks(last, r)[n]])
                if (r, n) == (pipe.dp_rank, position) and pipe.stage in (0, last):
                    group = made
    return TiedPair(mesh, ranks, group)


def sum_tied_grads(chunks: nn.Module | Sequence[nn.Module], pair: TiedPair) -> None:
    """After backward, before the optimizer step: the gradient of each copy of the tied table in this
    rank's ``chunks`` (``GPT2Stage``s, converted or wrapped) becomes the sum of every copy's, here and
    on the other rank of ``pair``: the serial gradient, in which the embedding's and the head's uses add.

    Sends one all-reduce of the table's block ``[⌈V/q⌉, h/q]`` (of ``[V, h]``) over ``pair.group``, on
    the ranks holding a copy of a stage mesh that does not hold both; nothing elsewhere. A copy with no
    gradient counts as zeros; a frozen table (``requires_grad=False``) is left alone.
    """
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    stages = [m for c in chunks for m in c.modules() if isinstance(m, GPT2Stage)]
    copies = list({id(p): p for s in stages for p in s.tied_copies() if p.requires_grad}.values())
    if not copies:
        return
    both = any(s.transformer.wte is not None for s in stages) and any(s.lm_head is not None for s in stages)
    if both != (len(pair.ranks) == 1):  # refused here, alone: the partner holds no copy and returns
        how = "tied_pair(pipe, last=0)" if both else "tied_pair(pipe) naming the stage mesh of the last chunk"
        raise ValueError(
            f"sum_tied_grads: rank {pair.mesh.rank} holds {'both copies' if both else 'one copy'} of the tied table, "
            f"but its pair is {list(pair.ranks)}: build the pair with {how} (a V-shaped schedule runs the first "
            f"and last chunks on stage mesh 0)"
        )
    if pair.mesh.rank not in pair.ranks or (len(pair.ranks) > 1 and pair.group is None):
        raise ValueError(
            f"sum_tied_grads: rank {pair.mesh.rank} holds a copy of the tied table but is not in its pair "
            f"{list(pair.ranks)} (tied_pair(last=...) names another stage mesh than the one running the last chunk)"
        )
    total = torch.zeros_like(copies[0])
    for p in copies:
        if p.grad is not None:
            total += p.grad
    P.all_reduce_group(total, pair.mesh, pair.group, "tied")
    for p in copies:
        if p.grad is None:
            p.grad = total.clone()
        else:
            p.grad.copy_(total)


def shared_copies(chunks: nn.Module | Sequence[nn.Module]) -> dict[nn.Parameter, int]:
    """The tied table's copies in this rank's ``chunks``, each with the number of copies the pipeline
    holds (2: one on the first stage, one on the last), for ``optimus2d.clip_grad_norm_(copies=)``; a
    stage holding both the embedding and the head holds one Parameter, counted once as it is."""
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    stages = [m for c in chunks for m in c.modules() if isinstance(m, GPT2Stage)]
    return {p: 2 for s in stages if (s.transformer.wte is None) != (s.lm_head is None) for p in s.tied_copies()}
