"""A model of the 1F1B schedule: iteration time from per-stage micro-batch costs.

Replays the exact operation order of ``pipeline/schedule.py`` (stage ``s``: ``P - s - 1`` warm-up
forwards, then one forward and one backward alternately, then the remaining backwards) as a
dependency graph: a forward needs the previous stage's forward of the same micro-batch, a
backward the next stage's backward (the last stage: its own forward), each stage runs its
operations in order, one at a time. Data-parallel replicas run side by side and the iteration
ends with the slowest (the gradient all-reduce waits for it), plus ``allreduce_ms``.

Used to predict what a plan will cost before running it (cluster sizes we cannot rent), to
compute the ideal speedup a balancer could reach for given costs, and checked against measured
runs (``tools/simulate_pipeline.py --replay``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class SimResult:
    iteration_ms: float
    stage_busy_ms: list
    bubble: list
    spans: list  # (stage, kind, micro_batch, start_ms, end_ms)


def one_f_one_b_order(pp: int, stage: int, m: int) -> list:
    """The operations of ``stage`` in execution order: ``[("F", i) | ("B", i), ...]``."""
    warmup = min(pp - stage - 1, m)
    ops = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    ops += [("B", i) for i in range(b, m)]
    return ops


@functools.lru_cache(maxsize=64)
def _dependency_order(pp: int, m: int) -> tuple:
    """Every operation of a ``pp``-stage, ``m``-micro-batch 1F1B, in an order that runs each one
    after the operation it waits for: ``((stage, kind, i, dep), ...)`` with ``dep`` the
    ``(kind, stage, i)`` it waits for, or ``None``.

    The order depends on the dependency graph alone, not on the costs, so it is built once per
    ``(pp, m)``; DST's bubble growth simulates the same schedule dozens of times per global batch.
    """
    orders = [one_f_one_b_order(pp, s, m) for s in range(pp)]
    placed, pos, out = set(), [0] * pp, []
    while len(out) < 2 * pp * m:
        progressed = False
        for s in range(pp):
            if pos[s] == len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            if kind == "F":
                dep = None if s == 0 else ("F", s - 1, i)
            else:
                dep = ("F", s, i) if s == pp - 1 else ("B", s + 1, i)
            if dep is not None and dep not in placed:
                continue
            placed.add((kind, s, i))
            out.append((s, kind, i, dep))
            pos[s] += 1
            progressed = True
        if not progressed:  # cannot happen for a valid 1F1B order; guards against a bad edit
            raise RuntimeError("1F1B dependency cycle in the simulator")
    return tuple(out)


def simulate_1f1b(forward_ms: Sequence[Sequence[float]], backward_ms: Sequence[Sequence[float]],
                  p2p_ms: float = 0.0) -> SimResult:
    """One pipeline: ``forward_ms[s][i]`` / ``backward_ms[s][i]`` for stage ``s``, micro-batch ``i``."""
    pp, m = len(forward_ms), len(forward_ms[0]) if forward_ms else 0
    if pp < 1 or m < 1 or len(backward_ms) != pp or any(len(r) != m for r in (*forward_ms, *backward_ms)):
        raise ValueError("forward_ms and backward_ms must both be [stages][micro-batches], non-empty")
    done = {}  # (kind, stage, i) -> end time
    free, busy = [0.0] * pp, [0.0] * pp
    spans = []
    for s, kind, i, dep in _dependency_order(pp, m):
        ready = 0.0 if dep is None else done[dep] + (p2p_ms if dep[1] != s else 0.0)
        start = max(free[s], ready)
        cost = (forward_ms if kind == "F" else backward_ms)[s][i]
        done[(kind, s, i)] = free[s] = start + cost
        busy[s] += cost
        spans.append((s, kind, i, start, start + cost))
    total = max(free)
    return SimResult(total, busy, [1.0 - x / total for x in busy], spans)


def simulate_iteration(stage_ms_per_replica: Sequence[Sequence[Sequence[float]]], backward_share: float = 2 / 3,
                       p2p_ms: float = 0.0, allreduce_ms: float = 0.0) -> float:
    """Iteration time of DP replicas, each ``[stage][micro-batch] -> forward+backward ms``.

    ``backward_share`` splits a micro-batch's stage time into backward and forward (2/3: the
    backward does twice the forward's matrix work).
    """
    times = []
    for replica in stage_ms_per_replica:
        fwd = [[t * (1 - backward_share) for t in stage] for stage in replica]
        bwd = [[t * backward_share for t in stage] for stage in replica]
        times.append(simulate_1f1b(fwd, bwd, p2p_ms).iteration_ms)
    return max(times) + allreduce_ms


def uniform_stages(micro_batch_ms: Sequence[float], pp: int) -> list:
    """``[stage][micro-batch]`` costs when every stage costs the same for a micro-batch."""
    return [list(micro_batch_ms) for _ in range(pp)]


def layer_fractions(split: Sequence[int], pp: int) -> list:
    """Each stage's layers (``split``, as ``pipeline_layer_split`` gives them) as a fraction of the
    latency table's stage, which is profiled with ``num_layers // pp`` layers."""
    per_table_stage = sum(split) // pp
    return [n / per_table_stage for n in split]


