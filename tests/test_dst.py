"""DST planner (DESIGN.md §4) on hand-computed cases."""
import pytest
import torch

from megatron_sparsebalance.balance.dst import DSTConfig, plan_budgets
from megatron_sparsebalance.balance.latency import LatencyModel


class LinearCost(LatencyModel):
    """A latency model whose answers are easy to compute by hand: sum(L) * (1 + k/4) ms."""

    def _dense_ms(self, total_tokens):
        return total_tokens

    def _attention_ms(self, length, k):
        return length * k / 4


MODEL = LinearCost(candidates=range(1, 17))


def plan(mbs, anchor, model=MODEL, **kw):
    return plan_budgets(mbs, model, DSTConfig(anchor=anchor, k_base=4, **kw))


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


@pytest.mark.parametrize("kw, match", [(dict(anchor="avg"), "--dst-anchor"), (dict(p=1.5), "--dst-p")])
def test_bad_config_names_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        plan([[1]], **{"anchor": "mean", **kw})


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
