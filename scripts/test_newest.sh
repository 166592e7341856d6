#!/usr/bin/env bash
# Drift, found here before users find it: the newest torch and transformers that pip resolves (no
# pins; a machine-wide pip constraint would cap them: it says so first), in a scratch .venv-newest,
# then the serial tests and, at 4 ranks, the model families and the pipelines. Run it through
# `bash scripts/test.sh --newest` before raising the upper bounds in setup.py.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv-newest
if pip config list 2>/dev/null | grep -q "constraint="; then
  echo "note: pip has a machine-wide constraint ($(pip config list | grep constraint=)); 'newest' is what it allows"
fi
"${PYTHON:-python3}" -m venv .venv-newest
echo "setting up .venv-newest (the newest torch and transformers; a CUDA build of torch is several GB)..."
.venv-newest/bin/pip install -q --disable-pip-version-check --no-cache-dir --upgrade torch transformers numpy einops tqdm \
  safetensors mpi4py mpich pytest pytest-mpi pytest-timeout 2>&1 | grep -v "is ignored: it is neither" || true
.venv-newest/bin/pip install -q --disable-pip-version-check --no-cache-dir --no-deps -e . 2>&1 | grep -v "is ignored" || true
export PATH="$PWD/.venv-newest/bin:$PATH" OMP_NUM_THREADS=1
python -c "import torch, transformers; print('== newest: torch', torch.__version__, '| transformers', transformers.__version__)"
python -m pytest -q -p no:cacheprovider "$@"
mpiexec -n 4 python -m pytest -q --only-mpi -p no:cacheprovider -m families "$@"
mpiexec -n 4 python -m pytest -q --only-mpi -p no:cacheprovider tests/test_pipeline_mpi.py tests/test_pipeline_llama_mpi.py \
  tests/test_pipeline_gpt2_mpi.py tests/test_pipeline_llava_mpi.py tests/test_pipeline_dp_mpi.py "$@"
python -c "import torch, transformers; print('newest passed: torch', torch.__version__, '| transformers', transformers.__version__)"
