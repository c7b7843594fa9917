"""Megatron-LM's launch flags that the CPU refuses (--bf16, --use-distributed-optimizer), on GPUs,
through the standalone entry with the rest of the flag list (tests/megatron_flags_cases.py)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests import megatron_flags_cases as cases
from tests.pretrain_cases import run_pretrain

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="PP=2 needs two GPUs")
def test_flag_list_with_bf16_and_the_distributed_optimizer_at_pp2(tmp_path):
    prefix, save, tb = str(tmp_path / "docs"), str(tmp_path / "ckpt"), str(tmp_path / "tb")
    cases.write_documents(prefix)
    os.makedirs(save)
    argv = cases.flag_list(prefix, save, tb) + ["--bf16", "--use-distributed-optimizer", "--log-dir", str(tmp_path),
                                                "--sparse-attn-impl", "auto",
                                                "--kv-channels", "64",  # the GPU kernels take head dim 64 or 128
                                                "--train-iters", "5"]
    # 3 of 5 iterations, saved at 2 (--save-interval) and at 3 (--exit-interval), then exit
    rc, err = run_pretrain(argv + ["--exit-interval", "3"], nproc=2)
    assert rc == 0, err[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    assert sorted(d for d in os.listdir(save) if d.startswith("iter_")) == ["iter_0000002", "iter_0000003"]

    # Resume from iteration 3 (the distributed optimizer's dp_reshardable state) to 5, against 5 straight.
    def run_to_5(name, load_from):
        log = tmp_path / f"log_{name}"
        os.makedirs(log)
        flags = argv + ["--log-dir", str(log), "--save", load_from, "--load", load_from]
        rc, err = run_pretrain(flags, nproc=2)
        assert rc == 0, err[-3000:]
        return {r["iteration"]: r["loss"] for r in map(json.loads, open(log / "metrics.jsonl"))}

    resumed = run_to_5("resumed", save)
    assert sorted(resumed) == [4, 5]
    straight_dir = str(tmp_path / "ckpt_straight")
    os.makedirs(straight_dir)
    straight = run_to_5("straight", straight_dir)
    assert sorted(straight) == [1, 2, 3, 4, 5]
    assert [straight[i] for i in (1, 2, 3)] == [r["loss"] for r in rows]
    assert [resumed[i] for i in (4, 5)] == [straight[i] for i in (4, 5)]
