#!/usr/bin/env bash
# The whole test suite, at both ends of the torch and transformers ranges that setup.py declares:
# - .venv (torch 2.13.0, transformers 5.25.0; constraints.txt): serial tests, then the MPI tests
#   under mpiexec at 1 and 9 ranks (meshes 1, 3×3; MPI carries the meshes), the model families and
#   replicas at 8 (2×2×2), pipelines of 2 stages × 3×3 at 18;
# - .venv-torch211 (torch 2.11.0, transformers 5.23.0; the low ends): the core and the families at 4
#   ranks (2×2, 1×1×4), right after the serial tests;
# - .venv-timm (torch 2.15.0, transformers 5.25.0; the high end of torch): timm's ViT, then the core
#   at 4 on 2×2 with gloo carrying the meshes (OPTIMUS2D_TRANSPORT=torch), last.
# The two other environments install in the background while the serial tests run (scripts/envs.sh),
# when the disk holds both. When it holds one at a time, .venv-torch211 goes once its tests have run,
# .venv-timm installs while the .venv sections run and goes after its own tests. An environment the disk
# cannot hold at all is not installed: the run says so and why, and its 4-rank sections run on .venv
# instead (as they do with OPTIMUS2D_SKIP_TIMM=1). An install that fails for another reason fails the
# run. Each section prints its time.
# Extra arguments go to every pytest of the .venv runs. A -k or -m among them joins each section's own
# selection (pytest would keep only the last), and a section none of whose tests they select passes.
#
#   bash scripts/test.sh --newest   # the newest torch and transformers pip finds, in .venv-newest:
#                                   # the families and pipeline tests at 4 ranks (run it before
#                                   # raising setup.py's upper bounds)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--newest" ]; then
  shift
  exec bash scripts/test_newest.sh "$@"
fi
# pytest keeps the last -k and the last -m it is given: the user's are joined to each section's own
args=() user_k="" user_m=""
while [ $# -gt 0 ]; do
  case "$1" in
    -k | -m)
      if [ $# -lt 2 ]; then echo "scripts/test.sh: $1 needs an expression" >&2; exit 2; fi
      if [ "$1" = -k ]; then user_k="${user_k:+$user_k and }($2)"; else user_m="${user_m:+$user_m and }($2)"; fi
      shift 2 ;;
    -k?*) k=${1#-k}; user_k="${user_k:+$user_k and }(${k#=})"; shift ;;  # -kEXPR, -k=EXPR
    -m?*) m=${1#-m}; user_m="${user_m:+$user_m and }(${m#=})"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
# pick MARKS KEYWORDS: picked=(-m ... -k ...), a section's own expressions and the user's, joined
pick() {
  local m=$1 k=$2
  if [ -n "$user_m" ]; then m="${m:+($m) and }$user_m"; fi
  if [ -n "$user_k" ]; then k="${k:+($k) and }$user_k"; fi
  picked=()
  if [ -n "$m" ]; then picked+=(-m "$m"); fi
  if [ -n "$k" ]; then picked+=(-k "$k"); fi
}
# selected COMMAND...: runs a section's pytest; with the user's own arguments, a section none of whose
# tests they select (pytest's exit code 5, "no tests ran") passes
selected() {
  local rc=0
  "$@" || rc=$?
  if [ "$rc" = 5 ] && [ -n "$user_k$user_m${args[*]}" ]; then
    echo "   (none of this section's tests is selected)"
    return 0
  fi
  return "$rc"
}
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
# every pytest below names its 8 slowest tests: what to trim when the suite outgrows its time
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} --durations=8"
start=$SECONDS
lap=$SECONDS
took() { echo "   ($1: $((SECONDS - lap)) s; whole suite so far $((SECONDS - start)) s)"; lap=$SECONDS; }
# timm needs torchvision, which needs another torch: a second environment, when the disk allows it
source scripts/envs.sh
timm=1
if [ "${OPTIMUS2D_SKIP_TIMM:-0}" = "1" ]; then
  timm=0 why="OPTIMUS2D_SKIP_TIMM=1"
