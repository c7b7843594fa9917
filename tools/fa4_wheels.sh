#!/usr/bin/env bash
# Fetch flash-attn-4 and its CuTe DSL for the GPU machine (Python 3.12, x86-64), here, into
# .whl-fa4/ (git-ignored), split for the device tool's 64 MiB per call:
#   .whl-fa4/call1/  seven small wheels + the first part of nvidia-cutlass-dsl-libs-cu13 (92 MB)
#   .whl-fa4/call2/  the second part
# each with SHA256SUMS of the whole wheels. On the device, tools/fa4_device.sh stages call 1 and
# joins, checks and installs in call 2 (docs/FA4.md has the two commands).
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

rm -rf "$OUTDIR/all" "$OUTDIR/call1" "$OUTDIR/call2"
mkdir -p "$OUTDIR/all" "$OUTDIR/call1" "$OUTDIR/call2"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$OUTDIR/all" "${WHEELS[@]}"

n=$(ls "$OUTDIR"/all/*.whl | wc -l)
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} wheels, got $n" >&2; exit 1; }
[ -f "$OUTDIR/all/$BIG" ] || { echo "missing $BIG" >&2; exit 1; }
(cd "$OUTDIR/all" && sha256sum *.whl > ../SHA256SUMS)

# Cut the big wheel where both calls carry about the same: part 1 rides with the small wheels.
big=$(stat -c %s "$OUTDIR/all/$BIG")
small=$(ls "$OUTDIR"/all/*.whl | grep -v "$BIG" | xargs stat -c %s | awk "{s += \$1} END {print s}")
first=$(( (big - small) / 2 ))
head -c "$first" "$OUTDIR/all/$BIG" > "$OUTDIR/call1/$BIG.part1"
tail -c +"$((first + 1))" "$OUTDIR/all/$BIG" > "$OUTDIR/call2/$BIG.part2"
cmp <(cat "$OUTDIR/call1/$BIG.part1" "$OUTDIR/call2/$BIG.part2") "$OUTDIR/all/$BIG"
ls "$OUTDIR"/all/*.whl | grep -v "$BIG" | xargs -I{} cp {} "$OUTDIR/call1/"
cp "$OUTDIR/SHA256SUMS" "$OUTDIR/call1/"
cp "$OUTDIR/SHA256SUMS" "$OUTDIR/call2/"
rm -rf "$OUTDIR/all"
du -sh "$OUTDIR/call1" "$OUTDIR/call2"
