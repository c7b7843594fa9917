#!/usr/bin/env bash
# Registers and spills of every Hopper (sm_90a) kernel of csrc/cuda/attention.cu, compiled here
# without a GPU (about 4 minutes on 2 cores): a kernel edit's spills show before a device call
# (docs/FA4.md, "What was built and measured": dK/dV's 32-68 spilled bytes at head dim 128 cost the
# 3B stored-dS step 1.4-1.8%). Needs nvcc (CUDA 13 here) and the project's .venv (torch's headers).
#
# A CPU-only torch lacks what its CUDA headers include: the CUDA libraries' headers (taken from
# NVIDIA's wheels, headers only, cached in $CACHE) and c10's generated cuda_cmake_macros.h (a
# one-line stand-in: the build on the GPU machine uses torch's own).
#   bash tools/ptxas_report.sh                 # the working tree's kernels
#   bash tools/ptxas_report.sh /path/to/tree   # another checkout's (an A/B's other side)
set -euo pipefail
cd "$(dirname "$0")/.."
TREE=${1:-.}
PYTHON=${PYTHON:-.venv/bin/python}
CACHE=${CACHE:-/tmp/msb_nvcc_headers}

if [ ! -f "$CACHE/ok" ]; then
  rm -rf "$CACHE" && mkdir -p "$CACHE/whl" "$CACHE/include/c10/cuda/impl"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$CACHE/whl" nvidia-cusparse nvidia-cublas nvidia-cusolver 2>/dev/null
  for w in "$CACHE"/whl/*.whl; do unzip -q -o "$w" '*/include/*' -d "$CACHE/x"; done
  cp -r "$CACHE"/x/nvidia/*/include/. "$CACHE/include/"
  rm -rf "$CACHE/whl" "$CACHE/x"
  echo '#pragma once' > "$CACHE/include/c10/cuda/impl/cuda_cmake_macros.h"
  touch "$CACHE/ok"
fi

includes=$("$PYTHON" -c "
import sysconfig
from torch.utils.cpp_extension import include_paths
print(' '.join('-I' + p for p in include_paths() + [sysconfig.get_paths()['include']]))")
log=$(mktemp)
# The flags of setup.py's sm_90a build, written out again: setup.py builds its CUDA extension only
# where torch has CUDA, which this machine's torch does not, so its build cannot run here.
nvcc -O3 -std=c++17 --use_fast_math -lineinfo --expt-relaxed-constexpr \
  -gencode=arch=compute_90a,code=sm_90a -DSPARSEBALANCE_HAS_SM90A -DWITH_CUDA \
  -DTORCH_EXTENSION_NAME=_C -D_GLIBCXX_USE_CXX11_ABI=1 -I"$TREE/csrc" $includes -I"$CACHE/include" \
  -Xptxas -v -c "$TREE/csrc/cuda/attention.cu" -o /dev/null 2> "$log" || { cat "$log" >&2; exit 1; }
# One line per kernel: registers, spill stores and loads, the demangled name.
awk '/Compiling entry function/ {
       match($0, /'"'"'[^'"'"']+'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2)}
     /bytes spill stores/ {st = $5; ld = $9}
     /Used [0-9]+ registers/ && name != "" {
       printf "%4d regs %5d B spilled %5d B reloaded  %s\n", $5, st, ld, name; name = ""}' "$log" |
  c++filt | grep "sm90::" | sort -k9
rm -f "$log"
