#!/usr/bin/env bash
# Creates .venv (once) with optimus2d, its test and MPI extras, and MPICH from PyPI.
# torch is pinned to 2.13.0 through constraints.txt: an unpinned torch would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# (again when constraints.txt pins another transformers than the one installed)
pinned=$(sed -n 's/^transformers==//p' constraints.txt)
if ! .venv/bin/python -c "import optimus2d, mpi4py, pytest_mpi, pytest_timeout, einops, ruff, transformers
assert transformers.__version__ == '$pinned'" 2>/dev/null \
   || [ ! -x .venv/bin/mpiexec ]; then
  echo "setting up .venv (a few minutes)..."
  .venv/bin/pip install -q --disable-pip-version-check --no-cache-dir -c constraints.txt -e '.[test,mpi,families]' 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
fi
if ! .venv/bin/python -c "import optimus2d, mpi4py"; then
  echo "setup.sh: .venv did not install (free disk: $(df -Ph . | awk 'NR==2 {print $4}'); it needs about 2 GB)" >&2
  exit 1
fi
