"""Measurement of a pipeline iteration: per-micro-batch compute times, imbalance, bubble, trace.

Every stage records when each forward and backward ran (CUDA events on a GPU, the wall clock
on a CPU), relative to the moment its schedule started. After the iteration the records of all
ranks are gathered and reduced to the figures the paper reports:

- micro-batch time: forward + backward of a micro-batch summed over the stages it crossed;
- imbalance: max / mean micro-batch time over the whole global batch (all DP ranks);
- bubble of a stage: the fraction of the iteration in which it computed nothing;
- predicted vs measured time per micro-batch and stage, which calibrates the latency model.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state


@dataclass
class Span:
    micro_batch: int
    kind: str  # "F" or "B"
    start_ms: float
    end_ms: float


@dataclass
class StageRecord:
    """What one rank measured in one iteration."""

    pp_rank: int
    dp_rank: int
    spans: list
    budgets: dict  # micro-batch -> mean budget used over this stage's layers
    coverage: dict  # micro-batch -> mean coverage C(k) over this stage's layers
    predicted_ms: dict  # micro-batch -> the plan's prediction for this stage (if any)
    layers: dict = field(default_factory=dict)  # micro-batch -> this stage's sparse attention layers that ran it


class StageClock:
    """Records compute spans; CUDA events on a GPU so no sync happens inside the schedule."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._open: dict = {}
        self._spans: list = []
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        else:
            self._origin = time.perf_counter()

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self, micro_batch: int, kind: str) -> None:
        self._open[(micro_batch, kind)] = self._now()

    def stop(self, micro_batch: int, kind: str) -> None:
        self._spans.append((micro_batch, kind, self._open.pop((micro_batch, kind)), self._now()))

    def spans(self) -> list:
        if self.cuda:
            torch.cuda.synchronize()
            rel = lambda ev: self._origin.elapsed_time(ev)  # noqa: E731
        else:
            rel = lambda t: (t - self._origin) * 1e3  # noqa: E731
        return [Span(mb, kind, rel(a), rel(b)) for mb, kind, a, b in self._spans]


@dataclass
class IterationMetrics:
    """The figures of one iteration, identical on every rank."""

    iteration_ms: float
    imbalance: float
    bubble: list  # per pipeline stage
    micro_batch_ms: list  # per (dp_rank, micro-batch), summed over stages, dp-major order
    budgets: list  # per (dp_rank, micro-batch): mean budget used over all layers
    coverage: list
    predicted_ms: list  # per (dp_rank, micro-batch): plan's prediction summed over stages, or None
    records: list = field(repr=False, default_factory=list)

    def chrome_trace(self) -> dict:
        """Chrome trace (chrome://tracing, Perfetto): one process per stage, one thread per DP rank."""
        events = []
        for rec in self.records:
            for s in rec.spans:
                events.append(dict(
                    name=f"{s.kind}{s.micro_batch}", ph="X", ts=s.start_ms * 1e3, dur=(s.end_ms - s.start_ms) * 1e3,
                    pid=rec.pp_rank, tid=rec.dp_rank, cat=s.kind,
                    args=dict(micro_batch=s.micro_batch, budget=rec.budgets.get(s.micro_batch)),
                ))
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

    def figures(self, pipeline_stages: int) -> dict:
        """What both entries log per iteration: imbalance, mean bubble over stages, the plan's
        predicted and the measured step ms, the mean budget used and its coverage (NaN where
        the iteration has none, e.g. dense layers report no budgets)."""
        nan = float("nan")
        predicted = self.predicted_ms and None not in self.predicted_ms
        return dict(
            imbalance=self.imbalance, bubble=sum(self.bubble) / len(self.bubble) if self.bubble else nan,
            predicted_ms=sum(self.predicted_ms) / pipeline_stages if predicted else nan,
            measured_ms=self.iteration_ms,
            mean_budget=sum(self.budgets) / len(self.budgets) if self.budgets else nan,
            mean_coverage=sum(self.coverage) / len(self.coverage) if self.coverage else nan,
        )

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("records")
        return d


def gather_iteration_metrics(record: StageRecord, num_micro_batches: int) -> IterationMetrics:
    """All-gather every rank's record (host objects, once per iteration) and reduce them."""
    world = dist.get_world_size()
    records = [None] * world
    dist.all_gather_object(records, asdict(record))
    records = [StageRecord(**{**r, "spans": [Span(**s) for s in r["spans"]]}) for r in records]
    # With tensor parallelism several ranks hold the same (pp, dp) position: they ran the same
    # micro-batches together (their collectives wait for each other), so one of them speaks for
    # the stage and none is counted twice. They must also have used the same budgets: the
    # attention layers agree on them over the TP group (attention/tensor_parallel.py); ranks
    # that did not would have computed different sparse attentions of one layer.
    unique = {}
    for r in records:
        first = unique.setdefault((r.pp_rank, r.dp_rank), r)
        if first is not r and first.budgets != r.budgets:
            raise RuntimeError(f"the tensor-parallel ranks of stage {r.pp_rank} (DP rank {r.dp_rank}) used different "
                               f"budgets: {first.budgets} and {r.budgets}")
    records = list(unique.values())
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    # Each DP rank's own count (``num_micro_batches`` is this rank's): under
    # --variable-micro-batches replicas run different numbers of micro-batches.
    counts = [num_micro_batches] * dp
    for r in records:
        counts[r.dp_rank] = len(r.predicted_ms)
    mb_ms = [[0.0] * counts[d] for d in range(dp)]
    predicted = [[0.0] * counts[d] for d in range(dp)]
    have_prediction = True
    # Budget and coverage are means over the layers that ran the micro-batch, whichever stage
    # holds them: a stage without attention layers (the output layer alone, or an uneven split)
    # neither counts as budget 0 nor weighs as much as a stage with more layers.
    budget_sum = [[0.0] * counts[d] for d in range(dp)]
    coverage_sum = [[0.0] * counts[d] for d in range(dp)]
    layer_count = [[0] * counts[d] for d in range(dp)]
    busy = [0.0] * pp
    iteration_ms = 0.0
    for r in records:
        for s in r.spans:
            mb_ms[r.dp_rank][s.micro_batch] += s.end_ms - s.start_ms
            busy[r.pp_rank] += (s.end_ms - s.start_ms) / dp
            iteration_ms = max(iteration_ms, s.end_ms)
        for mb in range(counts[r.dp_rank]):
            layers = r.layers.get(mb, 0)
            budget_sum[r.dp_rank][mb] += r.budgets.get(mb, 0.0) * layers
            coverage_sum[r.dp_rank][mb] += r.coverage.get(mb, 0.0) * layers
            layer_count[r.dp_rank][mb] += layers
            if r.predicted_ms.get(mb) is None:
                have_prediction = False
            else:
                predicted[r.dp_rank][mb] += r.predicted_ms[mb]
    flat = [t for row in mb_ms for t in row]
    mean = sum(flat) / max(1, len(flat))
    return IterationMetrics(
        iteration_ms=iteration_ms,
        imbalance=max(flat) / mean if mean > 0 else 1.0,
        bubble=[1.0 - b / iteration_ms if iteration_ms > 0 else 0.0 for b in busy],
        micro_batch_ms=flat,
        budgets=[b / n if n else 0.0 for row, ns in zip(budget_sum, layer_count) for b, n in zip(row, ns)],
        coverage=[c / n if n else 0.0 for row, ns in zip(coverage_sum, layer_count) for c, n in zip(row, ns)],
        predicted_ms=[p for row in predicted for p in row] if have_prediction else [],
        records=records,
    )
