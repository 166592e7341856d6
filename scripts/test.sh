#!/usr/bin/env bash
# The whole test suite: serial tests, then the MPI tests under mpiexec at 1, 4, 8 and 9 ranks
# (meshes 1, 2×2 and 1×1×4, 2×2×2 and 1×1×8, 3×3 and 1×1×9; MPI carries the meshes), again at 4
# and 9 with gloo carrying them (OPTIMUS2D_TRANSPORT=torch), then timm's ViT in a second
# environment (scripts/setup_timm.sh). Extra arguments go to every pytest of the main runs.
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
for n in 4 9; do  # the same tests with torch.distributed (gloo) carrying the meshes, not MPI
  echo "== mpiexec -n $n, OPTIMUS2D_TRANSPORT=torch (model families: over MPI only)"
  OPTIMUS2D_TRANSPORT=torch mpiexec -n "$n" python -m pytest -q --only-mpi -p no:cacheprovider -m "not families" "$@"
done
# timm needs torchvision, which needs another torch: a second environment, when the disk allows it
free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
if [ "${OPTIMUS2D_SKIP_TIMM:-0}" = "1" ]; then
  echo "== timm tests skipped: OPTIMUS2D_SKIP_TIMM=1"
elif [ "$free_gb" -lt 12 ] && [ ! -x .venv-timm/bin/python ]; then
  echo "== timm tests skipped: ${free_gb} GB free, .venv-timm needs about 6"
else
  bash scripts/setup_timm.sh
  for n in 4 8; do
    echo "== mpiexec -n $n (torch 2.14.1 + timm)"
    .venv-timm/bin/mpiexec -n "$n" .venv-timm/bin/python -m pytest -q --only-mpi -p no:cacheprovider tests/test_timm_mpi.py
  done
fi
echo "whole suite: $((SECONDS - start)) s"
