"""End-to-end: SparseBalance against the fixed-budget baseline, through the pretrain entry point.

Run under torchrun, one process per GPU (or over gloo on a CPU for a smoke run)::

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --standalone --nproc_per_node 4 \\
        -m benchmarks.e2e --layout pp4dp1 --latency-table benchmarks/results/e2e/latency_table_h200.json --out "$OUT"

For each length distribution and each configuration the same run is made with
``megatron_sparsebalance.pretrain.pretrain`` in this process: the same model (Qwen2.5-0.5B
architecture, random init, same seed), the same global batches (mock data, same seed), ``--warmup``
iterations then ``--iters`` measured ones. The configurations (``CONFIGS``) differ only in the
SparseBalance flags. Per configuration the rank-0 process records, over the measured iterations:

* ``iter_ms``: mean wall time of an iteration (planning, 1F1B, optimizer step, everything);
  ``speedup`` = baseline ``iter_ms`` / this ``iter_ms`` (the paper's definition);
* ``pipeline_ms``: mean time of the 1F1B schedule alone (CUDA events, first op to last);
* ``imbalance`` (max / mean micro-batch time, mean over iterations) and ``bubble`` (mean over
  stages); ``overhead_ms``: SAB's plan plus DST's plan per iteration (host time);
* ``predicted_ms``: the 1F1B simulator on the plan's predicted micro-batch costs, and
  ``simulated_iter_ms``: the simulator on the measured per-stage forward/backward times, both
  against ``pipeline_ms``;
* ``mean_budget``, ``mean_coverage`` (means over the attention layers), and the last iteration's
  ``loss`` (what the schedule trained on: the mean of the micro-batches' per-token losses, or the
  global batch's per-token loss under per-token normalization, which ``--variable-micro-batches``
  turns on) and ``lm_loss`` (the global batch's per-token loss for every configuration: the one
  to compare across configurations).

``--layout`` picks the parallel layout and the pipeline split. The last stage runs the output
layer over a 152K vocabulary (as much work as six to nine of these layers), so the split gives it
fewer layers (``--decoder-last-pipeline-num-layers``), as a Megatron user would.

Memory: a micro-batch is capped at ``--micro-batch-tokens`` (default = ``--seq-length`` = 64K); the
largest tensor is the last stage's fp32 logits (64K x 152K x 4 bytes = 40 GB); the sparse runs
fit an H200 without recomputation (up to 115 GiB on stage 0 of PP=4, with the allocator's
expandable segments against fragmentation); the dense row does not fit at PP=4. ``--batching none`` keeps arrival order and moves a cut only
where the cap requires it (``balance/sab.py: arrival_order_chunks``).

Writes ``e2e_<tag>_<layout>.json``: rows, per-iteration records, the Chrome traces of the last
baseline and SAB+DST iterations, and the simulator's ideal speedups for the baseline's measured
costs (``ideal`` splits a micro-batch over the stages by the baseline's shares,
``ideal_stage_aware`` by the ``StageCostModel`` in ``stage_costs``, fitted to the baseline's stage
times, ``pipeline/simulate.py``). ``--merge`` joins layout files into
``e2e_<tag>.json`` and draws the timelines and the speedup chart.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch

CONFIGS = {  # name -> pretrain flags on top of the common ones
    "baseline": ["--batching", "none", "--dst-anchor", "none"],
    "lbb": ["--batching", "lbb", "--dst-anchor", "none"],
    "sab": ["--batching", "sab", "--dst-anchor", "none"],
    "dst": ["--batching", "none", "--dst-anchor", "mean", "--dst-p", "0.1"],
    "sab+dst": ["--batching", "sab", "--dst-anchor", "mean", "--dst-p", "0.1"],
    # The paper's growth rule (every micro-batch below the anchor grows up to it) next to ours.
    "dst-anchor": ["--batching", "none", "--dst-anchor", "mean", "--dst-p", "0.1", "--dst-growth", "anchor"],
    "sab+dst-anchor": ["--batching", "sab", "--dst-anchor", "mean", "--dst-p", "0.1", "--dst-growth", "anchor"],
    "sab+dst-min": ["--batching", "sab", "--dst-anchor", "min", "--dst-p", "0.1"],
    "sab+dst-max": ["--batching", "sab", "--dst-anchor", "max", "--dst-p", "0.1"],
    "sab+dst-p0.05": ["--batching", "sab", "--dst-anchor", "mean", "--dst-p", "0.05"],
    "sab+dst-p0.2": ["--batching", "sab", "--dst-anchor", "mean", "--dst-p", "0.2"],
    "sab+dst-p0.3": ["--batching", "sab", "--dst-anchor", "mean", "--dst-p", "0.3"],
    # DST choosing only among the profiled budgets (the table stops at 64; beyond it is extrapolated)
    "sab+dst-k64": ["--batching", "sab", "--dst-anchor", "mean", "--dst-p", "0.1",
                    "--dst-budgets", "8", "12", "16", "20", "24", "28", "32", "40", "48", "56", "64"],
    "baseline-seed2": ["--batching", "none", "--dst-anchor", "none"],  # with --seed + 1: the loss noise
    "dense": ["--batching", "none", "--dst-anchor", "none", "--no-sparse-attention"],
    # Issue 43's pieces (docs/BATCHING.md): the split chosen from predicted stage costs, Hydraulis's
    # two levels with a per-replica micro-batch count, DST on the critical path; "+x" adds one to
    # sab+dst, "all" has every one.
    "baseline+split": ["--batching", "none", "--dst-anchor", "none", "--decoder-pipeline-split", "auto"],
    "+split": ["--batching", "sab", "--dst-anchor", "mean", "--dst-p", "0.1", "--decoder-pipeline-split", "auto"],
    "+hydraulis": ["--batching", "hydraulis", "--variable-micro-batches", "--dst-anchor", "mean", "--dst-p", "0.1"],
    "+hydraulis-simulated-count": ["--batching", "hydraulis", "--variable-micro-batches",
                                   "--micro-batch-count-objective", "simulated", "--dst-anchor", "mean", "--dst-p", "0.1"],
    "+critical-path": ["--batching", "sab", "--dst-anchor", "mean", "--dst-p", "0.1", "--dst-growth", "critical-path"],
    "all": ["--batching", "hydraulis", "--variable-micro-batches", "--micro-batch-count-objective", "simulated",
            "--dst-anchor", "mean", "--dst-p", "0.1", "--dst-growth", "critical-path", "--decoder-pipeline-split", "auto"],
    # The micro-batches' pipeline order searched on the simulated 1F1B (balance/sab.py: simulated_order).
    "+order": ["--batching", "sab", "--dst-anchor", "mean", "--dst-p", "0.1", "--micro-batch-order", "simulated"],
    "all+order": ["--batching", "hydraulis", "--variable-micro-batches", "--micro-batch-count-objective", "simulated",
                  "--dst-anchor", "mean", "--dst-p", "0.1", "--dst-growth", "critical-path", "--decoder-pipeline-split",
                  "auto", "--micro-batch-order", "simulated"],
}
MAIN_CONFIGS = ["baseline", "lbb", "sab", "dst", "sab+dst", "dense"]
BALANCE_CONFIGS = ["baseline", "lbb", "sab", "dst", "sab+dst", "+split", "+hydraulis", "+hydraulis-simulated-count",
                   "+critical-path", "+order", "all", "all+order", "baseline+split"]
"""Issue 43's ablation (``--configs`` for ``--split even``, the rows of tools/simulate_pipeline.py --ablation)."""
# layout -> (PP, first-stage layers, last-stage layers) for the 24 layers of Qwen2.5-0.5B. The
# 4xH200 rounds measured the output layer and loss at about 8.6 layers' worth (stage shares of
# pp4dp1, docs/BENCHMARKS.md), so the paper's 8-GPU layout gives the last stage one layer (7/8/8/1).
# Other models: --first-stage-layers / --last-stage-layers.
LAYOUTS = {"pp4dp1": (4, 8, 2), "pp4dp2": (4, 7, 1), "pp2dp2": (2, None, 9), "pp2dp1": (2, None, 9),
           "pp1dp1": (1, None, None)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="pp4dp1")
    p.add_argument("--dists", nargs="+", default=["bimodal", "longtail"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS),
                   help=f"any of {list(CONFIGS)}; DIST:CONFIG runs CONFIG for that distribution only")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--checkpoint", default=None,
                   help="start every run from this converted checkpoint (--pretrained-checkpoint --use-checkpoint-args) "
                        "instead of --model at random init (docs/REAL_MODEL.md)")
    p.add_argument("--data-prefix", default=None,
                   help="real data: <prefix>_<dist> (.bin/.idx of tools/build_mix.py) instead of mock data")
    p.add_argument("--weights", default=None,
                   help="label of the weights in each row (e.g. smollm2); default: random without --checkpoint")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset (smoke runs)")
    p.add_argument("--first-stage-layers", type=int, default=None, help="override the layout's first-stage layers")
    p.add_argument("--last-stage-layers", type=int, default=None, help="override the layout's last-stage layers")
    p.add_argument("--split", choices=["layout", "even"], default="layout",
                   help="layout: the layout's first/last-stage layers; even: Megatron's even split (the fixed "
                        "baseline of issue 43's rows, against which --decoder-pipeline-split auto is one of the pieces)")
    p.add_argument("--seq-length", type=int, default=65536)
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default: --seq-length")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--moba-block-size", type=int, default=128)
    p.add_argument("--moba-topk", type=int, default=32)
    p.add_argument("--latency-table", default=None, help="profiled table for DST/SAB (default: the analytic model)")
    p.add_argument("--warmup", type=int, default=2, help="iterations before the measured ones (the first ones compile kernels for the shapes and budgets they meet)")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--exclude", nargs="*", default=[], metavar="[FILE:]LAYOUT/DIST/CONFIG",
                   help="with --merge: rows to leave out of the merged file; with FILE: (a base name) only "
                        "that file's row, so a later measurement in another file can replace it")
    p.add_argument("--prewarm", nargs="*", default=[], choices=sorted(CONFIGS), metavar="CONFIG",
                   help="run these configurations once per distribution, untimed, before the measured runs "
                        "(compiles the kernel variants the runs meet; on a fresh machine the first run pays for them)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more pretrain flags for every run")
    p.add_argument("--tag", default=None, help="results file tag (default: h200x<GPUs> on GPUs, cpu otherwise)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                   help="no run: merge these layout files into e2e_<tag>.json and draw the figures")
    return p.parse_args(argv)


def pretrain_flags(args, dist: str, config: str) -> list:
    pp, first, last = LAYOUTS[args.layout]
    first = args.first_stage_layers if args.first_stage_layers is not None else first
    last = args.last_stage_layers if args.last_stage_layers is not None else last
    seed = args.seed + 1 if config == "baseline-seed2" else args.seed
    model = (["--pretrained-checkpoint", args.checkpoint, "--use-checkpoint-args"] if args.checkpoint
             else ["--model", args.model])
    data = (["--data-path", f"{args.data_prefix}_{dist}"] if args.data_prefix
            else ["--mock-data", "--mock-length-distribution", dist])
    flags = [
        *model, "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
        "--seq-length", str(args.seq_length), "--micro-batch-tokens", str(args.micro_batch_tokens or args.seq_length),
        *data, "--moba-block-size", str(args.moba_block_size),
        "--moba-topk", str(args.moba_topk), "--train-iters", str(args.warmup + args.iters), "--log-interval", "1",
        "--seed", str(seed), "--lr", "1e-4", "--lr-warmup-iters", "0",
    ]
    if args.num_layers:
        flags += ["--num-layers", str(args.num_layers)]
    # --decoder-pipeline-split auto chooses both itself; --split even leaves Megatron's even split.
    fixed = args.split == "layout" and "--decoder-pipeline-split" not in CONFIGS[config]
    if fixed and pp > 1 and first is not None:
        flags += ["--decoder-first-pipeline-num-layers", str(first)]
    if fixed and pp > 1 and last is not None:
        flags += ["--decoder-last-pipeline-num-layers", str(last)]
    if torch.cuda.is_available():
        flags += ["--bf16"]
    if args.latency_table:
        flags += ["--latency-table", args.latency_table]
    return flags + CONFIGS[config] + list(args.extra)


class Recorder:
    """``pretrain``'s per-iteration callback: keeps the measured iterations' figures."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.iterations = []
        self.last_trace = None

    def __call__(self, row: dict, step) -> None:
        if row["iteration"] <= self.warmup:
            return
        m = step.metrics
        stages = {}
        for rec in m.records:
            for s in rec.spans:
                key = (rec.dp_rank, rec.pp_rank)
                stages.setdefault(key, {}).setdefault(s.micro_batch, {})[s.kind] = s.end_ms - s.start_ms
        counts = {}
        for rec in m.records:  # each DP replica's micro-batches (they differ under --variable-micro-batches)
            counts[rec.dp_rank] = len(rec.predicted_ms)
        self.iterations.append(dict(
            micro_batches=[counts[d] for d in sorted(counts)],
            iteration=row["iteration"], elapsed_ms=row["elapsed_ms"], pipeline_ms=m.iteration_ms,
            imbalance=m.imbalance, bubble=m.bubble, micro_batch_ms=m.micro_batch_ms, budgets=m.budgets,
            coverage=m.coverage, predicted_ms=m.predicted_ms, loss=row["loss"], lm_loss=row["lm_loss"], dst_ms=row["dst_ms"],
            sab_ms=row["sab_ms"], tflops_per_gpu=row["tflops_per_gpu"],
            # [dp][stage][micro-batch] -> (forward ms, backward ms)
            stage_ms=[[[(stages[(d, s)][j]["F"], stages[(d, s)][j]["B"]) for j in sorted(stages[(d, s)])]
                       for s in sorted({k[1] for k in stages})] for d in sorted({k[0] for k in stages})],
        ))
        self.last_trace = m.chrome_trace()


def simulate_measured(it: dict) -> float:
    """The 1F1B simulator on one iteration's measured per-stage forward/backward times."""
    from megatron_sparsebalance.pipeline.simulate import simulate_1f1b

    times = []
    for replica in it["stage_ms"]:
        fwd = [[f for f, _ in stage] for stage in replica]
        bwd = [[b for _, b in stage] for stage in replica]
        times.append(simulate_1f1b(fwd, bwd).iteration_ms)
    return max(times)


def simulate_predicted(it: dict, pp: int, dp: int, stage_shares) -> float:
    """The simulator on the plan's predicted micro-batch costs (split over stages as measured)."""
    from megatron_sparsebalance.pipeline.simulate import simulate_iteration

    if not it["predicted_ms"]:
        return float("nan")
    counts = it.get("micro_batches") or [len(it["predicted_ms"]) // dp] * dp
    starts = [sum(counts[:d]) for d in range(dp)]
    replicas = [[[c * share for c in it["predicted_ms"][a:a + n]] for share in stage_shares]
                for a, n in zip(starts, counts)]
    return simulate_iteration(replicas)


def stage_shares(iterations: list) -> list:
    """Each stage's share of a micro-batch's time, averaged over the measured iterations."""
    pp = len(iterations[0]["stage_ms"][0])
    tot = [0.0] * pp
    for it in iterations:
        for replica in it["stage_ms"]:
            for s, stage in enumerate(replica):
                tot[s] += sum(f + b for f, b in stage)
    total = sum(tot)
    return [t / total for t in tot]


def summarize(dist: str, layout: str, config: str, iterations: list, dp: int, model: str) -> dict:
    pp = len(iterations[0]["stage_ms"][0])
    shares = stage_shares(iterations)
    mean = statistics.mean
    return dict(
        dist=dist, layout=layout, config=config, model=model,
        iter_ms=mean(it["elapsed_ms"] for it in iterations),
        pipeline_ms=mean(it["pipeline_ms"] for it in iterations),
        imbalance=mean(it["imbalance"] for it in iterations),
        bubble=mean(mean(it["bubble"]) for it in iterations),
        overhead_ms=mean(it["dst_ms"] + it["sab_ms"] for it in iterations),
        sab_ms=mean(it["sab_ms"] for it in iterations), dst_ms=mean(it["dst_ms"] for it in iterations),
        # Dense attention has no budget and no coverage.
        mean_budget=mean(mean(it["budgets"]) for it in iterations) if config != "dense" else None,
        mean_coverage=mean(mean(it["coverage"]) for it in iterations) if config != "dense" else None,
        loss=iterations[-1]["loss"], lm_loss=iterations[-1]["lm_loss"],
        tflops_per_gpu=mean(it["tflops_per_gpu"] for it in iterations),
        predicted_ms=mean(simulate_predicted(it, pp, dp, shares) for it in iterations),
        simulated_iter_ms=mean(simulate_measured(it) for it in iterations),
        stage_shares=shares,
    )


def ideal_speedups(args, cfg, baseline_iterations: list, pp: int, dp: int, latency) -> dict:
    """The simulator's ideal for these costs: the run's latency model rescaled to the baseline's
    measured micro-batches, every configuration planned with DST unconstrained by ``p``.

    Returns ``ideal`` (each micro-batch split over the stages by the baseline's stage shares),
    ``ideal_stage_aware`` (split by a ``StageCostModel`` of ``pipeline/simulate.py``, fitted to the
    baseline's measured stage times) and that model as ``stage_costs``."""
    import numpy as np

    from megatron_sparsebalance.balance.sab import SparsityAwareBatcher
    from megatron_sparsebalance.data.datasets import build_dataset
    from megatron_sparsebalance.data.sampler import GlobalBatchSampler
    from megatron_sparsebalance.pipeline.simulate import StageCostModel, layer_fractions
    from tools.simulate_pipeline import CONFIGS as SIM_CONFIGS, simulate_configs

    m = args.global_batch_size // (args.micro_batch_size * dp)
    sampler = GlobalBatchSampler(build_dataset(cfg.data).lengths, args.global_batch_size,
                                 SparsityAwareBatcher("none", dp, m), seed=cfg.data.seed)
    batches = [list(sampler.next_plan().lengths) for _ in range(args.warmup + args.iters)]
    measured = list(zip(baseline_iterations, (
        SparsityAwareBatcher("none", dp, m, micro_batch_tokens=cfg.batching.micro_batch_tokens).plan(lengths)
        for lengths in batches[args.warmup:])))
    # Rescale the model to the baseline's measured costs (micro-batch time summed over the stages).
    ratios = [ms / (pp * latency.predict(mb, args.moba_topk))
              for it, plan in measured for mb, ms in zip(plan.all_micro_batch_lengths(), it["micro_batch_ms"])]
    latency.load_calibration({"log_scale": latency.calibration_state()["log_scale"] + math.log(float(np.median(ratios))),
                              "observations": 0})
    fractions = layer_fractions(cfg.pipeline_layer_split(), pp)
    samples = []  # (stage, tokens, predicted ms, measured forward+backward ms)
    for it, plan in measured:
        for d, replica in enumerate(it["stage_ms"]):
            for s, stage in enumerate(replica):
                for j, (f, b) in enumerate(stage):
                    mb = plan.micro_batch_lengths(d, j)
                    samples.append((s, sum(mb), latency.predict(mb, args.moba_topk), f + b))
    stage_costs = StageCostModel.fit(fractions, samples)
    result = {"stage_costs": stage_costs.to_dict()}
    shares = stage_shares(baseline_iterations)
    for key, costs in (("ideal", None), ("ideal_stage_aware", stage_costs)):
        times = simulate_configs(batches, latency, pp, dp, m, args.moba_topk, warmup=args.warmup,
                                 configs=SIM_CONFIGS, stage_shares=shares,
                                 micro_batch_tokens=cfg.batching.micro_batch_tokens, stage_costs=costs)
        result[key] = {name: times["baseline"] / t for name, t in times.items()}
    return result


IDEAL_KEYS = ("ideal", "ideal_stage_aware", "stage_costs")
"""What :func:`ideal_speedups` gives, each kept per layout/distribution in a results file."""


def run(args) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sparsebalance.config import build_parser, config_from_args
    from megatron_sparsebalance.balance.latency import device_name
    from megatron_sparsebalance.pretrain import build_latency_model, pretrain

    parser = build_parser()
    result = dict(layout=args.layout, rows=[], iterations={}, traces={}, ideal={}, setup=dict(vars(args)))
    dp = None
    baseline_cfg = {}
    # Untimed first: Triton compiles a kernel variant the first time a launch meets new shapes or
    # budgets, and on a fresh machine that lands in the measured iterations of whichever
    # configuration meets it first (seconds, in one iteration), never in the later ones.
    for dist_name in args.dists:
        for config in args.prewarm:
            pretrain(config_from_args(parser.parse_args(pretrain_flags(args, dist_name, config))))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    for dist_name in args.dists:
        for entry in args.configs:
            only, _, config = entry.rpartition(":")
            if only and only != dist_name:
                continue
            cfg = config_from_args(parser.parse_args(pretrain_flags(args, dist_name, config)))
            # The model-parallel groups live across runs: megatron's destroy_model_parallel drops
            # its references to the groups but does not destroy them, so a new set per run leaves
            # the old NCCL communicators allocated (the prewarmed PP=4 job of docs/BENCHMARKS.md
            # ran out of memory after 15 runs with ~30 GiB outside PyTorch's allocator). pretrain
            # re-seeds megatron's CUDA RNG tracker on every call, so every configuration still
            # starts from the same weights.
            if config == "baseline":
                baseline_cfg[dist_name] = cfg
            recorder = Recorder(args.warmup)
            t0 = time.perf_counter()
            pretrain(cfg, on_iteration=recorder)
            wall = time.perf_counter() - t0
            dp = parallel_state.get_data_parallel_world_size()
            gc.collect()
            if torch.cuda.is_available():
                peak = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            else:
                peak = float("nan")
            peaks = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, peak)
            if dist.get_rank() != 0:
                continue
            row = summarize(dist_name, args.layout, config, recorder.iterations, dp, args.checkpoint or args.model)
            # The split pretrain ran (--decoder-pipeline-split auto resolves it in cfg), each measured
            # iteration's micro-batches per DP replica, and which weights.
            row.update(run_s=wall, peak_mem_gib_per_rank=peaks, split=cfg.pipeline_layer_split(),
                       micro_batches=[it["micro_batches"] for it in recorder.iterations],
                       weights=args.weights or ("random" if not args.checkpoint else args.checkpoint))
            result["rows"].append(row)
            result["iterations"][f"{dist_name}/{config}"] = recorder.iterations
            if config in ("baseline", "sab+dst"):
                result["traces"][f"{dist_name}/{config}"] = recorder.last_trace
            write_result(args, result)  # after every run: a later failure keeps what was measured
            print(f"[e2e] {args.layout} {dist_name:8s} {config:14s} iter {row['iter_ms']:8.1f} ms  pipeline "
                  f"{row['pipeline_ms']:8.1f}  imbalance {row['imbalance']:.3f}  bubble {100 * row['bubble']:4.1f}%  "
                  f"overhead {row['overhead_ms']:.2f} ms  budget {row['mean_budget'] or float('nan'):5.1f}  coverage "
                  f"{row['mean_coverage'] or float('nan'):.3f}  loss {row['loss']:.4f}  sim {row['simulated_iter_ms']:8.1f}  "
                  f"pred {row['predicted_ms']:8.1f}  ({wall:.0f} s, peak {max(peaks):.1f} GiB)", flush=True)
    if dist.get_rank() == 0:
        pp = LAYOUTS[args.layout][0]
        for dist_name in args.dists:
            rows = [r for r in result["rows"] if r["dist"] == dist_name]
            add_speedups(rows)
            if dist_name not in baseline_cfg:
                continue
            cfg = baseline_cfg[dist_name]
            latency = build_latency_model(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
            ideal = ideal_speedups(args, cfg, result["iterations"][f"{dist_name}/baseline"], pp, dp, latency)
            for key in IDEAL_KEYS:
                result.setdefault(key, {})[dist_name] = ideal[key]
        result.update(gpu=device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                      world_size=dist.get_world_size())
    return result


def add_speedups(rows: list, only_missing: bool = False) -> None:
    """``speedup`` (wall) and ``pipeline_speedup`` of each row against the baseline of its layout,
    distribution, weights and flags (``only_missing``: of the rows that have none yet)."""
    for r in rows:
        if only_missing and "speedup" in r:
            continue
        base = next((b for b in rows if b["config"] == "baseline" and b["dist"] == r["dist"]
                     and b["layout"] == r["layout"] and b.get("weights") == r.get("weights")
                     and b.get("flags") == r.get("flags")), None)
        if base is not None:
            r["speedup"] = base["iter_ms"] / r["iter_ms"]
            r["pipeline_speedup"] = base["pipeline_ms"] / r["pipeline_ms"]


# --latency-table-force only lets the planner read a table profiled on another machine: a row run
# with it measured the same step as one without.
PLANNING_ONLY_FLAGS = ("--latency-table-force",)


def run_flags(setup: dict) -> list:
    """The ``--extra`` flags of a run that set what its rows measured (a merged file keys rows on them)."""
    return [f for f in setup.get("extra") or [] if f not in PLANNING_ONLY_FLAGS]


def variant_label(weights, flags, common=()) -> str:
    """What tells a run's ideals and timelines apart in a merged file: ``""`` for random weights and
    the flags every merged run passed (``common``), else ``/smollm2``, ``/cross-entropy-loss-fusion``,
    ``/smollm2+...``."""
    parts = [] if weights in (None, "random") else [weights]
    parts += [f.lstrip("-") for f in flags if f not in common]
    return "/" + "+".join(parts) if parts else ""


def write_result(args, result: dict) -> str:
    import torch.distributed as dist

    tag = args.tag or (f"h200x{dist.get_world_size()}" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"e2e_{tag}_{args.layout}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    return path


def print_table(result: dict) -> None:
    print(f"\n{'layout':7s} {'weights':8s} {'dist':8s} {'config':14s} {'imbal':>6s} {'iter ms':>9s} {'ovh ms':>7s} "
          f"{'speedup':>7s} {'pipe x':>6s} {'bubble':>6s} {'sim/meas':>8s} {'pred/meas':>9s} {'budget':>6s} {'cover':>6s} "
          f"{'loss':>7s}")
    for r in result["rows"]:
        print(f"{r['layout']:7s} {r.get('weights') or 'random':8s} {r['dist']:8s} {r['config']:14s} "
              f"{r['imbalance']:6.3f} {r['iter_ms']:9.1f} "
              f"{r['overhead_ms']:7.2f} {r.get('speedup', float('nan')):7.3f} {r.get('pipeline_speedup', float('nan')):6.3f} "
              f"{100 * r['bubble']:5.1f}% {r['simulated_iter_ms'] / r['pipeline_ms']:8.3f} "
              f"{r['predicted_ms'] / r['pipeline_ms']:9.3f} {r['mean_budget'] or float('nan'):6.1f} "
              f"{r['mean_coverage'] or float('nan'):6.3f} {r['loss']:7.4f}")
    for kind, name in (("ideal", "ideal"), ("ideal_stage_aware", "stage-aware ideal")):
        for key, ideal in result.get(kind, {}).items():
            print(f"simulator's {name} speedups ({key}): " + ", ".join(f"{n} {v:.3f}" for n, v in ideal.items()))


def ideal_from_file(part: dict, dist_name: str) -> dict:
    """:func:`ideal_speedups` recomputed from a results file (its setup, baseline records and table)."""
    from megatron_sparsebalance.config import build_parser, config_from_args
    from megatron_sparsebalance.pretrain import build_latency_model

    args = argparse.Namespace(**part["setup"])
    cfg = config_from_args(build_parser().parse_args(pretrain_flags(args, dist_name, "baseline")))
    # The run's own latency model, rebuilt here on any machine: its table was recorded on the
    # run's GPU (so the metadata check is waived) and the analytic model takes that GPU's rates.
    cfg.latency.latency_table_force = True
    if part.get("gpu", "cpu") != "cpu":
        cfg.latency.latency_hardware = "h200"
    latency = build_latency_model(cfg, torch.device("cpu"))
    pp = LAYOUTS[args.layout][0]
    dp = len(part["iterations"][f"{dist_name}/baseline"][0]["stage_ms"])  # one entry per DP replica
    return ideal_speedups(args, cfg, part["iterations"][f"{dist_name}/baseline"], pp, dp, latency)


def is_excluded(row: dict, exclude, source: str | None = None) -> bool:
    """Whether ``--exclude`` leaves ``row`` out: an entry ``LAYOUT/DIST/CONFIG`` drops that row
    whichever file holds it; ``FILE:LAYOUT/DIST/CONFIG`` only the row of the file named ``FILE``
    (its base name), so another file's row of the same key can take its place."""
    key = f"{row['layout']}/{row['dist']}/{row['config']}"
    return any(entry == key or (source is not None and entry == f"{source}:{key}") for entry in exclude)


def merge(paths, out_dir: str, tag: str, exclude=()) -> dict:
    """Join per-layout files into one results file (rows only, plus the ideals) and draw the figures.

    Each row keeps its speedup over its own run's baseline; a later file's row replaces an earlier
    one of the same layout, distribution, configuration, weights and ``--extra`` flags.
    ``exclude``: rows left out (one measured again elsewhere), see :func:`is_excluded`."""
    merged = dict(gpu=None, torch=None, rows=[], **{key: {} for key in IDEAL_KEYS}, sources=[])
    traces = {}
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    flags_of = [run_flags(part["setup"]) for part in parts]
    # Labels name only the flags that tell runs apart (every GPU run passes --manual-gc).
    common = [f for f in flags_of[0] if all(f in flags for flags in flags_of)]
    merged["common_flags"] = common
    for path, part, flags in zip(paths, parts, flags_of):
        # A file cut short by a failure has no summary fields; the others name the GPU.
        merged["gpu"] = part.get("gpu", merged["gpu"])
        merged["torch"] = part.get("torch", merged["torch"])
        source = os.path.basename(path)
        # Each row names its file and flags: a merged table may join rows of runs planned with
        # different tables, and of runs whose step differs (--extra --cross-entropy-loss-fusion).
        # Its speedup is over its own run's baseline, on the same global batches.
        rows = [dict(r, source=source, flags=flags) for r in part["rows"]]
        add_speedups(rows)
        merged["rows"] += [r for r in rows if not is_excluded(r, exclude, source)]
        # Files of other weights than random init (--weights) or other flags keep their ideals and
        # timelines apart.
        label = variant_label(part["setup"].get("weights"), flags, common)
        for dist_name in part["setup"]["dists"]:
            if f"{dist_name}/baseline" in part["iterations"]:
                # Recomputed from the file's own records (also for a run that stopped before its
                # summary), so every ideal of the merged file comes from the same code; a run from
                # a checkpoint that is not on this machine (its architecture is read from it)
                # keeps the ideals it computed itself.
                checkpoint = part["setup"].get("checkpoint")
                if checkpoint and not os.path.isdir(checkpoint) and all(dist_name in part.get(k, {}) for k in IDEAL_KEYS):
                    ideal = {key: part[key][dist_name] for key in IDEAL_KEYS}
                else:
                    ideal = ideal_from_file(part, dist_name)
                for key in IDEAL_KEYS:
                    merged[key][f"{part['layout']}/{dist_name}{label}"] = ideal[key]
        merged["sources"].append(source)
        traces.update({f"{part['layout']}{label}/{k}": v for k, v in part["traces"].items()})
    # A later file's row replaces an earlier one of the same (layout, dist, config, weights, flags).
    # (--exclude was applied per file above: an unqualified entry drops the row in every file.)
    merged["rows"] = list({(r["layout"], r["dist"], r["config"], r.get("weights"), tuple(r["flags"])): r
                           for r in merged["rows"]}.values())
    merged["excluded"] = list(exclude)
    add_speedups(merged["rows"], only_missing=True)  # rows of a run without its own baseline
    path = os.path.join(out_dir, f"e2e_{tag}.json")
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    draw(merged, traces, out_dir, tag)
    return merged


def draw(merged: dict, traces: dict, out_dir: str, tag: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tools.plot_timeline import draw as draw_timeline

    for key, trace in traces.items():
        where, dist_name, config = key.rsplit("/", 2)  # where: the layout, then its variant_label
        if config != "baseline":
            continue
        other = traces.get(f"{where}/{dist_name}/sab+dst")
        panels = [("baseline", trace)] + ([("sab+dst", other)] if other else [])
        fig, axes = plt.subplots(len(panels), 1, figsize=(14, 2.2 * len(panels) + 1), squeeze=False)
        title = where.replace("/", " ")
        for ax, (name, tr) in zip(axes[:, 0], panels):
            draw_timeline(ax, [e for e in tr["traceEvents"] if e.get("ph") == "X"], f"{title} {dist_name}: {name}")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"e2e_timeline_{tag}_{where.replace('/', '_')}_{dist_name}.png"), dpi=110)
        plt.close(fig)
    common = merged.get("common_flags", [])
    groups = sorted({(r["layout"], r["dist"], variant_label(r.get("weights"), r.get("flags") or [], common))
                     for r in merged["rows"]})
    configs = [c for c in CONFIGS if any(r["config"] == c for r in merged["rows"])]
    # Capped: a merged file of ten groups drew a chart 70 inches wide.
    fig, ax = plt.subplots(figsize=(min(24, max(8, 1.2 * len(configs) * len(groups) / 2)), 5))
    width = 0.8 / max(1, len(groups))
    for g, (layout, dist_name, variant) in enumerate(groups):
        vals = [next((r.get("speedup", float("nan")) for r in merged["rows"]
                      if r["layout"] == layout and r["dist"] == dist_name and r["config"] == c
                      and variant_label(r.get("weights"), r.get("flags") or [], common) == variant), float("nan"))
                for c in configs]
        label = f"{layout} {dist_name}" + (f" ({variant.lstrip('/')})" if variant else "")
        ax.bar([i + g * width for i in range(len(configs))], vals, width, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(configs))], configs, rotation=30, ha="right")
    ax.set_ylabel("speedup over baseline")
    ax.set_title(f"End-to-end speedup ({merged['gpu']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"e2e_speedup_{tag}.png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        merged = merge(args.merge, args.out, args.tag or "h200x4", args.exclude)
        print_table(merged)
        return 0
    from megatron_sparsebalance.training.dist import destroy_distributed

    result = run(args)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        path = write_result(args, result)
        print_table(result)
        print(f"wrote {path}", flush=True)
    dist.barrier()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
