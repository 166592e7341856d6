#!/usr/bin/env bash
# The CPU benchmarks with one dedicated core per rank (the 16-core machine beside a lent GPU), launched by
# torchrun over gloo, the GPU hidden; the planner's rows (plan="auto") against DTensor 1D and 1D + SP:
#   bash scripts/cores.sh [RESULTS] [RANKS...]     # default benchmarks/results/cores, ranks 4 16
# ROUNDS=N sets every benchmark's rounds (default: each one's own); VLM_RANKS the vlm runs' (default 4 8).
# A step that fails is reported at the end and the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/cores}
shift $(($# > 0 ? 1 : 0))
ranks=("$@")
[ ${#ranks[@]} -gt 0 ] || ranks=(4 16)
py=${PYTHON:-python3}
export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
failed=()
bench() {  # N ranks on the mesh of depth d, the least that leaves N/d a square (8: 2×2×2)
  local n=$1 d=1
  shift
  while [ $((n % d)) -ne 0 ] || ! "$py" -c "import math, sys; sys.exit(math.isqrt($n // $d) ** 2 != $n // $d)"; do
    d=$((d + 1))
  done
  echo "== $n ranks (depth $d): $*"
  local start=$SECONDS
  "$py" -m torch.distributed.run --standalone --nproc-per-node "$n" -m benchmarks --depth "$d" --results "$out" "$@" ||
    failed+=("$n ranks: $*")
  echo "   ($((SECONDS - start)) s)"
}
nproc --all
"$py" -c "import torch, sys; print(sys.version.split()[0], torch.__version__)"
mkdir -p "$out"
for n in "${ranks[@]}"; do
  bench "$n" mlp --rounds "${ROUNDS:-10}"                                                     # weight-heavy: 1D's shape
  bench "$n" --name mlp-acts mlp --hidden 512 --ffn 2048 --batch 64 --seq 128 --rounds "${ROUNDS:-10}"  # many tokens a weight
  bench "$n" gpt --model llama --heads 16 --rounds "${ROUNDS:-5}"
done
for n in ${VLM_RANKS:-4 8}; do
  bench "$n" vlm --workloads small-frozen,large-trained,long-sequence,pooled-frozen,resampled-frozen \
    --rounds "${ROUNDS:-5}"
done
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all steps passed; results in $out"
