"""Ranks that disagree are caught on every rank, fast: never a silent wrong block, never a hang.

Each case builds meshes of its own (a failure is fatal to a mesh), makes one rank (the last)
differ from its peers, and asserts that every rank raises the expected error within ``helpers.FAST_S``:
a sixth of the suite's collective timeout (120 s), so the error came from the check or the
peer's report, not from a wait running out, with room for 9 ranks sharing 2 cores.
Run at every world size of the suite, over MPI and over gloo (``OPTIMUS2D_TRANSPORT=torch``).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from helpers import FAST_S, Scale, assert_close, raises_fast
from torch import nn

import optimus2d
from optimus2d import Mesh
from optimus2d.comm import primitives as P
from optimus2d.comm import watch

pytestmark = pytest.mark.mpi


def _last(world) -> bool:
    return world.rank == world.size - 1


def test_meshes_that_differ_are_refused_on_every_rank(world):
    if world.size == 1:
        pytest.skip("one rank")
    q = math.isqrt(world.size) if world.size != 8 else 2
    asked = (1, world.size) if _last(world) else (q, world.size // (q * q))
    message = raises_fast(ValueError, r"Mesh: the ranks disagree", lambda: Mesh(*asked))
    assert f"this rank ({world.rank})" in message and f"rank {world.size - 1}: Mesh(q=1, depth={world.size}" in message
    Mesh(q, world.size // (q * q))  # the next mesh is agreed again


def test_a_mesh_one_rank_cannot_build_is_refused_on_every_rank(world):
    if world.size == 1:
        pytest.skip("one rank")
    ranks = [0] * world.size if _last(world) else list(range(world.size))
    message = raises_fast(
        ValueError, r"rank \d+ refused it: ValueError: Mesh ranks", lambda: Mesh(1, world.size, ranks)
    )
    assert f"rank {world.size - 1} refused it" in message


def _block_linear(mesh, rows=2):
    torch.manual_seed(0)
    serial = nn.Linear(4 * mesh.q, 6 * mesh.q)
    layer = optimus2d.layers.Linear2D.from_serial(serial, mesh)
    return layer, torch.randn(rows, 3, 4)


@pytest.mark.parametrize("what", ["batch", "sequence", "features"])
def test_an_input_of_another_shape_on_one_rank(world, world_mesh, what):
    layer, x = _block_linear(world_mesh)
    if _last(world):
        grow = {"batch": (1, 0, 0), "sequence": (0, 1, 0), "features": (0, 0, 1)}[what]
        x = torch.randn(2 + grow[0], 3 + grow[1], 4 + grow[2])
    message = raises_fast(ValueError, r"Linear2D on Mesh.*the ranks disagree", lambda: layer(x))
    assert f"this rank ({world.rank}) has Linear2D of float32{list(x.shape)}" in message
    assert f"rank {world.size - 1}: Linear2D of float32" in message


def test_a_dtype_that_differs_on_one_rank(world, world_mesh):
    layer, x = _block_linear(world_mesh)
    x = x.double() if _last(world) else x
    raises_fast(ValueError, r"float64\[2, 3, 4\]", lambda: layer(x))


def test_a_scalar_kept_whole_frozen_on_one_rank(world, world_mesh):
    """A scalar kept whole on every rank, its gradient summed over the mesh by a hook, frozen on one
    rank: that rank skipped the sum and the others waited to the timeout. Each module call on the
    mesh agrees which of those parameters are frozen: refused on every rank, naming it."""

    torch.manual_seed(0)
    q = world_mesh.q
    model = optimus2d.parallelize(nn.Sequential(nn.Linear(4 * q, 4 * q), Scale(), nn.Linear(4 * q, 4 * q)), world_mesh)
    model[1].s.requires_grad_(not _last(world))
    x = optimus2d.scatter(torch.randn(2 * world_mesh.size, 3, 4 * q), world_mesh)
    raises_fast(ValueError, r"Linear2D on Mesh.*frozen Scale\.s", lambda: model(x).sum().backward())


@pytest.mark.parametrize("how", ["input requires grad", "no grad", "eval", "weight frozen"])
def test_grad_mode_and_training_that_differ_on_one_rank(world, world_mesh, how):
    """A layer picks its algorithm (and its backward its collectives) by whether its input needs a
    gradient and the grad mode: one rank's other choice waited to the timeout. One rank's eval()
    ran without its dropout (1.02 off). A weight frozen on one rank skipped its gradient's
    collectives: the peers waited to the timeout. Each is refused on every rank at once."""
    layer, x = _block_linear(world_mesh)
    odd = _last(world)
    if how == "eval":
        layer.train(not odd)
    if how == "weight frozen":
        layer.weight.requires_grad_(not odd)
        x.requires_grad_()
    x = x.requires_grad_() if how == "input requires grad" and odd else x
    with torch.set_grad_enabled(not (how == "no grad" and odd)):
        pattern = {"eval": r"training (True|False)", "weight frozen": "frozen weight"}.get(
            how, "requires grad|grad mode"
        )
        raises_fast(ValueError, rf"Linear2D on Mesh.*({pattern})", lambda: layer(x))


def test_cross_entropy_refused_by_one_rank_is_refused_by_all(world, world_mesh):
    """Refused on every rank, and the mesh stays usable: a loop that catches the refusal and skips
    the batch goes on (the refusal was reported as a failure: the next wait of over a second, a
    peer late from its data loader, raised PeerFailedError)."""
    q = world_mesh.q
    logits = optimus2d.scatter(torch.zeros(2 * world_mesh.size, 3, 4 * q), world_mesh)
    target = optimus2d.scatter_batch(torch.zeros(2 * world_mesh.size, 3, dtype=torch.long), world_mesh)
    short = target[:, :2] if _last(world) else target  # another shape than its logits': refused there
    raises_fast(
        ValueError,
        r"cross_entropy on Mesh.*rank \d+ refused it: ValueError: cross_entropy: target of shape",
        lambda: optimus2d.cross_entropy(logits, short, world_mesh),
    )
    if world.rank == 0:
        time.sleep(2.0)  # longer than a wait takes to hear a failure reported (0.2 s, then 1 s of grace)
    loss = optimus2d.cross_entropy(logits, target, world_mesh)
    assert_close(loss, torch.tensor(math.log(4 * q)), 1e-6, "the next loss")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_target_out_of_range_on_one_rank_is_refused_by_all(world, world_mesh, reduction):
    """One rank's targets edited after ``scatter_batch`` (its row's others in range): the flag
    was summed over col and depth alone, so the ranks of that row raised and the others returned
    the loss; a loop that skipped the batch then waited to the timeout. Now every rank raises,
    and the next loss is right."""
    q = world_mesh.q
    logits = optimus2d.scatter(torch.zeros(2 * world_mesh.size, 3, 4 * q), world_mesh)
    target = optimus2d.scatter_batch(torch.zeros(2 * world_mesh.size, 3, dtype=torch.long), world_mesh)
    bad = target.clone()
    if _last(world):
        bad[0, 0] = 4 * q
    call = lambda: optimus2d.cross_entropy(logits, bad, world_mesh, reduction=reduction)  # noqa: E731
    raises_fast(ValueError, rf"a target class is outside \[0, {4 * q}\)", call)
    loss = optimus2d.cross_entropy(logits, target, world_mesh)
    assert_close(loss, torch.tensor(math.log(4 * q)), 1e-6, "the next loss")


def test_a_module_called_on_a_rank_outside_its_mesh_says_so(world, world_mesh):
    """A 1×1×2 mesh over ranks 0 and 1: a Linear2D built on it everywhere (its blocks need no
    coordinates) and called on rank 2 raised a KeyError from MPI's communicators."""
    sub = optimus2d.Mesh(1, 2, ranks=[0, 1])
    layer = optimus2d.layers.Linear2D(4, 4, mesh=sub)
    if world.rank in (0, 1):
        assert layer(optimus2d.scatter(torch.ones(2, 3, 4), sub)).shape == (1, 3, 4)
    else:
        with pytest.raises(ValueError, match=rf"Linear2D: rank {world.rank} is not in Mesh\(q=1, depth=2"):
            layer(torch.ones(1, 3, 4))


