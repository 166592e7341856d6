"""torch.compile of a converted LLaMA: its graphs and graph breaks, and its step time against eager.

    mpiexec -n 4 python -m benchmarks compile                               # MPI carries the mesh
    OPTIMUS2D_TRANSPORT=torch mpiexec -n 4 python -m benchmarks compile     # gloo carries it
    mpiexec -n 4 python -m benchmarks compile --backend aot_eager           # traced, no code generated

transformers' ``LlamaForCausalLM`` as in ``gpt --model llama`` (4 layers, h=256, 8 heads, vocab
1024, batch 8 × 128), ``optimus2d.parallelize``d twice from the same weights: one run eagerly, one
through ``torch.compile``. Counted on the first compiled training step (a backend that counts the
graphs it is given, and dynamo's own count of graph breaks with their reasons); checked against
eager (logits and loss); then interleaved rounds of a training step (fwd + ``cross_entropy`` +
bwd) and of a forward under no_grad. Reported: graphs, breaks, median step times and the
compiled ÷ eager ratio, under the transport the mesh runs on (``--name`` defaults to
``compile-<transport>``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

import optimus2d
from benchmarks import compare
from benchmarks.compare import Peer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    compare.add_run_arguments(parser)


class _Counting:
    """A torch.compile backend that counts the graphs it is given and hands them to ``backend``."""

    def __init__(self, backend: str) -> None:
        self.graphs, self.backend = 0, torch._dynamo.lookup_backend(backend)

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


def _peer(name: str, model, call, ids: torch.Tensor, mesh: optimus2d.Mesh) -> Peer:
    def forward():
        local = optimus2d.scatter_batch(ids, mesh)
        logits = call(input_ids=local, use_cache=False).logits
        return optimus2d.cross_entropy(logits[:, :-1], local[:, 1:], mesh)

    return Peer(name, model, forward, lambda loss: loss.backward(), lambda loss: loss)


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    from benchmarks import gpt

    args.model, device, dtype = "llama", mesh.device, compare.dtype(args)
    args.name = args.name or f"compile-{mesh.transport}"
    torch.manual_seed(0)
    serial = gpt._model(args).to(device, dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    eager_model = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    model = optimus2d.parallelize(copy.deepcopy(serial), mesh)
    counting = _Counting(args.backend)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend=counting)
    eager = _peer("eager", eager_model, eager_model, ids, mesh)
    peer = _peer(f"compiled ({args.backend})", model, compiled, ids, mesh)

    start = time.perf_counter()
    loss = peer.forward()  # the first training step compiles forward and backward
    peer.backward(loss)
    compile_s = time.perf_counter() - start
    graphs = counting.graphs
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    with torch.no_grad():  # the no_grad forward compiles its own graphs, outside the timed rounds
        peer.forward()
    reference = eager.forward().detach()
    compare.check([peer], reference, tol=1e-5)
    for p in (eager, peer):
        p.model.zero_grad(set_to_none=True)
    compare.time_rounds([eager, peer], args.rounds, device, "compile")

    rows = [
        {"peer": p.name, "train_ms": statistics.median(p.train_ms), "infer_ms": statistics.median(p.infer_ms)}
        for p in (eager, peer)
    ]
    ratio = rows[1]["train_ms"] / rows[0]["train_ms"]
    infer_ratio = rows[1]["infer_ms"] / rows[0]["infer_ms"]
    totals = torch.tensor([compile_s], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    result = {
        "what": f"torch.compile of LLaMA {args.layers}×{args.hidden}, vocab {args.vocab}",
        "mesh": repr(mesh),
        "transport": mesh.transport,
        "backend": args.backend,
        "batch": args.batch,
        "seq": args.seq,
        "graphs": graphs,
        "graph_breaks": sum(breaks.values()),
        "break_reasons": breaks,
        "compile_s": totals.item(),
        "rows": rows,
        "train_ratio": ratio,
        "infer_ratio": infer_ratio,
    }
    if world.rank == 0:
        print(f"{result['what']}, batch {args.batch} × {args.seq}, {mesh}, {args.backend}, {args.rounds} rounds")
        print(f"graphs {graphs}, graph breaks {result['graph_breaks']}, first compiled step {totals.item():.1f} s")
        for reason, n in breaks.items():
            print(f"  {n} × {reason.splitlines()[0][:110]}")
        print(f"{'':<24}{'fwd+bwd ms':>12}{'fwd ms':>10}")
        for r in rows:
            print(f"{r['peer']:<24}{r['train_ms']:>12.1f}{r['infer_ms']:>10.1f}")
        print(f"compiled ÷ eager: {ratio:.3f} (fwd+bwd), {infer_ratio:.3f} (fwd)")
    return result
