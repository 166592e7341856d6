"""Benchmarks for optimus2d: run ``python -m benchmarks --help`` under mpiexec or torchrun."""
