"""Hugging Face LLaMA, built from a small random config (no download), on the mesh."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from torch.distributed.tensor import DTensor

import optimus2d
from optimus2d import gather, parallelize, scatter_batch, serial_state_dict

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]


def _tiny_llama(mesh):
    heads, kv_heads = (6, 3) if mesh.q == 3 else (4, 2)  # grouped-query attention, heads divisible by q
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_llama_logits_and_one_training_step(mesh):
    serial = _tiny_llama(mesh)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert isinstance(parallel.model.layers[0].self_attn.q_proj, optimus2d.layers.Linear2D)
    assert isinstance(parallel.model.norm, optimus2d.layers.RMSNorm2D)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 9))

    logits_ref = serial(input_ids=ids, use_cache=False).logits
    loss_ref = F.cross_entropy(logits_ref[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss_ref.backward()
    torch.optim.SGD(serial.parameters(), lr=0.5).step()

    logits = parallel(input_ids=scatter_batch(ids, mesh), use_cache=False).logits  # [b/(d·q), s, V/q]
    loss = optimus2d.cross_entropy(logits[:, :-1], scatter_batch(ids, mesh)[:, 1:], mesh)
    loss.backward()
    torch.optim.SGD(parallel.parameters(), lr=0.5).step()
    state = serial_state_dict(parallel)

    assert_close(gather(logits.detach(), mesh), logits_ref, 1e-4, "logits")
    assert_close(loss, loss_ref, 1e-5, "loss")
    assert set(state) == set(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-4, key)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_gpt2_attention_dropout_draws_a_mask_per_shard(mesh, kernel):
    """GPT-2's attention hands attn_dropout.p to its kernel (F.dropout, SDPA's dropout_p) and never
    calls the module: it ran outside shard_rng, each rank's heads under the same mask (the default
    attn_pdrop=0.1). Its forward now runs in shard_rng: a seed per rank, the same for a seed."""
    from mpi4py import MPI

    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=48, n_layer=1, n_head=6, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.5, attn_implementation=kernel,
    )  # fmt: skip
    torch.manual_seed(0)
    parallel = parallelize(transformers.GPT2LMHeadModel(config), mesh).train()
    seeds = []
    parallel.transformer.h[0].attn.c_proj.register_forward_pre_hook(lambda *_: seeds.append(torch.initial_seed()))
    ids = scatter_batch(torch.randint(0, 96, (2 * mesh.depth * mesh.q, 9)), mesh)
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(parallel(input_ids=ids).logits.detach())
    assert torch.equal(outs[0], outs[1]) and seeds[0] == seeds[1]  # reproducible for a seed
    assert len(set(MPI.COMM_WORLD.allgather(seeds[0]))) == MPI.COMM_WORLD.size  # a seed of its own


def _gpt2(kernel: str):
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=48, n_layer=2, n_head=6, attn_implementation=kernel
    )  # dropouts 0.1, then 0 as TRL's disable_dropout_in_model sets them
    return transformers.GPT2LMHeadModel(config)


def _opt(kernel: str):
    config = transformers.OPTConfig(
        vocab_size=96, hidden_size=48, ffn_dim=96, num_hidden_layers=2, num_attention_heads=6,
        max_position_embeddings=32, word_embed_proj_dim=48, attn_implementation=kernel,
    )  # fmt: skip
    return transformers.OPTForCausalLM(config)


@pytest.mark.parametrize(("make", "kernel"), [(_gpt2, "eager"), (_gpt2, "sdpa"), (_opt, "sdpa")], ids=str)
def test_a_training_forward_without_dropout_takes_nothing_from_the_generator(mesh, make, kernel):
    """Every dropout at 0 in train mode (TRL's disable_dropout_in_model, then sampling): a forward
    that hands a probability to its kernel or calls F.dropout itself ran in shard_rng all the same,
    which takes one number from torch's generator, so the next sample was not serial's (GPT-2's
    first sampled token differed). Now it runs there only while a probability is not 0."""
    torch.manual_seed(0)
    serial = make(kernel)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    for model in (serial, parallel):
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        for name in ("dropout", "attn_dropout_p"):  # OPT's decoder layers read a float
            for module in model.modules():
                if isinstance(getattr(module, name, None), float):
                    setattr(module, name, 0.0)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 9))
    after = []
    for model, x in ((serial.train(), ids), (parallel.train(), scatter_batch(ids, mesh))):
        torch.manual_seed(7)
        model(input_ids=x)
        after.append(torch.rand(4))
    assert torch.equal(after[0], after[1]), after


@pytest.mark.parametrize("vocab", [96, 97], ids=["vocab96", "vocab97"])  # 97: padded inside on q = 2, 3
def test_gpt2_logits_and_one_training_step(mesh, vocab):
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=32, n_embd=48, n_layer=2, n_head=6, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    serial = transformers.GPT2LMHeadModel(config)
    assert serial.lm_head.weight is serial.transformer.wte.weight  # tied
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert isinstance(parallel.lm_head, optimus2d.layers.TiedHead2D)
    assert parallel.lm_head.weight is parallel.transformer.wte.weight
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2 * mesh.depth * mesh.q, 9))

    logits_ref = serial(input_ids=ids, use_cache=False).logits
    loss_ref = F.cross_entropy(logits_ref[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss_ref.backward()
    torch.optim.SGD(serial.parameters(), lr=0.5).step()

    logits = parallel(input_ids=scatter_batch(ids, mesh), use_cache=False).logits  # [b/(d·q), s, ⌈V/q⌉]
    loss = optimus2d.cross_entropy(logits[:, :-1], scatter_batch(ids, mesh)[:, 1:], mesh)
    loss.backward()
    torch.optim.SGD(parallel.parameters(), lr=0.5).step()
    state = serial_state_dict(parallel)

    full = gather(logits.detach(), mesh)[..., :vocab]
    assert_close(full, logits_ref, 1e-4, "logits")
    assert_close(loss, loss_ref, 1e-5, "loss")
    assert set(state) == set(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-4, key)


def _tiny_gpt2(mesh):
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=48, n_layer=2, n_head=6, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("family", [_tiny_llama, _tiny_gpt2], ids=["llama", "gpt2"])
def test_frozen_parameters_of_a_family_stay_frozen(mesh, family):
    serial = family(mesh)
    names = [name for name, _ in serial.named_parameters()]
    frozen = set(names[1::2])  # every other parameter: norms, projections, the embedding or not
    for name, param in serial.named_parameters():
        param.requires_grad_(name not in frozen)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert {n: p.requires_grad for n, p in parallel.named_parameters()} == {n: n not in frozen for n in names}
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 9))
    logits_ref = serial(input_ids=ids, use_cache=False).logits
    F.cross_entropy(logits_ref[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    torch.optim.SGD([p for p in serial.parameters() if p.requires_grad], lr=0.5).step()
    local = scatter_batch(ids, mesh)
    logits = parallel(input_ids=local, use_cache=False).logits
    optimus2d.cross_entropy(logits[:, :-1], local[:, 1:], mesh).backward()
    torch.optim.SGD([p for p in parallel.parameters() if p.requires_grad], lr=0.5).step()
    assert all(p.grad is None for n, p in parallel.named_parameters() if n in frozen)
    state = serial_state_dict(parallel)
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-4, key)


def test_muon_is_refused_on_a_padded_vocabulary(mesh):
    """torch.optim.Muon scales its step by the parameter's shape: on GPT-2's table of 97 rows, stored
    padded to 98 on q = 2, it was 1.2e-3 off serial after 3 steps (its Newton-Schulz in float64).
    Refused before the step, naming the shape; the other 2-D weights step as before."""
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=48, n_layer=1, n_head=6, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    parallel = parallelize(transformers.GPT2LMHeadModel(config), mesh)
    ids = scatter_batch(torch.randint(0, 97, (2 * mesh.depth * mesh.q, 9)), mesh)
    table = torch.optim.Muon([parallel.transformer.wte.weight], lr=0.02)
    weights = [p for n, p in parallel.named_parameters() if p.dim() == 2 and ".h." in n]
    others = torch.optim.Muon(weights, lr=0.02)
    parallel(input_ids=ids, labels=ids).loss.backward()
    stepped = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)  # Muon on DTensors: seen there
    if stepped:
        full = lambda p: p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()  # noqa: E731
        before = [full(p).clone() for p in weights]
        others.step()
        assert all(not torch.equal(full(p), b) for p, b in zip(weights, before, strict=True))
    if mesh.q == 1:
        if stepped:
            table.step()  # not padded
    else:
        with pytest.raises(
            ValueError,
            match=rf"Muon: 1 parameter\(s\) are stored padded, \({-(-97 // mesh.q) * mesh.q}, 48\) \(serial \(97, ",
        ):
            table.step()
