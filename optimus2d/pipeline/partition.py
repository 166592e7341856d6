"""Frozen-aware pipeline partitioning: cut a chain of layers into stages of balanced time.

A layer's work per micro-batch (``LayerCost``): ``forward``, ``input_grad`` (its backward to its
input) and ``weight_grad`` seconds, measured or modelled, and ``activation`` bytes its backward
keeps. What it costs in a step depends on what is trained, as Cornstarch prices it:

* a trained layer: forward + input gradient + weight gradient (the input gradient is skipped
  only on the first layer of the model, whose input needs none);
* a frozen layer after a trained one: forward + the input gradient its predecessors need;
* a frozen layer with nothing trained before it (a frozen prefix, an encoder): forward alone,
  and it keeps nothing for backward.

``partition(costs, stages)`` chooses the contiguous cut that minimises the slowest stage (dynamic
programming over the cut points, exact), optionally under ``memory``: stage s of p keeps the
activations of p − s micro-batches in flight under 1F1B. ``equal_layers`` is the naive cut.
``stage_costs`` gives each stage's (forward, backward) seconds for the schedule simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class LayerCost:
    forward: float
    input_grad: float
    weight_grad: float
    frozen: bool = False
    activation: float = 0.0


def effective(costs: list[LayerCost]) -> list[tuple[float, float, float]]:
    """(forward, backward, kept bytes) of each layer as trained and frozen flags make them."""
    out, trained_before = [], False
    for layer in costs:
        backward = 0.0
        if not layer.frozen:
            backward += layer.weight_grad
        if trained_before:  # an earlier layer trains: the gradient must pass through this one
            backward += layer.input_grad
        keeps = layer.activation if (trained_before or not layer.frozen) else 0.0
        out.append((layer.forward, backward, keeps))
        trained_before = trained_before or not layer.frozen
    return out


def equal_layers(layers: int, stages: int) -> list[int]:
    """The naive cut: stage boundaries as equal layer counts (the first stages take the remainder)."""
    base, extra = divmod(layers, stages)
    bounds, at = [], 0
    for s in range(stages):
        at += base + (1 if s < extra else 0)
        bounds.append(at)
    return bounds


def stage_costs(costs: list[LayerCost], bounds: list[int]) -> list[tuple[float, float, float]]:
    """(forward, backward, kept bytes) of each stage of the cut ``bounds`` (each stage's end)."""
    per = effective(costs)
    out, start = [], 0
    for end in bounds:
        chunk = per[start:end]
        out.append((sum(c[0] for c in chunk), sum(c[1] for c in chunk), sum(c[2] for c in chunk)))
        start = end
    return out


def partition(costs: list[LayerCost], stages: int, *, memory: float | None = None) -> list[int]:
    """The cut (each stage's end) minimising the slowest stage's forward + backward, every stage
    s keeping ``stages − s`` micro-batches of activations within ``memory`` bytes."""
    per = effective(costs)
    n = len(per)
    if stages > n:
        raise ValueError(f"partition: {stages} stages for {n} layers")
    prefix = [(0.0, 0.0)]
    for forward, backward, keeps in per:
        prefix.append((prefix[-1][0] + forward + backward, prefix[-1][1] + keeps))

    def cost(start: int, end: int, stage: int) -> float:
        seconds, kept = prefix[end][0] - prefix[start][0], prefix[end][1] - prefix[start][1]
        if memory is not None and kept * (stages - stage) > memory:
            return float("inf")
        return seconds

    @cache
    def best(start: int, stage: int) -> tuple[float, tuple[int, ...]]:
        if stage == stages - 1:
            return cost(start, n, stage), (n,)
        choice = (float("inf"), ())
        for end in range(start + 1, n - (stages - stage - 1) + 1):
            rest, bounds = best(end, stage + 1)
            worst = max(cost(start, end, stage), rest)
            if worst < choice[0]:
                choice = (worst, (end, *bounds))
        return choice

    worst, bounds = best(0, 0)
    if worst == float("inf"):
        raise ValueError(f"partition: no cut into {stages} stages fits {memory} bytes a stage")
    return list(bounds)
