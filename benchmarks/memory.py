"""Bytes, not time: activations saved for backward and parameters, per rank against serial.

mpiexec -n 4 python -m benchmarks memory
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import optimus2d
from optimus2d.cost.memory import saved_activation_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    h = args.hidden
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
    block = nn.TransformerEncoderLayer(
        h, args.heads, 4 * h, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    models = {  # name: (serial, its optimus2d twin)
        "linear h→4h": (nn.Linear(h, 4 * h), optimus2d.layers.Linear2D.from_serial),
        "mlp h→4h→h": (mlp, optimus2d.layers.MLP2D.from_serial),
        "mlp, act. kept": (
            mlp,
            lambda m, mesh: optimus2d.layers.MLP2D.from_serial(m, mesh, recompute_activation=False),
        ),
        "transformer block": (block, optimus2d.layers.TransformerBlock2D.from_serial),
    }
    x = torch.randn(args.batch, args.seq, h, device=mesh.device, requires_grad=True)
    rows = []
    for name, (serial, twin) in models.items():
        serial = serial.to(mesh.device)
        parallel = twin(serial, mesh)
        serial_act = saved_activation_bytes(serial, x)
        local_act = saved_activation_bytes(parallel, optimus2d.scatter(x, mesh).detach().requires_grad_())
        serial_par = sum(p.numel() * p.element_size() for p in serial.parameters())
        local_par = sum(p.numel() * p.element_size() for p in parallel.parameters())
        rows.append(
            {
                "model": name,
                "serial_activation_bytes": serial_act,
                "rank_activation_bytes": local_act,
                "activation_ratio_to_serial_over_p": local_act / (serial_act / mesh.size),
                "serial_parameter_bytes": serial_par,
                "rank_parameter_bytes": local_par,
                "parameter_ratio_to_serial_over_q2": local_par / (serial_par / mesh.q**2),
            }
        )
    if world.rank == 0:
        print(f"saved activations and parameters per rank, {mesh.size} ranks as Mesh(q={mesh.q}, depth={mesh.depth})")
        head = ("model", "serial act", "rank act", "÷ (serial/p)", "rank params", "÷ (serial/q²)")
        print("{:<20}{:>14}{:>12}{:>14}{:>13}{:>15}".format(*head))
        for r in rows:
            print(
                f"{r['model']:<20}{r['serial_activation_bytes']:>14,}{r['rank_activation_bytes']:>12,}"
                f"{r['activation_ratio_to_serial_over_p']:>14.3f}{r['rank_parameter_bytes']:>13,}"
                f"{r['parameter_ratio_to_serial_over_q2']:>15.3f}"
            )
    return {"config": vars(args), "rows": rows}
