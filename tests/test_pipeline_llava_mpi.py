"""Hugging Face LLaVA in pipeline stages with its frozen vision tower in the LLM's bubbles
(``optimus2d.pipeline_bubbles`` on torch's action-list runtime): the loss of ``labels=``, every
gradient and one AdamW step equal the serial model's; the tower gets no gradient and sends none.
2 stages of one rank on 2 ranks, 4 of one rank on 4, 2 of 2×2 on 8."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close

import optimus2d
from optimus2d.comm import unshard
from optimus2d.layers.base import param_sharding
from optimus2d.pipeline import pipeline_stage, stage_meshes
from optimus2d.pipeline.bubbles import LLM_SCHEDULES, ScheduleEncoderInBubbles, bubble_order, encoder_stage, stage_rank
from optimus2d.pipeline.bubbles import llm_stages as llm_stage_ids
from optimus2d.pipeline.models.llama import causal_lm_loss, causal_lm_targets
from optimus2d.pipeline.models.llava import llava_stages

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]

PIPES = {2: (2, 1), 4: (4, 1), 8: (2, 2)}  # world → (stages, q)
IMAGE, ROWS, SEQ, B, N = 95, 4, 10, 8, 4  # image token; 16×16 images of 8×8 patches: 4 rows each
VISION = dict(
    hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=6, image_size=16, patch_size=8
)
TEXT = dict(
    vocab_size=96, hidden_size=60, intermediate_size=120, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=6, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip
_pipes: dict = {}


def _llava():
    """vision_feature_layer -2: the tower's first 3 layers make the features."""
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=transformers.LlamaConfig(**TEXT),
        image_token_id=IMAGE,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.model.vision_tower.requires_grad_(False)
    return model


def _batch(b: int = B):
    torch.manual_seed(1)
    ids = torch.randint(1, IMAGE, (b, SEQ))
    for row in range(b):
        start = 1 + row % 4
        ids[row, start : start + ROWS] = IMAGE
    return ids, torch.randn(b, 3, 16, 16), ids.masked_fill(ids == IMAGE, -100)


def _grads(chunk, mesh) -> dict:
    """The chunk's gradients assembled from the ranks' blocks, by serial name (None: no gradient)."""
    out = {}
    for name, q in chunk.named_parameters():
        sharding = param_sharding(q)
        out[name] = q.grad if q.grad is None or sharding is None else unshard(q.grad.contiguous(), mesh, sharding)
    return out


