"""Tensor parallelism end to end: Qwen2.5-3B at 64K on 4 GPUs, without full recomputation.

Run under torchrun, one process per GPU (4 GPUs of one host)::

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --standalone --nproc_per_node 4 \\
        -m benchmarks.e2e_tp --out benchmarks/results

Two layouts of the same 4 GPUs, each through ``megatron_sparsebalance.pretrain.pretrain`` in this
process (same model, random init, same seed; same mock global batches; ``--warmup`` iterations,
then ``--iters`` measured ones):

* ``pp4``: PP=4 with full activation recomputation (``--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1``), the only layout that fit 3B at 64K
  before TP: the fixed-budget baseline, for its iteration time and peak memory;
* ``tp2pp2``: TP=2 x PP=2 with ``--sequence-parallel`` and no recomputation: baseline, dst, sab
  and sab+dst (``benchmarks/e2e.py``'s configurations, ``--dst-p 0.1``).

Writes ``e2e_tp_<gpu>x4.json`` (``<gpu>`` h100 or h200; ``cpu`` for ``--smoke``)::

    {"gpu": str, "rows": [{"model", "tp", "pp", "dp", "sequence_parallel", "recompute", "dist",
      "config", "iter_ms", "peak_mem_gib", "imbalance", "bubble", "speedup", ...}]}

``speedup`` is against the baseline of the same layout (TP, PP, SP, recompute) and data;
``peak_mem_gib`` the largest over the ranks. Each row also carries e2e.py's other figures
(pipeline_ms, mean_budget, mean_coverage, loss, predicted_ms ...). The file is rewritten after
every run, so a failure keeps what was measured.

The last stage runs the output layer over 152K tokens of vocabulary, about four 3B layers' worth:
it gets fewer layers (``--last-stage-layers``: 16 of 36 at PP=2, 6 at PP=4), as a Megatron user
would. A latency table per layout (``--latency-table-tp2pp2``, profiled with
``tools/profile_latency.py --tensor-model-parallel-size 2 --sequence-parallel``) makes DST and SAB
plan with measured costs; without one they use the analytic model.

``--smoke``: the same runs with a tiny model on 4 CPU processes over gloo (the plumbing, not the figures).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

from benchmarks.e2e import CONFIGS, Recorder, summarize


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    pp: int
    sequence_parallel: bool
    recompute: str  # "none", "full" or "selective:<modules joined by +>"
    last_stage_layers: int
    configs: tuple


LAYOUTS = (
    Layout("pp4", 1, 4, False, "full", 6, ("baseline",)),
    Layout("tp2pp2", 2, 2, True, "none", 16, ("baseline", "dst", "sab", "sab+dst")),
)
SMOKE = ["--model", "tiny", "--num-layers", "4", "--seq-length", "1024", "--moba-block-size", "64", "--moba-topk", "4",
         "--global-batch-size", "8", "--warmup", "1", "--iters", "1", "--last-stage-layers", "1",
         "--extra", "--untie-embeddings-and-output-weights", "--mock-vocab-size", "512"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on 4 CPU processes (gloo): the plumbing only")
    p.add_argument("--layouts", nargs="+", default=[lay.name for lay in LAYOUTS], choices=[lay.name for lay in LAYOUTS])
    p.add_argument("--configs", nargs="+", default=None, help="restrict every layout to these configurations")
    p.add_argument("--model", default="qwen2.5-3b")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset (smoke runs)")
    p.add_argument("--last-stage-layers", type=int, default=None, help="override every layout's last-stage layers")
    p.add_argument("--dist", default="bimodal", help="--mock-length-distribution of every run")
    p.add_argument("--seq-length", type=int, default=65536)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--moba-block-size", type=int, default=128)
    p.add_argument("--moba-topk", type=int, default=32)
    p.add_argument("--tp2pp2-recompute", default="none", choices=("none", "mlp", "core_attn+mlp"),
                   help="selective recomputation at TP=2 x PP=2, should its activations not fit (an estimate for 3B "
                        "at 64K: ~46 KB per token and layer with SP, 20 layers and 2 micro-batches in flight on stage 0, "
                        "~120 GB; recomputing the MLP drops ~70%% of it)")
    p.add_argument("--latency-table-tp2pp2", default=None, help="profiled table of a TP=2 (SP) stage of PP=2")
    p.add_argument("--latency-table-pp4", default=None, help="profiled table of a PP=4 stage with full recomputation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more pretrain flags for every run")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:  # the smoke settings first, so that flags given after them still win
        argv = SMOKE[:SMOKE.index("--extra")] + argv + SMOKE[SMOKE.index("--extra"):]
    args = p.parse_args(argv)
    unknown = set(args.configs or ()) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; known: {sorted(CONFIGS)}")
    return args


def selected_layouts(args) -> list:
    """The layouts to run, TP=2 x PP=2's recomputation as ``--tp2pp2-recompute`` says."""
    chosen = []
    for lay in LAYOUTS:
        if lay.name not in args.layouts:
            continue
        if lay.name == "tp2pp2" and args.tp2pp2_recompute != "none":
            lay = replace(lay, recompute=f"selective:{args.tp2pp2_recompute}")
        chosen.append(lay)
    return chosen


