"""Routing coverage of a real pretrained model against the same architecture at random init.

For each held-out window of ``--seq-lengths`` tokens and each ``p`` of ``--ps``, one forward runs
under DST's coverage bound with the smallest request (``budget_scope(k=1, k_base=--moba-topk,
p)``): every sparse-attention layer then uses the smallest ``k`` with ``C(k_base) - C(k) <= p``
(DESIGN.md section 4, step 4) and reports it with ``C(k)`` and ``C(k_base)``
(``attention/budget.py``). The routing is the layers' own; nothing is re-implemented here. Later
layers see the outputs of earlier layers routed at their bounded ``k``, as in a DST step.

Rows: per weights (``smollm2``: the checkpoint; ``random``: megatron-core's init of its
architecture), sequence length and ``p``: ``k`` per layer (mean over the windows, and the min/max
over windows), ``C(k_base)`` per layer, and the mean over layers. Writes ``--out`` (default
benchmarks/results/realworld_coverage.json).

GPU (see docs/REAL_MODEL.md)::

    python -m benchmarks.realworld_coverage --checkpoint /tmp/smollm2/mcore \\
        --data-path /tmp/realdata/valid_text_document --seq-lengths 8192 32768 --bf16

CPU smoke (the tiny GGUF's checkpoint, 1K tokens)::

    python -m benchmarks.realworld_coverage --checkpoint ckpt --data-path valid_text_document \\
        --seq-lengths 1024 --moba-block-size 64 --moba-topk 8 --windows 1 --sparse-attn-impl torch
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

import torch

from benchmarks.realworld import build, checkpoint_shape, gpu_name, heldout_windows, sparse_config
from megatron_sparsebalance.attention.budget import budget_scope

DEFAULT_OUT = os.path.join("benchmarks", "results", "realworld_coverage.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="converted checkpoint root (tools/get_model.py --mcore-out)")
    p.add_argument("--data-path", required=True, help="held-out documents (.bin/.idx prefix, preprocess_data.py)")
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--ps", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="coverage bounds p (--dst-p)")
    p.add_argument("--moba-block-size", type=int, default=64)
    p.add_argument("--moba-topk", type=int, default=16, help="k_base")
    p.add_argument("--windows", type=int, default=4, help="held-out windows per sequence length")
    p.add_argument("--sparse-attn-impl", default="auto")
    p.add_argument("--bf16", action="store_true", help="run the model in bf16 (GPU)")
    p.add_argument("--random-seed", type=int, default=1234, help="seed of the random-init comparison model")
    p.add_argument("--rotary-base", type=float, default=None,
                   help="override the checkpoint's RoPE base (default: the checkpoint's; SmolLM2: 1e5)")
    p.add_argument("--out", default=DEFAULT_OUT)
    return p


def validate(args) -> None:
    if any(not 0.0 <= p <= 1.0 for p in args.ps):
        raise ValueError(f"--ps must be in [0, 1], got {args.ps}")
    if args.moba_topk < 2:
        raise ValueError(f"--moba-topk must be >= 2 (k_base; DST shrinks from it), got {args.moba_topk}")
    for L in args.seq_lengths:
        if L < args.moba_block_size * args.moba_topk:
            raise ValueError(f"--seq-lengths {L}: shorter than --moba-block-size x --moba-topk "
                             f"({args.moba_block_size * args.moba_topk}); every block would be selected")
    if args.windows < 1:
        raise ValueError(f"--windows must be >= 1, got {args.windows}")


def layer_budgets(model, tokens: torch.Tensor, k_base: int, p: float) -> list:
    """``[(layer_number, k_used, C(k_used), C(k_base))]`` of one bounded forward."""
    tokens = tokens.to(next(model.parameters()).device).unsqueeze(0)
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    with torch.no_grad(), budget_scope(k=1, k_base=k_base, p=p) as report:
        model(tokens, position_ids, None)
    out = []
    for layer in report.layers:
        k_used, cov = layer.stats.unread()
        out.append((layer.layer_number, int(k_used), float(cov), layer.stats.coverage_base))
    return out


def measure(model, windows: list, k_base: int, p: float) -> dict:
    runs = [layer_budgets(model, w, k_base, p) for w in windows]
    per_layer = list(zip(*runs))  # [layer][window]
    k = [[r[1] for r in layer] for layer in per_layer]
    k_mean = [sum(v) / len(v) for v in k]
    return {
        "layers": [layer[0][0] for layer in per_layer],
        "k_per_layer": k_mean,
        "k_min_per_layer": [min(v) for v in k], "k_max_per_layer": [max(v) for v in k],
        "coverage_used_per_layer": [sum(r[2] for r in layer) / len(layer) for layer in per_layer],
        "coverage_base_per_layer": [sum(r[3] for r in layer) / len(layer) for layer in per_layer],
        "k_mean": sum(k_mean) / len(k_mean), "k_min": min(min(v) for v in k), "k_max": max(max(v) for v in k),
    }


def run(args, log=print) -> dict:
    validate(args)
    shape = checkpoint_shape(args.checkpoint)
    if args.rotary_base is not None:
        from dataclasses import replace

        shape = replace(shape, rotary_base=args.rotary_base)
    rows = []
    for L in args.seq_lengths:
        windows = heldout_windows(args.data_path, L, args.windows)
        if not windows:
            raise ValueError(f"--data-path {args.data_path}: fewer than {L} held-out tokens")
        sparse = sparse_config(args.moba_block_size, args.moba_topk, args.sparse_attn_impl)
        for weights, ckpt in (("smollm2", args.checkpoint), ("random", None)):
            model = build(shape, sparse, L, ckpt, bf16=args.bf16, seed=args.random_seed)
            for p in args.ps:
                t0 = time.time()
                row = {"weights": weights, "seq_length": L, "p": p, "k_base": args.moba_topk,
                       "windows": len(windows), **measure(model, windows, args.moba_topk, p)}
                rows.append(row)
                log(f"{weights:8s} L={L:6d} p={p:.2f}: k per layer {[round(k, 1) for k in row['k_per_layer']]} "
                    f"(mean {row['k_mean']:.2f}) [{time.time() - t0:.1f} s]")
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    result = {"gpu": gpu_name(), "checkpoint": os.path.abspath(args.checkpoint), "data_path": args.data_path,
              "moba_block_size": args.moba_block_size, "k_base": args.moba_topk, "bf16": args.bf16,
              "rotary_base": shape.rotary_base, "num_layers": shape.num_layers,
              "rule": "k = smallest k with C(k_base) - C(k) <= p, per layer (DESIGN.md section 4), "
                      "chosen by the layers under budget_scope(k=1, k_base, p)",
              "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
