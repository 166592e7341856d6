"""Where an encoder and the model after it run: together on every rank, or apart on rank sets of their own.

``propose_placement(encoder, rest, world, hw)`` prices both modes with the cost model
(``cost.planner``) and returns the cheapest that fits, with every candidate it priced:

- **together** (colocated): both parts over all ``world`` ranks, each on the mesh shape of its own
  (``planner.propose_layouts``: every pair of shapes, the boundary between them priced by what
  ``redistribute`` moves; with ``one_d=True`` Megatron's 1D split too), one after the other on the
  whole batch;
- **apart** (non-colocated, ``pipeline.rank_sets``): the encoder on ranks 0..a−1, the rest on
  a..world−1, each set on any mesh shape of its size, two stages of torch's ``Schedule1F1B`` over
  ``microbatches``: the encoder's ranks compute micro-batch m + 1 while the rest's compute m. Each
  stage's part per micro-batch (``planner.part_time``; a backward twice its forward), the features
  crossing the sets (each rank sends or receives its block of them: the larger of the two blocks,
  at the calibrated bandwidth and latency), replayed in ``Schedule1F1B``'s own order
  (``pipeline.simulator``).

A shape is offered where its grid q divides the part's hidden, feed-forward and head counts and its
depth·q splits the batch (apart: the micro-batch; the rest's q also divides the encoder's hidden,
the last dim of the features it receives). Memory a rank: together, both parts' blocks
(``planner.part_memory`` at the whole batch); apart, its set's part alone, keeping the activations
of the micro-batches in flight (1F1B: two on the encoder's ranks, one on the rest's). ``Placement``
names the pick (``encoder_ranks`` 0: together) and ``explain()`` prints the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torch.distributed.pipelining import Schedule1F1B

from optimus2d.cost.planner import ONE_D, Hardware, Part, part_memory, part_time, propose_layouts
from optimus2d.pipeline.simulator import schedule_order, simulate

__all__ = ["Candidate", "Placement", "layout_name", "propose_placement", "shape_name"]


@dataclass(frozen=True)
class Candidate:
    """One placement priced: ``encoder_ranks`` (0: together on every rank), the (q, depth) of the
    encoder's mesh and of the rest's (together, either may be ``"1d"``: Megatron's split over every
    rank), the predicted step ``seconds``, the most bytes a rank holds (``memory``) and whether that
    fits the cap."""

    encoder_ranks: int
    encoder: tuple[int, int] | str
    rest: tuple[int, int] | str
    seconds: float
    memory: float
    fits: bool

    def describe(self, world: int) -> str:
        e, r = layout_name(self.encoder), layout_name(self.rest)
        if not self.encoder_ranks:
            return f"together on {world} ranks: encoder {e}, rest {r}"
        return f"apart: encoder on {self.encoder_ranks} ranks as {e}, rest on {world - self.encoder_ranks} as {r}"


@dataclass(frozen=True)
class Placement:
    """The pick (``best``, the cheapest candidate that fits; the least memory where none does) and
    every candidate priced, cheapest first (``table``), for ``world`` ranks."""

    best: Candidate
    table: tuple[Candidate, ...]
    world: int

    @property
    def encoder_ranks(self) -> int:
        return self.best.encoder_ranks

    def explain(self) -> str:
        lines = [f"{'placement':<64} {'predicted ms':>12} {'MiB a rank':>10}  fits"]
        for c in self.table:
            mark = "*" if c is self.best else " "
            lines.append(f"{mark}{c.describe(self.world):<63} {c.seconds * 1e3:12.3f} {c.memory / 2**20:10.2f}  "
                         f"{'yes' if c.fits else 'no'}")  # fmt: skip
        return "\n".join(lines)


def shape_name(q: int, depth: int) -> str:
    """2×2, 2×2×2, 1×1×4."""
    return f"{q}×{q}" + (f"×{depth}" if depth > 1 else "") if q > 1 else f"1×1×{depth}"


def layout_name(layout: tuple[int, int] | str) -> str:
    """2×2, 1×1×4, or 1d."""
    return layout if layout == ONE_D else shape_name(*layout)


def _splits_1d(part: Part, ranks: int) -> bool:
    """Whether Megatron's split over ``ranks`` divides ``part``'s heads and feed-forward width."""
    return ranks > 1 and part.layer.ffn % ranks == 0 and (part.layer.heads or ranks) % ranks == 0


def _shapes(part: Part, ranks: int, batch: int) -> list[tuple[int, int]]:
    """The (q, depth) meshes of ``ranks`` whose q divides ``part``'s sizes and whose depth·q splits ``batch``."""
    layer = part.layer
    return [
        (q, ranks // (q * q))
        for q in range(1, math.isqrt(ranks) + 1)
        if ranks % (q * q) == 0
        and all(n % q == 0 for n in (layer.hidden, layer.ffn, layer.heads or q))
        and batch % (ranks // q) == 0
    ]


def _apart(encoder: Part, rest: Part, a: int, shapes: tuple, world: int, n: int, hw: Hardware) -> tuple[float, float]:
    """(seconds, bytes a rank) of the encoder on ``a`` ranks and the rest on the others, ``n`` micro-batches."""
    mb = encoder.layer.batch // n
    parts = [replace(p, layer=replace(p.layer, batch=mb)) for p in (encoder, rest)]
    seconds = [part_time(part, *shape, hw) for part, shape in zip(parts, shapes, strict=True)]
    backward = [not p.frozen or p.input_grad for p in parts]
    costs = {}
    for stage, (total, back) in enumerate(zip(seconds, backward, strict=True)):
        costs["F", stage], costs["B", stage] = (total / 3, 2 * total / 3) if back else (total, 0.0)
    elements = mb * encoder.layer.seq * encoder.layer.hidden
    sent = elements / min(a, world - a) * hw.bytes_per_element / hw.bandwidth + hw.latency
    timeline = simulate(schedule_order(Schedule1F1B, 2, n), lambda kind, s: costs[kind, s], p2p=sent)
    # without a backward, stage 0's B actions are torch's no-ops (nothing comes back): not waited for
    makespan = max(end for spans in timeline.spans.values() for name, _, end in spans
                   if backward[0] or not name.startswith("B0,"))  # fmt: skip
    in_flight = (min(n, 2), 1)  # 1F1B on two stages: micro-batches whose activations a stage keeps at most
    memory = max(
        part_memory(replace(part, layer=replace(part.layer, batch=mb * k)), *shape, hw)
        for part, shape, k in zip(parts, shapes, in_flight, strict=True)
    )
    return makespan, memory


def propose_placement(
    encoder: Part,
    rest: Part,
    world: int,
    hw: Hardware,
    *,
    microbatches: int = 2,
    memory_cap: float | None = None,
    one_d: bool = False,
) -> Placement:
    """Price ``encoder`` then ``rest`` (``cost.planner.Part``s; ``layer.batch`` the whole batch a step,
    the same for both, each with its own sequence; ``rest.input_grad`` whether its first layer needs
    the input's gradient: the features', or a trained projector's before it) together on ``world``
    ranks and apart on every split a + (world − a), and pick the cheapest whose ranks all fit
    ``memory_cap`` bytes (None: no cap). ``one_d``: together, a part may also run in Megatron's 1D
    split over every rank (``planner.propose_layouts(one_d=True)``); apart only with 2 micro-batches
    or more (torch's 1F1B refuses fewer than its stages). Raises ``ValueError`` when no placement
    splits the batch."""
    batch = encoder.layer.batch
    if world < 1 or microbatches < 1:
        raise ValueError(f"propose_placement: world {world} and microbatches {microbatches} must be at least 1")
    if rest.layer.batch != batch:
        raise ValueError(f"propose_placement: the encoder's batch {batch} and the rest's {rest.layer.batch} differ")
    found = []
    together = propose_layouts([encoder, rest], world, hw, memory_cap=memory_cap, one_d=one_d)
    offered = {p.path: [*_shapes(p, world, batch), *[ONE_D] * _splits_1d(p, world)] for p in (encoder, rest)}
    for layouts, seconds, memory, ok in together.table:
        shapes = (layouts[encoder.path], layouts[rest.path])
        if shapes[0] in offered[encoder.path] and shapes[1] in offered[rest.path]:
            found.append(Candidate(0, *shapes, seconds, memory, ok))
    if batch % microbatches == 0 and microbatches >= 2:  # apart: torch's 1F1B on 2 stages needs 2 or more
        mb = batch // microbatches
        for a in range(1, world):
            rests = [r for r in _shapes(rest, world - a, mb) if encoder.layer.hidden % r[0] == 0]  # the features'
            for shapes in ((e, r) for e in _shapes(encoder, a, mb) for r in rests):  # last dim, split by its q
                seconds, memory = _apart(encoder, rest, a, shapes, world, microbatches, hw)
                found.append(Candidate(a, *shapes, seconds, memory, memory_cap is None or memory <= memory_cap))
    if not found:
        raise ValueError(
            f"propose_placement: no mesh of {world} ranks, nor of any split of them, splits the batch {batch} "
            f"(in {microbatches} micro-batches apart) and divides the parts' sizes"
        )
    table = tuple(sorted(found, key=lambda c: (not c.fits, c.seconds if c.fits else c.memory)))
    return Placement(table[0], table, world)