class StageCostModel:
    """A micro-batch's forward+backward ms on each pipeline stage.

    Stage ``s`` runs ``layer_fractions[s]`` times the layers of the latency model's stage, so it
    costs that fraction of the model's prediction at the micro-batch's budget (what DST changes),
    times one ``scale``; the last stage adds a cost per token for the output layer and the loss,
    which no budget changes. Splitting a micro-batch's total by the baseline's stage shares instead
    would shrink the last stage with the attention, where at PP=4 its 152K-vocabulary output layer
    is most of it. The first stage's embedding is a lookup, left in the noise: a per-token term
    there could trade places with the layers' term wherever the prediction is near-linear in
    tokens (long-tail packs on two stages), and the fit would no longer say what DST can change.
    """

    def __init__(self, layer_fractions, scale: float, per_token_last: float):
        self.layer_fractions = list(layer_fractions)
        self.scale, self.per_token_last = scale, per_token_last

    def __call__(self, lengths, predicted_ms: float) -> list:
        costs = [self.scale * f * predicted_ms for f in self.layer_fractions]
        costs[-1] += self.per_token_last * sum(lengths)
        return costs

    def to_dict(self) -> dict:
        return {"layer_fractions": self.layer_fractions, "scale": self.scale, "per_token_last": self.per_token_last}

    @classmethod
    def fit(cls, layer_fractions, samples) -> "StageCostModel":
        """Least squares over measured ``(stage, tokens, predicted_ms, measured_ms)`` samples; the
        per-token term is kept non-negative (and left out with a single stage)."""
        last = len(layer_fractions) - 1
        x = np.array([[layer_fractions[s] * pred, tokens * (s == last and last > 0)] for s, tokens, pred, _ in samples],
                     dtype=float)
        y = np.array([m for *_, m in samples])
        coef = np.linalg.lstsq(x, y, rcond=None)[0] if x[:, 1].any() else np.array([0.0, 0.0])
        if not x[:, 1].any() or coef[1] < 0:
            coef = np.array([np.linalg.lstsq(x[:, :1], y, rcond=None)[0][0], 0.0])
        return cls(layer_fractions, float(coef[0]), float(coef[1]))


class FlatRouterCoverage:
    """What the coverage bound ``p`` keeps of a shrink when the router's scores are flat (random
    weights: every earlier block equally likely), for simulations with ``--dst-p``.

    With flat scores a query block with ``c`` candidates keeps ``min(k - 1, c) / c`` of its mass
    at budget ``k`` (the diagonal is always kept and is no candidate; ``ops/router.py:
    coverage_curve``), so a pack's coverage ``C(k)`` is that mean over its query blocks that
    have candidates, and a layer keeps the smallest ``k`` with ``C(k_base) - C(k) <= p``
    (``coverage_bounded_budget``). Duck-types DST's :class:`CoverageFloor` (``budget(lengths)``):
    the floor a run learns from its layers, known here in closed form.
    """

    def __init__(self, k_base: int, p: float, block_size: int):
        self.k_base, self.p, self.block_size = int(k_base), float(p), int(block_size)
        self._cache: dict = {}

    def coverage(self, lengths, k: int) -> float:
        total, rows = 0.0, 0
        for n in lengths:
            blocks = -(-int(n) // self.block_size)
            for c in range(1, blocks):  # query block c + 1 has c earlier blocks
                total += min(k - 1, c) / c
                rows += 1
        return total / rows if rows else 1.0

    def budget(self, lengths) -> int:
        key = tuple(sorted(int(n) for n in lengths))
        if key not in self._cache:
            full = self.coverage(key, self.k_base)
            lo, hi = 1, self.k_base  # coverage is non-decreasing in k: the first k within p
            while lo < hi:
                mid = (lo + hi) // 2
                if full - self.coverage(key, mid) <= self.p + 1e-7:
                    hi = mid
                else:
                    lo = mid + 1
            self._cache[key] = lo
        return self._cache[key]
