"""The TP × PP × DP projection: its pipeline term is the simulator's (torch's 1F1B), its links
two-level, its picks within memory, Megatron's baseline TP8 × PP × DP."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed.pipelining.schedules as S

from optimus2d.cost.scale import GPT3_175B, LLAMA_70B, Cluster, Layout, best, pipeline_steps, stage_step, step
from optimus2d.pipeline.simulator import schedule_order, simulate


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (8, 24), (16, 96)])
def test_the_pipeline_term_is_torchs_1f1b_replayed(p, m):
    forward, backward = 1.0, 2.0
    timeline = simulate(schedule_order(S.Schedule1F1B, p, m), lambda kind, stage: {"F": forward, "B": backward}[kind])
    assert timeline.makespan == pytest.approx(pipeline_steps(p, m) * (forward + backward))
    assert timeline.bubble == pytest.approx((p - 1) / pipeline_steps(p, m))


def test_a_group_that_leaves_the_node_pays_the_slow_link():
    fast_everywhere = dataclasses.replace(Cluster(), inter=Cluster().intra)
    for tp, t in [("1d", 16), ("2d", 16)]:
        layout = Layout(tp, t, 8, 1)
        assert stage_step(GPT3_175B, layout, Cluster()) > stage_step(GPT3_175B, layout, fast_everywhere)
    inside = Layout("1d", 8, 8, 1)
    assert stage_step(GPT3_175B, inside, Cluster()) == stage_step(GPT3_175B, inside, fast_everywhere)
    # a 2D mesh of 16 spans two nodes on its columns only: it suffers less than a 1D group of 16
    slow = {tp: stage_step(GPT3_175B, Layout(tp, 16, 8, 1), Cluster()) for tp in ("1d", "2d")}
    assert slow["2d"] < slow["1d"]


@pytest.mark.parametrize("model", [GPT3_175B, LLAMA_70B], ids=["gpt3", "llama70b"])
@pytest.mark.parametrize("devices", [64, 512, 4096])
def test_picks_fit_memory_and_megatron_is_tp8(model, devices):
    cluster = Cluster()
    pick, megatron = best(model, devices, cluster), best(model, devices, cluster, megatron=True)
    assert pick is not None and megatron is not None
    assert pick[1]["memory"] <= cluster.memory and megatron[1]["memory"] <= cluster.memory
    assert (megatron[0].tp, megatron[0].t) == ("1d-sp", 8)
    assert pick[1]["total"] <= megatron[1]["total"]
    layout = pick[0]
    assert layout.t * layout.pp * layout.dp == devices
    assert step(model, layout, cluster)["total"] == pick[1]["total"]


def test_less_memory_forces_a_deeper_split():
    roomy = best(GPT3_175B, 512, Cluster(memory=400e9))[0]
    tight = best(GPT3_175B, 512, Cluster(memory=40e9))[0]
    assert roomy.t * roomy.pp < tight.t * tight.pp
