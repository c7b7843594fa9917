"""The end-to-end benchmark's plumbing on a CPU: uneven pipeline split, a 2-rank smoke run, the merge."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron_sparsebalance.training.launch import torchrun_command
from megatron_sparsebalance.training.step import pipeline_layer_split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pipeline_layer_split_follows_megatron():
    assert pipeline_layer_split(24, 4) == [6, 6, 6, 6]
    assert pipeline_layer_split(24, 4, first=8, last=2) == [8, 7, 7, 2]
    assert pipeline_layer_split(24, 2, last=9) == [15, 9]
    assert pipeline_layer_split(24, 2, first=20, last=4) == [20, 4]
    with pytest.raises(ValueError, match="--decoder-first/last-pipeline-num-layers leaves 15 layers for 2"):
        pipeline_layer_split(24, 4, first=7, last=2)
    with pytest.raises(ValueError, match="--decoder-last-pipeline-num-layers must be >= 1"):
        pipeline_layer_split(24, 4, last=0)
    with pytest.raises(ValueError, match="need --pipeline-model-parallel-size >= 2"):
        pipeline_layer_split(24, 1, last=3)
    with pytest.raises(ValueError, match="must be divisible by --pipeline-model-parallel-size"):
        pipeline_layer_split(24, 5)


def test_uneven_split_reaches_megatron_core():
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megatron_sparsebalance.training.model import MODEL_PRESETS, transformer_config

    cfg = transformer_config(MODEL_PRESETS["qwen2.5-0.5b"], pipeline_parallel_size=4, first_stage_layers=8,
                             last_stage_layers=2)
    assert get_num_layers_to_build(cfg, pp_rank=0) == 8
    assert get_num_layers_to_build(cfg, pp_rank=1) == 7
    assert get_num_layers_to_build(cfg, pp_rank=3) == 2


@pytest.mark.alone  # bounds the simulator's replay by the measured schedule: a timing of this machine
def test_e2e_smoke_run_and_merge(tmp_path):
    """Two gloo ranks, PP=2 with an uneven split: rows of the documented schema, then the merged file."""
    out = str(tmp_path)
    cmd = torchrun_command(2, "benchmarks.e2e", [
        "--layout", "pp2dp1", "--model", "tiny", "--num-layers", "3", "--last-stage-layers", "1",
        "--seq-length", "1024", "--moba-block-size", "64", "--moba-topk", "4", "--dists", "bimodal",
        "--configs", "baseline", "sab+dst", "all+order", "--prewarm", "baseline", "--iters", "2", "--global-batch-size", "8", "--out", out,
        "--extra", "--untie-embeddings-and-output-weights", "--mock-vocab-size", "512"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "e2e_cpu_pp2dp1.json")) as f:
        result = json.load(f)
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"baseline", "sab+dst", "all+order"}  # all+order: every balance piece
    for r in rows.values():
        # issue 43's schema: the split run, micro-batches per replica per measured iteration, weights
        assert sum(r["split"]) == 3 and len(r["split"]) == 2 and r["weights"] == "random"
        assert len(r["micro_batches"]) == 2 and all(len(it) == 1 and it[0] >= 1 for it in r["micro_batches"])
        for key in ("dist", "layout", "config", "iter_ms", "imbalance", "bubble", "overhead_ms", "speedup", "mean_budget",
                    "mean_coverage", "loss", "lm_loss", "simulated_iter_ms", "predicted_ms", "pipeline_ms"):
            assert key in r, key
        assert r["imbalance"] >= 1.0 and 0.0 <= r["bubble"] < 1.0 and r["iter_ms"] >= r["pipeline_ms"] > 0
        # The simulator replays the measured spans: it cannot exceed the measured schedule by much.
        assert 0.5 * r["pipeline_ms"] < r["simulated_iter_ms"] < 1.1 * r["pipeline_ms"]
    assert rows["baseline"]["speedup"] == 1.0 and rows["baseline"]["mean_budget"] == 4.0
    assert rows["sab+dst"]["overhead_ms"] > 0
    # Under --variable-micro-batches the schedule trains on the global batch's per-token loss, which
    # lm_loss reports for every configuration.
    assert rows["all+order"]["loss"] == pytest.approx(rows["all+order"]["lm_loss"], rel=1e-9)
    assert all(r["lm_loss"] > 0 for r in rows.values())
    assert rows["baseline"]["split"] == [2, 1] and rows["baseline"]["micro_batches"] == [[4], [4]]
    assert set(result["ideal"]["bimodal"]) >= {"baseline", "sab", "dst", "sab+dst"}
    assert len(result["iterations"]["bimodal/baseline"]) == 2
    from benchmarks.e2e import main  # the merge needs no process group: in this process, no start-up

    assert main(["--merge", os.path.join(out, "e2e_cpu_pp2dp1.json"), "--out", out, "--tag", "cpu"]) == 0
    with open(os.path.join(out, "e2e_cpu.json")) as f:
        merged_rows = json.load(f)["rows"]
    assert len(merged_rows) == 3 and {r["source"] for r in merged_rows} == {"e2e_cpu_pp2dp1.json"}
    assert os.path.exists(os.path.join(out, "e2e_speedup_cpu.png"))
    assert os.path.exists(os.path.join(out, "e2e_timeline_cpu_pp2dp1_bimodal.png"))


def test_stage_cost_model_recovers_the_output_layer_cost():
    """The simulator's stage model: fitted to measured stage times it recovers the per-layer scale and
    the output layer's per-token cost; only the layer part follows the budget."""
    import random

    from megatron_sparsebalance.pipeline.simulate import StageCostModel, layer_fractions

    fractions = [7 / 6, 8 / 6, 8 / 6, 1 / 6]  # layers 7/8/8/1 against a 6-layer table stage
    assert layer_fractions([7, 8, 8, 1], 4) == fractions
    truth = StageCostModel(fractions, 0.9, 0.02)
    rng = random.Random(0)
    samples = []
    for _ in range(40):
        lengths = [rng.randint(1000, 30000) for _ in range(rng.randint(1, 3))]
        pred = 1e-3 * sum(lengths) * rng.uniform(0.8, 1.6)  # the budget moves the layer part
        samples += [(s, sum(lengths), pred, c * rng.uniform(0.99, 1.01)) for s, c in enumerate(truth(lengths, pred))]
    fit = StageCostModel.fit(fractions, samples)
    assert fit.scale == pytest.approx(0.9, rel=0.02) and fit.per_token_last == pytest.approx(0.02, rel=0.05)
    full, half = fit([20000], 10.0), fit([20000], 5.0)  # half the layer cost: the last stage keeps its logits
    assert half[1] == pytest.approx(full[1] / 2) and half[3] > 0.9 * full[3]
    # a per-token cost the data would make negative is dropped, not fitted below zero
    cheaper_last = [(s, t, p, fractions[s] * p - 1e-5 * t * (s == 3)) for s, t, p, _ in samples]
    flat = StageCostModel.fit(fractions, cheaper_last)
    assert flat.per_token_last == 0.0 and flat.scale == pytest.approx(1.0, rel=0.05)
    # two stages and a prediction linear in tokens (long-tail packs): still the output layer's cost
    two = [2 / 3, 4 / 3]
    linear = [(s, t, 1e-3 * t, c) for s, t, c in
              ((s, t, StageCostModel(two, 0.8, 0.01)([t], 1e-3 * t)[s]) for t in range(8000, 16001, 1000) for s in (0, 1))]
    fit2 = StageCostModel.fit(two, linear)
    assert fit2.scale == pytest.approx(0.8, rel=1e-6) and fit2.per_token_last == pytest.approx(0.01, rel=1e-6)


