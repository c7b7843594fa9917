"""Cut tokenized documents into a length mix shaped like the paper's data, with its histogram.

  longtail  like LongAlign-10k: lengths from 8/72 of --seq-length up to --seq-length, most in the
            lowest octave (at --seq-length 73728: 8K-72K, ~75% in 8-16K)
  bimodal   like ChatQA2: ~80% short (under 4/32 of --seq-length), ~20% long (over 16/32)

The lengths are drawn from the mock data's distributions (megatron_sparsebalance/data/distributions.py);
each sample is a crop of a real document (rules in megatron_sparsebalance/data/mixes.py). Writes
<output-prefix>_<distribution>.bin/.idx for each --distribution (pass that prefix to --data-path)
and, with --histogram PREFIX, PREFIX.png (one panel per mix) and PREFIX.json (lengths, quantiles,
how many samples were fresh / reused / clipped).

Example:
  python tools/build_mix.py --input data/real/train_text_document --distribution longtail bimodal \\
      --seq-length 32768 --samples 512 --output-prefix data/real/mix32k --histogram data/real/mix32k_hist
  (writes data/real/mix32k_longtail.bin/.idx, data/real/mix32k_bimodal.bin/.idx)
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_sparsebalance.data.mixes import MIX_DISTRIBUTIONS, mix_summary, plan_mix, write_histogram, write_mix


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="prefix of the tokenized documents (.bin/.idx)")
    p.add_argument("--output-prefix", required=True, help="the mixes go to <prefix>_<distribution>.bin/.idx")
    p.add_argument("--distribution", required=True, nargs="+", choices=MIX_DISTRIBUTIONS)
    p.add_argument("--seq-length", type=int, required=True, help="longest sample (the distribution is scaled to it)")
    p.add_argument("--samples", type=int, required=True, help="samples in the mix")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--histogram", default=None, help="write PREFIX.png and PREFIX.json")
    return p


def build_mix(args) -> dict:
    """Every requested mix; returns ``{distribution: summary}`` (with each mix's ``prefix``)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not IndexedDataset.exists(args.input):
        raise ValueError(f"--input {args.input!r}: no {args.input}.bin / .idx")
    docs = IndexedDataset(args.input, mmap=True)
    summaries = {}
    for name in args.distribution:
        cuts = plan_mix(docs.sequence_lengths, name, args.samples, args.seq_length, args.seed)
        prefix = f"{args.output_prefix}_{name}"
        write_mix(docs, cuts, prefix)
        s = summaries[name] = mix_summary(cuts, name, args.seq_length, args.seed)
        s.update(input=args.input, prefix=prefix)
        print(f"{prefix}: {s['samples']} samples, {s['tokens']} tokens, median {s['quantiles']['0.5']}, "
              f"rules {s['rules']}")
    if args.histogram:
        write_histogram(summaries, args.histogram + ".png", args.histogram + ".json")
    return summaries


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        build_mix(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
