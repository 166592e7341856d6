"""Choosing a layout per module from predicted step time and memory (``parallelize(plan="auto")``).

Each ``Block`` is a module of the model the planner may lay out on its own: an MLP h → f → h, or a
pre-norm transformer layer, at a module path, with the rows (tokens) of a step. Its candidates over
p ranks: every mesh shape (q, depth) with depth·q² = p ("2d" q×q, "2.5d:d", and 1×1×p: the weights
whole on every rank, the batch split, data parallelism) and, where the module splits in Megatron's
way (``Block.splits_1d``), "1d". Each is priced by ``planner``'s formulas on a ``Hardware``
(``calibration.hardware``: measured on this machine, cached): compute split p ways, communication
per collective kind, latency per sync stage; memory as the weights (with gradient and two AdamW
moments when trained, all of the model's dtype: ``Hardware.bytes_per_element``) and the
activations backward keeps. A block off the model's mesh adds what
its boundaries move: ``redistribute`` to its mesh shape and back (the rest of the model runs on the
model's mesh), an all-gather of the activation into and out of a 1D block (forward in, backward
out). A "part" (a module of several blocks of one width) is priced as its blocks side by side,
whole on one mesh shape: its boundary once; or, where all split in 1D, each block in 1D. A
"region" (a module whose attention splits in 1D) runs whole in 1D, or stays on the model's mesh
with its blocks laid out alone (its attention priced there).
``choose`` tries every combination and keeps the fastest that fits the memory cap;
``Choice.table`` lists them all.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from optimus2d.cost.planner import (
    Hardware,
    Layer,
    activation_elements,
    boundary_elements,
    comm_time,
    mlp_comm,
    mlp_flops,
    step_time,
)

__all__ = ["Block", "Choice", "candidates", "choose", "predict"]


@dataclass(frozen=True)
class Block:
    """A module to lay out: ``kind`` "mlp" (h → f → h), "layer" (a pre-norm transformer layer of
    ``heads`` heads over sequences of ``seq``), "part" (a module made of the blocks ``inner``, of
    one width ``hidden``, laid out whole: one boundary in and out) or "region" (``layers`` such
    layers whose attention splits in 1D, and ``other`` weights: whole in 1D, or on the model's mesh
    with its blocks ``inner`` laid out alone), at ``path``; ``rows``: tokens a step; ``frozen``: no
    weight gradient; ``input_grad``: a gradient goes back from its input; ``splits_1d``: it may run
    in Megatron's 1D layout; ``qs``: the grid sizes q its dimensions divide (empty: any);
    ``dtensor_attention``: a layer whose attention 1D splits through DTensor (a region's), not the
    mesh's transport (torch's ``nn.MultiheadAttention``)."""

    path: str
    kind: str
    rows: int
    hidden: int
    ffn: int
    heads: int = 0
    seq: int = 1
    frozen: bool = False
    input_grad: bool = False
    splits_1d: bool = False
    qs: tuple[int, ...] = ()
    inner: tuple[Block, ...] = ()  # a "part"'s blocks, in order; a "region"'s, laid out alone when it stays
    layers: int = 1  # a "region"'s transformer layers
    other: int = 0  # a "region"'s weights outside its layers (an embedding): whole on every rank in 1D
    dtensor_attention: bool = False
    whole_in: bool = False  # it takes the model's input, given whole on every rank (parallelize(io="whole"))
    whole_out: bool = False  # it gives the model's output, which leaves whole on every rank

    @property
    def params(self) -> int:
        if self.kind == "part":
            return sum(b.params for b in self.inner)
        per_layer = 2 * self.hidden * self.ffn + (4 * self.hidden * self.hidden if self.kind != "mlp" else 0)
        return per_layer * (self.layers if self.kind == "region" else 1)

    def layer(self, first: bool = True) -> Block:
        """One of a region's transformer layers, as a "layer" block (the first takes the region's input)."""
        grad = self.input_grad or (not first and not self.frozen)
        return Block(
            self.path, "layer", self.rows, self.hidden, self.ffn, self.heads, self.seq, self.frozen, grad,
            dtensor_attention=True,
        )  # fmt: skip


def candidates(block: Block, p: int) -> list[str]:
    """The layouts ``block`` may take over ``p`` ranks: "q×q×d" for each mesh shape, then "1d"."""
    shapes = [
        f"{q}×{q}×{p // (q * q)}"
        for q in range(math.isqrt(p), 0, -1)
        if p % (q * q) == 0 and (not block.qs or q in block.qs)
    ]
    return shapes + (["1d"] if block.splits_1d and p > 1 else [])


def _scheme(layout: str, p: int) -> tuple[str, int, int]:
    """(cost-model scheme, q, depth) of a layout name."""
    if layout == "1d":
        return "1d", 1, 1
    q, _, depth = (int(n) for n in layout.split("×"))
    return ("2d" if depth == 1 else f"2.5d:{depth}"), q, depth


def _gather_1d(block: Block, p: int) -> list[tuple[str, int, float, int]]:
    """A 1D block's boundary: its input all-gathered forward, its output's gradient backward (where
    it has a backward); neither where it is taken or given whole at the model's edge."""
    times = int(not block.whole_in) + int((not block.frozen or block.input_grad) and not block.whole_out)
    return [("all_gather", p, block.rows * block.hidden * times, times)] if times else []


