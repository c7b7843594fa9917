#!/usr/bin/env bash
# `make test-gpu` spread over the GPUs of one machine: the tests marked `gpu` in groups, each on GPUs
# of its own. First the tests of the files that start processes of their own (PP=2 / TP=2 / DP=2),
# their ids dealt in turn to two pairs of GPUs; then the kernel grid, its ids dealt to three GPUs,
# beside everything else on the fourth. The entry's launches take ports of their own
# (torchrun --standalone), so that the groups never meet on one. Measured on 4xH200 (29 Nov,
# megatron-core 0.19.2, cold caches), the first phase's files one after another: the two
# Megatron-LM files more than 18 min (the resumes, FSDP and rerun tests 1.6-2.8 min each), the
# other three 3.5 min; the rest 1.2 min on one GPU. Dealt to two pairs, the first phase should
# take about half of their sum (not yet timed in this form). The kernel grid's thirds took
# 58-81 s with cold Triton caches (4xH200, 28 Nov). Every test's time goes to the logs
# (--durations). Needs 4 GPUs; build the extension first, in a call of its own (make test-gpu
# builds it, or MSB_CUDA=1 python3 setup.py build_ext --inplace).
#   bash tools/test_gpu_parallel.sh [LOG_DIR]      # exit status: 0 when every group passed
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${1:-${TMPDIR:-/tmp}/msb_test_gpu}
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -lt 4 ]; then
  echo "tools/test_gpu_parallel.sh needs 4 GPUs; use make test-gpu" >&2; exit 2
fi
$PY -c "from megatron_sparsebalance.compat import MEGATRON_CORE_VERSION, HAVE_MEGATRON_TRAINING as t; print(f'test-gpu (parallel): megatron-core {MEGATRON_CORE_VERSION}' + (' with megatron.training' if t else ''))"
# The files that start processes of their own (PP=2 / TP=2 / DP=2 on two GPUs) ...
MULTI="tests/gpu/test_megatron_flags_gpu.py tests/gpu/test_megatron_lm_gpu.py tests/gpu/test_tensor_parallel_gpu.py
       tests/gpu/test_pretrain_gpu.py tests/gpu/test_recompute_gpu.py"
KERNELS=tests/gpu/test_kernels.py
IGNORE=""
for f in $MULTI $KERNELS; do IGNORE="$IGNORE --ignore=$f"; done
run() {  # name, GPUs, pytest arguments...
  local name=$1 gpus=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus $PY -m pytest -q -p no:cacheprovider -m gpu --durations=0 "$@" > "$LOGS/$name.log" 2>&1
  echo $? > "$LOGS/$name.rc"
}
GROUPS_RUN=""
collect() {  # the ids of the tests marked gpu in the given files, one a line
  $PY -m pytest -q -p no:cacheprovider -m gpu --collect-only "$@" 2>/dev/null | grep '::'
}
deal() {  # name, files, GPUs of each part...: the files' test ids dealt in turn to the parts, run at once
  local name=$1 files=$2; shift 2
  local ids_file="$LOGS/$name-ids.txt" parts=$# part=0 gpus ids
  # shellcheck disable=SC2086
  collect $files > "$ids_file"
  [ -s "$ids_file" ] || { echo "no tests collected from $files" >&2; exit 1; }
  for gpus in "$@"; do
    mapfile -t ids < <(awk -v part=$part -v parts=$parts 'NR % parts == part' "$ids_file")
    if [ ${#ids[@]} -gt 0 ]; then
      run "$name-$part" "$gpus" "${ids[@]}" &
      GROUPS_RUN="$GROUPS_RUN $name-$part"
    fi
    part=$((part + 1))
  done
}
# ... dealt to GPUs 0-1 and 2-3 ...
deal multiprocess "$MULTI" 0,1 2,3
wait
# ... then the kernel grid's test ids dealt to GPUs 1-3, and everything else (FA4's file included) on 0.
deal kernels "$KERNELS" 1 2 3
# shellcheck disable=SC2086
run rest 0 tests $IGNORE &
GROUPS_RUN="$GROUPS_RUN rest"
wait
status=0
for name in $GROUPS_RUN; do
  rc=$(cat "$LOGS/$name.rc")
  # pytest's own summary line: a process group's teardown warnings can print after it
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)' "$LOGS/$name.log" | tail -n 1)
  echo "$name (rc $rc): ${summary:-$(tail -n 1 "$LOGS/$name.log")}"
  [ "$rc" = 0 ] || { status=1; grep -E "^(FAILED|ERROR)" "$LOGS/$name.log" | head -20; }
done
exit $status
