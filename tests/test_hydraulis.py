"""--batching hydraulis: Hydraulis's two pipeline-aware objectives on cases worked by hand, and
plans with a variable number of micro-batches (balance/sab.py)."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_sparsebalance.balance.latency import AnalyticLatencyModel
from megatron_sparsebalance.balance.sab import (
    BatchingConfig,
    SparsityAwareBatcher,
    assign_replicas,
    balanced_partition,
    choose_micro_batch_count,
    replica_pipeline_cost,
)
from megatron_sparsebalance.data.distributions import sample_lengths

QWEN25_05B = dict(hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14, num_query_groups=2,
                  kv_channels=64, vocab_size=151936)


def test_replicas_minimise_the_largest_sum_plus_warmup_and_cooldown():
    # Costs 10, 4, 4, 4, 4, 2 over 2 replicas of a 4-stage pipeline: a replica costs
    # sum + 3 x max. Whoever holds the 10 pays >= 10 + 30 = 40, reached by {10} alone (the other
    # {4,4,4,4,2} = 18 + 12 = 30). Balancing the sums (14 / 14: {10, 4} and {4, 4, 4, 2}), as SAB's
    # DP level does, costs 14 + 30 = 44.
    w = [10, 4, 4, 4, 4, 2]
    parts = assign_replicas(w, 2, 4)
    assert parts == [[0], [1, 2, 3, 4, 5]]
    costs = [replica_pipeline_cost([w[i] for i in p], 4) for p in parts]
    assert costs == [40.0, 30.0]
    assert max(replica_pipeline_cost([w[i] for i in p], 4) for p in ([0, 1], [2, 3, 4, 5])) == 44.0
    # Without a pipeline (P = 1) the objective is the sum: 14 / 14 is the optimum.
    assert max(sum(w[i] for i in p) for p in assign_replicas(w, 2, 1)) == 14


def test_the_replica_level_improves_on_its_greedy_start_and_keeps_minimum_counts():
    # A minimum of 3 samples per replica (the fixed count's floor) and 6 samples: 3 each.
    w = [5, 5, 1, 1, 1, 1]
    parts = assign_replicas(w, 2, 2, min_count=3)
    assert sorted(len(p) for p in parts) == [3, 3]
    # 5 and 5 apart: each replica 5 + 1 + 1 + 5 = 12; together, 12 + 5 = 17.
    assert max(replica_pipeline_cost([w[i] for i in p], 2) for p in parts) == 12.0


def test_the_micro_batch_count_minimises_heaviest_times_slots():
    # Costs 6, 2, 2, 2, fixed cost c = 1 per pack, 4 stages: (max + c) x (3 + v) is
    # v=1: 13 x 4 = 52; v=2 ({6} {2,2,2}): 7 x 5 = 35; v=3: 7 x 6 = 42; v=4: 7 x 7 = 49.
    v, parts, objective = choose_micro_batch_count([6, 2, 2, 2], [1, 1, 1, 1], 4, overhead=1.0)
    assert (v, objective) == (2, 35.0)
    assert sorted(map(sorted, parts)) == [[0], [1, 2, 3]]
    # No pipeline: one pack pays the fixed cost once (13 x 1 against 7 x 2).
    assert choose_micro_batch_count([6, 2, 2, 2], [1, 1, 1, 1], 1, overhead=1.0)[0] == 1
    # Deep pipeline, equal samples: one per pack (2.5 x 13 = 32.5 against 4.5 x 10 = 45 at v=3).
    v, _, objective = choose_micro_batch_count([2] * 6, [1] * 6, 8, overhead=0.5)
    assert (v, objective) == (6, 32.5)


def test_the_token_cap_bounds_the_count_from_below():
    # 7 tokens under a cap of 4: at least 2 packs; and the 6 (4 tokens) cannot share its pack.
    v, parts, _ = choose_micro_batch_count([6, 2, 2, 2], [4, 1, 1, 1], 1, overhead=1.0, token_cap=4)
    assert v == 2 and sorted(map(sorted, parts)) == [[0], [1, 2, 3]]


def model():
    return AnalyticLatencyModel(QWEN25_05B, layers_per_stage=6, block_size=128, hardware="h200")


def test_variable_plans_carry_each_replicas_count_and_every_sample_once():
    rng = np.random.default_rng(3)
    lengths = sample_lengths("bimodal", 16, 65536, rng).tolist()
    batcher = SparsityAwareBatcher("hydraulis", 2, 4, latency_model=model(), k_base=32, micro_batch_tokens=131072,
                                   pipeline_stages=2, variable_micro_batches=True)
    plan = batcher.plan(lengths)
    counts = plan.micro_batch_counts
    assert len(counts) == 2 and all(c >= 1 for c in counts)
    flat = sorted(i for rank in plan.micro_batches for mb in rank for i in mb)
    assert flat == list(range(16))
    assert all(t <= 131072 for rank in plan.tokens for t in rank)
    assert [len(r) for r in plan.rank_micro_batch_lengths()] == list(counts)
    assert len(plan.all_micro_batch_lengths()) == sum(counts)
    assert [len(r) for r in plan.split_by_rank(list(range(sum(counts))))] == list(counts)
    # Each replica's count is the one its own objective picks from its samples.
    overhead = batcher.pack_overhead()
    for r, rank in enumerate(plan.micro_batches):
        ids = [i for mb in rank for i in mb]
        w = [plan.weights[i] for i in ids]
        v, _, _ = choose_micro_batch_count(w, [lengths[i] for i in ids], 2, overhead, 131072)
        assert counts[r] == v
    if len(set(counts)) > 1:
        with pytest.raises(ValueError, match="micro_batch_counts"):
            plan.num_micro_batches


def test_fixed_count_hydraulis_keeps_the_runs_count():
    rng = np.random.default_rng(5)
    lengths = sample_lengths("longtail", 16, 65536, rng).tolist()
    plan = SparsityAwareBatcher("hydraulis", 2, 4, latency_model=model(), k_base=32, micro_batch_tokens=131072,
                                pipeline_stages=2).plan(lengths)
    assert plan.micro_batch_counts == (4, 4)


def test_variable_micro_batches_needs_hydraulis():
    with pytest.raises(ValueError, match="--variable-micro-batches needs --batching hydraulis"):
        BatchingConfig(batching="sab", variable_micro_batches=True).validate()
    BatchingConfig(batching="hydraulis", variable_micro_batches=True).validate()


def test_hydraulis_product_against_the_simulated_count():
    # Costs 10, 3, 3, 3, 3, fixed cost 0.2, 4 stages. Hydraulis's product: v=1: 22.2 x 4 = 88.8;
    # v=2 ({10} {3,3,3,3}): 12.2 x 5 = 61; v=3 ({10} {3,3} {3,3}): 10.2 x 6 = 61.2; v >= 4 cannot
    # beat 10.2 x 7: it picks 2. In 1F1B the document's pack is paid once per stage and the light
    # packs open and close the pipeline, so the simulated iteration is shorter with 4 packs.
    w, t = [10, 3, 3, 3, 3], [1] * 5
    v, parts, product = choose_micro_batch_count(w, t, 4, overhead=0.2)
    assert (v, product) == (2, pytest.approx(61.0))
    v_sim, _, sim_ms = choose_micro_batch_count(w, t, 4, overhead=0.2, objective="simulated")
    assert v_sim == 4
    from megatron_sparsebalance.balance.sab import pipeline_order
    from megatron_sparsebalance.pipeline.simulate import simulate_iteration, uniform_stages

    loads = [0.2 + sum(w[i] for i in p) for p in parts]
    two = simulate_iteration([uniform_stages([loads[j] for j in pipeline_order(loads)], 4)])
    assert sim_ms < two
    with pytest.raises(ValueError, match="--micro-batch-count-objective must be one of"):
        choose_micro_batch_count(w, t, 4, objective="fastest")
