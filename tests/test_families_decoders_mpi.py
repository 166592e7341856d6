"""Hugging Face decoders shaped like LLaMA, converted by structure: none of these families is named
in optimus2d's code (Phi-3's fused projections are recognised by what they hold and how their
forward slices them). Logits and one AdamW step equal serial, or the model is refused, on every
rank, before any collective."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, raises_fast

import optimus2d
from optimus2d import gather, parallelize, scatter_batch, serial_state_dict
from optimus2d.layers import Linear2D, RMSNorm2D

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]

_COMMON = dict(
    vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=1, max_position_embeddings=32,
    bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip
_EXACT = {  # family → (config class, extra config, model class)
    "qwen2": ("Qwen2Config", {}, "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", {"head_dim": 8}, "Qwen3ForCausalLM"),  # per-head q/k norms, replicated
    "mistral": ("MistralConfig", {"sliding_window": 4}, "MistralForCausalLM"),
    "phi3": ("Phi3Config", {}, "Phi3ForCausalLM"),  # fused qkv and gate_up
    "gemma": ("GemmaConfig", {"head_dim": 8}, "GemmaForCausalLM"),  # (1 + w) norms, scaled embedding
    "gemma2": (
        "Gemma2Config",
        {"head_dim": 8, "final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0, "sliding_window": 4},
        "Gemma2ForCausalLM",
    ),
    "olmo2": ("Olmo2Config", {}, "Olmo2ForCausalLM"),  # q/k norms over the whole q/k width: RMSNorm2D
    "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "logits_scaling": 3.0}, "GraniteForCausalLM"),
    "helium": ("HeliumConfig", {"head_dim": 12}, "HeliumForCausalLM"),
    "glm": ("GlmConfig", {"head_dim": 8}, "GlmForCausalLM"),  # fused gate_up, partial rotary
}


def _heads(mesh) -> tuple[int, int]:
    return (6, 3) if mesh.q == 3 else (4, 2)  # grouped-query attention, both divisible by q


def _model(family: str, mesh):
    config_cls, config_extra, model_cls = _EXACT[family]
    heads, kv_heads = _heads(mesh)
    if family == "helium":  # its o_proj takes hidden_size inputs: heads · head_dim must be the width
        config_extra = {"head_dim": 48 // heads}
    config = getattr(transformers, config_cls)(
        **_COMMON, num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="eager",
        **config_extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # norms that start at 1 (or 0) would hide a wrong scale: make every weight count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "k_proj.bias" in name:  # softmax ignores a key bias: its gradient is 0 up to roundoff,
                p.requires_grad_(False)  # which Adam would blow up to a step of lr; frozen instead
    return model


def _step(model, ids, mesh=None):
    """Logits, and the model after one AdamW step on the next-token loss."""
    # Adam's first step is lr·g/(|g| + eps): with eps 1e-8, an entry whose gradient is ~1e-7 by chance
    # steps by ±lr on its roundoff (gradients match to ~1e-6). eps 1e-4 keeps the step well-conditioned.
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-4)
    if mesh is None:
        logits = model(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    else:
        local = scatter_batch(ids, mesh)
        logits = model(input_ids=local, use_cache=False).logits  # [b/(d·q), s, V/q]
        optimus2d.cross_entropy(logits[:, :-1], local[:, 1:], mesh).backward()
        logits = gather(logits.detach(), mesh)
    opt.step()
    return logits.detach()


@pytest.mark.parametrize("family", sorted(_EXACT))
def test_a_llama_shaped_family_converts_exactly(mesh, family):
    serial = _model(family, mesh)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert any(isinstance(m, Linear2D) for m in parallel.modules())
    assert any(isinstance(m, RMSNorm2D) for m in parallel.modules())
    frozen = {n: p.requires_grad for n, p in serial.named_parameters()}  # k_proj biases frozen (_model)
    assert {n: p.requires_grad for n, p in parallel.named_parameters()} == frozen
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 7))
    logits_ref = _step(serial, ids)
    logits = _step(parallel, ids, mesh)
    assert_close(logits[..., :96], logits_ref, 1e-4, f"{family} logits")
    assert all(p.grad is None for n, p in parallel.named_parameters() if not frozen[n])
    state = serial_state_dict(parallel)
    assert set(state) == set(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-4, f"{family} {key} after AdamW")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_4d_mask_is_exact_and_one_per_head_refused_on_every_rank(mesh, attn):
    serial = _model("qwen2", mesh)
    serial.config._attn_implementation = attn
    parallel = parallelize(copy.deepcopy(serial), mesh)
    torch.manual_seed(1)
    b, s, heads = 2 * mesh.depth * mesh.q, 7, serial.config.num_attention_heads
    ids = torch.randint(0, 96, (b, s))
    causal = torch.triu(torch.full((s, s), -1e9), 1)
    mask = torch.zeros(b, 1, s, s) + causal
    mask[1, :, :, 0] = -1e9  # row 1 never attends to its first token
    local = scatter_batch(ids, mesh)
    got = gather(parallel(input_ids=local, attention_mask=scatter_batch(mask, mesh)).logits, mesh)
    assert_close(got[..., :96], serial(input_ids=ids, attention_mask=mask).logits, 1e-4, "a [b, 1, s, s] mask")
    if mesh.q > 1:
        per_head = mask.expand(b, heads, s, s).clone()
        message = raises_fast(
            ValueError,
            "a mask per head",
            lambda: parallel(input_ids=local, attention_mask=scatter_batch(per_head, mesh)),
        )
        assert f"[{b // (mesh.depth * mesh.q)}, {heads}, {s}, {s}]" in message and str(mesh) in message
        raises_fast(ValueError, "the whole batch's", lambda: parallel(input_ids=local, attention_mask=mask))


# Families named nowhere in optimus2d, nor above: each must be exact or refused (never wrong); those in
# _CONVERTED must convert (the reader vouches for them: dropout, partial rotary, fused per-head qkv).
_CONVERTED = {
    "cohere",
    "nemotron",
    "smollm3",
    "starcoder2",
    "gpt_neox",
    "phi",
    "phi_qk_layernorm",
    "exaone4",
    "olmo",
    "apertus",
    "olmo3",
    "granite_swa",
}
_UNSEEN = {
    "cohere": ("CohereConfig", {}, "CohereForCausalLM"),  # LayerNorm without bias, tied head
    "nemotron": ("NemotronConfig", {"head_dim": 12, "partial_rotary_factor": 1.0}, "NemotronForCausalLM"),
    "smollm3": ("SmolLM3Config", {}, "SmolLM3ForCausalLM"),
    "starcoder2": ("Starcoder2Config", {}, "Starcoder2ForCausalLM"),  # F.dropout in forward
    "stablelm": ("StableLmConfig", {}, "StableLmForCausalLM"),  # partial rotary: torch.cat of head slices
    "gpt_neox": ("GPTNeoXConfig", {}, "GPTNeoXForCausalLM"),  # fused qkv chunk(3)
    "phi": ("PhiConfig", {}, "PhiForCausalLM"),
    "phi_qk_layernorm": ("PhiConfig", {"qk_layernorm": True}, "PhiForCausalLM"),  # nn.LayerNorm of one head
    "exaone4": ("Exaone4Config", {}, "Exaone4ForCausalLM"),
    "olmo": ("OlmoConfig", {}, "OlmoForCausalLM"),  # LayerNorm with no weight (probed: its normalized_shape)
    "apertus": ("ApertusConfig", {}, "ApertusForCausalLM"),  # xIELU: scalar parameters, element by element
    "olmo3": ("Olmo3Config", {"sliding_window": 4}, "Olmo3ForCausalLM"),  # a rotary table per layer type
    "granite_swa": ("GraniteSWAConfig", {"sliding_window": 4}, "GraniteSWAForCausalLM"),  # a sink per head
    "cwm": ("CwmConfig", {"sliding_window": 4}, "CwmForCausalLM"),  # mask_kwargs.copy(): a dict it builds
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 4}, "Gemma3ForCausalLM"),
}


@pytest.mark.parametrize("family", sorted(_UNSEEN))
def test_an_unseen_family_is_exact_or_refused(mesh, family):
    config_cls, extra, model_cls = _UNSEEN[family]
    heads, kv_heads = _heads(mesh)
    names = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if family == "gpt_neox":
        names = {"num_attention_heads": heads}
    config = getattr(transformers, config_cls)(**_COMMON, **names, attn_implementation="eager", **extra)
    torch.manual_seed(0)
    serial = getattr(transformers, model_cls)(config).double()  # float64: a rounding error is not an error
    try:
        parallel = parallelize(copy.deepcopy(serial), mesh)
    except TypeError as err:  # refused on every rank, before any collective, naming the modules
        assert "cannot be converted" in str(err) and "(" in str(err), str(err)
        assert family not in _CONVERTED, str(err)
        return
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 7))
    assert_close(_step(parallel, ids, mesh)[..., :96], _step(serial, ids), 1e-4, f"{family} logits")
    state = serial_state_dict(parallel)
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-4, f"{family} {key} after AdamW")


def test_a_sink_per_head_whose_heads_do_not_split_is_refused_before_any_change(mesh):
    """GraniteSWA's learned sinks, one per head, split with the heads: heads that q does not divide are
    refused, naming the count and the mesh, and the model is left as it was."""
    if mesh.q == 1:
        pytest.skip("every head count splits over q = 1")
    heads = mesh.q + 1  # 3 on q = 2, 4 on q = 3: the hidden size 48 still divides
    config = transformers.GraniteSWAConfig(
        **_COMMON, num_attention_heads=heads, num_key_value_heads=heads, sliding_window=4, attn_implementation="eager"
    )
    torch.manual_seed(0)
    serial = transformers.GraniteSWAForCausalLM(config)
    before = copy.deepcopy(serial.state_dict())
    expected = rf"GraniteSWAAttention has num_attention_heads={heads}, one sinks entry per head, not divisible by "
    expected += rf"q={mesh.q}"
    with pytest.raises(ValueError, match=expected):
        parallelize(serial, mesh)
    assert type(serial.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    for key, value in serial.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_fused_qkv_whose_heads_do_not_split_is_refused_before_any_change(mesh):
    """Phi-3's fused qkv_proj holds whole heads of each part on each rank, or is refused, naming the
    count and the mesh (it had been converted, and failed in its forward)."""
    if mesh.q == 1:
        pytest.skip("every head count splits over q = 1")
    config = transformers.Phi3Config(
        **_COMMON, num_attention_heads=2 * mesh.q, num_key_value_heads=1, attn_implementation="eager"
    )
    torch.manual_seed(0)
    serial = transformers.Phi3ForCausalLM(config)
    with pytest.raises(ValueError, match=rf"fused qkv_proj has num_key_value_heads=1, not divisible by q={mesh.q}"):
        parallelize(serial, mesh)
    assert type(serial.model.layers[0].self_attn.qkv_proj) is torch.nn.Linear


def test_a_refused_family_taught_in_one_line_converts_exactly(mesh):
    """Ministral-3's attention scales its queries by ``get_llama_4_attn_scale(positions, ...)``, a
    function of positions the reader does not know, so it refuses; its author declares it, and it is
    exact."""
    from transformers.models.ministral3.modeling_ministral3 import Ministral3Attention

    from optimus2d.convert.registry import _CONVERTERS

    heads, kv_heads = _heads(mesh)
    config = transformers.Ministral3Config(
        **_COMMON, num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="eager"
    )
    torch.manual_seed(0)
    serial = transformers.Ministral3ForCausalLM(config)
    with pytest.raises(TypeError, match=r"self_attn \(Ministral3Attention\): its forward .*get_llama_4_attn_scale"):
        parallelize(copy.deepcopy(serial), mesh)
    optimus2d.convert.register_converter(Ministral3Attention, keep=True)  # the one line (README)
    try:
        parallel = parallelize(copy.deepcopy(serial), mesh)
    finally:
        _CONVERTERS.pop(Ministral3Attention)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 7))
    assert_close(_step(parallel, ids, mesh)[..., :96], _step(serial, ids), 1e-4, "ministral3 logits")
    state = serial_state_dict(parallel)
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-4, f"gpt_neox {key} after AdamW")


_FOLLOWING = {  # rotary tables whose frequencies follow max(position_ids): transformers' @dynamic_rope_update
    "dynamic": ("LlamaConfig", {"rope_type": "dynamic", "factor": 4.0}, "LlamaForCausalLM"),
    "longrope": ("Phi3Config", {"rope_type": "longrope"}, "Phi3ForCausalLM"),  # factors: one per rotary pair
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_FOLLOWING))
def test_a_rotary_table_that_follows_positions_reads_the_whole_batchs(mesh, kind):
    """Dynamic and longrope RoPE choose their frequencies from the batch's largest position (and
    dynamic keeps what it chose): each call reads the mesh's largest, as serial reads the batch's.
    Rows of other lengths (a left-padded batch) put a block of only short rows on some ranks."""
    config_cls, rope, model_cls = _FOLLOWING[kind]
    heads, kv_heads = _heads(mesh)
    head_dim = 48 // heads  # Phi-3's is hidden / heads whatever head_dim= says
    if kind == "longrope":
        rope = {**rope, "short_factor": [1.0] * (head_dim // 2), "long_factor": [4.0] * (head_dim // 2)}
    config = getattr(transformers, config_cls)(
        **{**_COMMON, "max_position_embeddings": 8}, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, attn_implementation="eager", rope_parameters={"rope_theta": 10000.0, **rope},
        **({"original_max_position_embeddings": 8} if kind == "longrope" else {}),
    )  # fmt: skip
    torch.manual_seed(0)
    serial = getattr(transformers, model_cls)(config).eval()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    b = 2 * mesh.depth * mesh.q
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (b, 10))
    short = torch.arange(10).expand(b, -1) - torch.tensor([6] * (b // 2) + [0] * (b - b // 2))[:, None]
    for positions in (short.clamp(min=0), torch.arange(10).expand(b, -1) % 5, short.clamp(min=0)):
        with torch.no_grad():
            want = serial(input_ids=ids, position_ids=positions).logits
            got = parallel(input_ids=scatter_batch(ids, mesh), position_ids=scatter_batch(positions, mesh)).logits
        assert_close(gather(got, mesh)[..., :96], want, 1e-5, f"{kind} logits")
