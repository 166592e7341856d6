"""A Hugging Face LLaMA cut into pipeline stages (``optimus2d.pipeline_models``): loss, every gradient
and one AdamW step equal the serial ``LlamaForCausalLM``'s ``labels=`` training step under each of
torch's seven schedules; its checkpoint loads on one mesh, and one mesh's checkpoint into the stages.
2 stages of 2×2 on 8 ranks, of 1×1×2 on 4, of one rank on 2."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    as_serial,
    assert_chunks_match,
    assert_close,
    causal_lm_schedule_step,
    check_stage_checkpoints,
    shared_tmp,
    stage_pipe,
    torch_rms_norms,
)
from torch import nn

import optimus2d
import optimus2d.pipeline
from optimus2d.checkpoint.stages import load_stages, save_stages
from optimus2d.pipeline.models.llama import llama_stages

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

SHAPES = {2: (1, 1), 4: (1, 2), 8: (2, 1)}  # world → (q, depth) of each of the 2 stage meshes
B, S, H, V, N = 8, 5, 48, 96, 4  # batch, sequence, hidden, vocabulary, micro-batches
TOL, ADAM_TOL = 1e-10, 1e-6  # float64; Adam's g/(√v + eps) lifts roundoff of tiny gradients
SCHEDULES = optimus2d.pipeline.SCHEDULES  # all seven of torch's


def _pipe(world):
    if world.size not in SHAPES:
        pytest.skip(f"runs on {' or '.join(map(str, SHAPES))} ranks")
    return stage_pipe(2, *SHAPES[world.size])


def _llama() -> nn.Module:
    """A tiny float64 LLaMA (grouped-query: 6 heads, 2 key/value heads). HF's ``LlamaRMSNorm`` computes in
    float32 whatever the dtype (1e-8 apart from float64); ``nn.RMSNorm`` in its place keeps serial exact."""
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config).double()
    torch_rms_norms(lm, H, "LlamaRMSNorm")
    return lm


def _serial_step(lm, ids):
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    out = lm(input_ids=ids, labels=ids, use_cache=False)  # HF: the mean over the b·(s-1) targets, in float32
    loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())  # the same mean in float64
    assert_close(out.loss.double(), loss, 1e-6, "HF's labels= loss")
    loss.backward()
    grads = {k: p.grad.clone() for k, p in lm.named_parameters()}
    opt.step()
    return loss.detach(), grads, opt


def _pipeline_step(pipe, serial, ids, name):
    """This rank's converted chunks, its optimizer, the loss (last stage) and the gradients (serial keys)."""
    _, indices = SCHEDULES[name]
    cut = llama_stages(serial, pipe.stages * len(indices(pipe.stage, pipe.stages)))
    chunks, loss = causal_lm_schedule_step(pipe, cut, name, ids, N, H, V)
    grads = as_serial(chunks, lambda p: p.grad)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-2)
    opt.step()
    return chunks, opt, loss, grads


def _ids():
    torch.manual_seed(1)
    return torch.randint(0, V, (B, S))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_llama_stages_match_serial(world, name):
    pipe, ids = _pipe(world), _ids()
    serial = _llama()
    chunks, _, loss, grads = _pipeline_step(pipe, serial, ids, name)
    state = as_serial(chunks, lambda p: p.data)  # the last collectives
    loss_ref, grads_ref, _ = _serial_step(serial, ids)
    if loss is not None:
        assert_close(loss, loss_ref, TOL, "loss")
    assert grads and set(grads) <= set(grads_ref)
    ref_state = serial.state_dict()
    assert_chunks_match(["the chunks"], [grads], [state], grads_ref, ref_state, TOL, ADAM_TOL)


def _optim_state(lm, opt) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): k for k, p in lm.named_parameters()}
    return {names[id(p)]: {k: v for k, v in s.items() if k != "step"} for p, s in opt.state.items()}


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B"])
def test_clip_grad_norm_over_the_stages_is_the_serial_models(world, name):
    """``pipeline.clip_grad_norm_``: the norm of the whole model's gradient (every stage's, each block
    once), and every gradient scaled as torch scales the serial model's."""
    pipe, ids = _pipe(world), _ids()
    serial = _llama()
    _, grads_ref, _ = _serial_step(copy.deepcopy(serial), ids)
    chunks, _, _, _ = _pipeline_step(pipe, serial, ids, name)
    norm_ref = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads_ref.values()]))
    max_norm = 0.5 * norm_ref.item()
    norm = optimus2d.clip_grad_norm_([p for c in chunks for p in c.parameters()], max_norm, pipe)
    assert_close(norm.double(), norm_ref, 1e-6, "norm")
    clipped = as_serial(chunks, lambda p: p.grad)
    for key, g in clipped.items():
        assert_close(g, grads_ref[key] * (max_norm / (norm_ref + 1e-6)), 1e-6, f"clipped {key}")
    inf = optimus2d.clip_grad_norm_([p for c in chunks for p in c.parameters()], 1e9, pipe, float("inf"))
    largest = max(g.abs().max() for g in grads_ref.values()) * (max_norm / (norm_ref + 1e-6))
    assert_close(inf.double(), largest, 1e-6, "inf norm of the clipped gradients")


