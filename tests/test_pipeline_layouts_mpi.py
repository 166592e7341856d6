"""Pipeline stages of different mesh shapes (``pipeline_layouts.py``): 2×2 → 1×1×4 and 1×1×4 → 2×2
on 8 ranks, 1 → 1 on 2. Loss, gradients and one AdamW step equal the serial model's (float32) under
GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble, and with a frozen first stage; each boundary sends
what ``redistribute``'s formula says; stages of unequal sizes and ranks that disagree are refused
on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import as_serial, assert_chunks_match, assert_close, stage_pipe
from torch import nn

import optimus2d
from optimus2d import count_comm
from optimus2d.comm.redistribution import plan_moves
from optimus2d.pipeline import (
    SCHEDULES,
    ToNextStage,
    mesh_sum,
    pipeline_stage,
    scatter_microbatches,
    stage_meshes,
)
from optimus2d.pipeline.models.llama import causal_lm_targets

pytestmark = pytest.mark.mpi

# world → name → each stage's (q, depth)
PIPES = {
    2: {"1-1": ((1, 1), (1, 1))},
    8: {"2x2-1x1x4": ((2, 1), (1, 4)), "1x1x4-2x2": ((1, 4), (2, 1))},
}
NAMES = sorted({name for pipes in PIPES.values() for name in pipes})
B, S, H, LAYERS, N = 16, 3, 8, 4, 4  # micro-batch [4, 3, 8]: [2, 3, 4] a rank on 2×2, [1, 3, 8] on 1×1×4
TOL = 1e-5  # float32
# after AdamW: the key bias's serial gradient is 0 and ~1e-8 here, which g/(√v + eps) lifts to ~1e-5 of the bias
ADAM_TOL = 1e-4


def _pipe(world, name):
    shapes = PIPES.get(world.size, {}).get(name)
    if shapes is None:
        pytest.skip(f"{name} runs on {[w for w, pipes in PIPES.items() if name in pipes]} ranks")
    q, depth = zip(*shapes, strict=True)
    return stage_pipe(2, q, depth)


def _serial() -> nn.Sequential:
    torch.manual_seed(0)
    layer = lambda: nn.TransformerEncoderLayer(H, 2, 2 * H, dropout=0.0, batch_first=True)  # noqa: E731
    return nn.Sequential(*[layer() for _ in range(LAYERS)])


@pytest.mark.parametrize("name", NAMES)
def test_stage_meshes_of_two_shapes(world, name):
    pipe = _pipe(world, name)
    shapes, p = PIPES[world.size][name], world.size // 2
    assert pipe.stages == 2 and pipe.stage == world.rank // p and pipe.shapes == shapes
    assert (pipe.mesh.q, pipe.mesh.depth) == shapes[pipe.stage] and pipe.meshes[pipe.stage] is pipe.mesh
    for t, mesh in enumerate(pipe.meshes):  # stage t's shape over this stage's ranks
        assert (mesh.q, mesh.depth) == shapes[t] and mesh.ranks == tuple(range(pipe.stage * p, (pipe.stage + 1) * p))
    assert (pipe.meshes[0] is pipe.meshes[1]) == (shapes[0] == shapes[1])
    assert pipe.lane_ranks == (world.rank % p, world.rank % p + p)  # the n-th rank of each stage
    if world.size > 1:
        assert dist.get_process_group_ranks(pipe.lane) == list(pipe.lane_ranks)
    # the targets of a pipeline of two shapes: its micro-batches re-split at the boundary, so the
    # schedule's micro-batch count is asked for, from the pipeline or its mesh alike
    labels = torch.arange(B * S).reshape(B, S)
    for where in (pipe, pipe.mesh):
        with pytest.raises(ValueError, match=r"causal_lm_targets: the stages have different shapes .* microbatches=n"):
            causal_lm_targets(labels, where)
    block, count = causal_lm_targets(labels, pipe, microbatches=N)
    assert count == B * (S - 1) and block.numel() == B * S // (pipe.mesh.q * pipe.mesh.depth)


def _next_stage(name: str, sid: int, stages: int) -> int | None:
    """The stage mesh running torch stage sid + 1 (V-shaped schedules turn back at the last mesh)."""
    if sid == stages * (2 if name in ("Interleaved1F1B", "ZBVZeroBubble") else 1) - 1:
        return None  # the last stage
    if name == "ZBVZeroBubble":
        return sid + 1 if sid + 1 < stages else 2 * stages - 2 - sid
    return (sid + 1) % stages


def _boundary_sends(pipe, stage_ids, num_stages, name, backward: bool) -> int:
    """The elements this rank sends in one step by ``redistribute``'s plan: over every micro-batch,
    the parts of its output block that other ranks of its stage need in the next stage's shape."""
    total, shape = 0, (B // N, S, H)
    for sid in stage_ids:
        if sid == num_stages - 1 or pipe.meshes[_next_stage(name, sid, pipe.stages)] is pipe.mesh:
            continue
        dst = pipe.meshes[_next_stage(name, sid, pipe.stages)]
        src, me = pipe.mesh, pipe.mesh.rank
        moves = plan_moves(src.ranks, (src.q, src.depth), dst.ranks, (dst.q, dst.depth), "activation", shape)
        forward = sum(_numel(part) for s, r, part in moves if s == me and r != me)
        assert forward == (B // N // 4) * S * (H // 2)  # 2×2 ↔ 1×1×4: the other hidden half of a batch quarter
        total += N * forward * (2 if backward else 1)  # backward sends each received part's gradient back
    return total


def _numel(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


@pytest.mark.parametrize(
    "name, mode",
    [
        ("GPipe", "train"),
        ("1F1B", "train"),
        ("Interleaved1F1B", "train"),
        ("ZBVZeroBubble", "train"),
        ("1F1B", "frozen"),
    ],
)
@pytest.mark.parametrize("pipe_name", NAMES)
def test_schedule_matches_serial(world, pipe_name, name, mode):
    pipe = _pipe(world, pipe_name)
    frozen = mode == "frozen"  # a frozen first stage (an encoder): no gradient crosses the boundary
    cls, indices = SCHEDULES[name]
    stage_ids = indices(pipe.stage, pipe.stages)
    num_stages = pipe.stages * len(stage_ids)
    per_chunk = LAYERS // num_stages
    torch.manual_seed(1)
    x, probe = torch.randn(B, S, H), torch.randn(B, S, H)

    serial = _serial()
    if frozen:
        serial[:per_chunk].requires_grad_(False)
    chunks, stages = [], []
    for sid in stage_ids:
        chunk = optimus2d.parallelize(copy.deepcopy(serial[sid * per_chunk : (sid + 1) * per_chunk]), pipe.mesh)
        chunks.append(chunk)
        grads = {"output_grad": sid > 0, "input_grad": sid > 1} if frozen else {}
        stage = pipeline_stage(
            chunk, pipe, microbatch_shape=(B // N, S, H), stage_index=sid, num_stages=num_stages,
            next_stage=_next_stage(name, sid, pipe.stages), **grads,
        )  # fmt: skip
        out_mesh = pipe.meshes[_next_stage(name, sid, pipe.stages)] if sid < num_stages - 1 else pipe.mesh
        assert isinstance(stage.submod, ToNextStage) == (out_mesh is not pipe.mesh)
        stages.append(stage)

    def loss_fn(out, target):  # the micro-batch's global loss, the same on every rank of the mesh
        return mesh_sum(out * target, pipe.mesh)

    schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=N, loss_fn=loss_fn, scale_grads=False)
    losses: list[torch.Tensor] = []
    # serial micro-batches x.chunk(N)[m] on both ends: each boundary re-splits a micro-batch's samples
    args = (scatter_microbatches(x, pipe.mesh, N),) if 0 in stage_ids else ()
    last = num_stages - 1 in stage_ids
    target = scatter_microbatches(probe, pipe.mesh, N) if last else None
    with count_comm() as counted:
        schedule.step(*args, target=target, losses=losses if last else None)
    sent = sum(r.numel for r in counted.records if r.kind == "send")

    trained = [p for c in chunks for p in c.parameters() if p.requires_grad]
    grads = [as_serial(c) for c in chunks]
    y = serial(x)
    loss_ref = (y * probe).sum()
    loss_ref.backward()
    ref_grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in serial.named_parameters()}
    scale = max(g.abs().max().item() for g in ref_grads.values())
    if trained:  # eps a thousandth of the largest gradient: rounding alone moves nothing (helpers.compare_step)
        torch.optim.AdamW(trained, lr=1e-2, eps=1e-3 * scale).step()
    states = [optimus2d.serial_state_dict(c) for c in chunks]  # the last collectives
    torch.optim.AdamW([p for p in serial.parameters() if p.requires_grad], lr=1e-2, eps=1e-3 * scale).step()
    ref_state = serial.state_dict()

    assert sent == _boundary_sends(pipe, stage_ids, num_stages, name, backward=not frozen), f"sent {sent}"
    if last:
        assert_close(torch.stack(losses).sum(), loss_ref.detach(), TOL, "loss")
    labels = [f"stage {sid}" for sid in stage_ids]  # a slice of nn.Sequential keeps the serial keys
    assert_chunks_match(labels, grads, states, ref_grads, ref_state, TOL, ADAM_TOL)


def test_boundary_bytes_by_hand(world):
    """2×2 → 1×1×4, 1F1B, 4 micro-batches [4, 3, 8] fp32: each rank of stage 0 sends, per micro-batch,
    the other hidden half of its batch quarter, 1·3·4 elements, forward and again backward: 4·2·12·4 =
    384 bytes; stage 1 sends none (torch's lane traffic is not optimus2d's)."""
    pipe = _pipe(world, "2x2-1x1x4")
    serial = _serial()
    chunk = optimus2d.parallelize(copy.deepcopy(serial[pipe.stage * 2 : pipe.stage * 2 + 2]), pipe.mesh)
    stage = pipeline_stage(chunk, pipe, microbatch_shape=(B // N, S, H))
    schedule = SCHEDULES["1F1B"][0](stage, n_microbatches=N, loss_fn=lambda o, t: mesh_sum(o * t, pipe.mesh))
    torch.manual_seed(1)
    x, probe = torch.randn(B, S, H), torch.randn(B, S, H)
    first = pipe.stage == 0
    args = (scatter_microbatches(x, pipe.mesh, N),) if first else ()
    target = None if first else scatter_microbatches(probe, pipe.mesh, N)
    with count_comm() as counted:
        schedule.step(*args, target=target)
    sends = [r for r in counted.records if r.kind == "send"]
    assert sum(r.bytes for r in sends) == (384 if first else 0)
    assert all(r.axis == "mesh" and r.numel == 12 for r in sends) and len(sends) == (8 if first else 0)


def test_unequal_stage_sizes_refused(world):
    """Sizes 4 and 2 (2×2, 1×1×2): the same ValueError on every rank, at any world size, no mesh built."""
    with pytest.raises(ValueError, match=r"different numbers of ranks \(stage 0: Mesh\(q=2, depth=1\), 4 ranks; "
                       r"stage 1: Mesh\(q=1, depth=2\), 2 ranks\)"):  # fmt: skip
        stage_meshes(2, q=(2, 1), depth=(1, 2))
    with pytest.raises(ValueError, match=r"q=\(2, 1, 1\) must be an int or one per stage \(2\)"):
        stage_meshes(2, q=(2, 1, 1))


def test_ranks_asking_for_other_stages_refused(world):
    """Half the ranks ask for 2×2 → 1×1×4, the others for 1×1×4 → 2×2: every rank raises, before any mesh."""
    if world.size != 8:
        pytest.skip("runs on 8 ranks")
    q, depth = ((2, 1), (1, 4)) if world.rank < 4 else ((1, 2), (4, 1))
    with pytest.raises(ValueError, match="stage_meshes: the ranks disagree"):
        stage_meshes(2, q=q, depth=depth)
