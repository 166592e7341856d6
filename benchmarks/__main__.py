"""python -m benchmarks SUBCOMMAND [options], under mpiexec -n N or torchrun (N = depth·q²)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import optimus2d
from benchmarks import (
    block,
    breakdown,
    calibrate,
    ceiling,
    checkpoint,
    checks,
    compile,
    gpt,
    linear,
    long,
    memory,
    meshes,
    mlp,
    pipeline,
    plan,
    pretrained,
    report,
    scale,
    transport,
    vlm,
    waits,
)

SUBCOMMANDS = {
    "linear": linear,
    "mlp": mlp,
    "block": block,
    "gpt": gpt,
    "memory": memory,
    "plan": plan,
    "pipeline": pipeline,
    "calibrate": calibrate,
    "breakdown": breakdown,
    "transport": transport,
    "waits": waits,
    "ceiling": ceiling,
    "checks": checks,
    "compile": compile,
    "pretrained": pretrained,
    "checkpoint": checkpoint,
    "report": report,
    "scale": scale,
    "vlm": vlm,
    "long": long,
    "meshes": meshes,
}
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--name", help="results file stem (default: the subcommand)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the JSON results (and the report)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = optimus2d.init()
    mesh = optimus2d.Mesh(math.isqrt(world.size // args.depth), args.depth)
    module = SUBCOMMANDS[args.command]
    result = module.run(args, world, mesh)
    if world.rank == 0 and result is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        path = args.results / f"{args.name or args.command}-p{world.size}-q{mesh.q}d{mesh.depth}.json"
        path.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")


if __name__ == "__main__":
    main()
