"""Hugging Face habits on converted causal LMs: ``labels=``, ``generate()``, serial answers."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, raises_fast

import optimus2d
from optimus2d import parallelize, scatter_batch, serial_state_dict

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]


def _llama(mesh, vocab=96, cls=None):
    heads, kv_heads = (6, 3) if mesh.q == 3 else (4, 2)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return (cls or transformers.LlamaForCausalLM)(config)


def _gpt2(mesh, vocab=96):
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=32, n_embd=48, n_layer=2, n_head=6, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


FAMILIES = {
    "llama": lambda mesh: _llama(mesh),
    "gpt2_96": lambda mesh: _gpt2(mesh, 96),
    "gpt2_97": lambda mesh: _gpt2(mesh, 97),  # 97: the tied table is padded inside on q = 2, 3
}


def _pair(mesh, family):
    serial = FAMILIES[family](mesh).eval()
    return serial, parallelize(copy.deepcopy(serial), mesh)


def _ids(mesh, vocab, rows=None, seq=7, seed=1):
    torch.manual_seed(seed)
    return torch.randint(0, vocab, (rows or 2 * mesh.depth * mesh.q, seq))


# ---- labels= -------------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [False, True], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_labels_loss_and_one_adamw_step(mesh, family, count):
    serial, parallel = _pair(mesh, family)
    serial.train(), parallel.train()
    vocab = serial.config.vocab_size
    ids = _ids(mesh, vocab, seq=9)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained on
    labels[-1, 5] = -100
    labels[1, -1] = vocab - 1  # the last class (in the padded block on q = 2, 3 for 97)
    extra = {"num_items_in_batch": torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)} if count else {}

    loss_ref = serial(input_ids=ids, labels=labels, **extra).loss
    loss_ref.backward()
    torch.optim.AdamW(serial.parameters(), lr=1e-2, eps=1e-4).step()

    out = parallel(input_ids=scatter_batch(ids, mesh), labels=scatter_batch(labels, mesh), **extra)
    out.loss.backward()
    torch.optim.AdamW(parallel.parameters(), lr=1e-2, eps=1e-4).step()

    assert out.loss.dim() == 0 and out.loss.dtype == torch.float32
    assert_close(out.loss, loss_ref, 1e-5, "loss")
    state = serial_state_dict(parallel)
    assert set(state) == set(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-4, key)


def test_labels_refusals(mesh):
    serial, parallel = _pair(mesh, "gpt2_97")
    ids = _ids(mesh, 97)
    local = scatter_batch(ids, mesh)
    if mesh.size > 1:
        with pytest.raises(ValueError, match="scatter_batch"):
            parallel(input_ids=local, labels=ids)  # the full labels
    bad = ids.clone()
    bad[0, 3] = 97  # outside the vocabulary, though inside the padded table on q = 2, 3
    with pytest.raises(IndexError):
        serial(input_ids=ids, labels=bad)
    with pytest.raises(ValueError, match=r"outside \[0, 97\)"):
        parallel(input_ids=local, labels=scatter_batch(bad, mesh))
    custom = _llama(mesh)
    custom.loss_function = lambda logits, labels, **kw: logits.sum()
    custom = parallelize(custom, mesh)
    with pytest.raises(TypeError, match="not transformers' ForCausalLMLoss"):
        custom(input_ids=scatter_batch(_ids(mesh, 96), mesh), labels=scatter_batch(_ids(mesh, 96), mesh))


def test_a_mask_of_other_rows_than_the_ids_is_refused(mesh):
    """``attention_mask`` left whole beside ``scatter_batch``-ed ids ran and gave wrong logits (transformers
    reads the block's rows of it: 0.09 off); now a ValueError on every rank. Its block is exact."""
    serial, parallel = _pair(mesh, "llama")
    ids = _ids(mesh, 96)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded
    local = scatter_batch(ids, mesh)
    got = optimus2d.gather(parallel(input_ids=local, attention_mask=scatter_batch(mask, mesh)).logits, mesh)
    assert_close(got[..., :96], serial(input_ids=ids, attention_mask=mask).logits, 1e-4, "logits, padded")
    if mesh.size > 1:
        call = lambda: parallel(input_ids=local, attention_mask=mask)  # noqa: E731
        message = raises_fast(ValueError, r"LlamaForCausalLM: attention_mask \[\d+, 7\] has \d+ rows", call)
        assert "scatter_batch(attention_mask, mesh)" in message and str(mesh) in message
    with pytest.raises(ValueError, match=r"token_type_ids \[3, 7\]"):  # neither one row nor the ids'
        parallel(input_ids=local, token_type_ids=torch.zeros(3, 7, dtype=torch.long))


# ---- generate() ----------------------------------------------------------------------------------
def _left_padded(ids):
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0 starts 3 tokens later, row 1 one token later
    mask[1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("padded", [False, True], ids=["nomask", "leftpad"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("family", ["llama", "gpt2_97"])
def test_generate_gives_the_serial_tokens(mesh, family, sample, padded):
    serial, parallel = _pair(mesh, family)
    ids = _ids(mesh, serial.config.vocab_size)
    kwargs = {"max_new_tokens": 6, "do_sample": sample, "pad_token_id": 0}
    if sample:
        kwargs.update(top_k=20, temperature=0.7)
    if padded:
        ids, kwargs["attention_mask"] = _left_padded(ids)
    torch.manual_seed(5)
    want = serial.generate(ids, **kwargs)
    torch.manual_seed(5)  # the same seed on every rank
    hooks = _hooks(parallel)
    got = parallel.generate(ids, **kwargs)
    assert want.shape == (ids.shape[0], ids.shape[1] + 6)
    assert torch.equal(got, want), f"{got[:, ids.shape[1] :].tolist()} != {want[:, ids.shape[1] :].tolist()}"
    assert _hooks(parallel) == hooks  # generate's own removed after it


@pytest.mark.parametrize("family", ["llama", "gpt2_97"])
def test_generate_without_cache_odd_batch_and_outputs(mesh, family):
    serial, parallel = _pair(mesh, family)
    ids = _ids(mesh, serial.config.vocab_size, rows=mesh.depth * mesh.q + 1)  # padded to a multiple of d·q inside
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    want = serial.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(parallel.generate(ids, use_cache=False, **kwargs), want)
    more = {"return_dict_in_generate": True, "output_scores": True, "output_hidden_states": True}
    want = serial.generate(ids, **kwargs, **more)
    got = parallel.generate(ids, **kwargs, **more)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):
        assert_close(a, b, 1e-4, "scores")
    for a, b in zip(got.hidden_states[-1], want.hidden_states[-1], strict=True):  # the last step, every layer
        assert_close(a, b, 1e-4, "hidden states")


@pytest.mark.parametrize("family", ["llama", "gpt2_97"])
def test_generate_with_guidance_and_rows_alike(mesh, family):
    """Classifier-free guidance: HF's logits processor calls the model itself with input_ids
    positional (refused: "positional inputs"). Rows alike with output_hidden_states: on a depth
    mesh every rank's hidden-state block is the same, and gather took them for the full tensor."""
    serial, parallel = _pair(mesh, family)
    ids = _ids(mesh, serial.config.vocab_size)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    for guided in ({"guidance_scale": 1.5}, {"guidance_scale": 1.5, "negative_prompt_ids": ids[:, :3]}):
        assert torch.equal(parallel.generate(ids, **kwargs, **guided), serial.generate(ids, **kwargs, **guided))
    alike = ids[:1].expand(ids.shape[0], -1)
    more = {"return_dict_in_generate": True, "output_hidden_states": True}
    want, got = serial.generate(alike, **kwargs, **more), parallel.generate(alike, **kwargs, **more)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.hidden_states[-1], want.hidden_states[-1], strict=True):
        assert_close(a, b, 1e-4, "hidden states")


def test_generate_from_inputs_embeds(mesh):
    serial, parallel = _pair(mesh, "llama")
    ids = _ids(mesh, 96)
    with torch.no_grad():
        embeds = serial.get_input_embeddings()(ids)
    want = serial.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, pad_token_id=0)
    got = parallel.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def _hooks(model) -> tuple[list, list]:
    return list(model._forward_pre_hooks.values()), list(model._forward_hooks.values())


def test_generate_refusals(mesh):
    _, parallel = _pair(mesh, "llama")
    ids = _ids(mesh, 96)
    hooks = _hooks(parallel)
    with pytest.raises(ValueError, match="beam_search is not supported"):
        parallel.generate(ids, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="cache_implementation='static'"):
        parallel.generate(ids, max_new_tokens=2, cache_implementation="static")
    static = transformers.StaticCache(config=parallel.config, max_cache_len=16)  # handed to the forward as cache=
    with pytest.raises(ValueError, match="StaticCache is not supported"):
        parallel.generate(ids, max_new_tokens=2, past_key_values=static)
    with pytest.raises(ValueError, match="output_attentions"):
        parallel.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    with pytest.raises(TypeError, match="resize the serial model"):
        parallel.resize_token_embeddings(128)
    assert _hooks(parallel) == hooks


# ---- what HF reads from the converted modules ------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2_97"])
def test_serial_answers(mesh, family):
    serial = FAMILIES[family](mesh)
    frozen = [name for name, _ in serial.named_parameters()][1::3]
    for name, param in serial.named_parameters():
        param.requires_grad_(name not in frozen)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    for kwargs in ({}, {"only_trainable": True}, {"exclude_embeddings": True}):
        assert parallel.num_parameters(**kwargs) == serial.num_parameters(**kwargs), kwargs
    emb, emb_ref = parallel.get_input_embeddings(), serial.get_input_embeddings()
    assert isinstance(emb, optimus2d.layers.Embedding2D)
    assert (emb.num_embeddings, emb.embedding_dim) == (emb_ref.num_embeddings, emb_ref.embedding_dim)
    head, head_ref = parallel.get_output_embeddings(), serial.get_output_embeddings()
    if isinstance(head, optimus2d.layers.Linear2D):
        assert (head.in_features, head.out_features) == (head_ref.in_features, head_ref.out_features)
    else:  # GPT-2's tied head
        assert head.weight is emb.weight and head.num_embeddings == head_ref.out_features


def test_a_causal_lm_is_recognised_by_what_it_is(mesh):
    class MyLM(transformers.LlamaForCausalLM):
        pass

    serial = _llama(mesh, cls=MyLM).eval()
    wrapped = parallelize(torch.nn.ModuleDict({"lm": copy.deepcopy(serial)}), mesh)  # found inside the root too
    ids = _ids(mesh, 96)
    want = serial.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(wrapped["lm"].generate(ids, max_new_tokens=3, do_sample=False), want)
    base = parallelize(copy.deepcopy(serial.model), mesh)  # a LlamaModel: no head, no generate
    assert "generate" not in vars(base) and base.num_parameters() == serial.model.num_parameters()


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_every_converted_model_answers_num_parameters_for_the_serial_one(mesh, family):
    """BERT (no lm_head) too: transformers' own counted this rank's blocks; T5's relative position
    biases are embeddings to transformers (they are HeadTable2D here)."""
    torch.manual_seed(0)
    if family == "bert":
        serial = transformers.BertModel(transformers.BertConfig(
            vocab_size=50, hidden_size=24 * mesh.q, num_hidden_layers=1, num_attention_heads=2 * mesh.q,
            intermediate_size=48, max_position_embeddings=16,
        ))  # fmt: skip
    else:
        serial = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=48, d_model=48, d_kv=8, d_ff=96, num_layers=1, num_decoder_layers=1, num_heads=6,
            relative_attention_num_buckets=8, dropout_rate=0.0,
        ))  # fmt: skip
    parallel = parallelize(copy.deepcopy(serial), mesh)
    for kwargs in ({}, {"exclude_embeddings": True}, {"only_trainable": True}):
        assert parallel.num_parameters(**kwargs) == serial.num_parameters(**kwargs), kwargs
    with pytest.raises(TypeError, match="resize the serial model"):
        parallel.resize_token_embeddings(64)
