"""Linear h→ffn: optimus2d against DTensor 1D column-parallel (with and without SP), same run.

    mpiexec -n 4 python -m benchmarks linear          # 1024→4096, batch 8 × seq 128

The same measurements as ``mlp`` (see its docstring) for a single layer.
"""

from __future__ import annotations

import argparse

from benchmarks import mlp

run = mlp.run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mlp.add_arguments(parser)
    parser.set_defaults(linear=True)