fi
echo "disk: $(gib "$(free_kib)") GiB free beside .venv"
# The other environments install one after the other while the serial tests run (pip waits on the disk,
# the tests on the CPU); this run waits for torch 2.11's after the serial tests, for torch 2.15's after
# torch 2.11's tests
mkdir -p .ci-logs
rm -rf .ci-logs/broken .ci-logs/ready.* .ci-logs/nospace.* .ci-logs/tmp
# A run on a disk of one at a time that stopped before it removed .venv-timm: it makes room again
if [ ! -x .venv-torch211/bin/python ] && [ "$(free_kib)" -lt $((needs[.venv-torch211] * 1048576)) ] \
   && room_by_removing .venv-torch211 .venv-timm; then
  echo "removing .venv-timm (left by a run that stopped) to make room for .venv-torch211"
  rm -rf .venv-timm
fi
# Each install in a session of its own, stopped with everything it started if this run ends first
low="" high=""
trap 'for job in $low $high; do kill -- "-$job" 2>/dev/null || true; done' EXIT
setsid -w bash -c 'source scripts/envs.sh; set_up .venv-torch211' > .ci-logs/setup.log 2>&1 &
low=$!
if [ "$timm" = 1 ]; then
  setsid -w bash -c 'source scripts/envs.sh; while kill -0 "$1" 2>/dev/null; do sleep 0.5; done
    [ -e .ci-logs/broken ] || set_up .venv-timm' _ "$low" > .ci-logs/setup-timm.log 2>&1 &
  high=$!
fi
pick "" ""
selected python -m pytest -q "${picked[@]}" "${args[@]}"
took "serial"
wait "$low" || true
cat .ci-logs/setup.log
if [ -e .ci-logs/broken ]; then exit 1; fi
on_venv_at_4=()  # why the 4-rank sections of an environment that is missing run on .venv
# 4 ranks at the low ends of both ranges: torch 2.11.0 with transformers 5.23.0 (what needs a newer torch is
# skipped there, and a test proves it is refused with the version it needs)
if ready .venv-torch211; then
  echo "== torch 2.11.0 + transformers 5.23.0: mpiexec -n 4 (core, then model families)"
  for marks in "not families" families; do
    env PATH="$PWD/.venv-torch211/bin:$PATH" .venv-torch211/bin/mpiexec -n 4 .venv-torch211/bin/python -m pytest -q \
      --only-mpi -p no:cacheprovider -m "$marks"
    took "torch 2.11, 4 ranks, $marks"
  done
else
  on_venv_at_4+=("no .venv-torch211")
fi
# A disk that holds one environment at a time: once torch 2.11's tests have run, its environment makes
# room for torch 2.15's, which installs while the .venv sections run, and goes after its own tests (the
# next run starts as this one did, and tests both ends again)
one_at_a_time=0
if [ -n "$high" ]; then  # its first try, long over by now where the disk held both
  wait "$high" || true
  cat .ci-logs/setup-timm.log
  if [ -e .ci-logs/broken ]; then exit 1; fi
  high=""
  if [ -e .ci-logs/nospace.venv-timm ] && ready .venv-torch211 && room_by_removing .venv-timm .venv-torch211; then
    echo "removing .venv-torch211 ($(gib "$(free_kib)") GiB free) to make room for .venv-timm"
    rm -rf .venv-torch211
    one_at_a_time=1
    setsid -w bash -c 'source scripts/envs.sh; set_up .venv-timm' > .ci-logs/setup-timm.log 2>&1 &
    high=$!
  fi
fi
# 4 ranks (2×2, 1×1×4; over gloo 2×2) run at the two ends below; here 1 and 9 ranks, each in two sessions
# (a session's meshes and their groups add up). At 9 ranks (3×3) what the mesh adds, the blocks'
# arithmetic (9 ranks on 2 cores are CI's dearest minutes). Of the core, not torch's tools and DCP on
# DTensor parameters, the checkpoints' commit and checksum agreement, the meshes' shared groups, the
# planner, deep copies (each at 1 and at 4 on both torch ends; the first two and the planner in part
# at 8). Of the families, every family's exactness, its loading and meta init, not the families'
# tests of what is built on a converted model (generate and HF's habits, context-parallel plans and
# copies, rank sets, modules in 1D, whole inputs and outputs, the planner's LLaMA region, LLaVA's
# pipelines, deep copies: at 1, at 8 and at 4 on torch 2.11; their cases for 9 ranks by hand)
not_at_9=(--ignore=tests/test_torch_tools_mpi.py --ignore=tests/test_checkpoint_dcp_mpi.py
  --ignore=tests/test_pretrained_agree_mpi.py --ignore=tests/test_checkpoint_commit_mpi.py
  --ignore=tests/test_shared_groups_mpi.py --ignore=tests/test_auto_mpi.py --ignore=tests/test_deepcopy_mpi.py)
