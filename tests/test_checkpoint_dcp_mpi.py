"""``optimus2d.checkpoint`` is torch's DCP checkpoint, committed: what it writes DCP's own
``load``/``set_state_dict`` read, what DCP's ``save`` of ``get_state_dict`` writes it reads, a
checkpoint of format 2 (optimus2d before DCP's keys) still loads on every mesh, and ``async_save``
returns once the state is staged, training on while the write and the commit run behind."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import mesh_shapes
from helpers import assert_close, shared_tmp
from test_checkpoint_mpi import SEQ, VOCAB, TiedShared, _parallel, _train
from test_torch_tools_mpi import ADAM, _gpt2, _load_dcp, _other, _save_dcp, _step
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import optimus2d
from optimus2d import checkpoint, parallelize, serial_state_dict

pytestmark = pytest.mark.mpi
_squarest: dict = {}


@pytest.fixture
def squarest(world):
    """The mesh of the world's squarest shape (2×2 on 4 ranks, 2×2×2 on 8, 3×3 on 9): the GPT-2 tests
    run on it alone, the format-2 checkpoint on every shape."""
    if world.size not in _squarest:
        _squarest[world.size] = optimus2d.Mesh(*mesh_shapes(world.size)[-1])
    return _squarest[world.size]


DATA = Path(__file__).parent / "data"  # written by tests/data/make_checkpoint_format2.py at 4450c34


def _same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for key, value in want.items():
        if isinstance(value, dict):
            _same(got[key], value, f"{what}/{key}")
        else:
            assert torch.equal(got[key], value), f"{what}/{key}"


def _resave(model, opt, root: str) -> str:
    checkpoint.save(os.path.join(root, "again"), model, opt)
    return os.path.join(root, "again")


def test_a_format_2_checkpoint_loads_on_every_mesh(mesh, shared_dir):
    """Written on 2×2 by optimus2d's earlier format (``model/<key>``, fused q/k/v in parts, a
    padded vocabulary), with AdamW's state after two steps; loaded here, the run goes on as it did."""
    want = torch.load(DATA / "checkpoint-format2.expected.pt")
    model = _parallel(1, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    checkpoint.load(DATA / "checkpoint-format2", model, opt)
    for key, value in serial_state_dict(model).items():
        assert torch.equal(value, want["model"][key]), key
    assert opt.param_groups[0]["lr"] == 1e-2
    if 12 % (mesh.depth * mesh.q) == 0:  # the batch of 12 splits (not over 1×1×8 nor 1×1×9)
        for got, expected in zip(_train(model, opt, mesh, range(2, 4)), want["losses"], strict=True):
            assert abs(got - expected) <= 1e-5 * abs(expected), (got, expected)
    else:
        resaved = checkpoint.read(_resave(model, opt, shared_dir))  # the optimizer's state went in whole
        _same(resaved["optimizer"], want["read"]["optimizer"], "optimizer, saved again")
    read = checkpoint.read(DATA / "checkpoint-format2")
    _same(read["model"], want["read"]["model"], "model")
    _same(read["optimizer"], want["read"]["optimizer"], "optimizer")


def test_dcp_and_optimus2d_read_each_others_checkpoints(squarest, tmp_path_factory):
    """GPT-2 (fused q/k/v, a padded vocabulary of 97) after two AdamW steps: ``checkpoint.save``
    read by DCP's ``load`` and ``set_state_dict`` onto another mesh shape, DCP's ``save`` read by
    ``checkpoint.load`` (no manifest: ``verify=False``) and by ``read`` into the serial model; one
    more step from each is the serial model's."""
    mesh = squarest
    serial = _gpt2()
    model = parallelize(copy.deepcopy(serial), mesh)
    opt_ref = torch.optim.AdamW(serial.parameters(), **ADAM, foreach=True)
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=True)
    torch.manual_seed(1)
    batches = [torch.randint(0, 97, (2 * mesh.size, 6)) for _ in range(3)]
    for ids in batches[:2]:
        _step(serial, opt_ref, None, ids)
        _step(model, opt, None, ids, mesh)
    root = shared_tmp(tmp_path_factory, "dcp_both_ways")
    checkpoint.save(root / "ours", model, opt)
    _save_dcp(model, opt, root / "theirs")
    trained = serial_state_dict(model)
    _step(serial, opt_ref, None, batches[2])
    for way in ("ours", "theirs"):
        other = parallelize(_gpt2(seed=3), _other(mesh))
        if way == "ours":
            other_opt = _load_dcp(other, root / way)  # torch's own, as torch documents it
        else:
            other_opt = torch.optim.AdamW(other.parameters(), **ADAM, foreach=True)
            checkpoint.load(root / way, other, other_opt, verify=False)
        for key, value in serial_state_dict(other).items():
            assert_close(value, trained[key], 0, f"{way}: {key}")
        _step(other, other_opt, None, batches[2], _other(mesh))
        for key, value in serial_state_dict(other).items():
            assert_close(value, serial.state_dict()[key], 1e-6, f"{way}: {key} after a step")
        fresh = _gpt2(seed=4)
        fresh.load_state_dict(checkpoint.read(root / way, verify=way == "ours")["model"])
        for key, value in fresh.state_dict().items():
            assert_close(value, trained[key], 0, f"{way}, read: {key}")