def predict(block: Block, layout: str, p: int, hw: Hardware, *, boundary: bool = True) -> tuple[float, float]:
    """(seconds of forward + backward, bytes a rank holds) of ``block`` in ``layout`` over ``p`` ranks
    (in 1D with its own boundary unless ``boundary`` is False: inside a part in 1D)."""
    if block.kind == "part":  # its blocks side by side on one layout: no boundary between them
        priced = [predict(b, layout, p, hw, boundary=False) for b in block.inner]
        gather = comm_time(_gather_1d(block, p), hw, 0.0) if layout == "1d" and boundary else 0.0
        return sum(t for t, _ in priced) + gather, sum(m for _, m in priced)
    if block.kind == "region":  # its layers, whole; in 1D its input gathered in, its output's gradient out
        priced = [predict(block.layer(n == 0), layout, p, hw) for n in range(block.layers)]
        seconds, memory = sum(t for t, _ in priced), sum(m for _, m in priced)
        _, q, _ = _scheme(layout, p)
        memory += block.other * hw.bytes_per_element * (1 if block.frozen else 4) / (1 if layout == "1d" else q * q)
        if layout == "1d":
            seconds += comm_time(_gather_1d(block, p), hw, 0.0)
        return seconds, memory
    scheme, q, _ = _scheme(layout, p)
    trained = not block.frozen
    backward = trained or block.input_grad
    if block.kind == "mlp":
        rows, h, f = block.rows, block.hidden, block.ffn
        if trained:
            flops = mlp_flops(rows, h, f, block.input_grad)
        else:  # frozen: 2 products forward, and the input's gradient through both where it has one
            flops = 2.0 * rows * h * f * (2 + 2 * int(block.input_grad))
        compute = flops / (p * hw.flops)
        comm = mlp_comm(rows, h, f, scheme, p, input_grad=block.input_grad, dw=trained)
        if scheme == "1d" and boundary:  # the input all-gathered forward, the output's gradient backward
            comm = [*comm, *_gather_1d(block, p)]
        seconds = compute + comm_time(comm, hw, compute)
        # kept for backward (parallelize keeps an MLP's linears apart): fc1's input (the gathered whole
        # in 1D), fc1's output (the activation's input) and the activation's output (fc2's input);
        # frozen, the activation's input alone (a frozen linear keeps no input)
        gathered = rows * h if scheme == "1d" else rows * h / p
        acts = gathered + 2 * rows * f / p if trained else rows * f / p
    else:
        layer = Layer(block.rows // block.seq, block.seq, block.hidden, block.ffn, block.heads)
        seconds = step_time(
            layer, scheme, p, hw, dx=block.input_grad, dw=trained, dtensor_attention=block.dtensor_attention
        )["total"]
        if scheme == "1d" and boundary:
            seconds += comm_time(_gather_1d(block, p), hw, 0.0)
        acts = activation_elements(layer, scheme, p)
    shards = p if scheme == "1d" else q * q
    weights = block.params / shards * hw.bytes_per_element * (4 if trained else 1)  # + gradient, AdamW's 2
    return seconds, weights + (acts * hw.bytes_per_element if backward else 0.0)


def _whole_out(block: Block, p: int, hw: Hardware) -> float:
    """Seconds to give the model's output [rows, hidden] whole from blocks of its mesh: one all-gather
    forward, nothing backward (``to_whole``)."""
    return comm_time([("all_gather", p, block.rows * block.hidden, 1)], hw, 0.0)


def _boundary(block: Block, before: str, after: str, backward: bool, p: int, hw: Hardware) -> float:
    """Seconds to move ``block``'s input [rows, hidden] from mesh layout ``before`` to ``after`` (and
    its gradient back when ``backward``); a 1D block's own boundary is in its ``predict``."""
    if before == after or "1d" in (before, after):
        return 0.0
    _, q1, d1 = _scheme(before, p)
    _, q2, d2 = _scheme(after, p)
    moved = boundary_elements(block.rows, block.hidden, (q1, d1), (q2, d2))
    return moved * (1 + int(backward)) * hw.bytes_per_element / hw.bandwidth + hw.latency * bool(moved)


@dataclass(frozen=True)
class Choice:
    """``layouts``: block path → layout name; ``seconds``/``memory``: its predicted step time and bytes
    a rank holds; ``table``: every combination, best predicted first, as (layouts, seconds, bytes,
    fits); ``measured``: row of ``table`` → its measured step time, for the rows that were timed."""

    layouts: dict
    seconds: float
    memory: float
    table: list
    measured: dict = field(default_factory=dict)

    def explain(self, limit: int = 8) -> str:
        """The candidates as a table, best predicted first (at most ``limit`` rows, and every measured
        one), with a "measured ms" column when some were timed."""
        head = f"{'layouts':<48}{'predicted ms':>14}" + (f"{'measured ms':>13}" if self.measured else "")
        lines = [f"{head}{'MiB a rank':>12}  fits"]
        if not any(layouts for layouts, *_ in self.table):  # nothing to lay out: no row to pick
            return f"{lines[0]}\n(no MLP or transformer layer below the model: it stays on its mesh)"
        for row, (layouts, seconds, memory, fits) in enumerate(self.table):
            if row >= limit and row not in self.measured:
                continue
            named = ", ".join(f"{path or '(model)'}: {layout}" for path, layout in layouts.items())
            timed = (
                ""
                if not self.measured
                else f"{self.measured[row] * 1e3:>13.2f}"
                if row in self.measured
                else f"{'-':>13}"
            )
            picked = "  <- picked" if layouts == self.layouts else ""
            lines.append(
                f"{named:<48}{seconds * 1e3:>14.2f}{timed}{memory / 2**20:>12.1f}  {'yes' if fits else 'no'}{picked}"
            )
        return "\n".join(lines)


def _options(block: Block, p: int, hw: Hardware, start: str, only: set[str] | None) -> list[tuple[dict, float, float]]:
    """Every way to lay out ``block`` as (path → layout, seconds, bytes a rank), its boundaries from and
    back to ``start`` priced: each of its candidates; a part whole on each mesh shape, or, where every
    one of its blocks splits in 1D, each of them in 1D (each with its own boundary, as a block alone);
    a region whole in 1D, or on ``start`` (its attention priced there) with each block's options."""
    options = []
    for layout in candidates(block, p):
        if (only is not None and layout not in only) or (block.kind == "region" and layout == start):
            continue
        t, m = predict(block, layout, p, hw)
        # on another mesh shape: its input moves there (its gradient back where it has one) and its
        # output back to the model's mesh (the gradient back where the block has a backward)
        into = 0.0 if block.whole_in else _boundary(block, start, layout, block.input_grad, p, hw)
        back = _boundary(block, layout, start, block.input_grad or not block.frozen, p, hw)
        if block.whole_out:  # leaving whole: a 1D block's is; a mesh's moves to the model's, then all-gathered
            back = 0.0 if layout == "1d" else back + _whole_out(block, p, hw)
        options.append(({block.path: layout}, t + into + back, m))
    if block.kind == "region":  # staying on the mesh: its attention there, each of its blocks laid out alone
        t, m = predict(block, start, p, hw)
        t += _whole_out(block, p, hw) if block.whole_out else 0.0
        for b in block.inner:
            bt, bm = predict(b, start, p, hw)
            t, m = t - bt, m - bm
        for combo in itertools.product(*(_options(b, p, hw, start, only) for b in block.inner)):
            layouts = {block.path: start, **{k: v for chosen, _, _ in combo for k, v in chosen.items()}}
            options.append((layouts, t + sum(o[1] for o in combo), m + sum(o[2] for o in combo)))
    elif block.inner and all(b.splits_1d for b in block.inner) and p > 1 and (only is None or "1d" in only):
        priced = [predict(b, "1d", p, hw) for b in block.inner]
        options.append(({b.path: "1d" for b in block.inner}, sum(t for t, _ in priced), sum(m for _, m in priced)))
    return options


def choose(
    blocks: list[Block],
    p: int,
    hw: Hardware,
    *,
    memory_cap: float | None = None,
    layout: str = "",
    only: set[str] | None = None,
) -> Choice:
    """The fastest combination of layouts for ``blocks`` whose bytes a rank fit ``memory_cap`` (the
    least memory, when none fits); the rest of the model runs in ``layout`` (the model's mesh,
    default the first candidate), the blocks' inputs come from it and their outputs return to it.
    ``only``: the layouts allowed (default every candidate)."""
    table = []
    start = layout or (candidates(blocks[0], p)[0] if blocks else "")
    for combo in itertools.product(*(_options(block, p, hw, start, only) for block in blocks)):
        seconds, memory = sum(o[1] for o in combo), sum(o[2] for o in combo)
        fits = memory_cap is None or memory <= memory_cap
        table.append(({k: v for layouts, _, _ in combo for k, v in layouts.items()}, seconds, memory, fits))
    table.sort(key=lambda row: (not row[3], row[1] if row[3] else row[2]))
    best = table[0] if table else ({}, 0.0, 0.0, True)
    return Choice(best[0], best[1], best[2], table)
