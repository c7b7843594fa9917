"""SAB: the estimator, the partition solver against exhaustive optima, plans, the sampler's state."""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os

import numpy as np
import pytest

from megatron_sparsebalance.balance.dst import DSTConfig, plan_budgets
from megatron_sparsebalance.balance.latency import AnalyticLatencyModel
from megatron_sparsebalance.balance.sab import (
    BatchingConfig,
    PartitionError,
    SparsityAwareBatcher,
    SparsityEstimator,
    arrival_order_chunks,
    balanced_partition,
    partition_lower_bound,
    pipeline_order,
    simulated_order,
)
from megatron_sparsebalance.data.distributions import sample_lengths
from megatron_sparsebalance.data.sampler import GlobalBatchSampler
from megatron_sparsebalance.training.ports import free_port

# This module stays free of megatron-core imports: the 2-process test spawns interpreters that
# import it, and on a 2-core machine every second of import counts twice.
K_BASE = 32
QWEN25_05B = dict(hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14, num_query_groups=2,
                  kv_channels=64, vocab_size=151936)


def latency_model():
    return AnalyticLatencyModel(QWEN25_05B, layers_per_stage=6, block_size=128, hardware="h200")


def dst_budgets(plan, model):
    """DST's budgets for a plan, shaped [rank][micro-batch] (what the schedule feeds back)."""
    flat = plan_budgets(plan.all_micro_batch_lengths(), model, DSTConfig(k_base=K_BASE)).budgets
    m = plan.num_micro_batches
    return [flat[r * m:(r + 1) * m] for r in range(plan.dp_size)]


def make_sampler(method="sab", dp=2, m=4, gbs=64, samples=1000, seed=7, cap=None, dist="longtail"):
    model = latency_model()
    lengths = sample_lengths(dist, samples, 16384, np.random.default_rng([seed, 0]))
    batcher = SparsityAwareBatcher(method, dp, m, model, k_base=K_BASE, micro_batch_tokens=cap)
    return GlobalBatchSampler(lengths, gbs, batcher, seed=seed), model


# ---- plans: coverage, no leaks, token caps ----------------------------------------------------


@pytest.mark.parametrize("method", ["sab", "lbb", "none"])
def test_every_sample_once_and_nothing_leaks(method):
    sampler, model = make_sampler(method, samples=700)  # 10 global batches per epoch, 60 dropped
    seen_this_epoch: set = set()
    for step in range(14):  # crosses an epoch boundary
        epoch, start = sampler.epoch, sampler.position
        if start + 64 > 700:
            epoch, start, seen_this_epoch = epoch + 1, 0, set()
        expected = sampler.epoch_order(epoch)[start:start + 64].tolist()
        plan = sampler.next_plan()
        planned = [i for rank in plan.micro_batches for mb in rank for i in mb]
        assert sorted(planned) == sorted(expected), "a plan holds exactly its global batch's samples"
        assert len(planned) == len(set(planned)) == 64
        assert all(len(mb) >= 1 for rank in plan.micro_batches for mb in rank)
        assert not seen_this_epoch & set(planned), "a sample appeared in two global batches of an epoch"
        seen_this_epoch |= set(planned)
        assert plan.tokens == tuple(tuple(sum(plan.length_of[i] for i in mb) for mb in rank) for rank in plan.micro_batches)
        sampler.update(plan, dst_budgets(plan, model))


