"""Context parallelism for one module through ``parallelize(..., plan={path: context.ContextParallel(mesh)})``.

The planned module (a LLaMA body, a LLaVA's language model) runs with its sequence split over the
mesh's depth axis while the rest of the model keeps the batch layout: the caller scatters the batch
as usual (``scatter_batch``), the head and the loss are unchanged. Against transformers' serial
model: logits, the loss, every gradient and every parameter after one AdamW step (float64:
logits and loss ≤ 1e-6; after the step ≤ 1e-5, transformers' norms computing in float32), and the
bytes of the boundary's all-to-alls against the formula. Refusals on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, compare_step, raises_fast, torch_rms_norms

import optimus2d
from optimus2d import context

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]


def _llama(q: int):
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32 * q, intermediate_size=32 * q, num_hidden_layers=2,
        num_attention_heads=4 * q, num_key_value_heads=2 * q, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def _batch(mesh, s: int):
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2 * mesh.q * mesh.depth, s))
    return ids, ids.clone()


@pytest.mark.parametrize(("balance", "attention"), [("head_tail", "all_gather"), ("makespan", "ring")])
def test_llama_body_with_context_parallelism_equals_serial(mesh, balance, attention):
    c = mesh.depth
    s = 2 * c * 8
    serial = _llama(mesh.q)
    spec = context.ContextParallel(mesh, balance=balance, attention=attention)
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": spec})
    ids, labels = _batch(mesh, s)
    want = serial(input_ids=ids, labels=labels)
    want.loss.backward()
    with optimus2d.count_comm() as counted:
        got = model(input_ids=optimus2d.scatter_batch(ids, mesh), labels=optimus2d.scatter_batch(labels, mesh))
    assert_close(optimus2d.gather(got.logits, mesh), want.logits, 1e-6, "logits")
    assert_close(got.loss, want.loss, 1e-6, "loss")
    moved = [r for r in counted.records if r.kind == "all_to_all"]
    tokens = ids.shape[0] // (mesh.q * c) * s
    # forward: the ids in (the embedding is the body's), the last hidden state out, each the rank's
    # block; each rank sends (c - 1)/c of it and receives as much
    assert [r.numel for r in moved] == ([tokens, tokens * serial.config.hidden_size // mesh.q] if c > 1 else [])
    kinds = {r.kind for r in counted.records if r.axis == "depth"} & {"all_gather", "ring"}  # K and V
    assert kinds == ({attention} if c > 1 else set())
    got.loss.backward()
    compare_step(serial, model, mesh, tol=1e-5)


def test_auto_takes_the_ring_when_the_gathered_keys_do_not_fit(mesh):
    """The cost model's pick: the all-gather (fewer bytes) unless its held elements exceed the memory given."""
    if mesh.depth == 1:
        pytest.skip("c = 1: no attention communication to pick")
    serial = _llama(mesh.q)
    b, s, c = 2 * mesh.q * mesh.depth, 2 * mesh.depth * 8, mesh.depth
    heads, d_h, n = 4, 32 // 4, s // c  # a rank's heads (4q of them over q), head dim, tokens
    counts = optimus2d.cost.context_attention(b // mesh.q, heads, n, d_h, c)
    need = counts["all_gather"]["held"] * 8  # float64
    for memory, kind in ((need, "all_gather"), (need - 1, "ring")):
        spec = context.ContextParallel(mesh, memory=memory)
        model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": spec})
        ids, _ = _batch(mesh, s)
        with optimus2d.count_comm() as counted:
            model(input_ids=optimus2d.scatter_batch(ids, mesh))
        assert {r.kind for r in counted.records if r.axis == "depth"} & {"all_gather", "ring"} == {kind}, memory


_ALL_DEPTH = {}


def test_the_split_module_on_a_mesh_of_its_own(mesh):
    """The body on Mesh(1, p) (c = p), the embedding's caller and the head on the model's mesh:
    ``redistribute`` moves the ids to the body's mesh, the all-to-all splits their sequence."""
    if mesh.size == 1 or mesh.depth == mesh.size:
        pytest.skip("needs a model mesh other than Mesh(1, p)")
    if mesh.size not in _ALL_DEPTH:
        _ALL_DEPTH[mesh.size] = optimus2d.Mesh(1, mesh.size)
    cp = _ALL_DEPTH[mesh.size]
    serial = _llama(mesh.q)  # the head on the model's mesh: sizes divide by its q
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": context.ContextParallel(cp)})
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (mesh.size, 4 * cp.depth))  # the batch divides over both meshes
    labels = ids.clone()
    want = serial(input_ids=ids, labels=labels)
    want.loss.backward()
    got = model(input_ids=optimus2d.scatter_batch(ids, mesh), labels=optimus2d.scatter_batch(labels, mesh))
    got.loss.backward()
    assert_close(got.loss, want.loss, 1e-6, "loss")
    for m in (serial, model):
        torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-3).step()
    state = optimus2d.serial_state_dict(model)  # blocks of both meshes
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-5, key)


