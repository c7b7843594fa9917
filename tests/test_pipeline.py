"""Our 1F1B schedule over real gloo processes equals the same model run without pipelining.

Starting processes costs more than these bodies: the module runs the single-process references in
one launch, every PP=2 body in one launch of two ranks, and the PP=4 and DP=2 x PP=2 bodies in one
launch of four (regrouped in between); each test checks that its own body passed on every rank."""
import json

import pytest

from tests import pipeline_cases
from tests.distributed import launch_cases, once_per_run, relayout

VARIED = [[130, 64], [448], [64, 64, 200], [321]]  # four micro-batches of unequal packs
SEED = 7
# DP=2 x PP=2 with plain gradients and with megatron-core's DDP (its gradients reduced over DP), also
# in the distributed optimizer's layout with the all-reduce Megatron-LM asks for to save gradients
DP2 = [VARIED, [[200], [64, 64], [100, 28], [512]]]
DP2_VARIANTS = (("no-ddp", 2, False, False), ("megatron-ddp", 2, True, False),
                ("megatron-ddp-sharded-all-reduce", 2, True, True))
# PP=4 at the full budget, each equal to the single process
EDGES = {"one-micro-batch": [[300]], "fewer-than-stages": [[64], [900], [65]],
         "very-unequal": [[1500, 3], [64], [70], [2], [64, 64]]}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return once_per_run(tmp_path_factory, "pipeline", launch_all)


def launch_all(root):
    refs = {}  # name -> (weights, reference, lengths per DP rank)

    def ref(name, lengths_per_dp):
        refs[name] = (str(root / f"{name}_w.pt"), str(root / f"{name}_ref.pt"), lengths_per_dp)

    ref("varied", [VARIED])
    ref("dp2", DP2)
    for name, lengths in EDGES.items():
        ref(name, [lengths])
    reference = launch_cases([(name, pipeline_cases.reference, (w, r, lengths, SEED)) for name, (w, r, lengths) in refs.items()],
                             world=1, done_dir=str(root / "done_ref"))

    def pipelined(name, budget=2, ddp=False, force_all_reduce=False):
        w, r, lengths = refs[name]
        return pipeline_cases.pipelined, (w, r, lengths, SEED, budget, ddp, force_all_reduce)

    bench_dir = root / "bench"
    bench_dir.mkdir()
    pp2 = launch_cases([
        ("varied", *pipelined("varied")),
        ("known-spans", pipeline_cases.metrics_from_known_spans, ()),
        ("known-sleeps", pipeline_cases.figures_from_known_sleeps, ()),
        ("megatron-1f1b", pipeline_cases.megatron_oracle, ([[130, 64], [448], [64, 64, 200]], 3)),
        ("groups-kept", pipeline_cases.groups_kept_across_calls, ()),
        ("benchmark", pipeline_cases.trainer_benchmark, (str(bench_dir),)),
    ], world=2, pp=2, done_dir=str(root / "done_pp2"), timeout_s=400)
    world4 = launch_cases([
        ("varied", *pipelined("varied")),
        *((name, *pipelined(name, budget=None)) for name in EDGES),
        ("regroup", relayout, (1, 2)),
        *((variant, *pipelined("dp2", budget, ddp, all_reduce)) for variant, budget, ddp, all_reduce in DP2_VARIANTS),
    ], world=4, pp=4, done_dir=str(root / "done_w4"), timeout_s=400)
    return dict(reference=reference, pp2=pp2, world4=world4, bench_dir=bench_dir)


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_equals_single_process(launches, pp):
    launches["reference"].check("varied")
    launches["pp2" if pp == 2 else "world4"].check("varied")


def test_dp2_pp2_equals_single_process(launches):
    """DP=2 x PP=2 with plain gradients and with megatron-core's DDP, one reference for both."""
    launches["reference"].check("dp2")
    launches["world4"].check("regroup")
    for variant, *_ in DP2_VARIANTS:
        launches["world4"].check(variant)


def test_no_deadlock_at_the_edges(launches):
    """The EDGES cases at PP=4 and the full budget, each equal to the single process."""
    for name in EDGES:
        launches["reference"].check(name)
        launches["world4"].check(name)


def test_imbalance_and_bubble_from_known_spans(launches):
    """The balance figures the benchmarks report, against values computed by hand."""
    launches["pp2"].check("known-spans")


def test_imbalance_and_bubble_the_schedule_measures_on_known_step_times(launches):
    """The figures of a real 1F1B run whose forward and backward times are set by sleeps."""
    launches["pp2"].check("known-sleeps")


def test_equals_megatron_core_1f1b(launches):
    """megatron-core's own schedule is the oracle: same losses, same gradients."""
    launches["pp2"].check("megatron-1f1b")


def test_pipeline_benchmark_runs_on_cpu(launches):
    """The GPU benchmark's code path (Trainer with megatron-core DDP and optimizer, DST, traces) on gloo."""
    launches["pp2"].check("benchmark")
    out = launches["bench_dir"]
    res = json.load(open(out / "pipeline_dst_cpu.json"))
    assert [r["dst_anchor"] for r in res["rows"]] == ["none", "mean"]
    for r in res["rows"]:
        assert r["imbalance"] >= 1.0 and r["iter_ms"] > 0 and 0 <= r["bubble"] < 1
        assert all(it["loss"] == it["loss"] for it in r["iterations"])  # never NaN
    assert res["rows"][0]["mean_budget"] == 4
    assert all(d["max_grad_diff"] <= 1e-6 * max(1.0, d["max_grad"]) for d in res["megatron_check"])
    assert (out / "trace_cpu_mean.json").exists()


def test_model_parallel_groups_are_kept_across_runs(launches):
    """Several runs in one process (benchmarks/e2e.py) share one set of groups: re-creating them
    per run left NCCL communicators allocated on the GPU."""
    launches["pp2"].check("groups-kept")