def test_token_cap_respected_and_infeasible_caps_rejected():
    cap = 24000
    sampler, model = make_sampler("sab", dp=2, m=8, cap=cap)
    for _ in range(5):
        plan = sampler.next_plan()
        assert max(t for rank in plan.tokens for t in rank) <= cap
    lengths = [16000] * 8 + [9000] * 8
    # total 200K tokens fit 8 x 25K, but no two 16K samples fit together under 20K
    with pytest.raises(ValueError, match="--micro-batch-tokens"):
        SparsityAwareBatcher("sab", 1, 4, model, k_base=K_BASE, micro_batch_tokens=20000).plan(lengths)
    with pytest.raises(ValueError, match="--micro-batch-tokens"):  # one sample over the cap
        SparsityAwareBatcher("lbb", 1, 4, model, micro_batch_tokens=15000).plan(lengths)
    with pytest.raises(ValueError, match="--micro-batch-tokens .* must be >= --seq-length"):
        BatchingConfig(micro_batch_tokens=4096).validate(seq_length=8192)
    with pytest.raises(ValueError, match="--batching none"):  # arrival order cannot respect it
        SparsityAwareBatcher("none", 1, 4, model, micro_batch_tokens=40000).plan(lengths)
    with pytest.raises(PartitionError):
        balanced_partition([1.0, 1.0, 1.0], 2, tokens=[5, 5, 5], token_cap=9)


def test_arrival_order_moves_cuts_only_for_the_token_cap():
    model = latency_model()
    lengths = [1000, 30000, 30000, 1000, 1000, 1000]  # even cuts fit: nothing moves
    assert arrival_order_chunks(lengths, 3, 40000) == [[0, 1], [2, 3], [4, 5]]
    # Even cuts would put 30K + 30K together; one cut moves, counts stay as even as they can.
    assert arrival_order_chunks([30000, 30000, 1000, 1000, 1000, 1000], 3, None) == [[0, 1], [2, 3], [4, 5]]
    runs = arrival_order_chunks([30000, 30000, 1000, 1000, 1000, 1000], 3, 40000)
    assert runs == [[0], [1, 2, 3], [4, 5]] or runs == [[0], [1, 2], [3, 4, 5]]
    assert arrival_order_chunks([30000, 30000, 30000], 2, 40000) is None
    plan = SparsityAwareBatcher("none", 1, 3, model, micro_batch_tokens=40000, order="as-planned").plan(
        [30000, 30000, 1000, 1000, 1000, 1000])
    assert [i for mb in plan.micro_batches[0] for i in mb] == list(range(6))  # arrival order kept
    assert max(plan.tokens[0]) <= 40000


def test_bad_flags_name_the_flag():
    model = latency_model()
    with pytest.raises(ValueError, match="--batching must be one of"):
        SparsityAwareBatcher("greedy", 1, 4, model, k_base=K_BASE)
    with pytest.raises(ValueError, match="--micro-batch-order"):
        SparsityAwareBatcher("sab", 1, 4, model, k_base=K_BASE, order="random")
    with pytest.raises(ValueError, match="--global-batch-size"):
        SparsityAwareBatcher("sab", 2, 4, model, k_base=K_BASE).plan([100] * 7)
    with pytest.raises(ValueError, match="latency model"):
        SparsityAwareBatcher("sab", 1, 4, None, k_base=K_BASE)
    with pytest.raises(ValueError, match="--sab-ema"):
        SparsityEstimator(K_BASE, decay=1.0)
    with pytest.raises(ValueError, match="--sab-length-bins"):
        SparsityEstimator(K_BASE, bins=(4096, 1024))


def test_baselines():
    model = latency_model()
    lengths = sample_lengths("bimodal", 64, 32768, np.random.default_rng(3)).tolist()
    none = SparsityAwareBatcher("none", 2, 4, model, k_base=K_BASE, order="as-planned").plan(lengths)
    # arrival order, contiguous chunks of equal size
    assert [i for rank in none.micro_batches for mb in rank for i in mb] == list(range(64))
    assert all(len(mb) == 8 for rank in none.micro_batches for mb in rank)
    lbb = SparsityAwareBatcher("lbb", 2, 4, model, k_base=K_BASE).plan(lengths)
    batcher = SparsityAwareBatcher("sab", 2, 4, model, k_base=K_BASE)
    sab = batcher.plan(lengths)
    tok = [t for rank in lbb.tokens for t in rank]
    assert max(tok) <= 1.01 * partition_lower_bound(lengths, 8), "lbb balances tokens"
    assert sab.max_over_mean() <= lbb.max_over_mean() * (1 + 1e-9)
    assert lbb.max_over_mean() < none.max_over_mean()
    cost, overhead = [batcher.sample_cost(n, K_BASE) for n in lengths], batcher.pack_overhead()
    best = (overhead + partition_lower_bound(cost, 8)) / (overhead + sum(cost) / 8)
    assert sab.max_over_mean() <= max(1.02, best * 1.001), "sab reaches what the largest sample allows"


