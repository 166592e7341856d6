"""Peers measured in the same run: each checked against serial, then timed in interleaved rounds.

Every subcommand that times (``linear``, ``mlp``, ``block``, ``gpt``) builds a list of ``Peer``s on
the same process group, with the same weights and inputs, and hands it to ``compare``. Noise on
a shared machine hits every peer of a round alike, so the ratios of medians are what to read.
On GPUs the rounds are timed with CUDA events, on CPUs with ``time.perf_counter``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from optimus2d import Mesh


@dataclass
class Peer:
    """One implementation under test.

    ``forward()`` runs it on this rank's share of the batch and returns its output (or loss);
    ``backward(out)`` back-propagates from it; ``full_output(out)`` is the whole output, to check
    against serial. ``rank0_only``: a serial baseline that runs on rank 0 while the others wait.
    ``extra``: fields copied into its row of ``summarize`` (the layouts a planner picked).
    """

    name: str
    model: nn.Module
    forward: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    full_output: Callable[[torch.Tensor], torch.Tensor]
    rank0_only: bool = False
    train_ms: list[float] = field(default_factory=list)
    infer_ms: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def runs_here(self) -> bool:
        return not self.rank0_only or dist.get_rank() == 0


class Timer:
    """Milliseconds of the work between ``start()`` and ``stop()``: CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.begin = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.begin.elapsed_time(self.end)
        return 1e3 * (time.perf_counter() - self.begin)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# How far a peer's output may be from serial's, relative to its largest element: fp32 differs only
# in the order of its sums; bf16 keeps 8 bits of mantissa, and a split sum rounds at other places.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def add_run_arguments(parser: argparse.ArgumentParser, batch: int = 8, seq: int = 128) -> None:
    """The options every timed subcommand takes: the batch, the rounds, the memory cap and the
    dtype of the weights and activations (``bfloat16``: every peer, serial too, in bf16)."""
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cap-mib", type=float, default=256.0)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")


def dtype(args: argparse.Namespace) -> torch.dtype:
    """The ``--dtype`` of a timed subcommand (float32 for the ones that have none)."""
    return DTYPES[getattr(args, "dtype", "float32")]


def title(what: str, args: argparse.Namespace, mesh: Mesh) -> str:
    """The first line of a timed subcommand's table."""
    return (
        f"{what}, batch {args.batch} × seq {args.seq}, {mesh.size} ranks (optimus2d Mesh(q={mesh.q}, "
        f"depth={mesh.depth})), median of {args.rounds} interleaved rounds"
    )


def result(args: argparse.Namespace, mesh: Mesh, serial_act: int, rows: list[dict]) -> dict:
    """What a timed subcommand writes as JSON (and ``report`` reads)."""
    return {
        "config": vars(args),
        "ranks": mesh.size,
        "mesh": [mesh.q, mesh.depth],
        "serial_activation_bytes": serial_act,
        "rows": rows,
    }


def exchange(mesh: Mesh, send: torch.Tensor, recv: torch.Tensor) -> None:
    """Swap ``send`` for the partner's into ``recv``: member n and member size−1−n of the mesh, over
    the mesh's transport (the middle rank of an odd mesh keeps its own)."""
    from optimus2d.comm import primitives as P

    me = mesh.index("mesh") if mesh.size > 1 else 0
    partner = mesh.size - 1 - me
    if partner != me:
        for handle in (P.isend(send, mesh, "mesh", partner), P.irecv(recv, mesh, "mesh", partner)):
            handle.wait()


def collective_device() -> torch.device:
    """Where tensors for the default group's collectives live: the current GPU under NCCL."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def progress(label: str, done: int, total: int) -> None:
    """A one-line progress bar on rank 0's stderr."""
    if dist.get_rank() != 0:
        return
    width = 30
    filled = width * done // total
    end = "\n" if done == total else ""
    print(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end, file=sys.stderr, flush=True)


def check(peers: list[Peer], reference: torch.Tensor, tol: float | None = None) -> None:
    """Every peer's output against serial; all ranks stop together if one differs.

    ``tol``: the largest error relative to serial's largest element (default by the reference's
    dtype, ``TOLERANCE``)."""
    tol = TOLERANCE.get(reference.dtype, TOLERANCE[torch.bfloat16]) if tol is None else tol
    errors = torch.zeros(len(peers), device=collective_device())
    for n, peer in enumerate(peers):
        if peer.runs_here():
            full = peer.full_output(peer.forward()).detach().float()
            errors[n] = ((full - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-30)).item()
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    bad = [f"{p.name}: {e:.2e}" for p, e in zip(peers, errors.tolist(), strict=True) if e > tol]
    if bad:
        raise SystemExit("output differs from serial: " + "; ".join(bad))


