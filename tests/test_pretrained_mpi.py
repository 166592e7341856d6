"""Hugging Face checkpoints into a converted model, block by block (``load_pretrained``), and back
(``save_pretrained``): the same weights and logits as transformers' own ``from_pretrained``."""

from __future__ import annotations

import collections
import json
import logging
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import optimus2d
from optimus2d import gather, load_pretrained, parallelize, save_pretrained, scatter_batch, serial_state_dict
from optimus2d.checkpoint import pretrained as P
from optimus2d.checkpoint.serial import _owners
from optimus2d.comm.sharding import shard
from optimus2d.layers.base import param_sharding, sharding_of

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]


def _llama(mesh, seed: int, *, meta: bool = False):
    heads, kv_heads = (6, 3) if mesh.q == 3 else (4, 2)  # grouped-query attention, heads divisible by q
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return transformers.LlamaForCausalLM(config)


def _gpt2(mesh, seed: int, *, meta: bool = False):
    config = transformers.GPT2Config(
        vocab_size=97,
        n_positions=32,
        n_embd=48,
        n_layer=2,
        n_head=6,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )  # fmt: skip  (vocabulary 97: padded on q = 2, 3; tied head; fused c_attn)
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return transformers.GPT2LMHeadModel(config)


FAMILIES = pytest.mark.parametrize("family", [_llama, _gpt2], ids=["llama", "gpt2"])


@pytest.fixture
def shared(shared_dir):
    """A directory every rank sees (conftest's ``shared_dir``)."""
    return shared_dir


def _on_rank0(fn) -> None:
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _logits(model, mesh, vocab: int, parallel: bool) -> torch.Tensor:
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2 * mesh.depth * mesh.q, 9))
    with torch.no_grad():
        if not parallel:
            return model(input_ids=ids, use_cache=False).logits
        return gather(model(input_ids=scatter_batch(ids, mesh), use_cache=False).logits, mesh)[..., :vocab]


def _assert_same(parallel, reference, mesh) -> None:
    """The converted model holds exactly the reference's weights and gives its logits."""
    state, want = serial_state_dict(parallel), reference.state_dict()
    assert set(state) == set(want)
    for key, value in want.items():
        assert torch.equal(state[key], value), key
    vocab = reference.config.vocab_size
    assert_close(_logits(parallel, mesh, vocab, True), _logits(reference, mesh, vocab, False), 1e-5, "logits")


def _stored_keys(path: str) -> set[str]:
    keys = set()
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                keys |= set(f.keys())
    return keys


@FAMILIES
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_load_then_save_match_from_pretrained(mesh, shared, family, sharded):
    size = "20KB" if sharded else "5GB"
    source, ours = os.path.join(shared, "hf"), os.path.join(shared, "ours")
    serial = family(mesh, 0)
    _on_rank0(lambda: serial.save_pretrained(source, max_shard_size=size))
    assert os.path.isfile(os.path.join(source, P.INDEX)) == sharded
    reference = type(serial).from_pretrained(source)

    parallel = parallelize(family(mesh, 1), mesh)  # other weights: the load must replace them all
    load_pretrained(parallel, source)
    _assert_same(parallel, reference, mesh)

    save_pretrained(parallel, ours, max_shard_size=size)
    assert os.path.isfile(os.path.join(ours, P.INDEX)) == sharded
    assert not os.path.exists(ours + P.SAVING) and not os.path.exists(ours + P.PREVIOUS)
    stored = _stored_keys(ours)
    assert stored == _stored_keys(source)  # the tied lm_head.weight (GPT-2) once, as transformers writes it
    assert ("lm_head.weight" in stored) == (family is _llama)
    again = type(serial).from_pretrained(ours)
    for key, value in reference.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    vocab = serial.config.vocab_size
    assert torch.equal(_logits(again, mesh, vocab, False), _logits(reference, mesh, vocab, False))


