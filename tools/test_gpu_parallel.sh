#!/usr/bin/env bash
# `make test-gpu` spread over the GPUs of one machine: the tests marked `gpu` in groups, each on GPUs
# of its own. First the files that start processes of their own, in two groups of two GPUs at once;
# then the kernel grid, its tests dealt round-robin to three GPUs, beside everything else on the
# fourth. Measured on 4xH200 (megatron-core 0.19.2): the two multi-process groups 4.3 and 5.5 min;
# the kernel grid took 3-4.5 min on one GPU with cold Triton caches (the device call's 10 minutes
# ran out in it after both groups), 12-27 s a quarter with warm ones; the rest 1.4 min. On 4xH100
# (27 Nov, cold caches, megatron-core 0.19.2) the whole script took 6.8 min: the groups 3.8 and
# 4.8 min, then the kernel grid's thirds 57-80 s beside the rest's 75 s; on 4xH200 (28 Nov, cold
# caches) 7.1 min, the kernel grid's thirds 58-81 s. Every test's time goes to
# the logs (--durations). Needs 4 GPUs; build the extension first, in a call of its
# own (make test-gpu builds it, or MSB_CUDA=1 python3 setup.py build_ext --inplace).
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
# The files that start processes of their own (PP=2 / TP=2), two groups of two GPUs ...
MULTI_A="tests/gpu/test_megatron_flags_gpu.py tests/gpu/test_megatron_lm_gpu.py"
MULTI_B="tests/gpu/test_tensor_parallel_gpu.py tests/gpu/test_pretrain_gpu.py tests/gpu/test_recompute_gpu.py"
KERNELS=tests/gpu/test_kernels.py
IGNORE=""
for f in $MULTI_A $MULTI_B $KERNELS; do IGNORE="$IGNORE --ignore=$f"; done
run() {  # name, GPUs, pytest arguments...
  local name=$1 gpus=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus $PY -m pytest -q -p no:cacheprovider -m gpu --durations=0 "$@" > "$LOGS/$name.log" 2>&1
  echo $? > "$LOGS/$name.rc"
}
run multiprocess-a 0,1 $MULTI_A &
run multiprocess-b 2,3 $MULTI_B &
wait
# ... then the kernel grid's test ids dealt to GPUs 1-3, and everything else (FA4's file included) on 0.
$PY -m pytest -q -p no:cacheprovider -m gpu --collect-only $KERNELS 2>/dev/null | grep '::' > "$LOGS/kernel_ids.txt"
KERNEL_GROUPS=""
for part in 0 1 2; do
  mapfile -t ids < <(awk -v part=$part 'NR % 3 == part' "$LOGS/kernel_ids.txt")
  [ ${#ids[@]} -gt 0 ] || continue
  run kernels-$part $((part + 1)) "${ids[@]}" &
  KERNEL_GROUPS="$KERNEL_GROUPS kernels-$part"
done
[ -n "$KERNEL_GROUPS" ] || { echo "no kernel tests collected from $KERNELS" >&2; exit 1; }
run rest 0 tests $IGNORE &
wait
status=0
for name in multiprocess-a multiprocess-b $KERNEL_GROUPS rest; do
  rc=$(cat "$LOGS/$name.rc")
  # pytest's own summary line: a process group's teardown warnings can print after it
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)' "$LOGS/$name.log" | tail -n 1)
  echo "$name (rc $rc): ${summary:-$(tail -n 1 "$LOGS/$name.log")}"
  [ "$rc" = 0 ] || { status=1; grep -E "^(FAILED|ERROR)" "$LOGS/$name.log" | head -20; }
done
exit $status