def test_loads_are_the_latency_models_prediction_of_the_pack():
    """At k_base everywhere, a micro-batch's planned load equals predict(its lengths, k_base)."""
    model = latency_model()
    lengths = sample_lengths("longtail", 48, 32768, np.random.default_rng(5)).tolist()
    plan = SparsityAwareBatcher("sab", 2, 3, model, k_base=K_BASE).plan(lengths)
    for r in range(2):
        for j in range(3):
            assert plan.loads[r][j] == pytest.approx(model.predict(plan.micro_batch_lengths(r, j), K_BASE), rel=1e-9)


def test_sab_beats_lbb_once_budgets_depend_on_length():
    """When DST shrinks long sequences' budgets, balancing tokens is no longer balancing time."""
    model = latency_model()
    est = SparsityEstimator(K_BASE, decay=0.0)
    est.update([2000, 6000, 12000, 20000, 30000], [64, 48, 32, 12, 8])
    rng = np.random.default_rng(11)
    sab_worse = 0
    for _ in range(5):
        lengths = sample_lengths("bimodal", 128, 32768, rng).tolist()
        plans = {m: SparsityAwareBatcher(m, 2, 8, model, estimator=est).plan(lengths) for m in ("sab", "lbb")}
        assert plans["sab"].max_over_mean() < 1.01
        sab_worse += plans["sab"].max_over_mean() > plans["lbb"].max_over_mean()
    assert sab_worse == 0


# ---- the estimator --------------------------------------------------------------------------


def test_estimator_follows_a_stream_of_budgets():
    est = SparsityEstimator(K_BASE, decay=0.8, bins=(1024, 4096, 16384))
    assert [est.estimate(n) for n in (100, 3000, 9000, 50000)] == [K_BASE] * 4
    est.update([3000, 2000], [16, 24])  # mean 20 in bin (1024, 4096]
    assert est.estimate(2500) == pytest.approx(0.8 * 32 + 0.2 * 20)
    assert est.estimate(100) == K_BASE, "a bin without observations keeps its estimate"
    rng = np.random.default_rng(0)
    for step in range(60):
        long_k = 48 if step < 30 else 12  # the stream changes regime half way
        lengths = [int(rng.integers(5000, 16000)) for _ in range(4)] + [int(rng.integers(20000, 60000)) for _ in range(4)]
        budgets = [24 + rng.normal(0, 2) for _ in range(4)] + [long_k + rng.normal(0, 2) for _ in range(4)]
        est.update(lengths, budgets)
        if step == 29:
            assert est.estimate(40000) == pytest.approx(48, abs=2.0)
    assert est.estimate(9000) == pytest.approx(24, abs=2.0)
    assert est.estimate(40000) == pytest.approx(12, abs=2.0), "the EMA followed the new regime"
    assert est.estimate(100) == K_BASE
    with pytest.raises(ValueError):
        est.update([100], [1, 2])


# ---- the solver against exhaustive optima -----------------------------------------------------


def exhaustive_best(w, parts):
    best = np.inf
    for rest in itertools.product(range(parts), repeat=len(w) - 1):  # item 0 in part 0: symmetry
        assign = np.array((0,) + rest)
        best = min(best, np.bincount(assign, weights=w, minlength=parts).max())
    return best


