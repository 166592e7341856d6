"""The encoder in the pipeline's bubbles (Optimus-MLLM, arXiv 2408.03505), on torch's action-list runtime.

An encoder + LLM model on ``p`` pipeline ranks (stage meshes, ``optimus2d.pipeline``) runs as one
chain of ``2p`` torch stages: ``p`` encoder chunks, then ``p`` LLM chunks. Every rank holds one of
each, on its own stage mesh, placed as a V::

    stage:   E0  E1  E2  E3 │ L0  L1  L2  L3        (p = 4; Ej = stage j, Lr = stage p + r)
    rank:     3   2   1   0 │  0   1   2   3

The images enter at the last rank, the one idle longest while 1F1B (or GPipe) fills the pipeline,
and flow up to rank 0, whose last encoder chunk hands the features to L0 in memory (torch's
V-schedule special case: no send). The LLM's actions keep torch's own order (``Schedule1F1B`` or
``ScheduleGPipe``); the encoder's forwards (and, when it trains, its backwards) are placed among
them by list scheduling from per-action costs measured on one rank (``bubble_order``): a rank runs
an encoder action when its next LLM action cannot start yet (a bubble), or when that encoder
micro-batch is due (``lead``: encoder micro-batch m before the rank's LLM forward of m − lead).
``plan_bubbles`` picks how many encoder layers each rank holds and the lead, by replaying every
candidate in the simulator. ``ScheduleEncoderInBubbles`` is a ``_PipelineScheduleRuntime`` given
that compute-only action list: torch adds the sends and receives (``_prepare_schedule_with_comms``)
and runs it.

No deadlock: an encoder chunk runs on the same stage mesh, hence the same ranks, as the LLM chunk
beside it, so every collective of either is called by ranks that execute one action list in one
order; the lists are a schedule the simulator has run to the end, so their cross-rank
dependencies (the data's) have no cycle, and torch's lowering checks it again. A frozen encoder's
backward actions compute and send nothing (its features need no gradient: ``output_grad=False``);
they stay in the list because torch's runtime counts a backward per stage and micro-batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch.distributed import pipelining
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

from optimus2d.pipeline.partition import LayerCost
from optimus2d.pipeline.simulator import Timeline, schedule_order

__all__ = [
    "BubblePlan",
    "ScheduleEncoderInBubbles",
    "bubble_order",
    "encoder_stage",
    "llm_stages",
    "plan_bubbles",
    "stage_rank",
]

_F, _B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
# the LLM's schedule by name → (torch's class, LLM chunks per rank: one, or looped over the ranks)
LLM_SCHEDULES = {
    "GPipe": (pipelining.ScheduleGPipe, 1),
    "1F1B": (pipelining.Schedule1F1B, 1),
    "Interleaved1F1B": (pipelining.ScheduleInterleaved1F1B, 2),
    "LoopedBFS": (pipelining.ScheduleLoopedBFS, 2),
}


def encoder_stage(rank: int, ranks: int) -> int:
    """The torch stage index of the encoder chunk on pipeline rank ``rank`` of ``ranks``."""
    return ranks - 1 - rank


def llm_stages(rank: int, ranks: int, chunks: int = 1) -> list[int]:
    """The torch stage indices of the LLM chunks on pipeline rank ``rank`` of ``ranks`` (looped:
    chunk v of the LLM is stage ``ranks + v·ranks + rank``)."""
    return [ranks + v * ranks + rank for v in range(chunks)]


def stage_rank(stage: int, ranks: int) -> int:
    """The pipeline rank holding torch stage ``stage`` (the V above, then looped)."""
    return ranks - 1 - stage if stage < ranks else (stage - ranks) % ranks


def bubble_order(
    llm: str, ranks: int, n_microbatches: int, cost: Callable[[str, int], float], lead: int = 0, p2p: float = 0.0
) -> tuple[dict[int, list[_Action]], Timeline]:
    """Each rank's compute-only action list, and its simulated timeline.

    ``llm``: the LLM's order, a name in ``LLM_SCHEDULES`` (Interleaved1F1B and LoopedBFS: two LLM
    chunks per rank); ``cost(kind, stage)``: seconds of "F" or "B" of a torch stage (encoder stages
    ``0 .. ranks−1``, LLM ``ranks .. (1 + chunks)·ranks − 1``); ``p2p``: seconds a
    send between ranks adds. List scheduling: the rank free earliest takes, in this order of
    preference, an encoder forward that is due (its micro-batch ≤ the next LLM forward's + ``lead``)
    and ready, its next LLM action if ready, any ready encoder action; else it waits for the next
    event. The LLM's own order is never changed.
    """
    if llm not in LLM_SCHEDULES:
        raise ValueError(f"bubble_order: llm={llm!r} is not one of {sorted(LLM_SCHEDULES)}")
    cls, chunks = LLM_SCHEDULES[llm]
    plan = _ListSchedule(cls, chunks, ranks, n_microbatches, lead, p2p)
    while any(plan.llm_queue[r] or plan.encoder_queue[r] for r in range(ranks)):
        # the action that can start first, over all ranks: everything placed later starts no earlier
        picks = [(c, r) for r in range(ranks) if (c := plan.choice(r)) is not None]
        if not picks:
            waiting = {r: (plan.llm_queue[r][:1], plan.encoder_queue[r][:1]) for r in range(ranks)}
            raise ValueError(f"bubble_order: every rank waits forever: {waiting}")
        (start, _, action, queue), rank = min(picks, key=lambda pick: (pick[0][0], pick[0][1], pick[1]))
        plan.place(rank, start, action, cost)
        queue.pop(0)
    return plan.out, Timeline(max(plan.clock.values()), plan.busy, plan.spans)


class _ListSchedule:
    """``bubble_order``'s state: each rank's queues of actions not placed yet, its clock, and what it placed."""

    def __init__(self, cls, chunks: int, ranks: int, n: int, lead: int, p2p: float) -> None:
        plain = schedule_order(cls, ranks, n, chunks)
        self.llm_queue = {
            r: [
                _Action(ranks + a.stage_index, a.computation_type, a.microbatch_index)
                for a in plain[r]
                if a and a.computation_type in (_F, _B)
            ]
            for r in range(ranks)
        }
        self.encoder_queue = {
            r: [_Action(encoder_stage(r, ranks), kind, m) for kind in (_F, _B) for m in range(n)] for r in range(ranks)
        }
        self.ranks, self.n, self.lead, self.p2p, self.last = ranks, n, lead, p2p, (1 + chunks) * ranks - 1
        self.done: dict[tuple, float] = {}
        self.clock = dict.fromkeys(range(ranks), 0.0)
        self.busy = dict.fromkeys(range(ranks), 0.0)
        self.spans: dict[int, list] = {r: [] for r in range(ranks)}
        self.out: dict[int, list[_Action]] = {r: [] for r in range(ranks)}

    def ready(self, action: _Action | None) -> float | None:
        """When ``action``'s inputs are there (None: one of them is not placed yet, or no action)."""
        if action is None:
            return None
        s, m, ranks = action.stage_index, action.microbatch_index, self.ranks
        needs = []
        if action.computation_type == _F and s > 0:
            needs.append((("F", s - 1, m), stage_rank(s - 1, ranks) != stage_rank(s, ranks)))
        if action.computation_type == _B:
            needs.append((("F", s, m), False))
            if s < self.last:
                needs.append((("B", s + 1, m), stage_rank(s + 1, ranks) != stage_rank(s, ranks)))
        if any(key not in self.done for key, _ in needs):
            return None
        return max((self.done[key] + (self.p2p if remote else 0.0) for key, remote in needs), default=0.0)

    def choice(self, rank: int) -> tuple[float, int, _Action, list] | None:
        """The rank's next action and its start (None: it waits for an action not placed yet)."""
        llm_queue, encoder_queue = self.llm_queue[rank], self.encoder_queue[rank]
        head = llm_queue[0] if llm_queue else None
        enc = encoder_queue[0] if encoder_queue else None
        now, t_llm, t_enc = self.clock[rank], self.ready(head), self.ready(enc)
        upcoming = next((a.microbatch_index for a in llm_queue if a.computation_type == _F), self.n)
        due = enc is not None and enc.computation_type == _F and enc.microbatch_index <= upcoming + self.lead
        options = []  # (start, preference): a due encoder forward, the LLM's next action, any encoder action
        if t_enc is not None:
            options.append((max(now, t_enc), 0 if due else 2, enc, encoder_queue))
        if t_llm is not None:
            options.append((max(now, t_llm), 1, head, llm_queue))
        return min(options, key=lambda o: o[:2]) if options else None

    def place(self, rank: int, start: float, action: _Action, cost: Callable[[str, int], float]) -> None:
        """Run ``action`` on ``rank`` from ``start``: its end, the rank's clock, busy time and span."""
        kind = action.computation_type.value
        seconds = cost(kind, action.stage_index)
        self.done[(kind, action.stage_index, action.microbatch_index)] = self.clock[rank] = start + seconds
        self.busy[rank] += seconds
        self.spans[rank].append((f"{kind}{action.stage_index},{action.microbatch_index}", start, start + seconds))
        self.out[rank].append(action)


@dataclass(frozen=True)
class BubblePlan:
    """``layers[r]``: encoder layers on pipeline rank r (its chunk is stage ``encoder_stage(r)``, and
    the chunks hold consecutive layers, stage 0 the first); ``lead``; ``order``: rank → actions;
    ``timeline``: simulated."""

    layers: tuple[int, ...]
    lead: int
    order: dict[int, list[_Action]]
    timeline: Timeline

    def stage_layers(self) -> list[int]:
        """The encoder layers of each encoder stage, in stage order (``llava_stages``' ``encoder_layers``)."""
        return [self.layers[stage_rank(j, len(self.layers))] for j in range(len(self.layers))]

    def encoder_bounds(self) -> list[int]:
        """Where each encoder stage's layers end, in stage order (stage j: ``bounds[j-1] .. bounds[j]``)."""
        return list(itertools.accumulate(self.stage_layers()))


def plan_bubbles(
    llm: str,
    ranks: int,
    n_microbatches: int,
    encoder: Sequence[LayerCost],
    llm_costs: Sequence[tuple[float, float]],
    *,
    p2p: float = 0.0,
    max_candidates: int = 400,
) -> BubblePlan:
    """The encoder split and lead that simulate fastest.

    ``encoder``: its layers' costs (``LayerCost``: a frozen layer costs its forward only, and a
    trained one its forward and both gradients); ``llm_costs[c]``: (forward, full backward) seconds
    of LLM chunk c (stage ``ranks + c``) per micro-batch, one per rank and chunk. Every split of the
    layers over the ranks is tried when there are at most ``max_candidates`` of them, else splits
    proportional to ``rank + c`` for a few c; with leads ``0, 1, 2, 4, n``. Ties go to the smaller
    lead, then to the first split found.
    """
    if llm not in LLM_SCHEDULES or len(llm_costs) != ranks * LLM_SCHEDULES[llm][1]:
        raise ValueError(
            f"plan_bubbles: {len(llm_costs)} LLM chunk costs for {ranks} ranks under {llm!r} (one per rank and chunk: "
            f"{ {k: v for k, (_, v) in LLM_SCHEDULES.items()} })"
        )
    n, total = n_microbatches, len(encoder)
    splits = _splits(total, ranks, max_candidates)
    best = None
    for layers in splits:
        bounds = list(itertools.accumulate(layers[stage_rank(j, ranks)] for j in range(ranks)))
        chunk = [encoder[(bounds[j - 1] if j else 0) : bounds[j]] for j in range(ranks)]
        sums = [
            (sum(c.forward for c in part), sum(0.0 if c.frozen else c.input_grad + c.weight_grad for c in part))
            for part in chunk
        ]

        def cost(kind: str, stage: int, sums=sums) -> float:
            f, b = sums[stage] if stage < ranks else llm_costs[stage - ranks]
            return f if kind == "F" else b

        for lead in sorted({0, 1, 2, 4, n}):
            order, timeline = bubble_order(llm, ranks, n, cost, lead, p2p)
            if best is None or timeline.makespan < best.timeline.makespan - 1e-12:
                best = BubblePlan(tuple(layers), lead, order, timeline)
    return best


def _splits(total: int, ranks: int, limit: int) -> list[tuple[int, ...]]:
    """Ways to give ``total`` layers to ``ranks`` ranks (rank order), all or a few proportional ones."""
    count = 1
    for k in range(1, ranks):
        count = count * (total + k) // k
    if count <= limit:
        return [
            tuple(b - a - 1 for a, b in zip((-1, *cuts), (*cuts, total + ranks - 1), strict=True))
            for cuts in itertools.combinations(range(total + ranks - 1), ranks - 1)
        ]
    out = []
    for c in (0.0, 0.5, 1.0, 2.0, 4.0, 1e9):
        weights = [r + c for r in range(ranks)]
        shares = [total * w / sum(weights) for w in weights]
        layers = [int(s) for s in shares]
        for r in sorted(range(ranks), key=lambda r: layers[r] - shares[r])[: total - sum(layers)]:
            layers[r] += 1
        if tuple(layers) not in out:
            out.append(tuple(layers))
    return out


class ScheduleEncoderInBubbles(_PipelineScheduleRuntime):
    """torch's action-list runtime, running ``order`` (``bubble_order``'s or ``plan_bubbles``'s).

    ``stages``: this rank's ``PipelineStage``s, its encoder chunk (``stage_index=
    encoder_stage(rank, p)``) and its LLM chunks (``llm_stages(rank, p, chunks)``), ``num_stages=
    (1 + chunks)·p``, all on its stage mesh (``optimus2d.pipeline.pipeline_stage``). ``step``: the
    images on the last pipeline rank (stage 0 is its encoder chunk), with the target on the rank of
    the last LLM chunk; keyword inputs (e.g. ``input_ids=``) on rank 0, where L0 reads them. torch
    hands ``step``'s keyword inputs to every stage of the rank: the chunks there must accept them.
    """

    def __init__(self, stages: list, n_microbatches: int, order: dict[int, list[_Action]], **kwargs) -> None:
        super().__init__(stages=stages, n_microbatches=n_microbatches, **kwargs)
        ranks, total = self.pp_group_size, self._num_stages
        chunks = total // ranks - 1
        expected = [encoder_stage(self.rank, ranks), *llm_stages(self.rank, ranks, chunks)]
        if total % ranks or chunks < 1 or sorted(s.stage_index for s in self._stages) != expected:
            raise ValueError(
                f"ScheduleEncoderInBubbles: pipeline rank {self.rank} of {ranks} needs stages {expected} of "
                f"(1 + chunks)·{ranks}, got {[s.stage_index for s in self._stages]} of {total}"
            )
        self.pipeline_order = {rank: list(actions) for rank, actions in order.items()}
        self._prepare_schedule_with_comms(self.pipeline_order)