def test_gpt2_learned_positions_follow_the_split(mesh):
    """GPT-2 reads a learned position table at ``position_ids``: the tokens' own, wherever they sit."""
    config = transformers.GPT2Config(
        vocab_size=96, n_embd=16 * mesh.q, n_layer=2, n_head=2 * mesh.q, n_positions=64, attn_pdrop=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    serial = transformers.GPT2LMHeadModel(config).double()
    plan = {"transformer": context.ContextParallel(mesh, attention="ring")}
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=plan)
    ids, labels = _batch(mesh, 4 * mesh.depth)
    want = serial(input_ids=ids, labels=labels)
    want.loss.backward()
    got = model(input_ids=optimus2d.scatter_batch(ids, mesh), labels=optimus2d.scatter_batch(labels, mesh))
    got.loss.backward()
    assert_close(got.loss, want.loss, 1e-6, "loss")
    compare_step(serial, model, mesh, tol=1e-5)


def test_qwen2_with_its_sequence_split_equals_serial(mesh):
    """Qwen2: biased q/k/v projections, grouped-query attention (its sliding window off, as by default);
    its RMSNorms torch's, in float64 (HF's computes in float32: 1.4e-5 after the step on 2x2 even at c = 1).
    The step is held to 1e-5: Adam's division by |g| lifts the rounding of the smallest gradients (a
    v_proj bias) to 1.3e-6 on 2x2x2."""
    config = transformers.Qwen2Config(
        vocab_size=96, hidden_size=32 * mesh.q, intermediate_size=32 * mesh.q, num_hidden_layers=2,
        num_attention_heads=4 * mesh.q, num_key_value_heads=2 * mesh.q, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    serial = transformers.Qwen2ForCausalLM(config).double()
    torch_rms_norms(serial, config.hidden_size, "Qwen2RMSNorm")
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": context.ContextParallel(mesh)})
    ids, labels = _batch(mesh, 2 * mesh.depth * 4)
    want = serial(input_ids=ids, labels=labels)
    want.loss.backward()
    got = model(input_ids=optimus2d.scatter_batch(ids, mesh), labels=optimus2d.scatter_batch(labels, mesh))
    got.loss.backward()
    assert_close(optimus2d.gather(got.logits.detach(), mesh), want.logits, 1e-6, "logits")
    assert_close(got.loss, want.loss, 1e-6, "loss")
    compare_step(serial, model, mesh, tol=1e-5)


def test_hidden_states_come_back_in_sequence_order(mesh):
    serial = _llama(mesh.q)
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": context.ContextParallel(mesh)})
    ids, _ = _batch(mesh, 4 * mesh.depth)
    want = serial(input_ids=ids, output_hidden_states=True).hidden_states
    got = model(input_ids=optimus2d.scatter_batch(ids, mesh), output_hidden_states=True).hidden_states
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(optimus2d.gather(g, mesh), w, 1e-6, f"hidden_states[{n}]")


def _llava(q: int):
    image = 95  # 16×16 images of 8×8 patches: 4 feature rows each (class token dropped)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6, image_size=16,
            patch_size=8,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=96, hidden_size=24 * q, intermediate_size=48 * q, num_hidden_layers=2,
            num_attention_heads=4 * q, num_key_value_heads=2 * q, max_position_embeddings=128,
        ),
        image_token_id=image, vision_feature_layer=-2, vision_feature_select_strategy="default",
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).double()
    with torch.no_grad():  # every parameter off its init: a wrong block shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model, image


