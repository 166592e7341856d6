#!/usr/bin/env bash
# The GPU path on one GPU: the CUDA tests, then every timed benchmark under NCCL, timed with CUDA
# events, then the report. Needs a python with a CUDA build of torch (and transformers for gpt):
#   bash scripts/gpu.sh [RESULTS]      # default benchmarks/results/gpu; PYTHON=... picks the python
# A step that fails is reported at the end and the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
py=${PYTHON:-python3}
failed=()
step() { echo "== $*"; "$@" || failed+=("$*"); }
bench() { step "$py" -m benchmarks --results "$out" "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
"$py" -c "import torch, sys; print(sys.version.split()[0], torch.__version__, 'CUDA', torch.version.cuda, \
'NCCL', '.'.join(map(str, torch.cuda.nccl.version())), torch.cuda.get_device_name())"
rm -rf "$out" && mkdir -p "$out"
step "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py
big=(--hidden 4096 --ffn 16384 --batch 8 --seq 1024 --cap-mib 40960)
bench ceiling                                                   # the matmul rate the TFLOP/s compare with
bench mlp --rounds 20                                           # the issue's CPU set-up: launches dominate
bench --name mlp-big mlp "${big[@]}"
bench --name mlp-big-bf16 mlp "${big[@]}" --dtype bfloat16
bench --name linear-big-bf16 linear "${big[@]}" --dtype bfloat16
bench --name block-big block --hidden 2048 --heads 16 --batch 8 --seq 1024 --cap-mib 40960
bench --name block-big-bf16 block --hidden 2048 --heads 16 --batch 8 --seq 1024 --cap-mib 40960 --dtype bfloat16
gpt2=(--layers 12 --hidden 768 --heads 12 --vocab 50304 --batch 8 --seq 1024 --cap-mib 40960)
bench --name gpt2-small gpt "${gpt2[@]}"
bench --name gpt2-small-bf16 gpt "${gpt2[@]}" --dtype bfloat16
bench --name llama-1b-bf16 gpt --model llama --layers 8 --hidden 2048 --heads 16 --vocab 32000 --batch 4 \
  --seq 1024 --cap-mib 40960 --dtype bfloat16
bench report
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all steps passed; results in $out"
