#!/usr/bin/env bash
# The main demo: 4 ranks on CPU (gloo), a 2×2 mesh, trained beside its serial twin.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
mpiexec -n 4 python examples/train_mlp.py "$@"
