"""DST, dynamic sparsity tuning: the budget of every micro-batch of a global batch.

DESIGN.md §4. Every rank runs the same plan from the same lengths, so no communication is
needed: predict each micro-batch's time at the base budget, take an anchor of those times
(min / mean / max / median), and give each micro-batch the largest budget whose predicted time
fits under the anchor. Stragglers shrink; the others grow. The per-layer coverage bound
(``--dst-p``) is applied later, inside each attention layer, because only the layer sees the
router's scores.

The plan predicts a shrunk micro-batch at the budget the layers will keep, not at the one it
asks for: :class:`CoverageFloor` learns, from what the layers did in earlier global batches, how
far the bound lets a micro-batch of a given length shrink.

How far the others grow is ``--dst-growth``:

* ``anchor`` (the paper's rule): every micro-batch below the anchor grows up to it.
* ``bubble`` (default): a micro-batch grows only as far as the simulated 1F1B iteration of the
  whole global batch (``pipeline/simulate.py``, every DP replica, with the plan's predicted
  times) does not get longer than with the shrinks alone. Growth to the anchor assumes the
  stragglers reach the anchor; when they cannot (the coverage bound keeps them above it, or even
  ``k_min`` is too slow), the grown micro-batches add their time to every stage's busy time and
  the iteration gets longer than the fixed budget's. Under ``bubble`` growth only fills time
  the pipeline would idle, which is what the budget headroom is for.
"""
from __future__ import annotations

import bisect
import itertools
import math
import statistics
import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_sparsebalance.balance.sab import DEFAULT_LENGTH_BINS
from megatron_sparsebalance.pipeline.simulate import simulate_iteration, uniform_stages

ANCHORS = ("none", "min", "mean", "max", "median")
GROWTH_RULES = ("bubble", "anchor")


@dataclass
class DSTConfig:
    anchor: str = "mean"
    """--dst-anchor: none (fixed k_base, the baseline), min, mean, max or median."""
    p: Optional[float] = 0.1
    """--dst-p: largest coverage a layer may lose against k_base when shrinking (None: unbounded)."""
    k_base: int = 32
    """--moba-topk: the fixed budget of the baseline."""
    growth: str = "bubble"
    """--dst-growth: how far micro-batches below the anchor grow (bubble or anchor; module doc)."""

    def validate(self) -> "DSTConfig":
        if self.anchor not in ANCHORS:
            raise ValueError(f"--dst-anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if self.growth not in GROWTH_RULES:
            raise ValueError(f"--dst-growth must be one of {GROWTH_RULES}, got {self.growth!r}")
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
    iteration_ms: Optional[float] = None
    """The simulated 1F1B iteration of ``predicted_ms`` (``bubble`` growth only)."""
    expected_budgets: Optional[list] = None
    """The budgets ``predicted_ms`` is priced at: ``budgets``, except a shrink the coverage
    bound is expected to refuse, at the :class:`CoverageFloor` estimate."""


class CoverageFloor:
    """How far the coverage bound lets a micro-batch shrink, learned from what the layers did.

    DST asks a straggler for the budget that would bring it to the anchor; each layer then refuses
    a shrink that loses more than ``p`` of coverage and keeps the smallest budget within ``p``
    (DESIGN.md §4, step 4). That depends on the router's scores, which exist only inside the
    forward, so the plan cannot compute it. It can learn it: per length bin of a micro-batch's
    longest sequence (the one whose query blocks dominate the layer's coverage curve), an EMA of
    the budget the layers kept (mean over layers) whenever they kept more than was asked; a shrink
    they took as asked lowers the estimate to what was asked. Without the estimate, a plan prices
    its stragglers at budgets they never run at, and spends on the others time the stragglers
    never give back.

    Args:
        decay: weight of the old estimate in the EMA.
        bins: upper edges of the length bins (SAB's, ``--sab-length-bins``' default).
    """

    def __init__(self, decay: float = 0.5, bins: Sequence[int] = DEFAULT_LENGTH_BINS):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"the coverage floor's EMA decay must be in [0, 1), got {decay}")
        self.decay, self.edges = decay, tuple(int(b) for b in bins)
        self.values: list = [None] * (len(self.edges) + 1)  # None: nothing learned for the bin yet

    def _bin(self, lengths: Sequence[int]) -> int:
        return bisect.bisect_left(self.edges, max(lengths))

    def budget(self, lengths: Sequence[int]) -> int:
        """The smallest budget the layers are expected to keep for this micro-batch (1: unknown)."""
        value = self.values[self._bin(lengths)]
        return 1 if value is None else math.ceil(value - 1e-6)

    def observe(self, lengths: Sequence[int], asked: int, used: float) -> None:
        """One micro-batch that DST asked to shrink to ``asked``; the layers' mean budget was ``used``."""
        b = self._bin(lengths)
        old = self.values[b]
        if used > asked + 0.5:  # the bound refused the shrink in (some) layers
            self.values[b] = used if old is None else self.decay * old + (1 - self.decay) * used
        elif old is not None and asked < old:
            self.values[b] = float(asked)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "bins": list(self.edges), "values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        if list(state["bins"]) != list(self.edges):
            raise ValueError(f"the checkpoint's coverage-floor bins {state['bins']} differ from {list(self.edges)}")
        self.decay, self.values = float(state["decay"]), list(state["values"])


