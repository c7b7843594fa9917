"""Simulate SparseBalance's pipeline for clusters we cannot rent, and check the model on runs we made.

Two modes:

* ``--replay FILE...``: each measured iteration of ``benchmarks/pipeline_dst.py`` results is
  replayed through the 1F1B model (``pipeline/simulate.py``) from its measured micro-batch times
  (forward+backward summed over stages, split evenly over stages, 1/3 forward, 2/3 backward);
  prints simulated against measured iteration time.
* predict (default): for DP x PP clusters of ``--gpus`` GPUs (``TP`` x ``PP`` x ``DP``), draws
  global batches of ``--micro-batches`` micro-batches of ``--micro-batch-size`` samples per DP
  replica from ``--dist``, plans them as each configuration would (batching none / lbb / sab, DST
  none / mean, growth ``bubble``, and the paper's ``anchor`` growth as ``sab+dst-anchor``; using the
  latency model: ``--latency-table`` or the analytic model) and simulates the iteration. DST here
  is unconstrained by the coverage bound ``p`` (the router's scores do not exist in a simulation),
  so its rows are the ideal DST can reach for these costs.

* ``--ablation``: issue 43's rows, each piece alone and together, on the paper's settings
  (micro-batch 2, global batch 16, 64K cap, p = 0.1 under flat router scores, mean anchor), PP=4
  and PP=2 x DP=2, bimodal and longtail, the analytic model and the profiled table; every stage
  priced apart (its layers' share, the last with the output layer per token:
  ``StageCostModel``), so the split matters as it does on the GPUs. Writes
  ``benchmarks/results/simulate_balance_h200.json`` (``--out``).

    python tools/simulate_pipeline.py --ablation --iters 12 --warmup 3 --micro-batch-tokens 65536 \\
        --latency-table benchmarks/results/latency_table_h200.json --out benchmarks/results/simulate_balance_h200.json
    python tools/simulate_pipeline.py --replay benchmarks/results/pipeline_dst/pipeline_dst_h200x2_longtail.json
    python tools/simulate_pipeline.py --model qwen2.5-3b --pp 4 --tp 2 --gpus 32 64 128 256 512 1024 \\
        --dist bimodal --latency-table benchmarks/results/e2e/latency_table_h200.json --out sim.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Optional, Sequence

import numpy as np

from megatron_sparsebalance.balance.dst import DSTConfig, PipelineShape, plan_budgets
from megatron_sparsebalance.balance.latency import AnalyticLatencyModel, LatencyModel
from megatron_sparsebalance.balance.sab import SparsityAwareBatcher
from megatron_sparsebalance.data.distributions import sample_lengths
from megatron_sparsebalance.balance.split import LayerCosts, choose_split, stage_costs_from_model
from megatron_sparsebalance.pipeline.simulate import (FlatRouterCoverage, StageCostModel, layer_fractions,
                                                       simulate_iteration, uniform_stages)
from megatron_sparsebalance.training.model import MODEL_PRESETS
from megatron_sparsebalance.training.step import pipeline_layer_split
from megatron_sparsebalance.training.tensor_parallel import validate_tensor_parallel

CONFIGS = {  # name: (batching, dst anchor, dst growth)
    "baseline": ("none", "none", "bubble"), "lbb": ("lbb", "none", "bubble"), "sab": ("sab", "none", "bubble"),
    "dst": ("none", "mean", "bubble"), "sab+dst": ("sab", "mean", "bubble"),
    "sab+dst-anchor": ("sab", "mean", "anchor"),
}


def replay(paths) -> list:
    rows = []
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        pp = res["pp"]
        for r in res["rows"]:
            for it in r["iterations"]:
                per_stage = [t / pp for t in it["micro_batch_ms"]]
                m = len(per_stage) // res["dp"]
                replicas = [uniform_stages(per_stage[d * m:(d + 1) * m], pp) for d in range(res["dp"])]
                sim = simulate_iteration(replicas)
                rows.append(dict(file=path, anchor=r["dst_anchor"], measured_ms=it["iteration_ms"], simulated_ms=sim,
                                 rel_err=abs(sim - it["iteration_ms"]) / it["iteration_ms"]))
    return rows


def simulate_configs(batches, latency, pp: int, dp: int, micro_batches: int, k_base: int, warmup: int = 0,
                     configs=CONFIGS, stage_shares=None, micro_batch_tokens=None, stage_costs=None) -> dict:
    """Mean simulated iteration ms of each configuration over the global batches after ``warmup``.

    ``batches``: the global batches' sample lengths (arrival order). Each configuration plans
    them as the run would (SAB or not, DST anchor with ``p`` unconstrained), prices each
    micro-batch with ``latency.predict`` (total over the stages: one stage's prediction times
    ``pp``) and simulates 1F1B. ``stage_shares`` splits a micro-batch's cost over the stages
    (measured shares of an uneven pipeline; default: equal). ``stage_costs(lengths, predicted_ms)``,
    when given, replaces the shares: each stage's ms of a micro-batch from its one-stage prediction
    at its budget (``pipeline/simulate.py: StageCostModel``, which keeps the output layer's cost fixed).
    ``micro_batch_tokens`` is the runs' ``--micro-batch-tokens`` cap.
    """
    shares = stage_shares or [1.0 / pp] * pp
    times = {}
    for name, (batching, anchor, growth) in configs.items():
        batcher = SparsityAwareBatcher(batching, dp, micro_batches, latency_model=latency, k_base=k_base,
                                       micro_batch_tokens=micro_batch_tokens)
        per_iter = []
        for lengths in batches:
            plan = batcher.plan(lengths)
            mbs = plan.all_micro_batch_lengths()
            dst = DSTConfig(anchor=anchor, p=None, k_base=k_base, growth=growth)
            decision = plan_budgets(mbs, latency, dst, PipelineShape(pp, (micro_batches,) * dp))
            budgets = decision.budgets
            m = micro_batches
            # As in pretrain: SAB's estimator learns the budgets DST gave, for the next batches.
            batcher.update(plan, [budgets[d * m:(d + 1) * m] for d in range(dp)])
            if stage_costs is not None:
                per_stage = [stage_costs(mb, t) for mb, t in zip(mbs, decision.predicted_ms)]
                replicas = [[[per_stage[d * m + j][s] for j in range(m)] for s in range(pp)] for d in range(dp)]
            else:
                cost = [pp * t for t in decision.predicted_ms]  # p is None: priced at the budgets asked
                replicas = [[[c * share for c in cost[d * m:(d + 1) * m]] for share in shares] for d in range(dp)]
            per_iter.append(simulate_iteration(replicas))
        times[name] = statistics.mean(per_iter[warmup:])
    return times


# issue 43's ablation: name -> (batching, micro-batch count (fixed, or the objective choosing it),
# DST anchor, DST growth, split, micro-batch order). "+x" rows add one piece to sab+dst; "all" has
# every piece of the first round, with the count objective that simulates better
# ("all-hydraulis-count": with Hydraulis's own); "all+order" adds the simulated order.
ABLATION = {
    "baseline": ("none", "fixed", "none", "bubble", "even", "light-ends"),
    "lbb": ("lbb", "fixed", "none", "bubble", "even", "light-ends"),
    "sab": ("sab", "fixed", "none", "bubble", "even", "light-ends"),
    "dst": ("none", "fixed", "mean", "bubble", "even", "light-ends"),
    "sab+dst": ("sab", "fixed", "mean", "bubble", "even", "light-ends"),
    "+split": ("sab", "fixed", "mean", "bubble", "auto", "light-ends"),
    "+hydraulis": ("hydraulis", "hydraulis", "mean", "bubble", "even", "light-ends"),
    "+hydraulis-fixed-count": ("hydraulis", "fixed", "mean", "bubble", "even", "light-ends"),
    "+hydraulis-simulated-count": ("hydraulis", "simulated", "mean", "bubble", "even", "light-ends"),
    "+critical-path": ("sab", "fixed", "mean", "critical-path", "even", "light-ends"),
    "+order": ("sab", "fixed", "mean", "bubble", "even", "simulated"),
    "all": ("hydraulis", "simulated", "mean", "critical-path", "auto", "light-ends"),
    "all+order": ("hydraulis", "simulated", "mean", "critical-path", "auto", "simulated"),
    "all-hydraulis-count": ("hydraulis", "hydraulis", "mean", "critical-path", "auto", "light-ends"),
    "all-fixed-count": ("hydraulis", "fixed", "mean", "critical-path", "auto", "light-ends"),
    "baseline+split": ("none", "fixed", "none", "bubble", "auto", "light-ends"),
}
LAYOUTS = {"pp4dp1": (4, 1), "pp2dp2": (2, 2)}


def ablation_split(shape, pp: int, latency, table_layers: int, per_token_last: float, batches, mbs: int, k_base: int):
    """The ``auto`` split for a layout: :func:`choose_split` over the baseline's micro-batches of the
    simulated batches, with the same costs the simulation prices stages at."""
    mb_lists = [b[i:i + mbs] for b in batches for i in range(0, len(b), mbs)]
    layer = sum(latency.predict(mb, k_base) for mb in mb_lists) / table_layers
    output = per_token_last * sum(map(sum, mb_lists))
    return choose_split(shape.num_layers, pp, LayerCosts(layer, 0.0, output))


def simulate_ablation_case(batches, latency, shape, pp: int, dp: int, mbs: int, k_base: int, p, block_size: int,
                           micro_batch_tokens: int, table_layers: int, per_token_last: float, warmup: int,
                           configs=ABLATION, auto_split: Optional[Sequence[int]] = None) -> dict:
    """Each configuration of ``configs`` over the same global batches: mean simulated iteration ms
    after ``warmup`` batches, its split, and the micro-batches per replica of every iteration.
    ``auto_split`` replaces the split the ``auto`` configurations would choose (``--ablation-split``)."""
    m = len(batches[0]) // (mbs * dp)
    if auto_split is None:
        auto_split = ablation_split(shape, pp, latency, table_layers, per_token_last, batches, mbs, k_base).split
    even = [shape.num_layers // pp] * pp
    floor = FlatRouterCoverage(k_base, p, block_size) if p is not None else None
    out = {}
    for name, (batching, count, anchor, growth, split_mode, order) in configs.items():
        split = list(auto_split) if split_mode == "auto" else even
        stages = StageCostModel([n / table_layers for n in split], 1.0, per_token_last)
        batcher = SparsityAwareBatcher(batching, dp, m, latency_model=latency, k_base=k_base,
                                       micro_batch_tokens=micro_batch_tokens, pipeline_stages=pp, order=order,
                                       variable_micro_batches=count != "fixed",
                                       count_objective="hydraulis" if count == "fixed" else count)
        batcher.stage_costs = stages
        dst = DSTConfig(anchor=anchor, p=p, k_base=k_base, growth=growth)
        times, counts, budgets = [], [], []
        for lengths in batches:
            plan = batcher.plan(lengths)
            mb_lengths = plan.all_micro_batch_lengths()
            shape_ = PipelineShape(pp, plan.micro_batch_counts, stages if growth == "critical-path" else None)
            decision = plan_budgets(mb_lengths, latency, dst, shape_, floor if anchor != "none" else None)
            kept = decision.expected_budgets or decision.budgets
            batcher.update(plan, plan.split_by_rank(kept))  # SAB's estimator learns the budgets kept
            per_stage = [stages(mb, t) for mb, t in zip(mb_lengths, decision.predicted_ms)]
            per_rank = plan.split_by_rank(per_stage)
            times.append(simulate_iteration([[[c[s] for c in rank] for s in range(pp)] for rank in per_rank]))
            counts.append(list(plan.micro_batch_counts))
            budgets.append(statistics.mean(kept))
        out[name] = {"iter_ms": statistics.mean(times[warmup:]), "split": split, "micro_batches": counts[warmup:],
                     "mean_budget": statistics.mean(budgets[warmup:])}
    return out


def ablation(args) -> list:
    """Issue 43's rows for every layout, distribution and latency model (module doc)."""
    shape = MODEL_PRESETS[args.model]
    models = [("analytic", None)]
    if args.latency_table:
        models.append(("profiled", args.latency_table))

    def output_term(fused):  # the analytic model's output layer and loss, ms per token
        costs = stage_costs_from_model(shape, [[args.seq_length]], args.moba_topk, None,
                                       block_size=args.moba_block_size, hardware="h200", fused_cross_entropy=fused)
        return costs.output_ms / args.seq_length

    rows = []
    for model_name, table in models:
        for layout in args.layouts:
            pp, dp = LAYOUTS[layout]
            table_layers = shape.num_layers // pp
            if table is None:
                latency = AnalyticLatencyModel(shape, table_layers, block_size=args.moba_block_size, hardware="h200")
                per_token = output_term(args.cross_entropy_loss_fusion)
                source = "analytic output-layer term"
            else:
                path = table if pp == 4 else table.replace(".json", f"_pp{pp}.json")
                latency = LatencyModel.load(path)
                table_layers = int(latency.metadata.get("layers_per_stage", table_layers))
                with open(args.stage_costs_file) as f:
                    fitted = json.load(f)["stage_costs"][f"{layout}/bimodal"]
                per_token = fitted["per_token_last"] / fitted["scale"]
                source = f"{args.stage_costs_file}:{layout}/bimodal (measured)"
                if args.cross_entropy_loss_fusion:
                    # The measured runs' loss was unfused: their output cost scaled by the analytic
                    # model's fused / unfused ratio (0.78 at 0.5B's shapes; 4xH200 measured 0.78-0.79).
                    per_token *= output_term(True) / output_term(False)
                    source += " x analytic fused/unfused"
            for dist in args.dists:
                rng = np.random.default_rng(args.seed)
                batches = [sample_lengths(dist, args.global_batch_size, args.seq_length, rng).tolist()
                           for _ in range(args.warmup + args.iters)]
                res = simulate_ablation_case(batches, latency, shape, pp, dp, args.micro_batch_size, args.moba_topk,
                                             None if args.dst_p < 0 else args.dst_p, args.moba_block_size,
                                             args.micro_batch_tokens or args.micro_batch_size * args.seq_length,
                                             table_layers, per_token, args.warmup, auto_split=args.ablation_split)
                base, base_split = res["baseline"]["iter_ms"], res["baseline+split"]["iter_ms"]
                for name, r in res.items():
                    rows.append(dict(model=model_name, latency=table or "analytic", output_cost=source, layout=layout,
                                     pp=pp, dp=dp, dist=dist, config=name, speedup=base / r["iter_ms"],
                                     speedup_over_baseline_split=base_split / r["iter_ms"], **r))
                print(f"{model_name:8s} {layout} {dist:8s} " + "  ".join(
                    f"{n} {base / r['iter_ms']:.3f}x" for n, r in res.items()), flush=True)
    return rows


def stage_costs_of(args):
    """``--stage-costs FILE:KEY``: the per-token cost of the last stage fitted on a measured run
    (``stage_costs[KEY]`` of a ``benchmarks/e2e.py`` results file), in the table's units, on this
    layout's layer split; None without the flag (every stage costs the same)."""
    if not args.stage_costs:
        return None
    path, _, key = args.stage_costs.rpartition(":")
    try:
        with open(path) as f:
            fitted = json.load(f).get("stage_costs", {})[key]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--stage-costs {args.stage_costs}: no stage_costs[{key!r}] in {path or '(no file)'} "
                         f"({type(e).__name__}); give FILE:LAYOUT/DIST of a merged benchmarks/e2e.py results file") from None
    shape = MODEL_PRESETS[args.model]
    split = pipeline_layer_split(shape.num_layers, args.pp, args.first_stage_layers, args.last_stage_layers)
    # The fit's scale maps the run's table to its measured times; here the table's units are kept.
    return StageCostModel(layer_fractions(split, args.pp), 1.0, fitted["per_token_last"] / fitted["scale"])


