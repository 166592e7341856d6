"""Checkpoints are committed atomically and verified against their manifest on every rank."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

import optimus2d
from optimus2d import checkpoint, serial_state_dict
from optimus2d.checkpoint.files import MANIFEST, PREVIOUS, SAVING

pytestmark = pytest.mark.mpi

SHAPES = [(1, 1), (2, 1), (1, 4), (2, 2), (3, 1)]  # (q, depth) on the first depth·q² ranks
_meshes: dict = {}


def _mesh(world):
    """The largest mesh of SHAPES on the first ranks (every rank builds it: it is collective)."""
    q, d = max((s for s in SHAPES if s[1] * s[0] ** 2 <= world.size), key=lambda s: s[1] * s[0] ** 2)
    if (q, d) not in _meshes:
        _meshes[(q, d)] = optimus2d.Mesh(q, d, ranks=range(d * q * q))
    return _meshes[(q, d)]


def _model(seed: int, mesh):
    """A 2D MLP and its AdamW state after one step, both depending on ``seed``."""
    torch.manual_seed(seed)
    model = optimus2d.parallelize(nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12)), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = optimus2d.scatter(torch.randn(36, 3, 12), mesh)
    model(x).square().mean().backward()
    opt.step()
    return model, opt


def _sync(mesh) -> None:
    if mesh.size > 1:
        dist.barrier(group=mesh.group("mesh"))


def _manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def _same(saved: dict, state: dict) -> bool:
    return set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in state)


def test_save_over_a_checkpoint_commits_atomically(world, monkeypatch, shared_dir):
    mesh, root = _mesh(world), shared_dir
    path = os.path.join(root, "ckpt")
    if mesh.coord is not None:
        model_a, opt_a = _model(0, mesh)
        state_a = serial_state_dict(model_a)
        checkpoint.save(path, model_a, opt_a)
        model_b, opt_b = _model(1, mesh)
        state_b = serial_state_dict(model_b)
        seen = []
        real_save = checkpoint.sharded.dcp.save

        def save_then_look(state, *, checkpoint_id, **kwargs):
            real_save(state, checkpoint_id=checkpoint_id, **kwargs)  # every rank has written B
            seen.append((checkpoint_id, sorted(os.listdir(checkpoint_id)), checkpoint.read(path)["model"]))

        monkeypatch.setattr(checkpoint.sharded.dcp, "save", save_then_look)
        checkpoint.save(path, model_b, opt_b)
        monkeypatch.undo()
        # this rank returned: the commit is done, whichever rank made it
        assert sorted(os.listdir(root)) == ["ckpt"]
        ((written_to, files, during),) = seen
        assert written_to == path + SAVING and MANIFEST not in files
        assert _same(during, state_a), "the checkpoint at path changed before the commit"
        saved = checkpoint.read(path)
        assert _same(saved["model"], state_b)
        assert set(os.listdir(path)) == set(files) | {MANIFEST}
        fresh, fresh_opt = _model(2, mesh)
        checkpoint.load(path, fresh, fresh_opt)
        assert _same(serial_state_dict(fresh), state_b)
    dist.barrier()


def test_a_commit_cut_between_its_renames_leaves_the_previous_checkpoint(world, shared_dir):
    mesh, root = _mesh(world), shared_dir
    path, other = os.path.join(root, "ckpt"), os.path.join(root, "other")
    if mesh.coord is not None:
        model_a, opt_a = _model(0, mesh)
        state_a = serial_state_dict(model_a)
        checkpoint.save(path, model_a, opt_a)
        checkpoint.save(other, *_model(1, mesh))
        _sync(mesh)
        if mesh.index("mesh") == 0:  # killed between the renames, B complete but not committed
            os.rename(path, path + PREVIOUS)
            os.rename(other, path + SAVING)
        _sync(mesh)
        assert _same(checkpoint.read(path)["model"], state_a)
        model, opt = _model(2, mesh)
        checkpoint.load(path, model, opt)
        assert _same(serial_state_dict(model), state_a)

        model_c, opt_c = _model(3, mesh)  # the next save puts A back first, then replaces it
        checkpoint.save(path, model_c, opt_c)
        assert sorted(os.listdir(root)) == ["ckpt"]
        assert _same(checkpoint.read(path)["model"], serial_state_dict(model_c))
        checkpoint.save(other, model_a, opt_a)
        _sync(mesh)
        if mesh.index("mesh") == 0:  # killed after the commit, before the old one was removed
            shutil.copytree(path, path + PREVIOUS)
            os.rename(other, path + SAVING)  # and a complete save after it: neither is read
        _sync(mesh)
        assert _same(checkpoint.read(path)["model"], serial_state_dict(model_c))
        checkpoint.save(path, model_a, opt_a)
        assert sorted(os.listdir(root)) == ["ckpt"]
        assert _same(checkpoint.read(path)["model"], state_a)
    dist.barrier()


DAMAGE = {
    "manifest": (ValueError, r"no readable checkpoint at .*ckpt': it has no manifest\.json, so a save did not finish"),
    "truncated": (RuntimeError, r"could not read .*ckpt': '.*__\d+_0\.distcp' has 16 bytes, the manifest says \d+"),
    "flipped": (RuntimeError, r"could not read .*ckpt': '.*__\d+_0\.distcp' is damaged \(crc32 [0-9a-f]{8}, the"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_on_every_rank(world, damage, shared_dir):
    mesh, root = _mesh(world), shared_dir
    path = os.path.join(root, "ckpt")
    if mesh.coord is not None:
        checkpoint.save(path, *_model(0, mesh))
        n = mesh.size
        share = sorted(_manifest(path)["files"])[n - 1 :: n]
        victim = os.path.join(path, next(f for f in share if f.endswith(".distcp")))  # checksummed by rank n-1
        _sync(mesh)
        if mesh.index("mesh") == 0:
            if damage == "manifest":
                os.remove(os.path.join(path, MANIFEST))
            elif damage == "truncated":
                os.truncate(victim, 16)
            else:
                with open(victim, "r+b") as f:  # one byte in the middle, the size unchanged
                    f.seek(os.path.getsize(victim) // 2)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0x40]))
        _sync(mesh)
        model, opt = _model(5, mesh)
        before = [p.clone() for p in model.parameters()]
        state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        error, pattern = DAMAGE[damage]
        with pytest.raises(error, match=pattern):
            checkpoint.load(path, model, opt)
        with pytest.raises(error, match=pattern):
            checkpoint.read(path)
        for p, b in zip(model.parameters(), before, strict=True):
            assert torch.equal(p, b)
        for p, s in opt.state.items():
            assert all(torch.equal(v, state_before[id(p)][k]) for k, v in s.items())
        if damage == "manifest":  # as one written before manifests: read unverified when asked (model: seed 5)
            checkpoint.load(path, model, opt, verify=False)
            assert _same(serial_state_dict(model), checkpoint.read(path, verify=False)["model"])
    dist.barrier()


def test_a_stale_temporary_directory_is_refused_then_cleaned(world, shared_dir):
    mesh, root = _mesh(world), shared_dir
    path = os.path.join(root, "ckpt")
    if mesh.coord is not None:
        if mesh.index("mesh") == 0:  # what a save killed while writing leaves
            os.mkdir(path + SAVING)
            with open(os.path.join(path + SAVING, "__1_0.distcp"), "wb") as f:
                f.write(b"half a shard")
        _sync(mesh)
        model, opt = _model(0, mesh)
        with pytest.raises(ValueError, match=r"no readable checkpoint at .*ckpt': it does not exist \(a save into"):
            checkpoint.load(path, model, opt)
        with pytest.raises(ValueError, match=r"optimus2d-saving': it has no manifest\.json, so a save did not finish"):
            checkpoint.read(path + SAVING)
        _sync(mesh)  # every rank has looked before the next save removes it
        checkpoint.save(path, model, opt)
        assert sorted(os.listdir(root)) == ["ckpt"]
        assert _same(checkpoint.read(path)["model"], serial_state_dict(model))

        _sync(mesh)
        if mesh.index("mesh") == 0:  # a temporary directory holding someone else's file is kept
            os.mkdir(path + SAVING)
            with open(os.path.join(path + SAVING, "notes.txt"), "w") as f:
                f.write("mine")
        _sync(mesh)
        other, other_opt = _model(1, mesh)
        with pytest.raises(ValueError, match=r"optimus2d-saving' holds \['notes\.txt'\], which optimus2d\.checkpoint"):
            checkpoint.save(path, other, other_opt)
        assert os.path.exists(os.path.join(path + SAVING, "notes.txt"))
        assert _same(checkpoint.read(path)["model"], serial_state_dict(model))
        _sync(mesh)
        if mesh.index("mesh") == 0:  # and so is a checkpoint path holding someone else's file
            shutil.move(os.path.join(path + SAVING, "notes.txt"), path)
        _sync(mesh)
        with pytest.raises(ValueError, match=r"ckpt' holds \['notes\.txt'\], which optimus2d\.checkpoint did not"):
            checkpoint.save(path, other, other_opt)
        assert _same(checkpoint.read(path)["model"], serial_state_dict(model))
    dist.barrier()


def test_copies_on_each_node_load_when_alike_and_are_refused_on_every_rank_when_not(world, shared_dir, monkeypatch):
    """A checkpoint copied to each node's own disk, read by the same relative path: the ranks of the
    odd mesh positions stand for a second node. Copies of one checkpoint load; a second node holding
    another checkpoint (which each rank's share of the checksums would not see: each checks its own
    copy) is refused on every rank, nothing changed."""
    mesh, root = _mesh(world), shared_dir
    if mesh.coord is not None:
        first, second = os.path.join(root, "first"), os.path.join(root, "second")
        checkpoint.save(first, *_model(0, mesh))
        checkpoint.save(second, *_model(1, mesh))
        if mesh.index("mesh") == 0:
            for node, source in (("node0", first), ("node1", first), ("node2", first), ("node3", second)):
                shutil.copytree(source, os.path.join(root, node, "ckpt"))
        _sync(mesh)
        model, opt = _model(5, mesh)
        monkeypatch.chdir(os.path.join(root, f"node{mesh.index('mesh') % 2}"))
        checkpoint.load("ckpt", model, opt)
        assert _same(serial_state_dict(model), checkpoint.read(first)["model"])
        before = [p.clone() for p in model.parameters()]
        monkeypatch.chdir(os.path.join(root, f"node{2 + mesh.index('mesh') % 2}"))
        if mesh.size > 1:
            with pytest.raises(RuntimeError, match=r"different checkpoints at 'ckpt': its manifest\.json differs"):
                checkpoint.load("ckpt", model, opt)
            for p, b in zip(model.parameters(), before, strict=True):
                assert torch.equal(p, b)
        _sync(mesh)
    dist.barrier()


def test_an_optimizer_given_on_some_ranks_only_is_refused_on_every_rank(world, shared_dir):
    """One rank's save or load without the optimizer: a load left that rank's optimizer state fresh
    (its blocks then stepped unlike the others'), a save ended in DCP's own error. Refused first."""
    mesh, path = _mesh(world), os.path.join(shared_dir, "ckpt")
    if mesh.coord is not None:
        model, opt = _model(0, mesh)
        checkpoint.save(path, model, opt)
        odd = mesh.index("mesh") == mesh.size - 1
        other, other_opt = _model(5, mesh)
        state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in other_opt.state.items()}
        if mesh.size > 1:
            with pytest.raises(ValueError, match=r"checkpoint\.load on Mesh.*no optimizer"):
                checkpoint.load(path, other, None if odd else other_opt)
            with pytest.raises(ValueError, match=r"checkpoint\.save on Mesh.*no optimizer"):
                checkpoint.save(os.path.join(shared_dir, "other"), other, None if odd else other_opt)
            assert not os.path.exists(os.path.join(shared_dir, "other"))
            for p, s in other_opt.state.items():
                assert all(torch.equal(v, state_before[id(p)][k]) for k, v in s.items())
        checkpoint.load(path, other, other_opt)  # alike on every rank: loads
        assert _same(serial_state_dict(other), checkpoint.read(path)["model"])
    dist.barrier()
