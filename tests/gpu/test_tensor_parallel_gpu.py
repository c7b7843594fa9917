"""Tensor and sequence parallelism on GPUs (NCCL, bf16, the Triton router): what the gloo tests
(tests/test_tensor_parallel.py, fp32 on the torch router) cannot show."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.pretrain_cases import TINY, run_pretrain

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_tp2_with_sequence_parallel_trains_with_dst_and_sab(tmp_path, impl):
    """TP=2 with SP on two GPUs in bf16, DST's coverage bound on (the bounded layers route through
    the Triton router with the TP group's reduced curve; the metrics gather stops the run if the TP
    ranks ever used different budgets): 12 iterations, the loss falls."""
    log_dir = str(tmp_path / "tp2")
    rc, err = run_pretrain([*TINY, "--sparse-attn-impl", impl, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--bf16", "--dst-anchor", "mean", "--dst-p", "0.1", "--batching", "sab", "--train-iters", "12",
                            "--kv-channels", "64",  # the GPU kernels take head dim 64 or 128 (tiny's is 32)
                            "--log-dir", log_dir], nproc=2)
    assert rc == 0, err[-3000:]
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 12 and all(r["loss"] == r["loss"] for r in rows)
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3]), [r["loss"] for r in rows]