def test_token_ids_of_another_length_on_one_rank(world, world_mesh):
    embedding = optimus2d.layers.Embedding2D(10, 4 * world_mesh.q, mesh=world_mesh)
    ids = torch.zeros(2, 5 if _last(world) else 4, dtype=torch.long)
    raises_fast(ValueError, r"Embedding2D on Mesh.*int64\[2, 5\]", lambda: embedding(ids))


def test_token_ids_out_of_range_on_one_rank(world, world_mesh):
    embedding = optimus2d.layers.Embedding2D(10, 4 * world_mesh.q, mesh=world_mesh)
    ids = torch.full((2, 4), 10 if _last(world) else 1, dtype=torch.long)
    raises_fast(ValueError, r"token ids outside \[0, 10\)", lambda: embedding(ids))


@pytest.mark.parametrize("fn", ["scatter", "scatter_batch"])
def test_a_full_input_that_differs_on_one_rank(world, world_mesh, fn):
    n = world_mesh.size
    x = torch.arange(float(n * 8 * world_mesh.q)).view(n, 2, 4 * world_mesh.q)
    if _last(world):
        x = x.flip(0)  # the same values, the batch in another order
    if fn == "scatter_batch":
        x = x.long()
    message = raises_fast(
        ValueError, rf"{fn} on Mesh.*hold different values", lambda: getattr(optimus2d, fn)(x, world_mesh)
    )
    assert f"rank {world.size - 1}: {fn} of" in message
    getattr(optimus2d, fn)(x, world_mesh, check=False)  # the documented opt-out: no exchange at all