families_at_9=(tests/test_families_mpi.py tests/test_families_decoders_mpi.py tests/test_families_encoders_mpi.py
  tests/test_families_positions_mpi.py tests/test_families_vision_mpi.py tests/test_families_llava_mpi.py
  tests/test_pretrained_mpi.py)  # meta init and the gradient sweep: at 1, 4 (both torch ends) and 8
for n in 1 9; do
  echo "== mpiexec -n $n"
  skip=() only=()
  if [ "$n" = 9 ]; then skip=("${not_at_9[@]}") only=("${families_at_9[@]}"); fi
  pick "not families" ""
  selected mpiexec -n "$n" python -m pytest -q --only-mpi -p no:cacheprovider "${picked[@]}" "${skip[@]}" "${args[@]}"
  took "$n ranks"
  echo "== mpiexec -n $n, model families"
  pick families ""
  selected mpiexec -n "$n" python -m pytest -q --only-mpi -p no:cacheprovider "${picked[@]}" "${args[@]}" "${only[@]}"
  took "$n ranks, families"
done
# 8 ranks: the model families on 2×2×2, the data-parallel replicas (2 × 2×2), redistribute and
# per-module layouts between 2×2×2 and 1×1×8, pipelines of 2 stages × 2×2 (and × 2 copies of 1×1×2), context
# parallelism with c = 2 on 2×2 (2×2×2) and c = 8 (1×1×8), torch's own tools on DTensor parameters (2×2×2,
# and FSDP2 over 2 replicas of 2×2), checkpoints as DCP's on 2×2×2, a module in 1D beside 2×2×2 and 1×1×8
# (their families' tests ran in the session before: not again). Every family's test runs here:
# the only run of all of them on transformers 5.25.0 on more than one rank (at 9 their exactness; on
# torch 2.15 rank sets and LLaVA's pipelines). Of the rest, for CI's time, what the mesh adds (what is
# left out runs at 4 ranks on both torch ends): the pipelines of stages of one shape under two
# schedules (1F1B, ZBVZeroBubble: a schedule sees a stage, not its mesh; stages of two shapes under
# all, and GPipe with the encoder in its bubbles), context attention under one balance (makespan),
# DCP on 2×2×2 without its fused QKV and padded vocabulary nor async saves, torch's tools without
# their gradient and dtype checks. The planner runs at 1 and 4 (both torch ends); torch.nn's attention
# split by heads and forwards set on an instance at 1, 4 and 9.
# The other tests also pass there (`mpiexec -n 8 python -m pytest -q --only-mpi`, about 15 minutes on 2
# cores), left out of this command to keep CI within its time
echo "== mpiexec -n 8: model families (2×2×2), replicas"
pick families ""
selected mpiexec -n 8 python -m pytest -q --only-mpi -p no:cacheprovider "${picked[@]}" "${args[@]}"
took "8 ranks, families"
at_8=(tests/test_device_mesh_mpi.py tests/test_redistribute_mpi.py tests/test_layouts_mpi.py tests/test_pipeline_mpi.py
  tests/test_pipeline_llama_mpi.py tests/test_pipeline_bubbles_mpi.py tests/test_pipeline_gpt2_mpi.py
  tests/test_pipeline_layouts_mpi.py tests/test_pipeline_dp_mpi.py tests/test_context_attention_mpi.py
  tests/test_context_block_mpi.py tests/test_torch_tools_mpi.py tests/test_checkpoint_dcp_mpi.py tests/test_megatron_mpi.py)