def test_partition_against_exhaustive_optimum():
    rng = np.random.default_rng(2024)
    worst_sab, worst_lpt, sab_better = 1.0, 1.0, 0
    for trial in range(160):
        n, parts = int(rng.integers(4, 10)), int(rng.integers(2, 4))
        w = rng.pareto(1.5, n) + 0.1 if trial % 2 else rng.uniform(1, 10, n)
        opt = exhaustive_best(w, parts)
        sab = max(w[p].sum() for p in map(np.array, balanced_partition(w, parts, tolerance=0.0)))
        lpt = max(w[p].sum() for p in map(np.array, balanced_partition(w, parts, improve=False)))
        assert partition_lower_bound(w, parts) <= opt * (1 + 1e-12)
        assert sab <= lpt * (1 + 1e-12), "the improvement never makes LPT worse"
        sab_better += sab < lpt * (1 - 1e-9)
        worst_sab, worst_lpt = max(worst_sab, sab / opt), max(worst_lpt, lpt / opt)
    print(f"\nworst max/optimum over 160 small cases: sab {worst_sab:.4f}, LPT alone {worst_lpt:.4f}")
    assert worst_sab <= 1.02  # 1.0170 measured; LPT + exchanges without the MULTIFIT restart: 1.0245
    assert worst_sab < worst_lpt and sab_better >= 5, "better than greedy where it matters"


def test_pairing_bound_where_the_pigeonhole_is_loose():
    # [10, 5, 4, 4] in 2 parts: the mean says 11.5; a part holding three of the four weighs 13,
    # two pairs put 10 with a 4 (14): 13, the optimum.
    for w, parts in (([10.0, 5.0, 4.0, 4.0], 2), ([11.0, 11.0, 9.0, 2.0, 2.0], 3)):
        assert partition_lower_bound(w, parts) == exhaustive_best(np.array(w), parts) == 13.0
        assert sum(w) / parts < 13.0
    rng = np.random.default_rng(7)
    for _ in range(300):  # never above the optimum, with as many heavy items as pairs can need
        parts = int(rng.integers(2, 5))
        w = rng.integers(1, 12, int(rng.integers(parts + 1, 2 * parts + 2))).astype(float)
        if parts ** (len(w) - 1) <= 20000:
            assert partition_lower_bound(w, parts) <= exhaustive_best(w, parts) * (1 + 1e-12)


def test_the_benchmarks_missed_batch_is_at_the_pairing_bound():
    """The batch benchmarks/batching.py once counted as missed (bimodal, 32 micro-batches): SAB
    1.0509 against a pigeonhole bound of 1.016. Its 47 long samples (0.36..0.72 x the mean) in 32
    micro-batches force 15 pairs, and their best pairing already weighs 1.0509: no split does
    better, the solver was optimal and the bound loose."""
    from benchmarks.batching import latency_model as qwen3b_stage

    model = qwen3b_stage()
    est = SparsityEstimator(K_BASE)  # the warmed estimates that run recorded
    for length, k in ((1024, 31.44), (2048, 31.46), (4096, 31.6), (32768, 31.43)):
        est.values[est.bin_of(length)] = k
    rng = np.random.default_rng([1234, 1])
    lengths = [sample_lengths("bimodal", 256, 32768, rng).tolist() for _ in range(6)][5]
    batcher = SparsityAwareBatcher("sab", 2, 16, model, estimator=est)
    cost = [batcher.sample_cost(n, est.estimate(n)) for n in lengths]
    overhead = batcher.pack_overhead()
    bound = (overhead + partition_lower_bound(cost, 32)) / (overhead + sum(cost) / 32)
    ratio = batcher.plan(lengths).max_over_mean()
    assert bound > 1.05
    assert ratio <= bound * (1 + 1e-3), "SAB reaches the pairing bound"


@pytest.mark.parametrize("seq_length,seed", [(65536, 104), (65536, 122), (65536, 143), (65536, 219), (73728, 62), (73728, 187)])
def test_sab_within_target_where_the_bound_allows_it(seq_length, seed):
    """64 micro-batches of 4 longtail samples: LPT + exchanges alone left 1.051..1.074 here (a
    sample of ~0.9 x the mean stuck beside a small one), with a bound of 1.0."""
    model = latency_model()
    lengths = sample_lengths("longtail", 256, seq_length, np.random.default_rng(seed)).tolist()
    batcher = SparsityAwareBatcher("sab", 4, 16, model, k_base=K_BASE)
    cost, overhead = [batcher.sample_cost(n, K_BASE) for n in lengths], batcher.pack_overhead()
    bound = (overhead + partition_lower_bound(cost, 64)) / (overhead + sum(cost) / 64)
    assert bound <= 1.05
    assert batcher.plan(lengths).max_over_mean() <= 1.05


