"""Pipeline bubbles: torch's schedules run for real on sleeping stages, beside the simulator.

    mpiexec -n 4 python -m benchmarks pipeline        # 4 stages of one rank, 8 micro-batches

On 2 shared cores wall time cannot show a bubble (a waiting rank lends its core to a working one),
so the stages compute by sleeping a set time (a custom autograd Function: forward sleeps its
forward seconds, backward its input-gradient and weight-gradient seconds where they are needed):
no core contention, and each action's cost is known. Every stage is a ``torch.distributed.
pipelining.PipelineStage`` on its own ``Mesh`` (``optimus2d.pipeline``); the actions each rank
runs are timed (``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``),
and the measured makespan and bubble fraction (1 − Σ busy / (ranks × makespan)) are printed beside
``optimus2d.pipeline_simulator``'s replay of the same schedule with the same costs.

The model is a frozen encoder of 6 layers (forward, input and weight gradient ``--enc-ms`` each)
then a trained LM of 8 layers (``--lm-ms`` each), cut into stages by equal layer counts (naive)
and by ``optimus2d.pipeline.partition.partition`` (frozen-aware: a frozen prefix costs its forward
alone): per stage, the predicted and the measured seconds, and the step they make. First, the
encoder in the LLM's bubbles (``optimus2d.pipeline_bubbles``): the LLM under 1F1B and
Interleaved1F1B, the encoder's split over the ranks and its lead chosen by ``plan_bubbles`` from
the same costs, run by ``ScheduleEncoderInBubbles`` on torch's action-list runtime.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function
from torch.distributed import pipelining as pp

import optimus2d
from optimus2d.pipeline import pipeline_stage, stage_meshes
from optimus2d.pipeline.bubbles import LLM_SCHEDULES, ScheduleEncoderInBubbles, encoder_stage, llm_stages, plan_bubbles
from optimus2d.pipeline.partition import LayerCost, equal_layers, partition, stage_costs
from optimus2d.pipeline.simulator import schedule_order, simulate, stage_to_rank

SCHEDULES = {"GPipe": (pp.ScheduleGPipe, 1), "1F1B": (pp.Schedule1F1B, 1)}
SCHEDULES.update({"Interleaved1F1B": (pp.ScheduleInterleaved1F1B, 2), "LoopedBFS": (pp.ScheduleLoopedBFS, 2)})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--enc-ms", type=float, default=4.0, help="an encoder layer's forward (= each gradient)")
    parser.add_argument("--lm-ms", type=float, default=8.0, help="an LM layer's forward (= each gradient)")
    parser.add_argument("--enc-layers", type=int, default=6)
    parser.add_argument("--trained-encoder", action="store_true", help="the encoder learns (default: frozen)")
    parser.add_argument("--lm-layers", type=int, default=8)


class _Sleep(Function):
    @staticmethod
    def forward(ctx, x, weight, seconds):
        ctx.seconds = seconds
        time.sleep(seconds[0])
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        need_x, need_w = ctx.needs_input_grad[:2]
        time.sleep(ctx.seconds[1] * need_x + ctx.seconds[2] * need_w)
        return grad if need_x else None, grad.sum().reshape(1) * 0 if need_w else None, None


class SleepLayers(nn.Module):
    """Layers that compute by sleeping: (forward, input gradient, weight gradient) seconds each."""

    def __init__(self, costs: list[LayerCost]) -> None:
        super().__init__()
        self.costs = costs
        self.weights = nn.ParameterList(nn.Parameter(torch.ones(1), requires_grad=not c.frozen) for c in costs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for cost, weight in zip(self.costs, self.weights, strict=True):
            x = _Sleep.apply(x, weight, (cost.forward, cost.input_grad, cost.weight_grad))
        return x


def _timed(stage, spans: list) -> None:
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        original = getattr(stage, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.monotonic()
            out = _original(*args, **kwargs)
            spans.append((_name, start, time.monotonic()))
            return out

        setattr(stage, name, timed)


def _measure(pipe, costs, bounds, cls, chunks_per_rank, n, prelude=0.0) -> tuple[float, list[float]]:
    """Run one step (after one warm-up); (makespan, each rank's busy seconds), on every rank.
    ``prelude``: seconds every rank computes first (the encoder phase of the three-phase schedule)."""
    ends = [0, *bounds]
    spans: list = []
    stage_ids = [pipe.stage] if chunks_per_rank == 1 else [pipe.stage, pipe.stage + pipe.stages]
    num = pipe.stages * chunks_per_rank
    stages = []
    for sid in stage_ids:
        chunk = SleepLayers(costs[ends[sid] : ends[sid + 1]])
        stage = pipeline_stage(
            chunk, pipe, microbatch_shape=(1, 1, 1), dtype=torch.float32, stage_index=sid, num_stages=num
        )
        _timed(stage, spans)
        stages.append(stage)
    schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=n, loss_fn=lambda out, t: out.sum())
    return _time_steps(schedule, 0 in stage_ids, num - 1 in stage_ids, n, spans, prelude)


def _measure_bubbles(pipe, encoder, lm, llm, plan, n) -> tuple[float, list[float]]:
    """``_measure`` for the encoder in the bubbles: ``plan``'s split and order, torch's runtime."""
    p, chunks = pipe.stages, LLM_SCHEDULES[llm][1]
    bounds, per, spans, stages = [0, *plan.encoder_bounds()], len(lm) // (p * chunks), [], []
    mine = [encoder_stage(pipe.stage, p), *llm_stages(pipe.stage, p, chunks)]
    for sid in mine:
        costs = encoder[bounds[sid] : bounds[sid + 1]] if sid < p else lm[(sid - p) * per : (sid - p + 1) * per]
        stage = pipeline_stage(
            SleepLayers(costs), pipe, microbatch_shape=(1, 1, 1), dtype=torch.float32, stage_index=sid,
            num_stages=(1 + chunks) * p, input_grad=sid > (p if encoder[0].frozen else 0),
            output_grad=sid >= p or not encoder[0].frozen,
        )  # fmt: skip
        _timed(stage, spans)
        stages.append(stage)
    schedule = ScheduleEncoderInBubbles(stages, n, plan.order, loss_fn=lambda out, t: out.sum())
    return _time_steps(schedule, 0 in mine, (1 + chunks) * p - 1 in mine, n, spans)


def _time_steps(schedule, first: bool, last: bool, n: int, spans: list, prelude=0.0) -> tuple[float, list[float]]:
    x = torch.ones(n, 1, 1, requires_grad=False)
    for _ in range(2):  # a warm-up step, then the measured one
        spans.clear()
        dist.barrier()
        start = time.monotonic()
        if prelude:
            time.sleep(prelude)
            spans.append(("prelude", start, time.monotonic()))
        if first:
            schedule.step(x, target=x, losses=[]) if last else schedule.step(x)
        elif last:
            schedule.step(target=x, losses=[])
        else:
            schedule.step()
        end = time.monotonic()
    figures = torch.tensor([start, end, sum(b - a for _, a, b in spans)], dtype=torch.float64)
    every = [torch.zeros_like(figures) for _ in range(dist.get_world_size())]
    dist.all_gather(every, figures)
    starts, stops, busy = zip(*(f.tolist() for f in every), strict=True)
    return max(stops) - min(starts), list(busy)


def _simulate(cls, p, n, v, per_stage):
    cost = lambda kind, s: per_stage[s][0] if kind == "F" else per_stage[s][1]  # noqa: E731
    return simulate(schedule_order(cls, p, n, v), cost, where=stage_to_rank(cls, p, v))


def _row(schedule: str, cut: str, bounds, sim, makespan: float, busy: list[float]) -> dict:
    p = len(busy)
    return {
        "schedule": schedule, "cut": cut, "bounds": bounds,
        "rank_predicted_ms": [1e3 * sim.busy[r] for r in sorted(sim.busy)], "rank_busy_ms": [1e3 * b for b in busy],
        "simulated_ms": 1e3 * sim.makespan, "measured_ms": 1e3 * makespan,
        "simulated_bubble": 1 - sum(sim.busy.values()) / (p * sim.makespan),
        "measured_bubble": 1 - sum(busy) / (p * makespan),
    }  # fmt: skip


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    p, n = world.size, args.microbatches
    pipe = stage_meshes(p, 1)
    enc, lm = args.enc_ms / 1e3, args.lm_ms / 1e3
    frozen = not args.trained_encoder
    encoder = [LayerCost(enc, enc, enc, frozen=frozen) for _ in range(args.enc_layers)]
    llm_layers = [LayerCost(lm, lm, lm) for _ in range(args.lm_layers)]
    costs, rows = encoder + llm_layers, []
    for llm in ("1F1B", "Interleaved1F1B"):  # the encoder in the bubbles of an LLM under torch's order
        chunks = LLM_SCHEDULES[llm][1]
        if args.lm_layers % (p * chunks):
            continue
        per = args.lm_layers // (p * chunks)
        costs_llm = [(per * lm, 2 * per * lm)] * (p * chunks)
        if frozen:  # the first LLM layer's input (frozen features): no gradient
            costs_llm[0] = (per * lm, (2 * per - 1) * lm)
        plan = plan_bubbles(llm, p, n, encoder, costs_llm)
        makespan, busy = _measure_bubbles(pipe, encoder, llm_layers, llm, plan, n)
        cut = f"enc {''.join(map(str, plan.layers))} lead {plan.lead}"
        rows.append(_row(f"bubbles+{llm}", cut, plan.encoder_bounds(), plan.timeline, makespan, busy))
    for llm in ("1F1B", "Interleaved1F1B"):  # Megatron-core MIMO's colocated three phases
        cls, v = SCHEDULES[llm]
        # each rank encodes n/p micro-batches before the LLM (and, trained, takes their backward after it)
        prelude = n * sum(c.forward + (not c.frozen) * (c.input_grad + c.weight_grad) for c in encoder) / p
        bounds = equal_layers(len(llm_layers), p * v)
        sim = _simulate(cls, p, n, v, stage_costs(llm_layers, bounds))
        sim.busy = {r: prelude + b for r, b in sim.busy.items()}
        sim.makespan += prelude
        makespan, busy = _measure(pipe, llm_layers, bounds, cls, v, n, prelude)
        rows.append(_row(f"3-phase+{llm}", "encoder DP", bounds, sim, makespan, busy))
    for name, (cls, v) in SCHEDULES.items():
        stages = p * v
        if len(costs) < stages:
            continue
        cuts = [("equal layers", equal_layers(len(costs), stages)), ("frozen-aware", partition(costs, stages))]
        if v == 1:  # Cornstarch's baseline: the encoder as the leading stage, the LM over the others
            cuts.append(("encoder stage", [len(encoder)] + [len(encoder) + b for b in partition(llm_layers, p - 1)]))
        for cut_name, bounds in cuts:
            sim = _simulate(cls, p, n, v, stage_costs(costs, bounds))
            makespan, busy = _measure(pipe, costs, bounds, cls, v, n)
            rows.append(_row(name, cut_name, bounds, sim, makespan, busy))
    if world.rank == 0:
        print(
            f"{p} stages of one rank, {n} micro-batches; encoder {args.enc_layers} × {args.enc_ms} ms "
            f"{'frozen' if frozen else 'trained'}, "
            f"LM {args.lm_layers} × {args.lm_ms} ms"
        )
        columns = f"{'schedule':22} {'cut':16} {'sim ms':>8} {'meas ms':>8} {'err':>6} {'sim bub':>8} {'meas bub':>8}"
        print(columns + "  per rank: predicted / measured busy ms")
        for r in rows:
            err = r["measured_ms"] / r["simulated_ms"] - 1
            stages = " ".join(
                f"{a:.0f}/{b:.0f}" for a, b in zip(r["rank_predicted_ms"], r["rank_busy_ms"], strict=True)
            )
            print(
                f"{r['schedule']:22} {r['cut']:16} {r['simulated_ms']:8.1f} {r['measured_ms']:8.1f} {err:+6.1%} "
                f"{r['simulated_bubble']:8.3f} {r['measured_bubble']:8.3f}  {stages}"
            )
    return {"config": vars(args), "ranks": p, "rows": rows}
