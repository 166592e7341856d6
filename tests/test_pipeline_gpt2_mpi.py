"""A Hugging Face GPT-2 cut into pipeline stages (``optimus2d.pipeline_gpt2``): loss, every gradient and
one AdamW step equal the serial ``GPT2LMHeadModel``'s ``labels=`` training step, its tied table included
(the first and the last stage hold copies whose gradients ``sum_tied_grads`` adds: they stay equal); its
checkpoint loads on one mesh, and one mesh's checkpoint into the stages. 2 stages of 2×2 on 8 ranks, of
1×1×2 on 4, of one rank on 2; with 2 data-parallel copies, of 1×1×2 on 8 and of one rank on 4; float32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import (
    as_serial,
    assert_chunks_match,
    assert_close,
    causal_lm_schedule_step,
    check_stage_checkpoints,
    optim_state,
    stage_pipe,
)

import optimus2d
from optimus2d.pipeline.models.gpt2 import TiedPair, gpt2_stages, shared_copies, sum_tied_grads, tied_pair

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

SHAPES = {2: (1, 1), 4: (1, 2), 8: (2, 1)}  # world → (q, depth) of each of the 2 stage meshes
DP_SHAPES = {4: (1, 1), 8: (1, 2)}  # the same, for 2 data-parallel copies of the pipeline
B, S, H, N = 8, 5, 48, 4  # batch, sequence, hidden, micro-batches
TOL, ADAM_TOL = 1e-5, 1e-5  # float32, relative to each tensor's largest element
SCHEDULES = optimus2d.pipeline.SCHEDULES
# every looped schedule with and without tying; a V-shaped one, whose first stage mesh runs both ends (summed here)
CASES = [(name, tied) for name in ("GPipe", "1F1B", "Interleaved1F1B") for tied in (True, False)]
CASES.append(("ZBVZeroBubble", True))
TIED = ("transformer.wte.weight", "lm_head.weight")
_pipes: dict = {}


def _pipe(world, dp: int = 1):
    """(this rank's StageMesh, its TiedPair by the stage mesh of the last chunk), built once per world size."""
    shapes = SHAPES if dp == 1 else DP_SHAPES
    if world.size not in shapes:
        pytest.skip(f"runs on {' or '.join(map(str, shapes))} ranks")
    if (world.size, dp) not in _pipes:
        pipe = stage_pipe(2, *shapes[world.size], dp=dp)
        _pipes[world.size, dp] = pipe, {last: tied_pair(pipe, last=last) for last in (1, 0)}  # collective
    return _pipes[world.size, dp]


def _gpt2(tied: bool = True, vocab: int = 96) -> torch.nn.Module:
    """A tiny GPT-2 without dropout; its norms and biases moved off 1 and 0, which would hide a wrong scale."""
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=16, n_embd=H, n_layer=4, n_head=6, n_inner=96, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa", tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config)
    assert (lm.lm_head.weight is lm.transformer.wte.weight) == tied
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return lm


def _ids(vocab: int = 96) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, vocab, (B, S))


def _serial_step(lm, ids):
    """HF's ``labels=`` step: (loss, gradients by state_dict key, AdamW's eps, the optimizer). AdamW's eps is
    a thousandth of the largest gradient, so that a gradient of rounding alone moves nothing (as compare_step)."""
    loss = lm(input_ids=ids, labels=ids, use_cache=False).loss  # the mean over the b·(s-1) targets
    loss.backward()
    grads = {k: p.grad.clone() for k, p in lm.named_parameters()}
    if lm.lm_head.weight is lm.transformer.wte.weight:  # one tensor, two keys: the sum of both uses
        grads["lm_head.weight"] = grads["transformer.wte.weight"]
    eps = 1e-3 * max(g.abs().max().item() for g in grads.values())
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2, eps=eps)
    opt.step()
    return loss.detach(), grads, eps, opt