def test_a_constant_full_input_that_differs_on_one_rank(world, world_mesh):
    """Rows of one value met an even number of times: xor alone would hash ones and sevens alike."""
    x = torch.full((world_mesh.size, 2, 4 * world_mesh.q), 7.0 if _last(world) else 1.0)
    message = raises_fast(
        ValueError, r"scatter on Mesh.*hold different values", lambda: optimus2d.scatter(x, world_mesh)
    )
    assert f"rank {world.size - 1}: scatter of" in message


def test_a_full_input_refused_by_one_rank_is_refused_by_all(world, world_mesh):
    x = torch.randn(world_mesh.size + (1 if _last(world) else 0), 4 * world_mesh.q)
    raises_fast(
        ValueError,
        rf"rank {world.size - 1} refused it: ValueError: scatter: batch dim 0",
        lambda: optimus2d.scatter(x, world_mesh),
    )


def test_gather_of_a_full_tensor_is_refused(world, world_mesh):
    torch.manual_seed(0)
    x = torch.randn(world_mesh.size, 4 * world_mesh.q)
    optimus2d.scatter(x, world_mesh)
    raises_fast(
        ValueError,
        r"gather expects a local block, but this tensor .* is a full one",
        lambda: optimus2d.gather(x, world_mesh),
    )
    y = optimus2d.gather(optimus2d.scatter(x, world_mesh), world_mesh)
    raises_fast(ValueError, r"is a full one", lambda: optimus2d.gather(y, world_mesh))


def test_a_block_of_another_mesh_of_the_same_shape_is_refused(world, world_mesh):
    reversed_mesh = Mesh(world_mesh.q, world_mesh.depth, list(reversed(world_mesh.ranks)))
    layer, _ = _block_linear(world_mesh)  # seeds: x is the same on every rank
    x = torch.randn(world_mesh.size * 2, 3, 4 * world_mesh.q)
    raises_fast(
        ValueError,
        r"its input is a block of Mesh.*not of this module's",
        lambda: layer(optimus2d.scatter(x, reversed_mesh)),
    )


