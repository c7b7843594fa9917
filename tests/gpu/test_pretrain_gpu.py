"""pretrain on the GPU in bf16: what the CPU suite (fp32, where megatron keeps no separate main
weights) cannot show."""
from __future__ import annotations

import json
import os

import pytest

from tests.pretrain_cases import TINY, run_pretrain

pytestmark = pytest.mark.gpu

RETRIEVAL = ["--mock-content", "retrieval", "--mock-retrieval-records", "4", "--bf16", "--eval-iters", "2"]


def _eval_loss(log_dir: str, iteration: int) -> float:
    with open(os.path.join(log_dir, "eval.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    (row,) = [r for r in rows if r["iteration"] == iteration]
    return row["loss"]


def test_pretrained_weights_survive_the_first_bf16_step(tmp_path):
    """--pretrained-checkpoint in bf16: after one step at a negligible learning rate the model still
    scores what the checkpoint scores, not what the random initialization does (the optimizer's
    fp32 main weights must be refreshed from the loaded ones, or its first step writes the random
    ones back)."""
    ck = str(tmp_path / "ck")
    rc, err = run_pretrain([*TINY, *RETRIEVAL, "--train-iters", "20", "--save", ck])
    assert rc == 0, err[-3000:]

    def evaluate(name, extra):
        log_dir = str(tmp_path / name)
        rc, err = run_pretrain([*TINY, *RETRIEVAL, "--log-dir", log_dir, *extra])
        assert rc == 0, err[-3000:]
        return log_dir

    loaded = _eval_loss(evaluate("loaded", ["--pretrained-checkpoint", ck, "--train-iters", "0",
                                            "--eval-interval", "100"]), 0)
    random_init = _eval_loss(evaluate("random", ["--train-iters", "0", "--eval-interval", "100"]), 0)
    stepped = _eval_loss(evaluate("stepped", ["--pretrained-checkpoint", ck, "--train-iters", "1", "--eval-interval", "1",
                                              "--lr", "1e-9", "--min-lr", "1e-10", "--lr-warmup-iters", "0"]), 1)
    assert abs(loaded - random_init) > 0.5, (loaded, random_init)  # 20 steps moved the weights measurably
    assert stepped == pytest.approx(loaded, abs=0.02), (stepped, loaded, random_init)


@pytest.mark.multigpu
@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="PP=2 needs two GPUs")
def test_a_last_stage_with_the_output_layer_alone_in_bf16(tmp_path):
    """--pipeline-model-parallel-layout "Et*2|L" on GPUs in bf16 (NCCL between the stages): stage 1
    holds the output layer and loss alone; from the same weights and data its losses are the even
    split's."""
    ck = str(tmp_path / "ck")
    pp2 = [*TINY, "--bf16", "--pipeline-model-parallel-size", "2"]
    rc, err = run_pretrain([*pp2, "--train-iters", "2", "--save", ck], nproc=2)
    assert rc == 0, err[-3000:]

    def losses(name, extra):
        log_dir = str(tmp_path / name)
        rc, err = run_pretrain([*pp2, "--train-iters", "4", "--pretrained-checkpoint", ck, "--log-dir", log_dir, *extra],
                               nproc=2)
        assert rc == 0, err[-3000:]
        return [json.loads(line)["loss"] for line in open(os.path.join(log_dir, "metrics.jsonl"))]

    even = losses("even", [])
    alone = losses("alone", ["--pipeline-model-parallel-layout", "Et*2|L"])
    assert len(alone) == 4 and alone == pytest.approx(even, rel=1e-4)
