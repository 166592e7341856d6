"""Layouts at scale: tensor (1D, 1D+SP, 2D, 2.5D) × pipeline × data parallelism on a two-level network.

A model, not a measurement. ``Cluster``: devices in nodes of ``node`` (8) with fast links inside a
node and slower ones between nodes. A layout ``TP × PP × DP`` places a tensor-parallel group on
consecutive devices (so a group of ≤ ``node`` devices stays in a node), a pipeline of ``pp``
stages across TP groups, and ``dp`` replicas beyond.

Step time (one optimizer step of ``batch`` sequences):

* a stage's micro-batch: ``layers/pp`` transformer layers of ``micro`` sequences on TP, their
  compute at ``flops`` and their TP collectives (``plan.layer_comm``) priced by the links each
  group crosses: a 1D group of t > node devices, a 2D column group (stride q, spanning q² devices)
  when q² > node, a depth group when d·q² > node, cross nodes;
* the pipeline: 1F1B over m = batch / (dp · micro) micro-batches, (m + pp − 1) stage steps
  (``pipeline_steps``; ``pipeline/simulator.py`` replays torch's own ``Schedule1F1B`` to the same
  figure), plus a send of the activation block per micro-batch and boundary, each way;
* data parallelism: a ring all-reduce of the device's gradient blocks (2 bytes each) over the dp
  replicas, between nodes when the replicas do not share one, not overlapped with backward.

Memory per device: 16 bytes a parameter of its blocks (bf16 weight and gradient, fp32 master and
two AdamW moments) and the activations ``plan.activation_elements`` keeps, for the ``pp`` micro-
batches 1F1B keeps in flight on the first stage; layouts over ``memory`` are not considered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimus2d.cost.planner import _FACTOR, DTENSOR, Layer, activation_elements, layer_comm


@dataclass(frozen=True)
class Cluster:
    """``flops`` sustained per device; links: ``intra``/``inter`` bytes/s per device inside and
    between nodes of ``node`` devices, ``latency``/``inter_latency`` seconds per sync stage."""

    flops: float = 400e12
    node: int = 8
    intra: float = 300e9
    inter: float = 25e9
    latency: float = 5e-6
    inter_latency: float = 15e-6
    bytes_per_element: int = 2
    memory: float = 80e9


@dataclass(frozen=True)
class Model:
    """A decoder of ``layers`` × (hidden ``hidden``, MLP ``ffn`` as two matrices: a gated MLP of
    width f counts as 1.5·f), ``seq`` tokens a sequence, ``batch`` sequences a step."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    seq: int
    batch: int

    @property
    def params(self) -> int:
        return self.layers * (4 * self.hidden**2 + 2 * self.hidden * self.ffn)


