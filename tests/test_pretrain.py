"""The pretrain entry point: training, exact resume, checkpoints, logs, and errors on bad input.

The PP=2 runs of the module (loss and logs, recomputation, the runs the resume is checked against)
share one launch of two ranks: starting the processes costs more than these tiny runs. The resume
itself starts fresh processes, as after a real stop."""
import json
import math
import os
import re

import pytest

from tests import pretrain_cases
from tests.pretrain_cases import run_pretrain
from tests.distributed import launch_cases, once_per_run

PP2 = ["--pipeline-model-parallel-size", "2"]
# samples up to 64 blocks: a budget below a sequence's block count changes which blocks it sees
RECOMPUTE_BASE = pretrain_cases.TINY + PP2 + ["--train-iters", "4", "--seq-length", "4096"]
RECOMPUTE_FLAGS = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return once_per_run(tmp_path_factory, "pretrain-pp2", launch_pp2_runs)


def launch_pp2_runs(root):
    """Every PP=2 run of the module in one launch, but the resume: in a launch of its own, fresh
    processes as after a real stop. ``root / name`` holds a run's logs, ``root / f"{name}.json"``
    its rows."""
    ck = str(root / "ck")

    def run(name, argv):
        return name, pretrain_cases.run, (argv, str(root / f"{name}.json"))

    launch = launch_cases([
        run("falls", pretrain_cases.TINY + PP2 + ["--train-iters", "10", "--tensorboard-dir", str(root / "tb"),
                                                  "--log-dir", str(root / "falls")]),
        run("plain", RECOMPUTE_BASE),
        run("recomputed", RECOMPUTE_BASE + RECOMPUTE_FLAGS),
        run("first", pretrain_cases.TINY + PP2 + ["--train-iters", "20", "--save", ck, "--exit-interval", "10"]),
        run("straight", pretrain_cases.TINY + PP2 + ["--train-iters", "20"]),
        # The same weights on an even split and on a last stage holding the output layer alone.
        run("layout_start", pretrain_cases.TINY + PP2 + ["--train-iters", "1", "--save", str(root / "ck_layout")]),
        run("even_from_start", pretrain_cases.TINY + PP2 + ["--train-iters", "4", "--pretrained-checkpoint",
                                                            str(root / "ck_layout")]),
        run("output_alone", pretrain_cases.TINY + PP2 + ["--train-iters", "4", "--pretrained-checkpoint",
                                                         str(root / "ck_layout"), "--pipeline-model-parallel-layout",
                                                         "Et*2|L", "--log-dir", str(root / "output_alone")]),
    ], world=2, pp=2, done_dir=str(root / "done"), timeout_s=400)
    resumed = launch_cases([run("second", pretrain_cases.TINY + PP2 + ["--train-iters", "20", "--load", ck])],
                           world=2, pp=2, done_dir=str(root / "done_resumed"))
    return launch, resumed, root


def test_pp2_loss_falls_and_logs_parse(pp2):
    launch, _, root = pp2
    launch.check("falls")
    out, tb, log_dir = root / "falls.json", str(root / "tb"), root / "falls"
    rows = json.load(open(out))
    losses = [r["loss"] for r in rows]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    assert all(r["imbalance"] >= 1.0 and 0.0 <= r["bubble"] < 1.0 and r["tflops_per_gpu"] > 0 for r in rows)
    config = json.load(open(log_dir / "config.json"))
    assert config["parallel"]["pipeline_model_parallel_size"] == 2 and config["dst"]["dst_anchor"] == "mean"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb)
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/imbalance", "train/bubble", "train/mean_budget", "train/tflops_per_gpu"):
        assert tag in scalars
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)


def test_a_last_stage_with_the_output_layer_alone_trains_as_an_even_split(pp2):
    """--pipeline-model-parallel-layout "Et*2|L": both transformer layers on stage 0, stage 1 only the
    output layer and loss (megatron-core builds an empty block there); from the same weights and
    data its losses are the even split's."""
    launch, _, root = pp2
    for name in ("layout_start", "even_from_start", "output_alone"):
        launch.check(name)
    even = [r["loss"] for r in json.load(open(root / "even_from_start.json"))]
    alone = [r["loss"] for r in json.load(open(root / "output_alone.json"))]
    assert len(alone) == 4 and alone == pytest.approx(even, rel=1e-5, abs=1e-6)
    config = json.load(open(root / "output_alone" / "config.json"))
    assert config["parallel"]["pipeline_model_parallel_layout"] == "Et*2|L"


