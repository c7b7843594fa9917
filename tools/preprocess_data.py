"""JSONL -> Megatron's ``.bin``/``.idx`` (megatron-core's IndexedDataset), like Megatron-LM's
tools/preprocess_data.py: one stored sequence per JSON record, tokenized with a Hugging Face
tokenizer from a local directory, an end-of-document token appended with ``--append-eod``.

Outputs ``<output-prefix>_<key>_document.bin/.idx`` for each ``--json-keys`` key (Megatron-LM's
naming); pass ``<output-prefix>_text_document`` to ``--data-path``. Records keep their input order
whatever ``--workers`` is, so the output is a pure function of the input and the tokenizer.

Example:
  python tools/preprocess_data.py --input data/docs_train.jsonl --output-prefix data/docs_train \\
      --tokenizer-model models/smollm2-135m --append-eod --workers 8
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np

_tokenizer = None
_keys: tuple = ()
_append_eod = False


def _init_worker(tokenizer_model: str, keys: tuple, append_eod: bool) -> None:
    global _tokenizer, _keys, _append_eod
    from megatron_sparsebalance.data.datasets import load_tokenizer

    _tokenizer, _keys, _append_eod = load_tokenizer(tokenizer_model), keys, append_eod


def encode_text(tokenizer, text: str, append_eod: bool) -> list[int]:
    """The ids Megatron-LM's HF tokenizer gives a document (the tokenizer's own special tokens), plus EOD."""
    ids = list(tokenizer(text)["input_ids"])
    if append_eod:
        ids.append(tokenizer.eos_token_id)
    return ids


def _encode_line(numbered: tuple) -> tuple:
    line_no, line = numbered
    if not line.strip():
        return line_no, None, len(line)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"--input line {line_no}: not valid JSON ({e})") from None
    out = {}
    for key in _keys:
        if not isinstance(record.get(key), str):
            raise ValueError(f"--input line {line_no}: no string field {key!r} (--json-keys)")
        out[key] = np.asarray(encode_text(_tokenizer, record[key], _append_eod), dtype=np.int64)
    return line_no, out, len(line)


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def preprocess(input_path: str, prefix: str, tokenizer_model: str, keys: Sequence[str] = ("text",),
               append_eod: bool = False, workers: int = 1, log=print) -> dict:
    """Tokenize ``input_path`` into one IndexedDataset per key; returns ``{key: data path prefix}``."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    import torch

    if not os.path.isfile(input_path):
        raise ValueError(f"--input {input_path!r}: no such file")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if not keys:
        raise ValueError("--json-keys needs at least one key")
    _init_worker(tokenizer_model, tuple(keys), append_eod)  # also checks the tokenizer before any work
    if append_eod and _tokenizer.eos_token_id is None:
        raise ValueError(f"--append-eod: the tokenizer of {tokenizer_model} has no end-of-text token")
    dtype = DType.optimal_dtype(len(_tokenizer))
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builders = {k: IndexedDatasetBuilder(output_prefix(prefix, k) + ".bin", dtype=dtype) for k in keys}
    start, docs, tokens, nbytes = time.time(), 0, 0, 0
    with open(input_path, encoding="utf-8") as f:
        numbered = enumerate(f, 1)
        if workers == 1:
            results = map(_encode_line, numbered)
            pool = None
        else:
            # The parent has used the tokenizer already; its Rust thread pool must not be forked.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            pool = multiprocessing.get_context("fork").Pool(workers, _init_worker, (tokenizer_model, tuple(keys), append_eod))
            results = pool.imap(_encode_line, numbered, chunksize=4)  # imap keeps the input order
        try:
            for _, encoded, size in results:
                nbytes += size
                if encoded is None:
                    continue
                for k, ids in encoded.items():
                    builders[k].add_item(torch.from_numpy(ids))
                    builders[k].end_document()
                docs += 1
                tokens += len(encoded[keys[0]])
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    for k, b in builders.items():
        b.finalize(output_prefix(prefix, k) + ".idx")
    elapsed = time.time() - start
    log(f"{input_path}: {docs} documents, {tokens} tokens ({nbytes / 1e6:.1f} MB in {elapsed:.1f} s) -> "
        + ", ".join(output_prefix(prefix, k) for k in keys))
    return {k: output_prefix(prefix, k) for k in keys}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--output-prefix", required=True, help="prefix of the .bin/.idx files")
    p.add_argument("--tokenizer-model", required=True, help="local directory of a Hugging Face tokenizer")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize (default: text)")
    p.add_argument("--append-eod", action="store_true", help="append the tokenizer's end-of-text token to each document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        preprocess(args.input, args.output_prefix, args.tokenizer_model, args.json_keys, args.append_eod, args.workers)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
