"""The cost of the agreement checks: one step on meshes built with check "off", "entry", "every".

    mpiexec -n 4 python -m benchmarks checks                 # MLP 1024→4096→1024, 8 × 128: the issue's
    mpiexec -n 4 python -m benchmarks checks --model llama   # transformers' LLaMA as in ``gpt --model llama``

Each step is what a training step does with the input: ``scatter`` (``scatter_batch`` of the
token ids for LLaMA) of the full batch, checksummed at "entry"; the forward, whose outermost
optimus2d modules agree on their inputs unless those come unchanged from another optimus2d module
(for LLaMA: each layer's two norms and the products after attention and after the gate); the
backward (and LLaMA's ``cross_entropy``). Three meshes of the same shape over the same ranks,
interleaved rounds, "off" first and again last (their difference is the spread that the order
within a round gives); each checked against serial first. Reported: median fwd+bwd and forward
times, their ratio to "off", and the agreement exchanges of one step.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from torch import nn

import optimus2d
from benchmarks import compare
from benchmarks.compare import Peer

LEVELS = ("off", "entry", "every", "off")  # "off" twice, first and last: the spread of the rounds' order


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=("mlp", "llama"), default="mlp")
    parser.add_argument("--hidden", type=int, default=None, help="default: 1024 (mlp), 256 (llama)")
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    compare.add_run_arguments(parser)


def _llama_peer(level: str, serial: nn.Module, mesh: optimus2d.Mesh, ids: torch.Tensor) -> Peer:
    checked = optimus2d.Mesh(mesh.q, mesh.depth, transport=mesh.transport, check=level)
    model = optimus2d.parallelize(copy.deepcopy(serial), checked)

    def loss():
        local = optimus2d.scatter_batch(ids, checked)
        logits = model(input_ids=local, use_cache=False).logits
        return optimus2d.cross_entropy(logits[:, :-1], local[:, 1:], checked)

    return Peer(f"check={level}", model, loss, lambda out: out.backward(), lambda out: out)


def _peer(level: str, serial: nn.Module, mesh: optimus2d.Mesh, x: torch.Tensor, grad: torch.Tensor) -> Peer:
    checked = optimus2d.Mesh(mesh.q, mesh.depth, transport=mesh.transport, check=level)
    model = optimus2d.layers.MLP2D.from_serial(copy.deepcopy(serial), checked)
    grad_local = optimus2d.scatter(grad, checked, check=False)
    return Peer(
        f"check={level}",
        model,
        lambda: model(optimus2d.scatter(x, checked)),
        lambda out: out.backward(grad_local),
        lambda out: optimus2d.gather(out, checked),
    )


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    device, dtype = mesh.device, compare.dtype(args)
    torch.manual_seed(0)
    if args.model == "llama":
        from benchmarks import gpt

        args.hidden = args.hidden or 256
        serial = gpt._model(args).to(device, dtype)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        with torch.no_grad():
            reference = gpt._serial_loss(serial, ids)
        peers = [_llama_peer(level, serial, mesh, ids) for level in LEVELS]
        what = f"LLaMA {args.layers}×{args.hidden}, vocab {args.vocab}"
    else:
        h = args.hidden = args.hidden or 1024
        serial = nn.Sequential(nn.Linear(h, args.ffn), nn.GELU(), nn.Linear(args.ffn, h)).to(device, dtype)
        x = torch.randn(args.batch, args.seq, h, device=device, dtype=dtype)
        with torch.no_grad():
            reference = serial(x)
        grad = torch.randn_like(reference)
        peers = [_peer(level, serial, mesh, x, grad) for level in LEVELS]
        what = f"MLP {h}→{args.ffn}→{h}"
    peers[-1].name += " again"
    compare.check(peers, reference, tol=1e-5 if args.model == "llama" else None)
    exchanges = {}
    for peer in peers:
        with optimus2d.count_comm() as counter:
            peer.backward(peer.forward())
        peer.model.zero_grad(set_to_none=True)
        exchanges[peer.name] = (len(counter.checks), sum(r.bytes for r in counter.checks))
    compare.time_rounds(peers, args.rounds, device, "checks")
    base = statistics.median(peers[0].train_ms)
    rows = []
    for peer in peers:
        train, infer = statistics.median(peer.train_ms), statistics.median(peer.infer_ms)
        n, nbytes = exchanges[peer.name]
        rows.append(
            {
                "peer": peer.name,
                "train_ms": train,
                "infer_ms": infer,
                "ratio": train / base,
                "check_exchanges": n,
                "check_bytes": nbytes,
            }
        )
    if world.rank == 0:
        print(f"{what}, batch {args.batch} × {args.seq}, {mesh}, {args.rounds} rounds")
        print(f"{'':<14}{'fwd+bwd ms':>12}{'÷ off':>8}{'fwd ms':>10}{'exchanges':>11}{'bytes':>8}")
        for r in rows:
            print(
                f"{r['peer']:<14}{r['train_ms']:>12.1f}{r['ratio']:>8.3f}{r['infer_ms']:>10.1f}"
                f"{r['check_exchanges']:>11}{r['check_bytes']:>8}"
            )
    return {"what": f"agreement checks, {what}", "mesh": repr(mesh), "rows": rows}
