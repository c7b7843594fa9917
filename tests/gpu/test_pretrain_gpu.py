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
