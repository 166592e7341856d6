"""A pre-norm transformer block (``nn.TransformerEncoderLayer``): optimus2d against torch on one rank.

    mpiexec -n 4 python -m benchmarks block          # h=512, 8 heads, ffn 4h, batch 8 × seq 128

The same measurements as ``mlp``. The 1D peers run ``tp_block.TPBlock`` (the same weights with
q, k, v as separate Linears, which DTensor's plans can split by heads) under Megatron's plan, with
and without sequence parallelism; elements sent are checked against
``optimus2d.cost.planner.transformer_layer_elements``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import optimus2d
from benchmarks import compare, peers
from benchmarks.tp_block import TPBlock, block_plan
from optimus2d.cost.memory import saved_activation_bytes
from optimus2d.cost.planner import Layer, transformer_layer_elements


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    compare.add_run_arguments(parser)


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    p, h, device, dtype = world.size, args.hidden, mesh.device, compare.dtype(args)
    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(
        h, args.heads, 4 * h, 0.0, "gelu", batch_first=True, norm_first=True, device=device, dtype=dtype
    )
    x = torch.randn(args.batch, args.seq, h, device=device, dtype=dtype)
    with torch.no_grad():
        reference = serial(x)
    grad = torch.randn_like(reference)
    group = peers.optimus_twins(serial, mesh, x, grad)
    if p > 1 and args.heads % p == 0:
        for sp in (False, True):
            plan, out_dim = block_plan(sp), (1 if sp else None)
            group.append(peers.dtensor_1d(TPBlock(serial), plan, x, grad, sequence_parallel=sp, out_dim=out_dim))
    group.append(peers.plain_torch(serial, x, grad))
    compare.check(group, reference)

    ours = group[0]
    x_local = optimus2d.scatter(x, mesh).detach().requires_grad_()  # the formula counts the input's gradient
    with optimus2d.count_comm() as counter:
        ours.model(x_local).backward(optimus2d.scatter(grad, mesh))
    ours.model.zero_grad(set_to_none=True)
    rows = args.batch * args.seq
    what = f"transformer block h={h}, {args.heads} heads" + ("" if dtype == torch.float32 else f", {args.dtype}")
    compare.time_rounds(group, args.rounds, device, what)
    layer = Layer(args.batch, args.seq, h, 4 * h)
    results = compare.summarize(group, rows, args.batch, args.cap_mib, layer.flops)
    results[0]["elements_measured"] = counter.numel
    results[0]["elements_formula"] = transformer_layer_elements(layer, mesh.q, mesh.depth, on_diagonal=mesh.i == mesh.j)
    serial_act = saved_activation_bytes(serial, x)
    if world.rank == 0:
        compare.print_table(compare.title(what, args, mesh), results, serial_act, p)
        print(
            f"elements sent by rank 0 (input needing grad): measured {counter.numel:,}, "
            f"formula {results[0]['elements_formula']:,}"
        )
    return compare.result(args, mesh, serial_act, results)
