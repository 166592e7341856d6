"""Context parallelism inside a pipeline: c = 2 in each of 2 stages (issue 27).

A Hugging Face LLaMA cut into 2 stages (``llama_stages``), each converted on a Mesh(1, 2) whose depth
axis splits the sequence (``pipeline_stage(..., context=context.ContextParallel(pipe.mesh))``): the
ids and the targets enter as sequence blocks (``context.scatter_batch``, ``causal_lm_targets(...,
context=)``), the stages pass sequence blocks ``[b/(n·q), s/c, h/q]``, each stage's attention gathers
its keys over depth (or passes them round the ring), under a causal, an image–text or a
packed-document mask. Under torch's 1F1B and GPipe schedules the loss,
every gradient and one AdamW step equal the serial ``LlamaForCausalLM``'s (float64, ``nn.RMSNorm``
for HF's float32 norm: 1e-10, the step 1e-6). 4 ranks: 2 stages × c 2; 8: × 2 data-parallel copies.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import as_serial, assert_chunks_match, assert_close, context_mask, stage_pipe, torch_rms_norms
from torch import nn

import optimus2d
from optimus2d import context
from optimus2d.pipeline import SCHEDULES, pipeline_stage
from optimus2d.pipeline.models.llama import causal_lm_loss, causal_lm_targets, llama_stages

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]

SHAPES = {4: 1, 8: 2}  # world → data-parallel copies of 2 stages × Mesh(1, 2)
B, S, H, V, N = 8, 16, 48, 96, 2  # batch, sequence, hidden, vocabulary, micro-batches
TOL, ADAM_TOL = 1e-10, 1e-6


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config).double()
    torch_rms_norms(lm, H, "LlamaRMSNorm")
    return lm


@pytest.mark.parametrize(
    ("name", "attention", "kind"),
    [("1F1B", "all_gather", "causal"), ("GPipe", "ring", "image"), ("1F1B", "ring", "documents")],
)
def test_context_parallel_stages_match_serial(world, name, attention, kind):
    if world.size not in SHAPES:
        pytest.skip(f"runs on {sorted(SHAPES)} ranks")
    dp = SHAPES[world.size]
    pipe = stage_pipe(2, 1, 2, dp=dp)
    serial = _llama()
    torch.manual_seed(1)
    ids = torch.randint(0, V, (B, S))
    mine = ids[B // dp * pipe.dp_rank : B // dp * (pipe.dp_rank + 1)] if dp > 1 else ids
    b = mine.shape[0]

    mask = context_mask(kind, S)
    balance = "head_tail" if kind == "causal" else "makespan"
    spec = context.ContextParallel(pipe.mesh, mask=mask, balance=balance, block=2, attention=attention)
    chunk = optimus2d.parallelize(llama_stages(serial, 2)[pipe.stage], pipe.mesh)
    first, last = pipe.stage == 0, pipe.stage == 1
    stage = pipeline_stage(
        chunk, pipe, microbatch_shape=(b // N, S) if first else (b // N, S, H),
        output_shape=(b // N, S, V) if last else (b // N, S, H), token_ids=first, context=spec,
    )  # fmt: skip
    target, count = causal_lm_targets(mine, pipe, context=spec)
    cls, _ = SCHEDULES[name]
    schedule = cls(stage, n_microbatches=N, loss_fn=causal_lm_loss(pipe, count), scale_grads=False)
    losses: list[torch.Tensor] = []
    split = spec.split(S)[0]
    args = (context.scatter_batch(mine, pipe.mesh, split),) if first else ()
    schedule.step(*args, target=target if last else None, losses=losses if last else None)
    grads = as_serial(chunk, lambda p: p.grad)
    torch.optim.AdamW(chunk.parameters(), lr=1e-2).step()
    state = as_serial(chunk, lambda p: p.data)

    opt = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    bias = torch.zeros(S, S, dtype=torch.float64).masked_fill(~mask, float("-inf"))[None, None].expand(B, 1, S, S)
    logits = serial(input_ids=ids, use_cache=False, attention_mask=bias if kind != "causal" else None).logits
    loss_ref = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss_ref.backward()
    grads_ref = {k: p.grad.clone() for k, p in serial.named_parameters()}
    opt.step()
    if last:
        total = torch.stack(losses).sum()
        if dp > 1:  # each copy's loss is dp times its share of the whole batch's
            parts = [torch.zeros((), dtype=total.dtype) for _ in range(dp)]
            torch.distributed.all_gather(parts, total.detach(), group=pipe.dp_group)
            total = torch.stack(parts).mean()
        assert_close(total, loss_ref, TOL, "loss")
    assert_chunks_match(["the chunk"], [grads], [state], grads_ref, serial.state_dict(), TOL, ADAM_TOL)


def test_a_chunk_that_cannot_split_its_sequence_is_refused(world):
    if world.size not in SHAPES:
        pytest.skip(f"runs on {sorted(SHAPES)} ranks")
    pipe = stage_pipe(2, 1, 2, dp=SHAPES[world.size])
    chunk = optimus2d.parallelize(nn.Sequential(nn.Linear(H, H)), pipe.mesh)
    with pytest.raises(TypeError, match="does not say how to run with its sequence split"):
        pipeline_stage(chunk, pipe, microbatch_shape=(4, S, H), context=context.ContextParallel(pipe.mesh))
    with pytest.raises(ValueError, match=r"17 tokens do not divide: pad the sequence to a multiple of 4"):
        chunk = optimus2d.parallelize(llama_stages(_llama(), 2)[pipe.stage], pipe.mesh)
        pipeline_stage(chunk, pipe, microbatch_shape=(4, S + 1, H), context=context.ContextParallel(pipe.mesh))
