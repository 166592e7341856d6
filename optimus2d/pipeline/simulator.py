"""A pipeline schedule simulator: torch's own schedules, replayed with per-action costs.

``schedule_order(cls, ranks, n_microbatches, stages_per_rank)`` asks a schedule class of
``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, or any with the same constructor) for its action list, rank by rank: the
same ``pipeline_order`` its runtime executes, built here from stand-in stages (no process group).

``simulate(order, cost, ...)`` replays it: each rank runs its computation actions in their order,
an action starting when its rank is free and its inputs have arrived:

    F(s, m)   after F(s−1, m) (+ ``p2p`` when stage s−1 is on another rank)
    B/I(s, m) after F(s, m), and after B/I(s+1, m) (+ ``p2p``) unless s is the last stage
    W(s, m)   after I(s, m)

``cost(kind, stage)`` gives the seconds of an action ("F", "B" full backward, "I" input gradient,
"W" weight gradient); communication and idle steps (``None``) take no rank time. The result: the
makespan, each rank's busy seconds and the bubble fraction 1 − Σ busy / (ranks × makespan), the
share of the ranks' time spent waiting. An encoder's work can be added to any rank's list as
extra actions (``extra``: rank → [(position, name, seconds, after)]) to see it fill the bubbles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

_KINDS = {"F": "F", "B": "B", "I": "I", "W": "W"}


def stage_to_rank(cls: type, ranks: int, stages_per_rank: int) -> Callable[[int], int]:
    """Which rank holds stage s: looped (s mod ranks) or, for the V-shaped schedules, down and back."""
    if getattr(cls, "__name__", "") in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return lambda s: s if s < ranks else 2 * ranks - 1 - s
    return lambda s: s % ranks


def schedule_order(cls: type, ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> dict[int, list]:
    """torch's ``pipeline_order`` of ``cls`` for ``ranks`` pipeline ranks (rank → its actions)."""
    stages = ranks * stages_per_rank
    where = stage_to_rank(cls, ranks, stages_per_rank)

    def stand_in(index: int) -> SimpleNamespace:
        return SimpleNamespace(
            stage_index=index, num_stages=stages, group_size=ranks, group_rank=where(index), is_first=index == 0,
            is_last=index == stages - 1, has_backward=True, submod=None, group=None, device="cpu",
            stage_index_to_group_rank={s: where(s) for s in range(stages)},
        )  # fmt: skip

    if stages_per_rank == 1:
        order = cls(stand_in(0), n_microbatches=n_microbatches).pipeline_order
    else:
        mine = [s for s in range(stages) if where(s) == 0]
        order = cls([stand_in(s) for s in mine], n_microbatches=n_microbatches).pipeline_order
    return {rank: _forwards_in_order(actions, n_microbatches) for rank, actions in order.items()}


def _forwards_in_order(actions: list, n_microbatches: int) -> list:
    """The actions with each stage's forwards numbered 0, 1, ... in their order. A stage runs its
    forwards in micro-batch order under every schedule; torch 2.13's ``Schedule1F1B`` IR (which
    its runtime does not execute) numbers the last rank's 1..n instead of 0..n−1."""
    seen: dict[int, int] = {}
    out = []
    for action in actions:
        if action is not None and action.computation_type.value == "F":
            n = seen.get(action.stage_index, 0)
            seen[action.stage_index] = n + 1
            if n >= n_microbatches:
                raise ValueError(f"schedule_order: stage {action.stage_index} has more than {n_microbatches} forwards")
            action = action._replace(microbatch_index=n)
        out.append(action)
    return out


@dataclass
class Timeline:
    """``makespan`` seconds; ``busy[r]`` seconds rank r computed; ``spans[r]``: (name, start, end)."""

    makespan: float
    busy: dict[int, float]
    spans: dict[int, list[tuple[str, float, float]]] = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        """The share of the ranks' time spent waiting: 1 − Σ busy / (ranks × makespan)."""
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def simulate(
    order: dict[int, list],
    cost: Callable[[str, int], float],
    *,
    where: Callable[[int], int] | None = None,
    p2p: float = 0.0,
    extra: dict[int, list[tuple[int, str, float, str | None]]] | None = None,
) -> Timeline:
    """Replay ``order`` (``schedule_order``'s) with ``cost``; see the module docstring."""
    stages = 1 + max((a.stage_index for acts in order.values() for a in acts if a is not None), default=0)
    where = where or (lambda s: s % len(order))
    lists = {}
    for rank, actions in order.items():
        flat = [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]  # DualPipeV's F+B pairs
        work = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in flat]
        work = [(_KINDS[k], s, m) for k, s, m in work if k in _KINDS]
        for position, name, seconds, after in sorted((extra or {}).get(rank, []), reverse=True):
            work.insert(position, ("X", name, (seconds, after)))
        lists[rank] = work
    done: dict[tuple, float] = {}
    clock = {rank: 0.0 for rank in lists}
    busy = {rank: 0.0 for rank in lists}
    spans: dict[int, list] = {rank: [] for rank in lists}
    at = {rank: 0 for rank in lists}
    while any(at[r] < len(lists[r]) for r in lists):
        progressed = False
        for rank, work in lists.items():
            while at[rank] < len(work):
                ready = _ready(work[at[rank]], rank, done, where, p2p, stages)
                if ready is None:
                    break
                kind, stage, micro = work[at[rank]]
                seconds = micro[0] if kind == "X" else cost(kind, stage)
                start = max(clock[rank], ready)
                clock[rank] = start + seconds
                busy[rank] += seconds
                name = stage if kind == "X" else f"{kind}{stage},{micro}"
                key = ("X", stage) if kind == "X" else (kind, stage, micro)
                done[key] = clock[rank]
                if kind == "B":  # a full backward is the input gradient and the weight gradient
                    done[("I", stage, micro)] = done[("W", stage, micro)] = clock[rank]
                spans[rank].append((name, start, clock[rank]))
                at[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: lists[r][at[r]] for r in lists if at[r] < len(lists[r])}
            raise ValueError(f"simulate: the schedule waits forever (each rank's next action: {stuck})")
    return Timeline(max(clock.values(), default=0.0), busy, spans)


def _ready(action, rank: int, done: dict, where, p2p: float, stages: int) -> float | None:
    """When ``action``'s inputs are there (None: not yet computed)."""
    kind, stage, micro = action
    if kind == "X":
        after = micro[1]
        return 0.0 if after is None else done.get(("X", after))
    needs = []
    if kind == "F" and stage > 0:
        needs.append((("F", stage - 1, micro), where(stage - 1) != rank))
    if kind in ("B", "I"):
        needs.append((("F", stage, micro), False))
        if stage < stages - 1:
            needs.append((("I", stage + 1, micro), where(stage + 1) != rank))
    if kind == "W":
        needs.append((("I", stage, micro), False))
    times = []
    for key, remote in needs:
        if key not in done:
            return None
        times.append(done[key] + (p2p if remote else 0.0))
    return max(times, default=0.0)
