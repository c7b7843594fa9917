"""The 1F1B simulator against hand-computed schedules and against the schedule's own order."""
import pytest

from megatron_sparsebalance.pipeline.simulate import one_f_one_b_order, simulate_1f1b, simulate_iteration, uniform_stages


def test_equal_costs_give_the_textbook_time():
    # P stages, M micro-batches, forward f and backward b everywhere: (M + P - 1) * (f + b)
    for pp, m in [(1, 3), (2, 4), (4, 8), (4, 2)]:
        res = simulate_1f1b([[1.0] * m] * pp, [[2.0] * m] * pp)
        assert res.iteration_ms == pytest.approx((m + pp - 1) * 3.0)
        assert res.bubble[0] == pytest.approx(1 - m * 3.0 / ((m + pp - 1) * 3.0))


def test_one_straggler_costs_it_on_every_stage():
    # PP=2, M=3, one micro-batch 5x slower: the 1F1B critical path by hand.
    f = [[1, 5, 1], [1, 5, 1]]
    b = [[2, 10, 2], [2, 10, 2]]
    # stage1: F0 1-2, B0 2-4, F1 6-11 (waits for stage0 F1 at 1-6), B1 11-21, F2 21-22 (stage0 F2 done at 8), B2 22-24
    # stage0: F0 0-1, F1 1-6, B0 6-8, F2 8-9, B1 21-31, B2 31-33
    assert simulate_1f1b(f, b).iteration_ms == pytest.approx(33.0)


def test_order_matches_the_schedule():
    assert one_f_one_b_order(4, 0, 6) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                          ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert one_f_one_b_order(4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert one_f_one_b_order(4, 1, 1) == [("F", 0), ("B", 0)]  # fewer micro-batches than stages


def test_balancing_lowers_the_simulated_time():
    skewed = [10, 1, 1, 1, 1, 1, 1, 10]
    balanced = [3.25] * 8
    assert sum(skewed) == sum(balanced)
    t_skew = simulate_iteration([uniform_stages(skewed, 4)])
    t_bal = simulate_iteration([uniform_stages(balanced, 4)])
    assert t_bal < t_skew
    assert simulate_iteration([uniform_stages(balanced, 4), uniform_stages(skewed, 4)]) == t_skew  # slowest replica


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="forward_ms and backward_ms"):
        simulate_1f1b([[1.0, 2.0]], [[1.0]])