@FAMILIES
def test_the_converted_models_own_save_pretrained_writes_the_serial_files(mesh, shared, family):
    """``model.save_pretrained(dir)``, as a Hugging Face user writes it: transformers' own wrote each
    rank's blocks under the serial names (rank 0 raised, the others returned)."""
    serial = family(mesh, 0)
    parallel = parallelize(family(mesh, 0), mesh)
    path = os.path.join(shared, "own")
    parallel.save_pretrained(
        path, is_main_process=dist.get_rank() == 0, max_shard_size="20KB", save_function=torch.save
    )
    assert os.path.isfile(os.path.join(path, P.INDEX)) and os.path.isfile(os.path.join(path, "config.json"))
    again = type(serial).from_pretrained(path)
    for key, value in serial.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    for bad, error in ({"state_dict": {}}, ValueError), ({"variant": "fp16"}, ValueError), ({"shard": 1}, TypeError):
        with pytest.raises(error, match=r"save_pretrained on .* converted by optimus2d\.parallelize"):
            parallel.save_pretrained(os.path.join(shared, "refused"), **bad)
    assert not os.path.exists(os.path.join(shared, "refused"))


def test_the_models_own_save_pretrained_says_it_is_collective_when_peers_never_come(mesh, monkeypatch):
    """transformers' habit, ``if rank == 0: model.save_pretrained(d)``: the wait's timeout says why."""
    from optimus2d.families import hf_methods

    def lost(*args, **kwargs):
        raise TimeoutError("MPI all-gather over mesh did not complete within 10 s: is a peer lost?")

    monkeypatch.setattr(hf_methods, "save_pretrained", lost)
    parallel = parallelize(_llama(mesh, 0), mesh)
    with pytest.raises(TimeoutError, match=r"is a peer lost\?.*it is collective: every rank of the mesh calls it"):
        parallel.save_pretrained("anywhere")


class _Recorder:
    """``safe_open`` that counts, per key, the elements each read returns (``get_tensor``: whole)."""

    def __init__(self, real) -> None:
        self.real, self.read, self.whole, self.rows = real, collections.Counter(), set(), 0

    def __call__(self, *args, **kwargs):
        return _RecordedFile(self, self.real(*args, **kwargs))


class _RecordedFile:
    def __init__(self, recorder, f) -> None:
        self.recorder, self.f = recorder, f

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, key):
        out = self.f.get_tensor(key)
        self.recorder.read[key] += out.numel()
        self.recorder.whole.add(key)
        return out

    def get_slice(self, key):
        recorder, piece = self.recorder, self.f.get_slice(key)

        class Slice:
            get_shape, get_dtype = piece.get_shape, piece.get_dtype

            def __getitem__(self, index):
                out = piece[index]
                recorder.read[key] += out.numel()
                recorder.rows = max(recorder.rows, out.shape[0] if out.dim() else 1)
                return out

        return Slice()


@FAMILIES
@pytest.mark.parametrize("chunk", [None, 1], ids=["16MiB-runs", "row-by-row"])
def test_each_rank_reads_only_its_blocks(mesh, shared, family, monkeypatch, chunk):
    """Only the block's slices are read, in runs of rows of at most ``_CHUNK`` bytes of the file
    (1: a row at a time), so a rank maps no more than a run of a tensor's pages at once."""
    serial = family(mesh, 0)
    _on_rank0(lambda: serial.save_pretrained(shared, max_shard_size="30KB"))
    parallel = parallelize(family(mesh, 1), mesh)
    recorder = _Recorder(P.safe_open)
    monkeypatch.setattr(P, "safe_open", recorder)
    if chunk is not None:
        monkeypatch.setattr(P, "_CHUNK", chunk)
    load_pretrained(parallel, shared)
    monkeypatch.undo()
    if chunk is not None:
        assert recorder.rows == 1

    owners, split_read, split_total = _owners(parallel), 0, 0
    for key, full in serial.state_dict().items():
        owner, name = owners[key]
        if key == "lm_head.weight" and family is _gpt2:  # tied: the embedding's table, read under its key
            assert getattr(owner, name) is parallel.transformer.wte.weight and key not in recorder.read
            continue
        sharding, _ = sharding_of(owner, name)
        if sharding is None:  # held whole on every rank: read whole (by runs of rows)
            assert recorder.read[key] == full.numel(), key
            continue
        marker = (torch.arange(full.numel(), dtype=torch.float64) + 1).view(full.shape)
        mine = int((shard(marker, mesh, sharding) != 0).sum())  # the real (not padding) entries of my block
        assert recorder.read[key] == mine and key not in recorder.whole, (key, recorder.read[key], mine)
        split_read, split_total = split_read + mine, split_total + full.numel()
    if mesh.q > 1:  # weights 1/q², norms and biases 1/q (a little more where padded)
        assert split_read < 1.1 * split_total / mesh.q, (split_read, split_total)
    _assert_same(parallel, serial, mesh)


