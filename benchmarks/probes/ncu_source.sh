#!/usr/bin/env bash
# Nsight Compute of one kernel (its third launch; LAUNCH_SKIP below) with the per-instruction warp samples, as CSV:
#   bash benchmarks/probes/ncu_source.sh OUT_PREFIX KERNEL_REGEX -- python3 -m benchmarks.probes.step_probe --once SHAPE S DENSITY
# LAUNCH_SKIP=N profiles launch N + 1 instead (0 for the forward, which --once runs once).
# writes OUT_PREFIX.sass.csv (the source page: SASS with samples per instruction), OUT_PREFIX.raw.csv
# (every metric) and OUT_PREFIX.log; the report itself stays in /tmp.
set -uo pipefail
if [ $# -lt 4 ] || [ "$3" != "--" ]; then
  echo "usage: $0 OUT_PREFIX KERNEL_REGEX -- COMMAND..." >&2
  exit 2
fi
prefix=$1 kernel=$2
shift 3
rep=/tmp/$(basename "$prefix")
NCU=/usr/local/cuda/bin/ncu
$NCU --set full --import-source no -k "regex:$kernel" --launch-skip "${LAUNCH_SKIP:-2}" -c 1 -f -o "$rep" "$@" > "$prefix.log" 2>&1
$NCU -i "$rep.ncu-rep" --page source --csv --print-source sass > "$prefix.sass.csv" 2>> "$prefix.log" \
  || $NCU -i "$rep.ncu-rep" --page source --csv > "$prefix.sass.csv" 2>> "$prefix.log"
$NCU -i "$rep.ncu-rep" --page raw --csv > "$prefix.raw.csv" 2>> "$prefix.log"
ls -la "$prefix".* >&2