@pytest.mark.parametrize("llm", ["1F1B", "GPipe", "Interleaved1F1B"])
def test_llava_with_its_frozen_tower_in_the_bubbles_matches_serial(world, llm):
    if world.size not in PIPES:
        pytest.skip(f"runs on {' or '.join(map(str, PIPES))} ranks")
    if world.size not in _pipes:
        _pipes[world.size] = stage_meshes(*PIPES[world.size])
    pipe = _pipes[world.size]
    p, chunks = pipe.stages, LLM_SCHEDULES[llm][1]
    if TEXT["num_hidden_layers"] % (p * chunks):
        pytest.skip(f"{TEXT['num_hidden_layers']} decoder layers in {p}·{chunks} chunks")
    layers = [0, *[3 // (p - 1)] * (p - 1)]  # tower layers by rank: none on rank 0, the rest spread
    layers[-1] += 3 - sum(layers)
    serial = _llava()
    encoders, texts = llava_stages(serial, [layers[stage_rank(j, p)] for j in range(p)], p * chunks)
    cost = lambda kind, s: 1.0 if s >= p else 0.5 * layers[stage_rank(s, p)]  # noqa: E731
    order, _ = bubble_order(llm, p, N, cost, lead=1)

    mine = [encoder_stage(pipe.stage, p), *llm_stage_ids(pipe.stage, p, chunks)]
    total, mb = (1 + chunks) * p, B // N
    chunks_here, stages = [], []
    for sid in mine:
        chunk = optimus2d.parallelize(encoders[sid] if sid < p else texts[sid - p], pipe.mesh)
        chunks_here.append(chunk)
        hidden = (mb, SEQ, TEXT["hidden_size"])
        if sid == 0:
            shapes = dict(microbatch_shape=(mb, 3, 16, 16), input_layout="batch", output_shape=(mb, 1 + ROWS, 48))
        elif sid < p:
            shapes = dict(microbatch_shape=(mb, 1 + ROWS, 48), output_shape=(mb, 1 + ROWS - (sid == p - 1), 48))
        elif sid == p:
            shapes = dict(microbatch_shape=(mb, ROWS, 48), output_shape=hidden)
        else:
            shapes = dict(microbatch_shape=hidden, output_shape=(mb, SEQ, 96) if sid == total - 1 else hidden)
        stages.append(
            pipeline_stage(
                chunk, pipe, stage_index=sid, num_stages=total, dtype=torch.float32,
                input_grad=sid > p, output_grad=sid >= p, **shapes,
            )
        )  # fmt: skip

    ids, pixels, labels = _batch()
    target, count = causal_lm_targets(labels, pipe.mesh)
    schedule = ScheduleEncoderInBubbles(stages, N, order, loss_fn=causal_lm_loss(pipe.mesh, count), scale_grads=False)
    losses: list = []
    last = total - 1 in mine
    args = (optimus2d.scatter_batch(pixels, pipe.mesh),) if 0 in mine else ()
    kwargs = {"input_ids": optimus2d.scatter_batch(ids, pipe.mesh)} if p in mine else {}
    sent_back = []  # the gradient sends of this rank's tower chunk: none
    tower = stages[mine.index(encoder_stage(pipe.stage, p))]
    send_ops = tower.get_bwd_send_ops
    tower.get_bwd_send_ops = lambda m: sent_back.extend(ops := send_ops(m)) or ops
    schedule.step(*args, **kwargs, target=target if last else None, losses=losses if last else None)
    kept = getattr(tower, "_forward_chunk_states", None)  # torch 2.15's name for what 2.11–2.14 call fwd_cache
    assert not (tower.fwd_cache if kept is None else kept), "the frozen tower kept an activation"
    assert sent_back == [], "the frozen tower sent a gradient"  # on torch 2.11 too (LaneStage)

    grads = [_grads(c, pipe.mesh) for c in chunks_here]
    loss_ref = serial(input_ids=ids, pixel_values=pixels, labels=labels).loss
    loss_ref.backward()
    ref_grads = {k: q.grad for k, q in serial.named_parameters()}
    eps = 1e-3 * max(g.abs().max().item() for g in ref_grads.values() if g is not None)  # as compare_step
    for model in (serial, *chunks_here):
        if trained := [q for q in model.parameters() if q.requires_grad]:
            torch.optim.AdamW(trained, lr=1e-2, eps=eps).step()
    states = [optimus2d.serial_state_dict(c) for c in chunks_here]
    ref_state = serial.state_dict()
    if last:
        assert_close(torch.stack(losses).sum(), loss_ref.detach(), 1e-5, "loss")
    for sid, grad, state in zip(mine, grads, states, strict=True):
        for key, g in grad.items():
            if sid < p:  # the frozen tower: no gradient at all
                assert g is None and ref_grads[key] is None, key
            else:
                assert_close(g, ref_grads[key], 1e-5, f"stage {sid} grad {key}")
        for key, value in state.items():
            assert_close(value, ref_state[key], 1e-5, f"stage {sid} AdamW {key}")


def test_image_tokens_that_do_not_match_the_features_are_refused_on_every_rank(world):
    """One rank of the first language-model chunk's mesh holds a sample with an image token too many:
    every rank of that mesh raises the same ValueError (one all-gather), before the merge. A fresh mesh
    over the world: a mesh whose ranks disagreed is not to be used again."""
    q = math.isqrt(world.size)
    while world.size % (q * q):
        q -= 1
    mesh = optimus2d.Mesh(q, world.size // (q * q))
    _, texts = llava_stages(_llava(), [3], 1)
    first = optimus2d.parallelize(texts[0], mesh)
    b = 2 * mesh.depth * mesh.q
    ids, _, _ = _batch(b)
    ids = optimus2d.scatter_batch(ids, mesh)
    features = optimus2d.scatter(torch.randn(b, ROWS, 48), mesh)
    with pytest.raises(ValueError, match="needs input_ids="):  # on every rank alike, before any collective
        first(features)
    if world.rank == 0:
        ids[0, -1] = IMAGE  # this rank's first sample: 5 image tokens for 4 feature rows
    with pytest.raises(ValueError, match="image tokens"):
        first(features, input_ids=ids)


def test_llava_stages_refuse_what_they_cannot_cut():
    llava = _llava()
    with pytest.raises(ValueError, match="sum to the 3 tower layers before vision_feature_layer=-2"):
        llava_stages(llava, [2, 2], 2)
    with pytest.raises(ValueError, match="4 decoder layers do not split into 3"):
        llava_stages(llava, [1, 2], 3)
    llava.config.get_text_config().tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        llava_stages(llava, [1, 2], 2)
    llava.config.get_text_config().tie_word_embeddings = False
    llava.config.vision_feature_layer = [-2, -1]
    with pytest.raises(ValueError, match="not supported"):
        llava_stages(llava, [1, 2], 2)
