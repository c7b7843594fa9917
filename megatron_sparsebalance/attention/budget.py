"""The budget channel between the pipeline schedule (DST) and the attention layers.

Megatron builds attention deep inside the model, and only the activation tensor crosses
the model's forward; so the schedule opens a :func:`budget_scope` around the forward of a
micro-batch and every ``SparseCoreAttention`` inside reads the request from it and writes back
what it did. Outside any scope, layers use ``--moba-topk``. The schedule opens the same scope
again around the micro-batch's backward, where recomputed layers (``--recompute-granularity``)
run their forward a second time and must route as the first time did.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

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
        """Mean budget over the layers (0 without layers); reads the device, see :func:`read_reports`."""
        return read_reports({0: self})[0].get(0, 0.0)

    def mean_coverage(self) -> float:
        """Mean ``C(k_used)`` over the layers (0 without layers); reads the device."""
        return read_reports({0: self})[1].get(0, 0.0)


def read_reports(reports: dict) -> tuple[dict, dict, dict]:
    """Mean budget, mean coverage and number of layers of each report (``{micro_batch:
    BudgetReport}``), read at once; a report without layers is in none of the three.

    The layers leave what they chose on the device (:class:`RouteStats`); reading it report by
    report would stop the host after every micro-batch's forward, which in a pipeline leaves the
    GPU idle while the next one is launched. This gathers every value of the iteration into one
    tensor and reads it with a single wait.
    """
    pending = []  # the device values of all reports, read in one go

    def later(value) -> object:
        if isinstance(value, torch.Tensor):
            pending.append(value.reshape(()).to(torch.float64))
            return len(pending) - 1, None
        return None, float(value)

    layers = {i: [tuple(later(v) for v in r.stats.unread()) for r in report.layers]
              for i, report in reports.items() if report.layers}
    read = torch.stack(pending).tolist() if pending else []
    value = lambda slot: read[slot[0]] if slot[0] is not None else slot[1]  # noqa: E731
    budgets = {i: sum(value(k) for k, _ in pairs) / len(pairs) for i, pairs in layers.items()}
    coverage = {i: sum(value(c) for _, c in pairs) / len(pairs) for i, pairs in layers.items()}
    return budgets, coverage, {i: len(pairs) for i, pairs in layers.items()}


class _ScopeState:
    report: Optional[BudgetReport] = None


# Process-wide, not thread-local: with activation recomputation the attention runs again inside
# backward, and autograd runs the backward of CUDA tensors on a device thread of its own while
# the host thread that opened the scope waits in ``torch.autograd.backward``.
_state = _ScopeState()


def active_scope() -> Optional[BudgetReport]:
    return _state.report


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