@dataclass(frozen=True)
class PipelineShape:
    """Where the micro-batches run: ``stages`` pipeline stages per DP replica, and how many of the
    plan's micro-batches (in order) each replica runs. One stage and one replica: no pipeline."""

    stages: int = 1
    replicas: Optional[tuple] = None
    """Micro-batches per DP replica, in the plan's order (None: all on one replica)."""

    def ranges(self, n: int) -> list:
        """``range`` of the plan's micro-batches (``n`` of them) that each DP replica runs."""
        counts = self.replicas or (n,)
        if sum(counts) != n or self.stages < 1:
            raise ValueError(f"pipeline shape {self} does not fit {n} micro-batches")
        starts = itertools.accumulate(counts, initial=0)
        return [range(a, a + c) for a, c in zip(starts, counts)]

    def split(self, values: Sequence[float]) -> list:
        return [[values[j] for j in r] for r in self.ranges(len(values))]

    def iteration_ms(self, stage_ms: Sequence[float]) -> float:
        """Simulated 1F1B iteration when micro-batch ``j`` costs ``stage_ms[j]`` on every stage."""
        return simulate_iteration([uniform_stages(r, self.stages) for r in self.split(stage_ms) if r])


def _anchor(times: Sequence[float], anchor: str) -> float:
    if anchor == "min":
        return min(times)
    if anchor == "max":
        return max(times)
    if anchor == "median":
        return statistics.median(times)
    return sum(times) / len(times)


def plan_budgets(micro_batches: Sequence[Sequence[int]], model, config: DSTConfig,
                 pipeline: Optional[PipelineShape] = None, floor: Optional[CoverageFloor] = None,
                 replica: Optional[int] = None) -> BudgetPlan:
    """Budgets of all micro-batches of a global batch (all DP ranks).

    Args:
        micro_batches: the sequence lengths packed in each micro-batch.
        model: a latency model (docs/INTERFACES.md); its ``align`` picks from its budget
            candidates, at least its ``k_min``. ``k_base`` must be one of the candidates, so
            that a micro-batch at the anchor keeps its base budget.
        pipeline: the stages and DP replicas the micro-batches run on (``bubble`` growth
            simulates them); default: no pipeline, where no growth is free.
        floor: what the coverage bound is expected to keep of a shrink (with ``p`` set);
            default: a shrink is expected to be taken as asked.
        replica: with ``bubble`` growth, grow only this DP replica's micro-batches (the one a
            rank runs); the others keep their shrinks. A replica's growth depends on the
            shrinks of all and on its own micro-batches alone, so its budgets are the same as in
            the whole plan, and the growth costs the same at any DP. Default: every replica.
    """
    config.validate()
    if config.anchor != "none" and config.k_base not in model.candidates:
        raise ValueError(f"--moba-topk={config.k_base} is not among the latency model's budget candidates {model.candidates}")
    if not micro_batches:
        raise ValueError("a global batch needs at least one micro-batch")
    # Priced at calibration scale 1 (LatencyModel.uncalibrated: the plan must not depend on wall-clock
    # measurements); the predictions it reports are scaled back for predicted-vs-measured figures.
    scale = getattr(model, "scale", 1.0)
    model = model.uncalibrated() if hasattr(model, "uncalibrated") else model
    plan = _plan(micro_batches, model, config, pipeline, floor, replica)
    return dataclasses.replace(
        plan, predicted_base_ms=[t * scale for t in plan.predicted_base_ms],
        predicted_ms=[t * scale for t in plan.predicted_ms],
        anchor_ms=plan.anchor_ms * scale if plan.anchor_ms is not None else None,
        iteration_ms=plan.iteration_ms * scale if plan.iteration_ms is not None else None)


