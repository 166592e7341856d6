"""The frozen-aware partitioner: Cornstarch's costs, the optimal cut, the memory cap."""

from __future__ import annotations

import itertools
import random

import pytest

from optimus2d.pipeline.partition import LayerCost, effective, equal_layers, partition, stage_costs


def test_what_a_layer_costs_depends_on_what_trains():
    frozen, trained = LayerCost(1, 2, 4, frozen=True, activation=8), LayerCost(1, 2, 4, activation=8)
    # a frozen prefix: forward alone, nothing kept; the first trained layer: no input gradient;
    # a frozen layer after it: the input gradient only
    assert effective([frozen, trained, frozen, trained]) == [(1, 0, 0), (1, 4, 8), (1, 2, 8), (1, 6, 8)]


def _brute(costs, stages):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [*cuts, len(costs)]
        worst = max(f + b for f, b, _ in stage_costs(costs, bounds))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_the_cut_is_optimal(seed):
    rng = random.Random(seed)
    costs = [LayerCost(rng.random(), rng.random(), rng.random(), frozen=rng.random() < 0.4) for _ in range(9)]
    for stages in (2, 3, 4):
        bounds = partition(costs, stages)
        assert len(bounds) == stages and bounds[-1] == len(costs) and bounds == sorted(set(bounds))
        worst = max(f + b for f, b, _ in stage_costs(costs, bounds))
        assert worst == pytest.approx(_brute(costs, stages))


def test_a_frozen_encoder_moves_the_cut_and_the_memory_cap_binds():
    costs = [LayerCost(1, 1, 1, frozen=True, activation=1)] * 6 + [LayerCost(2, 2, 2, activation=2)] * 6
    assert equal_layers(12, 4) == [3, 6, 9, 12]
    smart = partition(costs, 4)
    slowest = lambda bounds: max(f + b for f, b, _ in stage_costs(costs, bounds))  # noqa: E731
    assert slowest(smart) < slowest(equal_layers(12, 4))
    assert smart[0] > 3  # the frozen encoder's stages take more layers
    # stage s keeps 4 − s micro-batches: a cap the first stages' kept activations must fit
    capped = partition(costs, 4, memory=8)
    assert all(kept * (4 - s) <= 8 for s, (_, _, kept) in enumerate(stage_costs(costs, capped)))
    with pytest.raises(ValueError, match="no cut into 4 stages fits"):
        partition(costs, 4, memory=1)