@pytest.mark.parametrize("tower", ["same", "own"])
def test_llava_with_its_language_model_context_parallel_equals_serial(mesh, tower):
    """The image features merged at their tokens in the batch layout, then the fused sequence split
    over depth in the language model; the frozen tower on the model's mesh or on Mesh(1, p)."""
    serial, image = _llava(mesh.q)
    serial.model.vision_tower.requires_grad_(False)
    plan = {"model.language_model": context.ContextParallel(mesh)}
    if tower == "own":
        plan["model.vision_tower"] = optimus2d.Mesh(1, mesh.size) if mesh.size > 1 else mesh
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan=plan)
    b, s = mesh.size, 16 * mesh.depth  # the batch divides over q·depth and over Mesh(1, p)
    torch.manual_seed(1)
    ids = torch.randint(1, image, (b, s))
    for row in range(b):
        start = 1 + 3 * row % (s - 5)  # the image's 4 tokens at a place that differs by sample
        ids[row, start : start + 4] = image
    batch = dict(
        input_ids=ids, pixel_values=torch.randn(b, 3, 16, 16).double(), labels=ids.masked_fill(ids == image, -100)
    )
    want = serial(**batch)
    want.loss.backward()
    got = model(**{k: optimus2d.scatter_batch(v, mesh) for k, v in batch.items()})
    got.loss.backward()
    assert_close(optimus2d.gather(got.logits.detach(), mesh)[..., :96], want.logits, 1e-6, "logits")
    assert_close(got.loss, want.loss, 1e-6, "loss")
    assert all(p.grad is None for p in model.model.vision_tower.parameters())
    compare_step(serial, model, mesh, tol=1e-5)


def test_refusals_on_every_rank(world_mesh):
    mesh = optimus2d.Mesh(1, world_mesh.size)  # a fresh mesh (a refusal may leave it unusable), c = p
    model = optimus2d.parallelize(_llama(mesh.q), mesh, plan={"model": context.ContextParallel(mesh)})
    c = mesh.depth
    ids, _ = _batch(mesh, 2 * c * 4 + 1)  # head_tail needs 2c chunks
    raises_fast(
        ValueError, "pad the sequence to a multiple of", lambda: model(input_ids=optimus2d.scatter_batch(ids, mesh))
    )
    ids, _ = _batch(mesh, 2 * c * 4)
    padding = torch.ones_like(ids)
    padding[-1, -1] = 0  # the last sample: on the last rank's block only
    raises_fast(
        ValueError,
        "padding attention_mask",
        lambda: model(
            input_ids=optimus2d.scatter_batch(ids, mesh), attention_mask=optimus2d.scatter_batch(padding, mesh)
        ),
    )
    with pytest.raises(TypeError, match="ContextParallel"):
        optimus2d.parallelize(_llama(mesh.q), mesh, plan={"model": "context"})


def test_a_deep_copy_runs_its_own_weights(mesh):
    """An EMA twin (``copy.deepcopy``) of a converted model runs its own body, split as the original's."""
    serial = _llama(mesh.q)
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": context.ContextParallel(mesh)})
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.model.parameters():
            p.mul_(0.5)
        for p in serial.model.parameters():
            p.mul_(0.5)
    ids, _ = _batch(mesh, 2 * mesh.depth * 4)
    got = twin(input_ids=optimus2d.scatter_batch(ids, mesh)).logits
    assert_close(optimus2d.gather(got.detach(), mesh), serial(input_ids=ids).logits, 1e-6, "the twin's logits")


def test_each_samples_own_position_ids_follow_it(mesh):
    """position_ids ``[b, s]`` per sample (here each shifted by its index), one sample a rank or more."""
    serial = _llama(mesh.q)
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": context.ContextParallel(mesh)})
    s = 2 * mesh.depth * 4
    for b in (mesh.q * mesh.depth, 2 * mesh.q * mesh.depth):  # a rank's batch block of 1, then of 2
        torch.manual_seed(b)
        ids = torch.randint(0, 96, (b, s))
        positions = torch.arange(s)[None] + 5 * torch.arange(b)[:, None]
        want = serial(input_ids=ids, position_ids=positions).logits
        local = {k: optimus2d.scatter_batch(v, mesh) for k, v in (("input_ids", ids), ("position_ids", positions))}
        assert_close(optimus2d.gather(model(**local).logits.detach(), mesh), want, 1e-6, f"logits, b = {b}")