def test_recomputed_layers_route_with_the_micro_batch_budget(pp2):
    """Full activation recomputation runs each layer's forward again inside backward: with the
    schedule's budget scope re-opened there, training is the same as without recomputation, loss
    for loss, while DST moves budgets away from --moba-topk (else the test would prove nothing)."""
    launch, _, root = pp2
    launch.check("plain")
    launch.check("recomputed")
    plain, recomputed = root / "plain.json", root / "recomputed.json"
    a, b = json.load(open(plain)), json.load(open(recomputed))
    assert any(r["mean_budget"] != 4 for r in a), [r["mean_budget"] for r in a]
    assert [r["mean_budget"] for r in b] == [r["mean_budget"] for r in a]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5, abs=0)


def test_iteration_line_parses():
    from megatron_sparsebalance.config import parse_config
    from megatron_sparsebalance.pretrain import Metrics

    m = Metrics(parse_config(["--train-iters", "100"]), 0, is_logger=False)
    row = dict(iteration=7, consumed_samples=112, elapsed_ms=1234.5, tflops_per_gpu=321.0, lr=3e-4, loss=2.5, grad_norm=1.25,
               skipped=0, nan=0, imbalance=1.34, bubble=0.12, predicted_ms=1000.0, measured_ms=1100.0, mean_budget=24.5,
               mean_coverage=0.93, sab_ms=1.5, dst_ms=0.25)
    line = m.line(row, 65.0)
    fields = dict(part.strip().rsplit(":", 1) for part in line.split("|")[1:] if ":" in part)
    assert fields["lm loss"].strip() == "2.500000E+00" and float(fields["imbalance"]) == 1.34
    assert re.search(r"iteration\s+7/\s+100", line) and "bubble: 12.0%" in line and "mean budget: 24.5" in line
    assert "step time predicted/measured (ms): 1000.0/1100.0" in line and "ETA: 00:01:05" in line
    assert "SAB/DST planning (ms): 1.50/0.25" in line


def test_resume_is_bitwise_identical(pp2):
    """20 iterations straight against 10, save, stop, resume, 10 more: the same losses, bit for bit."""
    launch, resumed, root = pp2
    launch.check("first")
    launch.check("straight")
    resumed.check("second")
    straight, first, second = (root / f"{n}.json" for n in ("straight", "first", "second"))
    ck = str(root / "ck")
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "10"
    a = [r["loss"] for r in json.load(open(straight))]
    b = [r["loss"] for r in json.load(open(first))] + [r["loss"] for r in json.load(open(second))]
    assert len(a) == len(b) == 20
    assert a == b  # bitwise: same data order, budgets, optimizer state and RNG after the resume


def test_interrupted_checkpoint_is_not_the_latest(gloo_world_of_one, tmp_path):
    pretrain_cases.interrupted_save(str(tmp_path))


def test_killed_run_keeps_the_metrics_of_its_iterations(tmp_path):
    """A run killed without warning (a scheduler's SIGKILL) keeps a metrics.jsonl row for every
    iteration it finished, not nothing: the rows are written as they are logged."""
    import signal
    import subprocess
    import sys
    import time

    log_dir = str(tmp_path / "logs")
    cmd = [sys.executable, "-m", "megatron_sparsebalance.pretrain", *pretrain_cases.TINY, "--train-iters", "100000",
           "--log-dir", log_dir]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**env, "OMP_NUM_THREADS": "1"})
    path = os.path.join(log_dir, "metrics.jsonl")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.isfile(path) and sum(1 for _ in open(path)) >= 3:
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rows = [json.loads(line) for line in open(path) if line.endswith("\n")]
    assert len(rows) >= 3
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(math.isfinite(r["loss"]) and r["elapsed_ms"] > 0 for r in rows)


