#!/usr/bin/env bash
# Creates .venv-peers (once): optimus2d with megatron-core 0.16.1 and Colossal-AI 0.5.0, the extra
# peers of benchmarks/external.py. Both go in with --no-deps (their full dependency lists pull CUDA
# builds and compilers); what their tensor-parallel layers import is listed here instead. Every
# install pins torch to the 2.13.0 CPU wheel through constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-peers/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-peers
fi
pip=(.venv-peers/bin/pip install -q --disable-pip-version-check --no-cache-dir -c constraints.txt)
if ! .venv-peers/bin/python -c "import optimus2d, mpi4py, pytest_mpi, pytest_timeout, ruff" 2>/dev/null \
   || [ ! -x .venv-peers/bin/mpiexec ]; then
  echo "setting up .venv-peers: optimus2d..."
  "${pip[@]}" -e '.[test,mpi]' 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
fi
if ! .venv-peers/bin/python -c "import megatron.core.tensor_parallel" 2>/dev/null; then
  echo "setting up .venv-peers: megatron-core 0.16.1..."
  "${pip[@]}" --no-deps megatron-core==0.16.1
  "${pip[@]}" packaging
fi
if ! .venv-peers/bin/python -c "import colossalai.legacy.nn.layer.parallel_2d" 2>/dev/null; then
  echo "setting up .venv-peers: Colossal-AI 0.5.0 (no extensions built)..."
  BUILD_EXT=0 "${pip[@]}" --no-deps colossalai==0.5.0
  "${pip[@]}" psutil peft galore_torch einops
fi
.venv-peers/bin/python -W ignore -c "import optimus2d, megatron.core.tensor_parallel, colossalai.legacy.nn.layer.parallel_2d"
