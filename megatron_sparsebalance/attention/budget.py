"""The budget channel between the pipeline schedule (DST) and the attention layers.

Megatron builds attention deep inside the model, and only the activation tensor crosses
the model's forward; so the schedule opens a :func:`budget_scope` around the forward of a
micro-batch and every ``SparseCoreAttention`` inside reads the request from it and writes back
what it did. Outside any scope, layers use ``--moba-topk``.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

from megatron_sparsebalance.ops.sparse_attention import RouteStats


@dataclass(frozen=True)
class BudgetRequest:
    k: int
    """Budget asked for this micro-batch (DST's k_anchor)."""
    k_base: Optional[int] = None
    """The fixed budget DST shrinks from (enables the coverage bound with ``p``)."""
    p: Optional[float] = None
    """Largest coverage a shrink may lose against ``k_base`` (``--dst-p``)."""


@dataclass
class LayerBudget:
    layer_number: int
    stats: RouteStats


@dataclass
class BudgetReport:
    """What the layers did with the request, in call order."""

    request: Optional[BudgetRequest]
    layers: list = field(default_factory=list)

    def mean_budget(self) -> float:
        return sum(r.stats.k_used for r in self.layers) / max(1, len(self.layers))

    def mean_coverage(self) -> float:
        return sum(r.stats.coverage_used for r in self.layers) / max(1, len(self.layers))


_state = threading.local()


def active_scope() -> Optional[BudgetReport]:
    return getattr(_state, "report", None)


@contextlib.contextmanager
def budget_scope(k: Optional[int] = None, k_base: Optional[int] = None, p: Optional[float] = None) -> Iterator[BudgetReport]:
    """Run the enclosed forward with budget ``k`` (``None``: each layer's ``--moba-topk``)."""
    if k is not None and k < 1:
        raise ValueError(f"budget k must be >= 1, got {k}")
    if p is not None and not 0.0 <= p <= 1.0:
        raise ValueError(f"--dst-p must be in [0, 1], got {p}")
    previous = active_scope()
    report = BudgetReport(BudgetRequest(k, k_base, p) if k is not None else None)
    _state.report = report
    try:
        yield report
    finally:
        _state.report = previous
