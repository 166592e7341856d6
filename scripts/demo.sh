#!/usr/bin/env bash
# The main demo: a character-level GPT on 4 CPU ranks (gloo, a 2×2 mesh), trained beside its serial
# twin; it stops with an error if the two loss curves differ by more than 1e-4 (relative).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
mpiexec -n 4 python examples/train_gpt.py --check "$@"
