#!/usr/bin/env bash
# Creates .venv-torch211 (once): optimus2d with torch 2.11.0, the oldest torch it supports, to test the
# core there (about 1-3 minutes and 4.6 GiB: PyPI's torch 2.11.0 is a CUDA build; it runs on CPU).
# See constraints-torch211.txt for the pins.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-torch211/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-torch211
fi
if ! .venv-torch211/bin/python -c "import optimus2d, transformers, mpi4py, pytest_mpi, pytest_timeout, safetensors" 2>/dev/null \
   || [ ! -x .venv-torch211/bin/mpiexec ]; then
  echo "setting up .venv-torch211 (torch 2.11.0, about 1-3 minutes)..."
  .venv-torch211/bin/pip install -q --disable-pip-version-check --no-cache-dir -c constraints-torch211.txt \
    torch transformers numpy einops mpi4py mpich pytest pytest-mpi pytest-timeout safetensors tqdm \
    2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
  .venv-torch211/bin/pip install -q --disable-pip-version-check --no-cache-dir --no-deps -e . \
    2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
fi
.venv-torch211/bin/python -c "import torch, optimus2d; assert torch.__version__.startswith('2.11.'), torch.__version__"
