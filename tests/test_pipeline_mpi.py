"""Pipeline stages on sub-meshes under torch's schedules: loss, gradients and one AdamW step equal
the serial model's. 2 stages of 2×2 on 8 ranks, of 1×1×2 on 4, of one rank on 2, of 2×2×2 on 16 and
of 3×3 on 18 (scripts/test.sh runs all at 4; at 8 and 18 1F1B, Interleaved1F1B, ZBVZeroBubble and
the refusals; 16 by hand)."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from helpers import as_serial, assert_chunks_match, assert_close, shared_tmp, stage_pipe
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import optimus2d
from optimus2d import checkpoint
from optimus2d.pipeline import SCHEDULES, mesh_sum, pipeline_stage, scatter_microbatches

pytestmark = pytest.mark.mpi

SHAPES = {2: (1, 1), 4: (1, 2), 8: (2, 1), 16: (2, 2), 18: (3, 1)}  # world → (q, depth) of each of the 2 stage meshes
S, LAYERS = 3, 4
TOL = 1e-10  # float64
# after AdamW: the key bias's gradient is 0 in serial and ~1e-17 here, which Adam's g/(√v + eps) lifts to ~1e-9·lr
ADAM_TOL = 1e-6


def _pipe(world):
    if world.size not in SHAPES:
        pytest.skip(f"runs on {' or '.join(map(str, SHAPES))} ranks")
    return stage_pipe(2, *SHAPES[world.size])


def _dims(pipe) -> tuple[int, int, int]:
    """(batch, hidden, heads): 4 micro-batches the mesh splits, heads the mesh splits (8, 8, 2 up to
    2×2; 24, 24, 6 on 3×3)."""
    unit = math.lcm(2, pipe.mesh.q * pipe.mesh.depth)
    return 4 * unit, 4 * unit, unit


def _serial(h: int, heads: int) -> nn.Sequential:
    torch.manual_seed(0)
    layer = lambda: nn.TransformerEncoderLayer(h, heads, 2 * h, dropout=0.0, batch_first=True)  # noqa: E731
    return nn.Sequential(*[layer() for _ in range(LAYERS)]).double()


def test_stage_meshes_and_lanes(world):
    pipe = _pipe(world)
    p = pipe.mesh.size
    assert pipe.stages == 2 and pipe.stage == world.rank // p
    assert pipe.mesh.ranks == tuple(range(pipe.stage * p, (pipe.stage + 1) * p))
    assert pipe.lane_ranks == (world.rank % p, world.rank % p + p)  # the same (k, i, j) in both meshes
    assert torch.distributed.get_process_group_ranks(pipe.lane) == list(pipe.lane_ranks)
    wanted = os.environ.get("OPTIMUS2D_TRANSPORT", "mpi")
    assert pipe.mesh.transport == (wanted if p > 1 else "torch"), pipe.mesh


def _stages(pipe, serial, stage_ids, num_stages, n, b, h, recompute=False):
    """This rank's chunks (equal slices of ``serial``, converted on its stage mesh; ``recompute``: each
    layer in torch's ``checkpoint_wrapper``) and their torch stages for micro-batches ``[b/n, S, h]``."""
    per_chunk = LAYERS // num_stages
    chunks, stages = [], []
    for sid in stage_ids:
        chunk = optimus2d.parallelize(copy.deepcopy(serial[sid * per_chunk : (sid + 1) * per_chunk]), pipe.mesh)
        if recompute:  # activation checkpointing: each layer's forward runs again in backward
            for at, layer in enumerate(chunk):
                chunk[at] = checkpoint_wrapper(layer)
        chunks.append(chunk)
        shape = (b // n, S, h)
        stages.append(pipeline_stage(chunk, pipe, microbatch_shape=shape, stage_index=sid, num_stages=num_stages))
    return chunks, stages


@pytest.mark.parametrize("mode", ["sum", "mean", "frozen", "recompute"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_matches_serial(world, name, mode):
    if mode != "sum" and name not in ("1F1B", "Interleaved1F1B"):
        pytest.skip("the mean loss and a frozen first chunk on two schedules are enough")
    mean = mode == "mean"
    pipe, n = _pipe(world), 4
    b, h, heads = _dims(pipe)
    cls, indices = SCHEDULES[name]
    stage_ids = indices(pipe.stage, pipe.stages)
    num_stages = pipe.stages * len(stage_ids)
    per_chunk = LAYERS // num_stages
    torch.manual_seed(1)
    x, probe = torch.randn(b, S, h, dtype=torch.float64), torch.randn(b, S, h, dtype=torch.float64)
    scale = 1.0 / (b // n * S * h) if mean else 1.0  # the mean of each micro-batch, averaged as serial

    serial = _serial(h, heads)
    if mode == "frozen":  # the first chunk learns nothing: its output has no grad_fn, and still gets a gradient sent
        serial[:per_chunk].requires_grad_(False)
    chunks, stages = _stages(pipe, serial, stage_ids, num_stages, n, b, h, recompute=mode == "recompute")

    def loss_fn(out, target):  # the micro-batch's global loss, the same on every rank of the mesh
        return mesh_sum(out * target, pipe.mesh) * scale

    if len(stages) == 1:
        schedule = cls(stages[0], n_microbatches=n, loss_fn=loss_fn, scale_grads=mean)
    else:
        schedule = cls(stages, n_microbatches=n, loss_fn=loss_fn, scale_grads=mean)
    losses: list[torch.Tensor] = []
    args = (optimus2d.scatter(x, pipe.mesh),) if 0 in stage_ids else ()
    last = num_stages - 1 in stage_ids
    target = optimus2d.scatter(probe, pipe.mesh) if last else None
    schedule.step(*args, target=target, losses=losses if last else None)

    trained = [p for c in chunks for p in c.parameters() if p.requires_grad]
    grads = [as_serial(c) for c in chunks]
    if trained:
        torch.optim.AdamW(trained, lr=1e-2).step()
    states = [optimus2d.serial_state_dict(c) for c in chunks]  # the last collectives

    y = serial(x)
    loss_ref = (y * probe).sum() * (1.0 / (b * S * h) if mean else 1.0)
    loss_ref.backward()
    torch.optim.AdamW([p for p in serial.parameters() if p.requires_grad], lr=1e-2).step()
    ref_grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in serial.named_parameters()}
    ref_state = serial.state_dict()
    if last:
        got = torch.stack(losses).sum() if not mean else torch.stack(losses).mean()
        assert_close(got, loss_ref.detach(), TOL, "loss")
    labels = [f"stage {sid}" for sid in stage_ids]  # a slice of nn.Sequential keeps the serial keys
    assert_chunks_match(labels, grads, states, ref_grads, ref_state, TOL, ADAM_TOL)


def test_pipeline_stage_refuses_what_does_not_fit_on_every_rank(world):
    """Before any stage is built (nothing is sent): a layout that is not one, a next stage mesh that
    does not exist, and, on a mesh that splits, a batch the mesh does not divide, with the numbers."""
    pipe = _pipe(world)
    b, h, _ = _dims(pipe)
    chunk, shape = nn.Identity(), (b // 4, S, h)
    with pytest.raises(ValueError, match="input_layout='images' is not 'activation' or 'batch'"):
        pipeline_stage(chunk, pipe, microbatch_shape=shape, dtype=torch.float64, input_layout="images")
    with pytest.raises(ValueError, match=r"next_stage=5 is not a stage mesh of 0\.\.1"):
        pipeline_stage(chunk, pipe, microbatch_shape=shape, dtype=torch.float64, stage_index=0, next_stage=5)
    splits = pipe.mesh.depth * pipe.mesh.q
    if splits == 1:
        return
    odd = (splits + 1, S, h)
    with pytest.raises(ValueError, match=rf"microbatch_shape=\({splits + 1}, {S}, {h}\) must be .* depth·q = {splits}"):
        pipeline_stage(chunk, pipe, microbatch_shape=odd, dtype=torch.float64)
    images = (splits + 1, 3, 16, 16)
    with pytest.raises(ValueError, match=rf"batch microbatch_shape=\({splits + 1}, 3, 16, 16\) .* depth·q = {splits}"):
        pipeline_stage(chunk, pipe, microbatch_shape=images, dtype=torch.float64, input_layout="batch")


def test_checkpoint_save_refuses_stage_meshes_as_replicas(world, tmp_path_factory):
    """Stage meshes have one shape over disjoint ranks, as data-parallel replicas do, but hold
    different layers: ``checkpoint.save`` (replica 0 writes) would keep only the first stage's.
    Refused on every rank with each stage's tensors named, nothing written."""
    pipe = _pipe(world)
    _, h, heads = _dims(pipe)
    per = LAYERS // pipe.stages
    chunk = optimus2d.parallelize(_serial(h, heads)[pipe.stage * per : (pipe.stage + 1) * per], pipe.mesh)
    path = shared_tmp(tmp_path_factory, "refused") / "ckpt"
    with pytest.raises(ValueError, match=r"checkpoint\.save over replica meshes .*save_stages\).*disagree") as info:
        checkpoint.save(path, chunk)
    first = pipe.mesh.size  # stage 0's ranks, named as one group
    who = f"ranks {', '.join(map(str, range(first)))}" if first > 1 else "rank 0"
    assert f"{who}: a model of" in str(info.value)
    assert f"({per}.self_attn.in_proj_weight[{3 * h}, {h}]" in str(info.value)  # the second stage's first layer
    assert not path.exists()


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n not in ("ZBVZeroBubble", "DualPipeV")])
def test_schedule_eval_is_the_serial_forward(world, name):
    """``schedule.eval``: forwards only (validation), the losses equal the serial model's, no gradient
    anywhere; then a training step still runs on the same schedule."""
    pipe, n = _pipe(world), 4
    b, h, heads = _dims(pipe)
    cls, indices = SCHEDULES[name]
    stage_ids = indices(pipe.stage, pipe.stages)
    num_stages = pipe.stages * len(stage_ids)
    torch.manual_seed(1)
    x, probe = torch.randn(b, S, h, dtype=torch.float64), torch.randn(b, S, h, dtype=torch.float64)
    serial = _serial(h, heads)
    chunks, stages = _stages(pipe, serial, stage_ids, num_stages, n, b, h)
    schedule = cls(
        stages if len(stages) > 1 else stages[0], n_microbatches=n, scale_grads=False,
        loss_fn=lambda out, target: mesh_sum(out * target, pipe.mesh),
    )  # fmt: skip
    last = num_stages - 1 in stage_ids
    args = (scatter_microbatches(x, pipe.mesh, n),) if 0 in stage_ids else ()
    target = scatter_microbatches(probe, pipe.mesh, n) if last else None
    for step in ("eval", "step", "eval"):
        losses: list[torch.Tensor] = []
        getattr(schedule, step)(*args, target=target, losses=losses if last else None)
        if step == "eval":
            assert all(p.grad is None for c in chunks for p in c.parameters()), "eval left a gradient"
        else:
            assert all(p.grad is not None for c in chunks for p in c.parameters())
            for c in chunks:
                c.zero_grad(set_to_none=True)
        if last:
            with torch.no_grad():
                ref = [(m * t).sum() for m, t in zip(serial(x).chunk(n), probe.chunk(n), strict=True)]
            for got, want in zip(losses, ref, strict=True):
                assert_close(got.detach(), want, TOL, f"{step} micro-batch loss")