def test_async_save_commits_the_state_it_was_called_with(squarest, tmp_path_factory):
    """Two steps run while the checkpoint is written; it holds the state of the call (the same
    files as ``save`` at that point), and a second ``async_save`` waits for the first."""
    mesh = squarest
    model = parallelize(_gpt2(), mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=True)
    torch.manual_seed(2)
    batches = [torch.randint(0, 97, (2 * mesh.size, 6)) for _ in range(4)]
    _step(model, opt, None, batches[0], mesh)
    root = shared_tmp(tmp_path_factory, "async")
    checkpoint.save(root / "sync", model, opt)
    pending = checkpoint.async_save(root / "async", model, opt)
    with torch.no_grad():  # at once, before DCP's thread has planned its write: a staged copy is unchanged
        for p in model.parameters():
            p.add_(1.0)
    for ids in batches[1:3]:  # collectives on the mesh while the save's run on groups of their own
        _step(model, opt, None, ids, mesh)
    later = checkpoint.async_save(root / "later", model, opt)
    assert pending.done()  # the second waited for the first
    later.result()
    assert pending.result() is None
    want, got = checkpoint.read(root / "sync"), checkpoint.read(root / "async")
    _same(got["model"], want["model"], "model")
    _same(got["optimizer"], want["optimizer"], "optimizer")
    assert got["meta"] == want["meta"]
    now = serial_state_dict(model)
    _same(checkpoint.read(root / "later")["model"], now, "later")
    other = parallelize(_gpt2(seed=3), _other(mesh))
    checkpoint.load(root / "async", other, torch.optim.AdamW(other.parameters(), **ADAM, foreach=True))
    _same(serial_state_dict(other), want["model"], "loaded")


def test_async_save_refuses_a_foreign_directory_on_every_rank_before_writing(squarest, tmp_path_factory):
    model = parallelize(_gpt2(), squarest)
    root = shared_tmp(tmp_path_factory, "async_foreign")
    os.makedirs(root / "notes", exist_ok=True)
    if torch.distributed.get_rank() == 0:
        (root / "notes" / "todo.txt").write_text("mine")
    torch.distributed.barrier()
    with pytest.raises(ValueError, match=r"which optimus2d\.checkpoint did not write"):
        checkpoint.async_save(root / "notes", model)
    assert (root / "notes" / "todo.txt").read_text() == "mine"


def _tied(mesh, steps: int, opt_of):
    """TiedShared (a tied, padded vocabulary of 13) on ``mesh`` after ``steps`` steps of ``opt_of(model)``."""
    model = parallelize(TiedShared(), mesh)
    opt = opt_of(model)
    torch.manual_seed(5)
    for _ in range(steps):
        opt.zero_grad()
        ids = torch.randint(0, VOCAB, (12 * mesh.depth, SEQ))
        model.loss(optimus2d.scatter_batch(ids, mesh), mesh).backward()
        opt.step()
    return model, opt


