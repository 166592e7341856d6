"""The encoder-in-the-bubbles planner: its action lists keep every data dependency (torch's own
lowering to sends and receives accepts them), the simulator replays them to the planner's own
timeline, and on a frozen-encoder model the planned schedule beats every plain schedule with the
encoder as part of the first stage (cut by the frozen-aware partitioner)."""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules as S

from optimus2d.pipeline.bubbles import LLM_SCHEDULES, bubble_order, encoder_stage, llm_stages, plan_bubbles, stage_rank
from optimus2d.pipeline.partition import LayerCost, partition, stage_costs
from optimus2d.pipeline.simulator import schedule_order, simulate, stage_to_rank

ENC = [LayerCost(0.5, 0.5, 0.5, frozen=True)] * 6  # an encoder layer costs half an LLM layer
LLM = [LayerCost(1.0, 1.0, 1.0)] * 8


def _cost(p, chunks, layers, trained=False):
    def cost(kind, s):
        if s >= p:
            return (len(LLM) / (p * chunks)) * (1.0 if kind == "F" else 2.0)
        return 0.5 * layers[stage_rank(s, p)] * (1.0 if kind == "F" else 2.0 * trained)

    return cost


@pytest.mark.parametrize("llm", list(LLM_SCHEDULES))
@pytest.mark.parametrize("p,n", [(2, 4), (4, 8), (4, 5), (8, 16)])
@pytest.mark.parametrize("lead", [0, 2, 99])
@pytest.mark.parametrize("trained", [False, True])
def test_orders_keep_every_dependency_and_replay_exactly(llm, p, n, lead, trained):
    chunks = LLM_SCHEDULES[llm][1]
    if llm != "1F1B" and (p == 8 or n % p):
        pytest.skip("torch's looped schedules want n divisible by p; 8 ranks under 1F1B is enough")
    layers = [r % 3 for r in range(p)]  # uneven, some ranks with no encoder layer
    cost = _cost(p, chunks, layers, trained)
    order, timeline = bubble_order(llm, p, n, cost, lead)
    total = (1 + chunks) * p
    for rank, actions in order.items():  # each stage of the rank: n forwards and n backwards, nothing else
        mine = {encoder_stage(rank, p), *llm_stages(rank, p, chunks)}
        assert {a.stage_index for a in actions} == mine
        for stage in mine:
            kinds = sorted((a.computation_type.value, a.microbatch_index) for a in actions if a.stage_index == stage)
            assert kinds == sorted((k, m) for k in "BF" for m in range(n))
    # torch's lowering places every receive after its send and refuses a schedule that cannot progress
    comms = S._add_send_recv({r: list(a) for r, a in order.items()}, lambda s: stage_rank(s, p), total)
    assert sum(len(a) for a in comms.values()) > sum(len(a) for a in order.values())
    replay = simulate(order, cost, where=lambda s: stage_rank(s, p))
    assert replay.makespan == pytest.approx(timeline.makespan)
    assert replay.busy == pytest.approx(timeline.busy)


def test_rank_0_hands_each_micro_batch_to_the_llm_after_encoding_it():
    p, n = 4, 8
    order, _ = bubble_order("1F1B", p, n, _cost(p, 1, [1, 1, 2, 2]), lead=0)
    seen = []
    for action in order[0]:
        if action.computation_type.value == "F":
            seen.append((action.stage_index, action.microbatch_index))
    for m in range(n):
        assert seen.index((p - 1, m)) < seen.index((p, m))


def test_an_unknown_llm_order_is_refused():
    with pytest.raises(ValueError, match="ZBV"):
        bubble_order("ZBV", 2, 4, lambda k, s: 1.0)
    with pytest.raises(ValueError, match="LLM chunk costs"):
        plan_bubbles("Interleaved1F1B", 4, 8, ENC, [(1.0, 2.0)] * 4)


def _best_plain(p, n):
    costs, best = ENC + LLM, None
    for name, (cls, v) in {
        "GPipe": (S.ScheduleGPipe, 1), "1F1B": (S.Schedule1F1B, 1),
        "Interleaved1F1B": (S.ScheduleInterleaved1F1B, 2), "LoopedBFS": (S.ScheduleLoopedBFS, 2),
    }.items():  # fmt: skip
        per = stage_costs(costs, partition(costs, p * v))
        t = simulate(schedule_order(cls, p, n, v), lambda k, s, per=per: per[s][0] if k == "F" else per[s][1],
                     where=stage_to_rank(cls, p, v))  # fmt: skip
        best = min(best or (t.makespan, name), (t.makespan, name))
    return best


def test_the_encoder_in_the_bubbles_beats_the_best_plain_schedule():
    """4 ranks, 8 micro-batches, a frozen encoder of 6 half-cost layers before an LLM of 8: the best
    plain schedule is Interleaved1F1B on the frozen-aware cut (72 units); the encoder in the bubbles of
    an Interleaved1F1B LLM takes 62.5 (every unit: an LLM layer's forward)."""
    p, n = 4, 8
    plain, name = _best_plain(p, n)
    plan = plan_bubbles("Interleaved1F1B", p, n, ENC, [(1.0, 2.0)] * (2 * p))
    assert name == "Interleaved1F1B" and plain == pytest.approx(72.0)
    assert plan.timeline.makespan == pytest.approx(62.5)
    assert sum(plan.layers) == len(ENC) and plan.encoder_bounds()[-1] == len(ENC)
    ideal = n * (sum(c.forward for c in ENC) + 3 * len(LLM)) / p
    assert ideal < plan.timeline.makespan < plain