def test_empty_inputs_are_refused_on_every_rank(world, world_mesh):
    layer, _ = _block_linear(world_mesh)
    raises_fast(ValueError, r"empty along dim 0", lambda: layer(torch.randn(0, 3, 4)))
    raises_fast(
        ValueError,
        r"empty along dim 1",
        lambda: optimus2d.scatter(torch.randn(world_mesh.size, 0, 4 * world_mesh.q), world_mesh),
    )
    ids = torch.zeros(world_mesh.size, 0, dtype=torch.long)
    raises_fast(ValueError, r"empty along dim 1", lambda: optimus2d.scatter_batch(ids, world_mesh))
    x = torch.randn(0 if _last(world) else 2, 3, 4)  # one rank's batch alone is empty
    raises_fast(
        ValueError,
        rf"rank {world.size - 1} refused it: ValueError: Linear2D: input of shape \[0, 3, 4\] is empty",
        lambda: layer(x),
    )


def test_a_rank_on_another_code_path_is_caught(world, world_mesh):
    layer, x = _block_linear(world_mesh)
    norm = optimus2d.layers.LayerNorm2D(4 * world_mesh.q, mesh=world_mesh)
    call = (lambda: norm(x)) if _last(world) else (lambda: layer(x))
    message = raises_fast(ValueError, r"the ranks disagree", call)
    assert "LayerNorm2D of float32[2, 3, 4]" in message and "Linear2D of float32[2, 3, 4]" in message


def test_serial_weights_that_differ_are_named(world, world_mesh):
    torch.manual_seed(world.rank if _last(world) else 0)  # the README's old snippet: no common seed
    model = nn.Sequential(nn.Linear(4 * world_mesh.q, 8 * world_mesh.q), nn.GELU(), nn.Linear(8 * world_mesh.q, 4))
    with torch.no_grad():
        model[2].weight.zero_()  # the same on every rank: not named
    message = raises_fast(
        ValueError,
        r"parallelize: the serial weights on Mesh.*3 of 4 tensors differ",
        lambda: optimus2d.parallelize(model, world_mesh),
    )
    assert "0.weight, 0.bias, 2.bias" in message and "2.weight" not in message


def test_every_collective_is_checked_at_the_debug_level(world):
    if world.size == 1:
        pytest.skip("one rank")
    mesh = Mesh(1, world.size, check="every")
    t = torch.ones(3 if _last(world) else 2)
    message = raises_fast(
        ValueError, r"all_reduce over depth of Mesh.*the ranks disagree", lambda: P.all_reduce(t, mesh, "depth")
    )
    assert "float32[3]" in message and "float32[2]" in message


def test_one_ranks_error_reaches_its_peers_at_once(world, world_mesh):
    layer, x = _block_linear(world_mesh)
    if _last(world):  # fails in its own code, as a data loader would; init()'s excepthook reports it
        start = time.monotonic()
        # report_failure tells every mesh of this rank; here only this test's own, so that the
        # session's other meshes (the fixture's, used by later tests) do not read it as fresh news
        watch.report(RuntimeError("the data loader ran dry"), meshes=[world_mesh])
    else:
        start = time.monotonic()
        with pytest.raises(
            optimus2d.faults.PeerFailedError, match=rf"rank {world.size - 1}: RuntimeError: the data loader ran dry"
        ):
            optimus2d.gather(layer(x), world_mesh)
    assert time.monotonic() - start < FAST_S
    dist.barrier()


def test_a_rank_that_skips_a_collective_is_a_timeout_on_the_others(world, world_mesh):
    timeout = 1.0
    world_mesh.timeout = timeout  # this test's own mesh: the timeout is fatal to it
    if world_mesh.mpi is not None:
        world_mesh.mpi.timeout = timeout
    layer, x = _block_linear(world_mesh)
    if not _last(world):  # the last rank never joins: its peers wait for it, not forever
        start = time.monotonic()
        with pytest.raises((TimeoutError, optimus2d.faults.PeerFailedError), match=r"did not complete within 1 s"):
            layer(x)
        assert time.monotonic() - start < FAST_S  # the message names the 1 s wait; this bounds the hang
    dist.barrier()
