"""Families whose positions are not rotary: learned tables that compute their ids from the mask (OPT,
BioGPT) and linear biases per head (BLOOM's and MPT's ALiBi). Logits and one AdamW step equal
serial, with and without a padded mask; what does not split is refused before the model changes."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close
from test_families_decoders_mpi import _COMMON, _heads, _step

from optimus2d import gather, parallelize, scatter_batch, serial_state_dict
from optimus2d.convert.positions import PositionsFromInputs2D

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.mpi, pytest.mark.families]

_NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
_FAMILIES = {  # family → (config class, extra config, model class)
    "opt": ("OPTConfig", {**_NO_DROPOUT, "ffn_dim": 96, "layerdrop": 0.0}, "OPTForCausalLM"),
    "biogpt": (
        "BioGptConfig",
        {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "activation_dropout": 0.0},
        "BioGptForCausalLM",
    ),
    "bloom": ("BloomConfig", {}, "BloomForCausalLM"),
    "mpt": ("MptConfig", {}, "MptForCausalLM"),
}


def _serial(family: str, mesh, **extra):
    config_cls, config_extra, model_cls = _FAMILIES[family]
    config = getattr(transformers, config_cls)(
        **_COMMON, num_attention_heads=_heads(mesh)[0], attn_implementation="eager", **(config_extra | extra)
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).double()  # float64: a rounding error is not an error
    with torch.no_grad():  # norms that start at 1 would hide a wrong scale
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "k_proj.bias" in name:  # softmax ignores a key bias: its gradient is roundoff (as in _model)
                p.requires_grad_(False)
    return model


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_a_family_with_learned_positions_or_alibi_is_exact(mesh, family):
    serial = _serial(family, mesh)
    parallel = parallelize(copy.deepcopy(serial), mesh)
    if family in ("opt", "biogpt"):
        assert sum(isinstance(m, PositionsFromInputs2D) for m in parallel.modules()) == 1
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (2 * mesh.depth * mesh.q, 7))
    assert_close(_step(parallel, ids, mesh)[..., :96], _step(serial, ids), 1e-6, f"{family} logits")
    state = serial_state_dict(parallel)
    assert set(state) == set(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, 1e-6, f"{family} {key} after AdamW")


@pytest.mark.parametrize("family", ["opt", "biogpt", "bloom"])
def test_positions_and_biases_follow_a_padded_mask(mesh, family):
    """Left padding: OPT's and BioGPT's positions count from each row's first token (a ``cumsum`` of
    its own mask row), BLOOM's biases likewise; rows of one rank's block differ in their padding."""
    serial = _serial(family, mesh).eval()
    parallel = parallelize(copy.deepcopy(serial), mesh).eval()
    rows = 2 * mesh.depth * mesh.q
    torch.manual_seed(2)
    ids = torch.randint(1, 96, (rows, 9))
    mask = torch.ones(rows, 9, dtype=torch.long)
    for r in range(rows):
        mask[r, : r % 4] = 0  # 0 to 3 pads
    want = serial(input_ids=ids, attention_mask=mask, use_cache=False).logits
    got = parallel(input_ids=scatter_batch(ids, mesh), attention_mask=scatter_batch(mask, mesh), use_cache=False)
    got = gather(got.logits.detach(), mesh)[..., :96]
    keep = mask.bool()  # a padded position's logits are whatever its masked-out row gives: compare the tokens'
    assert_close(got[keep], want.detach()[keep], 1e-6, f"{family} logits with padding")


def test_layerdrop_is_refused_before_any_change(mesh):
    """OPT's LayerDrop skips a layer by a draw of the global RNG, which ranks do not share."""
    serial = _serial("opt", mesh, layerdrop=0.5)
    before = copy.deepcopy(serial.state_dict())
    with pytest.raises(ValueError, match=r"OPTDecoder has layerdrop=0.5: each rank would skip layers"):
        parallelize(serial, mesh)
    assert type(serial.model.decoder.layers[0].fc1) is torch.nn.Linear
    for key, value in serial.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_alibi_heads_that_do_not_split_are_refused_before_any_change(mesh, family):
    if mesh.q == 1:
        pytest.skip("every head count splits over q = 1")
    config_cls, config_extra, model_cls = _FAMILIES[family]
    heads = mesh.q + 1  # 3 on q = 2, 4 on q = 3: the hidden size 48 still divides
    config = getattr(transformers, config_cls)(**_COMMON, num_attention_heads=heads, **config_extra)
    serial = getattr(transformers, model_cls)(config)
    before = copy.deepcopy(serial.state_dict())
    name = {"bloom": "BloomAttention num_heads", "mpt": "MptAttention n_heads"}[family]
    with pytest.raises(ValueError, match=rf"{name}={heads} is not divisible by q={mesh.q}"):
        parallelize(serial, mesh)
    for key, value in serial.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_bloom_slicing_the_hidden_dim_by_its_pretraining_tp_is_refused(mesh):
    if mesh.q == 1:
        pytest.skip("nothing is split over q = 1")
    serial = _serial("bloom", mesh, pretraining_tp=2, slow_but_exact=True)
    with pytest.raises(ValueError, match=r"Bloom(Attention|MLP) with pretraining_tp=2 and slow_but_exact"):
        parallelize(serial, mesh)
