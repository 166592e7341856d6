"""MLP h→4h→h: optimus2d 2D against DTensor 1D (with and without sequence parallelism), same run.

    mpiexec -n 4 python -m benchmarks mlp            # the issue's set-up: 1024→4096→1024, 8 × 128

Every peer runs on the same process group with the same weights and input, in interleaved
rounds; each peer's output is checked against the serial MLP before it is timed. Reported:
median fwd+bwd and forward-only time and their ratio to optimus2d, tokens/s, elements sent per
rank (optimus2d: counted, and its formula), activation and parameter bytes per rank, and the
largest batch whose activations and parameters (+ gradients) fit ``--cap-mib`` per rank.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import optimus2d
from optimus2d.cost import mlp_1d_elements, mlp_2d_elements
from optimus2d.memory import saved_activation_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cap-mib", type=float, default=256.0)


class _Peer:
    def __init__(self, name, model, make_input, gather_output):
        self.name, self.model, self.make_input, self.gather_output = name, model, make_input, gather_output
        self.train_times: list[float] = []
        self.infer_times: list[float] = []


def _dtensor_peer(serial, mesh1d, p, sequence_parallel: bool) -> _Peer:
    model = copy.deepcopy(serial)
    if sequence_parallel:
        plan = {"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(model, mesh1d, plan)
    rank = dist.get_rank()

    def make_input(x):
        if not sequence_parallel:
            return x
        s = x.shape[1] // p
        return x[:, rank * s : (rank + 1) * s].contiguous()

    def gather_output(y):
        if isinstance(y, DTensor):
            y = y.full_tensor()
        if sequence_parallel:
            parts = [torch.empty_like(y) for _ in range(p)]
            dist.all_gather(parts, y.contiguous())
            y = torch.cat(parts, 1)
        return y

    return _Peer("DTensor 1D + SP" if sequence_parallel else "DTensor 1D", model, make_input, gather_output)


def _act_bytes(model, x) -> int:
    def unwrap(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    params = {unwrap(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        t = unwrap(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def _param_bytes(model) -> int:
    return sum(
        (p._local_tensor if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
    )


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    p, h = world.size, args.hidden
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(h, args.ffn), nn.GELU(), nn.Linear(args.ffn, h))
    x = torch.randn(args.batch, args.seq, h)
    probe = torch.randn(args.batch, args.seq, h)
    reference = serial(x).detach()

    ours = _Peer(
        f"optimus2d {'2D' if mesh.depth == 1 else '2.5D'}",
        optimus2d.parallelize(copy.deepcopy(serial), mesh),
        lambda x: optimus2d.scatter(x, mesh),
        lambda y: optimus2d.gather(y, mesh),
    )
    summa_only = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    for layer in summa_only.modules():
        if isinstance(layer, optimus2d.Linear2D):
            layer.algorithm = "summa"
    mesh1d = init_device_mesh("cpu", (p,))
    one_d, one_d_sp = _dtensor_peer(serial, mesh1d, p, False), _dtensor_peer(serial, mesh1d, p, True)
    peers = [ours, one_d, one_d_sp]
    if mesh.q > 1:  # what the weight-stationary choice gains over SUMMA alone
        peers.insert(1, _Peer(f"{ours.name} SUMMA", summa_only, ours.make_input, ours.gather_output))
    if p == 1:  # the 1-rank overhead against plain torch
        peers.append(_Peer("plain torch", copy.deepcopy(serial), lambda x: x, lambda y: y))
    for peer in peers:  # every peer must be right before it is timed
        y = peer.gather_output(peer.model(peer.make_input(x)))
        err = ((y - reference).abs().max() / reference.abs().max()).item()
        if err > 1e-4:
            raise SystemExit(f"{peer.name}: output differs from serial by {err:.2e}")

    with optimus2d.count_comm() as counter:
        ours.model(ours.make_input(x)).backward(optimus2d.scatter(probe, mesh))
    rows = args.batch * args.seq

    for _ in range(args.rounds):  # interleaved rounds: noise hits every peer alike
        for peer in peers:
            xi = peer.make_input(x)
            gi = peer.make_input(probe) if peer.make_input is not ours.make_input else optimus2d.scatter(probe, mesh)
            dist.barrier()
            start = time.perf_counter()
            peer.model(xi).backward(gi)
            dist.barrier()
            peer.train_times.append(time.perf_counter() - start)
            peer.model.zero_grad(set_to_none=True)
            with torch.no_grad():
                dist.barrier()
                start = time.perf_counter()
                peer.model(xi)
                dist.barrier()
                peer.infer_times.append(time.perf_counter() - start)

    cap = args.cap_mib * 2**20
    results = []
    for peer in peers:
        xi = peer.make_input(x)
        act = _act_bytes(peer.model, xi)
        params = _param_bytes(peer.model)
        per_sample = act / args.batch
        largest = int(max(0.0, cap - 2 * params) // per_sample) if per_sample else 0
        results.append(
            {
                "peer": peer.name,
                "train_ms": 1e3 * statistics.median(peer.train_times),
                "infer_ms": 1e3 * statistics.median(peer.infer_times),
                "activation_bytes": act,
                "parameter_bytes": params,
                "largest_batch": largest,
            }
        )
    base = results[0]
    for r in results:
        r["train_vs_optimus2d"] = r["train_ms"] / base["train_ms"]
        r["infer_vs_optimus2d"] = r["infer_ms"] / base["infer_ms"]
        r["tokens_per_s"] = rows / (r["train_ms"] / 1e3)
    by_name = {r["peer"]: r for r in results}
    by_name[one_d.name]["elements_formula"] = mlp_1d_elements(rows, h, p)  # the input needs no gradient
    by_name[one_d_sp.name]["elements_formula"] = mlp_1d_elements(rows, h, p, sequence_parallel=True)
    base["elements_measured"] = counter.numel
    base["elements_formula"] = mlp_2d_elements(
        rows, h, args.ffn, mesh.q, mesh.depth, input_grad=False, on_diagonal=mesh.i == mesh.j
    )
    if mesh.q > 1:
        by_name[f"{ours.name} SUMMA"]["elements_formula"] = mlp_2d_elements(
            rows, h, args.ffn, mesh.q, mesh.depth, input_grad=False, algorithm="summa", on_diagonal=mesh.i == mesh.j
        )
    serial_act = saved_activation_bytes(serial, x)
    if world.rank == 0:
        _print(args, world, mesh, results, serial_act)
    return {
        "config": vars(args),
        "ranks": p,
        "mesh": [mesh.q, mesh.depth],
        "serial_activation_bytes": serial_act,
        "rows": results,
    }


def _print(args, world, mesh, results, serial_act) -> None:
    print(
        f"MLP {args.hidden}→{args.ffn}→{args.hidden}, batch {args.batch} × seq {args.seq}, {world.size} ranks "
        f"(optimus2d Mesh(q={mesh.q}, depth={mesh.depth})), median of {args.rounds} interleaved rounds"
    )
    head = ("peer", "fwd+bwd ms", "÷ ours", "fwd ms", "÷ ours", "tokens/s", "act B/rank", "÷ serial/p", "max batch")
    print("{:<22}{:>11}{:>8}{:>9}{:>8}{:>10}{:>13}{:>11}{:>10}".format(*head))
    for r in results:
        print(
            f"{r['peer']:<22}{r['train_ms']:>11.1f}{r['train_vs_optimus2d']:>8.2f}{r['infer_ms']:>9.1f}"
            f"{r['infer_vs_optimus2d']:>8.2f}{r['tokens_per_s']:>10.0f}{r['activation_bytes']:>13,}"
            f"{r['activation_bytes'] / (serial_act / world.size):>11.3f}{r['largest_batch']:>10}"
        )
    ours = results[0]
    print(f"elements sent by rank 0: optimus2d measured {ours['elements_measured']:,}; formulas:")
    print("  " + ", ".join(f"{r['peer']} {r['elements_formula']:,}" for r in results if "elements_formula" in r))