def _plan(micro_batches, model, config: DSTConfig, pipeline, floor, replica) -> "BudgetPlan":
    base = [model.predict(mb, config.k_base) for mb in micro_batches]
    if config.anchor == "none":
        return BudgetPlan([config.k_base] * len(base), base, list(base), None, config.k_base, None)
    target = _anchor(base, config.anchor)
    budgets = [model.align(mb, target) for mb in micro_batches]

    def expected(mb, k: int) -> int:
        if floor is None or config.p is None or k >= config.k_base:
            return k
        return min(config.k_base, max(k, floor.budget(mb)))

    if config.growth == "bubble":  # its predictions are at the kept budgets already
        budgets, predicted, iteration_ms = _grow_into_bubbles(micro_batches, model, config.k_base, budgets, target,
                                                              pipeline or PipelineShape(), expected, replica)
    kept = [expected(mb, k) for mb, k in zip(micro_batches, budgets)]
    if config.growth != "bubble":
        predicted, iteration_ms = [model.predict(mb, k) for mb, k in zip(micro_batches, kept)], None
    notes = [f"micro-batch {i}: even k_min={model.k_min} is predicted above the anchor"
             for i, (t, k) in enumerate(zip(predicted, budgets)) if k == model.k_min and t > target]
    return BudgetPlan(budgets, base, predicted, target, config.k_base, config.p, notes, iteration_ms, kept)


def _grow_into_bubbles(micro_batches, model, k_base: int, asked: list, anchor_ms: float,
                       pipeline: PipelineShape, expected, only: Optional[int] = None) -> tuple:
    """Shrinks as ``asked`` (priced at what the layers are ``expected`` to keep); growth only as
    far as the simulated iteration stays as short as with the shrinks alone. Returns
    ``(budgets, predicted ms at what the layers are expected to keep, simulated iteration ms)``.

    The iteration is the slowest DP replica's, and a budget changes only its own replica's
    pipeline: so the limit is the shrinks' iteration over every replica, and each replica grows
    on its own against it (``only``: just that replica). Two passes per replica, both bisections
    (the simulated time never falls when a micro-batch costs more): first its growers rise to one
    common time level, the anchor lowered until the replica fits, so its equal micro-batches get
    equal budgets; then each, lightest first, grows further into whatever idle time its own
    stage slots still have. Every check simulates the one replica, and is cached; each grower's
    budget ladder is priced once.
    """
    budgets = [min(k, k_base) for k in asked]
    times = [model.predict(mb, expected(mb, k)) for mb, k in zip(micro_batches, budgets)]
    replicas = pipeline.ranges(len(times))
    if only is not None and not 0 <= only < len(replicas):
        raise ValueError(f"replica {only} is not one of the pipeline's {len(replicas)} DP replicas")
    one = PipelineShape(pipeline.stages)
    shrinks_ms = pipeline.iteration_ms(times)
    limit = shrinks_ms * (1 + 1e-9)
    growing = [r for i, r in enumerate(replicas) if only is None or i == only]
    # ladder[j]: (budget, ms) of the candidates above k_base that micro-batch j may grow to
    ladder = {j: [(c, model.predict(micro_batches[j], c)) for c in model.candidates if k_base < c <= asked[j]]
              for r in growing for j in r if asked[j] > k_base}
    if not ladder:
        return budgets, times, shrinks_ms

    seen = {}  # (replica, its growers' rungs) -> fits: the bisections revisit the same rungs

    def fits(step: dict, replica: range) -> bool:  # step: {micro-batch: ladder index}
        key = (replica.start, tuple(step.get(j, -1) for j in replica))
        if key not in seen:
            seen[key] = one.iteration_ms([ladder[j][step[j]][1] if j in step else times[j] for j in replica]) <= limit
        return seen[key]

    rung_ms = {j: [t for _, t in rungs] for j, rungs in ladder.items()}

    def at_level(growers: list, level_ms: float) -> dict:  # each grower's highest rung within the level
        step = {}
        for j in growers:
            i = bisect.bisect_right(rung_ms[j], level_ms) - 1
            if i >= 0:
                step[j] = i
        return step

    for replica in growing:
        growers = [j for j in replica if j in ladder]
        if not growers:
            continue
        lo, hi = min(times[j] for j in growers), anchor_ms  # at lo nothing grows: it fits
        if fits(at_level(growers, hi), replica):
            lo = hi
        else:
            for _ in range(16):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if fits(at_level(growers, mid), replica) else (lo, mid)
        step = at_level(growers, lo)
        for j in sorted(growers, key=lambda j: ladder[j][step[j]][1] if j in step else times[j]):
            lo_i, hi_i = step.get(j, -1), len(ladder[j]) - 1  # ladder[j][:lo_i + 1] fit
            while lo_i < hi_i:
                mid = (lo_i + hi_i + 1) // 2
                lo_i, hi_i = (mid, hi_i) if fits({**step, j: mid}, replica) else (lo_i, mid - 1)
            if lo_i >= 0:
                step[j] = lo_i
        for j, i in step.items():
            budgets[j], times[j] = ladder[j][i]
    # Growing one replica moves the iteration by at most the check's 1e-9 slack: no second
    # simulation of every replica for one rank's plan.
    return budgets, times, pipeline.iteration_ms(times) if only is None else shrinks_ms