def pretrain_flags(args, layout: Layout, config: str) -> list:
    flags = [
        "--model", args.model, "--tensor-model-parallel-size", str(layout.tp),
        "--pipeline-model-parallel-size", str(layout.pp),
        "--decoder-last-pipeline-num-layers", str(args.last_stage_layers or layout.last_stage_layers),
        "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
        "--seq-length", str(args.seq_length), "--micro-batch-tokens", str(args.seq_length),
        "--mock-data", "--mock-length-distribution", args.dist, "--moba-block-size", str(args.moba_block_size),
        "--moba-topk", str(args.moba_topk), "--train-iters", str(args.warmup + args.iters), "--log-interval", "1",
        "--seed", str(args.seed), "--lr", "1e-4", "--lr-warmup-iters", "0",
    ]
    if args.num_layers:
        flags += ["--num-layers", str(args.num_layers)]
    if layout.sequence_parallel:
        flags += ["--sequence-parallel"]
    if layout.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif layout.recompute.startswith("selective:"):
        flags += ["--recompute-granularity", "selective", "--recompute-modules", *layout.recompute.split(":")[1].split("+")]
    if torch.cuda.is_available():
        flags += ["--bf16"]
    table = getattr(args, f"latency_table_{layout.name}")
    if table:
        flags += ["--latency-table", table]
    return flags + CONFIGS[config] + list(args.extra)


def schema_row(layout: Layout, dp: int, model: str, dist_name: str, config: str, summary: dict, peaks: list) -> dict:
    """One row of the results file: the issue's schema first, e2e.py's other figures after it."""
    row = dict(model=model, tp=layout.tp, pp=layout.pp, dp=dp, sequence_parallel=layout.sequence_parallel,
               recompute=layout.recompute, dist=dist_name, config=config, iter_ms=summary["iter_ms"],
               peak_mem_gib=max(peaks), imbalance=summary["imbalance"], bubble=summary["bubble"])
    row.update({k: v for k, v in summary.items() if k not in row and k not in ("layout", "stage_shares")})
    row["peak_mem_gib_per_rank"] = peaks
    return row


def add_layout_speedups(rows: list) -> None:
    """``speedup`` of each row against the baseline of its layout and data (None without one)."""
    key = lambda r: (r["model"], r["tp"], r["pp"], r["sequence_parallel"], r["recompute"], r["dist"])  # noqa: E731
    base = {key(r): r["iter_ms"] for r in rows if r["config"] == "baseline"}
    for r in rows:
        r["speedup"] = base[key(r)] / r["iter_ms"] if key(r) in base else None


def gpu_tag() -> str:
    """``h100`` / ``h200`` (the results file's ``<gpu>``), ``cpu`` without a GPU."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((g for g in ("h100", "h200", "b200", "a100") if g in name), name.replace(" ", "_"))


def result_path(out_dir: str, world: int) -> str:
    return os.path.join(out_dir, f"e2e_tp_{gpu_tag()}x{world}.json")


def write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def run(args) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sparsebalance.balance.latency import device_name
    from megatron_sparsebalance.config import build_parser, config_from_args
    from megatron_sparsebalance.pretrain import pretrain

    parser = build_parser()
    result = {"gpu": device_name() if torch.cuda.is_available() else "cpu", "rows": [], "setup": vars(args)}
    path = None
    for layout in selected_layouts(args):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()  # pretrain builds this layout's groups
        for config in [c for c in layout.configs if args.configs is None or c in args.configs]:
            cfg = config_from_args(parser.parse_args(pretrain_flags(args, layout, config)))
            recorder = Recorder(args.warmup)
            t0 = time.perf_counter()
            pretrain(cfg, on_iteration=recorder)
            wall = time.perf_counter() - t0
            dp = parallel_state.get_data_parallel_world_size()
            gc.collect()
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            peaks = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, peak)
            if dist.get_rank() != 0:
                continue
            summary = summarize(args.dist, layout.name, config, recorder.iterations, dp, args.model)
            row = schema_row(layout, dp, args.model, args.dist, config, summary, peaks)
            row["run_s"] = wall
            result["rows"].append(row)
            add_layout_speedups(result["rows"])
            path = result_path(args.out, dist.get_world_size())
            write(path, result)
            print(f"[e2e_tp] {layout.name} {config:8s} iter {row['iter_ms']:9.1f} ms  peak {row['peak_mem_gib']:6.1f} GiB  "
                  f"imbalance {row['imbalance']:.3f}  bubble {100 * row['bubble']:4.1f}%  speedup "
                  f"{row['speedup'] or float('nan'):.3f}  loss {row['loss']:.4f}  ({wall:.0f} s)", flush=True)
    result["path"] = path
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) != 4:
        raise SystemExit("benchmarks.e2e_tp runs on 4 processes: "
                         "torchrun --standalone --nproc_per_node 4 -m benchmarks.e2e_tp")
    from megatron_sparsebalance.training.dist import destroy_distributed

    result = run(args)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"wrote {result['path']}", flush=True)
    dist.barrier()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
