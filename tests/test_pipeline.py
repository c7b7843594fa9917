"""Our 1F1B schedule over real gloo processes equals the same model run without pipelining."""
import pytest

from tests import pipeline_cases
from tests.distributed import run_workers

VARIED = [[130, 64], [448], [64, 64, 200], [321]]  # four micro-batches of unequal packs


def run_case(tmp_path, lengths_per_dp, pp, variants=(("budget-2", 2, False),), seed=7):
    """The single-process reference once, then each ``(name, budget, ddp)`` variant of the
    pipeline against it, all in one launch."""
    weights, ref = str(tmp_path / "w.pt"), str(tmp_path / "ref.pt")
    run_workers(pipeline_cases.reference, world=1, args=(weights, ref, lengths_per_dp, seed))
    cases = [(name, (weights, ref, lengths_per_dp, seed, budget, ddp)) for name, budget, ddp in variants]
    run_workers(pipeline_cases.each_case, world=pp * len(lengths_per_dp), pp=pp,
                args=(pipeline_cases.pipelined, cases))


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_equals_single_process(tmp_path, pp):
    run_case(tmp_path, [VARIED], pp)


def test_dp2_pp2_equals_single_process(tmp_path):
    """DP=2 x PP=2 with plain gradients and with megatron-core's DDP (its gradients reduced over
    DP), one reference and one launch for both."""
    run_case(tmp_path, [VARIED, [[200], [64, 64], [100, 28], [512]]], pp=2,
             variants=(("no-ddp", 2, False), ("megatron-ddp", 2, True)))


EDGES = {"one-micro-batch": [[300]], "fewer-than-stages": [[64], [900], [65]],
         "very-unequal": [[1500, 3], [64], [70], [2], [64, 64]]}


def test_no_deadlock_at_the_edges(tmp_path):
    """The EDGES cases at PP=4 and the full budget, each equal to the single process; the three
    share one launch of the reference and one of the pipeline."""
    seed = 7
    refs, pipes = [], []
    for name, lengths in EDGES.items():
        weights, ref = str(tmp_path / f"{name}_w.pt"), str(tmp_path / f"{name}_ref.pt")
        refs.append((name, (weights, ref, [lengths], seed)))
        pipes.append((name, (weights, ref, [lengths], seed, None)))
    run_workers(pipeline_cases.each_case, world=1, args=(pipeline_cases.reference, refs))
    run_workers(pipeline_cases.each_case, world=4, pp=4, args=(pipeline_cases.pipelined, pipes))


def test_imbalance_and_bubble_from_known_spans():
    """The balance figures the benchmarks report, against values computed by hand."""
    run_workers(pipeline_cases.metrics_from_known_spans, world=2, pp=2)


def test_equals_megatron_core_1f1b():
    """megatron-core's own schedule is the oracle: same losses, same gradients."""
    run_workers(pipeline_cases.megatron_oracle, world=2, pp=2, args=([[130, 64], [448], [64, 64, 200]], 3))


def test_pipeline_benchmark_runs_on_cpu(tmp_path):
    """The GPU benchmark's code path (Trainer with megatron-core DDP and optimizer, DST, traces) on gloo."""
    import json

    run_workers(pipeline_cases.trainer_benchmark, world=2, pp=2, args=(str(tmp_path),))
    res = json.load(open(tmp_path / "pipeline_dst_cpu.json"))
    assert [r["dst_anchor"] for r in res["rows"]] == ["none", "mean"]
    for r in res["rows"]:
        assert r["imbalance"] >= 1.0 and r["iter_ms"] > 0 and 0 <= r["bubble"] < 1
        assert all(it["loss"] == it["loss"] for it in r["iterations"])  # never NaN
    assert res["rows"][0]["mean_budget"] == 4
    assert all(d["max_grad_diff"] <= 1e-6 * max(1.0, d["max_grad"]) for d in res["megatron_check"])
    assert (tmp_path / "trace_cpu_mean.json").exists()


def test_model_parallel_groups_are_kept_across_runs():
    """Several runs in one process (benchmarks/e2e.py) share one set of groups: re-creating them
    per run left NCCL communicators allocated on the GPU."""
    run_workers(pipeline_cases.groups_kept_across_calls, world=2, pp=2)
