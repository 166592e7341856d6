"""Checkpoints: how long training waits for one, saved three ways in the same run, and what it stores.

    mpiexec -n 4 python -m benchmarks checkpoint              # LLaMA 4 × 1024, ffn 2816, vocab 16000, AdamW
    mpiexec -n 4 python -m benchmarks checkpoint --rounds 5

A converted LLaMA after one AdamW step (so the optimizer has its moments), then in rotated order
each round: torch's own ``dcp.save`` of ``get_state_dict`` (no commit, no checksums),
``optimus2d.checkpoint.save`` (the same files, a manifest, an atomic commit), and
``optimus2d.checkpoint.async_save``: the time until it returns (what training waits for), then
until its ``Future`` is done. Training steps are timed alone and while an async save is in flight
(on shared cores the background write takes CPU from the step). Bytes: the tensor data DCP's
metadata lists, against the serial model's parameters and AdamW's two moments (exact), and the
files' sizes. Wall times are medians over rounds, rank 0's; the ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

import optimus2d
from benchmarks.pretrained import _config, llama_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    llama_arguments(parser)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (divisible by depth·q)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _stored_bytes(path: str) -> tuple[int, int]:
    """(bytes of tensor data DCP's metadata lists, bytes of the files)."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    data = sum(
        m.size.numel() * m.properties.dtype.itemsize for m in meta.values() if isinstance(m, TensorStorageMetadata)
    )
    files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return data, files


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    import transformers

    torch.manual_seed(0)
    serial = transformers.LlamaForCausalLM(_config(args))
    serial_params = sum(p.numel() * p.element_size() for p in serial.parameters())
    steps = 4 * len(list(serial.parameters()))  # AdamW's step: one float32 scalar per parameter
    model = optimus2d.parallelize(serial, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    rows = optimus2d.scatter_batch(ids, mesh)

    def step() -> None:
        model(input_ids=rows, labels=rows).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    box = [args.dir or (tempfile.mkdtemp(prefix="optimus2d-ckpt-bench-") if world.rank == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    root = box[0]

    def torch_dcp() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "dcp"))

    ways = {
        "dcp.save(get_state_dict)": torch_dcp,
        "checkpoint.save": lambda: optimus2d.checkpoint.save(os.path.join(root, "sync"), model, opt),
        "checkpoint.async_save": lambda: optimus2d.checkpoint.async_save(os.path.join(root, "async"), model, opt),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    done_s, step_s, step_during_s = [], [], []
    for n in range(args.rounds):
        names = list(ways)[n % len(ways) :] + list(ways)[: n % len(ways)]
        for name in names:
            seconds, out = _timed(ways[name])
            times[name].append(seconds)
            if name == "checkpoint.async_save":
                start = time.perf_counter() - seconds
                step_during_s.append(_timed(step)[0])  # a step while the write runs behind
                out.result()
                done_s.append(time.perf_counter() - start)
        step_s.append(_timed(step)[0])
    dist.barrier()
    if world.rank != 0:  # rank 0 alone reads the files, then removes them
        return None
    data, files = _stored_bytes(os.path.join(root, "sync"))
    moments = 2 * serial_params  # AdamW's exp_avg and exp_avg_sq, fp32 as the parameters
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    rows_out = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "mesh": f"{mesh.depth}x{mesh.q}x{mesh.q}",
        "blocking_s": rows_out,
        "async_done_s": statistics.median(done_s),
        "step_s": statistics.median(step_s),
        "step_during_async_s": statistics.median(step_during_s),
        "serial_param_bytes": serial_params,
        "stored_tensor_bytes": data,
        "file_bytes": files,
        "expected_tensor_bytes": serial_params + moments + steps,
    }
    base = rows_out["dcp.save(get_state_dict)"]
    print(
        f"checkpoint of a LLaMA of {serial_params / 1e6:.0f} MB fp32 + AdamW on {result['mesh']}, "
        f"median of {args.rounds}"
    )
    print(f"{'':34} {'training waits':>15} {'÷ dcp.save':>11}")
    for name, seconds in rows_out.items():
        print(f"{name:34} {seconds * 1e3:12.0f} ms {seconds / base:10.2f}x")
    print(f"{'async_save until committed':34} {result['async_done_s'] * 1e3:12.0f} ms")
    print(
        f"a training step: {result['step_s'] * 1e3:.0f} ms alone, {result['step_during_async_s'] * 1e3:.0f} ms "
        "while an async save writes"
    )
    expected = result["expected_tensor_bytes"]
    print(f"stored tensor data {data} B; the serial parameters, AdamW's two moments and steps: {expected} B")
    print(f"files {files} B ({files / data:.3f}x the data)")
    return result
