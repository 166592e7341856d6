"""Pipelines with data-parallel copies (``stage_meshes(..., dp=2)``): every copy runs torch's schedule
on its share of the batch, each stage's gradient is averaged over the copies, and the loss, every
gradient, the clipped norm and one AdamW step equal the serial model's on the whole batch.
2 stages × dp 2 × one rank on 4 ranks, × 1×1×2 on 8 (both in scripts/test.sh; at 8 three schedules),
× 2×2 on 16 (by hand:
``mpiexec -n 16 python -m pytest --only-mpi tests/test_pipeline_dp_mpi.py``, 12 passed)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import (
    as_serial,
    assert_chunks_match,
    assert_close,
    check_stage_checkpoints,
    optim_state,
    raises_fast,
    shared_tmp,
    stage_pipe,
)
from torch import nn

import optimus2d
from optimus2d.checkpoint.stages import save_stages
from optimus2d.pipeline import SCHEDULES, lanes, mesh_sum, pipeline_stage, stage_meshes
from optimus2d.pipeline.data_parallel import DataParallelStage

pytestmark = pytest.mark.mpi

SHAPES = {4: (1, 1), 8: (1, 2), 16: (2, 1)}  # world → (q, depth) of each of the 2 stages × 2 copies
DP, B, S, H, LAYERS, N = 2, 16, 3, 8, 4, 4  # copies, batch, sequence, hidden, layers, micro-batches
TOL, ADAM_TOL, MAX_NORM = 1e-10, 1e-6, 0.1  # float64; the clip bites (the norm is about 0.33)


def _pipe(world):
    if world.size not in SHAPES:
        pytest.skip(f"runs on {' or '.join(map(str, SHAPES))} ranks")
    return stage_pipe(2, *SHAPES[world.size], dp=DP)


def _serial() -> nn.Sequential:
    torch.manual_seed(0)
    layer = lambda: nn.TransformerEncoderLayer(H, 2, 2 * H, dropout=0.0, batch_first=True)  # noqa: E731
    return nn.Sequential(*[layer() for _ in range(LAYERS)]).double()


def test_copies_lanes_and_dp_groups(world):
    """Pipeline outermost: stage s of copy r on ranks (s·dp + r)·p ..; a lane within a copy, a dp
    group within a stage, at the same mesh position."""
    pipe = _pipe(world)
    p = pipe.mesh.size
    m = world.rank // p
    assert (pipe.stage, pipe.dp_rank, pipe.stages, pipe.dp) == (m // DP, m % DP, 2, DP)
    n = world.rank % p
    assert pipe.lane_ranks == tuple((s * DP + pipe.dp_rank) * p + n for s in range(2))
    assert pipe.dp_ranks == tuple((pipe.stage * DP + r) * p + n for r in range(DP))
    assert dist.get_process_group_ranks(pipe.lane) == list(pipe.lane_ranks)
    assert dist.get_process_group_ranks(pipe.dp_group) == list(pipe.dp_ranks)
    assert pipe.stage_ranks(1, 0) == tuple(range(2 * p * DP // 2 * 1, 2 * p * DP // 2 * 1 + p))


def _step(pipe, serial, name, x, probe):
    """The pipelined step on this copy's share: the chunks, their optimizer, the losses, the clip norm."""
    cls, indices = SCHEDULES[name]
    ids = indices(pipe.stage, pipe.stages)
    num = pipe.stages * len(ids)
    per = LAYERS // num
    share = slice(pipe.dp_rank * B // DP, (pipe.dp_rank + 1) * B // DP)  # this copy's samples
    chunks, stages = [], []
    for sid in ids:
        chunk = optimus2d.parallelize(copy.deepcopy(serial[sid * per : (sid + 1) * per]), pipe.mesh)
        chunks.append(chunk)
        shape = (B // DP // N, S, H)
        stages.append(pipeline_stage(chunk, pipe, microbatch_shape=shape, stage_index=sid, num_stages=num))
    assert all(isinstance(s, DataParallelStage) for s in stages)
    scale = 1.0 / (B // DP // N * S * H)  # each micro-batch's mean

    def loss_fn(out, target):
        return mesh_sum(out * target, pipe.mesh) * scale

    schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=N, loss_fn=loss_fn, scale_grads=True)
    losses: list[torch.Tensor] = []
    last = num - 1 in ids
    args = (optimus2d.scatter(x[share], pipe.mesh),) if 0 in ids else ()
    target = optimus2d.scatter(probe[share], pipe.mesh) if last else None
    schedule.step(*args, target=target, losses=losses if last else None)
    params = [p for c in chunks for p in c.parameters()]
    norm = optimus2d.clip_grad_norm_(params, MAX_NORM, pipe)
    grads = [as_serial(c) for c in chunks]
    opt = torch.optim.AdamW(params, lr=1e-2)
    opt.step()
    return chunks, opt, (torch.stack(losses).mean() if last else None), norm, grads


def _reference(serial, x, probe):
    loss = (serial(x) * probe).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), MAX_NORM)
    grads = {k: p.grad.clone() for k, p in serial.named_parameters()}
    opt = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    opt.step()
    return loss.detach(), norm, grads, opt


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_data_parallel_pipeline_matches_serial(world, name):
    pipe, serial = _pipe(world), _serial()
    torch.manual_seed(1)
    x, probe = torch.randn(B, S, H, dtype=torch.float64), torch.randn(B, S, H, dtype=torch.float64)
    chunks, _, loss, norm, grads = _step(pipe, serial, name, x, probe)
    states = [optimus2d.serial_state_dict(c) for c in chunks]
    loss_ref, norm_ref, grads_ref, _ = _reference(ref := copy.deepcopy(serial), x, probe)
    if loss is not None:  # each copy's mean over its share; their mean is the whole batch's
        total = loss.clone()
        dist.all_reduce(total, group=pipe.dp_group)
        assert_close(total / DP, loss_ref, TOL, "loss")
    assert_close(norm.double(), norm_ref, TOL, "clipped norm")
    ref_state = ref.state_dict()
    assert_chunks_match([name] * len(grads), grads, states, grads_ref, ref_state, TOL, ADAM_TOL)


