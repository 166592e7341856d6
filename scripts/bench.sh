#!/usr/bin/env bash
# Every benchmark, then the report: tables in benchmarks/results/report.md, plots beside it.
#   bash scripts/bench.sh            # about 10 minutes on 2 cores; ROUNDS=3 for a quick look
# Ranks share the cores: one thread each. Same command on a GPU node (NCCL is picked by init()).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -c "import matplotlib" 2>/dev/null \
  || .venv/bin/pip install -q --disable-pip-version-check --no-cache-dir -c constraints.txt -e '.[bench]' 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
export OMP_NUM_THREADS=1 PATH="$PWD/.venv/bin:$PATH"
rounds=${ROUNDS:-10}
run() { local n=$1; shift; echo "== mpiexec -n $n python -m benchmarks $*"; mpiexec -n "$n" python -m benchmarks "$@"; }
rm -f benchmarks/results/*.json
run 1 mlp --rounds "$rounds"                                  # 1-rank overhead against plain torch
run 2 --depth 2 transport                                     # a core per rank: a sync point over MPI and gloo
run 2 --depth 2 mlp --rounds "$rounds"                        # ... and a whole 1×1×2 step over each
run 4 transport                                               # 4 ranks sharing 2 cores
run 4 linear --rounds "$rounds"
if [ -x .venv-peers/bin/python ]; then  # megatron-core and Colossal-AI beside (scripts/setup_peers.sh)
  echo "== .venv-peers: mpiexec -n 4 python -m benchmarks mlp"
  .venv-peers/bin/mpiexec -n 4 .venv-peers/bin/python -W ignore -m benchmarks mlp --rounds "$rounds"
else
  run 4 mlp --rounds "$rounds"                                # the issue's set-up
fi
run 4 breakdown --rounds "$rounds"                            # compute alone, communication alone: 2D and 1D
run 4 waits --rounds "$rounds"                                # every MPI wait of a step timed: SUMMA, stationary
run 4 --name waits-b2 waits --batch 2 --rounds "$rounds"
run 4 --name mlp-b2 mlp --batch 2 --rounds "$rounds"          # few rows: the weight-stationary regime
run 4 block --rounds "$rounds"
run 4 gpt --rounds "$rounds"
run 4 --name llama gpt --model llama --rounds "$rounds"       # a LLaMA, with DTensor 1D under its own TP plan
run 4 memory
run 4 calibrate --rounds "$rounds"
if [ -x .venv-peers/bin/python ]; then
  echo "== .venv-peers: mpiexec -n 8 python -m benchmarks --depth 2 mlp"
  .venv-peers/bin/mpiexec -n 8 .venv-peers/bin/python -W ignore -m benchmarks --depth 2 mlp --rounds "$rounds"
else
  run 8 --depth 2 mlp --rounds "$rounds"                      # 2.5D, 2×2×2
fi
run 8 --depth 2 block --rounds "$rounds"
run 8 --depth 2 memory
run 9 --name mlp-h576 mlp --hidden 576 --ffn 2304 --batch 9 --seq 144 --rounds "$rounds"  # 3×3 (sizes ÷ 9 for 1D)
python -m benchmarks plan
python -m benchmarks report
