#!/usr/bin/env bash
# Fetch flash-attn-4 and its CuTe DSL for the GPU machine (Python 3.12, x86-64), here, into
# .whl-fa4/ (git-ignored), split for the device tool's 64 MiB per call, which the working tree
# shares (tracked and untracked-not-ignored files, measured here when this runs):
#   .whl-fa4/call1/  seven small wheels + the first part of nvidia-cutlass-dsl-libs-cu13 (92 MB)
#   .whl-fa4/callN/  its next part, as many calls as it takes beside the tree (three at a tree
#                    of 16.7 MB counted in 4 KiB blocks)
# each with SHA256SUMS of the whole wheels. On the device, tools/fa4_device.sh stages every call
# but the last and joins, checks and installs in the last (docs/FA4.md has the commands).
# Rerun it when the tree has grown: a call that no longer fits is refused before it starts.
# Usage: bash tools/fa4_wheels.sh   (PYTHON=... to pick the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUTDIR=.whl-fa4
WHEELS=(
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)
BIG=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl

rm -rf "$OUTDIR/all" "$OUTDIR"/call*
mkdir -p "$OUTDIR/all"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$OUTDIR/all" "${WHEELS[@]}"

n=$(ls "$OUTDIR"/all/*.whl | wc -l)
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} wheels, got $n" >&2; exit 1; }
[ -f "$OUTDIR/all/$BIG" ] || { echo "missing $BIG" >&2; exit 1; }
(cd "$OUTDIR/all" && sha256sum *.whl > ../SHA256SUMS)

room=$(bash tools/device_room.sh)  # what a call may carry beside the working tree
small=$(ls "$OUTDIR"/all/*.whl | grep -v "$BIG" | xargs stat -c %s | awk '{s += $1} END {print s}')
[ "$room" -gt "$small" ] || { echo "the working tree leaves $room bytes a call, too few for the small wheels" >&2; exit 1; }
# Part 1 rides with the small wheels; every later part fills a call of its own.
big=$(stat -c %s "$OUTDIR/all/$BIG")
offset=0 call=1 size=$(( room - small ))
while [ "$offset" -lt "$big" ]; do
  mkdir -p "$OUTDIR/call$call"
  dd if="$OUTDIR/all/$BIG" of="$OUTDIR/call$call/$BIG.part$call" bs=1M iflag=skip_bytes,count_bytes \
    skip="$offset" count="$size" status=none
  offset=$(( offset + size )) call=$(( call + 1 )) size=$room
done
cmp <(cat $(for ((c = 1; c < call; c++)); do echo "$OUTDIR/call$c/$BIG.part$c"; done)) "$OUTDIR/all/$BIG"
ls "$OUTDIR"/all/*.whl | grep -v "$BIG" | xargs -I{} cp {} "$OUTDIR/call1/"
for ((c = 1; c < call; c++)); do cp "$OUTDIR/SHA256SUMS" "$OUTDIR/call$c/"; done
rm -rf "$OUTDIR/all"
echo "$room bytes a call beside the tree; $((call - 1)) calls:" >&2
du -sh "$OUTDIR"/call*
