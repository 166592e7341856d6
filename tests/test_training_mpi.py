"""Gradient clipping, dropout seeding, activation checkpointing and saved-activation memory."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, assert_state_close
from torch import nn
from torch.utils.checkpoint import checkpoint

import optimus2d
from optimus2d import clip_grad_norm_, gather, scatter, scatter_batch, serial_state_dict
from optimus2d.cost.memory import saved_activation_bytes
from optimus2d.layers import Dropout2D, TransformerBlock2D

pytestmark = pytest.mark.mpi

E, HEADS, SEQ = 12, 6, 5


def _serial_block(dropout=0.0, d_model=E, heads=HEADS, ffn=4 * E):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(
        d_model, heads, ffn, dropout=dropout, activation="gelu", batch_first=True, norm_first=True
    )


def test_clip_grad_norm_is_the_serial_norm(mesh):
    serial = _serial_block()
    parallel = TransformerBlock2D.from_serial(serial, mesh)
    torch.manual_seed(1)
    x = torch.randn(2 * mesh.depth * mesh.q, SEQ, E)
    serial(x).square().sum().backward()
    parallel(scatter(x, mesh)).square().sum().backward()
    norm_ref = torch.nn.utils.clip_grad_norm_(serial.parameters(), max_norm=0.5)
    norm = clip_grad_norm_(parallel.parameters(), max_norm=0.5)  # the mesh found from the parameters
    inf_ref = max(p.grad.abs().max() for p in serial.parameters())  # after clipping, both sides
    inf = clip_grad_norm_(parallel.parameters(), max_norm=1e9, mesh=mesh, norm_type=float("inf"))
    least_ref = torch.nn.utils.clip_grad_norm_(serial.parameters(), max_norm=1e9, norm_type=float("-inf"))
    least = clip_grad_norm_(parallel.parameters(), max_norm=1e9, norm_type=float("-inf"))  # was 1.0
    with pytest.raises(ValueError, match=r"norm_type=0 is not taken"):
        clip_grad_norm_(parallel.parameters(), max_norm=1e9, norm_type=0)
    with pytest.raises(TypeError, match=r"mesh=1\.0 is not a Mesh.*pass norm_type=1\.0"):  # torch's order
        clip_grad_norm_(parallel.parameters(), 1e9, 1.0)
    torch.optim.SGD(serial.parameters(), lr=1.0).step()
    torch.optim.SGD(parallel.parameters(), lr=1.0).step()
    state = serial_state_dict(parallel)
    assert norm_ref > 0.5  # clipping did happen
    assert_close(norm, norm_ref, what="total norm")
    assert_close(inf, inf_ref, what="inf norm")
    assert abs(least - least_ref) <= 1e-5 * inf_ref, (least, least_ref)  # the smallest |g|: rounding's scale
    assert_state_close(state, serial.state_dict())
    next(iter(parallel.parameters())).grad[0, 0] = float("nan") if mesh.index("mesh") == 0 else 0.0
    with pytest.raises(RuntimeError, match=r"total norm of order 2.0 of the gradients is non-finite"):
        clip_grad_norm_(parallel.parameters(), 1e9, error_if_nonfinite=True, foreach=True)  # on every rank


def test_clip_grad_norm_of_order_minus_inf_skips_the_padding(mesh):
    """A vocabulary q does not divide: the table's last block holds zero rows, which the smallest
    |g| took (0 where serial gave 4.9e-4)."""
    vocab, rows = 4 * mesh.q + 1, 2 * mesh.depth * mesh.q
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Embedding(vocab, 4 * mesh.q), nn.Linear(4 * mesh.q, 4 * mesh.q))
    parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    ids = (torch.arange(rows * 4) % vocab).view(rows, 4)  # every token: no serial row without a gradient
    probe = torch.randn(rows, 4, 4 * mesh.q)
    (serial(ids) * probe).sum().backward()
    (parallel(scatter_batch(ids, mesh)) * scatter(probe, mesh)).sum().backward()
    least_ref = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9, norm_type=float("-inf"))
    least = clip_grad_norm_(parallel.parameters(), 1e9, norm_type=float("-inf"))
    assert least_ref > 0 and abs(least - least_ref) <= 1e-4 * least_ref, (least, least_ref)


def test_clip_grad_norm_refuses_on_every_rank_settings_one_rank_changes(mesh):
    """One rank's norm_type=inf was a max all-reduce against the others' sums (over MPI: norms that
    differ by rank, no error); its own max_norm clipped its blocks alone. Refused, nothing clipped."""
    if mesh.size == 1:
        pytest.skip("one rank agrees with itself")
    parallel = TransformerBlock2D.from_serial(_serial_block(), mesh)
    parallel(scatter(torch.randn(2 * mesh.depth * mesh.q, SEQ, E), mesh)).square().sum().backward()
    grads = [p.grad.clone() for p in parallel.parameters()]
    odd = mesh.index("mesh") == mesh.size - 1
    params = list(parallel.parameters())
    for kwargs in ({"norm_type": float("inf") if odd else 2.0}, {"max_norm": 0.01 if odd else 0.1}, {"n": odd}):
        n = kwargs.pop("n", 0)
        with pytest.raises(ValueError, match=r"clip_grad_norm_ on Mesh"):
            clip_grad_norm_(params[n:], **{"max_norm": 0.1, "mesh": mesh, **kwargs})
    assert all(torch.equal(p.grad, g) for p, g in zip(parallel.parameters(), grads, strict=True))


@pytest.mark.parametrize("odd", ["max_norm", "norm_type", "refusal"])
def test_clip_grad_norm_over_stages_agrees_the_settings_of_every_stage(world, odd):
    """With a pipeline's ``StageMesh``: one stage's other max_norm clipped its gradients alone, its
    other norm_type sent a max over the lane where the others summed, and a refusal on one stage
    left the others waiting in the lane's all-reduce. Each is raised on every rank of every stage
    at once, nothing clipped."""
    from helpers import raises_fast, stage_pipe

    if world.size not in (2, 4, 8):
        pytest.skip("2 stages of 1, 1×1×2 or 2×2")
    pipe = stage_pipe(2, *{2: (1, 1), 4: (1, 2), 8: (2, 1)}[world.size])
    torch.manual_seed(pipe.stage)
    layer = optimus2d.layers.Linear2D.from_serial(nn.Linear(4 * pipe.mesh.q, 4 * pipe.mesh.q), pipe.mesh)
    layer(scatter(torch.randn(2 * pipe.mesh.size, 3, 4 * pipe.mesh.q), pipe.mesh)).square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    last = pipe.stage == pipe.stages - 1
    kwargs = {"max_norm": 0.1, "norm_type": 2.0}
    if last and odd != "refusal":
        kwargs[odd] = {"max_norm": 0.01, "norm_type": float("inf")}[odd]
    if last and odd == "refusal":
        kwargs["norm_type"] = 0.0
    message = r"norm_type=0.0 is not taken" if odd == "refusal" else r"clip_grad_norm_ over the ranks .*disagree"
    raises_fast(ValueError, message, lambda: clip_grad_norm_(list(layer.parameters()), pipe=pipe, **kwargs))
    assert all(torch.equal(p.grad, g) for p, g in zip(layer.parameters(), grads, strict=True))


@pytest.mark.parametrize("odd", ["max_norm", "refusal"])
def test_clip_grad_norm_over_copies_agrees_the_settings_of_every_copy(world, odd):
    """A pipeline with data-parallel copies: one copy's other max_norm made the copies' weights
    part (0.21 after one SGD step, no error), and its refusal left the other copy waiting. Raised on
    every rank of every copy at once, nothing clipped."""
    from helpers import raises_fast, stage_pipe

    if world.size != 4:
        pytest.skip("2 stages of 1 rank, 2 copies")
    pipe = stage_pipe(2, 1, dp=2)
    torch.manual_seed(pipe.stage)
    layer = optimus2d.layers.Linear2D.from_serial(nn.Linear(4, 4), pipe.mesh)
    layer(scatter(torch.randn(2, 3, 4), pipe.mesh)).square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    kwargs = {"max_norm": 0.1, "norm_type": 2.0}
    if pipe.dp_rank == 1:
        kwargs.update({"max_norm": 1.0} if odd == "max_norm" else {"norm_type": 0.0})
    message = r"norm_type=0.0 is not taken" if odd == "refusal" else r"clip_grad_norm_ over the copies .*disagree"
    raises_fast(ValueError, message, lambda: clip_grad_norm_(list(layer.parameters()), pipe=pipe, **kwargs))
    assert all(torch.equal(p.grad, g) for p, g in zip(layer.parameters(), grads, strict=True))


def test_clip_grad_norm_finds_the_meshes_of_its_parameters(mesh):
    plain = nn.Linear(3, 4)
    plain(torch.ones(2, 3)).sum().backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    norm = clip_grad_norm_(plain.parameters(), max_norm=0.1)  # no mesh anywhere: torch's own
    assert_close(norm, torch.cat([g.flatten() for g in grads]).norm(), what="plain norm")
    from optimus2d import Mesh

    other = Mesh(1, mesh.size)  # over the same ranks: each parameter's replicas counted on its own mesh
    serial = [_serial_block(), _serial_block()]
    blocks = [TransformerBlock2D.from_serial(s, m) for s, m in zip(serial, (mesh, other), strict=True)]
    x = torch.randn(2 * mesh.size, 4, E)
    for s, block, m in zip(serial, blocks, (mesh, other), strict=True):
        s(x).square().sum().backward()
        block(scatter(x, m)).square().sum().backward()
    want = torch.nn.utils.clip_grad_norm_([p for s in serial for p in s.parameters()], 1e9)
    for given in (None, mesh, other):
        got = clip_grad_norm_([p for b in blocks for p in b.parameters()], 1e9, given)
        assert_close(got, want, 1e-5, f"norm, mesh={given}")


def test_dropout_masks_differ_between_shards_and_repeat_for_a_seed(mesh):
    drop = Dropout2D(0.5, mesh=mesh)
    ones = torch.ones(2 * mesh.depth * mesh.q, 8, 4 * mesh.q)

    def mask(seed):
        torch.manual_seed(seed)
        return gather(drop(scatter(ones, mesh)), mesh)

    first, again, other = mask(7), mask(7), mask(8)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert set(first.unique().tolist()) == {0.0, 2.0}
    if mesh.size > 1:  # two shards of the tensor: different masks
        b, h = ones.shape[0] // (mesh.depth * mesh.q), 4
        shards = [first[r * b : (r + 1) * b, :, :h] for r in range(mesh.depth * mesh.q)]
        shards += [first[:b, :, c * h : (c + 1) * h] for c in range(1, mesh.q)]
        assert len({tuple(s.flatten().tolist()) for s in shards}) == len(shards)


def test_dropout_turned_off_by_walking_the_modules_is_off(mesh):
    """``m.p = 0`` for every ``nn.Dropout`` (TRL's disable_dropout_in_model) after parallelize: the
    converted dropouts were not nn.Dropout, kept dropping (0.79 off serial, 30 % of outputs zero)."""
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(E, 2 * E), nn.Dropout(0.3), nn.GELU(), nn.Linear(2 * E, E), nn.Dropout(0.3))
    parallel = optimus2d.parallelize(copy.deepcopy(serial), mesh).train()
    for model in (serial, parallel):
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    assert sum(isinstance(m, Dropout2D) for m in parallel.modules()) == 2
    x = torch.randn(2 * mesh.depth * mesh.q, SEQ, E)
    assert_close(gather(parallel(scatter(x, mesh)).detach(), mesh), serial.train()(x), what="without dropout")


def test_activation_checkpointing_replays_collectives_and_dropout(mesh):
    parallel = TransformerBlock2D.from_serial(_serial_block(dropout=0.2), mesh)
    torch.manual_seed(1)
    x = scatter(torch.randn(2 * mesh.depth * mesh.q, SEQ, E), mesh)

    def grads(use_checkpoint):
        parallel.zero_grad()
        torch.manual_seed(11)
        xi = x.clone().requires_grad_()
        y = checkpoint(parallel, xi, use_reentrant=False) if use_checkpoint else parallel(xi)
        y.square().sum().backward()
        return [xi.grad] + [p.grad.clone() for p in parallel.parameters()]

    plain, recomputed = grads(False), grads(True)
    for a, b in zip(plain, recomputed, strict=True):
        assert torch.equal(a, b)


def test_saved_activations_per_rank_are_a_quarter_of_serial(mesh):
    if (mesh.q, mesh.depth) != (2, 1):
        pytest.skip("the bound is stated for the 2×2 mesh")
    serial = _serial_block(d_model=64, heads=4, ffn=256)
    parallel = TransformerBlock2D.from_serial(serial, mesh)
    torch.manual_seed(1)
    x = torch.randn(8, 16, 64, requires_grad=True)
    serial_bytes = saved_activation_bytes(serial, x)
    local_bytes = saved_activation_bytes(parallel, scatter(x, mesh).detach().requires_grad_())
    ratio = local_bytes / (serial_bytes / 4)
    print(f"\nsaved activations: serial {serial_bytes} B, per rank {local_bytes} B = {ratio:.3f} × serial/4")
    assert ratio <= 1.25
