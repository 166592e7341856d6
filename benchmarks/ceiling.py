"""The device's own matmul rate: what the TFLOP/s of the other subcommands compare with.

    python -m benchmarks ceiling                  # n×n×n products, n = 8192 on a GPU, 1024 on a CPU

One product ``a @ b`` of random n×n matrices in each dtype (fp32 as torch runs it by default,
fp32 with TF32 allowed, bf16), timed like the peers (CUDA events on a GPU), median of ``--rounds``
after a warm-up. Rank 0 measures; the others wait.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import optimus2d
from benchmarks import compare

MODES = {"float32": (torch.float32, False), "tf32": (torch.float32, True), "bfloat16": (torch.bfloat16, False)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=None, help="n (default 8192 on a GPU, 1024 on a CPU)")
    parser.add_argument("--rounds", type=int, default=10)


def matmul_tflops(n: int, dtype: torch.dtype, tf32: bool, rounds: int, device: torch.device) -> float:
    """TFLOP/s of one n×n×n product (2n³ flops), the median of ``rounds``."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    timer, times = compare.Timer(device), []
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        a @ b  # warm-up: the library picks its kernel
        for _ in range(rounds):
            timer.start()
            a @ b
            times.append(timer.stop())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return 2.0 * n**3 / (statistics.median(times) / 1e3) / 1e12


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    device = mesh.device
    n = args.size or (8192 if device.type == "cuda" else 1024)
    modes = MODES if device.type == "cuda" else {"float32": MODES["float32"], "bfloat16": MODES["bfloat16"]}
    rows, name = [], torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, 1 thread"
    if world.rank == 0:
        print(f"matmul {n}×{n}×{n} on {name}, median of {args.rounds}")
        for mode, (dtype, tf32) in modes.items():
            rate = matmul_tflops(n, dtype, tf32, args.rounds, device)
            rows.append({"dtype": mode, "tflops": rate})
            print(f"  {mode:<9}{rate:>10.2f} TFLOP/s")
    dist.barrier()
    return {"config": vars(args), "ranks": world.size, "device": name, "size": n, "rows": rows}
