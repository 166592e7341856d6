"""Projection from the cost model (optimus2d.cost.planner): which layout wins as devices grow.

    python -m benchmarks plan               # a model, not a measurement; runs in one process

For one transformer layer (hidden h, sequence s, batch growing with the devices), prints the
predicted step time of 1D, 1D + sequence parallelism, 2D and 2.5D on p devices, the fastest layout,
its parallel efficiency, and the isoefficiency hidden size: the smallest h at which each layout
keeps the target efficiency (the problem size grows as h²).
"""

from __future__ import annotations

import argparse
import math

import optimus2d
from optimus2d.cost.planner import Hardware, Layer, efficiency, isoefficiency_hidden, step_time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch-per-device", type=int, default=4)
    parser.add_argument("--tflops", type=float, default=150.0, help="sustained per device")
    parser.add_argument("--gbps", type=float, default=25.0, help="link bandwidth, GB/s")
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--efficiency", type=float, default=0.5)


def _layouts(p: int) -> list[str]:
    out = ["1d", "1d-sp"]
    if math.isqrt(p) ** 2 == p:
        out.append("2d")
    for depth in (2, 4):
        if p % depth == 0 and math.isqrt(p // depth) ** 2 == p // depth and p // depth > 1:
            out.append(f"2.5d:{depth}")
    return out


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    hw = Hardware(args.tflops * 1e12, args.gbps * 1e9, args.latency_us * 1e-6)
    rows = []
    for p in (4, 16, 64, 256, 1024, 4096):
        layer = Layer(args.batch_per_device * p, args.seq, args.hidden, 4 * args.hidden)
        times = {s: step_time(layer, s, p, hw)["total"] for s in _layouts(p)}
        eff = {s: efficiency(layer, s, p, hw) for s in _layouts(p)}
        iso = {s: isoefficiency_hidden(s, p, hw, args.efficiency, args.seq, layer.batch) for s in _layouts(p)}
        rows.append({"p": p, "batch": layer.batch, "time_s": times, "efficiency": eff, "isoefficiency_hidden": iso})
    if world.rank == 0:
        print(
            f"cost model: one layer, h={args.hidden}, s={args.seq}, batch {args.batch_per_device}·p; "
            f"{args.tflops:g} TFLOP/s, {args.gbps:g} GB/s, {args.latency_us:g} µs per device"
        )
        names = ["1d", "1d-sp", "2d", "2.5d:2", "2.5d:4"]
        print("{:>6}{:>8}".format("p", "batch") + "".join(f"{n:>11}" for n in names) + "   fastest")
        for r in rows:
            cells = "".join(f"{r['time_s'][n] * 1e3:>9.1f}ms" if n in r["time_s"] else f"{'—':>11}" for n in names)
            fastest = min(r["time_s"], key=r["time_s"].get)
            print(f"{r['p']:>6}{r['batch']:>8}{cells}   {fastest}")
        print("efficiency at that size")
        for r in rows:
            cells = "".join(f"{r['efficiency'][n]:>11.2f}" if n in r["efficiency"] else f"{'—':>11}" for n in names)
            print(f"{r['p']:>6}{'':>8}{cells}")
        print(f"isoefficiency: smallest hidden size at {args.efficiency:.0%} efficiency")
        for r in rows:
            cells = "".join(f"{r['isoefficiency_hidden'].get(n) or '—':>11}" for n in names)
            print(f"{r['p']:>6}{'':>8}{cells}")
    return {"config": vars(args), "rows": rows}
