"""Ranks that would read or write different things are refused on every rank, fast; data a rank reads
is what was saved: ``load_pretrained`` agrees on the checkpoint's identity and checks the crc32s
``save_pretrained`` puts in each file's header; ``checkpoint.save`` and ``save_pretrained`` agree
on the path. Run at 4 ranks over MPI and over gloo (``OPTIMUS2D_TRANSPORT=torch``; CI: on 2×2)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct

import pytest
import torch
import torch.distributed as dist
from helpers import raises_fast
from safetensors import safe_open
from torch import nn

from optimus2d import Mesh, checkpoint, load_pretrained, parallelize, save_pretrained, serial_state_dict
from optimus2d.checkpoint import integrity
from optimus2d.checkpoint import pretrained as P

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi


def _llama(mesh, seed: int):
    heads, kv_heads = (6, 3) if mesh.q == 3 else (4, 2)  # grouped-query attention, heads divisible by q
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture
def shared(shared_dir):
    """A directory every rank sees (conftest's ``shared_dir``)."""
    return shared_dir


def _on_rank0(fn) -> None:
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _peers(size: int) -> None:
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")


def _last(mesh) -> bool:
    return mesh.index("mesh") == mesh.size - 1


def _save(mesh, seed: int, path: str, how: str) -> nn.Module:
    """The serial model of ``seed``, saved at ``path`` by transformers ("hf": no checksums) or by
    optimus2d ("ours", collective)."""
    serial = _llama(mesh, seed)
    if how == "hf":
        _on_rank0(lambda: serial.save_pretrained(path))
    else:
        save_pretrained(parallelize(_llama(mesh, seed), mesh), path)
    return serial


def _exact(parallel, serial) -> None:
    state = serial_state_dict(parallel)
    assert set(state) == set(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert torch.equal(state[key], value), key


def _same(state: dict, want: dict) -> None:
    assert set(state) == set(want)
    for key, value in want.items():
        assert torch.equal(state[key], value), key


def _unchanged(parallel, before: dict) -> None:
    _same(serial_state_dict(parallel), before)


def _data_offsets(file: str) -> tuple[int, dict]:
    """(where the data starts, the header's entries)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


def _flip(file: str, at: int) -> None:
    """One bit of the byte at ``at`` flipped."""
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


# ---- row 1: the same checkpoint on every rank --------------------------------------------------
@pytest.mark.parametrize("how", ["hf", "ours"])
def test_another_directory_on_one_rank_is_refused(mesh, shared, how):
    """The last rank names a checkpoint of the same shapes (other values): refused on every rank,
    naming each rank's directory, before anything is read."""
    _peers(mesh.size)
    a, b = os.path.join(shared, "a"), os.path.join(shared, "b")
    serial = _save(mesh, 0, a, how)
    _save(mesh, 1, b, how)
    parallel = parallelize(_llama(mesh, 2), mesh)
    before = serial_state_dict(parallel)
    message = raises_fast(
        ValueError, "not the same checkpoint on every rank", lambda: load_pretrained(parallel, b if _last(mesh) else a)
    )
    last, me = mesh.ranks[-1], dist.get_rank()
    assert f"this rank ({me}) has" in message
    others = ", ".join(map(str, mesh.ranks[:-1]))
    assert re.search(rf"ranks {others}: load_pretrained of {re.escape(repr(a))}", message), message
    assert re.search(rf"rank {last}: load_pretrained of {re.escape(repr(b))}", message), message
    assert ("no checksums" if how == "hf" else "checksummed") in message
    _unchanged(parallel, before)
    load_pretrained(parallel, a)  # the mesh is whole: the next load on every rank is agreed
    _exact(parallel, serial)


@pytest.mark.parametrize("how", ["hf", "ours"])
def test_the_same_checkpoint_at_another_path_loads(mesh, shared, how):
    """Identity is the contents: a copy at another path (a node-local copy) is the same checkpoint."""
    a, copy = os.path.join(shared, "a"), os.path.join(shared, "copy")
    serial = _save(mesh, 0, a, how)
    _on_rank0(lambda: shutil.copytree(a, copy))
    parallel = parallelize(_llama(mesh, 2), mesh)
    load_pretrained(parallel, copy if _last(mesh) else a)
    _exact(parallel, serial)


# ---- row 2: checksums ---------------------------------------------------------------------------
def test_save_puts_checksums_in_each_header_and_round_trips_exactly(mesh, shared, monkeypatch):
    """Checksums per chunk in every file's header (Hugging Face still loads it); a round trip is
    exact, a second save byte-identical; each rank checks only the chunks under what it reads."""
    monkeypatch.setattr(integrity, "CHUNK", 1024)  # many chunks, so ranks read different ones
    ours, again = os.path.join(shared, "ours"), os.path.join(shared, "again")
    serial = _llama(mesh, 0)
    saved = parallelize(_llama(mesh, 0), mesh)
    save_pretrained(saved, ours, max_shard_size="60KB")
    save_pretrained(saved, again, max_shard_size="60KB")
    files = sorted(n for n in os.listdir(ours) if n.endswith(".safetensors"))
    assert len(files) > 1 and os.path.isfile(os.path.join(ours, P.INDEX))
    total = 0
    for name in files:
        with safe_open(os.path.join(ours, name), "pt") as f:
            value = f.metadata()[integrity.KEY]
        start, _ = _data_offsets(os.path.join(ours, name))
        data = os.path.getsize(os.path.join(ours, name)) - start
        assert re.fullmatch(rf"crc32:1024:[0-9a-f]{{8}}:[0-9a-f]{{{8 * -(-data // 1024)}}}", value), value
        assert "0" * 8 * 4 not in value.rpartition(":")[2][:-8]  # written, not left as zeros
        with open(os.path.join(ours, name), "rb") as f, open(os.path.join(again, name), "rb") as g:
            assert f.read() == g.read(), name  # deterministic: the same model saves the same bytes
        total += data
    reference = transformers.LlamaForCausalLM.from_pretrained(ours)
    for key, value in serial.state_dict().items():
        assert torch.equal(reference.state_dict()[key], value), key

    read = []
    real = integrity._File.verify
    monkeypatch.setattr(integrity._File, "verify", lambda self, *a: read.append(real(self, *a)) or read[-1])
    parallel = parallelize(_llama(mesh, 1), mesh)
    load_pretrained(parallel, ours)
    _exact(parallel, serial)
    assert 0 < sum(read) <= total
    if mesh.q > 1:  # the weights' blocks: each rank's rows of them, not all of the data
        assert sum(read) < 0.8 * total, (sum(read), total)


@pytest.mark.parametrize("where", ["replicated", "first-byte", "last-byte"])
def test_a_flipped_bit_is_found_and_refused_on_every_rank(mesh, shared, where, monkeypatch):
    """One bit of a tensor's data flipped after the save (safetensors would read it as it is): every
    rank raises ``ValueError`` naming the file, the tensor and the rank that found it (chunks of
    1 KiB: only the ranks that read the bad one find it, the others learn it from them)."""
    monkeypatch.setattr(integrity, "CHUNK", 1024)
    ours = os.path.join(shared, "ours")
    _save(mesh, 0, ours, "ours")
    file = os.path.join(ours, P.WEIGHTS)
    start, entries = _data_offsets(file)
    tensors = sorted((v["data_offsets"], k) for k, v in entries.items() if k != "__metadata__")
    if where == "replicated":  # read whole by every rank
        key = "model.norm.weight"
        at = start + entries[key]["data_offsets"][0] + 5
    elif where == "first-byte":
        (begin, _), key = tensors[0]
        at = start + begin
    else:
        (_, end), key = tensors[-1]
        at = start + end - 1
    _on_rank0(lambda: _flip(file, at))
    parallel = parallelize(_llama(mesh, 1), mesh)
    message = raises_fast(ValueError, rf"{re.escape(repr(file))} is damaged", lambda: load_pretrained(parallel, ours))
    assert key in message and re.search(r"have crc32 [0-9a-f]{8}, its checksum says [0-9a-f]{8}", message), message
    assert re.search(r"found on rank \d+", message), message


def test_a_bit_flipped_in_one_ranks_copy_fails_every_rank(mesh, shared, monkeypatch):
    """Each rank reads its own copy (the same checkpoint: agreed); the last rank's copy has a flipped
    bit in a tensor it reads: it finds it, and every other rank raises the same error, naming it."""
    _peers(mesh.size)
    monkeypatch.setattr(integrity, "CHUNK", 1024)
    ours = os.path.join(shared, "ours")
    serial = _save(mesh, 0, ours, "ours")
    mine = os.path.join(shared, f"copy-{dist.get_rank()}")
    shutil.copytree(ours, mine)
    file = os.path.join(mine, P.WEIGHTS)
    start, entries = _data_offsets(file)
    if _last(mesh):
        _flip(file, start + entries["model.norm.weight"]["data_offsets"][0] + 2)  # read whole by every rank
    dist.barrier()
    parallel = parallelize(_llama(mesh, 1), mesh)
    last = mesh.ranks[-1]
    message = raises_fast(ValueError, "is damaged", lambda: load_pretrained(parallel, mine))
    assert "model.norm.weight" in message and f"found on rank {last}" in message, message
    if not _last(mesh):  # relayed: the rank that found it and its text
        assert re.search(rf"reading the blocks\) on Mesh.*: rank {last} \(of the failing ranks {last}\)", message)
    load_pretrained(parallel, ours)  # the mesh is whole
    _exact(parallel, serial)


def test_a_flipped_bit_in_a_header_is_found(mesh, shared):
    """A header that still parses but names another tensor: the entries' crc32 differs."""
    ours = os.path.join(shared, "ours")
    _save(mesh, 0, ours, "ours")
    file = os.path.join(ours, P.WEIGHTS)
    start, _ = _data_offsets(file)  # read by every rank before rank 0 flips
    with open(file, "rb") as f:
        at = f.read(start).index(b'"model.norm.weight"') + len('"model.norm.weigh')  # 't' → 'd' (0x74 ^ 0x10)
    dist.barrier()
    _on_rank0(lambda: _flip(file, at))
    parallel = parallelize(_llama(mesh, 1), mesh)
    message = raises_fast(ValueError, "is damaged", lambda: load_pretrained(parallel, ours, strict=False))
    assert "its header's tensor entries have crc32" in message, message


def test_a_directory_without_checksums_loads_and_says_so(mesh, shared, caplog):
    hf, ours = os.path.join(shared, "hf"), os.path.join(shared, "ours")
    serial = _save(mesh, 0, hf, "hf")
    _save(mesh, 0, ours, "ours")
    parallel = parallelize(_llama(mesh, 1), mesh)
    lead = mesh.index("mesh") == 0
    with caplog.at_level(logging.INFO, logger="optimus2d"):
        load_pretrained(parallel, hf, progress=False)
    _exact(parallel, serial)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "(1 file, no checksums: data not verified)" in said if lead else not said, said
    caplog.clear()
    parallel = parallelize(_llama(mesh, 1), mesh)
    with caplog.at_level(logging.INFO, logger="optimus2d"):
        load_pretrained(parallel, ours, progress=False)
    _exact(parallel, serial)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "(1 file, checksums verified)" in said if lead else not said, said


# ---- row 3: the same path on every rank ---------------------------------------------------------
def _mlp(mesh, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return parallelize(nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12)), mesh)


@pytest.mark.parametrize("what", ["checkpoint.save", "save_pretrained", "checkpoint.save_stages"])
def test_another_path_on_one_rank_is_refused_before_writing(mesh, shared, what):
    _peers(mesh.size)
    x, y = os.path.join(shared, "x"), os.path.join(shared, "y")
    model = _mlp(mesh, 0)
    save = {
        "checkpoint.save": lambda p: checkpoint.save(p, model),
        "save_pretrained": lambda p: save_pretrained(model, p),
        "checkpoint.save_stages": lambda p: checkpoint.save_stages(p, [model]),  # one stage: the world is its mesh
    }[what]
    message = raises_fast(ValueError, rf"{re.escape(what)}.*the ranks disagree", lambda: save(y if _last(mesh) else x))
    last, me = mesh.ranks[-1], dist.get_rank()
    assert f"this rank ({me}) has" in message
    others = ", ".join(map(str, mesh.ranks[:-1]))
    assert f"ranks {others}: {what} of the directory {x!r}" in message, message
    assert f"rank {last}: {what} of the directory {y!r}" in message, message
    dist.barrier()
    assert sorted(os.listdir(shared)) == []  # nothing written, on any rank
    dist.barrier()
    spelled = os.path.join(shared, "sub", "..", "x") if _last(mesh) else x  # the same directory: agreed
    save(spelled)
    if what != "save_pretrained":
        state = serial_state_dict(model)
        fresh = _mlp(mesh, 1)
        checkpoint.load(x, fresh)
        _unchanged(fresh, state)  # what was saved
    else:
        assert sorted(os.listdir(x)) == [P.WEIGHTS]


def test_replicas_with_another_path_on_one_rank_are_refused(world, shared):
    """Data-parallel replicas (here of a 1-rank mesh) commit together: the path is agreed over the world."""
    _peers(world.size)
    mesh = Mesh(1, ranks=[world.rank])  # collective: every rank builds its replica
    x, y = os.path.join(shared, "x"), os.path.join(shared, "y")
    model = _mlp(mesh, 0)
    message = raises_fast(
        ValueError,
        r"checkpoint\.save over replica meshes: the ranks disagree",
        lambda: checkpoint.save(y if world.rank == world.size - 1 else x, model),
    )
    assert f"this rank ({world.rank}) has" in message and f"rank {world.size - 1}: " in message, message
    assert repr(x) in message and repr(y) in message, message
    dist.barrier()
    assert sorted(os.listdir(shared)) == []
    dist.barrier()
    checkpoint.save(x, model)
    _same(checkpoint.read(x)["model"], serial_state_dict(model))
