"""Models built on meta: parallelize converts them without a full tensor, materialize gives each
rank its blocks, initialised as the serial model would be and the same on every mesh."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from optimus2d import gather, materialize, parallelize, scatter, scatter_batch, serial_state_dict

pytestmark = [pytest.mark.mpi, pytest.mark.families]
transformers = pytest.importorskip("transformers")


def _llama_config(mesh):
    heads = 6 if mesh.q == 3 else 4
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads // 2, max_position_embeddings=32, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip


def _gemma_config(mesh):
    heads = 6 if mesh.q == 3 else 4
    return transformers.GemmaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads // 2, head_dim=8, max_position_embeddings=32, pad_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip


def _gpt2_config(mesh):
    return transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=6, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )


class TruncLinear(nn.Linear):  # timm's habit: a truncated normal (which torch's init skips on meta)
    def reset_parameters(self):
        nn.init.trunc_normal_(self.weight, std=0.3, a=-0.4, b=0.4)
        nn.init.zeros_(self.bias)


def _torch_stack(mesh):
    layer = nn.TransformerEncoderLayer(48, 6, 96, dropout=0.0, batch_first=True)
    return nn.Sequential(
        TruncLinear(24, 48), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.LayerNorm(48)
    )


_FAMILIES = {
    "llama": lambda mesh: transformers.LlamaForCausalLM(_llama_config(mesh)),
    "gpt2": lambda mesh: transformers.GPT2LMHeadModel(_gpt2_config(mesh)),
    "gemma": lambda mesh: transformers.GemmaForCausalLM(_gemma_config(mesh)),  # a 0-d embed_scale buffer
    "torch": _torch_stack,
}


class _LargestAllocation(TorchDispatchMode):
    """The most elements any op produced off the meta device (a whole tensor would show here)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.largest = max(self.largest, t.numel())
        return out


def _ks(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    a, b = a.double().flatten().sort().values, b.double().flatten().sort().values
    grid = torch.cat([a, b])
    fa = torch.searchsorted(a, grid, right=True) / a.numel()
    fb = torch.searchsorted(b, grid, right=True) / b.numel()
    return float((fa - fb).abs().max())


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_built_on_meta_converted_and_materialized_as_serial_on_every_mesh(mesh, family):
    with torch.device("meta"):
        parallel = _FAMILIES[family](mesh)
    largest = _LargestAllocation()
    with largest:
        parallel = parallelize(parallel, mesh)
        materialize(parallel, seed=7)
    blocks = [t for t in (*parallel.parameters(), *parallel.buffers())]
    assert not any(t.is_meta for t in blocks)
    assert largest.largest <= max(t.numel() for t in blocks), "a tensor larger than any block was built"

    with torch.device("meta"):
        serial = _FAMILIES[family](mesh)
    materialize(serial, seed=7)  # the same counter-based draws, whole: the mesh changes nothing
    state = serial_state_dict(parallel)
    assert set(state) == set(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert torch.equal(state[key], value), f"{key} differs from the serial materialization"

    torch.manual_seed(0)
    reference = _FAMILIES[family](mesh)  # torch's/HF's own initialisation: the same distributions
    for key, value in reference.state_dict().items():
        if value.is_floating_point() and value.numel() > 1 and value.std() > 0:
            bound = 1.95 * ((2 * value.numel()) / value.numel() ** 2) ** 0.5  # KS at 99.9 %
            assert _ks(state[key], value) < bound, f"{key}: not distributed as the serial init"
        else:
            assert torch.equal(state[key], value), f"{key}: the serial init sets it to constants"

    torch.manual_seed(1)
    if family == "torch":
        x = torch.randn(2 * mesh.depth * mesh.q, 5, 24)
        assert_close(gather(parallel(scatter(x, mesh)).detach(), mesh), serial(x), 1e-5, "output")
    else:
        ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 5))
        logits_ref = serial(input_ids=ids).logits
        logits = gather(parallel(input_ids=scatter_batch(ids, mesh)).logits.detach(), mesh)
        assert_close(logits[..., : logits_ref.shape[-1]], logits_ref, 1e-5, "logits")


def test_what_cannot_be_initialised_on_blocks_is_refused_by_name(mesh):
    class Orthogonal(nn.Linear):
        def reset_parameters(self):
            nn.init.orthogonal_(self.weight)

    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(4))

    with torch.device("meta"):
        model = nn.Sequential(Orthogonal(4, 4), Raw())
    with pytest.raises(ValueError) as err:
        materialize(model, seed=0)
    assert "0.weight: its initialisation calls unsupported:nn.init.orthogonal_" in str(err.value)
    assert "1.scale: nothing initialises it" in str(err.value)
    assert model[0].weight.is_meta  # refused before anything was allocated


def test_a_materialized_model_trains_as_its_serial_twin(mesh):
    with torch.device("meta"):
        parallel = transformers.LlamaForCausalLM(_llama_config(mesh))
        serial = transformers.LlamaForCausalLM(_llama_config(mesh))
    parallel = parallelize(parallel, mesh)
    materialize(parallel, seed=3)
    materialize(serial, seed=3)
    torch.manual_seed(2)
    ids = torch.randint(0, 96, (2 * mesh.depth * mesh.q, 6))
    for model, m in ((serial, None), (parallel, mesh)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
        local = ids if m is None else scatter_batch(ids, m)
        model(input_ids=local, labels=local).loss.backward()
        opt.step()
    state = serial_state_dict(parallel)
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-4, f"{key} after AdamW")