def predict(args, latency, stage_costs=None) -> list:
    rows = []
    for gpus in args.gpus:
        if gpus % (args.tp * args.pp):
            raise SystemExit(f"--gpus {gpus} is not a multiple of --tp x --pp = {args.tp * args.pp}")
        dp = gpus // (args.tp * args.pp)
        rng = np.random.default_rng(args.seed)
        batches = [sample_lengths(args.dist, dp * args.micro_batches * args.micro_batch_size, args.seq_length, rng).tolist()
                   for _ in range(args.warmup + args.iters)]
        times = simulate_configs(batches, latency, args.pp, dp, args.micro_batches, args.moba_topk, args.warmup,
                                 micro_batch_tokens=args.micro_batch_tokens or args.micro_batch_size * args.seq_length,
                                 stage_costs=stage_costs)
        for name, t in times.items():
            rows.append(dict(gpus=gpus, dp=dp, pp=args.pp, tp=args.tp, sequence_parallel=args.sequence_parallel,
                             dist=args.dist, config=name, iter_ms=t,
                             speedup=times["baseline"] / t))
        print(f"{gpus:5d} GPUs (DP={dp:3d}): " + "  ".join(f"{n} {times['baseline'] / t:.3f}x" for n, t in times.items()),
              flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replay", nargs="+", default=None, help="benchmarks/pipeline_dst.py result files to replay")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size: the analytic stage splits its heads and "
                   "FFN over TP GPUs and pays the TP collectives; a --latency-table must have been profiled at it")
    p.add_argument("--sequence-parallel", action="store_true", help="the stages run with Megatron's sequence parallelism")
    p.add_argument("--tp-link-gbps", type=float, default=300.0,
                   help="with --tp > 1 and the analytic model: bus bandwidth of the TP collectives (GB/s per GPU, NVLink)")
    p.add_argument("--gpus", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    p.add_argument("--dist", default="longtail")
    p.add_argument("--seq-length", type=int, default=65536)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per DP replica and iteration")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="token cap per micro-batch (default: --micro-batch-size x --seq-length: without a cap SAB may pile many short samples into one pack, far outside the profiled range)")
    p.add_argument("--moba-block-size", type=int, default=128)
    p.add_argument("--moba-topk", type=int, default=32)
    p.add_argument("--latency-table", default=None)
    p.add_argument("--iters", type=int, default=5, help="global batches averaged per cluster size")
    p.add_argument("--warmup", type=int, default=3, help="global batches first planned (SAB's estimator learns DST's budgets)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stage-costs", default=None, metavar="FILE:KEY",
                   help="price each stage apart: its share of the layers at the table's prediction, plus the "
                        "per-token cost of the output layer and loss fitted on a measured run "
                        "(stage_costs of a benchmarks/e2e.py results file, e.g. "
                        "benchmarks/results/e2e_h200x4.json:pp4dp1/bimodal); default: every stage alike")
    p.add_argument("--first-stage-layers", type=int, default=None, help="with --stage-costs: layers of the first stage")
    p.add_argument("--last-stage-layers", type=int, default=None, help="with --stage-costs: layers of the last stage")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--ablation", action="store_true", help="issue 43's ablation rows (module doc)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS), help="with --ablation")
    p.add_argument("--dists", nargs="+", default=["bimodal", "longtail"], help="with --ablation")
    p.add_argument("--global-batch-size", type=int, default=16, help="with --ablation")
    p.add_argument("--dst-p", type=float, default=0.1,
                   help="with --ablation: the coverage bound, under flat router scores (random weights); < 0: none")
    p.add_argument("--ablation-split", default=None, type=lambda v: [int(x) for x in v.split(",")], metavar="N,N,...",
                   help="with --ablation and one layout: the layers per stage of the rows that choose the split "
                        "(+split, all, baseline+split), instead of choose_split's; a last stage of 0 layers holds "
                        "the output layer and loss alone (Megatron-LM: --pipeline-model-parallel-layout "
                        "\"Et*8|t*8|t*8|L\"; our training entries take no such split yet)")
    p.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="with --ablation: price the output layer with megatron-core's fused cross entropy")
    p.add_argument("--stage-costs-file", default="benchmarks/results/e2e_h200x4.json",
                   help="with --ablation and --latency-table: the measured output-layer cost per token (stage_costs)")
    args = p.parse_args(argv)
    if args.ablation_split is not None:
        n = MODEL_PRESETS[args.model].num_layers
        if not args.ablation or len(args.layouts) != 1:
            p.error("--ablation-split goes with --ablation and one --layouts")
        pp = LAYOUTS[args.layouts[0]][0]
        if len(args.ablation_split) != pp or sum(args.ablation_split) != n or min(args.ablation_split) < 0 \
                or min(args.ablation_split[:-1]) < 1:
            p.error(f"--ablation-split {','.join(map(str, args.ablation_split))}: {pp} stages of {args.layouts[0]} "
                    f"holding {n} layers, at least one on every stage but the last")
    if args.cross_entropy_loss_fusion and not args.ablation:
        p.error("--cross-entropy-loss-fusion goes with --ablation (it prices the ablation's output layer)")
    if (args.first_stage_layers is not None or args.last_stage_layers is not None) and not args.stage_costs:
        p.error("--first-stage-layers / --last-stage-layers go with --stage-costs (without it every stage costs the same)")
    try:
        validate_tensor_parallel(MODEL_PRESETS[args.model], args.tp, args.sequence_parallel)
        stage_costs = stage_costs_of(args)  # bad input stops here, before any simulation
    except ValueError as e:
        p.error(str(e))
    if args.ablation:
        rows = ablation(args)
    elif args.replay:
        rows = replay(args.replay)
        for r in rows:
            print(f"{r['file'].split('/')[-1]:45s} {r['anchor']:6s} measured {r['measured_ms']:8.1f} ms  "
                  f"simulated {r['simulated_ms']:8.1f} ms  error {100 * r['rel_err']:5.1f}%")
        errs = [r["rel_err"] for r in rows]
        print(f"median error {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}% over {len(errs)} iterations")
    else:
        shape = MODEL_PRESETS[args.model]
        if args.latency_table:
            # a table prices one layout's stage: another TP (or SP) is another stage
            latency = LatencyModel.load(args.latency_table, expect={"parallel_layout": {
                "tp": args.tp, "pp": args.pp, "cp": 1, "sequence_parallel": args.sequence_parallel}})
        else:
            latency = AnalyticLatencyModel(shape, shape.num_layers // args.pp, block_size=args.moba_block_size,
                                           hardware="h200", tensor_parallel_size=args.tp,
                                           sequence_parallel=args.sequence_parallel,
                                           tp_link_gbps=args.tp_link_gbps if args.tp > 1 else None)
        rows = predict(args, latency, stage_costs)
    if args.out:
        with open(args.out, "w") as f:
            mode = "ablation" if args.ablation else "replay" if args.replay else "predict"
            json.dump({"mode": mode, "args": vars(args), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
