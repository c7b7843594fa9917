#!/usr/bin/env bash
# On the GPU machine: install flash-attn-4 from the wheels tools/fa4_wheels.sh split over two calls.
#   bash tools/fa4_device.sh stage     # call 1 (carry .whl-fa4/call1): keep its files in /tmp/fa4stage
#   P=$(bash tools/fa4_device.sh install) || exit 1; export PYTHONPATH=$P   # call 2 (carry .whl-fa4/call2)
# install joins the big wheel, checks every wheel's sha256, installs all into /tmp/fa4site with
# pip --target and prints the PYTHONPATH to use (its last line of stdout; the rest goes to stderr):
# with --target, the CuTe DSL's .pth is not read, so <target>/nvidia_cutlass_dsl/dsl_packages
# must be on PYTHONPATH for `import cutlass`. /tmp/fa4stage lives as long as the machine: call 2
# must follow call 1 while it is still warm.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/fa4stage
SITE=/tmp/fa4site
case "${1:-}" in
  stage)
    mkdir -p "$STAGE"
    cp .whl-fa4/call1/* "$STAGE/"
    ls -l "$STAGE" >&2
    echo "staged $(ls "$STAGE" | wc -l) files in $STAGE" >&2
    ;;
  install)
    [ -d "$STAGE" ] || { echo "$STAGE is missing: run 'bash tools/fa4_device.sh stage' (call 1) on this machine first" >&2; exit 1; }
    cp .whl-fa4/call2/* "$STAGE/"
    cd "$STAGE"
    for part1 in *.whl.part1; do
      whl=${part1%.part1}
      cat "$part1" "$whl.part2" > "$whl"
      rm -f "$part1" "$whl.part2"
    done
    sha256sum -c --quiet SHA256SUMS >&2 || { echo "sha256 mismatch: re-run tools/fa4_wheels.sh and both calls" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" ./*.whl >&2
    path="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
    PYTHONPATH="$path" python3 -c "import cutlass.cute, flash_attn.cute.interface; print('flash-attn-4 imports', flush=True)" >&2 \
      || { echo "flash-attn-4 does not import; its needs from the image: einops, cuda-bindings, protobuf, typing-extensions" >&2; exit 1; }
    echo "$path"
    ;;
  *)
    echo "usage: bash tools/fa4_device.sh stage|install" >&2; exit 2 ;;
esac
