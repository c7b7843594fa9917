"""DST, dynamic sparsity tuning: the budget of every micro-batch of a global batch.

DESIGN.md §4. Every rank runs the same plan from the same lengths, so no communication is
needed: predict each micro-batch's time at the base budget, take an anchor of those times
(min / mean / max / median), and give each micro-batch the largest budget whose predicted time
fits under the anchor. Stragglers shrink; the others grow into time the pipeline would idle
anyway. The per-layer coverage bound (``--dst-p``) is applied later, inside each attention
layer, because only the layer sees the router's scores.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

ANCHORS = ("none", "min", "mean", "max", "median")


@dataclass
class DSTConfig:
    anchor: str = "mean"
    """--dst-anchor: none (fixed k_base, the baseline), min, mean, max or median."""
    p: Optional[float] = 0.1
    """--dst-p: largest coverage a layer may lose against k_base when shrinking (None: unbounded)."""
    k_base: int = 32
    """--moba-topk: the fixed budget of the baseline."""
    candidates: Optional[Sequence[int]] = None
    """--dst-budgets: the budgets DST may choose (default: 1..4*k_base); k_base is always one."""
    k_min: int = 1
    """--dst-k-min: the smallest budget DST gives a straggler."""

    def validate(self) -> "DSTConfig":
        if self.anchor not in ANCHORS:
            raise ValueError(f"--dst-anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if self.p is not None and not 0.0 <= self.p <= 1.0:
            raise ValueError(f"--dst-p must be in [0, 1], got {self.p}")
        if self.k_base < 1:
            raise ValueError(f"--moba-topk must be >= 1, got {self.k_base}")
        if not 1 <= self.k_min <= self.k_base:
            raise ValueError(f"--dst-k-min must be in [1, --moba-topk={self.k_base}], got {self.k_min}")
        if self.candidates is not None and (not self.candidates or min(self.candidates) < 1):
            raise ValueError(f"--dst-budgets must be positive integers, got {list(self.candidates)}")
        return self

    def budget_candidates(self) -> tuple[int, ...]:
        base = self.candidates if self.candidates is not None else range(1, 4 * self.k_base + 1)
        return tuple(sorted({k for k in base if k >= self.k_min} | {self.k_base}))


@dataclass
class BudgetPlan:
    """DST's decision for one global batch (micro-batches in the order they were given)."""

    budgets: list[int]
    predicted_base_ms: list[float]
    predicted_ms: list[float]
    anchor_ms: Optional[float]
    k_base: int
    p: Optional[float]
    notes: list[str] = field(default_factory=list)


def _anchor(times: Sequence[float], anchor: str) -> float:
    if anchor == "min":
        return min(times)
    if anchor == "max":
        return max(times)
    if anchor == "median":
        return statistics.median(times)
    return sum(times) / len(times)


def align(model, lengths: Sequence[int], target_ms: float, candidates: Sequence[int], k_min: int) -> int:
    """Largest candidate budget whose predicted time fits under ``target_ms`` (``k_min`` if none does).

    Prediction is monotone in ``k``, so a binary search over the sorted candidates suffices.
    """
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if model.predict(lengths, candidates[mid]) <= target_ms:
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    return max(best, k_min) if best is not None else k_min


def plan_budgets(micro_batches: Sequence[Sequence[int]], model, config: DSTConfig) -> BudgetPlan:
    """Budgets of all micro-batches of a global batch (all DP ranks).

    Args:
        micro_batches: the sequence lengths packed in each micro-batch.
        model: a latency model (``predict(lengths, k) -> ms``, docs/INTERFACES.md).
    """
    config.validate()
    if not micro_batches:
        raise ValueError("a global batch needs at least one micro-batch")
    base = [model.predict(mb, config.k_base) for mb in micro_batches]
    if config.anchor == "none":
        return BudgetPlan([config.k_base] * len(base), base, list(base), None, config.k_base, None)
    target = _anchor(base, config.anchor)
    candidates = config.budget_candidates()
    budgets = [align(model, mb, target, candidates, config.k_min) for mb in micro_batches]
    predicted = [model.predict(mb, k) for mb, k in zip(micro_batches, budgets)]
    notes = [f"micro-batch {i}: even k_min={config.k_min} is predicted above the anchor"
             for i, (t, k) in enumerate(zip(predicted, budgets)) if k == config.k_min and t > target]
    return BudgetPlan(budgets, base, predicted, target, config.k_base, config.p, notes)