def _to_meta(model: nn.Module) -> None:
    """Every saved tensor of a converted model onto the meta device, each object kept (ties too)."""
    for t in {id(t): t for t in model.state_dict(keep_vars=True).values()}.values():
        new = torch.empty_like(t, device="meta")
        new = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        new.__dict__.update(t.__dict__)
        torch.utils.swap_tensors(t, new)


@FAMILIES
@pytest.mark.parametrize("how", ["moved", "built"])
def test_meta_tensors_get_their_blocks(mesh, shared, family, how):
    """``moved``: a converted model's tensors moved to meta; ``built``: the serial model built on meta,
    converted (``parallelize`` of meta tensors) and loaded: what the checkpoint lacks (LLaMA's rotary
    table, not saved) is made by ``optimus2d.materialize`` within ``load_pretrained``."""
    serial = family(mesh, 0)
    _on_rank0(lambda: serial.save_pretrained(shared))
    if how == "moved":
        parallel = parallelize(family(mesh, 1), mesh)
        _to_meta(parallel)
    else:
        if not hasattr(optimus2d, "materialize"):
            pytest.skip("optimus2d.materialize (meta-device conversion) is not there")
        parallel = parallelize(family(mesh, 1, meta=True), mesh)
    params = [(n, id(p), param_sharding(p)) for n, p in parallel.named_parameters()]
    assert all(t.is_meta for t in parallel.state_dict().values())
    load_pretrained(parallel, shared)
    for key, t in parallel.state_dict(keep_vars=True).items():  # blocks of their own, not views of the file
        assert not t.is_meta and t.is_contiguous(), key
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
    assert [(n, id(p), param_sharding(p)) for n, p in parallel.named_parameters()] == params
    if family is _gpt2:
        assert parallel.lm_head.weight is parallel.transformer.wte.weight
    assert not any(t.is_meta for t in parallel.buffers())  # LLaMA's rotary table (not saved) made too
    _assert_same(parallel, serial, mesh)


def test_a_frozen_kept_parameter_under_a_weak_reference_loads_and_trains(mesh, shared):
    """Qwen3's per-head q norm (whole on every rank, its gradient summed by a hook), frozen, built on
    meta, a weak reference held (``swap_tensors`` refuses: a new Parameter in every holder): its hook
    went onto a tensor that needs no gradient, and every rank raised. Loaded, unfrozen: as serial."""
    import weakref

    heads = 6 if mesh.q == 3 else 4
    config = transformers.Qwen3Config(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=heads // 2, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    serial = transformers.Qwen3ForCausalLM(config)
    norm = lambda m: m.model.layers[0].self_attn.q_norm.weight  # noqa: E731
    with torch.no_grad():
        norm(serial).add_(torch.randn(8) * 0.3)
    _on_rank0(lambda: serial.save_pretrained(shared))
    with torch.device("meta"):
        parallel = transformers.Qwen3ForCausalLM(config)
    norm(parallel).requires_grad_(False)
    parallel = parallelize(parallel, mesh)
    refs = [weakref.ref(p) for p in parallel.parameters()]  # noqa: F841
    load_pretrained(parallel, shared)
    norm(parallel).requires_grad_(True)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 7))
    probe = torch.randn(*ids.shape, 96)
    (serial(input_ids=ids).logits * probe).sum().backward()
    logits = gather(parallel(input_ids=scatter_batch(ids, mesh)).logits, mesh)[..., :96]
    (logits * probe).sum().backward()
    grad = norm(parallel).grad
    assert_close(grad.full_tensor() if hasattr(grad, "full_tensor") else grad, norm(serial).grad, 1e-4, "q_norm grad")


