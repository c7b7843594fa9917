#!/usr/bin/env bash
# Real documents on this machine, no download: its installed packages' source trees -> held-out
# split by package -> tokenized .bin/.idx -> longtail and bimodal mixes with their histogram.
# See docs/REAL_MODEL.md.
#
#   TOKENIZER=/tmp/smollm2/hf OUT=/tmp/realdata SEQ_LENGTH=32768 tools/prepare_real_data.sh
#
# Writes $OUT/{train,valid}.jsonl, $OUT/packages.json, $OUT/{train,valid}_text_document.{bin,idx},
# $OUT/mix_{longtail,bimodal}.{bin,idx} and $OUT/mix_hist.{png,json}.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TOKENIZER="${TOKENIZER:-/tmp/smollm2/hf}"
OUT="${OUT:-/tmp/realdata}"
SEQ_LENGTH="${SEQ_LENGTH:-32768}"
SAMPLES="${SAMPLES:-512}"
# ~40 M characters (~12 M tokens): enough long documents for the mixes, tokenized in well under a minute on 16 cores.
MAX_CHARS="${MAX_CHARS:-40000000}"
WORKERS="${WORKERS:-$(nproc)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

cd "$REPO"
"$PYTHON" tools/build_documents.py --out-dir "$OUT" --valid-fraction "${VALID_FRACTION:-0.1}" --max-total-chars "$MAX_CHARS"
for split in train valid; do
  "$PYTHON" tools/preprocess_data.py --input "$OUT/$split.jsonl" --output-prefix "$OUT/$split" \
    --tokenizer-model "$TOKENIZER" --append-eod --workers "$WORKERS"
done
"$PYTHON" tools/build_mix.py --input "$OUT/train_text_document" --distribution longtail bimodal \
  --seq-length "$SEQ_LENGTH" --samples "$SAMPLES" --output-prefix "$OUT/mix" --histogram "$OUT/mix_hist"