schedules="GPipe or LoopedBFS or Interleaved1F1B or InterleavedZeroBubble or DualPipeV"
# context attention's balances are index arithmetic of c alone: makespan (the general one) here, all at 4
cp_balances="test_attention_equals_sdpa_on_the_whole_sequence and (uniform or head_tail)"
bubbles="test_pipeline_bubbles_mpi and not GPipe"  # the encoder in the bubbles: GPipe's here, every schedule's at 4
kept="not ($schedules) or test_pipeline_layouts_mpi or (test_pipeline_bubbles_mpi and GPipe)"
pick "not families" "($kept) and not ($cp_balances) and not ($bubbles)"
not_at_8=(--deselect tests/test_torch_tools_mpi.py::test_fused_qkv_and_a_padded_vocabulary_go_through_dcp_as_serial_tensors
  --deselect tests/test_torch_tools_mpi.py::test_gradients_reach_the_parameters_as_torch_would_give_them
  --deselect tests/test_torch_tools_mpi.py::test_dtype_and_device_moves_keep_the_gradient_sums
  --deselect tests/test_checkpoint_dcp_mpi.py::test_async_save_commits_the_state_it_was_called_with)
selected mpiexec -n 8 python -m pytest -q --only-mpi -p no:cacheprovider "${picked[@]}" "${at_8[@]}" "${not_at_8[@]}" \
  "${args[@]}"
took "8 ranks"
# 18 ranks: pipelines of 2 stages × 3×3, three schedules (one stage a rank, several, the V of zero
# bubbles: a schedule sees a stage, not its mesh) and the refusals; all seven run at 4 (stages of 1×1×2),
# two of them at 8 (2×2); `-n 16` gives stages of 2×2×2, left out of CI for its time
echo "== mpiexec -n 18: pipelines of 2 stages × 3×3"
pick "" "refuses or lanes or 1F1B-sum or ZBVZeroBubble-sum"
selected mpiexec -n 18 python -m pytest -q --only-mpi -p no:cacheprovider tests/test_pipeline_mpi.py "${picked[@]}" \
  "${args[@]}"
took "18 ranks"
# 4 ranks at the high end of torch: timm, the core with gloo carrying the meshes (OPTIMUS2D_TRANSPORT=torch;
# MPI carries them everywhere else), and the two families' files whose pipelines torch 2.15 changed under
# (stages on rank sets, the LLaVA tower in the bubbles). The other families of transformers 5.25.0 ran on
# .venv at 1, 9 and 8 ranks, not again here (`bash scripts/test.sh --newest` runs them). Over gloo, the
# core's tests of a mesh_shape on 2×2 only, not 1×1×4 (which ran over MPI on torch 2.11, and 1×1×8 on
# 2.13), but for the transport's and context parallelism's own (a depth group of 4, the ring's sends);
# the tests that build their meshes themselves as they do. Gloo's waits are CI's slowest minutes.
# Without that environment, the core and families at 4 ranks run here on .venv instead
if [ -n "$high" ]; then
  wait "$high" || true
  cat .ci-logs/setup-timm.log
  if [ -e .ci-logs/broken ]; then exit 1; fi
fi
if ready .venv-timm; then
  run=(env PATH="$PWD/.venv-timm/bin:$PATH" .venv-timm/bin/mpiexec -n 4 .venv-timm/bin/python -m pytest -q --only-mpi
    -p no:cacheprovider)
  echo "== torch 2.15.0 + transformers 5.25.0 + timm: mpiexec -n 4 (timm, pipelines of LLaVA; core over gloo)"
  "${run[@]}" tests/test_timm_mpi.py tests/test_rank_sets_mpi.py tests/test_pipeline_llava_mpi.py  # and the pipelines
  "${run[@]:0:2}" OPTIMUS2D_TRANSPORT=torch "${run[@]:2}" -m "not families" \
    -k "not q1d4 or test_transport_mpi or test_context_attention_mpi or test_context_block_mpi"
  took "torch 2.15.0, 4 ranks over gloo"
  if [ "$one_at_a_time" = 1 ]; then
    echo "removing .venv-timm: this disk holds one of the two at a time"
    rm -rf .venv-timm
  fi
else
  on_venv_at_4+=("${why:-no .venv-timm}")
fi
if [ ${#on_venv_at_4[@]} -gt 0 ]; then
  echo "== NOT TESTED at that end: ${on_venv_at_4[*]} (above: why); mpiexec -n 4 on .venv (torch 2.13.0) instead"
  for marks in "not families" families; do
    pick "$marks" ""
    selected mpiexec -n 4 python -m pytest -q --only-mpi -p no:cacheprovider "${picked[@]}" "${args[@]}"
    took "4 ranks, $marks"
  done
fi
echo "whole suite: $((SECONDS - start)) s"
