"""Repository-level documents from installed Python packages -> train/valid JSONL (no download).

Each document is one package directory's text files concatenated in sorted path order with a
header line per file (large packages are cut along their directory tree); packages are held out
by a hash of their name, so no package is in both splits. The rules are in
``megatron_sparsebalance/data/documents.py``. Default source: this interpreter's site-packages.

Writes <out-dir>/train.jsonl, <out-dir>/valid.jsonl and <out-dir>/packages.json (which package
went where, and the settings). Then tokenize with tools/preprocess_data.py.

Example:
  python tools/build_documents.py --out-dir data/real --valid-fraction 0.1 --max-total-chars 60000000
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from megatron_sparsebalance.data.documents import (DEFAULT_MAX_CHARS, build_documents, default_search_roots,
                                                   write_jsonl)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="directory for train.jsonl, valid.jsonl, packages.json")
    p.add_argument("--source-root", action="append", default=None,
                   help="directory whose top-level packages become documents (repeatable; default: site-packages)")
    p.add_argument("--packages", nargs="+", default=None, help="only these packages")
    p.add_argument("--exclude", nargs="+", default=[], help="leave these packages out")
    p.add_argument("--valid-fraction", type=float, default=0.1, help="share of packages held out (by name hash)")
    p.add_argument("--max-document-chars", type=int, default=DEFAULT_MAX_CHARS,
                   help="cut a package into sub-directory documents above this many characters")
    p.add_argument("--max-total-chars", type=int, default=None,
                   help="take packages in name-hash order, skipping any that would take the text past this size")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.max_total_chars is not None and args.max_total_chars < 1:
            raise ValueError(f"--max-total-chars must be >= 1, got {args.max_total_chars}")
        docs = build_documents(args.source_root or default_search_roots(), args.valid_fraction,
                               args.max_document_chars, args.packages, args.exclude, args.max_total_chars)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(os.path.join(args.out_dir, "train.jsonl"), docs.train)
    write_jsonl(os.path.join(args.out_dir, "valid.jsonl"), docs.valid)
    summary = {"roots": docs.roots, "packages": docs.packages, "valid_fraction": args.valid_fraction,
               "max_document_chars": args.max_document_chars, "max_total_chars": args.max_total_chars,
               "documents": {"train": len(docs.train), "valid": len(docs.valid)},
               "chars": {"train": sum(len(d.text) for d in docs.train), "valid": sum(len(d.text) for d in docs.valid)}}
    with open(os.path.join(args.out_dir, "packages.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{args.out_dir}: {summary['documents']['train']} train documents ({len(docs.packages['train'])} packages, "
          f"{summary['chars']['train'] / 1e6:.1f} M chars), {summary['documents']['valid']} held-out documents "
          f"({len(docs.packages['valid'])} packages, {summary['chars']['valid'] / 1e6:.1f} M chars)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
