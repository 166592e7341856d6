"""Train an MLP of Linear2D layers on a 2D (or 2.5D) mesh beside its serial twin, step for step.

    mpiexec -n 4 python examples/train_mlp.py            # 2×2 mesh
    torchrun --standalone --nproc_per_node 8 examples/train_mlp.py --depth 2

Every rank builds the serial MLP with the same seed; the parallel one takes its blocks
(``Linear2D.from_serial``). Both train on the same data; the output reports the largest
difference between the two models' parameters and the time a step takes in each.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

import optimus2d


@dataclass
class Config:
    hidden: int = 256
    layers: int = 2
    batch: int = 16
    seq: int = 32
    steps: int = 10
    lr: float = 1e-3
    depth: int = 1
    seed: int = 0


def serial_mlp(cfg: Config) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(cfg.layers):
        blocks += [nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.GELU(), nn.Linear(4 * cfg.hidden, cfg.hidden)]
    return nn.Sequential(*blocks)


def parallel_mlp(serial: nn.Sequential, mesh: optimus2d.Mesh) -> nn.Sequential:
    return nn.Sequential(
        *(optimus2d.layers.Linear2D.from_serial(m, mesh) if isinstance(m, nn.Linear) else m for m in serial)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Config()).items():
        parser.add_argument(f"--{name}", type=type(value), default=value)
    cfg = Config(**vars(parser.parse_args()))

    world = optimus2d.init()
    q = math.isqrt(world.size // cfg.depth)
    mesh = optimus2d.Mesh(q, cfg.depth)
    torch.manual_seed(cfg.seed)
    serial = serial_mlp(cfg).to(world.device)
    model = parallel_mlp(serial, mesh)
    opt_serial = torch.optim.AdamW(serial.parameters(), lr=cfg.lr)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    target_map = torch.randn(cfg.hidden, cfg.hidden, device=world.device) / math.sqrt(cfg.hidden)

    times, times_serial = [], []
    for step in range(cfg.steps):
        x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, device=world.device)
        target = torch.tanh(x @ target_map)

        start = time.perf_counter()
        out = model(optimus2d.scatter(x, mesh))
        # the mean over the full batch: each rank's block contributes its share of the sum
        loss_local = (out - optimus2d.scatter(target, mesh)).square().sum() / target.numel()
        opt.zero_grad()
        loss_local.backward()
        opt.step()
        times.append(time.perf_counter() - start)

        start = time.perf_counter()
        loss_serial = (serial(x) - target).square().mean()
        opt_serial.zero_grad()
        loss_serial.backward()
        opt_serial.step()
        times_serial.append(time.perf_counter() - start)

        loss = optimus2d.comm.all_reduce(loss_local.detach(), mesh, ("row", "col", "depth"))
        if world.rank == 0:
            print(f"step {step:3d}  loss 2D {loss.item():.6f}  serial {loss_serial.item():.6f}")

    state, reference = optimus2d.serial_state_dict(model), serial.state_dict()
    diff = max((state[k] - reference[k]).abs().max().item() for k in reference)
    if world.rank == 0:
        med, med_serial = sorted(times)[len(times) // 2], sorted(times_serial)[len(times_serial) // 2]
        print(f"{mesh}: max |param 2D - param serial| after {cfg.steps} AdamW steps = {diff:.2e}")
        print(
            f"step time, median of {cfg.steps}: 2D {med * 1e3:.1f} ms per rank, serial {med_serial * 1e3:.1f} ms "
            f"(on {world.size} ranks sharing this machine's cores; see benchmarks/ for real comparisons)"
        )


if __name__ == "__main__":
    main()
