"""Megatron-LM's own ``pretrain()`` with our plugin, on one GPU (megatron-core with megatron.training)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_sparsebalance.compat import HAVE_MEGATRON_TRAINING, MEGATRON_CORE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(not HAVE_MEGATRON_TRAINING or MEGATRON_CORE < (0, 19), reason="needs megatron.training (0.19)"),
]


def test_megatron_lm_loop_trains_with_our_schedule_and_logs_our_figures(tmp_path):
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    argv = SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "6", "--lr-decay-iters", "6",
                                                    "--save", str(tmp_path), "--save-interval", "6"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "megatron_sparsebalance.megatron_lm",
           *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = [ln for ln in out.stdout.splitlines() if " iteration " in ln and "lm loss:" in ln]
    assert len(lines) == 6 and all("sb imbalance:" in ln and "sb mean budget:" in ln for ln in lines), lines
    rows = [json.loads(ln) for ln in open(os.path.join(tmp_path, "sparsebalance_metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
    # DST ran: the budgets the layers used moved off --moba-topk for some micro-batch.
    assert any(abs(r["sb_mean_budget"] - 8) > 1e-6 for r in rows)
    assert os.path.exists(os.path.join(tmp_path, "iter_0000006", "sparsebalance.pt"))


def test_megatron_lm_entry_refuses_the_interleaved_schedule():
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING

    argv = SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "2", "--pipeline-model-parallel-size", "1",
                                                    "--num-layers-per-virtual-pipeline-stage", "1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "megatron_sparsebalance.megatron_lm",
           *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "interleaved" in out.stdout + out.stderr


@pytest.mark.parametrize("extra, flag", [
    (["--rampup-batch-size", "2", "2", "8"], "--rampup-batch-size"),
    (["--decrease-batch-size-if-needed"], "--decrease-batch-size-if-needed"),
    (["--context-parallel-size", "2"], "--context-parallel-size"),
    (["--attention-backend", "flash"], "--attention-backend flash selects"),
    (["--num-experts", "4"], "--num-experts"),
    (["--position-embedding-type", "yarn"], "--position-embedding-type yarn"),
])
def test_megatron_lm_parser_flags_we_cannot_run_are_refused_before_any_process_group(extra, flag):
    """Through Megatron-LM's own parser (the names its arguments get there), in this process: the
    refusal comes before ``validate_args`` and ``initialize_megatron``."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, OURS, SHAPE, TRAINING
    from megatron_sparsebalance.megatron_lm import parse_megatron_args

    with pytest.raises(ValueError, match=flag):
        parse_megatron_args(SHAPE + TRAINING + OURS + MEGATRON_LM + ["--train-iters", "2", *extra])


def test_megatron_lm_loop_on_token_files_masks_its_tokenizers_eod_and_evaluates_on_the_split(tmp_path):
    """Megatron-LM's usual data: a .bin/.idx prefix, its tokenizer's EOD for --eod-mask-loss (here
    NullTokenizer's, moved by --null-tokenizer-eod-id), and no --split, so Megatron-LM's default
    969,30,1 holds a validation share that --eval-interval evaluates on."""
    from benchmarks.megatron_lm_plugin import MEGATRON_LM, SHAPE, TRAINING
    from tests import megatron_flags_cases as cases

    prefix = str(tmp_path / "docs")
    cases.write_documents(prefix, count=700)  # EOD = cases.VOCAB - 1, some inside documents
    ours = "--dst-anchor mean --dst-p 0.1 --batching sab --moba-block-size 128 --moba-topk 8".split()
    argv = SHAPE + TRAINING + ours + MEGATRON_LM + [
        "--train-iters", "2", "--lr-decay-iters", "2", "--eval-iters", "1", "--eval-interval", "2",
        "--data-path", prefix, "--eod-mask-loss", "--null-tokenizer-eod-id", str(cases.VOCAB - 1)]
    probe = ("import sys; from megatron.training import get_args; "
             "from megatron_sparsebalance.megatron_lm import checked_config, end_of_document, parse_megatron_args; "
             "parse_megatron_args(sys.argv[1:]); print('EOD', end_of_document(checked_config(get_args())))")
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and f"EOD {cases.VOCAB - 1}" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "megatron_sparsebalance.megatron_lm",
           *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert len([ln for ln in out.stdout.splitlines() if " iteration " in ln and "lm loss:" in ln]) == 2
    assert " validation loss at " in out.stdout, out.stdout[-4000:]