GPT3_175B = Model("GPT-3 175B", 96, 12288, 4 * 12288, 96, 2048, 1536)
LLAMA_70B = Model("LLaMA 70B", 80, 8192, 3 * 28672 // 2, 64, 4096, 1024)


@dataclass(frozen=True)
class Layout:
    """``tp``: "1d", "1d-sp", "2d" or "2.5d:<depth>" over ``t`` devices; ``pp`` stages; ``dp``
    replicas; ``micro`` sequences a micro-batch."""

    tp: str
    t: int
    pp: int
    dp: int
    micro: int = 1

    def __str__(self) -> str:
        kind, _, depth = self.tp.partition(":")
        tp = f"{kind.upper()}{self.t}" + (f" (d={depth})" if depth else "")
        return f"{tp} × PP{self.pp} × DP{self.dp}"


def pipeline_steps(pp: int, microbatches: int) -> int:
    """Stage steps of 1F1B (and GPipe): m + pp − 1 (the bubble (pp − 1)/(m + pp − 1))."""
    return microbatches + pp - 1


def _links(layout: Layout, n: int, cluster: Cluster) -> tuple[float, float]:
    """(seconds a byte, latency) of a TP collective over a group of n devices, averaged over the
    group's axes where they differ (a 2D "q" group is a row half the time, a column the other)."""
    fast, slow = (1 / cluster.intra, cluster.latency), (1 / cluster.inter, cluster.inter_latency)
    if layout.tp in ("1d", "1d-sp"):
        return fast if layout.t <= cluster.node else slow
    depth = int(layout.tp.split(":")[1]) if ":" in layout.tp else 1
    q = math.isqrt(layout.t // depth)
    if n == q and q > 1:  # rows: consecutive q devices; columns: stride q, spanning q²
        row, col = (fast if q <= cluster.node else slow), (fast if q * q <= cluster.node else slow)
        return (row[0] + col[0]) / 2, (row[1] + col[1]) / 2
    if n == 2 and n != depth:  # the weight-stationary exchange with (k, j, i): within the q² block
        return fast if q * q <= cluster.node else slow
    return fast if layout.t <= cluster.node else slow  # the depth group spans d·q²


def stage_step(model: Model, layout: Layout, cluster: Cluster) -> float:
    """Seconds of one micro-batch's forward + backward through one stage (its layers on TP)."""
    layer = Layer(layout.micro, model.seq, model.hidden, model.ffn, model.heads)
    compute = layer.flops / (layout.t * cluster.flops)
    comm = 0.0
    for kind, n, elements, stages in layer_comm(layer, layout.tp, layout.t):
        per_byte, latency = _links(layout, n, cluster)
        factor = _FACTOR.get(kind.removeprefix(DTENSOR), lambda n: 1.0)(n)  # NCCL carries both alike
        comm += factor * elements * cluster.bytes_per_element * per_byte + stages * latency * math.log2(max(n, 2))
    return (compute + comm) * model.layers / layout.pp


def step(model: Model, layout: Layout, cluster: Cluster) -> dict[str, float]:
    """Predicted seconds of one step (``pipeline``, ``p2p``, ``dp``, ``total``), the bubble and the
    bytes per device (``memory``)."""
    m = model.batch // (layout.dp * layout.micro)
    stage = stage_step(model, layout, cluster)
    pipeline = pipeline_steps(layout.pp, m) * stage
    block = layout.micro * model.seq * model.hidden / layout.t * cluster.bytes_per_element
    cross = layout.t * 1 >= cluster.node  # consecutive stages sit in different nodes
    link = cluster.inter if cross else cluster.intra
    p2p = 2 * (layout.pp - 1) * m * block / link if layout.pp > 1 else 0.0
    grads = model.params / (layout.t * layout.pp) * cluster.bytes_per_element
    inter_dp = layout.t * layout.pp >= cluster.node
    dp = (
        _FACTOR["all_reduce"](layout.dp) * grads / (cluster.inter if inter_dp else cluster.intra)
        if layout.dp > 1
        else 0
    )
    layer = Layer(layout.micro, model.seq, model.hidden, model.ffn, model.heads)
    acts = activation_elements(layer, layout.tp, layout.t) * model.layers / layout.pp * min(layout.pp, m)
    memory = 16 * model.params / (layout.t * layout.pp) + acts * cluster.bytes_per_element
    total = pipeline + p2p + dp
    bubble = (layout.pp - 1) / pipeline_steps(layout.pp, m)
    return {"pipeline": pipeline, "p2p": p2p, "dp": dp, "total": total, "bubble": bubble, "memory": memory}


def layouts(model: Model, devices: int, *, micro: int = 1) -> list[Layout]:
    """Every layout of ``devices``: TP of 1–64 devices (1D, 1D+SP; 2D q²; 2.5D d·q², d = 2, 4),
    pp dividing the layers, dp the rest, the batch dividing into micro-batches on every replica."""
    out = []
    tps = [("1d", t) for t in (1, 2, 4, 8, 16, 32, 64)] + [("1d-sp", t) for t in (2, 4, 8, 16, 32, 64)]
    tps += [("2d", q * q) for q in (2, 3, 4, 8)] + [(f"2.5d:{d}", d * q * q) for d in (2, 4) for q in (2, 4)]
    for tp, t in tps:
        depth = int(tp.split(":")[1]) if ":" in tp else 1
        if devices % t or (tp.startswith("2") and model.hidden % math.isqrt(t // depth)):
            continue
        for pp in range(1, model.layers + 1):
            if model.layers % pp or (devices // t) % pp:
                continue
            dp = devices // (t * pp)
            if model.batch % (dp * micro) == 0:
                out.append(Layout(tp, t, pp, dp, micro))
    return out


def best(model: Model, devices: int, cluster: Cluster, *, megatron: bool = False) -> tuple[Layout, dict] | None:
    """The fastest layout that fits the device memory (``megatron``: among TP8 1D+SP × PP × DP)."""
    fits = []
    for layout in layouts(model, devices):
        if megatron and (layout.tp, layout.t) != ("1d-sp", 8):
            continue
        figures = step(model, layout, cluster)
        if figures["memory"] <= cluster.memory:
            fits.append((figures["total"], layout, figures))
    if not fits:
        return None
    _, layout, figures = min(fits, key=lambda row: row[0])
    return layout, figures
