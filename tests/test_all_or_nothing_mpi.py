"""Conversion is all or nothing (issue 25): whatever ``parallelize`` refuses, it refuses before the
model changes — a meta copy is converted first — so a refused model is bit-identical and still runs
serially, and one error on every rank names every module that does not fit.

Cases: a LLaMA with an untied head of vocabulary 97 (the head's 97 rows do not split over q = 2),
two Linear layers whose sizes do not divide, a head count that does not divide (BERT). On q = 1
everything divides: those convert.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import optimus2d

pytestmark = pytest.mark.mpi


def _same(before: dict, model: nn.Module) -> bool:
    after = model.state_dict()
    return list(after) == list(before) and all(torch.equal(before[k], v) for k, v in after.items())


def _refused_whole(model: nn.Module, mesh, match: str, x: dict) -> str:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    want = model(**x)
    with pytest.raises((ValueError, TypeError), match=match) as caught:
        optimus2d.parallelize(model, mesh)
    assert [type(m) for m in model.modules()] == kinds, "a module was replaced"
    assert _same(before, model), "a tensor changed"
    again = model(**x)  # still the serial model
    for got, ref in zip(again.values(), want.values(), strict=True):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, ref)
    return str(caught.value)


def test_an_untied_head_that_does_not_split_leaves_the_model_whole(mesh):
    if mesh.q == 1:
        pytest.skip("q = 1: every size divides")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=12 * mesh.q, intermediate_size=24 * mesh.q, num_hidden_layers=1,
        num_attention_heads=2 * mesh.q, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 97, (2, 5))
    message = _refused_whole(model, mesh, r"lm_head \(Linear\): Linear2D: out_features=97", {"input_ids": ids})
    assert "nothing was changed" in message


class _Two(nn.Module):
    def __init__(self, q: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4 * q, 4 * q + 1), nn.Linear(4 * q + 1, 4 * q)

    def forward(self, x):
        return {"y": self.b(self.a(x))}


def test_every_module_that_does_not_fit_is_named_once(mesh):
    if mesh.q == 1:
        pytest.skip("q = 1: every size divides")
    torch.manual_seed(0)
    model = _Two(mesh.q)
    message = _refused_whole(model, mesh, r"2 module\(s\) do not fit", {"x": torch.randn(2, 4 * mesh.q)})
    assert "\n  a (Linear): Linear2D: out_features" in message and "\n  b (Linear): Linear2D: in_features" in message


class _Nested(nn.Module):
    def __init__(self, q: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4 * q, 4 * q + 1), nn.GELU())
        self.projector = nn.Sequential(nn.Linear(4 * q + 1, 4 * q), nn.LayerNorm(4 * q))

    def forward(self, x):
        return {"y": self.projector(self.encoder(x))}


def test_modules_inside_containers_are_named_by_their_whole_paths(mesh):
    """A container's children are converted by the container's converter: they were named by their
    own names alone ("0 (Linear)" for both encoder.0 and projector.0)."""
    if mesh.q == 1:
        pytest.skip("q = 1: every size divides")
    torch.manual_seed(0)
    model = _Nested(mesh.q)
    message = _refused_whole(model, mesh, r"2 module\(s\) do not fit", {"x": torch.randn(2, 4 * mesh.q)})
    assert "\n  encoder.0 (Linear): Linear2D: out_features" in message, message
    assert "\n  projector.0 (Linear): Linear2D: in_features" in message, message


def test_what_fits_converts_as_before(mesh):
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(4 * mesh.q, 8 * mesh.q), nn.ReLU(), nn.Linear(8 * mesh.q, 4 * mesh.q))
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    x = torch.randn(2 * mesh.q * mesh.depth, 4 * mesh.q)
    torch.testing.assert_close(optimus2d.gather(model(optimus2d.scatter(x, mesh)), mesh), serial(x))