def test_an_encoder_attends_both_ways_or_is_refused(mesh):
    """BERT (``is_causal=False``) under the default causal mask: refused on every rank; under the
    all-true mask it equals serial."""
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=16 * mesh.q, intermediate_size=32 * mesh.q, num_hidden_layers=2,
        num_attention_heads=2 * mesh.q, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    serial = transformers.BertForMaskedLM(config).double()
    s = 2 * mesh.depth * 4
    ids, _ = _batch(mesh, s)
    refused = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"bert": context.ContextParallel(mesh)})
    with pytest.raises(ValueError, match=r"BertSelfAttention attends both ways \(is_causal=False\)"):
        refused(input_ids=optimus2d.scatter_batch(ids, mesh))
    spec = context.ContextParallel(mesh, mask=torch.ones(s, s, dtype=torch.bool), balance="uniform")
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"bert": spec})
    got = model(input_ids=optimus2d.scatter_batch(ids, mesh)).logits
    assert_close(optimus2d.gather(got.detach(), mesh)[..., :96], serial(input_ids=ids).logits, 1e-6, "logits")


def test_more_refusals_on_every_rank(world_mesh):
    mesh = optimus2d.Mesh(1, world_mesh.size)
    model = optimus2d.parallelize(_llama(1), mesh, plan={"model": context.ContextParallel(mesh)})
    ids, _ = _batch(mesh, 2 * mesh.depth * 4)
    model.gradient_checkpointing_enable()
    raises_fast(
        ValueError, "recompute their layers in backward", lambda: model(input_ids=optimus2d.scatter_batch(ids, mesh))
    )
    model.gradient_checkpointing_disable()
    # torch's own recompute around a layer (reentrant: gradients from a recompute outside the split,
    # 0.53 off; not reentrant: a CheckpointError), its wrapper or its composable API
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    layers = model.model.layers
    for wrap in (lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.REENTRANT), checkpoint_wrapper):
        wrapped = copy.deepcopy(model)
        wrapped.model.layers[1] = wrap(wrapped.model.layers[1])
        raises_fast(
            ValueError,
            r"\['layers.1'\] recompute their layers",
            lambda m=wrapped: m(input_ids=optimus2d.scatter_batch(ids, mesh)),
        )
    checkpoint(layers[0])
    raises_fast(
        ValueError,
        r"\['layers.0'\] recompute their layers",
        lambda: model(input_ids=optimus2d.scatter_batch(ids, mesh)),
    )
    with torch.no_grad():  # no backward, no recompute
        model(input_ids=optimus2d.scatter_batch(ids, mesh))
    model = optimus2d.parallelize(_llama(1), mesh, plan={"model": context.ContextParallel(mesh)})
    for keyword in ("cache", "past_key_values"):  # transformers 5's name, and the older one
        raises_fast(ValueError, r"a cache \(past_key_values\) is not supported", lambda k=keyword: model(
            input_ids=optimus2d.scatter_batch(ids, mesh), **{k: transformers.DynamicCache(config=model.config)}
        ))  # fmt: skip
    raises_fast(
        ValueError,
        r"\['token_type_ids'\] would stay in the batch layout",
        lambda: model.model(
            input_ids=optimus2d.scatter_batch(ids, mesh), token_type_ids=optimus2d.scatter_batch(ids, mesh)
        ),
    )
    raises_fast(  # a mapping of masks (Gemma 3's, handed on to its language model)
        ValueError,
        "attention_mask is a dict",
        lambda: model.model(input_ids=optimus2d.scatter_batch(ids, mesh), attention_mask={"full_attention": None}),
    )
    # a memory bound that differs on one rank would pick another attention there: refused at parallelize
    memory = 1.0 if optimus2d.comm.mesh.as_mesh(mesh).coord[0] == 0 else None
    raises_fast(
        ValueError,
        "parallelize",
        lambda: optimus2d.parallelize(_llama(1), mesh, plan={"model": context.ContextParallel(mesh, memory=memory)}),
    )

    # ids of another dtype on one rank: agreed with the shapes (the all-to-all sent messages of other
    # sizes: MPI's error on one rank, gloo aborted), refused by name on every rank
    own = optimus2d.comm.mesh.as_mesh(mesh)
    if own.size > 1:
        block = optimus2d.scatter_batch(ids, mesh)
        mine = block.to(torch.int32) if own.rank == own.ranks[-1] else block.clone()
        raises_fast(ValueError, r"the ranks disagree(.|\n)*'input_ids': 'int32\[", lambda: model(input_ids=mine))

    # last (a refusal on some ranks leaves the mesh unusable): one sample's position_ids restart
    # (packed documents, which transformers masks apart without a cache): its rank refuses, and so does
    # every other
    model.config.use_cache = False
    s = 2 * mesh.depth * 4
    one = torch.arange(s)[None].repeat(ids.shape[0], 1)
    one[-1, s // 2 :] -= s // 2
    raises_fast(
        ValueError,
        "position_ids restart inside a row",
        lambda: model(input_ids=optimus2d.scatter_batch(ids, mesh), position_ids=optimus2d.scatter_batch(one, mesh)),
    )


class _OwnAttention(torch.nn.Module):
    """A user's attention that calls torch's kernel itself, not transformers' AttentionInterface."""

    def __init__(self, hidden: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim, self.qkv = head_dim, torch.nn.Linear(hidden, 3 * hidden)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        b, s = hidden_states.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(hidden_states).chunk(3, -1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, -1), None


def test_what_context_parallel_attention_would_not_apply_is_refused_on_every_rank(world_mesh):
    """Layers whose tokens meet outside the kernel (a user's own attention; BLOOM's ALiBi attention),
    T5's position bias handed to the kernel, a 4D mask of the model's own, and shapes that differ
    between ranks (each rank padding its own batch): a ValueError on every rank, none left waiting."""
    mesh = optimus2d.Mesh(1, world_mesh.size)
    c = mesh.depth
    ids, _ = _batch(mesh, 2 * c * 4)
    local = optimus2d.scatter_batch(ids, mesh)
    own = _llama(1)
    for layer in own.model.layers:
        layer.self_attn = _OwnAttention(32, 8).double()
    optimus2d.convert.register_converter(_OwnAttention, keep=True)  # right on whole rows (q = 1)
    try:
        model = optimus2d.parallelize(own, mesh, plan={"model": context.ContextParallel(mesh)})
        raises_fast(
            ValueError,
            r"\['layers.0', 'layers.1'\] ran, but not through the context-parallel attention",
            lambda: model(input_ids=local),
        )
    finally:
        del optimus2d.convert.registry._CONVERTERS[_OwnAttention]
    config = transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4)
    bloom = transformers.BloomForCausalLM(config).double()  # ALiBi: positions of its own, no position_ids
    refused = r"1 module\(s\) cannot run with context parallelism:\n  transformer \(BloomModel\): its forward takes no"
    raises_fast(ValueError, refused, lambda: optimus2d.parallelize(
        bloom, mesh, plan={"transformer": context.ContextParallel(mesh)}
    ))  # fmt: skip
    config = transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4, dropout_rate=0.0
    )
    spec = context.ContextParallel(mesh, mask=torch.ones(2 * c * 4, 2 * c * 4, dtype=torch.bool), balance="uniform")
    t5 = transformers.T5EncoderModel(config).double()  # positions of its own (a relative bias), no position_ids
    raises_fast(ValueError, r"encoder \(T5Stack\): its forward takes no position_ids", lambda: optimus2d.parallelize(
        t5, mesh, plan={"encoder": spec}
    ))  # fmt: skip
    model = optimus2d.parallelize(_llama(1), mesh, plan={"model": context.ContextParallel(mesh)})
    model.config.num_hidden_layers = 1  # a layer that does not run is no layer of this call: not refused
    model(input_ids=local)
    model.config.num_hidden_layers = 2
    attention = model.model.layers[0].self_attn  # a tensor handed to the kernel that it would not apply
    q = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    mask = context.causal_mask(2 * c)
    with context.sequence_parallel(model.model, mesh, context.assign(mask, c), mask):
        kernel = transformers.AttentionInterface()["optimus2d_context"]
        bias = torch.zeros(1, 4, 2, 2 * c)
        raises_fast(ValueError, r"gives its attention \['position_bias'\]", lambda: kernel(
            attention, q, q, q, None, position_bias=bias
        ))  # fmt: skip
    whole = torch.ones(ids.shape[0], 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
    raises_fast(
        ValueError,
        r"attention_mask \[2, 1, \d+, \d+\] is not this rank's block \[b, s\]",
        lambda: model(input_ids=local, attention_mask=optimus2d.scatter_batch(whole, mesh)),
    )
    mine = local if mesh.index("depth") else local[:, : 2 * c]  # the first rank's sequence padded otherwise
    raises_fast(ValueError, r"the ranks disagree(.|\n)*'input_ids': 'int64\[2, \d+\]", lambda: model(input_ids=mine))


def test_a_mask_set_anew_is_the_one_used(mesh):
    """``spec.mask`` set to another between two batches of one length: the second runs under it."""
    serial = _llama(mesh.q)
    spec = context.ContextParallel(mesh)
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": spec})
    s = 2 * mesh.depth * 4
    ids, _ = _batch(mesh, s)
    for mask in (context.causal_mask(s), context.document_mask([s // 2, s // 2])):
        spec.mask = mask
        want = serial(input_ids=ids, attention_mask=mask[None, None].expand(ids.shape[0], 1, s, s)).logits
        got = optimus2d.gather(model(input_ids=optimus2d.scatter_batch(ids, mesh)).logits.detach(), mesh)
        assert_close(got, want, 1e-6, "logits")


def test_packed_documents_in_position_ids_follow_transformers_or_are_refused(mesh):
    """position_ids that restart inside a row with no attention_mask: transformers masks each
    document apart (its padding-free packing). Under the default causal mask (it attends across
    them: 0.54 off): refused on every rank, also where one sample alone is packed; under the
    documents' mask (``ContextParallel(mask=document_mask(...))``): exact; with an attention_mask of
    ones (transformers then attends over the whole row): exact under the causal mask. With a cache
    made (the config's ``use_cache=True``) transformers attends across them: the reverse."""
    c = mesh.depth
    s = 2 * c * 4
    serial = _llama(mesh.q)
    serial.config.use_cache = False  # transformers finds packing only without a cache
    ids, _ = _batch(mesh, s)
    b = ids.shape[0]
    packed = torch.cat([torch.arange(s // 2), torch.arange(s // 2)])[None].expand(b, s).contiguous()
    causal = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": context.ContextParallel(mesh)})
    raises_fast(  # every row packed: the same refusal on every rank (one sample alone: below, on a mesh of its own)
        ValueError,
        "position_ids restart inside a row",
        lambda: causal(
            input_ids=optimus2d.scatter_batch(ids, mesh), position_ids=optimus2d.scatter_batch(packed, mesh)
        ),
    )
    ones = torch.ones_like(ids)
    want = serial(input_ids=ids, position_ids=packed, attention_mask=ones).logits
    got = causal(**{k: optimus2d.scatter_batch(v, mesh) for k, v in
                    (("input_ids", ids), ("position_ids", packed), ("attention_mask", ones))}).logits  # fmt: skip
    assert_close(optimus2d.gather(got.detach(), mesh)[..., :96], want, 1e-6, "logits, a mask of ones")
    spec = context.ContextParallel(mesh, mask=context.document_mask([s // 2, s // 2]), balance="makespan", block=4)
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": spec})
    labels = ids.clone()
    want = serial(input_ids=ids, position_ids=packed, labels=labels)
    want.loss.backward()
    got = model(**{k: optimus2d.scatter_batch(v, mesh) for k, v in
                   (("input_ids", ids), ("position_ids", packed), ("labels", labels))})  # fmt: skip
    assert_close(optimus2d.gather(got.logits.detach(), mesh)[..., :96], want.logits, 1e-6, "logits, documents")
    got.loss.backward()
    compare_step(serial, model, mesh, tol=1e-5)
    # the config's default, use_cache=True: the serial call makes a cache, and transformers then attends
    # across the documents (it looks for packing only without one): the documents' mask refused (it was
    # 0.28 off), the causal mask exact
    serial.config.use_cache = True
    inputs = {"input_ids": optimus2d.scatter_batch(ids, mesh), "position_ids": optimus2d.scatter_batch(packed, mesh)}
    apart = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": spec})
    raises_fast(ValueError, "masks documents apart only without a cache", lambda: apart(**inputs))
    across = optimus2d.parallelize(copy.deepcopy(serial), mesh, plan={"model": context.ContextParallel(mesh)})
    with torch.no_grad():
        want = serial(input_ids=ids, position_ids=packed).logits
        got = across(**inputs).logits
    assert_close(optimus2d.gather(got, mesh)[..., :96], want, 1e-6, "logits, a cache made")