@pytest.mark.parametrize("extra, match", [
    (["--dst-anchor", "avg"], "--dst-anchor must be one of"),
    (["--dst-p", "1.5"], r"--dst-p must be in \[0, 1\]"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], "--global-batch-size .6. must be divisible"),
    (["--moba-topk", "64"], "--moba-topk .64. is larger than a sequence can use"),
    (["--pipeline-model-parallel-size", "3"], "world size 1 is not divisible by .* = 3"),
    (["--latency-table", "/nonexistent.json"], "--latency-table /nonexistent.json: no such file"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method uniform or block"),
    (["--recompute-modules", "mlp"], "--recompute-modules goes with --recompute-granularity selective"),
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
     "--recompute-modules must be core_attn and/or mlp, got .'layernorm'. .megatron-core's layernorm recompute needs"),
    (["--sparse-attn-impl", "fa4", "--deterministic-mode"], "--sparse-attn-impl fa4 is not deterministic"),
    (["--sparse-attn-impl", "fa4", "--moba-block-size", "64"], "--sparse-attn-impl fa4 needs --moba-block-size in"),
    (["--variable-micro-batches"], "--variable-micro-batches needs --batching hydraulis"),
    (["--batching", "hydraulis", "--micro-batch-count-objective", "simulated"],
     "--micro-batch-count-objective chooses the count of --variable-micro-batches"),
    (["--decoder-pipeline-split", "auto", "--decoder-last-pipeline-num-layers", "1"],
     "--decoder-pipeline-split auto chooses --decoder-first/last-pipeline-num-layers itself"),
    (["--decoder-pipeline-split", "uneven"], "--decoder-pipeline-split must be one of"),
    (["--pipeline-model-parallel-layout", "Et|tL"], "has 2 stages; --pipeline-model-parallel-size is 1"),
    (PP2 + ["--pipeline-model-parallel-layout", "Et|tL", "--decoder-last-pipeline-num-layers", "1"],
     "--pipeline-model-parallel-layout places every layer itself"),
    (PP2 + ["--pipeline-model-parallel-layout", "Ett|Lt"], "L .the output layer and loss. must close the last stage"),
    (PP2 + ["--pipeline-model-parallel-layout", "Et|tmL"], r"layer types \['mtp'\] are not supported"),
    (PP2 + ["--pipeline-model-parallel-layout", "Et|tx"], "Invalid layer character"),
    (PP2 + ["--pipeline-model-parallel-layout", "Et*3|L"], "places 3 transformer layers; --num-layers is 2"),
    (PP2 + ["--pipeline-model-parallel-layout", "E|t*2L"], "every stage but the last needs a transformer layer"),
    (PP2 + ["--decoder-pipeline-split", "auto", "--pipeline-model-parallel-layout", "Et|tL"],
     "--decoder-pipeline-split auto chooses"),
    (["--dst-growth", "critical"], "--dst-growth must be one of .*critical-path"),
])
def test_bad_flags_name_the_flag(extra, match, capsys, monkeypatch):
    rc, err = pretrain_cases.refused_in_process(pretrain_cases.TINY + ["--train-iters", "1"] + extra, capsys, monkeypatch)
    assert rc == 2 and re.search(match, err), err


def test_missing_data_path_and_tokenizer(tmp_path, capsys, monkeypatch):
    """Refused by validation, before any process group: in this process (the CLI's exit path is
    the other run_pretrain tests')."""
    no_mock = [a for a in pretrain_cases.TINY if a != "--mock-data"]
    rc, err = pretrain_cases.refused_in_process(no_mock + ["--train-iters", "1"], capsys, monkeypatch)
    assert rc == 2 and "--data-path is required" in err, err
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    rc, err = pretrain_cases.refused_in_process(no_mock + ["--train-iters", "1", "--data-path", str(data)], capsys, monkeypatch)
    assert rc == 2 and "--tokenizer-model" in err, err


def test_world_not_divisible_by_pipeline_exits_on_every_rank():
    rc, err = run_pretrain(pretrain_cases.TINY + ["--train-iters", "1", "--model", "tiny", "--num-layers", "4",
                                                  "--pipeline-model-parallel-size", "4"], nproc=2)
    assert rc != 0 and "world size 2 is not divisible" in err, err


def test_latency_table_of_another_model_is_refused(tmp_path):
    from megatron_sparsebalance.balance.latency import AnalyticLatencyModel, latency_metadata
    from megatron_sparsebalance.training.model import MODEL_PRESETS

    table = str(tmp_path / "t.json")
    other = MODEL_PRESETS["qwen2.5-0.5b"]
    AnalyticLatencyModel(other, 1, block_size=64, metadata=latency_metadata(other, 64, 1, "float32", "torch", gpu="cpu")).save(table)
    rc, err = run_pretrain(pretrain_cases.TINY + ["--train-iters", "1", "--latency-table", table])
    assert rc == 2 and "model_shape" in err and "--latency-table-force" in err, err


def test_overlong_samples_without_truncation(tmp_path):
    import torch

    from megatron_sparsebalance.data.datasets import write_indexed_dataset

    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, [torch.randint(1, 60, (n,)) for n in (300, 2000, 500, 100)], vocab_size=64)
    no_mock = [a for a in pretrain_cases.TINY if a != "--mock-data"]
    rc, err = run_pretrain(no_mock + ["--train-iters", "1", "--data-path", prefix, "--overlong-samples", "error"])
    assert rc == 2 and "--seq-length" in err and "--overlong-samples" in err, err
