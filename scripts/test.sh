#!/usr/bin/env bash
# The whole test suite: serial tests, then the MPI tests under mpiexec at 1, 4, 8 and 9 ranks
# (meshes 1, 2×2 and 1×1×4, 2×2×2 and 1×1×8, 3×3 and 1×1×9). Extra arguments go to every pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
start=$SECONDS
python -m pytest -q "$@"
for n in 1 4 8 9; do
  echo "== mpiexec -n $n"
  mpiexec -n "$n" python -m pytest -q --only-mpi -p no:cacheprovider "$@"
done
echo "whole suite: $((SECONDS - start)) s"
