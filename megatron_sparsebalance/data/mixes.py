"""Length mixes of real documents: samples cut from tokenized documents to lengths drawn like the
paper's data sets.

The lengths come from the same named distributions as the mock data (:mod:`.distributions`:
``longtail`` like LongAlign-10k, ``bimodal`` like ChatQA2, scaled so the longest possible sample
is ``--seq-length``); only the content is real. Cutting rule, for each drawn length ``L`` in draw
order (all choices from one generator seeded by ``--seed``):

1. *fresh*: among the documents with at least ``L`` tokens not yet used, pick one uniformly and
   take its next ``L`` tokens (each document is consumed front to back, so fresh samples never
   overlap);
2. *reused*: if no document has ``L`` unused tokens, take ``L`` tokens at a uniform offset of a
   document that has ``L`` tokens in all (text already seen by another sample);
3. *clipped*: if no document is that long, the sample is the whole longest document and is
   shorter than drawn.

The plan records which rule made each sample, so the histogram says how much of the mix is
declared-length fresh text.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_sparsebalance.data.distributions import check_distribution, sample_lengths

MIX_DISTRIBUTIONS = ("longtail", "bimodal")
RULES = ("fresh", "reused", "clipped")


@dataclass(frozen=True)
class Cut:
    document: int
    start: int
    length: int
    drawn: int
    rule: str


def plan_mix(document_lengths: Sequence[int], distribution: str, count: int, seq_length: int, seed: int,
             min_length: int = 2) -> list[Cut]:
    """The cuts of a ``count``-sample mix from documents of the given token counts."""
    check_distribution(distribution)
    if distribution not in MIX_DISTRIBUTIONS:
        raise ValueError(f"--distribution must be one of {MIX_DISTRIBUTIONS}, got {distribution!r}")
    if count < 1:
        raise ValueError(f"--samples must be >= 1, got {count}")
    lengths = np.asarray(document_lengths, dtype=np.int64)
    if not len(lengths) or lengths.max() < min_length:
        raise ValueError(f"no document has {min_length} tokens: nothing to cut samples from")
    rng = np.random.default_rng([seed, MIX_DISTRIBUTIONS.index(distribution)])
    drawn = sample_lengths(distribution, count, seq_length, rng, min_length)
    used = np.zeros_like(lengths)
    cuts = []
    for L in drawn.tolist():
        fresh = np.flatnonzero(lengths - used >= L)
        if len(fresh):
            d = int(fresh[rng.integers(len(fresh))])
            cuts.append(Cut(d, int(used[d]), L, L, "fresh"))
            used[d] += L
            continue
        whole = np.flatnonzero(lengths >= L)
        if len(whole):
            d = int(whole[rng.integers(len(whole))])
            cuts.append(Cut(d, int(rng.integers(lengths[d] - L + 1)), L, L, "reused"))
            continue
        d = int(lengths.argmax())
        cuts.append(Cut(d, 0, int(lengths[d]), L, "clipped"))
    return cuts


def write_mix(documents, cuts: Sequence[Cut], prefix: str) -> None:
    """Write the cut samples of ``documents`` (an IndexedDataset) as ``prefix.bin/.idx``."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=documents.index.dtype)
    for c in cuts:
        builder.add_item(torch.from_numpy(np.asarray(documents.get(c.document, c.start, c.length)).astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def mix_summary(cuts: Sequence[Cut], distribution: str, seq_length: int, seed: int) -> dict:
    """Length histogram and quantiles of a mix (the JSON beside its picture)."""
    lengths = np.array([c.length for c in cuts])
    edges = [0, 1024, 2048, 4096, 8192, 16384, 24576, 32768, 49152, 65536, 73728, max(73729, int(lengths.max()) + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    return {
        "distribution": distribution, "seq_length": seq_length, "seed": seed, "samples": len(cuts),
        "tokens": int(lengths.sum()),
        "rules": {r: sum(c.rule == r for c in cuts) for r in RULES},
        "quantiles": {q: int(np.quantile(lengths, float(q))) for q in ("0.0", "0.1", "0.25", "0.5", "0.75", "0.9", "1.0")},
        "histogram": {"edges": edges, "counts": counts.tolist()},
        "fraction_below_4096": float((lengths < 4096).mean()),
        "fraction_above_16384": float((lengths > 16384).mean()),
        "fraction_8192_16384": float(((lengths >= 8192) & (lengths <= 16384)).mean()),
        "lengths": lengths.tolist(),
    }


def write_histogram(summaries: dict, png_path: str, json_path: str) -> None:
    """``summaries``: ``{mix name: mix_summary(...)}``; one panel per mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(summaries, f, indent=1)
    fig, axes = plt.subplots(1, len(summaries), figsize=(5 * len(summaries), 3.5), squeeze=False)
    for ax, (name, s) in zip(axes[0], summaries.items()):
        ax.hist(np.array(s["lengths"]) / 1024, bins=40, color="tab:blue")
        ax.set_title(f"{name} (--seq-length {s['seq_length']}): {s['samples']} samples, "
                     f"{s['tokens'] / 1e6:.2f} M tokens", fontsize=9)
        ax.set_xlabel("sample length (K tokens)")
        ax.set_ylabel("samples")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