def test_solver_is_fast_on_a_256_sample_global_batch():
    model = latency_model()
    lengths = sample_lengths("longtail", 256, 65536, np.random.default_rng(1)).tolist()
    batcher = SparsityAwareBatcher("sab", 4, 8, model, k_base=K_BASE)
    times = []
    for _ in range(5):
        batcher.plan(lengths)
        times.append(batcher.last_solver_ms)
    # the budget is 10 ms (benchmarks/batching.py reports it); loose here for a busy CI machine
    assert sorted(times)[2] < 30.0


def test_pipeline_order_light_ends():
    loads = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    order = pipeline_order(loads, "light-ends")
    assert sorted(order) == list(range(6))
    seq = [loads[j] for j in order]
    assert seq[0] == 1.0 and seq[-1] == 2.0
    assert max(seq) in (seq[2], seq[3]), "the heaviest run in the middle"
    assert [loads[j] for j in pipeline_order(loads, "descending")] == sorted(loads, reverse=True)


def _simulated_ms(stage_loads, order):
    from megatron_sparsebalance.pipeline.simulate import simulate_iteration

    P = len(stage_loads[0])
    return simulate_iteration([[[stage_loads[j][s] for j in order] for s in range(P)]])


def test_simulated_order_on_a_case_worked_by_hand():
    """Two stages, three micro-batches of 6 ms each over the stages: A = (1, 5) loads the last
    stage (its output layer), B = (5, 1) the first, C = (3, 3) both; forward 1/3, backward 2/3 of a
    stage's time. Light-ends sees three equal loads and keeps A, C, B: 13.67 ms. B, C, A: stage 0
    runs B's forward (0-1.67), stage 1 B's forward and backward (to 2.67) while stage 0 runs C's
    forward; then stage 0 B's backward (2.67-6) overlaps C's forward and backward on stage 1 (to
    5.67); A's forward (6-6.33) and C's backward (6.33-8.33) on stage 0, A's forward and backward on
    stage 1 (6.33-11.33), A's backward on stage 0 (to 12.0): 12.0 ms, the best of the six orders."""
    import itertools

    per = [(1.0, 5.0), (5.0, 1.0), (3.0, 3.0)]
    loads = [sum(c) for c in per]
    light = pipeline_order(loads, "light-ends")
    assert light == [0, 2, 1] and _simulated_ms(per, light) == pytest.approx(41 / 3)
    order = pipeline_order(loads, "simulated", per)
    assert order == [1, 2, 0] and _simulated_ms(per, order) == pytest.approx(12.0)
    assert _simulated_ms(per, order) == pytest.approx(min(_simulated_ms(per, o) for o in itertools.permutations(range(3))))


def test_simulated_order_is_never_longer_than_light_ends():
    """Four stages, eight micro-batches whose last stage carries a per-token output cost: the search
    starts from light-ends and keeps only swaps that shorten the simulated iteration."""
    rng = np.random.default_rng(5)
    better = 0
    for _ in range(20):
        tokens = rng.choice([2048, 8192, 65536], size=8, p=[0.5, 0.3, 0.2])
        attention = [(t / 8192.0) ** 1.5 for t in tokens]
        per = [[a, a, a, a + 0.4 * t / 8192.0] for a, t in zip(attention, tokens)]
        loads = [sum(c) for c in per]
        light = pipeline_order(loads, "light-ends")
        order = pipeline_order(loads, "simulated", per)
        assert sorted(order) == list(range(8))
        assert _simulated_ms(per, order) <= _simulated_ms(per, light) + 1e-9
        better += _simulated_ms(per, order) < _simulated_ms(per, light) * 0.999
    assert better >= 5
    assert simulated_order([[1.0, 2.0]], [0]) == [0]