def test_replay_reproduces_a_textbook_run(tmp_path):
    """tools/simulate_pipeline.py --replay on a result file whose times follow 1F1B exactly."""
    import json

    from tools.simulate_pipeline import replay

    pp, m, t = 2, 4, 3.0  # each micro-batch: 3 ms per stage -> 6 ms summed over stages
    result = {"pp": pp, "dp": 1, "rows": [{"dst_anchor": "none", "iterations": [
        {"micro_batch_ms": [t * pp] * m, "iteration_ms": (m + pp - 1) * t}]}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    (row,) = replay([str(path)])
    assert row["simulated_ms"] == pytest.approx((m + pp - 1) * t) and row["rel_err"] == pytest.approx(0.0)


def test_stage_costs_flag_names_what_is_wrong(capsys):
    from tools.simulate_pipeline import main

    cases = ((["--stage-costs", "benchmarks/results/e2e_h200x4.json:pp9dp9/bimodal"], "no stage_costs['pp9dp9/bimodal']"),
             (["--first-stage-layers", "7"], "go with --stage-costs"),
             (["--ablation-split", "8,8,8,0"], "goes with --ablation and one --layouts"),
             (["--ablation", "--layouts", "pp4dp1", "--ablation-split", "8,8,0,8"], "at least one on every stage but the last"),
             (["--ablation", "--layouts", "pp4dp1", "--ablation-split", "8,8,8"], "4 stages of pp4dp1 holding 24 layers"),
             (["--cross-entropy-loss-fusion"], "goes with --ablation"))
    for argv, says in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["--gpus", "4", "--iters", "1", "--warmup", "0", *argv])
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_flat_router_floor_by_hand():
    """Flat scores: a query block with c candidates keeps min(k-1, c)/c of its mass. One sequence of
    4 blocks (candidates 1, 2, 3): C(4) = 1, C(3) = (1 + 1 + 2/3)/3 = 0.889, C(2) = (1 + 1/2 + 1/3)/3
    = 0.611. With p = 0.15 the layers keep k = 3 of a shrink below it; with p = 0.5, k = 2."""
    from megatron_sparsebalance.pipeline.simulate import FlatRouterCoverage

    assert FlatRouterCoverage(4, 0.15, 128).coverage([512], 3) == pytest.approx(8 / 9)
    assert FlatRouterCoverage(4, 0.15, 128).budget([512]) == 3
    assert FlatRouterCoverage(4, 0.5, 128).budget([512]) == 2
    assert FlatRouterCoverage(4, 0.0, 128).budget([512]) == 4


def test_ablation_rows_on_a_small_case():
    """Issue 43's ablation on one PP=4 bimodal case: every row, the split takes layers off the
    output layer's stage and lowers the fixed baseline's time, and the variable count stays
    within the token cap's floor."""
    import numpy as np

    from megatron_sparsebalance.balance.latency import AnalyticLatencyModel
    from megatron_sparsebalance.data.distributions import sample_lengths
    from megatron_sparsebalance.training.model import MODEL_PRESETS
    from tools.simulate_pipeline import ABLATION, simulate_ablation_case

    shape = MODEL_PRESETS["qwen2.5-0.5b"]
    latency = AnalyticLatencyModel(shape, 6, block_size=128, hardware="h200")
    per_token = (AnalyticLatencyModel(shape, 6, block_size=128, hardware="h200", post_process=True).predict([65536], 32)
                 - latency.predict([65536], 32)) / 65536
    rng = np.random.default_rng(0)
    batches = [sample_lengths("bimodal", 16, 65536, rng).tolist() for _ in range(3)]
    res = simulate_ablation_case(batches, latency, shape, 4, 1, 2, 32, 0.1, 128, 131072, 6, per_token, 1)
    assert set(res) == set(ABLATION)
    assert res["baseline"]["split"] == [6, 6, 6, 6] and res["+split"]["split"][-1] < 6
    assert res["baseline+split"]["iter_ms"] < res["baseline"]["iter_ms"]
    assert all(c == [8] for c in res["sab+dst"]["micro_batches"])
    assert all(1 <= c[0] <= 16 for c in res["all"]["micro_batches"])
    assert res["dst"]["mean_budget"] != 32 and res["baseline"]["mean_budget"] == 32


def test_ablation_with_an_output_only_last_stage():
    """--ablation-split 8,8,8,0: the split rows run it, the others keep the even split; with the
    output layer priced above seven layers (the analytic term: ~9 at 64K), a last stage holding it
    alone is faster than one holding it and a layer (7/8/8/1), and the middle stages are not the
    bottleneck either way (8 layers each)."""
    import numpy as np

    from megatron_sparsebalance.balance.latency import AnalyticLatencyModel
    from megatron_sparsebalance.data.distributions import sample_lengths
    from megatron_sparsebalance.training.model import MODEL_PRESETS
    from tools.simulate_pipeline import simulate_ablation_case

    shape = MODEL_PRESETS["qwen2.5-0.5b"]
    latency = AnalyticLatencyModel(shape, 6, block_size=128, hardware="h200")
    per_token = (AnalyticLatencyModel(shape, 6, block_size=128, hardware="h200", post_process=True).predict([65536], 32)
                 - latency.predict([65536], 32)) / 65536
    layer_per_token = latency.predict([65536], 32) / 6 / 65536
    assert per_token > 7 * layer_per_token  # the premise of the case
    rng = np.random.default_rng(0)
    batches = [sample_lengths("bimodal", 16, 65536, rng).tolist() for _ in range(3)]
    configs = {"baseline": ("none", "fixed", "none", "bubble", "even", "light-ends"),
               "baseline+split": ("none", "fixed", "none", "bubble", "auto", "light-ends")}
    run = lambda split: simulate_ablation_case(batches, latency, shape, 4, 1, 2, 32, 0.1, 128, 131072, 6, per_token, 1,
                                               configs=configs, auto_split=split)
    alone, with_a_layer = run([8, 8, 8, 0]), run([7, 8, 8, 1])
    assert alone["baseline+split"]["split"] == [8, 8, 8, 0] and alone["baseline"]["split"] == [6, 6, 6, 6]
    assert alone["baseline"]["iter_ms"] == with_a_layer["baseline"]["iter_ms"]
    assert alone["baseline+split"]["iter_ms"] < with_a_layer["baseline+split"]["iter_ms"] < alone["baseline"]["iter_ms"]


def test_ablation_with_the_fused_loss_prices_a_cheaper_output_layer(tmp_path):
    """--cross-entropy-loss-fusion: both models' output term shrinks by the analytic fused / unfused
    ratio (the profiled one scales its measured, unfused cost by it), so every even-split baseline,
    whose last stage carries the output layer, runs faster than without the flag."""
    import json

    from tools.simulate_pipeline import main

    def rows(*extra):
        out = tmp_path / f"ablation{len(extra)}.json"
        main(["--ablation", "--layouts", "pp4dp1", "--dists", "bimodal", "--iters", "2", "--warmup", "1",
              "--latency-table", "benchmarks/results/e2e/latency_table_h200.json", "--out", str(out), *extra])
        return {(r["model"], r["config"]): r for r in json.loads(out.read_text())["rows"]}

    plain, fused = rows(), rows("--cross-entropy-loss-fusion")
    for model in ("analytic", "profiled"):
        assert fused[model, "baseline"]["iter_ms"] < 0.95 * plain[model, "baseline"]["iter_ms"], model
    assert fused["profiled", "baseline"]["output_cost"].endswith("x analytic fused/unfused")
