#!/usr/bin/env bash
# On the GPU machine: install flash-attn-4 from the wheels tools/fa4_wheels.sh split over calls.
#   bash tools/fa4_device.sh stage     # every call but the last (carry .whl-fa4/callK): keep its files
#   P=$(bash tools/fa4_device.sh install) || exit 1; export PYTHONPATH=$P   # the last call
# Each copies the files of whichever .whl-fa4/callK the call carried into /tmp/fa4stage. install
# then joins the big wheel's parts in order, checks every wheel's sha256, installs all into
# /tmp/fa4site with pip --target and prints the PYTHONPATH to use (its last line of stdout; the
# rest goes to stderr): with --target, the CuTe DSL's .pth is not read, so
# <target>/nvidia_cutlass_dsl/dsl_packages must be on PYTHONPATH for `import cutlass`.
# /tmp/fa4stage lives as long as the machine: each call must follow the one before while it is
# still warm.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/fa4stage
SITE=/tmp/fa4site
# The machine keeps a carried folder between calls, so an earlier call's may be here too: each
# is copied on its own (their SHA256SUMS are one file).
carried() {
  local dirs=(.whl-fa4/call*/) d
  [ -d "${dirs[0]}" ] || { echo "no .whl-fa4/callK was carried" >&2; exit 1; }
  for d in "${dirs[@]}"; do cp "$d"* "$STAGE/"; done
}
case "${1:-}" in
  stage)
    mkdir -p "$STAGE"
    carried
    ls -l "$STAGE" >&2
    echo "staged $(ls "$STAGE" | wc -l) files in $STAGE" >&2
    ;;
  install)
    [ -d "$STAGE" ] || { echo "$STAGE is missing: run 'bash tools/fa4_device.sh stage' (the calls before) on this machine first" >&2; exit 1; }
    carried
    cd "$STAGE"
    for part1 in *.whl.part1; do
      whl=${part1%.part1}
      n=$(ls "$whl".part* | wc -l)
      for ((i = 1; i <= n; i++)); do
        [ -f "$whl.part$i" ] || { echo "$whl.part$i is missing: a call was skipped or the machine changed" >&2; exit 1; }
        cat "$whl.part$i"
      done > "$whl"
      rm -f "$whl".part*
    done
    sha256sum -c --quiet SHA256SUMS >&2 || { echo "sha256 mismatch: re-run tools/fa4_wheels.sh and every call" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" ./*.whl >&2
    path="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
    PYTHONPATH="$path" python3 -c "import cutlass.cute, flash_attn.cute.interface; print('flash-attn-4 imports', flush=True)" >&2 \
      || { echo "flash-attn-4 does not import; its needs from the image: einops, cuda-bindings, protobuf, typing-extensions" >&2; exit 1; }
    echo "$path"
    ;;
  *)
    echo "usage: bash tools/fa4_device.sh stage|install" >&2; exit 2 ;;
esac