def test_copies_save_one_checkpoint_of_the_whole_model(world, tmp_path_factory):
    """``save_stages`` from both copies writes each block once (the first copy's); it loads on one mesh
    and back into the stages, equal to the serial model after the step."""
    pipe, serial = _pipe(world), _serial()
    torch.manual_seed(1)
    x, probe = torch.randn(B, S, H, dtype=torch.float64), torch.randn(B, S, H, dtype=torch.float64)
    chunks, opt, _, _, _ = _step(pipe, serial, "1F1B", x, probe)
    _, _, _, ref_opt = _reference(ref := copy.deepcopy(serial), x, probe)
    half = LAYERS // 2
    fresh = _serial()[pipe.stage * half : (pipe.stage + 1) * half]
    check_stage_checkpoints(
        pipe, chunks, opt, _serial(), fresh, ref.state_dict(), optim_state(ref, ref_opt), tmp_path_factory,
        TOL, ADAM_TOL,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"held by more than one stage mesh .*data-parallel copies: pass pipe="):
        save_stages(shared_tmp(tmp_path_factory, "refused") / "ckpt", chunks, opt)  # refused before any file


def test_copies_that_do_not_fit_are_refused_on_every_rank(world):
    if world.size not in SHAPES:
        pytest.skip(f"runs on {' or '.join(map(str, SHAPES))} ranks")
    need = r"dp=3 replicas of 2 stages of Mesh\(q=1, depth=1\) need 3·2·1 = 6 ranks"
    with pytest.raises(ValueError, match=rf"{need} but the world has {world.size}"):
        stage_meshes(2, 1, dp=3)
    with pytest.raises(ValueError, match=r"positive number dp, got dp=0"):
        stage_meshes(2, 1, dp=0)
    pipe = _pipe(world)  # 4 stage meshes (2 stages × 2 copies) do not make 3 copies
    with pytest.raises(ValueError, match=r"lanes: dp=3 does not divide the 4 meshes of Mesh"):
        lanes(pipe.mesh, dp=3)


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B"])
def test_each_copy_sends_its_gradient_blocks_once_per_step(world, name):
    """Exact bytes: building a stage broadcasts its parameter blocks over the dp group once; a step
    all-reduces each chunk's gradient blocks once (one message per chunk), nothing else over it."""
    pipe, serial = _pipe(world), _serial()
    torch.manual_seed(1)
    x, probe = torch.randn(B, S, H, dtype=torch.float64), torch.randn(B, S, H, dtype=torch.float64)
    with optimus2d.count_comm() as counted:
        chunks, _, _, _, _ = _step(pipe, serial, name, x, probe)
    dp = [r for r in counted.records if r.axis == "dp"]
    blocks = [sum(p.numel() for p in c.parameters()) for c in chunks]
    sent = [r.numel for r in dp if r.kind == "all_reduce"]
    assert sorted(sent) == sorted(blocks)  # one message per chunk, at its last backward
    assert sum(r.numel for r in dp if r.kind == "broadcast") == sum(blocks)
    assert {r.kind for r in dp} == {"all_reduce", "broadcast"}


def test_copies_of_a_stage_with_unlike_modules_are_refused(world):
    """One copy's Tanh where the other's has a ReLU: the copies trained apart (gradients 4.3 off, no
    error). The copies of that stage agree what they hold before copy 0's weights are sent, and raise."""
    pipe = _pipe(world)
    odd = pipe.stage == 0 and pipe.dp_rank == 1
    chunk = nn.Sequential(nn.Linear(H, H), nn.Tanh() if odd else nn.ReLU()).double()
    chunk = optimus2d.parallelize(chunk, pipe.mesh)
    build = lambda: pipeline_stage(chunk, pipe, microbatch_shape=(B // DP // N, S, H))  # noqa: E731
    if pipe.stage == 0:
        raises_fast(ValueError, r"pipeline_stage over the copies over the ranks .*the ranks disagree", build)
    else:
        assert isinstance(build(), DataParallelStage)