def _pipeline_step(pipe, pairs, serial, ids, name, eps):
    """This rank's converted chunks, its optimizer, the loss (last stage: its copy's) and the gradients
    (serial keys). Data-parallel copies each take their share of ``ids``, in N / dp micro-batches."""
    _, indices = SCHEDULES[name]
    b, n = B // pipe.dp, N // pipe.dp
    ids = ids[pipe.dp_rank * b : (pipe.dp_rank + 1) * b]
    stage_ids = indices(pipe.stage, pipe.stages)
    num_stages = pipe.stages * len(stage_ids)
    pair = pairs[next(s for s in range(pipe.stages) if num_stages - 1 in indices(s, pipe.stages))]
    cut = gpt2_stages(serial, num_stages)
    q, vocab = pipe.mesh.q, serial.config.vocab_size
    logits = -(-vocab // q) * q if cut[0].tied else vocab  # a tied head's vocabulary is padded to q·⌈V/q⌉
    chunks, loss = causal_lm_schedule_step(pipe, cut, name, ids, n, H, logits)
    sum_tied_grads(chunks, pair)
    grads = as_serial(chunks, lambda p: p.grad)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-2, eps=eps)
    opt.step()
    return chunks, opt, loss, grads


def _tied_copies(state: dict) -> list[torch.Tensor]:
    """Every rank's copies of the tied table in ``state`` (collective over the world)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [state[k] for k in TIED if k in state])
    return [t for mine in everyone for t in mine]


@pytest.mark.parametrize(("name", "tied"), CASES, ids=[f"{n}-{'tied' if t else 'untied'}" for n, t in CASES])
def test_gpt2_stages_match_serial(world, name, tied):
    (pipe, pairs), ids = _pipe(world), _ids()
    serial = _gpt2(tied)
    loss_ref, grads_ref, eps, _ = _serial_step(ref := copy.deepcopy(serial), ids)
    chunks, _, loss, grads = _pipeline_step(pipe, pairs, serial, ids, name, eps)
    state = as_serial(chunks, lambda p: p.data)
    copies = _tied_copies(state)  # the last collectives
    if loss is not None:
        assert_close(loss, loss_ref, TOL, "loss")
    assert grads and set(grads) <= set(grads_ref)
    ref_state = ref.state_dict()
    assert_chunks_match(["the chunks"], [grads], [state], grads_ref, ref_state, TOL, ADAM_TOL)
    assert len(copies) == 2 * world.size // pipe.stages  # the embedding's table and the head's, every position
    assert all(torch.equal(c, copies[0]) for c in copies) == tied  # tied: one step for both, bit for bit


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_gpt2_stages_with_data_parallel_copies(world, name):
    """Two copies of the pipeline, each on half the batch: the stages average their gradients over
    the copies, then ``sum_tied_grads`` adds the tied table's (each copy's own pair): the serial step."""
    (pipe, pairs), ids = _pipe(world, dp=2), _ids()
    serial = _gpt2()
    loss_ref, grads_ref, eps, _ = _serial_step(ref := copy.deepcopy(serial), ids)
    chunks, _, loss, grads = _pipeline_step(pipe, pairs, serial, ids, name, eps)
    state = as_serial(chunks, lambda p: p.data)
    if loss is not None:  # each copy's mean over its targets, as many in each: their mean is serial's
        total = loss.clone()
        dist.all_reduce(total, group=pipe.dp_group)
        assert_close(total / pipe.dp, loss_ref, TOL, "loss")
    ref_state = ref.state_dict()
    assert_chunks_match(["the chunks"], [grads], [state], grads_ref, ref_state, TOL, ADAM_TOL)
    copies = _tied_copies(state)
    assert len(copies) == 2 * world.size // pipe.stages and all(torch.equal(c, copies[0]) for c in copies)


@pytest.mark.parametrize("name", ["1F1B", "ZBVZeroBubble"])
def test_clip_grad_norm_counts_the_tied_table_once(world, name):
    """``pipeline.clip_grad_norm_(copies=shared_copies(chunks))``: the serial norm, in which the tied
    table is one tensor, though the first and the last stage each hold a copy of its gradient."""
    (pipe, pairs), ids = _pipe(world), _ids()
    serial = _gpt2()
    _, grads_ref, _, _ = _serial_step(copy.deepcopy(serial), ids)
    chunks, _, _, _ = _pipeline_step(pipe, pairs, serial, ids, name, 1e-8)
    unique = {k: g for k, g in grads_ref.items() if k != "lm_head.weight"}  # one tensor under two names
    norm_ref = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in unique.values()]))
    params = [p for c in chunks for p in c.parameters()]
    norm = optimus2d.clip_grad_norm_(params, 1e9, pipe, copies=shared_copies(chunks))
    assert_close(norm.double(), norm_ref, 1e-5, "norm")
    twice = optimus2d.clip_grad_norm_(params, 1e9, pipe)  # without copies= the table counts twice
    assert twice > norm * (1 + 1e-4)


def test_gpt2_stages_with_a_padded_tied_vocabulary(world):
    """97 rows: the tied table and its copy are padded alike on q = 2 (the head's logits too)."""
    (pipe, pairs), ids = _pipe(world), _ids(97)
    serial = _gpt2(vocab=97)
    loss_ref, grads_ref, eps, _ = _serial_step(ref := copy.deepcopy(serial), ids)
    chunks, _, loss, grads = _pipeline_step(pipe, pairs, serial, ids, "1F1B", eps)
    state = as_serial(chunks, lambda p: p.data)
    if loss is not None:
        assert_close(loss, loss_ref, TOL, "loss")
    ref_state = ref.state_dict()
    assert_chunks_match(["the chunks"], [grads], [state], grads_ref, ref_state, TOL, ADAM_TOL)


def test_pipelined_checkpoint_loads_on_one_mesh_and_back(world, tmp_path_factory):
    """And the head's copy of the tied table gets its optimizer state back from a whole model's
    checkpoint, which holds it once, under transformer.wte.weight, naming lm_head.weight its alias."""
    (pipe, pairs), ids = _pipe(world), _ids()
    serial = _gpt2()
    _, _, eps, serial_opt = _serial_step(ref := copy.deepcopy(serial), ids)
    chunks, opt, _, _ = _pipeline_step(pipe, pairs, serial, ids, "1F1B", eps)
    ref_state, ref_optim = ref.state_dict(), optim_state(ref, serial_opt)
    ref_optim["lm_head.weight"] = ref_optim["transformer.wte.weight"]  # the head's copy took the same steps
    check_stage_checkpoints(
        pipe, chunks, opt, _gpt2(), gpt2_stages(_gpt2(), 2)[pipe.stage], ref_state, ref_optim, tmp_path_factory,
        TOL, ADAM_TOL, eps,
    )  # fmt: skip


def test_gpt2_stages_refuse_what_they_cannot_cut(world):
    (pipe, _), lm = _pipe(world), _gpt2()
    with pytest.raises(ValueError, match="4 blocks do not split into 3 equal stages"):
        gpt2_stages(lm, 3)
    lm.config.add_cross_attention = True
    with pytest.raises(ValueError, match="add_cross_attention"):
        gpt2_stages(lm, 2)
    lm.config.add_cross_attention = False
    with pytest.raises(ValueError, match="last=2 is not a stage mesh of a pipeline of 2"):
        tied_pair(pipe, last=2)
    if pipe.stage == 0:  # the first chunk's copy on a pair that names no stage mesh but the first
        lonely = TiedPair(pipe.mesh, (pipe.mesh.rank, pipe.mesh.rank + 1), None)
        chunk = optimus2d.parallelize(gpt2_stages(lm, 2)[0], pipe.mesh)
        with pytest.raises(ValueError, match="holds a copy of the tied table but is not in its pair"):
            sum_tied_grads(chunk, lonely)
        pairs = _pipe(world)[1]  # a V-shaped schedule's first and last chunks, both on stage mesh 0: the
        head = optimus2d.parallelize(gpt2_stages(lm, 2)[1], pipe.mesh)  # pair of the last stage mesh waited
        with pytest.raises(ValueError, match=r"holds both copies .* build the pair with tied_pair\(pipe, last=0\)"):
            sum_tied_grads([chunk, head], pairs[1])  # out the timeout (the partner holds no copy)
        with pytest.raises(ValueError, match=r"holds one copy of the tied table, but its pair is \[\d+\]"):
            sum_tied_grads(chunk, pairs[0])