def test_exclude_names_a_row_everywhere_or_in_one_file():
    from benchmarks.e2e import is_excluded

    row = {"layout": "pp2dp2", "dist": "longtail", "config": "dense"}
    assert is_excluded(row, ["pp2dp2/longtail/dense"]) and is_excluded(row, ["pp2dp2/longtail/dense"], "a.json")
    # a file-qualified entry drops the row of that file only, and never the merged row
    assert is_excluded(row, ["a.json:pp2dp2/longtail/dense"], "a.json")
    assert not is_excluded(row, ["a.json:pp2dp2/longtail/dense"], "b.json")
    assert not is_excluded(row, ["a.json:pp2dp2/longtail/dense"])
    assert not is_excluded(row, ["pp2dp2/bimodal/dense", "pp4dp1/longtail/dense"], "a.json")


def test_merge_pairs_each_row_with_its_own_runs_baseline(tmp_path):
    """A merged row's speedup is over the baseline of the run that measured it (same global batches),
    a later run's row replaces an earlier one of the same key, and runs whose step differs
    (--cross-entropy-loss-fusion) keep their rows and baseline apart."""
    from benchmarks.e2e import merge

    def part(name, extra, rows):
        rows = [dict(layout="pp4dp1", dist="bimodal", config=c, weights="random", iter_ms=ms, pipeline_ms=ms - 20)
                for c, ms in rows]
        setup = dict(layout="pp4dp1", dists=["bimodal"], weights=None, extra=extra)
        path = tmp_path / name
        path.write_text(json.dumps(dict(layout="pp4dp1", rows=rows, iterations={}, traces={}, setup=setup, gpu="X")))
        return str(path)

    files = [part("triton.json", ["--manual-gc", "--latency-table-force"], [("baseline", 990.0), ("lbb", 900.0)]),
             part("old.json", ["--manual-gc"], [("baseline", 1000.0), ("sab+dst", 800.0), ("all", 780.0)]),
             part("new.json", ["--manual-gc"], [("baseline", 1100.0), ("all", 800.0)]),
             part("fused.json", ["--manual-gc", "--cross-entropy-loss-fusion"], [("baseline", 950.0), ("all", 700.0)])]
    merged = merge(files, str(tmp_path), "t")
    assert merged["common_flags"] == ["--manual-gc"]  # labels name the fused run's flag alone
    rows = merged["rows"]
    got = {(r["config"], tuple(r["flags"])): (r["source"], r["speedup"]) for r in rows}
    plain, fused = ("--manual-gc",), ("--manual-gc", "--cross-entropy-loss-fusion")
    assert got == {
        ("baseline", plain): ("new.json", 1.0),
        ("lbb", plain): ("triton.json", 990.0 / 900.0),  # a table flag alone does not make another step
        ("sab+dst", plain): ("old.json", 1000.0 / 800.0),  # its own run's baseline, not new.json's
        ("all", plain): ("new.json", 1100.0 / 800.0),
        ("baseline", fused): ("fused.json", 1.0),
        ("all", fused): ("fused.json", 950.0 / 700.0),
    }
    assert rows[-1]["pipeline_speedup"] == pytest.approx(930.0 / 680.0)
