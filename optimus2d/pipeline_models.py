"""Models cut into pipeline stages, and their loss and checkpoints (``optimus2d/pipeline.py`` runs them).

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
targets), whatever the micro-batches hold.

``save_stages``/``load_stages``: ``optimus2d.checkpoint``'s format, written by every stage at once
(one checkpoint of the whole model: it loads with ``optimus2d.checkpoint.load`` into the whole
model on any one mesh, or ``read`` in one process) and read into each stage (from any checkpoint of
the whole model). ``optimus2d.checkpoint.save`` itself cannot: it takes the stage meshes for
data-parallel replicas, which hold the same blocks, and writes only stage 0's.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from optimus2d import checkpoint as _ckpt
from optimus2d import checkpoint_files as _files
from optimus2d.comm import scatter_batch
from optimus2d.comm.mesh import Mesh
from optimus2d.layers.loss import cross_entropy
from optimus2d.parallelize import register_converter

__all__ = [
    "LlamaStage", "causal_lm_loss", "causal_lm_targets", "decoder_layers", "llama_stages", "load_stages", "save_stages"
]  # fmt: skip


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        hidden = decoder_layers(self.config, self.model.rotary_emb, self.model.layers.values(), hidden)
        if self.model.norm is not None:
            hidden = self.model.norm(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        return hidden


def causal_mask(config, hidden: torch.Tensor, positions: torch.Tensor):
    """Hugging Face's causal mask for ``hidden`` at ``positions``, with no padding and no cache (the
    cache argument is ``past_key_values`` up to transformers 5.23, ``cache`` from 5.24)."""
    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    no_cache = {name: None for name in ("cache", "past_key_values") if name in params}
    return create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, position_ids=positions, **no_cache
    )


def decoder_layers(config, rotary_emb: nn.Module, layers, hidden: torch.Tensor) -> torch.Tensor:
    """LLaMA-shaped decoder ``layers`` in turn on ``hidden`` ``[b, s, h]`` (a block ``[b/(d·q), s, h/q]``),
    at positions ``0 .. s-1`` under the causal mask, as the serial model runs them without an
    ``attention_mask`` (no padding, no cache)."""
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
    per = n // stages
    out = []
    for s in range(stages):
        stage = LlamaStage(lm, range(s * per, (s + 1) * per), s == 0, s == stages - 1)
        out.append(copy.deepcopy(stage))
    return out


def causal_lm_targets(labels: torch.Tensor, mesh: Mesh, ignore_index: int = -100) -> tuple[torch.Tensor, int]:
    """(this rank's block ``[b/(d·q), s]`` of the next-token targets, the global number of targets).

    ``labels``: the full ``[b, s]`` (``labels=`` of Hugging Face: usually the ids), the same on every
    rank; target t of a row is its label t + 1 (the last is ``ignore_index``)."""
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return scatter_batch(shifted.contiguous(), mesh), int((shifted != ignore_index).sum())


def causal_lm_loss(mesh: Mesh, num_items: int, *, ignore_index: int = -100):
    """``loss_fn(logits_block, target_block)`` for a schedule (``scale_grads=False``): the
    micro-batch's summed cross-entropy ``/ num_items``, the same on every rank of ``mesh``."""

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, mesh, ignore_index=ignore_index, reduction="sum") / num_items

    return loss_fn


