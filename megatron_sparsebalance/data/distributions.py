"""Named sequence-length distributions for mock data (``--mock-length-distribution``).

Real long-context SFT sets are far from uniform, and that shape is what batching has to cope
with. Each distribution is defined at the scale of the data set it imitates and then scaled so
that its longest possible sample equals ``--seq-length``; the shape (ratios between short and long
samples) is kept, so a demo at 8K shows the same imbalance as a run at 64K.

- ``bimodal``: like ChatQA2-Long-SFT. 80% short conversations (log-normal, median 1.5K, clipped to
  128..4K) and 20% long documents (uniform in 16K..32K). Reference scale 32K.
- ``longtail``: like LongAlign-10k. A Pareto tail of index 2 starting at 8K and cut at 72K: about
  75% of samples in 8–16K, 6% above 32K, a few near 72K. Reference scale 72K.
- ``uniform``: uniform in ``[seq_length / 16, seq_length]``.
- ``powerlaw``: a Pareto tail of index 1 from ``x_min`` to ``seq_length``, where ``x_min`` is the
  shortest sample the data allows (``min_length``; for the retrieval task, the length that just
  holds its records) or ``seq_length / 256``, whichever is larger. It is *not* scaled: the short
  end stays at ``x_min`` whatever ``--seq-length`` is. Half the samples are shorter than
  ``2 x_min``, one in 16 longer than ``16 x_min``, and each octave of length carries about the same
  number of tokens. Made for training from scratch on the retrieval task (benchmarks/fidelity.py):
  the many short, record-dense samples teach the lookup within a few hundred iterations, where a
  long-only distribution stays at chance, and the tail still reaches ``--seq-length``.
- ``fixed``: every sample exactly ``seq_length`` (the dense-pretraining case; nothing to balance).
"""
from __future__ import annotations

import numpy as np

DISTRIBUTIONS = ("bimodal", "longtail", "uniform", "fixed", "powerlaw")

# Longest sample of the data set each distribution imitates; lengths are scaled by
# seq_length / reference so the shape survives any --seq-length.
REFERENCE_MAX_LENGTH = {"bimodal": 32768, "longtail": 73728}
# ``powerlaw`` starts at the larger of the data's shortest sample and this fraction of --seq-length.
POWERLAW_MIN_FRACTION = 1 / 256


def check_distribution(name: str) -> str:
    if name not in DISTRIBUTIONS:
        raise ValueError(f"--mock-length-distribution must be one of {DISTRIBUTIONS}, got {name!r}")
    return name


def sample_lengths(name: str, count: int, seq_length: int, rng: np.random.Generator, min_length: int = 2) -> np.ndarray:
    """``count`` lengths (int64) drawn from distribution ``name``, all in ``[min_length, seq_length]``."""
    check_distribution(name)
    if seq_length < min_length:
        raise ValueError(f"--seq-length must be >= {min_length} for this data, got {seq_length}")
    if count < 0:
        raise ValueError(f"sample count must be >= 0, got {count}")
    if name == "fixed":
        raw = np.full(count, float(seq_length))
    elif name == "uniform":
        raw = rng.uniform(seq_length / 16, seq_length, count)
    elif name == "powerlaw":
        # Inverse CDF of a Pareto(alpha=1, x_min) truncated at seq_length: P(L > x) ~ x_min / x.
        lo = max(float(min_length), seq_length * POWERLAW_MIN_FRACTION)
        raw = lo / (1.0 - rng.random(count) * (1.0 - lo / seq_length))
    elif name == "bimodal":
        short = np.clip(rng.lognormal(np.log(1536.0), 0.7, count), 128, 4096)
        long = rng.uniform(16384, 32768, count)
        raw = np.where(rng.random(count) < 0.8, short, long) * (seq_length / REFERENCE_MAX_LENGTH["bimodal"])
    else:  # longtail
        # Inverse CDF of a Pareto(alpha=2, x_min=8K) truncated at 72K.
        alpha, lo, hi = 2.0, 8192.0, float(REFERENCE_MAX_LENGTH["longtail"])
        tail = 1.0 - (lo / hi) ** alpha
        raw = lo * (1.0 - rng.random(count) * tail) ** (-1.0 / alpha)
        raw = raw * (seq_length / hi)
    return np.clip(np.rint(raw), min_length, seq_length).astype(np.int64)
