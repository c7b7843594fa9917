"""DDP vs DiLoCo vs SparseLoCo on the same tokens: final loss and bytes each replica sends.

CPU is enough::

    python -m benchmarks.sparseloco --iters 256 --outer-steps-interval 8 --out benchmarks/results/sparseloco.json

Each method is one ``pretrain`` run (``torchrun``, DP=2 over gloo, the tiny model, mock data, the
same seed, hence the same global batches): ``--dp-comm ddp``, ``diloco`` and ``sparseloco``. The
final loss is the mean training loss of the last ``--loss-window`` iterations (every replica's
local loss, averaged over replicas, as ``pretrain`` logs it); the bytes are ``pretrain``'s own
count (``bytes_sent_total`` of the last iteration: what one replica sends over the run under ring
collectives, equal to the payload at DP=2). Writes ``{"rows": [{"method", "tokens", "final_loss",
"bytes_sent_per_replica"}], ...}`` with the settings and the two checks of the issue:
SparseLoCo sends at least 50x fewer bytes than DDP, and ends within ``--loss-tolerance``
(relative) of DiLoCo's loss.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=256, help="training iterations (same tokens for every method)")
    p.add_argument("--outer-steps-interval", type=int, default=8, help="H for diloco and sparseloco")
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas (processes)")
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--loss-window", type=int, default=8, help="iterations averaged into the final loss")
    p.add_argument("--loss-tolerance", type=float, default=0.05,
                   help="allowed relative excess of SparseLoCo's final loss over DiLoCo's")
    p.add_argument("--sparseloco-topk", type=int, default=32, help="kept entries per 64x64 chunk (of 4096)")
    p.add_argument("--methods", nargs="+", default=["ddp", "diloco", "sparseloco"])
    p.add_argument("--out", default="benchmarks/results/sparseloco.json")
    return p.parse_args(argv)


def run_method(args, method: str, workdir: str) -> list:
    log_dir = os.path.join(workdir, method)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.dp),
           "-m", "megatron_sparsebalance.pretrain", "--model", "tiny", "--untie-embeddings-and-output-weights",
           "--mock-data", "--mock-length-distribution", "fixed", "--mock-samples", "4096", "--mock-vocab-size", "64",
           "--seq-length", str(args.seq_length), "--global-batch-size", str(args.global_batch_size),
           "--moba-block-size", "64", "--moba-topk", "4", "--sparse-attn-impl", "torch", "--dst-anchor", "none",
           "--lr", str(args.lr), "--min-lr", str(args.lr / 10), "--lr-decay-iters", str(args.iters),
           "--train-iters", str(args.iters), "--log-interval", str(max(1, args.iters // 8)), "--log-dir", log_dir,
           "--dp-comm", method, "--outer-steps-interval", str(args.outer_steps_interval),
           "--sparseloco-topk", str(args.sparseloco_topk)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(argv=None) -> int:
    args = parse_args(argv)
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as workdir:
        for method in args.methods:
            history = run_method(args, method, workdir)
            window = history[-args.loss_window:]
            tokens = history[-1]["consumed_samples"] * args.seq_length  # fixed-length samples
            rows.append({"method": method, "tokens": tokens,
                         "final_loss": sum(r["loss"] for r in window) / len(window),
                         "bytes_sent_per_replica": history[-1]["bytes_sent_total"]})
            curves[method] = [r["loss"] for r in history]
            dense = history[-1]["dense_fp32_bytes"] * len(history)
    by = {r["method"]: r for r in rows}
    checks = {}
    if "ddp" in by and "sparseloco" in by:
        ratio = by["ddp"]["bytes_sent_per_replica"] / max(1, by["sparseloco"]["bytes_sent_per_replica"])
        checks["ddp_over_sparseloco_bytes"] = ratio
        checks["sparseloco_50x_fewer_bytes_than_ddp"] = ratio >= 50
    if "diloco" in by and "sparseloco" in by:
        excess = by["sparseloco"]["final_loss"] / by["diloco"]["final_loss"] - 1
        checks["sparseloco_loss_excess_over_diloco"] = excess
        checks[f"sparseloco_within_{args.loss_tolerance:g}_of_diloco"] = excess <= args.loss_tolerance
    result = {"rows": rows, "checks": checks, "dense_fp32_allreduce_bytes_per_replica": dense,
              "settings": vars(args), "loss_curves": curves}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"{'method':<11} {'tokens':>9} {'final loss':>10} {'bytes/replica':>14}")
    for r in rows:
        print(f"{r['method']:<11} {r['tokens']:>9d} {r['final_loss']:>10.4f} {r['bytes_sent_per_replica']:>14d}")
    print(json.dumps(checks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