# ---- checkpoints ---------------------------------------------------------------------------------
def _state(chunks: list[nn.Module], optimizer) -> tuple[dict, dict, list]:
    """(DCP state of this rank's chunks, their meta, their entries), as ``optimus2d.checkpoint.save``."""
    entries = [e for c in chunks for e in _ckpt._entries(_ckpt._unwrap(c))]
    mesh = _ckpt._model_mesh(entries)
    device_mesh = _ckpt._device_mesh(mesh)
    state: dict[str, object] = {}
    for e in entries:
        views = _ckpt._stored_views(e.tensor.detach(), e.sharding, e.mesh, device_mesh)
        for suffix, view in zip(_ckpt._suffixes(e.sharding), views, strict=True):
            state[f"model/{e.key}{suffix}"] = view
    if optimizer is not None:
        for key, (value, entry) in _ckpt._optimizer_tensors(optimizer, entries).items():
            sharding = entry.sharding if entry is not None else None
            views = _ckpt._stored_views(value.detach(), sharding, entry.mesh if entry else None, device_mesh)
            for suffix, view in zip(_ckpt._suffixes(sharding), views, strict=True):
                state[f"{key}{suffix}"] = view
    meta = _ckpt._meta(optimizer, entries)
    meta["parts_dim"] = {k.partition("#")[0]: dim for k, dim in _ckpt._parts_dims(entries, state).items()}
    return state, meta, entries


def _merged_meta(metas: list[dict]) -> dict:
    """One meta from every rank's: the stages' parameter groups joined group by group."""
    meta = copy.deepcopy(metas[0])
    kinds = {m["optimizer"] for m in metas}
    if len(kinds) > 1:
        raise ValueError(f"save_stages: the stages hold different optimizers: {sorted(map(str, kinds))}")
    for m in metas[1:]:
        meta["parts_dim"].update(m["parts_dim"])
        meta["aliases"].update(m["aliases"])
        for group, other in zip(meta["param_groups"], m["param_groups"], strict=True):
            group["params"] += [p for p in other["params"] if p not in group["params"]]
    return meta


def save_stages(path: str | os.PathLike, chunks: nn.Module | list[nn.Module], optimizer=None, *, pipe=None) -> None:
    """Write every stage's ``chunks`` (this rank's, converted on its stage mesh; a list for several
    stages per rank) and ``optimizer`` as ONE checkpoint of the whole model, in ``optimus2d.checkpoint``'s
    format: it loads with ``optimus2d.checkpoint.load`` into the whole model on any mesh (or ``read``).

    Collective over the world: every rank of every stage calls it. The stages' keys must be disjoint
    (``llama_stages`` keeps the serial names); their optimizers of one class, with the same groups.
    Data-parallel copies (``stage_meshes(dp=)``): pass ``pipe``, this rank's ``StageMesh``; the copies
    of a stage must hold the same keys, and copy 0 writes them. Without it, every stage mesh is a stage.
    """
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    state, meta, entries = _state(chunks, optimizer)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = _ckpt._model_mesh(entries)
    where = mesh.ranks[0] if mesh is not None else (dist.get_rank() if world > 1 else 0)  # the stage mesh
    mine = (meta, where if pipe is None else pipe.stage, sorted(k for k in state if k.startswith("model/")))
    metas = [mine]
    if world > 1:
        metas = [None] * world
        dist.all_gather_object(metas, mine)
    by_stage: dict[object, set[tuple[str, ...]]] = {}  # a stage's data-parallel copies share its id
    for _, stage, keys in metas:
        by_stage.setdefault(stage, set()).add(tuple(keys))
    differ = [stage for stage, held in by_stage.items() if len(held) > 1]
    if differ:  # on every rank alike, before anything is written
        raise ValueError(f"save_stages: the data-parallel copies of stage {differ[0]} hold different tensors")
    holders: dict[str, set[object]] = {}
    for stage, (keys,) in by_stage.items():
        for k in keys:
            holders.setdefault(k, set()).add(stage)
    shared = sorted(k for k, h in holders.items() if len(h) > 1)
    if shared:
        copies = "" if pipe is not None else "; data-parallel copies: pass pipe="
        held = f"{shared[:5]} are held by more than one stage mesh"
        raise ValueError(f"save_stages: {held} (they would overwrite{copies})")
    if pipe is not None and pipe.dp_rank != 0:  # copy 0 of this stage writes these blocks
        state = {}
    state["meta"] = torch.tensor(list(json.dumps(_merged_meta([m for m, _, _ in metas])).encode()), dtype=torch.uint8)
    no_dist = world == 1

    def write(directory: str) -> int:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.save(state, checkpoint_id=directory, process_group=None, no_dist=no_dist)
        return 0 if no_dist else dist.get_rank()

    _files.save_atomically(path, write, None, no_dist)


