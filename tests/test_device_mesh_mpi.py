"""Meshes from torch's DeviceMesh; data-parallel replicas of a 2×2 mesh under DDP, and their checkpoint.

The mapping tests run on 1, 4, 8 and 9 ranks; the replica tests on 8 (2 replicas × 2×2).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_close
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import optimus2d
from optimus2d import Mesh, checkpoint, gather, parallelize, scatter, scatter_batch, serial_state_dict
from optimus2d.comm.replicas import AXIS_OF_DIM, DIMS

pytestmark = pytest.mark.mpi

SHAPES = {1: [(1, 1)], 4: [(1, 2), (4, 1)], 8: [(2, 2), (8, 1)], 9: [(1, 3)]}  # (depth, q) over the world


def _needs(world, *sizes) -> None:
    if world.size not in sizes:
        pytest.skip(f"runs on {' or '.join(map(str, sizes))} ranks")


def _check_blocks(mesh: Mesh, seed: int) -> None:
    """Every rank holds batch block k·q + i and hidden block j of the full tensor, and the mesh's
    collectives (scatter's check, gather) give it back whole."""
    q, d = mesh.q, mesh.depth
    torch.manual_seed(seed)
    x = torch.randn(2 * d * q, 3 * q)
    block = scatter(x, mesh)
    k, i, j = mesh.coord
    assert torch.equal(block, x.view(d * q, 2, q, 3)[k * q + i, :, j, :])
    assert torch.equal(gather(block, mesh), x)


def _check_groups(mesh: Mesh, sub: DeviceMesh, reused: bool) -> None:
    for dim in DIMS:
        axis = AXIS_OF_DIM[dim]  # the DeviceMesh's group along "row" holds a column of the mesh
        assert mesh.index(axis) == sub.get_coordinate()[DIMS.index(dim)], (dim, axis)
        if mesh.axis_size(axis) > 1:
            if reused:  # the group's own rank order is the mesh's (torch's get_local_rank: the rank in it)
                assert mesh.index(axis) == sub.get_local_rank(dim), (dim, axis)
            assert sorted(mesh.members(axis)) == dist.get_process_group_ranks(sub.get_group(dim)), (dim, axis)
            assert (mesh.group(axis) is sub.get_group(dim)) == reused, (dim, axis)
            assert mesh.group(axis) is not dist.group.WORLD


def test_device_mesh_dims_map_to_the_mesh_order(world):
    _needs(world, 1, 4, 8, 9)
    for depth, q in SHAPES[world.size]:
        dm = init_device_mesh("cpu", (depth, q, q), mesh_dim_names=DIMS)
        mesh, plain = Mesh.from_device_mesh(dm), Mesh(q, depth)
        assert mesh.ranks == plain.ranks == tuple(range(world.size))
        assert mesh.coord == plain.coord == dm.get_coordinate()
        assert mesh.replicas == (mesh.ranks,) and mesh.replica == 0
        assert mesh.device_mesh is dm
        # the DeviceMesh's groups serve, unless one is the world's default group (a 1×1×p mesh)
        _check_groups(mesh, dm, reused=world.size > 1 and depth < world.size)
        _check_blocks(mesh, seed=depth)
        built = plain.device_mesh  # on first use, on every rank
        assert built.mesh_dim_names == DIMS and torch.equal(built.mesh, dm.mesh)
        assert built.get_coordinate() == plain.coord and plain.device_mesh is built


def test_a_device_mesh_in_another_rank_order(world):
    _needs(world, 4, 8, 9)
    depth, q = SHAPES[world.size][0]
    order = torch.arange(world.size).flip(0).view(depth, q, q)  # rank p-1 at (0, 0, 0)
    dm = DeviceMesh("cpu", order, mesh_dim_names=DIMS)
    mesh = Mesh.from_device_mesh(dm)
    assert mesh.ranks == tuple(order.flatten().tolist()) == Mesh(q, depth, ranks=order.flatten().tolist()).ranks
    assert mesh.coord == dm.get_coordinate()
    _check_groups(mesh, dm, reused=False)  # torch sorts a group's ranks: the mesh builds its own, in its order
    _check_blocks(mesh, seed=1)


def test_device_meshes_that_do_not_fit_are_refused_on_every_rank(world):
    _needs(world, 4, 8, 9)
    named = init_device_mesh("cpu", (world.size,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=r"has no dim named 'depth', 'row', 'col'; name the mesh's dims"):
        Mesh.from_device_mesh(named)
    if world.size != 9:
        oblong = init_device_mesh("cpu", (world.size // 4, 1, 4), mesh_dim_names=DIMS)
        with pytest.raises(ValueError, match=r"has 1 rows and 4 columns"):
            Mesh.from_device_mesh(oblong)
    with pytest.raises(TypeError, match=r"needs a torch DeviceMesh, got list"):
        Mesh.from_device_mesh([0, 1, 2, 3])
    _check_blocks(Mesh(*reversed(SHAPES[world.size][0])), seed=2)  # and the next mesh is agreed


@pytest.mark.parametrize("names", [("dp", "depth", "row", "col"), ("depth", "row", "col", "dp")])
def test_replicas_of_a_device_mesh_each_get_their_mesh(world, names):
    _needs(world, 8)
    shape = tuple(2 if n in ("dp", "row", "col") else 1 for n in names)
    dm = init_device_mesh("cpu", shape, mesh_dim_names=names)
    mesh, sub = Mesh.from_device_mesh(dm), dm["depth", "row", "col"]
    dp = names.index("dp")
    expected = tuple(tuple(dm.mesh.select(dp, n).flatten().tolist()) for n in range(2))
    assert mesh.replicas == expected  # ((0, 1, 2, 3), (4, 5, 6, 7)) or ((0, 2, 4, 6), (1, 3, 5, 7))
    assert mesh.replica == dm.get_local_rank("dp") and mesh.ranks == expected[mesh.replica]
    assert mesh.coord == sub.get_coordinate()
    assert torch.equal(mesh.device_mesh.mesh, sub.mesh) and mesh.device_mesh.mesh_dim_names == DIMS
    _check_groups(mesh, sub, reused=True)
    _check_blocks(mesh, seed=10 + mesh.replica)  # each replica its own tensor, at the same time
    assert f"replica {mesh.replica} of 2" in repr(mesh)


def test_replicas_built_from_rank_lists(world):
    _needs(world, 8)
    r = world.rank
    mesh = Mesh(2, ranks=range(4) if r < 4 else range(4, 8))
    assert mesh.replicas == ((0, 1, 2, 3), (4, 5, 6, 7)) and mesh.replica == r // 4
    _check_blocks(mesh, seed=20 + mesh.replica)
    dm = mesh.device_mesh  # collective: every rank asks
    assert dm.mesh_dim_names == DIMS and dm.mesh.flatten().tolist() == list(mesh.ranks)
    single = Mesh(1, ranks=[r])  # pure data parallelism: a replica per rank
    assert single.replicas == tuple((n,) for n in range(8)) and single.replica == r


def test_inconsistent_replicas_are_refused_on_every_rank(world):
    _needs(world, 8)
    r = world.rank
    cases = [  # (ranks asked for, or (q, depth, ranks), and the error)
        (range(4) if r < 4 else [3, 4, 5, 6], r"\(rank 7 not in the mesh it asks for; every rank"),
        (range(4) if r < 4 else [4, 5, 7, 6] if r == 7 else [4, 5, 6, 7], r"\(only ranks 4, 5, 6 ask for the 4-rank"),
        (range(4) if r < 4 else range(4, 8) if r < 6 else range(2, 6), r"not in the mesh it asks for"),
        ((2, 1, range(4)) if r < 4 else (1, 4, range(4, 8)), r"Mesh: the ranks disagree"),
    ]
    for asked, error in cases:
        q, depth, ranks = asked if isinstance(asked, tuple) else (2, 1, asked)
        with pytest.raises(ValueError, match=error) as info:
            Mesh(q, depth, ranks=ranks)
        assert f"this rank ({r})" in str(info.value)
    assert Mesh(2, ranks=range(4) if r < 4 else range(4, 8)).replica == r // 4  # and then a good one builds


def _tiny_llama(seed: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def _serial_step(model, ids, optimizer) -> torch.Tensor:
    optimizer.zero_grad()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())  # the mean over the whole batch
    loss.backward()
    optimizer.step()
    return loss.detach()


def _parallel_step(model, ids, mesh, optimizer) -> torch.Tensor:
    optimizer.zero_grad()
    local = scatter_batch(ids, mesh)
    logits = model(input_ids=local, use_cache=False).logits
    loss = optimus2d.cross_entropy(logits[:, :-1], local[:, 1:], mesh)  # the mean over this replica's batch
    loss.backward()  # DDP: the gradients averaged over the replicas
    optimizer.step()
    return loss.detach()


def test_ddp_over_replicas_steps_like_serial_and_checkpoints_once(world, shared_dir):
    _needs(world, 8)
    dm = init_device_mesh("cpu", (2, 1, 2, 2), mesh_dim_names=("dp", "depth", "row", "col"))
    mesh = Mesh.from_device_mesh(dm["depth", "row", "col"])
    serial = _tiny_llama(0)
    model = DistributedDataParallel(parallelize(copy.deepcopy(serial), mesh), process_group=dm.get_group("dp"))
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (8, 9))  # the global batch: 4 sequences per replica, 2 per rank
    # eps 1e-3: a gradient that is zero in exact arithmetic is rounding noise that Adam's first step
    # would turn into ±lr (as in tests/test_deepcopy_mpi.py)
    opt_ref = torch.optim.AdamW(serial.parameters(), lr=1e-2, eps=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    loss_ref = _serial_step(serial, ids, opt_ref)
    loss = _parallel_step(model, ids[4 * mesh.replica : 4 * mesh.replica + 4], mesh, opt)
    losses = [torch.zeros(()) for _ in range(2)]
    dist.all_gather(losses, loss, group=dm.get_group("dp"))
    assert_close(torch.stack(losses).mean(), loss_ref, 1e-5, "loss")
    state = serial_state_dict(model.module)
    assert set(state) == set(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-5, key)

    path = os.path.join(shared_dir, "ckpt")
    checkpoint.save(path, model, opt)  # every rank calls it; replica 0 writes
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == [f"__{n}_0.distcp" for n in range(4)]
    plain = checkpoint.load(path)  # in this process alone
    assert set(plain) == set(state) and all(torch.equal(plain[k], state[k]) for k in state)
    fresh = _tiny_llama(5)
    fresh.load_state_dict(plain)

    single = Mesh(2, ranks=range(4))  # one 2×2 mesh: ranks 4..7 hold no block of it
    if single.coord is not None:
        other = parallelize(_tiny_llama(5), single)
        opt_other = torch.optim.AdamW(other.parameters(), lr=0.5)
        checkpoint.load(path, other, opt_other)
        assert opt_other.param_groups[0]["lr"] == 1e-2 and opt_other.param_groups[0]["eps"] == 1e-3
        assert all(torch.equal(v, state[k]) for k, v in serial_state_dict(other).items())
        _serial_step(serial, ids, opt_ref)  # the second step, on the whole batch: Adam's moments came back
        _parallel_step(other, ids, single, opt_other)
        for key, value in serial_state_dict(other).items():
            assert_close(value, serial.state_dict()[key], 1e-5, f"step 2: {key}")
    dist.barrier()
    again = _tiny_llama(6)
    model = DistributedDataParallel(parallelize(again, mesh), process_group=dm.get_group("dp"))
    checkpoint.load(path, model)  # both replicas read it, each over its own mesh, at the same time
    assert all(torch.equal(v, state[k]) for k, v in serial_state_dict(model.module).items())


def test_pure_data_parallel_replicas_checkpoint_once(world, shared_dir):
    _needs(world, 8)
    mesh = Mesh(1, ranks=[world.rank])  # 8 replicas of a 1-rank mesh
    torch.manual_seed(0)
    model = parallelize(nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4)), mesh)
    path = os.path.join(shared_dir, "ckpt")
    checkpoint.save(path, model)
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == ["__0_0.distcp"]
    saved = checkpoint.read(path)["model"]
    assert all(torch.equal(saved[k], v) for k, v in serial_state_dict(model).items())


def test_a_device_mesh_is_taken_wherever_a_mesh_is(world):
    """``parallelize``, its ``plan=``, a layer's ``mesh=``, ``scatter``/``gather`` and ``ContextParallel``
    take torch's DeviceMesh (dims "depth", "row", "col"): the same Mesh each time, results as on it."""
    depth, q = SHAPES[world.size][0]
    dm = init_device_mesh("cpu", (depth, q, q), mesh_dim_names=DIMS)
    mesh = optimus2d.comm.mesh.as_mesh(dm)
    assert optimus2d.comm.mesh.as_mesh(init_device_mesh("cpu", (depth, q, q), mesh_dim_names=DIMS)) is mesh
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(4 * q, 8 * q), nn.GELU(), nn.Linear(8 * q, 4 * q))
    model = parallelize(copy.deepcopy(serial), dm, plan={"2": dm})
    assert model[0].mesh is mesh and model[2].mesh is mesh
    x = torch.randn(2 * depth * q, 3, 4 * q)
    assert_close(gather(model(scatter(x, dm)), dm), serial(x), 1e-6, "output")
    layer = optimus2d.layers.Linear2D(4 * q, 4 * q, mesh=dm)
    assert layer.mesh is mesh
    assert optimus2d.context.ContextParallel(dm).mesh is mesh
    with pytest.raises(TypeError, match=r"parallelize's mesh must be an optimus2d.Mesh or a torch DeviceMesh"):
        parallelize(nn.Linear(2, 2), "mesh")
