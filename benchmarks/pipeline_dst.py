"""DST in the pipeline, measured: fixed budget against DST anchors, side by side in one run.

Run under torchrun, one process per GPU (or over gloo on a CPU for a smoke run)::

    torchrun --nproc_per_node 2 -m benchmarks.pipeline_dst --pp 2 --model qwen2.5-0.5b \\
        --seq-length 32768 --micro-batches 8 --iters 6 --anchors none mean --out results/

For each anchor the same global batches (long-tailed lengths, random tokens) go through the
same stage models: warm-up iterations first, then ``--iters`` measured ones. Per iteration the
schedule reports imbalance (max / mean micro-batch time), bubble per stage and iteration time;
the medians are written to ``pipeline_dst_<tag>.json`` with a Chrome trace of one iteration per
anchor (``trace_<anchor>.json``; ``tools/plot_timeline.py`` draws it). ``--check-megatron``
first checks our schedule against megatron-core's own 1F1B on the same micro-batches.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_sparsebalance.attention import SparseAttentionConfig
from megatron_sparsebalance.balance.dst import ANCHORS, GROWTH_RULES, DSTConfig
from megatron_sparsebalance.balance.latency import AnalyticLatencyModel, LatencyModel, device_name
from megatron_sparsebalance.data.distributions import sample_lengths
from megatron_sparsebalance.data.synthetic import pack_sequences
from megatron_sparsebalance.ops.implementations import IMPLEMENTATIONS, resolve_impl
from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
from megatron_sparsebalance.training.dist import init_distributed
from megatron_sparsebalance.training.model import MODEL_PRESETS, with_layers
from megatron_sparsebalance.training.step import layers_per_stage
from megatron_sparsebalance.training.trainer import OptimSettings, Trainer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="--pipeline-model-parallel-size")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--seq-length", type=int, default=32768, help="longest sample (lengths are capped here)")
    p.add_argument("--dist", default="longtail", help="length distribution of the samples")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per DP rank per global batch")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples packed per micro-batch")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--anchors", nargs="+", default=["none", "mean"], choices=ANCHORS)
    p.add_argument("--dst-p", type=float, default=0.1)
    p.add_argument("--dst-growth", choices=GROWTH_RULES, default="bubble",
                   help="how far micro-batches below the anchor grow (the committed 2xH200 figures: anchor)")
    p.add_argument("--moba-block-size", type=int, default=128)
    p.add_argument("--moba-topk", type=int, default=32)
    p.add_argument("--sparse-attn-impl", choices=IMPLEMENTATIONS, default="auto")
    p.add_argument("--latency-table", default=None, help="profiled latency table (default: the analytic model)")
    p.add_argument("--check-megatron", action="store_true", help="compare with megatron-core's 1F1B first")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tag", default=None, help="results file suffix (default: from the GPU count)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--trace-dir", default=None, help="where the Chrome traces go (default: --out)")
    return p.parse_args(argv)


def global_batches(args, vocab: int, dp: int):
    """The same long-tailed global batches for every anchor: ``[iteration][dp][micro-batch]``."""
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    out = []
    per_batch = dp * args.micro_batches * args.micro_batch_size
    for _ in range(args.warmup + args.iters):
        lengths = sample_lengths(args.dist, per_batch, args.seq_length, rng).tolist()
        it = iter(lengths)
        ranks = []
        for _ in range(dp):
            mbs = []
            for _ in range(args.micro_batches):
                seqs = [torch.randint(1, vocab, (next(it),), generator=gen) for _ in range(args.micro_batch_size)]
                mbs.append(pack_sequences(seqs, [torch.ones(len(s)) for s in seqs]))
            ranks.append(mbs)
        out.append(ranks)
    return out


def main(argv=None):
    args = parse_args(argv)
    enable_cpu_megatron()
    init_distributed(pipeline_parallel_size=args.pp, seed=args.seed)
    on_gpu = torch.cuda.is_available()
    shape = MODEL_PRESETS[args.model]
    if args.num_layers:
        shape = with_layers(shape, args.num_layers)
    if not on_gpu and args.pp > 1 and not shape.untie_embeddings_and_output_weights:
        from dataclasses import replace

        shape = replace(shape, untie_embeddings_and_output_weights=True)  # tied + PP needs CUDA in megatron-core
    dp = parallel_state.get_data_parallel_world_size()
    rank0 = dist.get_rank() == 0
    sparse = SparseAttentionConfig(moba_block_size=args.moba_block_size, moba_topk=args.moba_topk,
                                   sparse_attn_impl=args.sparse_attn_impl)
    device = torch.device("cuda" if on_gpu else "cpu")
    nl = layers_per_stage(shape.num_layers, args.pp)
    batches = global_batches(args, min(shape.vocab_size, 32000), dp)
    result = dict(gpu=device_name() if on_gpu else "cpu", torch=torch.__version__, pp=args.pp, dp=dp,
                  model=args.model, num_layers=shape.num_layers, dist=args.dist, seq_length=args.seq_length,
                  micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                  block_size=args.moba_block_size, k_base=args.moba_topk, dst_p=args.dst_p,
                  impl=resolve_impl(args.sparse_attn_impl, device), rows=[])

    if args.check_megatron:
        # fp32 and the torch attention path (the Triton/CUDA kernels are bf16/fp16), so the two
        # schedules must agree to fp32 rounding; packs of up to 4K tokens keep the fp32 path small.
        from megatron_sparsebalance.pipeline.oracle import compare_with_megatron
        from megatron_sparsebalance.training.model import build_gpt_model, transformer_config
        from megatron_sparsebalance.training.step import stage_flags

        cfg = transformer_config(shape, pipeline_parallel_size=args.pp)
        cfg.moe_token_dispatcher_type = "alltoall"
        torch.manual_seed(args.seed)
        check_sparse = SparseAttentionConfig(moba_block_size=args.moba_block_size, moba_topk=4, sparse_attn_impl="torch")
        model = build_gpt_model(shape, check_sparse, cfg, args.seq_length, **stage_flags()).to(device)
        gen = torch.Generator().manual_seed(args.seed)
        check = [pack_sequences([torch.randint(1, min(shape.vocab_size, 1000), (min(n, args.seq_length),), generator=gen) for n in lengths],
                                [torch.ones(min(n, args.seq_length)) for n in lengths])
                 for lengths in ([1500, 700], [4000], [300, 300, 900], [2100])]
        diff = compare_with_megatron(model, cfg, check, shape.hidden_size, budget=4)
        diffs = [None] * dist.get_world_size()
        dist.all_gather_object(diffs, diff)
        result["megatron_check"] = diffs
        if rank0:
            print("megatron-core 1F1B vs ours:", json.dumps(diffs), flush=True)
        del model
        if on_gpu:
            torch.cuda.empty_cache()

    tag = args.tag or (f"h200x{dist.get_world_size()}" if on_gpu else "cpu")
    if rank0:
        os.makedirs(args.trace_dir or args.out, exist_ok=True)
    for anchor in args.anchors:
        if args.latency_table:
            latency = LatencyModel.load(args.latency_table)
        else:
            latency = AnalyticLatencyModel(shape, nl, block_size=args.moba_block_size,
                                           hardware="h200" if on_gpu else "cpu", dtype_bytes=2 if on_gpu else 4)
        torch.manual_seed(args.seed)
        trainer = Trainer(shape, sparse, DSTConfig(anchor=anchor, p=args.dst_p, k_base=args.moba_topk, growth=args.dst_growth),
                          OptimSettings(lr=1e-5, min_lr=1e-6), max_sequence_length=args.seq_length, bf16=on_gpu,
                          latency_model=latency)
        measured = []
        for it, gb in enumerate(batches):
            lengths = [[b.lengths for b in rank] for rank in gb]
            step = trainer.train_step(lengths, gb[parallel_state.get_data_parallel_rank()])
            m = step.metrics
            if rank0:
                print(f"[{anchor}] iter {it} loss {step.loss:.3f} iter {m.iteration_ms:.1f} ms imbalance {m.imbalance:.3f} "
                      f"bubble {[round(b, 3) for b in m.bubble]} budgets {[round(b, 1) for b in m.budgets]} "
                      f"dst {step.dst_ms:.2f} ms", flush=True)
            if it >= args.warmup:
                measured.append(dict(iteration_ms=m.iteration_ms, imbalance=m.imbalance, bubble=m.bubble,
                                     budgets=m.budgets, micro_batch_ms=m.micro_batch_ms, predicted_ms=m.predicted_ms,
                                     loss=step.loss, dst_ms=step.dst_ms))
                if it == args.warmup and rank0:
                    m.write_trace(os.path.join(args.trace_dir or args.out, f"trace_{tag}_{anchor}.json"))
        result["rows"].append(dict(
            dst_anchor=anchor,
            imbalance=statistics.median(r["imbalance"] for r in measured),
            iter_ms=statistics.median(r["iteration_ms"] for r in measured),
            bubble=statistics.median(sum(r["bubble"]) / len(r["bubble"]) for r in measured),
            mean_budget=statistics.mean(b for r in measured for b in r["budgets"]),
            dst_overhead_ms=statistics.median(r["dst_ms"] for r in measured),
            iterations=measured,
        ))
        del trainer
        if on_gpu:
            torch.cuda.empty_cache()
    base = next((r for r in result["rows"] if r["dst_anchor"] == "none"), None)
    for r in result["rows"]:
        r["speedup"] = base["iter_ms"] / r["iter_ms"] if base else None
    if rank0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"pipeline_dst_{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(f"{'anchor':>8} {'imbalance':>10} {'iter ms':>9} {'bubble':>7} {'budget':>7} {'speedup':>8}")
        for r in result["rows"]:
            print(f"{r['dst_anchor']:>8} {r['imbalance']:10.3f} {r['iter_ms']:9.1f} {r['bubble']:7.3f} "
                  f"{r['mean_budget']:7.1f} {r['speedup'] or 0:8.3f}")
    return result


if __name__ == "__main__":
    main()