@FAMILIES
def test_a_serial_model_built_on_meta_loads_as_from_pretrained(mesh, shared, family):
    """Not parallelized: what the checkpoint lacks (LLaMA's rotary table) is made from a record of the
    serial initialisation taken on a meta twin; taken on the model itself, it re-initialised the loaded
    weights (16 of LLaMA's 21 tensors, logits 160 % off)."""
    serial = family(mesh, 0)
    _on_rank0(lambda: serial.save_pretrained(shared))
    model = family(mesh, 1, meta=True)
    load_pretrained(model, shared)
    want = dict(serial.state_dict(keep_vars=True), **dict(serial.named_buffers()))
    got = dict(model.state_dict(keep_vars=True), **dict(model.named_buffers()))
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_a_checkpoint_in_the_names_transformers_renames_loads_as_from_pretrained(mesh, shared):
    """transformers 5 renamed ViT's modules (``encoder.layer.N.attention.attention.query`` is now
    ``layers.N.attention.q_proj``) and its ``save_pretrained`` writes the old names, as the hub's
    files hold them: read through transformers' own renamings, as ``from_pretrained`` reads them
    (they were missing and unexpected keys)."""
    config = transformers.ViTConfig(
        hidden_size=48, num_hidden_layers=1, num_attention_heads=6, intermediate_size=96, image_size=8, patch_size=4
    )
    torch.manual_seed(0)
    serial = transformers.ViTModel(config, add_pooling_layer=False)
    with torch.no_grad():
        for p in serial.parameters():
            p.add_(torch.randn_like(p) * 0.1)

    _on_rank0(lambda: serial.save_pretrained(shared))
    with safe_open(os.path.join(shared, P.WEIGHTS), "pt") as f:
        assert any("encoder.layer.0.attention.attention.query" in k for k in f.keys())  # the old names
    want = transformers.ViTModel.from_pretrained(shared, add_pooling_layer=False)
    with torch.device("meta"):
        model = transformers.ViTModel(config, add_pooling_layer=False)
    parallel = parallelize(model, mesh)
    load_pretrained(parallel, shared)
    state = serial_state_dict(parallel)
    for key, value in want.state_dict().items():
        assert torch.equal(state[key], value), key


def test_dtype_is_cast_to_the_models(mesh, shared):
    serial = _llama(mesh, 0).to(torch.bfloat16)
    _on_rank0(lambda: serial.save_pretrained(shared))
    parallel = parallelize(_llama(mesh, 1), mesh)
    load_pretrained(parallel, shared)
    state = serial_state_dict(parallel)
    for key, value in serial.state_dict().items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], value.float()), key


def test_a_base_model_checkpoint_loads_into_the_head_model(mesh, shared):
    """GPT-2's hub files hold ``h.0...``, not ``transformer.h.0...``: the prefix is added."""
    serial = _gpt2(mesh, 0)
    _on_rank0(lambda: serial.transformer.save_pretrained(shared))
    parallel = parallelize(_gpt2(mesh, 1), mesh)
    load_pretrained(parallel, shared)
    _assert_same(parallel, serial, mesh)


