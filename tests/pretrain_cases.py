"""Bodies of the multi-process pretrain tests (importable by spawned workers)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from megatron_sparsebalance.training.launch import torchrun_command

TINY = ["--model", "tiny", "--untie-embeddings-and-output-weights", "--mock-data", "--mock-length-distribution", "longtail",
        "--seq-length", "1024", "--mock-samples", "512", "--mock-vocab-size", "64", "--global-batch-size", "4",
        "--moba-block-size", "64", "--moba-topk", "4", "--sparse-attn-impl", "torch", "--lr", "3e-3", "--min-lr", "1e-4",
        "--lr-decay-iters", "40"]


def run(argv, out_path=None):
    """One rank of ``pretrain`` with ``argv``; rank 0 writes the logged rows to ``out_path``."""
    import torch.distributed as dist

    from megatron_sparsebalance.config import parse_config
    from megatron_sparsebalance.pretrain import pretrain

    rows = pretrain(parse_config(argv))
    if out_path and dist.get_rank() == dist.get_world_size() - 1:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def interrupted_save(root):
    """Save once, then crash in the middle of the next save: the first must stay the latest."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron_sparsebalance.attention import SparseAttentionConfig
    from megatron_sparsebalance.balance.dst import DSTConfig
    from megatron_sparsebalance.training import checkpointing
    from megatron_sparsebalance.training.model import MODEL_PRESETS
    from megatron_sparsebalance.training.trainer import OptimSettings, Trainer

    t = Trainer(MODEL_PRESETS["tiny"], SparseAttentionConfig(moba_block_size=64, sparse_attn_impl="torch"),
                DSTConfig(anchor="none", k_base=2), OptimSettings(lr=1e-3, min_lr=1e-4), 256)
    checkpointing.save_checkpoint(root, 2, t.model, t.optimizer, {})
    real_save = dist_checkpointing.save

    def dies_midway(state, path, *a, **k):
        real_save({"model": state["model"]}, path, *a, **k)  # some shards are on disk ...
        raise RuntimeError("node lost")  # ... and then the job dies

    checkpointing.dist_checkpointing.save = dies_midway
    try:
        checkpointing.save_checkpoint(root, 4, t.model, t.optimizer, {})
    except RuntimeError:
        pass
    finally:
        checkpointing.dist_checkpointing.save = real_save
    assert os.path.isdir(checkpointing.iteration_dir(root, 4))
    assert checkpointing.latest_checkpoint(root) == checkpointing.iteration_dir(root, 2)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(1.0)
    with open(os.path.join(root, checkpointing.LATEST), "w") as f:  # a stale pointer to the torn one
        f.write("4\n")
    try:
        checkpointing.latest_checkpoint(root)
    except ValueError as exc:
        assert "not a complete checkpoint" in str(exc)
    else:
        raise AssertionError("a torn checkpoint was accepted")


def run_pretrain(args, nproc=1):
    """The CLI as a user runs it; returns (exit code, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_sparsebalance.pretrain", *args]
    else:
        cmd = torchrun_command(nproc, "megatron_sparsebalance.pretrain", list(args))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    return p.returncode, p.stderr


def refused_in_process(args, capsys, monkeypatch):
    """``pretrain.main(args)`` in this process, for flags the CLI must refuse before any process
    group or model exists: (exit code, stderr).

    A subprocess per case spends ~6 s of a 2-core CI machine importing megatron-core; the checks
    themselves take milliseconds. Training is replaced by a failure, so flags that slip past the
    checks fail the test here instead of training in pytest's process. The CLI's own exit path
    (``sys.exit(main())``) stays covered by the tests that run it through :func:`run_pretrain`.
    """
    from megatron_sparsebalance import pretrain

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

    def accepted(cfg, *_, **__):
        raise AssertionError("the flags were accepted: training started")

    monkeypatch.setattr(pretrain, "pretrain", accepted)
    try:
        rc = pretrain.main(args)
    except SystemExit as exc:  # argparse refuses a value outside a flag's choices itself
        rc = exc.code
    return rc, capsys.readouterr().err