def load_stages(path: str | os.PathLike, chunks: nn.Module | list[nn.Module], optimizer=None) -> None:
    """Read a checkpoint of the whole model (``save_stages``, or ``optimus2d.checkpoint.save`` on any
    one mesh) into this rank's stage ``chunks`` (and ``optimizer``): each stage reads its own keys.

    Collective over the world. Raises ``ValueError`` on every rank, before anything changes, if a
    stage's key is missing from the checkpoint or has another shape, or if the stages together do not
    hold every key of the checkpoint.
    """
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    entries = [e for c in chunks for e in _ckpt._entries(_ckpt._unwrap(c))]
    mesh = _ckpt._model_mesh(entries)
    group, no_dist = _ckpt._process_group(mesh)
    path = _files.verified(path, group, no_dist, True)
    metadata = _ckpt._read_metadata(path)
    meta = _ckpt._read_meta(path, metadata)
    device_mesh = _ckpt._device_mesh(mesh)
    targets, expected = [], {}
    for e in entries:
        for suffix, part in zip(_ckpt._suffixes(e.sharding), _ckpt._parts(e.sharding), strict=True):
            expected[f"model/{e.key}{suffix}"] = part.full_shape if part is not None else tuple(e.tensor.shape)
        targets.append((e.tensor, torch.zeros_like(e.tensor), e.sharding, e.mesh))
    optim_targets, problem = [], None
    stored = {k for k in metadata if k.startswith("model/")}
    mine = {k for k in expected if k.startswith("model/")}
    try:  # this stage's keys and shapes; the verdicts are shared below, so every rank raises alike
        if optimizer is not None:
            if meta["optimizer"] != type(optimizer).__name__:
                raise ValueError(
                    f"load_stages: {os.fspath(path)!r} holds {meta['optimizer']} state, not {type(optimizer).__name__}"
                )
            optim_targets = _ckpt._optimizer_targets(optimizer, entries, metadata, expected, meta.get("aliases"))
        _ckpt._check_fits(
            path, {k: v for k, v in metadata.items() if k in mine or not k.startswith("model/")}, expected
        )
    except ValueError as err:
        problem = str(err)
    everyone = [(mine, problem)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, problem))
    for _, theirs in everyone:
        if theirs is not None:
            raise ValueError(theirs)
    missing = sorted(stored - set().union(*(keys for keys, _ in everyone)))
    if missing:
        raise ValueError(f"load_stages: no stage holds {missing[:5]} of {os.fspath(path)!r}")
    state, views = {}, []
    for e, (_, buffer, sharding, m) in zip(entries, targets, strict=True):
        vs = _ckpt._stored_views(buffer, sharding, m, device_mesh)
        for suffix, v in zip(_ckpt._suffixes(sharding), vs, strict=True):
            state[f"model/{e.key}{suffix}"] = v
        views.append((buffer, vs, sharding, m))
    for key, buffer, sharding, m, _ in optim_targets:
        vs = _ckpt._stored_views(buffer, sharding, m, device_mesh)
        for suffix, v in zip(_ckpt._suffixes(sharding), vs, strict=True):
            state[f"{key}{suffix}"] = v
        views.append((buffer, vs, sharding, m))
    _ckpt._dcp_load(state, path, group, no_dist)
    for buffer, vs, sharding, m in views:
        _ckpt._write_back(buffer, vs, sharding, m)
    with torch.no_grad():
        for tensor, buffer, _, _ in targets:
            tensor.copy_(buffer)
    if optimizer is not None:
        _ckpt._install_optimizer_state(optimizer, optim_targets, meta)
