#!/usr/bin/env bash
# `make test-gpu` spread over the GPUs of one machine: the tests marked `gpu` in three groups that run
# at once, each on GPUs of its own. A whole pass in one process takes ~10-12 min on an H100; in groups
# the longest (the multi-process files, 2 GPUs) takes ~5.5 min. Needs 4 GPUs; the extension must be
# built first (make test-gpu builds it, or MSB_CUDA=1 python3 setup.py build_ext --inplace).
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
# The files that start processes of their own, two GPUs each (PP=2 / TP=2) ...
MULTI="tests/gpu/test_megatron_flags_gpu.py tests/gpu/test_tensor_parallel_gpu.py tests/gpu/test_megatron_lm_gpu.py
       tests/gpu/test_pretrain_gpu.py tests/gpu/test_recompute_gpu.py"
KERNELS=tests/gpu/test_kernels.py
IGNORE=""
for f in $MULTI $KERNELS; do IGNORE="$IGNORE --ignore=$f"; done
run() {  # name, GPUs, pytest arguments...
  local name=$1 gpus=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus $PY -m pytest -q -p no:cacheprovider -m gpu "$@" > "$LOGS/$name.log" 2>&1
  echo $? > "$LOGS/$name.rc"
}
run multiprocess 0,1 $MULTI &
run kernels 2 $KERNELS &
run rest 3 tests $IGNORE &   # ... the kernel grid alone, and everything else (FA4's file included)
wait
status=0
for name in multiprocess kernels rest; do
  rc=$(cat "$LOGS/$name.rc")
  echo "$name (rc $rc): $(tail -n 1 "$LOGS/$name.log")"
  [ "$rc" = 0 ] || { status=1; grep -E "^(FAILED|ERROR)" "$LOGS/$name.log" | head -20; }
done
exit $status
