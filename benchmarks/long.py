"""Long fused sequences: how context parallelism's sequence split balances the attention work.

    python -m benchmarks long                     # s = 8192; c = 2, 4, 8; three masks
    python -m benchmarks long --seq 32768 --cp 4 8

For each mask and context-parallel size c, the unmasked (query, key) pairs each rank's queries
hold (``optimus2d.context.assign``), as max / mean over the ranks, for the three splits: uniform
(contiguous s/c tokens a rank), head–tail (chunks r and 2c − 1 − r) and makespan (blocks of
``--block`` tokens, greedy, an equal count a rank). The masks: causal; causal text with three
bidirectional image spans of ``--image`` tokens (a mixed image–text sequence); packed causal
documents of random lengths (seeded). Pairs are exact counts, not timings: rank 0 computes them.
The step time and the longest sequence that trains come with context-parallel attention (issue 27).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import optimus2d
from optimus2d.context import METHODS, assign, causal_mask, document_mask, image_text_mask


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", type=int, default=8192, help="tokens in the fused sequence")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="context-parallel sizes")
    parser.add_argument("--image", type=int, default=576, help="tokens of each of the three images")
    parser.add_argument("--block", type=int, default=None, help="makespan's block (default: s/(8c))")


def masks(s: int, image: int) -> dict[str, torch.Tensor]:
    """The three masks of the table, over ``s`` tokens."""
    spans = [(s * k // 4, s * k // 4 + image) for k in range(3)]
    generator = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < s:
        lengths.append(int(torch.randint(s // 32, s // 4, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - s
    if lengths[-1] <= 0:
        lengths.pop()
        lengths[-1] += s - sum(lengths)
    return {
        "causal": causal_mask(s),
        f"image-text ({len(spans)} images of {image})": image_text_mask(s, spans),
        f"packed documents ({len(lengths)})": document_mask(lengths),
    }


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> dict:
    rows = []
    if world.rank == 0:
        print(f"unmasked (query, key) pairs per context-parallel rank, max / mean; s = {args.seq}")
        print(f"{'mask':<34}{'c':>3}" + "".join(f"{m:>12}" for m in METHODS))
        for kind, mask in masks(args.seq, args.image).items():
            for c in args.cp:
                block = args.block or max(1, args.seq // (8 * c))
                split = {m: assign(mask, c, m, block=block if m == "makespan" else None) for m in METHODS}
                for method, a in split.items():
                    rows.append(
                        {"mask": kind, "c": c, "method": method, "imbalance": a.imbalance, "pairs": list(a.pairs)}
                    )
                print(f"{kind:<34}{c:>3}" + "".join(f"{split[m].imbalance:>12.4f}" for m in METHODS))
    if dist.is_initialized():
        dist.barrier()
    return {"config": vars(args), "ranks": world.size, "rows": rows}
