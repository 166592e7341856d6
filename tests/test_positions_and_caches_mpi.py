"""The rules that let OPT, BioGPT, BLOOM and MPT convert, each beside a lookalike that must still be
refused: a learned position table computing its ids (exact; not when the ids mix rows, the lookup is
post-processed or the table is read), a branch under ``self.training and self.p > 0`` with p 0 (not
read; read when p > 0), and a KV cache indexed by layer (not a row; a tensor indexed so is)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import check_against_serial
from torch import nn

from optimus2d import parallelize, scatter, scatter_batch
from optimus2d.convert.positions import PositionsFromInputs2D, positions_from_inputs

pytestmark = pytest.mark.mpi
transformers = pytest.importorskip("transformers")
from transformers.cache_utils import Cache  # noqa: E402

E = 12


class OffsetPositions(nn.Embedding):  # OPT's table: positions from the mask, shifted by an offset
    def __init__(self, n: int, dim: int):
        self.offset = 2
        super().__init__(n + self.offset, dim)

    def forward(self, attention_mask, cache_length: int = 0, position_ids=None):
        if position_ids is None:
            position_ids = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()
            position_ids = position_ids[:, cache_length:]
        return super().forward(position_ids + self.offset)


class CountsOverTheBatch(OffsetPositions):  # the ids of a row depend on the other rows
    def forward(self, attention_mask, cache_length: int = 0, position_ids=None):
        return super(OffsetPositions, self).forward(attention_mask.cumsum(dim=0).clamp(max=5))


class ScalesItsRows(nn.Embedding):  # does more than look up: what it returns is not the table's rows
    def forward(self, attention_mask):
        return super().forward(attention_mask.cumsum(dim=1)) * 2


class ReadsItsTable(nn.Embedding):  # reads the table beside the lookup
    def forward(self, attention_mask):
        ids = attention_mask.cumsum(dim=1) % self.weight.shape[0]
        return super().forward(ids)


def test_a_table_computing_its_ids_is_recognised_and_its_lookalikes_are_not():
    assert positions_from_inputs(OffsetPositions(16, E)) is not None
    lookalikes = [CountsOverTheBatch(16, E), ScalesItsRows(16, E), ReadsItsTable(16, E)]
    assert [positions_from_inputs(t) for t in lookalikes] == [None, None, None]


class WithPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.positions, self.proj = OffsetPositions(16, E), nn.Linear(E, E)

    def forward(self, x, attention_mask):
        return self.proj(x + self.positions(attention_mask))


class _WithMask(nn.Module):  # the model with its mask given: one input, as check_against_serial wants
    def __init__(self, model: nn.Module, mask: torch.Tensor) -> None:
        super().__init__()
        self.model, self.mask = model, mask

    def forward(self, x):
        return self.model(x, self.mask)


def test_a_table_computing_its_ids_is_exact_on_padded_rows(mesh):
    """Outputs, input gradients and the table and projection after a step, rows padded 0 to 2 tokens."""
    torch.manual_seed(0)
    serial = WithPositions()
    parallel = parallelize(copy.deepcopy(serial), mesh)
    assert isinstance(parallel.positions, PositionsFromInputs2D)
    rows = 2 * mesh.depth * mesh.q
    x, mask = torch.randn(rows, 6, E), torch.ones(rows, 6, dtype=torch.long)
    for r in range(rows):
        mask[r, : r % 3] = 0
    check_against_serial(_WithMask(serial, mask), _WithMask(parallel, scatter_batch(mask, mesh)), x, mesh)


def test_a_lookalike_table_is_refused_before_any_change(mesh):
    model = WithPositions()
    model.positions = CountsOverTheBatch(16, E)
    with pytest.raises(TypeError, match=r"positions \(CountsOverTheBatch\): holds weight and has no converter"):
        parallelize(model, mesh)
    assert type(model.proj) is nn.Linear


class LayerDrop(nn.Module):  # OPT's and BioGPT's LayerDrop: a draw of the global RNG per layer
    def __init__(self, p: float):
        super().__init__()
        self.layers, self.layerdrop = nn.ModuleList([nn.Linear(E, E), nn.Linear(E, E)]), p

    def forward(self, x):
        for layer in self.layers:
            if self.training and self.layerdrop > 0.0:
                if torch.rand([]) < self.layerdrop:
                    continue
            x = layer(x)
        return x


class CachedByLayer(nn.Module):  # BioGPT's attention: its cache's layer, by the layer's index
    def __init__(self):
        super().__init__()
        self.proj, self.layer_idx = nn.Linear(E, E), 0

    def forward(self, x, cache: Cache | None = None):
        if cache is not None:
            curr_cache = cache
            keys = curr_cache.layers[self.layer_idx].keys  # noqa: F841 (BioGPT reuses them for cross-attention)
            cache.is_updated[self.layer_idx] = True
        return self.proj(x)


class RowByLayer(nn.Module):  # the same subscript on a tensor picks a row of the split batch
    def __init__(self):
        super().__init__()
        self.proj, self.layer_idx = nn.Linear(E, E), 0

    def forward(self, x, cache: torch.Tensor | None = None):
        return self.proj(x + x[self.layer_idx])


def test_a_branch_that_cannot_run_and_a_cache_by_layer_convert_exactly(mesh):
    torch.manual_seed(0)
    for serial in (LayerDrop(0.0), CachedByLayer()):
        parallel = parallelize(copy.deepcopy(serial), mesh)
        check_against_serial(serial, parallel, torch.randn(2 * mesh.depth * mesh.q, 3, E), mesh)


def test_layerdrop_set_after_conversion_stops_the_forward(mesh):
    """The branch was read as dead with layerdrop 0: with 0.1 the forward raises, on every rank,
    before its layers run (a collective among them)."""
    parallel = parallelize(LayerDrop(0.0), mesh)
    parallel.layerdrop = 0.1
    with pytest.raises(RuntimeError, match=r"LayerDrop.forward was judged correct on blocks with `self.training and"):
        parallel(scatter(torch.randn(2 * mesh.depth * mesh.q, 3, E), mesh))


@pytest.mark.parametrize(
    ("module", "named"), [(LayerDrop(0.1), "calls torch.rand"), (RowByLayer(), "indexes rows")], ids=["drop", "row"]
)
def test_their_lookalikes_are_refused(mesh, module, named):
    with pytest.raises(TypeError, match="cannot be converted") as err:
        parallelize(module, mesh)
    assert named in str(err.value)
