"""DST planner (DESIGN.md §4) on hand-computed cases."""
import pytest
import torch

from megatron_sparsebalance.balance.dst import CoverageFloor, DSTConfig, PipelineShape, plan_budgets
from megatron_sparsebalance.balance.latency import LatencyModel


class LinearCost(LatencyModel):
    """A latency model whose answers are easy to compute by hand: sum(L) * (1 + k/4) ms."""

    def _dense_ms(self, total_tokens):
        return total_tokens

    def _attention_ms(self, length, k):
        return length * k / 4


MODEL = LinearCost(candidates=range(1, 17))


def plan(mbs, anchor, model=MODEL, pipeline=None, floor=None, replica=None, **kw):
    """The paper's growth rule unless ``growth`` says otherwise: the hand cases below are its."""
    kw.setdefault("growth", "anchor")
    return plan_budgets(mbs, model, DSTConfig(anchor=anchor, k_base=4, **kw), pipeline, floor, replica)


def test_none_is_the_fixed_budget():
    p = plan([[1], [2], [6]], "none")
    assert p.budgets == [4, 4, 4] and p.anchor_ms is None and p.p is None


@pytest.mark.parametrize(
    "anchor, budgets",
    [
        # base times 2, 4, 12. mean 6: L=1 -> k <= 20 (capped at 4*k_base = 16); L=2 -> 8; L=6 -> none fits
        ("mean", [16, 8, 1]),
        # median 4: L=1 -> k <= 12; L=2 -> k_base; L=6 -> k_min
        ("median", [12, 4, 1]),
        # min 2: L=1 keeps k_base, the others fall to k_min
        ("min", [4, 1, 1]),
        # max 12: L=1 -> 16 (cap), L=2 -> 16 (k <= 20), L=6 keeps k_base
        ("max", [16, 16, 4]),
    ],
)
def test_anchor_by_hand(anchor, budgets):
    p = plan([[1], [2], [6]], anchor)
    assert p.budgets == budgets
    assert all(t <= p.anchor_ms + 1e-9 or k == 1 for t, k in zip(p.predicted_ms, p.budgets))


def test_all_equal_micro_batches_keep_k_base():
    for anchor in ("min", "mean", "max", "median"):
        assert plan([[3, 1]] * 5, anchor).budgets == [4] * 5


def test_one_huge_straggler():
    p = plan([[1], [1], [1], [100]], "mean")  # anchor (3*2 + 200) / 4 = 51.5
    assert p.budgets == [16, 16, 16, 1]
    assert p.notes and "micro-batch 3" in p.notes[0]  # even k_min misses the anchor: said, not hidden


def test_k_min_floor():
    p = plan([[1], [6]], "mean", model=LinearCost(candidates=range(1, 17), k_min=4))
    assert p.budgets[1] == 4  # already at k_min: cannot shrink further
    assert plan([[1], [6]], "mean", model=LinearCost(candidates=range(1, 17), k_min=2)).budgets[1] == 2


def test_candidates_restrict_choices():
    p = plan([[1], [2], [6]], "mean", model=LinearCost(candidates=[1, 2, 4, 6, 10]))
    assert p.budgets == [10, 6, 1]  # L=1: largest <= 20 is 10; L=2: largest <= 8 is 6; L=6: k_min
    with pytest.raises(ValueError, match="--moba-topk=4 is not among"):
        plan([[1]], "mean", model=LinearCost(candidates=[2, 6]))


@pytest.mark.parametrize("kw, match", [(dict(anchor="avg"), "--dst-anchor"), (dict(p=1.5), "--dst-p"),
                                       (dict(growth="idle"), "--dst-growth")])
def test_bad_config_names_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        plan([[1]], **{"anchor": "mean", **kw})


def test_bubble_growth_without_a_pipeline_grows_nothing():
    # One stage, one replica: the iteration is the sum of the micro-batches, so any growth lengthens it.
    p = plan([[1], [2], [6]], "mean", growth="bubble")
    assert p.budgets == [4, 4, 1] and p.iteration_ms == pytest.approx(2 + 4 + 6 * 1.25)


