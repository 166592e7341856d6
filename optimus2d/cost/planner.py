"""A cost model: per-rank communication, memory and step time of 1D, 1D+SP, 2D and 2.5D layouts.

Communication is counted as ``count_comm`` counts it (elements of payload each rank takes part
in), exactly for optimus2d's own schedule (``transformer_layer_elements`` is checked against the
counter in the tests) and by Megatron's schedule for 1D. Time adds compute at a given flop rate
to communication priced per collective kind (ring all-reduce moves 2(n−1)/n of its payload,
all-gather and reduce-scatter (n−1)/n, broadcast and reduce about 1×) plus a latency per sync
stage (collectives issued together wait once). Where ranks share cores, a sync stage costs more
the more work came before it (``Hardware.latency_work``). A 1D layout's linears send their
collectives through DTensor, over torch's own process groups (gloo on CPU), while the mesh's go over
its transport (MPI on CPU): those are priced on ``Hardware.torch_link`` (kinds prefixed ``DTENSOR``).
A model: the numbers rank layouts and show trends; they are not measurements.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from optimus2d.comm.redistribution import plan_moves
from optimus2d.cost.volume import linear_2d_algorithm, linear_2d_elements, linear_2d_summa_elements


@dataclass(frozen=True)
class Layer:
    """One pre-norm transformer layer: batch b, sequence s, hidden h, feed-forward f, attention heads."""

    batch: int
    seq: int
    hidden: int
    ffn: int
    heads: int = 0  # only for the memory count (one log-sum-exp a head and token); 0: not counted

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    @property
    def flops(self) -> float:
        """fwd+bwd matmul flops: 6 per multiply-add of qkv, out, fc1, fc2, plus attention scores."""
        h, f, r, s = self.hidden, self.ffn, self.rows, self.seq
        return 6.0 * r * (3 * h * h + h * h + 2 * h * f) + 12.0 * r * s * h


DTENSOR = "dtensor "  # a collective kind's prefix where DTensor sends it, over torch's process group


@dataclass(frozen=True)
class Hardware:
    """flop/s of one device, and bandwidth (bytes/s) and latency (s) of the links between them.

    ``latency_work``: 0 (default) for devices of their own, where a sync stage costs ``latency``
    whatever came before it. Else the seconds of work before the sync point at which ``latency``
    was measured, on ranks that share cores: they drift apart while they work and a sync point
    waits for the last, a random walk, so a stage after w seconds of work costs
    latency·√(w / latency_work) (``python -m benchmarks transport``: ≈ 0.8·√(ms of work) ms on 4
    ranks sharing 2 cores).

    ``torch_link``: (bandwidth, latency) of torch's own process groups, which carry DTensor's
    collectives (a 1D layout's linears), where they differ from the mesh's transport: on CPU the
    mesh's go over MPI's shared memory and DTensor's over gloo, 2.5–6× slower on 4 ranks here
    (``calibration.hardware`` measures both). None: the same link.

    ``reduce_bandwidth``: bytes/s of the mesh's all-reduces of a weight gradient's size, where they
    run slower than ``bandwidth`` says (measured by moving bytes between two ranks): an all-reduce
    also adds what it receives and copies it on, on cores the ranks share (4 ranks on 2 cores here:
    1.5 GB/s against 4.7 for a move, ``benchmarks/calibrate.py``). A replicated module's gradients
    meet it (1×1×p, the depth of 2.5D). None: ``bandwidth``.
    """

    flops: float
    bandwidth: float
    latency: float
    bytes_per_element: int = 2
    latency_work: float = 0.0
    torch_link: tuple[float, float] | None = None  # (bandwidth, latency) of torch's groups; None: the same
    reduce_bandwidth: float | None = None  # of the mesh's all-reduces, where it differs; None: ``bandwidth``

    def stage_latency(self, work: float, latency: float | None = None) -> float:
        """Seconds one sync stage costs after ``work`` seconds of work since the previous one (of
        ``latency`` measured without work before it; default ``self.latency``)."""
        latency = self.latency if latency is None else latency
        if self.latency_work <= 0 or work <= 0:
            return latency
        return latency * math.sqrt(work / self.latency_work)

    def link(self, kind: str) -> tuple[float, float]:
        """(bandwidth, latency) of a collective of ``kind``: ``torch_link`` for DTensor's (``DTENSOR``), the
        mesh's all-reduce at ``reduce_bandwidth`` where measured."""
        if kind.startswith(DTENSOR) and self.torch_link is not None:
            return self.torch_link
        if kind == "all_reduce" and self.reduce_bandwidth is not None:
            return self.reduce_bandwidth, self.latency
        return self.bandwidth, self.latency


def transformer_layer_elements(layer: Layer, q: int, depth: int = 1, *, on_diagonal: bool = False) -> int:
    """Elements an optimus2d rank sends for ``TransformerBlock2D`` forward + backward (input needs grad).

    Two LayerNorms (all-gather of [mean, M2] per row forward, all-reduce of 2 per row backward,
    their weight and bias gradients over col and depth) and four ``Linear2D``: qkv (h→3h, per
    part), out (h→h), fc1 (h→f), fc2 (f→h), each by the algorithm "auto" picks.
    ``on_diagonal``: rank (k, i, i), whose exchanges send nothing.
    """
    h, f, r = layer.hidden, layer.ffn, layer.rows
    norms = 2 * (2 * r // (depth * q) * q + 2 * r // (depth * q)) if q > 1 else 0
    # each norm's weight and bias gradients ([h/q] each) are summed over col and over depth
    norms += 2 * 2 * (h // q) * (int(q > 1) + int(depth > 1))
    shapes = ((h, 3 * h), (h, h), (h, f), (f, h))
    return norms + sum(linear_2d_elements(r, i, o, q, depth, on_diagonal=on_diagonal) for i, o in shapes)


def layer_comm(
    layer: Layer, scheme: str, p: int, *, dx: bool = True, dw: bool = True, dtensor_attention: bool = False
) -> list[tuple[str, int, float, int]]:
    """(kind, group size, elements per rank, sync stages) of one layer fwd+bwd under ``scheme``.

    A sync stage is a wait for other ranks; collectives issued together count once. 2D and 2.5D:
    ``dx``/``dw`` False for a layer whose input / weights need no gradient (frozen: ``dw=False``;
    a frozen prefix, forward only: both False). 1D: the MLP's all-reduces are DTensor's (``DTENSOR``),
    the attention's too where ``dtensor_attention`` (a Hugging Face layer's projections, split by
    ``parallelize_module``), else the mesh's (torch's ``nn.MultiheadAttention``:
    ``megatron.SplitMultiheadAttention``).
    """
    r, h, f = layer.rows, layer.hidden, layer.ffn
    if scheme in ("1d", "1d-sp"):
        if p == 1:
            return []
        if scheme == "1d":  # an all-reduce of r·h after the MLP and after attention forward; backward
            mlp, attention = 1 + int(dx or dw), 1 + int(dx)  # the MLP's input always, the layer's where it needs it
            over = DTENSOR if dtensor_attention else ""
            return [
                (DTENSOR + "all_reduce", p, mlp * r * h, mlp),
                (over + "all_reduce", p, attention * r * h, attention),
            ]
        return [(DTENSOR + "all_gather", p, 4 * r * h, 4), (DTENSOR + "reduce_scatter", p, 4 * r * h, 4)]
    q, depth = _mesh_shape(scheme, p)
    out = []
    if q > 1:
        rows = r // (depth * q)
        out.append(("all_gather", q, 2 * 2 * rows * q, 2))  # the norms' statistics
        if dx or dw:
            out.append(("all_reduce", q, 2 * 2 * rows, 2))
        for n, (i, o) in enumerate(((h, 3 * h), (h, h), (h, f), (f, h))):
            out.extend(_linear_comm(r, i, o, q, depth, dx=dx or (dw and n > 0), dw=dw))
            if dw:
                out.append(("all_reduce", q, o // q, 1))  # bias over col
        if dw:
            out.append(("all_reduce", q, 2 * 2 * (h // q), 2))  # the norms' weight and bias over col
    if depth > 1 and dw:
        out.append(("all_reduce", depth, 2 * 2 * (h // q), 2))  # the norms' weight and bias over depth
        grads = 3 * h * h + h * h + 2 * h * f
        biases = (3 * h + h + f + h) // q
        out.append(("all_reduce", depth, grads // (q * q) + biases, 4))
    return out


def _linear_comm(
    r: int, i: int, o: int, q: int, depth: int, dx: bool = True, algorithm: str = "auto", dw: bool = True
) -> list[tuple[str, int, float, int]]:
    """One Linear2D's products, fwd+bwd, by ``algorithm`` ("auto": as ``Linear2D`` picks), off the
    diagonal. ``dx``/``dw``: whether backward makes the input's / the weight's gradient."""
    if algorithm == "auto":
        algorithm = linear_2d_algorithm(r, i, o, q, depth, dx=dx, dw=dw)
    backward = int(dx or dw)
    if algorithm == "summa":
        # each step's broadcasts are issued together, a backward's for both gradients: one sync
        # stage a step forward and one backward
        return [("broadcast", q, linear_2d_summa_elements(r, i, o, q, depth, dx=dx, dw=dw), (1 + backward) * q)]
    big = r // depth  # rows of a depth slice
    swaps = 1 + int(dx or (dw and i > o))
    return [  # messages counted as sync stages: the backward gathers dY and the input together
        ("all_gather", q, big * (i + backward * o + int(dw) * i) // q, 1 + backward),  # input, dY, input for dW
        ("reduce_scatter", q, big * (o + (i if dx else 0)) // q, 1 + int(dx)),  # the output and dX
        ("transpose", 2, swaps * big * min(i, o) // (q * q), swaps),  # exchanges with rank (k, j, i)
    ]


def mlp_comm(
    rows: int,
    hidden: int,
    ffn: int,
    scheme: str,
    p: int,
    input_grad: bool = False,
    algorithm: str = "auto",
    dw: bool = True,
) -> list:
    """(kind, group size, elements per rank, sync stages) of an MLP h→f→h fwd+bwd under ``scheme``;
    ``dw`` False for frozen weights (no weight gradients, nor their all-reduces; with no
    ``input_grad`` either, forward only)."""
    if scheme in ("1d", "1d-sp"):
        if p == 1:
            return []
        backward = int(input_grad)  # the input gradient's collective
        if scheme == "1d":
            return [(DTENSOR + "all_reduce", p, (1 + backward) * rows * hidden, 1 + backward)]
        scattered = (1 + backward) * rows * hidden  # the output forward, dX backward
        return [
            (DTENSOR + "all_gather", p, 2 * rows * hidden, 2),
            (DTENSOR + "reduce_scatter", p, scattered, 1 + backward),
        ]
    q, depth = _mesh_shape(scheme, p)
    out = []
    if q > 1:
        out += _linear_comm(rows, hidden, ffn, q, depth, input_grad, algorithm, dw=dw)
        out += _linear_comm(rows, ffn, hidden, q, depth, input_grad or dw, algorithm, dw=dw)
        if dw:
            out.append(("all_reduce", q, (ffn + hidden) // q, 2))  # biases over col
    if depth > 1 and dw:
        out.append(("all_reduce", depth, 2 * hidden * ffn // (q * q) + (ffn + hidden) // q, 4))  # weights, biases
    return out


def mlp_flops(rows: int, hidden: int, ffn: int, input_grad: bool = False) -> float:
    """Matmul flops of an MLP h→f→h fwd+bwd: 2·rows·h·f per product, 3 products a layer (2 for fc1
    when the input needs no gradient)."""
    return 2.0 * rows * hidden * ffn * (5 + int(input_grad))


def comm_time(comm: list[tuple[str, int, float, int]], hw: Hardware, compute: float = 0.0) -> float:
    """Seconds to move ``comm`` (kind, group size, elements, sync stages) over ``hw``'s links.

    ``compute``: the step's seconds of work, spread evenly between its sync stages, for
    ``Hardware.latency_work`` (without it a stage costs ``hw.latency``)."""
    stages = sum(messages for *_, messages in comm)
    work = compute / stages if stages else 0.0
    total = 0.0
    for kind, n, elements, messages in comm:
        bandwidth, latency = hw.link(kind)
        factor = _FACTOR.get(kind.removeprefix(DTENSOR), lambda n: 1.0)(n)
        total += factor * elements * hw.bytes_per_element / bandwidth
        total += messages * hw.stage_latency(work, latency) * math.log2(max(n, 2))
    return total


def _mesh_shape(scheme: str, p: int) -> tuple[int, int]:
    if scheme == "2d":
        q = math.isqrt(p)
        if q * q != p:
            raise ValueError(f"2D needs p = q², got p={p}")
        return q, 1
    if scheme.startswith("2.5d"):
        depth = int(scheme.split(":")[1]) if ":" in scheme else 2
        q = math.isqrt(p // depth)
        if depth * q * q != p:
            raise ValueError(f"{scheme} needs p = depth·q², got p={p}")
        return q, depth
    raise ValueError(f"unknown scheme {scheme!r}: '1d', '1d-sp', '2d', '2.5d:<depth>'")


_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
_FACTOR["reduce_scatter"] = _FACTOR["all_gather"]


def step_time(
    layer: Layer,
    scheme: str,
    p: int,
    hw: Hardware,
    *,
    dx: bool = True,
    dw: bool = True,
    dtensor_attention: bool = False,
) -> dict[str, float]:
    """Predicted seconds of one layer fwd+bwd: compute, communication and their sum. ``dx``/``dw``,
    ``dtensor_attention``: as for ``layer_comm`` (forward is a third of the flops, each gradient another third)."""
    compute = layer.flops * (1 + int(dx) + int(dw)) / 3 / (p * hw.flops)
    comm = comm_time(layer_comm(layer, scheme, p, dx=dx, dw=dw, dtensor_attention=dtensor_attention), hw, compute)
    return {"compute": compute, "comm": comm, "total": compute + comm}


def activation_elements(layer: Layer, scheme: str, p: int) -> float:
    """Saved activations per rank, in elements, of a pre-norm layer's forward (dropout 0, SDPA).

    Per token, as torch's ``nn.TransformerEncoderLayer`` saves them: 4h at the two norms (each
    one's input and output, the output being the next projection's input), 4h for attention (q, k,
    v and its output, the out-projection's input), 2f for the MLP (fc1's output and the
    activation's; optimus2d keeps only fc1's and recomputes the activation, ``MLP2D``), and per
    row 2 statistics a norm and one log-sum-exp a head. 1D keeps the norms' 4h whole and splits the
    rest p ways; 1D+SP splits the norms' inputs but its column-parallel projections keep their
    gathered inputs whole; 2D and 2.5D split all of it p ways, the statistics over the rows only
    (d·q ways; the heads over q). ``tests/test_plan_mpi.py`` checks 2D and serial to the element;
    a 2D rank off the diagonal whose out-projection takes the weight-stationary form keeps h/q a
    row more (the block it received from rank (k, j, i), besides SDPA's output).
    """
    r, h, f, heads = layer.rows, layer.hidden, layer.ffn, layer.heads
    if scheme in ("1d", "1d-sp"):
        split = 4 * h + 2 * f + heads
        if scheme == "1d":
            return r * (4 * h + 4 + split / p)
        return r * (2 * h + (2 * h + split) / p + 4 / p)
    q, depth = _mesh_shape(scheme, p)
    return r * ((4 * h + 4 * h + f) / p + (4 + heads / q) / (depth * q))


def efficiency(layer: Layer, scheme: str, p: int, hw: Hardware) -> float:
    """Parallel efficiency: serial time / (p · parallel time)."""
    serial = layer.flops / hw.flops
    return serial / (p * step_time(layer, scheme, p, hw)["total"])


def isoefficiency_hidden(scheme: str, p: int, hw: Hardware, target: float, seq: int, batch: int) -> int | None:
    """Smallest hidden size (a power of two ≥ 256) at which ``scheme`` on p devices reaches ``target``.

    The problem size W grows as h² (flops per token); how fast the returned h must grow with p
    is the layout's isoefficiency. None when no h up to 2^20 reaches it, or the layout needs
    another p.
    """
    hidden = 256
    while hidden <= 2**20:
        try:
            if efficiency(Layer(batch, seq, hidden, 4 * hidden), scheme, p, hw) >= target:
                return hidden
        except ValueError:
            return None
        hidden *= 2
    return None


# ---- a layout per module (parallelize(plan=)) -------------------------------------------------
@dataclass(frozen=True)
class Part:
    """A module of a model for ``propose_layouts``: ``layers`` × ``layer``, at module path ``path``
    (the key of ``parallelize(plan=)``). ``frozen``: its parameters need no gradient; then, unless
    ``input_grad`` (something before it trains), it has no backward at all (a frozen prefix).
    ``params``: its parameter count, 4·h² + 2·h·f a layer (biases and norms left out).
    ``dtensor_attention``: in 1D its attention splits through DTensor (a Hugging Face layer's), not
    the mesh's transport (torch's ``nn.MultiheadAttention``): ``layer_comm``."""

    path: str
    layer: Layer
    layers: int = 1
    frozen: bool = False
    input_grad: bool = False
    dtensor_attention: bool = False

    @property
    def params(self) -> int:
        h, f = self.layer.hidden, self.layer.ffn
        return self.layers * (4 * h * h + 2 * h * f)


@dataclass(frozen=True)
class Proposal:
    """``layouts``: path → (q, depth) of the cheapest choice; ``seconds``/``memory``: its predicted
    step time and peak bytes per rank; ``table``: every choice considered, cheapest first, as
    (layouts, seconds, bytes, fits)."""

    layouts: dict
    seconds: float
    memory: float
    table: list


ONE_D = "1d"  # a part's layout in Megatron's 1D split over every rank (``megatron.Megatron``), beside (q, depth)


def _scheme(layout: tuple[int, int] | str, world: int) -> tuple[str, int, int]:
    """(cost-model scheme, ranks, the ways its weights split) of a (q, depth) mesh or ``ONE_D``."""
    if layout == ONE_D:
        return "1d", world, world
    q, depth = layout
    return (f"2.5d:{depth}" if depth > 1 else "2d"), depth * q * q, q * q


def part_time(part: Part, q: int, depth: int, hw: Hardware) -> float:
    """Seconds of ``part``'s forward (+ backward, where anything needs a gradient) on a (q, depth) mesh."""
    return layout_time(part, (q, depth), depth * q * q, hw)


def layout_time(part: Part, layout: tuple[int, int] | str, world: int, hw: Hardware) -> float:
    """``part_time`` on a (q, depth) mesh or in 1D (``ONE_D``) over ``world`` ranks."""
    dw = not part.frozen
    dx = part.input_grad or dw  # inside the part, every layer after a trainable one needs dx
    scheme, p, _ = _scheme(layout, world)
    over = part.dtensor_attention
    first = step_time(part.layer, scheme, p, hw, dx=part.input_grad, dw=dw, dtensor_attention=over)["total"]
    rest = step_time(part.layer, scheme, p, hw, dx=dx, dw=dw, dtensor_attention=over)["total"]
    return first + (part.layers - 1) * rest


def part_memory(part: Part, q: int, depth: int, hw: Hardware) -> float:
    """Bytes per rank: the weight blocks (with gradient and two AdamW moments when trained, fp32)
    and the activations backward keeps (none for a frozen prefix)."""
    return layout_memory(part, (q, depth), depth * q * q, hw)


def layout_memory(part: Part, layout: tuple[int, int] | str, world: int, hw: Hardware) -> float:
    """``part_memory`` on a (q, depth) mesh or in 1D (``ONE_D``: weights split p ways, the norms'
    activations whole) over ``world`` ranks."""
    scheme, p, ways = _scheme(layout, world)
    weights = part.params / ways * (hw.bytes_per_element if part.frozen else 16)
    keeps = not part.frozen or part.input_grad
    acts = activation_elements(part.layer, scheme, p) * part.layers if keeps else 0.0
    return weights + acts * hw.bytes_per_element


def crossing_elements(rows: int, hidden: int, src, dst, world: int, backward: bool) -> tuple[int, int]:
    """(forward, backward) elements a rank receives where an activation [rows, hidden] goes from a
    part laid out ``src`` to one laid out ``dst`` ((q, depth) or ``ONE_D``; None: the model's input
    or output, a block of the neighbour's mesh). Between meshes ``redistribute``'s moves, each way
    where ``backward``; into a 1D part its input all-gathered forward (``to_whole``), out of one the
    gradient's blocks all-gathered backward (``from_whole``): all but the rank's own block."""
    if ONE_D not in (src, dst):
        moved = boundary_elements(rows, hidden, src, dst) if None not in (src, dst) else 0
        return moved, moved if backward else 0
    gathered = rows * hidden * (world - 1) // world
    return (gathered if dst == ONE_D else 0), (gathered if src == ONE_D and backward else 0)


def boundary_elements(rows: int, hidden: int, src: tuple[int, int], dst: tuple[int, int]) -> int:
    """Most elements a rank receives when an activation [rows, hidden] moves from a (q, depth)
    layout to another over the same ranks (``optimus2d.redistribute``; each element sent once)."""
    if src == dst:
        return 0
    ranks = tuple(range(src[1] * src[0] ** 2))
    moves = plan_moves(ranks, src, ranks, dst, "activation", (rows, hidden))
    received = [0] * len(ranks)
    for sender, to, box in moves:
        if sender != to:
            received[to] += math.prod(b - a for a, b in box)
    return max(received)


def propose_layouts(
    parts: list[Part], world: int, hw: Hardware, *, memory_cap: float | None = None, one_d: bool = False
) -> Proposal:
    """A mesh shape (q, depth), depth·q² = ``world``, for each part of a chain of modules (each
    hands its activation [rows, hidden] to the next): the choice of least predicted step time whose
    every rank fits ``memory_cap`` bytes (the least memory, when none fits). Prices each part by its
    frozen state (``part_time``) and each boundary by what ``redistribute`` moves, forward and, where
    the receiver needs the gradient, backward. ``one_d``: a part may also run in Megatron's 1D split
    (``ONE_D``, ``layout_time``), its input all-gathered in and its output's gradient out
    (``crossing_elements``; the first part's input and the last's output are blocks of the mesh
    beside them)."""
    shapes = [(q, world // (q * q)) for q in range(1, math.isqrt(world) + 1) if world % (q * q) == 0]
    shapes += [ONE_D] if one_d and world > 1 else []
    table = []
    for choice in itertools.product(shapes, repeat=len(parts)):
        seconds = sum(layout_time(part, c, world, hw) for part, c in zip(parts, choice, strict=True))
        memory = sum(layout_memory(part, c, world, hw) for part, c in zip(parts, choice, strict=True))
        for n in range(len(parts) + 1):  # the model's input, each boundary, the model's output
            before = parts[n - 1] if n else None
            after = parts[n] if n < len(parts) else None
            rows, hidden = (before or after).layer.rows, (before or after).layer.hidden
            backward = before is not None and (not before.frozen or before.input_grad)
            src, dst = (choice[n - 1] if n else None), (choice[n] if after is not None else None)
            moved = sum(crossing_elements(rows, hidden, src, dst, world, backward))
            seconds += moved * hw.bytes_per_element / hw.bandwidth + hw.latency * bool(moved)
        fits = memory_cap is None or memory <= memory_cap
        table.append(({part.path: shape for part, shape in zip(parts, choice, strict=True)}, seconds, memory, fits))
    table.sort(key=lambda row: (not row[3], row[1] if row[3] else row[2]))
    best = table[0]
    return Proposal(best[0], best[1], best[2], table)
