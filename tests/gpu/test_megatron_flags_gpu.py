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
                                                "--kv-channels", "64"]  # the GPU kernels take head dim 64 or 128
    rc, err = run_pretrain(argv, nproc=2)
    assert rc == 0, err[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    assert sorted(d for d in os.listdir(save) if d.startswith("iter_")) == ["iter_0000002", "iter_0000003"]
