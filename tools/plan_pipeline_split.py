"""Choose Megatron-LM's uneven pipeline split from predicted stage costs, and print the stage times.

Draws ``--global-batches`` global batches from ``--dist`` (the run's mock length distribution),
cuts them into micro-batches of ``--micro-batch-size`` samples in arrival order (the fixed-budget
baseline's packing), prices one transformer layer, the embedding and the output layer (+ loss)
over them at ``--moba-topk`` (``balance/split.py: stage_costs_from_model``) and prints the split
with the smallest predicted largest stage time, beside the even split:

    python tools/plan_pipeline_split.py --model qwen2.5-0.5b --pp 4 --seq-length 65536 \\
        --latency-table benchmarks/results/latency_table_h200.json

The printed flags are what ``--decoder-pipeline-split auto`` sets in a run.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

import numpy as np

from megatron_sparsebalance.balance.latency import LatencyModel
from megatron_sparsebalance.balance.split import choose_split, stage_costs_from_model
from megatron_sparsebalance.data.distributions import sample_lengths
from megatron_sparsebalance.training.model import MODEL_PRESETS


def workload(dist: str, global_batches: int, global_batch_size: int, micro_batch_size: int, seq_length: int,
             seed: int) -> list:
    """Micro-batches (packed lengths) of ``global_batches`` global batches, cut in arrival order."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(global_batches):
        lengths = sample_lengths(dist, global_batch_size, seq_length, rng).tolist()
        out += [lengths[i:i + micro_batch_size] for i in range(0, len(lengths), micro_batch_size)]
    return out


def output_per_token(spec: str) -> float:
    """``FILE:KEY`` of a benchmarks/e2e.py results file: its fitted last-stage per-token cost, in the
    latency table's units (``per_token_last / scale``)."""
    path, _, key = spec.rpartition(":")
    with open(path) as f:
        fitted = json.load(f)["stage_costs"][key]
    return fitted["per_token_last"] / fitted["scale"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=65536)
    p.add_argument("--dist", default="bimodal")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--global-batches", type=int, default=8)
    p.add_argument("--moba-topk", type=int, default=32)
    p.add_argument("--moba-block-size", type=int, default=128)
    p.add_argument("--latency-table", default=None, help="profiled table of one stage (default: the analytic model)")
    p.add_argument("--stage-costs", default=None, metavar="FILE:KEY",
                   help="the output layer's per-token cost fitted on a measured run (stage_costs of a "
                        "benchmarks/e2e.py results file); default: the analytic model's output-layer term")
    p.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="the run's loss is megatron-core's fused cross entropy (Megatron-LM's flag): a cheaper output layer")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", action="store_true", help="print the choice as JSON")
    args = p.parse_args(argv)
    shape = MODEL_PRESETS[args.model]
    latency = LatencyModel.load(args.latency_table) if args.latency_table else None
    mbs = workload(args.dist, args.global_batches, args.global_batch_size, args.micro_batch_size, args.seq_length,
                   args.seed)
    costs = stage_costs_from_model(shape, mbs, args.moba_topk, latency,
                                   output_ms_per_token=output_per_token(args.stage_costs) if args.stage_costs else None,
                                   block_size=args.moba_block_size, tensor_parallel_size=args.tp,
                                   fused_cross_entropy=args.cross_entropy_loss_fusion)
    choice = choose_split(shape.num_layers, args.pp, costs)
    result = {"costs": costs.to_dict(), **choice.to_dict(), "flags": choice.flags()}
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    per_it = 1.0 / args.global_batches
    print(f"{args.model}, PP={args.pp}, {args.dist} at {args.seq_length}, {len(mbs)} micro-batches of "
          f"{args.micro_batch_size}: per global batch one layer {costs.layer_ms * per_it:.1f} ms, embedding "
          f"{costs.embedding_ms * per_it:.1f} ms, output layer + loss {costs.output_ms * per_it:.1f} ms "
          f"({costs.output_ms / costs.layer_ms:.1f} layers' worth)")
    for name, split, times in (("even", [shape.num_layers // args.pp] * args.pp if shape.num_layers % args.pp == 0
                                else None, choice.even_stage_ms), ("chosen", choice.split, choice.stage_ms)):
        if split is None:
            continue
        print(f"{name:7s} {'/'.join(map(str, split)):12s} stage ms per global batch: "
              + " ".join(f"{t * per_it:8.1f}" for t in times) + f"   max {max(times) * per_it:8.1f}")
    print("flags: " + (shlex.join(choice.flags()) or "(the even split)")
          + f"  (predicted max stage time {choice.max_ms / choice.even_max_ms:.3f}x the even split's)")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
