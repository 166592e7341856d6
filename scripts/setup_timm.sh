#!/usr/bin/env bash
# Creates .venv-timm (once): optimus2d with torch 2.15.0 + torchvision 0.29.2 + timm + transformers
# 5.25.0, to test the timm converters and the high end of the torch range (about 5.7 GiB, downloaded
# from PyPI: about 1.5 minutes here; see constraints-timm.txt for why a second environment).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-timm/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-timm
fi
pinned=$(sed -n 's/^transformers==//p' constraints-timm.txt)  # again when a pin changes
torch_pinned=$(sed -n 's/^torch==//p' constraints-timm.txt)
if ! .venv-timm/bin/python -c "import optimus2d, timm, torch, transformers, mpi4py, pytest_mpi, pytest_timeout
assert transformers.__version__ == '$pinned' and torch.__version__.split('+')[0] == '$torch_pinned'" 2>/dev/null \
   || [ ! -x .venv-timm/bin/mpiexec ]; then
  echo "setting up .venv-timm (torch $torch_pinned + torchvision + timm, about 1.5 minutes)..."
  .venv-timm/bin/pip install -q --disable-pip-version-check --no-cache-dir -c constraints-timm.txt \
    torch torchvision timm transformers -e '.[test,mpi,families]' 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
fi
# what the install must have given (pip's own errors are filtered above: they show here)
.venv-timm/bin/python -c "import optimus2d, timm, torch, transformers, mpi4py, pytest_mpi, pytest_timeout
assert torch.__version__.split('+')[0] == '$torch_pinned', torch.__version__"
test -x .venv-timm/bin/mpiexec