def test_bubble_growth_by_hand_across_replicas():
    # Replica 0: one straggler (L=100: 200 ms at k_base, 125 even at k_min). Replica 1: two L=20
    # micro-batches (40 ms each). Anchor (200 + 40 + 40) / 3 = 93.3: the paper's rule grows both to
    # k=14 (90 ms each), 180 ms on replica 1, longer than the straggler's 125. Under bubble growth
    # replica 1 may use 125 ms: the common level gives k=8 each (60 + 60), the top-up k=9 to the
    # first (65 + 60 = 125).
    shape = PipelineShape(stages=1, replicas=(1, 2))
    assert plan([[100], [20], [20]], "mean").budgets == [1, 14, 14]
    p = plan([[100], [20], [20]], "mean", pipeline=shape, growth="bubble")
    assert p.budgets == [1, 9, 8]
    assert p.iteration_ms == pytest.approx(125.0)
    # The balance figure itself: the paper's rule makes replica 1 the slowest (180 ms).
    assert shape.iteration_ms(plan([[100], [20], [20]], "mean").predicted_ms) == pytest.approx(180.0)
    # Imbalance (max / mean micro-batch time) and replica 1's idle share of the iteration, by hand:
    # fixed budget 200 / 93.3 = 2.14, replica 1 idle 1 - 80/200 = 60%; the paper's rule 125 / 101.7
    # = 1.23 but a 180 ms iteration; bubble growth 125 / 83.3 = 1.50 with replica 1 idle 0%.
    def imbalance(times):
        return max(times) / (sum(times) / len(times))

    fixed = plan([[100], [20], [20]], "none").predicted_ms
    paper = plan([[100], [20], [20]], "mean").predicted_ms
    assert (imbalance(fixed), imbalance(paper), imbalance(p.predicted_ms)) == pytest.approx((2.142857, 1.229508, 1.5))
    assert 1 - sum(fixed[1:]) / shape.iteration_ms(fixed) == pytest.approx(0.6)
    assert 1 - sum(p.predicted_ms[1:]) / p.iteration_ms == pytest.approx(0.0)


def test_bubble_growth_never_lengthens_the_pipeline():
    """Random global batches on 4 stages x 2 replicas: stragglers shrink exactly as the paper's rule
    says, the others grow at most to its budgets, and the simulated iteration is the shrinks' own."""
    import random

    rng = random.Random(0)
    shape = PipelineShape(stages=4, replicas=(4, 4))
    grew = 0
    for _ in range(30):
        mbs = [[rng.choice([1, 1, 2, 3, 40])] for _ in range(8)]
        paper = plan(mbs, "mean", model=MODEL)
        ours = plan(mbs, "mean", model=MODEL, pipeline=shape, growth="bubble")
        shrunk = [min(k, 4) for k in paper.budgets]
        for k_ours, k_paper, k_shrunk in zip(ours.budgets, paper.budgets, shrunk):
            assert k_shrunk <= k_ours <= max(k_paper, 4)
        assert ours.iteration_ms <= shape.iteration_ms([MODEL.predict(mb, k) for mb, k in zip(mbs, shrunk)]) * (1 + 1e-9)
        assert ours.iteration_ms == pytest.approx(shape.iteration_ms(ours.predicted_ms))
        assert ours.predicted_ms == [MODEL.predict(mb, k) for mb, k in zip(mbs, ours.expected_budgets)]
        assert ours.iteration_ms <= shape.iteration_ms(paper.predicted_ms) * (1 + 1e-9)  # never slower than the paper's
        grew += sum(k > s for k, s in zip(ours.budgets, shrunk))
    assert grew > 0  # a pipeline with stragglers has idle time to grow into


def test_a_rank_plans_its_own_replica_alone(monkeypatch):
    """With ``replica`` only that DP replica grows: its budgets are the whole plan's, the other
    replicas keep their shrinks, and the simulations it runs do not grow with DP."""
    import random

    from megatron_sparsebalance.balance import dst

    rng = random.Random(1)
    batch = [[rng.choice([1, 1, 2, 3, 40])] for _ in range(16 * 4)]  # 16 replicas of 4
    shape = PipelineShape(stages=4, replicas=(4,) * 16)
    whole = plan(batch, "mean", pipeline=shape, growth="bubble")
    shrinks = [min(k, 4) for k in plan(batch, "mean").budgets]
    grew = 0
    for r, span in enumerate(shape.ranges(len(batch))):
        own = plan(batch, "mean", pipeline=shape, growth="bubble", replica=r)
        assert [own.budgets[j] for j in span] == [whole.budgets[j] for j in span]
        assert all(own.budgets[j] == shrinks[j] for j in range(len(batch)) if j not in span)
        assert own.iteration_ms == pytest.approx(whole.iteration_ms)
        grew += sum(whole.budgets[j] > shrinks[j] for j in span)
    assert grew > 0
    with pytest.raises(ValueError, match="replica 16 is not one of the pipeline's 16 DP replicas"):
        plan(batch, "mean", pipeline=shape, growth="bubble", replica=16)

    calls = []
    real = dst.simulate_iteration
    monkeypatch.setattr(dst, "simulate_iteration", lambda *a, **k: calls.append(1) or real(*a, **k))

    def simulations(times: int, replica) -> int:  # the same 16 replicas, repeated: DP = 16 x times
        calls.clear()
        plan(batch * times, "mean", pipeline=PipelineShape(4, (4,) * 16 * times), growth="bubble", replica=replica)
        return len(calls)

    assert simulations(1, 0) == simulations(8, 0) > 0  # one rank's plan: independent of DP
    assert simulations(8, None) > 4 * simulations(1, None)  # the whole plan: grows with DP


