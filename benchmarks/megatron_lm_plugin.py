"""Both entries on one GPU machine: Megatron-LM's ``pretrain()`` with our plugin, and the standalone entry.

Runs, on ``--nproc`` GPUs at PP = nproc, with DST + SAB on mock long-tailed data:
1. ``megatron_sparsebalance.megatron_lm`` for ``--iters`` iterations straight;
2. the same for half of them, saving and exiting (``--exit-interval``), then resumed with ``--load``
   to the end: the resumed losses must equal the straight run's bit for bit;
3. ``megatron_sparsebalance.pretrain`` (the standalone entry) with the same flags, data and seed.

Writes ``benchmarks/results/megatron_lm_plugin.json``::

    python -m benchmarks.megatron_lm_plugin --nproc 2 --iters 20 --out benchmarks/results/megatron_lm_plugin.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from megatron_sparsebalance.training.launch import torchrun_command

# One tiny Llama/Qwen-shaped model, the same for both entries (Megatron-LM's names).
SHAPE = ("--num-layers 4 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 4 --num-query-groups 2 "
         "--kv-channels 64 --rotary-base 1000000 --seq-length 4096 --vocab-size 4096").split()
TRAINING = ("--micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
            "--clip-grad 1.0 --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --seed 1234 "
            "--log-interval 1").split()
OURS = ("--mock-data --mock-length-distribution longtail --dst-anchor mean --dst-p 0.1 --batching sab "
        "--moba-block-size 128 --moba-topk 8").split()
# What a Megatron-LM launch script says besides (its defaults differ from a Qwen2 model's); both
# entries take these with the same meaning.
LAUNCH_SCRIPT = ("--group-query-attention --max-position-embeddings 4096 --position-embedding-type rope --swiglu "
                 "--normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear --add-qkv-bias "
                 "--attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02 "
                 "--untie-embeddings-and-output-weights --transformer-impl local --tokenizer-type NullTokenizer").split()
# Megatron-LM's loop only: its fp32 gradient reduction is opt-in (the standalone entry always reduces
# in fp32), and it divides --train-iters by --eval-interval even without evaluation.
MEGATRON_LM = LAUNCH_SCRIPT + "--accumulate-allreduce-grads-in-fp32 --eval-iters 0 --eval-interval 1000".split()
STANDALONE = LAUNCH_SCRIPT


def torchrun(nproc: int, module: str, argv: list, log_path: str) -> None:
    cmd = torchrun_command(nproc, module, argv)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-6000:]
        raise RuntimeError(f"{module} exited with {rc}:\n{tail}")


def read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--impl", default="auto", help="--sparse-attn-impl of both entries")
    p.add_argument("--out", default="benchmarks/results/megatron_lm_plugin.json")
    p.add_argument("--logs", default=None, help="keep the runs' logs here")
    a = p.parse_args(argv)
    from megatron_sparsebalance.compat import MEGATRON_CORE_VERSION

    pp, n, half = a.nproc, a.iters, a.iters // 2
    common = SHAPE + TRAINING + OURS + ["--sparse-attn-impl", a.impl, "--pipeline-model-parallel-size", str(pp),
                                        "--train-iters", str(n), "--lr-decay-iters", str(n)]
    work = tempfile.mkdtemp(prefix="mlm_plugin_")
    logs = a.logs or work
    os.makedirs(logs, exist_ok=True)
    runs = {}
    try:
        straight, halves, alone = (os.path.join(work, d) for d in ("straight", "halves", "standalone"))
        ml = "megatron_sparsebalance.megatron_lm"
        torchrun(pp, ml, common + MEGATRON_LM + ["--save", straight, "--save-interval", str(n)],
                 os.path.join(logs, "megatron_lm_straight.log"))
        torchrun(pp, ml, common + MEGATRON_LM + ["--save", halves, "--save-interval", str(n), "--exit-interval", str(half)],
                 os.path.join(logs, "megatron_lm_first_half.log"))
        torchrun(pp, ml, common + MEGATRON_LM + ["--save", halves, "--load", halves, "--save-interval", str(n)],
                 os.path.join(logs, "megatron_lm_resumed.log"))
        torchrun(pp, "megatron_sparsebalance.pretrain", common + STANDALONE + ["--save", alone],
                 os.path.join(logs, "standalone.log"))
        runs["straight"] = read_jsonl(os.path.join(straight, "sparsebalance_metrics.jsonl"))
        runs["halves"] = read_jsonl(os.path.join(halves, "sparsebalance_metrics.jsonl"))
        runs["standalone"] = read_jsonl(os.path.join(alone, "metrics.jsonl"))
        with open(os.path.join(logs, "megatron_lm_straight.log")) as f:
            line = [ln for ln in f if "sb imbalance" in ln][-1].strip()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    straight_losses = [r["lm_loss"] for r in runs["straight"]]
    resumed = [r["lm_loss_hex"] for r in runs["halves"]]
    bitwise = [r["lm_loss_hex"] for r in runs["straight"]] == resumed
    standalone_losses = [r.get("lm_loss", r["loss"]) for r in runs["standalone"]]
    result = {
        "megatron_core": MEGATRON_CORE_VERSION,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "rows": [
            {"entry": "megatron-lm", "pp": pp, "tp": 1, "iters": n, "losses": straight_losses, "resume_bitwise": bitwise,
             "mean_budget": [r["sb_mean_budget"] for r in runs["straight"]],
             "imbalance": [r["sb_imbalance"] for r in runs["straight"]]},
            {"entry": "standalone", "pp": pp, "tp": 1, "iters": n, "losses": standalone_losses, "resume_bitwise": None,
             "mean_budget": [r["mean_budget"] for r in runs["standalone"]],
             "imbalance": [r["imbalance"] for r in runs["standalone"]]},
        ],
        "max_abs_loss_difference_between_entries": max(abs(x - y) for x, y in zip(straight_losses, standalone_losses)),
        "megatron_lm_log_line": line,
        "command": "python -m benchmarks.megatron_lm_plugin " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"megatron-core {MEGATRON_CORE_VERSION}; Megatron-LM entry losses {straight_losses[0]:.4f} -> "
          f"{straight_losses[-1]:.4f}; resume bitwise: {bitwise}; standalone {standalone_losses[0]:.4f} -> "
          f"{standalone_losses[-1]:.4f}; max |difference| {result['max_abs_loss_difference_between_entries']:.3g}")
    return 0 if bitwise and straight_losses[-1] < straight_losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
