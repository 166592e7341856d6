"""Projection at scale (a model, not a measurement): TP (1D, 1D+SP, 2D, 2.5D) × PP × DP.

    python -m benchmarks scale                    # GPT-3 175B and LLaMA 70B on 64, 512, 4096 devices
    python -m benchmarks scale --inter-gbps 50    # faster links between nodes

For each model and device count: the fastest layout of ``optimus2d.cost.scale`` that fits the
device memory, the fastest Megatron-style TP8 (1D+SP) × PP × DP, their ratio, and the fastest of
each tensor-parallel kind, with the pipeline bubble (1F1B) and the memory per device.
"""

from __future__ import annotations

import argparse

import optimus2d
from optimus2d.cost.scale import GPT3_175B, LLAMA_70B, Cluster, best, layouts, step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tflops", type=float, default=400.0, help="sustained per device")
    parser.add_argument("--intra-gbps", type=float, default=300.0, help="per device, inside a node of 8")
    parser.add_argument("--inter-gbps", type=float, default=25.0, help="per device, between nodes")
    parser.add_argument("--memory-gb", type=float, default=80.0)
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 512, 4096])


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict | None:
    if world.rank != 0:
        return None
    cluster = Cluster(
        flops=args.tflops * 1e12, intra=args.intra_gbps * 1e9, inter=args.inter_gbps * 1e9, memory=args.memory_gb * 1e9
    )
    rows = []
    print(f"{cluster}\n{'model':12} {'devices':>7}  {'layout':34} {'step s':>8} {'bubble':>7} {'GB':>5}  vs TP8×PP×DP")
    for model in (GPT3_175B, LLAMA_70B):
        for devices in args.devices:
            pick, megatron = best(model, devices, cluster), best(model, devices, cluster, megatron=True)
            kinds = {}
            for layout in layouts(model, devices):
                figures = step(model, layout, cluster)
                kind = layout.tp.split(":")[0]
                if figures["memory"] <= cluster.memory and (
                    kind not in kinds or figures["total"] < kinds[kind][1]["total"]
                ):
                    kinds[kind] = (layout, figures)
            for label, found in [("pick", pick), ("TP8×PP×DP", megatron), *sorted(kinds.items())]:
                if found is None:
                    continue
                layout, figures = found
                ratio = megatron[1]["total"] / figures["total"] if megatron else float("nan")
                print(
                    f"{model.name:12} {devices:7}  {label + ': ' + str(layout):34} {figures['total']:8.2f} "
                    f"{figures['bubble']:7.3f} {figures['memory'] / 1e9:5.1f}  {ratio:.3f}×"
                )
                rows.append({"model": model.name, "devices": devices, "label": label, "layout": str(layout),
                             **figures, "speedup_vs_megatron": ratio})  # fmt: skip
    return {"cluster": vars(cluster), "rows": rows}