def test_coverage_floor_learns_what_the_layers_kept():
    floor = CoverageFloor(decay=0.5)
    assert floor.budget([5000]) == 1  # nothing learned: a shrink is expected to be taken as asked
    floor.observe([5000, 100], asked=3, used=20.0)  # refused: the layers kept 20 on average
    assert floor.budget([6000]) == 20 and floor.budget([3000]) == 1  # same bin (4K-8K) / another bin
    floor.observe([7000], asked=3, used=10.0)
    assert floor.budget([5000]) == 15  # EMA: 0.5 * 20 + 0.5 * 10
    floor.observe([5000], asked=12, used=12.0)  # taken as asked, below the estimate
    assert floor.budget([5000]) == 12
    floor.observe([5000], asked=14, used=14.0)  # taken as asked, above it: says nothing new
    assert floor.budget([5000]) == 12
    other = CoverageFloor()
    other.load_state_dict(floor.state_dict())
    assert other.budget([5000]) == 12 and other.budget([3000]) == 1
    with pytest.raises(ValueError, match="coverage-floor bins"):
        CoverageFloor(bins=(10, 20)).load_state_dict(floor.state_dict())


def test_plan_prices_a_refused_shrink_at_the_floor():
    # The straggler (L=100) asks k_min=1 but the layers are known to keep 4 (= k_base): it will run
    # 200 ms, not 125. Replica 1 then has 200 ms to fill and grows to the anchor (k=14, 90 + 90),
    # where without the floor it had 125 (test above: k=9 and 8).
    floor = CoverageFloor()
    floor.observe([100], asked=1, used=4.0)
    shape = PipelineShape(stages=1, replicas=(1, 2))
    p = plan([[100], [20], [20]], "mean", pipeline=shape, growth="bubble", p=0.1, floor=floor)
    assert p.budgets == [1, 14, 14] and p.expected_budgets == [4, 14, 14]
    assert p.predicted_ms == pytest.approx([200.0, 90.0, 90.0]) and p.iteration_ms == pytest.approx(200.0)
    # Without --dst-p the layers take every shrink: the floor is not consulted.
    assert plan([[100], [20], [20]], "mean", pipeline=shape, growth="bubble", p=None, floor=floor).budgets == [1, 9, 8]


def test_pipeline_shape_must_fit_the_plan():
    with pytest.raises(ValueError, match="does not fit 3 micro-batches"):
        plan([[1], [2], [3]], "mean", pipeline=PipelineShape(stages=2, replicas=(2, 2)), growth="bubble")


def test_coverage_fallback_in_the_layer():
    """DST asks a straggler to shrink; a layer whose coverage would drop more than p refuses."""
    from megatron_sparsebalance.ops import BlockLayout, route

    torch.manual_seed(0)
    T = 64 * 12
    q, k = torch.randn(T, 4, 16) * 4, torch.randn(T, 2, 16) * 4  # peaked scores: coverage varies with k
    lay = BlockLayout.from_cu_seqlens(torch.tensor([0, T], dtype=torch.int32), 64, T)
    p = plan([[1], [6]], "mean")
    k_straggler = p.budgets[1]
    _, loose = route(q, k, lay, k_straggler, k_base=4, p=1.0)
    _, tight = route(q, k, lay, k_straggler, k_base=4, p=0.05)
    assert loose.k_used == k_straggler
    assert tight.k_used > k_straggler
    assert tight.coverage_base - tight.coverage_used <= 0.05 + 1e-6
    assert loose.coverage_base - loose.coverage_used > 0.05


def test_plan_cost_benchmark_runs_and_writes_its_rows(tmp_path):
    import json
    import os

    from benchmarks.dst_plan_cost import main

    out = tmp_path / "cost.json"
    table = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "e2e", "latency_table_h200.json")
    rows = main(["--dp", "1", "4", "--dist", "bimodal", "--repeats", "1", "--latency-table", table, "--out", str(out)])
    assert [(r["dist"], r["dp"], r["micro_batches"]) for r in rows] == [("bimodal", 1, 4), ("bimodal", 4, 16)]
    assert all(r[k] > 0 for r in rows for k in ("anchor_rule_ms", "whole_plan_ms", "own_replica_ms"))
    assert json.load(open(out))["rows"] == rows