def time_rounds(peers: list[Peer], rounds: int, device: torch.device, label: str) -> None:
    """Interleaved rounds: fwd+bwd, then forward under no_grad, for every peer in turn, each round
    starting one peer later (the peer after a rank-0-only one met colder caches: 1–2 % slower,
    measured with the peers of ``gpt`` in both orders)."""
    timer = Timer(device)
    for peer in peers:  # one warm-up step each, the first time
        if peer.runs_here() and not peer.train_ms:
            peer.backward(peer.forward())
            peer.model.zero_grad(set_to_none=True)
    for n in range(rounds):
        start = n % len(peers)
        for peer in peers[start:] + peers[:start]:
            for training in (True, False):
                dist.barrier()
                if peer.runs_here():
                    timer.start()
                    with torch.set_grad_enabled(training):
                        out = peer.forward()
                        if training:
                            peer.backward(out)
                    (peer.train_ms if training else peer.infer_ms).append(timer.stop())
                dist.barrier()
            peer.model.zero_grad(set_to_none=True)
        if label:
            progress(label, n + 1, rounds)


def saved_bytes(peer: Peer) -> int:
    """Bytes autograd saves for backward in one forward (parameters excluded), as allocated."""

    def unwrap(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    params = {unwrap(p).untyped_storage().data_ptr() for p in peer.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        t = unwrap(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.device.type != "meta":
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        peer.forward()
    return sum(seen.values())


def peak_step_bytes(peer: Peer) -> int | None:
    """Bytes the CUDA allocator held at the peak of one fwd+bwd step beyond what it held before
    (activations, gradients, temporaries): the allocator's own count beside ``saved_bytes``.
    None off a GPU, where no allocator keeps such a count."""
    device = next(peer.model.parameters()).device
    if device.type != "cuda" or not peer.runs_here():
        return None
    peer.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    peer.backward(peer.forward())
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    peer.model.zero_grad(set_to_none=True)
    return peak


def parameter_bytes(model: nn.Module) -> int:
    return sum((p._local_tensor if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def summarize(peers: list[Peer], tokens: int, batch: int, cap_mib: float, flops: float | None = None) -> list[dict]:
    """Medians, ratios to the first peer, tokens/s, bytes per rank and the largest batch under the cap.

    The largest batch: activations scale with the batch; parameters, their gradients and two
    Adam moments (4 × parameter bytes) are fixed. ``flops``: the step's matmul flops (all ranks
    together), for the TFLOP/s each rank sustains (a rank-0-only peer does them all alone).
    """
    rows = []
    for peer in peers:
        times = torch.tensor(
            [statistics.median(peer.train_ms), statistics.median(peer.infer_ms)] if peer.runs_here() else [0.0, 0.0],
            device=collective_device(),
        )
        dist.broadcast(times, src=0)  # rank 0 runs every peer: its figures are the report
        act = saved_bytes(peer) if peer.runs_here() else 0
        params = parameter_bytes(peer.model)
        per_sample = act / batch
        largest = int(max(0.0, cap_mib * 2**20 - 4 * params) // per_sample) if per_sample else 0
        train, infer = times.tolist()
        rows.append(
            {
                "peer": peer.name,
                "train_ms": train,
                "infer_ms": infer,
                "tokens_per_s": tokens / (train / 1e3),
                "tflops_per_rank": (
                    flops / (1 if peer.rank0_only else dist.get_world_size()) / (train / 1e3) / 1e12 if flops else None
                ),
                "activation_bytes": act,
                "peak_step_bytes": peak_step_bytes(peer),
                "parameter_bytes": params,
                "largest_batch": largest,
                **peer.extra,
            }
        )
    for r in rows:
        r["train_vs_first"] = r["train_ms"] / rows[0]["train_ms"]
        r["infer_vs_first"] = r["infer_ms"] / rows[0]["infer_ms"]
    return rows


def print_table(title: str, rows: list[dict], serial_act: int, p: int) -> None:
    print(title)
    peaks = [r for r in rows if r.get("peak_step_bytes")]
    if peaks:  # on a GPU: the allocator's peak of a step, beside the saved bytes of the table below
        print(
            "peak of a fwd+bwd step, CUDA allocator: "
            + ", ".join(f"{r['peer']} {r['peak_step_bytes'] / 2**20:,.0f} MiB" for r in peaks)
        )
    head = ("peer", "fwd+bwd ms", "÷ ours", "fwd ms", "÷ ours", "tokens/s", "TFLOP/s", "act B/rank", "÷ serial/p")
    print("{:<24}{:>11}{:>8}{:>9}{:>8}{:>10}{:>9}{:>13}{:>11}{:>10}".format(*head, "max batch"))
    for r in rows:
        tflops = f"{r['tflops_per_rank']:.3f}" if r.get("tflops_per_rank") else "—"
        print(
            f"{r['peer']:<24}{r['train_ms']:>11.1f}{r['train_vs_first']:>8.2f}{r['infer_ms']:>9.1f}"
            f"{r['infer_vs_first']:>8.2f}{r['tokens_per_s']:>10.0f}{tflops:>9}{r['activation_bytes']:>13,}"
            f"{r['activation_bytes'] / (serial_act / p):>11.3f}{r['largest_batch']:>10}"
        )