def test_pipelined_checkpoint_loads_on_one_mesh_and_back(world, tmp_path_factory):
    pipe, ids = _pipe(world), _ids()
    serial = _llama()
    chunks, opt, _, _ = _pipeline_step(pipe, serial, ids, "1F1B")
    _, _, serial_opt = _serial_step(serial, ids)
    ref_state, ref_optim = serial.state_dict(), _optim_state(serial, serial_opt)
    fresh_opt = check_stage_checkpoints(
        pipe, chunks, opt, _llama(), llama_stages(_llama(), 2)[pipe.stage], ref_state, ref_optim, tmp_path_factory,
        TOL, ADAM_TOL,
    )  # fmt: skip
    assert all(int(s["step"]) == 1 for s in fresh_opt.state.values())


def test_llama_stages_refuses_what_it_cannot_cut(world):
    lm = _llama()
    with pytest.raises(ValueError, match="4 decoder layers do not split into 3 equal stages"):
        llama_stages(lm, 3)
    lm.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        llama_stages(lm, 2)
    mistral = transformers.MistralForCausalLM(  # a sliding window: the stages' mask was LLaMA's, 0.59 off
        transformers.MistralConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, sliding_window=3,
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"attends within a sliding window \(sliding_window=3"):
        llama_stages(mistral, 2)
    mistral.config.sliding_window = None  # no longer than the window: the same mask
    assert len(llama_stages(mistral, 2)) == 2


def test_a_frozen_stage_without_an_optimizer_saves_beside_the_trained_one(world, tmp_path_factory):
    """A frozen first stage has no optimizer (AdamW refuses an empty list): the checkpoint holds the
    trained stage's optimizer, which loads back as it was; stages whose optimizers' settings differ
    (one checkpoint, one optimizer) are refused on every rank, before anything is written."""
    pipe = _pipe(world)
    base = shared_tmp(tmp_path_factory, "frozen")

    def stage(lr: float | None):
        chunk = optimus2d.parallelize(llama_stages(_llama(), 2)[pipe.stage], pipe.mesh)
        if lr is None:
            return chunk.requires_grad_(False), None
        opt = torch.optim.AdamW(chunk.parameters(), lr=lr)
        for param in chunk.parameters():
            param.grad = torch.ones_like(param)
        opt.step()
        return chunk, opt

    chunk, opt = stage(None if pipe.stage == 0 else 1e-2)
    save_stages(f"{base}/ckpt", chunk, opt, pipe=pipe)
    fresh, fresh_opt = stage(None if pipe.stage == 0 else 1e-2)
    if fresh_opt is not None:
        fresh_opt.state.clear()
    load_stages(f"{base}/ckpt", fresh, fresh_opt)
    if opt is not None:
        for a, b in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"], strict=True):
            assert torch.equal(opt.state[a]["exp_avg"], fresh_opt.state[b]["exp_avg"])
    chunk, opt = stage(1e-2 if pipe.stage == 0 else 1e-3)
    with pytest.raises(ValueError, match=r"save_stages: the stages' optimizers have different parameter groups"):
        save_stages(f"{base}/lrs", chunk, opt, pipe=pipe)


def test_stage_checkpoints_refuse_overlapping_or_missing_stages(world, tmp_path_factory):
    pipe = _pipe(world)
    base = shared_tmp(tmp_path_factory, "refuse")
    same = optimus2d.parallelize(llama_stages(_llama(), 2)[0], pipe.mesh)  # every stage mesh holds stage 0
    with pytest.raises(ValueError, match="held by more than one stage mesh"):
        save_stages(f"{base}/twice", same)
    with pytest.raises(ValueError, match="held by more than one stage mesh"):
        save_stages(f"{base}/twice", same, pipe=pipe)  # stage meshes, not copies, whatever their keys
    whole = optimus2d.parallelize(_llama(), pipe.mesh)
    optimus2d.checkpoint.save(f"{base}/whole", whole)
    with pytest.raises(ValueError, match=r"no stage holds \['model\.lm_head\.weight'"):
        load_stages(f"{base}/whole", same)
