"""Where an MLP step's time goes: compute alone, communication alone, and both, for 2D and 1D.

    mpiexec -n 4 python -m benchmarks breakdown      # the issue's set-up: 1024→4096→1024, 8 × 128

Six variants of one fwd+bwd step, timed in interleaved rounds (medians):

* optimus2d 2D (SUMMA) as shipped, and the same model on a *silent* copy of its mesh, whose
  groups are all None, so every collective is skipped as on a 1-rank mesh: the same local
  matmuls on the same block shapes, no communication (its numbers are wrong; only its time
  counts). Then its collectives alone: every collective the step made (``count_comm``'s records:
  kind, axis, size), replayed one after another without the matmuls.
* DTensor 1D as the benchmarks time it, the local shard it computes (fc1's f/p rows, fc2's f/p
  columns, on the whole input) without the all-reduce, and that all-reduce alone.

Then each compute-alone step once more under ``torch.profiler``, on rank 0 alone while the others
wait (sharing cores, a kernel's time is mostly who else ran): ms a step by kernel (self CPU time;
the matmuls together), to say where SUMMA's compute differs from 1D's. And the 2D compute
alone with the activation kept (``recompute_activation=False``): what recomputing it costs.

"exposed" = step − compute alone: what communication adds to the step. Read beside the elements
each rank moves, it shows whether the loss is volume (exposed ≈ alone, growing with elements) or
something else. On this machine (2 cores for 4 ranks) there is no idle core to hide a copy.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist
from torch import nn

import optimus2d
from benchmarks import compare, peers
from optimus2d.comm import primitives as P
from optimus2d.cost import mlp_2d_elements


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    compare.add_run_arguments(parser)


def silent(mesh: optimus2d.Mesh) -> optimus2d.Mesh:
    """A copy of ``mesh`` whose every group has "one rank": the collectives send nothing."""
    quiet = copy.copy(mesh)
    quiet.group = lambda axis: None
    quiet.mpi = None
    quiet.check = "off"  # nor any agreement exchange
    return quiet


def replay(records: list, mesh: optimus2d.Mesh) -> list:
    """Buffers for ``records`` and a step that issues them in order, each waited (roots rotate over
    the members as SUMMA's steps do)."""
    buffers = [torch.zeros(r.numel, dtype=r.dtype, device=mesh.device) for r in records]
    seen: dict = {}

    def step() -> None:
        seen.clear()
        for r, buf in zip(records, buffers, strict=True):
            n = seen[r.kind, r.axis] = seen.get((r.kind, r.axis), -1) + 1
            root = n % mesh.axis_size(r.axis)
            if r.kind == "broadcast":
                P.broadcast(buf, mesh, r.axis, root)
            elif r.kind == "reduce":
                P.reduce(buf, mesh, r.axis, root)
            elif r.kind == "all_reduce":
                P.all_reduce(buf, mesh, r.axis)
            else:
                raise ValueError(f"replay does not know {r.kind} ({r.axis}, {r.numel} elements) on {mesh}")

    return step


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    p, h, f, device = world.size, args.hidden, args.ffn, mesh.device
    if mesh.depth != 1 or p == 1:
        raise ValueError(f"breakdown compares a 2D mesh with 1D on the same ranks; got {mesh}")
    torch.set_flush_denormal(True)  # the silent model multiplies uninitialised buffers
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h)).to(device)
    x = torch.randn(args.batch, args.seq, h, device=device)
    grad = torch.randn_like(x)
    x_2d, grad_2d = optimus2d.scatter(x, mesh), optimus2d.scatter(grad, mesh)

    def optimus_step(on: optimus2d.Mesh, recompute: bool = True):
        model = optimus2d.layers.MLP2D.from_serial(copy.deepcopy(serial), mesh, recompute_activation=recompute)
        for layer in model.modules():
            if isinstance(layer, optimus2d.layers.Linear2D):
                layer.algorithm, layer.mesh = "summa", on
        return lambda: model(x_2d).backward(grad_2d)

    with optimus2d.count_comm() as counter:
        optimus_step(mesh)()
    compute_only = optimus_step(silent(mesh))
    with optimus2d.count_comm() as quiet:
        compute_only()
    if quiet.records:
        raise RuntimeError(f"the silent mesh sent {quiet.numel} elements on {mesh}")
    one_d = peers.dtensor_1d(serial, peers.mlp_plans(False), x, grad, sequence_parallel=False, out_dim=None)
    rank = dist.get_rank()
    shard = nn.Sequential(nn.Linear(h, f // p), nn.GELU(), nn.Linear(f // p, h, bias=rank == 0)).to(device)
    out_1d = torch.empty_like(x)
    variants = {
        "optimus2d 2D (SUMMA)": optimus_step(mesh),
        "  compute alone (silent mesh)": compute_only,
        "  compute alone, activation kept": optimus_step(silent(mesh), recompute=False),
        "  its collectives alone": replay(counter.records, mesh),
        "DTensor 1D": lambda: one_d.backward(one_d.forward()),
        "  compute alone (its shard)": lambda: shard(x).backward(grad),
        "  its all-reduce alone": lambda: dist.all_reduce(out_1d),
    }
    elements = {"optimus2d 2D (SUMMA)": counter.numel, "DTensor 1D": x.numel()}
    times = {name: [] for name in variants}
    timer = compare.Timer(device)
    for step in variants.values():  # warm-up
        step()
    for n in range(args.rounds):
        for name, step in variants.items():
            dist.barrier()
            timer.start()
            step()
            times[name].append(timer.stop())
        compare.progress("breakdown", n + 1, args.rounds)
    ms = {name: statistics.median(t) for name, t in times.items()}
    kernels = {}  # on rank 0 alone, the others waiting: one rank's kernels without sharing cores
    if world.rank == 0:
        compute_steps = {"optimus2d 2D (SUMMA)": compute_only, "DTensor 1D": variants["  compute alone (its shard)"]}
        kernels = profile_kernels(compute_steps)
    dist.barrier()
    rows = []
    for peer, compute, alone in (
        ("optimus2d 2D (SUMMA)", "  compute alone (silent mesh)", "  its collectives alone"),
        ("DTensor 1D", "  compute alone (its shard)", "  its all-reduce alone"),
    ):
        exposed = ms[peer] - ms[compute]
        rows.append(
            {
                "peer": peer.strip(),
                "step_ms": ms[peer],
                "compute_ms": ms[compute],
                "exposed_ms": exposed,
                "comm_alone_ms": ms[alone],
                "elements": elements[peer],
                "exposed_ms_per_mib": exposed / (elements[peer] * x.element_size() / 2**20),
            }
        )
    if world.rank == 0:
        print(f"\n{compare.title(f'MLP {h}→{f}→{h}: where the step goes', args, mesh)}")
        for name, value in ms.items():
            print(f"{name:<32}{value:>9.1f} ms")
        for r in rows:
            print(
                f"{r['peer']}: exposed communication {r['exposed_ms']:.1f} ms for {r['elements']:,} elements "
                f"({r['exposed_ms_per_mib']:.2f} ms/MiB; alone {r['comm_alone_ms']:.1f} ms)"
            )
        print(f"2D moves {rows[0]['elements'] / rows[1]['elements']:.1f}× 1D's elements a rank")
        print("compute alone by kernel on rank 0 alone, ms a step (self CPU time, torch.profiler):")
        for op in kernels["DTensor 1D"]:
            cells = "".join(f"{kernels[peer].get(op, 0.0):>9.2f}" for peer in kernels)
            print(f"  {op:<30}{cells}   ({' / '.join(kernels)})")
    result = {"config": vars(args), "ranks": p, "mesh": [mesh.q, mesh.depth], "times_ms": ms, "rows": rows}
    result["compute_kernels_ms"] = kernels
    return result | {
        "elements_formula": mlp_2d_elements(x.numel() // h, h, f, mesh.q, input_grad=False, algorithm="summa")
    }


MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::matmul")


def profile_kernels(steps: dict, repeats: int = 5, top: int = 6) -> dict[str, dict[str, float]]:
    """ms a step of each step's kernels (self CPU time under torch.profiler, the median over
    ``repeats`` steps profiled one by one, interleaved): "matmuls" together, the ``top`` other
    kernels of each step (for every step, side by side), "rest" (every other op and frame:
    autograd, Python) and "total"."""
    from torch.profiler import ProfilerActivity, profile

    samples: dict[str, list[dict[str, float]]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            samples[name].append({e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()})
    profiles = {
        name: {op: statistics.median(s.get(op, 0.0) for s in found) for op in {op for s in found for op in s}}
        for name, found in samples.items()
    }
    listed: list[str] = []
    for ops in profiles.values():
        kernels = sorted((op for op in ops if op.startswith("aten::") and op not in MATMULS), key=lambda op: -ops[op])
        listed += [op for op in kernels[:top] if op not in listed]
    found = {}
    for name, ops in profiles.items():
        row = {"matmuls": sum(ms for op, ms in ops.items() if op in MATMULS)} | {op: ops.get(op, 0.0) for op in listed}
        total = sum(ops.values())  # a sum of medians: the parts add up to it
        found[name] = row | {"rest": total - sum(row.values()), "total": total}
    return found
