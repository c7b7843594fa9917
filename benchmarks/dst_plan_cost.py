"""DST's planning cost per rank as DP grows: one rank's plan (its own replica grown into the
bubbles, what pretrain does) against the whole plan (every replica grown) and the paper's growth
rule, on this machine's CPU, best of ``--repeats``.

    python -m benchmarks.dst_plan_cost --dp 1 16 64 256 --dist bimodal longtail \\
        --latency-table benchmarks/results/e2e/latency_table_h200.json --out benchmarks/results/dst_plan_cost.json

The global batches are drawn as in ``tools/simulate_pipeline.py`` (``--micro-batches`` of
``--micro-batch-size`` samples per replica, packed in arrival order under a cap of
``--micro-batch-size`` x ``--seq-length`` tokens); DST's anchor is the mean, unbounded by ``p``.
A rank's cost is the slowest of the first 8 replicas' own plans.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from megatron_sparsebalance.balance.dst import DSTConfig, PipelineShape, plan_budgets
from megatron_sparsebalance.balance.latency import LatencyModel
from megatron_sparsebalance.balance.sab import SparsityAwareBatcher
from megatron_sparsebalance.data.distributions import sample_lengths


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def measure(latency, dist: str, dp: int, args, rng) -> dict:
    lengths = sample_lengths(dist, dp * args.micro_batches * args.micro_batch_size, args.seq_length, rng).tolist()
    batcher = SparsityAwareBatcher("none", dp, args.micro_batches, latency_model=latency, k_base=args.moba_topk,
                                   micro_batch_tokens=args.micro_batch_size * args.seq_length)
    mbs = batcher.plan(lengths).all_micro_batch_lengths()
    shape = PipelineShape(args.pp, (args.micro_batches,) * dp)
    bubble, anchor = (DSTConfig(anchor="mean", p=None, k_base=args.moba_topk, growth=g) for g in ("bubble", "anchor"))
    return {
        "dist": dist, "dp": dp, "pp": args.pp, "micro_batches": len(mbs),
        "anchor_rule_ms": best_ms(lambda: plan_budgets(mbs, latency, anchor, shape), args.repeats),
        "whole_plan_ms": best_ms(lambda: plan_budgets(mbs, latency, bubble, shape), args.repeats),
        "own_replica_ms": max(best_ms(lambda: plan_budgets(mbs, latency, bubble, shape, replica=r), args.repeats)
                              for r in range(min(dp, 8))),
    }


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--dist", nargs="+", default=["bimodal", "longtail"])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per DP replica")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=65536)
    p.add_argument("--moba-topk", type=int, default=32)
    p.add_argument("--latency-table", required=True)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    latency = LatencyModel.load(args.latency_table)
    rng = np.random.default_rng(args.seed)
    rows = []
    print(f"{'dist':9s} {'DP':>4s} {'anchor rule':>12s} {'whole plan':>11s} {'own replica':>12s}  (ms, best of {args.repeats})")
    for dist in args.dist:
        for dp in args.dp:
            r = measure(latency, dist, dp, args, rng)
            rows.append(r)
            print(f"{dist:9s} {dp:4d} {r['anchor_rule_ms']:12.2f} {r['whole_plan_ms']:11.2f} {r['own_replica_ms']:12.2f}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": platform.processor() or platform.machine(), "args": vars(args), "rows": rows}, f, indent=1)
            f.write("\n")
    return rows


if __name__ == "__main__":
    main()