def test_simulated_order_needs_the_stage_costs():
    with pytest.raises(ValueError, match="--micro-batch-order simulated"):
        pipeline_order([1.0, 2.0], "simulated")
    with pytest.raises(ValueError, match="--micro-batch-order"):
        pipeline_order([1.0, 2.0], "fastest")


def test_batcher_with_the_simulated_order_keeps_its_packs():
    """--micro-batch-order simulated reorders each rank's micro-batches, never their contents; with
    stage costs (the output layer on the last stage) the plan's simulated iteration is shorter
    (here 984.8 against 1001.7 ms)."""
    model = latency_model()
    lengths = sample_lengths("bimodal", 16, 65536, np.random.default_rng(3)).tolist()
    plans = {}
    for order in ("light-ends", "simulated"):
        batcher = SparsityAwareBatcher("sab", 1, 8, model, k_base=K_BASE, micro_batch_tokens=65536,
                                       order=order, pipeline_stages=4)
        batcher.stage_costs = lambda lens, ms: [ms, ms, ms, ms + 2e-4 * sum(lens)]
        plans[order] = batcher.plan(lengths)
    light, searched = plans["light-ends"], plans["simulated"]
    assert sorted(light.micro_batches[0]) == sorted(searched.micro_batches[0])
    stage = lambda plan: [[ms, ms, ms, ms + 2e-4 * t] for ms, t in zip(plan.loads[0], plan.tokens[0])]  # noqa: E731
    assert _simulated_ms(stage(searched), range(8)) < _simulated_ms(stage(light), range(8)) * 0.99


# ---- determinism: identical plans on every rank, state restored -------------------------------


def _rank_plans(rank, world, port, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sampler, model = make_sampler("sab", dp=world, m=4)
    prints = []
    for _ in range(4):
        plan = sampler.next_plan()
        prints.append(plan.fingerprint())
        sampler.update(plan, dst_budgets(plan, model))
    prints.append(sampler.batcher.estimator.fingerprint())
    gathered = [None] * world
    dist.all_gather_object(gathered, prints)
    # every rank packs only its own micro-batches, so the union must be the whole global batch
    own = torch.tensor([sum(len(mb) for mb in plan.micro_batches[rank])])
    dist.all_reduce(own)
    if rank == 0:
        queue.put((gathered, int(own)))
    dist.destroy_process_group()


def test_identical_plans_on_every_rank_across_processes():
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_plans, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    gathered, total = queue.get()
    assert gathered[0] == gathered[1]
    assert total == 64
    local, model = make_sampler("sab", dp=2, m=4)  # and the same in this process
    mine = []
    for _ in range(4):
        plan = local.next_plan()
        mine.append(plan.fingerprint())
        local.update(plan, dst_budgets(plan, model))
    assert mine == gathered[0][:4]


def test_sampler_state_round_trip():
    a, model = make_sampler("sab", samples=400)  # 6 batches per epoch
    for _ in range(5):
        plan = a.next_plan()
        a.update(plan, dst_budgets(plan, model))
    state = a.state_dict()
    after = []
    for _ in range(4):  # crosses the epoch boundary
        plan = a.next_plan()
        after.append(plan.fingerprint())
        a.update(plan, dst_budgets(plan, model))
    b, _ = make_sampler("sab", samples=400)
    b.load_state_dict(state)
    assert b.batcher.estimator.fingerprint() != SparsityEstimator(K_BASE).fingerprint()
    resumed = []
    for _ in range(4):
        plan = b.next_plan()
        resumed.append(plan.fingerprint())
        b.update(plan, dst_budgets(plan, model))
    assert resumed == after
    assert b.consumed_samples == a.consumed_samples == 9 * 64
    c, _ = make_sampler("sab", samples=400, seed=8)
    with pytest.raises(ValueError, match="--seed"):
        c.load_state_dict(state)
