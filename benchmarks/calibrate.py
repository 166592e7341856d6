"""Calibrate the cost model on this machine, then check its predicted times against measured ones.

    mpiexec -n 4 python -m benchmarks calibrate

1. Measures, with every rank busy at once (as in a real step, so sharing of cores and links is
   in the figures): the compute rate of one rank on its share of the MLP, the bandwidth of an
   exchange of 4 MiB with another rank and of an all-reduce of 16 MiB over the mesh (``Hardware.
   reduce_bandwidth``: what a replicated module's gradients meet), and the latency of a wait for a
   partner between two pieces of work (what a sync point costs when ranks share cores).
2. Builds ``optimus2d.cost.planner.Hardware`` from them and predicts the fwd+bwd time of MLPs under
   optimus2d (as it chooses, and SUMMA only) and Megatron 1D (compute + communication, no overlap).
3. Measures the same MLPs (``benchmarks.compare``, interleaved rounds) and prints predicted against
   measured; the issue asks for |predicted / measured − 1| ≤ 25 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

import optimus2d
from benchmarks import compare, peers
from optimus2d.comm import primitives as P
from optimus2d.cost import calibration
from optimus2d.cost.planner import Hardware, comm_time, mlp_comm, mlp_flops


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 8], help="batches of --seq tokens")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        timer = compare.Timer(device)
        timer.start()
        fn()
        times.append(timer.stop())
    return statistics.median(times)


def measure_hardware(
    mesh: optimus2d.Mesh, device: torch.device, args: argparse.Namespace, repeats: int, rows: int
) -> Hardware:
    """Compute rate and point-to-point link of one rank while all ranks do the same.

    The rate is that of a 1/p share of the MLP (h → f/p → h, fwd+bwd on ``rows`` rows, GELU included),
    the kernels the steps run, at the slowest rank; the link that of exchanges of 64 bytes and
    4 MiB with another rank between matmuls, and all-reduces of 16 MiB over the mesh between them.
    """
    h, f = args.hidden, args.ffn
    share = nn.Sequential(nn.Linear(h, f // mesh.size), nn.GELU(), nn.Linear(f // mesh.size, h)).to(device)
    x = torch.randn(rows, h, device=device)
    flops = mlp_flops(rows, h, f // mesh.size) / (_median_ms(lambda: share(x).sum().backward(), repeats, device) / 1e3)

    # the link as a step meets it: between two pieces of work, every rank busy. A step of the
    # loop is a matmul then an exchange; beyond the matmuls alone, a 64-byte exchange costs the
    # latency (a wait for a partner) and a 4 MiB one the latency and 4 MiB over the bandwidth
    small, n = (torch.randn(16, device=device), torch.empty(16, device=device)), 1024 * 1024
    big = (torch.randn(n, device=device), torch.empty(n, device=device))
    a, b = torch.randn(256, 1024, device=device), torch.randn(1024, 1024, device=device)
    steps = 20
    alone = _median_ms(lambda: [a @ b for _ in range(steps)], repeats, device)
    synced = _median_ms(lambda: [(a @ b, compare.exchange(mesh, *small)) for _ in range(steps)], repeats, device)
    loaded = _median_ms(lambda: [(a @ b, compare.exchange(mesh, *big)) for _ in range(steps)], repeats, device)
    t_big = max(loaded - synced, 0.0) / 1e3 / steps
    # and an all-reduce over the mesh of a weight gradient's size (16 MiB) between the same matmuls, as
    # a replicated module's gradients meet it: it adds and copies what it receives as well as moving it
    grads = torch.zeros(4 * n, device=device)
    reduced = _median_ms(lambda: [(a @ b, P.all_reduce(grads, mesh, "mesh")) for _ in range(steps)], repeats, device)
    t_reduce = max(reduced - synced, 0.0) / 1e3 / steps
    rates = torch.tensor(
        [t_big, (synced - alone) / 1e3 / steps, alone / 1e3 / steps, t_reduce], device=compare.collective_device()
    )
    dist.all_reduce(rates)  # the link: the mean over ranks
    t_big, latency, work, t_reduce = (rates / dist.get_world_size()).tolist()
    p = mesh.size
    # compute: the slowest rank's rate, as a step that syncs waits for it (ranks sharing cores
    # finish the same work up to a third apart; their mean rate would price the fastest)
    slowest = torch.tensor([flops], device=compare.collective_device())
    dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
    flops = slowest.item()
    bandwidth = 4 * n / max(t_big, 1e-9)
    return Hardware(
        flops=flops,
        bandwidth=bandwidth,
        latency=max(latency, 0.0),
        bytes_per_element=4,
        latency_work=work if shared_cores(device) else 0.0,
        # (no faster than a move: where noise says so, the move's)
        reduce_bandwidth=min(2 * (p - 1) / p * 4 * grads.numel() / max(t_reduce, 1e-9), bandwidth) if p > 1 else None,
    )


def with_torch_link(hw: Hardware, mesh: optimus2d.Mesh) -> Hardware:
    """``hw`` with ``torch_link``: torch's own process groups carry DTensor's collectives (the 1D
    linears), the mesh's transport (MPI) the rest. ``optimus2d.cost.calibration.hardware`` times
    the same all-reduces on both, nothing between them; what torch's takes beyond the mesh's (per
    byte, per stage) is added to ``hw``'s link, measured between pieces of work as a step meets it.
    ``hw`` itself where the mesh's transport is torch's already."""
    if mesh.transport == "torch" or mesh.size == 1:
        return hw
    both = calibration.hardware(mesh, cache=False)
    bandwidth, latency = both.torch_link
    per_byte = 1 / hw.bandwidth + max(1 / bandwidth - 1 / both.bandwidth, 0.0)
    return dataclasses.replace(hw, torch_link=(1 / per_byte, hw.latency + max(latency - both.latency, 0.0)))


def shared_cores(device: torch.device) -> bool:
    """Whether the ranks compute on CPU cores they share (more ranks × threads on this host than
    cores): a sync point then costs more the more work came before it (``Hardware.latency_work``).
    The host's rank count from the launcher (MPICH, Open MPI, torchrun), else the world's."""
    if device.type != "cpu":
        return False
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    local = local or os.environ.get("LOCAL_WORLD_SIZE") or dist.get_world_size()
    return int(local) * torch.get_num_threads() > usable_cores()


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS tells it), else all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _scheme(mesh: optimus2d.Mesh) -> str:
    return "2d" if mesh.depth == 1 else f"2.5d:{mesh.depth}"


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    p, h, f, device = world.size, args.hidden, args.ffn, mesh.device
    groups = []
    for batch in args.batches:
        torch.manual_seed(0)
        serial = nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h)).to(device)
        x = torch.randn(batch, args.seq, h, device=device)
        with torch.no_grad():
            reference = serial(x)
        grad = torch.randn_like(reference)
        group = peers.optimus_twins(serial, mesh, x, grad)
        if p > 1:
            group.append(
                peers.dtensor_1d(serial, peers.mlp_plans(False), x, grad, sequence_parallel=False, out_dim=None)
            )
        compare.check(group, reference)
        groups.append((batch, group))
    # each peer's link is priced on its own transport: the mesh's, and gloo's (DTensor, "over gloo")
    links = {"mesh": mesh}
    if mesh.transport != "torch":
        links["gloo"] = optimus2d.Mesh(mesh.q, mesh.depth, transport="torch")
    # the machine's load drifts: measure it in every round, between the rounds of the workloads
    samples = {(link, batch): [] for link in links for batch in args.batches}
    for n in range(args.rounds):
        for batch, group in groups:
            for link, link_mesh in links.items():
                samples[link, batch].append(measure_hardware(link_mesh, device, args, 3, batch * args.seq))
            compare.time_rounds(group, 1, device, "")
        compare.progress("calibrate", n + 1, args.rounds)
    measured_hw = {
        key: Hardware(
            flops=statistics.median(s.flops for s in found),
            bandwidth=statistics.median(s.bandwidth for s in found),
            latency=statistics.median(s.latency for s in found),
            bytes_per_element=4,
            latency_work=statistics.median(s.latency_work for s in found),
            reduce_bandwidth=_median_of(s.reduce_bandwidth for s in found),
        )
        for key, found in samples.items()
    }
    hardware = {batch: measured_hw["mesh", batch] for batch in args.batches}
    gloo_hw = {batch: measured_hw[next(reversed(links)), batch] for batch in args.batches}
    rows_out = []
    for batch, group in groups:
        measured = compare.summarize(group, batch * args.seq, batch, 1.0)
        rows = batch * args.seq
        for peer, m in zip(group, measured, strict=True):
            hw = hardware[batch] if peer.name.startswith("optimus2d") and "gloo" not in peer.name else gloo_hw[batch]
            compute = mlp_flops(rows, h, f) / (p * hw.flops)
            if peer.name.startswith("optimus2d"):
                algorithm = "summa" if peer.name.endswith("SUMMA") else "auto"
                comm = comm_time(mlp_comm(rows, h, f, _scheme(mesh), p, algorithm=algorithm), hw, compute)
            else:
                comm = comm_time(mlp_comm(rows, h, f, "1d", p), hw, compute)
            predicted = 1e3 * (compute + comm)
            rows_out.append(
                {
                    "batch": batch,
                    "peer": peer.name,
                    "measured_ms": m["train_ms"],
                    "predicted_ms": predicted,
                    "compute_ms": 1e3 * compute,
                    "comm_ms": 1e3 * comm,
                    "error": predicted / m["train_ms"] - 1,
                }
            )
    if world.rank == 0:
        print(
            f"calibrated on {p} ranks, every rank busy at once: "
            + "; ".join(
                f"batch {b}: {hw.flops / 1e9:.1f} GFLOP/s a rank, {hw.bandwidth / 1e9:.2f} GB/s, "
                f"{hw.latency * 1e6:.0f} µs a sync point"
                + (f" after {hw.latency_work * 1e3:.1f} ms of work (× √(work / that))" if hw.latency_work else "")
                for b, hw in hardware.items()
            )
            + (f" (over {mesh.transport}; over gloo: " if mesh.transport != "torch" else "")
            + (
                "; ".join(
                    f"batch {b}: {hw.latency * 1e6:.0f} µs, {hw.bandwidth / 1e9:.2f} GB/s" for b, hw in gloo_hw.items()
                )
                + ")"
                if mesh.transport != "torch"
                else ""
            )
        )
        print(
            "{:>6}  {:<22}{:>12}{:>13}{:>11}{:>9}{:>8}".format(
                "batch", "peer", "measured ms", "predicted ms", "compute", "comm", "error"
            )
        )
        for r in rows_out:
            print(
                f"{r['batch']:>6}  {r['peer']:<22}{r['measured_ms']:>12.1f}{r['predicted_ms']:>13.1f}"
                f"{r['compute_ms']:>11.1f}{r['comm_ms']:>9.1f}{r['error']:>+8.0%}"
            )
        worst = max(abs(r["error"]) for r in rows_out)
        print(f"largest |error| {worst:.0%} ({'within' if worst <= 0.25 else 'outside'} the 25 % the issue asks)")
    return {
        "config": vars(args),
        "ranks": p,
        "mesh": [mesh.q, mesh.depth],
        "transport": mesh.transport,
        "hardware": {b: _fields(h) for b, h in hardware.items()},
        "hardware_gloo": {b: _fields(h) for b, h in gloo_hw.items()},
        "rows": rows_out,
    }


def _median_of(values) -> float | None:
    """The median of the values measured (None where none was: one rank)."""
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def _fields(hw: Hardware) -> dict:
    fields = {"flops": hw.flops, "bandwidth": hw.bandwidth, "latency": hw.latency, "latency_work": hw.latency_work}
    fields |= {"reduce_bandwidth": hw.reduce_bandwidth} if hw.reduce_bandwidth else {}
    return fields | ({"torch_link": list(hw.torch_link)} if hw.torch_link else {})
