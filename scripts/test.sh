#!/usr/bin/env bash
# The whole test suite: serial tests, then the MPI tests under mpiexec at 1, 4 and 9 ranks (meshes
# 1, 2×2 and 1×1×4, 3×3 and 1×1×9; MPI carries the meshes), the model families and replicas at 8
# (2×2×2), pipelines of 2 stages × 2×2×2 at 16 and × 3×3 at 18, the tests again at 4 with gloo
# carrying the meshes (OPTIMUS2D_TRANSPORT=torch), then timm's ViT in a second environment
# (scripts/setup_timm.sh). Extra arguments go to every pytest of the main runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
start=$SECONDS
python -m pytest -q "$@"
for n in 1 4 9; do  # each in two sessions: a session's meshes (and their groups) add up
  echo "== mpiexec -n $n"
  mpiexec -n "$n" python -m pytest -q --only-mpi -p no:cacheprovider -m "not families" "$@"
  echo "== mpiexec -n $n, model families"
  mpiexec -n "$n" python -m pytest -q --only-mpi -p no:cacheprovider -m families "$@"
done
# 8 ranks: the model families on 2×2×2, the data-parallel replicas (2 × 2×2), redistribute and
# per-module layouts between 2×2×2 and 1×1×8, pipelines of 2 stages × 2×2 (and × 2 copies of 1×1×2). The other tests
# also pass there (`mpiexec -n 8 python -m pytest -q --only-mpi`, about 10 minutes on 2 cores),
# left out of this command to keep it within CI's 30 minutes
echo "== mpiexec -n 8: model families (2×2×2), replicas"
mpiexec -n 8 python -m pytest -q --only-mpi -p no:cacheprovider -m families "$@"
mpiexec -n 8 python -m pytest -q --only-mpi -p no:cacheprovider tests/test_device_mesh_mpi.py \
  tests/test_redistribute_mpi.py tests/test_layouts_mpi.py tests/test_pipeline_mpi.py tests/test_pipeline_llama_mpi.py \
  tests/test_pipeline_bubbles_mpi.py tests/test_pipeline_gpt2_mpi.py tests/test_pipeline_layouts_mpi.py \
  tests/test_pipeline_dp_mpi.py "$@"
for n in 16 18; do  # pipelines of 2 stages × 2×2×2, × 3×3: every schedule, the refusals (the rest runs at 4 and 8)
  echo "== mpiexec -n $n: pipelines of 2 stages, every schedule"
  mpiexec -n "$n" python -m pytest -q --only-mpi -p no:cacheprovider tests/test_pipeline_mpi.py -k "sum or refuses or lanes" "$@"
done
for n in 4; do  # the same tests with torch.distributed (gloo) carrying the meshes, not MPI
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
  for n in 4; do
    echo "== mpiexec -n $n (torch 2.14.1 + timm)"
    .venv-timm/bin/mpiexec -n "$n" .venv-timm/bin/python -m pytest -q --only-mpi -p no:cacheprovider tests/test_timm_mpi.py
  done
fi
echo "whole suite: $((SECONDS - start)) s"
