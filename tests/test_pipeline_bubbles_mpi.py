"""The encoder in the pipeline's bubbles on torch's action-list runtime: an encoder + LLM model (torch.nn
layers) whose loss, gradients and one AdamW step equal the serial model's, the encoder frozen or
trained, under each LLM order, for the encoder splits and leads the planner can pick (a rank with no
encoder layer included). 2 stages of one rank on 2 ranks, 4 of one rank and 2 of 1×1×2 on 4, 2 of
2×2 on 8."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import as_serial, assert_close, stage_pipe
from torch import nn

import optimus2d
from optimus2d.pipeline import mesh_sum, pipeline_stage
from optimus2d.pipeline.bubbles import (
    LLM_SCHEDULES,
    ScheduleEncoderInBubbles,
    bubble_order,
    encoder_stage,
    llm_stages,
    stage_rank,
)

pytestmark = pytest.mark.mpi

PIPES = {2: [(2, 1, 1)], 4: [(4, 1, 1), (2, 1, 2)], 8: [(2, 2, 1)]}  # world → (stages, q, depth)
B, S, H, ENC, LM = 8, 3, 8, 4, 8
TOL, ADAM_TOL = 1e-10, 1e-6  # float64; see test_pipeline_mpi.py for Adam's tolerance


def _serial(frozen: bool) -> nn.Sequential:
    torch.manual_seed(0)
    layer = lambda: nn.TransformerEncoderLayer(H, 2, 2 * H, dropout=0.0, batch_first=True)  # noqa: E731
    model = nn.Sequential(*[layer() for _ in range(ENC + LM)]).double()
    model[:ENC].requires_grad_(not frozen)
    return model


def _cases():
    for world, shapes in PIPES.items():
        for shape in shapes:
            for llm in LLM_SCHEDULES:
                for frozen in (True, False):
                    yield world, shape, llm, frozen


@pytest.mark.parametrize("world_size,shape,llm,frozen", list(_cases()))
def test_encoder_in_bubbles_matches_serial(world, world_size, shape, llm, frozen):
    if world.size != world_size:
        pytest.skip(f"runs on {world_size} ranks")
    if llm == "LoopedBFS" and not (frozen and shape[0] == 4):
        pytest.skip("LoopedBFS: the frozen case on 4 pipeline ranks is enough")
    pipe, n = stage_pipe(*shape), 4
    p, chunks = pipe.stages, LLM_SCHEDULES[llm][1]
    per = LM // (p * chunks)
    if per * p * chunks != LM:
        pytest.skip(f"{LM} LLM layers do not split into {p}·{chunks} chunks")
    # the encoder's layers by rank: uneven, rank 0 with none when it can, as the planner picks them
    layers = [0, *[ENC // (p - 1)] * (p - 1)]
    layers[-1] += ENC - sum(layers)
    starts = [sum(layers[stage_rank(j, p)] for j in range(i)) for i in range(p + 1)]  # by encoder stage
    cost = lambda kind, s: 1.0 if s >= p else 0.5 * layers[stage_rank(s, p)]  # noqa: E731
    order, _ = bubble_order(llm, p, n, cost, lead=1)

    serial = _serial(frozen)
    mine = [encoder_stage(pipe.stage, p), *llm_stages(pipe.stage, p, chunks)]
    chunks_here, stages = [], []
    for sid in mine:
        if sid < p:
            part = serial[starts[sid] : starts[sid + 1]]
        else:
            first = ENC + (sid - p) * per
            part = serial[first : first + per]
        chunk = optimus2d.parallelize(copy.deepcopy(part), pipe.mesh)
        chunks_here.append(chunk)
        encoder_out = sid < p and frozen  # a frozen encoder's features carry no gradient either way
        stages.append(
            pipeline_stage(
                chunk, pipe, microbatch_shape=(B // n, S, H), stage_index=sid, num_stages=(1 + chunks) * p,
                dtype=torch.float64,
                input_grad=sid > 0 and not (frozen and sid <= p), output_grad=not encoder_out,
            )
        )  # fmt: skip

    def loss_fn(out, target):
        return mesh_sum(out * target, pipe.mesh)

    schedule = ScheduleEncoderInBubbles(stages, n, order, loss_fn=loss_fn, scale_grads=False)
    torch.manual_seed(1)
    x, probe = torch.randn(B, S, H, dtype=torch.float64), torch.randn(B, S, H, dtype=torch.float64)
    losses: list[torch.Tensor] = []
    last = (1 + chunks) * p - 1 in mine
    args = (optimus2d.scatter(x, pipe.mesh),) if 0 in mine else ()
    target = optimus2d.scatter(probe, pipe.mesh) if last else None
    schedule.step(*args, target=target, losses=losses if last else None)

    trained = [q for c in chunks_here for q in c.parameters() if q.requires_grad]
    grads = [as_serial(c) for c in chunks_here]
    torch.optim.AdamW(trained, lr=1e-2).step()
    states = [optimus2d.serial_state_dict(c) for c in chunks_here]

    loss_ref = (serial(x) * probe).sum()
    loss_ref.backward()
    torch.optim.AdamW([q for q in serial.parameters() if q.requires_grad], lr=1e-2).step()
    ref_grads = {k: q.grad if q.grad is not None else torch.zeros_like(q) for k, q in serial.named_parameters()}
    ref_state = serial.state_dict()
    if last:
        assert_close(torch.stack(losses).sum(), loss_ref.detach(), TOL, "loss")
    for sid, grad, state in zip(mine, grads, states, strict=True):
        for key, g in grad.items():
            assert_close(g, ref_grads[key], TOL, f"stage {sid} grad {key}")
            assert_close(state[key], ref_state[key], ADAM_TOL, f"stage {sid} AdamW {key}")
        if sid < p and frozen:
            assert all(q.grad is None for q in chunks_here[mine.index(sid)].parameters()), "a frozen chunk got grads"


def test_a_rank_without_its_encoder_chunk_is_refused(world):
    if world.size != 2:
        pytest.skip("runs on 2 ranks")
    pipe = stage_pipe(2, 1, 1)
    order, _ = bubble_order("1F1B", 2, 4, lambda kind, s: 1.0)
    mine = llm_stages(pipe.stage, 2)[0]  # the LLM chunk alone: the encoder chunk is missing
    stage = pipeline_stage(nn.Linear(H, H).double(), pipe, microbatch_shape=(2, S, H), stage_index=mine, num_stages=4)
    with pytest.raises(ValueError, match=rf"pipeline rank {pipe.stage} of 2 needs stages \[{1 - pipe.stage}, {mine}\]"):
        ScheduleEncoderInBubbles([stage], 4, order)
