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

    def validate(self) -> "DSTConfig":
        if self.anchor not in ANCHORS:
            raise ValueError(f"--dst-anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if self.p is not None and not 0.0 <= self.p <= 1.0:
            raise ValueError(f"--dst-p must be in [0, 1], got {self.p}")
        if self.k_base < 1:
            raise ValueError(f"--moba-topk must be >= 1, got {self.k_base}")
        return self


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


def plan_budgets(micro_batches: Sequence[Sequence[int]], model, config: DSTConfig) -> BudgetPlan:
    """Budgets of all micro-batches of a global batch (all DP ranks).

    Args:
        micro_batches: the sequence lengths packed in each micro-batch.
        model: a latency model (docs/INTERFACES.md); its ``align`` picks from its budget
            candidates, at least its ``k_min``. ``k_base`` must be one of the candidates, so
            that a micro-batch at the anchor keeps its base budget.
    """
    config.validate()
    if config.anchor != "none" and config.k_base not in model.candidates:
        raise ValueError(f"--moba-topk={config.k_base} is not among the latency model's budget candidates {model.candidates}")
    if not micro_batches:
        raise ValueError("a global batch needs at least one micro-batch")
    base = [model.predict(mb, config.k_base) for mb in micro_batches]
    if config.anchor == "none":
        return BudgetPlan([config.k_base] * len(base), base, list(base), None, config.k_base, None)
    target = _anchor(base, config.anchor)
    budgets = [model.align(mb, target) for mb in micro_batches]
    predicted = [model.predict(mb, k) for mb, k in zip(micro_batches, budgets)]
    notes = [f"micro-batch {i}: even k_min={model.k_min} is predicted above the anchor"
             for i, (t, k) in enumerate(zip(predicted, budgets)) if k == model.k_min and t > target]
    return BudgetPlan(budgets, base, predicted, target, config.k_base, config.p, notes)
