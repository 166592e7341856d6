"""The schedule simulator replays torch's own schedules: the textbook bubbles come out exactly."""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules as S

from optimus2d.pipeline.simulator import schedule_order, simulate, stage_to_rank

COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _run(cls, p, m, v=1, p2p=0.0, extra=None):
    order = schedule_order(cls, p, m, v)
    return simulate(order, lambda k, s: COST[k] / v, where=stage_to_rank(cls, p, v), p2p=p2p, extra=extra)


@pytest.mark.parametrize("cls", [S.ScheduleGPipe, S.Schedule1F1B])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(cls, p, m):
    t = _run(cls, p, m)
    assert t.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert all(b == pytest.approx(3.0 * m) for b in t.busy.values())  # every rank: m forwards and backwards


@pytest.mark.parametrize("cls", [S.ScheduleInterleaved1F1B, S.ScheduleLoopedBFS])
def test_interleaved_stages_divide_the_bubble(cls):
    p, m, v = 4, 8, 2
    assert _run(cls, p, m, v).bubble == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("cls", [S.ScheduleInterleavedZeroBubble, S.ScheduleZBVZeroBubble, S.ScheduleDualPipeV])
def test_zero_bubble_schedules_beat_1f1b(cls):
    assert _run(cls, 4, 8, 2).bubble < _run(S.Schedule1F1B, 4, 8).bubble / 2


def test_a_send_between_ranks_lengthens_the_step():
    assert _run(S.Schedule1F1B, 4, 8, p2p=0.5).makespan > _run(S.Schedule1F1B, 4, 8).makespan


def test_work_placed_in_a_bubble_costs_nothing():
    """The last rank waits 3 forwards for its first input: 3 s of an encoder's work there keep the
    makespan and shrink the bubble; 4 s lengthen it."""
    plain = _run(S.Schedule1F1B, 4, 8)
    filled = _run(S.Schedule1F1B, 4, 8, extra={3: [(0, "encoder", 3.0, None)]})
    over = _run(S.Schedule1F1B, 4, 8, extra={3: [(0, "encoder", 4.0, None)]})
    assert filled.makespan == plain.makespan and filled.bubble < plain.bubble
    assert over.makespan > plain.makespan