class _Scaled(nn.Module):
    """A Linear2D beside saved buffers: a 0-d float and an int64 counter (held whole on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 24)
        self.register_buffer("scale", torch.tensor(2.0))
        self.register_buffer("steps", torch.tensor(3))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_saved_buffers_round_trip(mesh, shared):
    optimus2d.convert.register_converter(_Scaled, keep=True)
    torch.manual_seed(0)
    serial = _Scaled()
    serial.scale.fill_(0.5)
    serial.steps.fill_(7)
    _on_rank0(lambda: save_file(serial.state_dict(), os.path.join(shared, P.WEIGHTS), metadata={"format": "pt"}))
    torch.manual_seed(1)
    parallel = parallelize(_Scaled(), mesh)
    load_pretrained(parallel, shared)
    ours = os.path.join(shared, "ours")
    save_pretrained(parallel, ours)
    assert not os.path.exists(os.path.join(ours, "config.json"))  # not a transformers model: weights only
    with safe_open(os.path.join(ours, P.WEIGHTS), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    for state in (serial_state_dict(parallel), saved):
        assert set(state) == set(serial.state_dict())
        for key, value in serial.state_dict().items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


def _write_text(name: str, text: str) -> None:
    with open(name, "w") as f:
        f.write(text)


def _checkpoint_with(shared: str, state: dict) -> None:
    _on_rank0(lambda: save_file(state, os.path.join(shared, P.WEIGHTS), metadata={"format": "pt"}))


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "nothing", "damaged"])
def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank(mesh, shared, case, caplog):
    state = {k: v.contiguous() for k, v in _llama(mesh, 0).state_dict().items()}
    if case == "missing":
        del state["model.layers.1.mlp.up_proj.weight"]
        match = r"missing keys \(1\): model\.layers\.1\.mlp\.up_proj\.weight"
    elif case == "unexpected":
        state["model.layers.9.extra.weight"] = torch.zeros(3)
        match = r"unexpected keys \(1\): model\.layers\.9\.extra\.weight"
    elif case == "shape":
        state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(25, 48)
        key = r"model\.layers\.0\.self_attn\.k_proj\.weight"
        match = rf"on Mesh\(q=.*shapes \(1\): {key}: checkpoint \[25, 48\], model \[24, 48\]"
    if case == "nothing":
        match = "no model.safetensors or model.safetensors.index.json"
    elif case == "damaged":
        _on_rank0(lambda: _write_text(os.path.join(shared, P.WEIGHTS), "not a safetensors file"))
        match = "load_pretrained: .*SafetensorError.*deserializing header"
    else:
        _checkpoint_with(shared, state)
    parallel = parallelize(_llama(mesh, 1), mesh)
    before = serial_state_dict(parallel)
    with pytest.raises(ValueError, match=match):
        load_pretrained(parallel, shared)
    for key, value in serial_state_dict(parallel).items():
        assert torch.equal(value, before[key]), key  # nothing changed
    if case == "missing":
        with caplog.at_level(logging.INFO, logger="optimus2d"), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            load_pretrained(parallel, shared, strict=False, progress=False)  # the rest is read
        said_aloud = [str(w.message) for w in warned if "strict=False" in str(w.message)]
        assert len(said_aloud) == (mesh.index("mesh") == 0), said_aloud  # a warning, on the first rank
        assert torch.equal(serial_state_dict(parallel)["model.norm.weight"], state["model.norm.weight"])
        said = "1 keys of the model not in the checkpoint (model.layers.1.mlp.up_proj.weight)"
        assert mesh.index("mesh") != 0 or said in caplog.text, caplog.text  # what was skipped, said


@pytest.mark.parametrize("head", ["equal", "other"])
def test_a_tied_table_held_twice_by_the_checkpoint_must_agree(mesh, shared, head):
    """GPT-2 ties its head to its table; a checkpoint holding ``lm_head.weight`` too, with other values
    (transformers would then untie them), is refused before anything is read into the model (it
    was read from the table alone: logits 0.86 off); the same values load."""
    serial = _gpt2(mesh, 0)
    state = {k: v.clone().contiguous() for k, v in serial.state_dict().items()}
    state["lm_head.weight"] = state["transformer.wte.weight"] + (0.1 if head == "other" else 0.0)
    _checkpoint_with(shared, state)
    parallel = parallelize(_gpt2(mesh, 1), mesh)
    before = serial_state_dict(parallel)
    if head == "equal":
        load_pretrained(parallel, shared)
        _assert_same(parallel, serial, mesh)
        return
    with pytest.raises(ValueError, match=r"holds transformer\.wte\.weight and lm_head\.weight with different"):
        load_pretrained(parallel, shared)
    for key, value in serial_state_dict(parallel).items():
        assert torch.equal(value, before[key]), key  # nothing changed


def test_a_base_model_reads_the_checkpoint_of_its_lm(mesh, shared, caplog):
    """``LlamaModel`` from a ``LlamaForCausalLM`` checkpoint (keys under "model."), as transformers'
    ``from_pretrained`` reads it: every weight, the head's key named as not read."""
    _on_rank0(lambda: _llama(mesh, 0).save_pretrained(shared))
    reference = transformers.LlamaModel.from_pretrained(shared)
    torch.manual_seed(1)
    parallel = parallelize(transformers.LlamaModel(reference.config), mesh)
    with caplog.at_level(logging.INFO, logger="optimus2d"):
        load_pretrained(parallel, shared, progress=False)
    state, want = serial_state_dict(parallel), reference.state_dict()
    assert set(state) == set(want) and all(torch.equal(state[k], v) for k, v in want.items())
    said = "1 keys of a head the model has not (lm_head.weight)"
    assert mesh.index("mesh") != 0 or said in caplog.text, caplog.text


