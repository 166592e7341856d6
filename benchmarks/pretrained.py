"""Pretrained weights block by block: a rank's peak resident memory and time in ``load_pretrained``.

    mpiexec -n 4 python -m benchmarks pretrained             # LLaMA 4 × 1024, ffn 2816, vocab 16000: 317 MB fp32
    mpiexec -n 4 python -m benchmarks pretrained --init cpu  # convert a model built on the CPU (blocks allocated)

Rank 0 writes the serial model with transformers' ``save_pretrained`` (one safetensors file, or
shards: ``--shard``). Every rank then builds the model on the meta device, converts it (no tensor
allocated) and runs ``load_pretrained``: its blocks are allocated and read, a slice per block.
``--init cpu``: the converted model's blocks exist (random) before the load, which overwrites them.

Memory: Linux's peak resident set (``VmHWM`` of /proc/self/status), reset just before the measured
call by writing 5 to /proc/self/clear_refs (so it starts at the current ``VmRSS``); reported as the
peak's rise over that start. It counts the file pages a rank maps and touches through safetensors'
mmap (``RssFile``, shared with the page cache) as well as its own allocations. Compared with the
bytes of the rank's blocks and with ``LlamaForCausalLM.from_pretrained`` in one process (rank 0,
alone, the others waiting), measured the same way; then ``save_pretrained`` of the converted model
(every rank all-gathers one serial tensor at a time, rank 0 writes it) beside transformers' own.
Times are wall clock; the ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

import optimus2d

MB = 1e6


def llama_arguments(parser: argparse.ArgumentParser) -> None:
    """The LLaMA's size (``_config``): 4 × 1024, ffn 2816, 16 heads (8 for k and v), vocabulary 16000."""
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    llama_arguments(parser)
    parser.add_argument("--shard", default="5GB", help="max_shard_size of the checkpoint written")
    parser.add_argument("--init", choices=("meta", "cpu"), default="meta")
    parser.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")


def _config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )


def _status(field: str) -> int:
    """A ``/proc/self/status`` field (kB there) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux ≥ 4.0)


def _measured(fn) -> dict:
    """Wall time and the rise of the peak resident set over its start, around ``fn()``."""
    gc.collect()
    _reset_peak()
    start_rss = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "start_rss": start_rss, "peak_rise": _status("VmHWM") - start_rss}


def _touch(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.sum()


def _blocks_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    import transformers

    config = _config(args)
    box = [args.dir or (tempfile.mkdtemp(prefix="optimus2d-pretrained-") if world.rank == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    source, ours = os.path.join(root, "hf"), os.path.join(root, "ours")
    serial_bytes = None
    if world.rank == 0:
        torch.manual_seed(0)
        serial = transformers.LlamaForCausalLM(config)
        serial_bytes = _blocks_bytes(serial)
        serial.save_pretrained(source, max_shard_size=args.shard)
        del serial
    dist.barrier()

    torch.manual_seed(1)
    with torch.device("meta" if args.init == "meta" else "cpu"):
        model = transformers.LlamaForCausalLM(config)
    model = optimus2d.parallelize(model, mesh)
    dist.barrier()
    load = _measured(lambda: optimus2d.load_pretrained(model, source))
    blocks = _blocks_bytes(model)
    dist.barrier()
    save = _measured(lambda: optimus2d.save_pretrained(model, ours, max_shard_size=args.shard))
    dist.barrier()

    alone = optimus2d.Mesh(1, ranks=[0])  # collective: every rank builds it; rank 0 alone uses it
    reference = {}
    if world.rank == 0:  # the others wait: one process alone on the machine
        with torch.device("meta" if args.init == "meta" else "cpu"):
            whole = transformers.LlamaForCausalLM(config)
        whole = optimus2d.parallelize(whole, alone)
        reference["mesh1"] = _measured(lambda: optimus2d.load_pretrained(whole, source))
        del whole
        holder = {}
        hf = transformers.LlamaForCausalLM
        reference["lazy"] = _measured(lambda: holder.setdefault("m", hf.from_pretrained(source)))
        holder.clear()  # its weights are views of the mapped file, read when first used: read them all
        reference["load"] = _measured(lambda: _touch(holder.setdefault("m", hf.from_pretrained(source))))
        again = os.path.join(root, "hf-again")
        reference["save"] = _measured(lambda: holder["m"].save_pretrained(again, max_shard_size=args.shard))
        check = transformers.LlamaForCausalLM.from_pretrained(ours)  # our save reads back as transformers'
        for key, value in holder["m"].state_dict().items():
            assert torch.equal(check.state_dict()[key], value), key
        del holder, check
    dist.barrier()
    per_rank = [None] * world.size
    dist.all_gather_object(per_rank, {"rank": world.rank, "blocks": blocks, "load": load, "save": save})
    if world.rank == 0 and not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    if world.rank != 0:
        return None
    return _report(args, mesh, serial_bytes, per_rank, reference)


def _report(args, mesh, serial_bytes: int, per_rank: list[dict], reference: dict) -> dict:
    print(
        f"LLaMA {args.layers} × {args.hidden} (ffn {args.ffn}, vocab {args.vocab}, "
        f"heads {args.heads}/{args.kv_heads}), "
        f"fp32: {serial_bytes / MB:.0f} MB; {mesh.size} ranks as Mesh(q={mesh.q}, depth={mesh.depth}), "
        f"model built on {args.init}; peak = rise of VmHWM over VmRSS at the call"
    )
    print("{:<42}{:>10}{:>14}{:>10}{:>10}".format("", "blocks MB", "peak rise MB", "÷ blocks", "seconds"))
    rows = []
    for r in per_rank:
        for what in ("load", "save"):
            m = r[what]
            name = f"rank {r['rank']}: {'load_pretrained' if what == 'load' else 'save_pretrained'}"
            rows.append({"what": name, "rank": r["rank"], "blocks_bytes": r["blocks"], **m})
    for name, what in (
        ("load_pretrained on Mesh(1)", "mesh1"),
        ("from_pretrained (lazy)", "lazy"),
        ("from_pretrained, weights read", "load"),
        ("save_pretrained", "save"),
    ):
        rows.append({"what": f"1 process: {name}", "rank": None, "blocks_bytes": serial_bytes, **reference[what]})
    for row in sorted(rows, key=lambda r: ("save_" in r["what"], r["rank"] is None, r["rank"] or 0)):
        ratio = row["peak_rise"] / row["blocks_bytes"]
        print(
            f"{row['what']:<42}{row['blocks_bytes'] / MB:>10.1f}{row['peak_rise'] / MB:>14.1f}"
            f"{ratio:>10.2f}{row['seconds']:>10.2f}"
        )
    loads = [r["load"]["seconds"] for r in per_rank]
    print(
        f"load_pretrained on {mesh.size} ranks: {max(loads):.2f} s (slowest rank) vs from_pretrained "
        f"{reference['load']['seconds']:.2f} s in one process, weights read ({reference['lazy']['seconds']:.2f} s lazy)"
    )
    return {
        "model": {
            "hidden": args.hidden,
            "ffn": args.ffn,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
            "serial_bytes": serial_bytes,
            "shard": args.shard,
            "init": args.init,
        },
        "mesh": {"q": mesh.q, "depth": mesh.depth},
        "from_pretrained": "transformers maps the file; 'lazy': weights unread, 'weights read': each summed once",
        "memory": "rise of VmHWM (/proc/self/status) over VmRSS, peak reset by /proc/self/clear_refs = 5",
        "rows": rows,
    }