def test_a_checkpoint_loaded_then_saved_before_a_step_is_the_same_checkpoint(squarest, tmp_path_factory):
    """The optimizer's state of a padded vocabulary goes out serial whether or not the optimizer has
    stepped since it was made (a fresh one, filled by ``load``)."""
    root = shared_tmp(tmp_path_factory, "resave")
    model, opt = _tied(squarest, 2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    checkpoint.save(root / "first", model, opt)
    again, again_opt = _tied(squarest, 0, lambda m: torch.optim.AdamW(m.parameters(), lr=0.5))
    checkpoint.load(root / "first", again, again_opt)
    checkpoint.save(root / "second", again, again_opt)
    first, second = checkpoint.read(root / "first"), checkpoint.read(root / "second")
    _same(second["model"], first["model"], "model")
    _same(second["optimizer"], first["optimizer"], "optimizer")


def test_parameter_groups_come_back_by_their_parameters_with_every_setting(squarest, tmp_path_factory):
    """Groups are matched by their parameters' keys, not by position (as DCP's ``set_state_dict``);
    every saved setting comes back (a scheduler's ``initial_lr``, a tensor ``lr``), from optimus2d's
    checkpoints and from DCP's flattened optimizer state (torchtitan's)."""
    root = shared_tmp(tmp_path_factory, "groups")

    def groups(model, first_table: bool, **table):
        tables = [model.emb.weight]
        mixes = [model.mix.weight, model.mix.bias]
        pairs = [({"params": tables, **table}), {"params": mixes, "weight_decay": 0.0}]
        return pairs if first_table else pairs[::-1]

    def adamw(m):
        opt = torch.optim.AdamW(groups(m, True, weight_decay=0.5, lr=torch.tensor(3e-3)), lr=1e-2, foreach=False)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # adds initial_lr to every group
        return opt

    model, opt = _tied(squarest, 1, adamw)
    checkpoint.save(root / "ours", model, opt)
    model_state, optim_state = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=root / "flat")
    for way in ("ours", "flat"):
        other = parallelize(TiedShared(), squarest)
        other_opt = torch.optim.AdamW(groups(other, False, weight_decay=0.1), lr=0.5, weight_decay=0.1, foreach=False)
        checkpoint.load(root / way, other, other_opt, verify=way == "ours")
        mixes, tables = other_opt.param_groups
        assert (tables["weight_decay"], mixes["weight_decay"]) == (0.5, 0.0), way
        assert torch.equal(torch.as_tensor(tables["lr"]), torch.tensor(3e-3)), way
        assert mixes["lr"] == 1e-2 and tables["initial_lr"] == tables["lr"], way
        ref = {k: v for k, v in opt.state[model.emb.weight].items()}
        got = other_opt.state[other.emb.weight]
        assert set(got) == set(ref) and torch.equal(got["step"], ref["step"]), way


def test_async_save_on_a_mesh_over_some_ranks_is_refused_on_each_of_them(world, tmp_path_factory):
    """Its background groups are made over the world, so a mesh over ranks 0 and 1 of more is
    refused (``save`` works there), on both ranks, naming the mesh."""
    if world.size < 4:
        pytest.skip("needs a mesh over some ranks of at least 4")
    half = optimus2d.Mesh(1, 2, ranks=[0, 1])  # collective: every rank builds it
    root = shared_tmp(tmp_path_factory, "async_some_ranks")
    if half.coord is not None:
        model, opt = _tied(half, 1, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        with pytest.raises(ValueError, match=r"async_save: Mesh\(q=1, depth=2.* over some ranks of the world"):
            checkpoint.async_save(root / "half", model, opt)
        checkpoint.save(root / "half", model, opt)
        assert set(checkpoint.read(root / "half")["model"]) == set(serial_state_dict(model))
    torch.distributed.barrier()