def test_a_rank_failing_to_read_fails_every_rank(mesh, shared, monkeypatch):
    serial = _llama(mesh, 0)
    _on_rank0(lambda: serial.save_pretrained(shared))
    parallel = parallelize(_llama(mesh, 1), mesh)
    failing = mesh.size - 1  # the last rank of the mesh cannot read its blocks

    def broken(block_file, *args, **kwargs):
        raise OSError("disk unreadable")

    if mesh.index("mesh") == failing:
        monkeypatch.setattr(P, "_read_block", broken)
    with pytest.raises((RuntimeError, OSError), match="disk unreadable"):
        load_pretrained(parallel, shared)


def test_save_is_atomic(mesh, shared, monkeypatch):
    """A failed save leaves the last one as it was (and a tokenizer beside it); a save killed between
    its two renames leaves it at ``path.optimus2d-previous``, which load and the next save take up."""
    path = os.path.join(shared, "model")
    first = parallelize(_gpt2(mesh, 0), mesh)
    save_pretrained(first, path, max_shard_size="30KB")
    _on_rank0(lambda: _write_text(os.path.join(path, "tokenizer.json"), "{}"))
    second = parallelize(_gpt2(mesh, 1), mesh)
    calls = []

    def failing_write(f, full, t):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        real_write(f, full, t)

    real_write = P._write_tensor
    monkeypatch.setattr(P, "_write_tensor", failing_write)
    opened, real_writer = [], P.integrity.Writer
    monkeypatch.setattr(P.integrity, "Writer", lambda f, header: opened.append(f) or real_writer(f, header))
    with pytest.raises((RuntimeError, OSError), match="disk full"):
        save_pretrained(second, path, max_shard_size="30KB")
    monkeypatch.undo()
    assert len(opened) == (mesh.index("mesh") == 0) and all(f.closed for f in opened)  # the shard it failed in
    assert not os.path.exists(path + P.SAVING) and os.path.isfile(os.path.join(path, "tokenizer.json"))
    _assert_same(first, transformers.GPT2LMHeadModel.from_pretrained(path), mesh)

    _on_rank0(lambda: os.rename(path, path + P.PREVIOUS))  # as if killed between the renames
    probe = parallelize(_gpt2(mesh, 2), mesh)
    load_pretrained(probe, path)
    _assert_same(probe, transformers.GPT2LMHeadModel.from_pretrained(path + P.PREVIOUS), mesh)
    save_pretrained(second, path)  # one file now: the old shards go, the tokenizer stays
    assert sorted(os.listdir(path)) == ["config.json", "generation_config.json", P.WEIGHTS, "tokenizer.json"]
    assert not os.path.exists(path + P.PREVIOUS)
    _assert_same(second, transformers.GPT2LMHeadModel.from_pretrained(path), mesh)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["GPT2LMHeadModel"]


def test_block_slices_cover_the_block_that_shard_gives(mesh):
    """``block_slices`` agrees with ``comm.sharding.shard`` on padded, fused and depth-split tensors."""
    from optimus2d.comm.sharding import Sharding

    cases = [
        Sharding((("col",), ("row",)), (97, 48)),  # a padded vocabulary
        Sharding((("row",), ("col",)), (48 * 3, 48), parts=(48, 48, 48)),  # fused q/k/v
        Sharding((("col",), ("row",)), (48, 72), parts=(24, 48), parts_dim=1),  # Conv1D layout, uneven parts
        Sharding((("depth", "col"), (), ("row",)), (13, 3, 10)),  # batch over depth·q, padded
        Sharding((("row",),), (7,)),
    ]
    for sharding in cases:
        full = (torch.arange(torch.Size(sharding.full_shape).numel(), dtype=torch.float64) + 1).view(
            sharding.full_shape
        )
        want = shard(full, mesh, sharding)
        got = torch.zeros(sharding.local_shape(mesh), dtype=torch.float64)
        for src, dst in P.block_slices(sharding, mesh):
            got[dst] = full[src]
        assert torch.equal(got, want), sharding
