"""Context extension 8K -> 32K of a pretrained model on real documents: dense, fixed-budget MoBA (two
seeds), SparseBalance p = 0.1 and 0.2, equal steps, one GPU per configuration.

Steps (docs/REAL_MODEL.md has the command):

1. The training mix: ``--train-iters x --global-batch-size`` samples cut from the training
   documents to a ``--distribution`` mix at ``--seq-length`` (data/mixes.py), so a run is one
   epoch and every configuration trains the same samples (SAB reorders only within a global batch).
2. One worker per configuration on its own GPU (``CUDA_VISIBLE_DEVICES``; more configurations
   than GPUs wait for a free one). A worker evaluates the starting checkpoint as published, at its
   own RoPE base ("before"), trains
   it with ``megatron_sparsebalance.pretrain --pretrained-checkpoint --use-checkpoint-args
   --rotary-base R`` and evaluates the result ("after").
3. Evaluation, as the run's own evaluator decides (training/evaluate.py): sparse runs at the fixed
   budget ``--moba-topk`` with DST off, dense runs dense. Held-out loss over ``--eval-windows``
   windows of ``--seq-length`` tokens of the held-out packages' documents, overall and on the last
   quarter of positions; passkey retrieval (a 5-digit number planted at depths 0.1 ... 0.9 of
   held-out text, asked at the end, teacher-forced: right when every answer token is the argmax)
   at each of ``--passkey-lengths``.
4. ``tokens_per_s``: training tokens of the measured iterations (all but the first
   ``--warmup-iters``, which include kernel compilation) over their wall time; ``mean_budget``:
   mean over iterations of the run's mean budget (null for dense).

RoPE base: by default the "NTK-aware" base for the length factor ``--seq-length /
--trained-length``: base * factor^(d / (d - 2)) = 1e5 * 4^(64/62) ~ 4.18e5 for SmolLM2 at 32K.
It stretches the lowest frequencies' angle range by the length factor while leaving the
highest ones almost unchanged, the smallest change that puts 32K positions into angles the model
saw at 8K, which is what a short fine-tune (a few hundred steps) can adapt to; bases 10x larger
(ABF-style 1e6+) move every frequency and need longer training to recover short-context loss.

Writes ``--out`` (benchmarks/results/realworld_extension.json): ``{"gpu", "rows": [{"config",
"steps", "val_loss", "val_loss_last_quarter", "passkey": {"8192": acc, ...}, "tokens_per_s",
"mean_budget", ...}]}`` plus the "before" figures and the settings.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional, Sequence

CONFIGS = {
    "dense": ["--no-sparse-attention", "--dst-anchor", "none", "--batching", "none"],
    "fixed": ["--dst-anchor", "none", "--batching", "none"],
    "fixed_seed2": ["--dst-anchor", "none", "--batching", "none", "--seed", "2"],
    "sb_p0.1": ["--dst-anchor", "mean", "--dst-p", "0.1", "--batching", "sab"],
    "sb_p0.2": ["--dst-anchor", "mean", "--dst-p", "0.2", "--batching", "sab"],
}
DEFAULT_OUT = os.path.join("benchmarks", "results", "realworld_extension.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="converted checkpoint root (tools/get_model.py --mcore-out)")
    p.add_argument("--tokenizer-model", required=True, help="the model's HF directory (tools/get_model.py --hf-out)")
    p.add_argument("--train-documents", required=True, help="training documents, .bin/.idx prefix")
    p.add_argument("--valid-documents", required=True, help="held-out documents, .bin/.idx prefix")
    p.add_argument("--workdir", default="/tmp/realworld_extension", help="mix, runs and checkpoints")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--seq-length", type=int, default=32768)
    p.add_argument("--trained-length", type=int, default=8192, help="context the model was trained at")
    p.add_argument("--rotary-base", type=float, default=None, help="default: the NTK-aware base (see above)")
    p.add_argument("--distribution", default="longtail", choices=("longtail", "bimodal"))
    p.add_argument("--train-iters", type=int, default=60)
    p.add_argument("--warmup-iters", type=int, default=3, help="iterations left out of tokens/s")
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--moba-block-size", type=int, default=64)
    p.add_argument("--moba-topk", type=int, default=32, help="k_base of the sparse runs")
    p.add_argument("--sparse-attn-impl", default="auto")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--eval-windows", type=int, default=4)
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--passkey-keys", type=int, default=2, help="numbers per depth and length")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to spread the configurations over (default: all)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def rotary_base(args) -> float:
    from benchmarks.realworld import checkpoint_shape, ntk_rotary_base

    if args.rotary_base is not None:
        return args.rotary_base
    shape = checkpoint_shape(args.checkpoint)
    return ntk_rotary_base(shape.rotary_base, shape.kv_channels, args.seq_length / args.trained_length)


def rotary_base_of(checkpoint: str) -> float:
    from benchmarks.realworld import checkpoint_shape

    return checkpoint_shape(checkpoint).rotary_base


def validate(args) -> None:
    if args.train_iters <= args.warmup_iters:
        raise ValueError(f"--train-iters ({args.train_iters}) must exceed --warmup-iters ({args.warmup_iters})")
    if max(args.passkey_lengths) > args.seq_length:
        raise ValueError(f"--passkey-lengths {args.passkey_lengths}: longer than --seq-length {args.seq_length}")
    if args.seq_length < args.moba_block_size * args.moba_topk:
        raise ValueError("--seq-length must exceed --moba-block-size x --moba-topk (else the runs are all dense)")


# ---- the worker: one configuration on one device ------------------------------------------------


def _evaluate(args, checkpoint: str, config: str, base: Optional[float]) -> dict:
    """Loss and passkey of ``checkpoint`` with the run's attention; ``base`` None: its own RoPE base."""
    from dataclasses import replace

    import torch

    from benchmarks import realworld as rw
    from megatron_sparsebalance.data.datasets import load_tokenizer

    shape = rw.checkpoint_shape(checkpoint)
    shape = replace(shape, rotary_base=base) if base is not None else shape
    sparse = rw.sparse_config(args.moba_block_size, args.moba_topk, args.sparse_attn_impl, sparse=config != "dense")
    model = rw.build(shape, sparse, args.seq_length, checkpoint, bf16=args.bf16)
    windows = rw.heldout_windows(args.valid_documents, args.seq_length, args.eval_windows)
    out = rw.loss_summary([rw.token_losses(model, w) for w in windows])
    tokenizer = load_tokenizer(args.tokenizer_model)
    filler = torch.cat(rw.heldout_windows(args.valid_documents, max(args.passkey_lengths), 1) or [torch.zeros(0)])
    out["passkey"] = {str(L): rw.passkey_accuracy(model, rw.passkey_prompts(tokenizer, filler, L, args.passkey_keys),
                                                  len(tokenizer))
                      for L in args.passkey_lengths}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _pretrain_argv(args, config: str, base: float, run_dir: str) -> list:
    return ["--pretrained-checkpoint", args.checkpoint, "--use-checkpoint-args", "--rotary-base", repr(base),
            "--data-path", os.path.join(args.workdir, "mix"), "--seq-length", str(args.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch_size),
            "--train-iters", str(args.train_iters), "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
            "--lr-warmup-iters", str(max(1, args.train_iters // 10)), "--moba-block-size", str(args.moba_block_size),
            "--moba-topk", str(args.moba_topk), "--sparse-attn-impl", args.sparse_attn_impl,
            "--log-interval", "1", "--log-dir", run_dir, "--save", os.path.join(run_dir, "ckpt"),
            "--save-interval", str(args.train_iters), "--seed", str(args.seed),
            *(["--bf16"] if args.bf16 else []), *CONFIGS[config]]


def _tokens_per_iteration(args, config: str) -> list:
    """Tokens of each iteration's global batch: the sampler's order is a function of the lengths and seed."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_sparsebalance.data.sampler import GlobalBatchSampler

    seed = int(CONFIGS[config][CONFIGS[config].index("--seed") + 1]) if "--seed" in CONFIGS[config] else args.seed
    # The lengths are a view of the index's memory map, which closes with the data set: copy them
    # while it is alive.
    mix = IndexedDataset(os.path.join(args.workdir, "mix"), mmap=True)
    lengths = np.array(mix.sequence_lengths, dtype=np.int64)
    del mix
    sampler = GlobalBatchSampler(lengths, args.global_batch_size, batcher=None, seed=seed)
    return [int(sum(lengths[i] for i in sampler.next_indices())) for _ in range(args.train_iters)]


def worker(args, config: str) -> dict:
    base = rotary_base(args)
    run_dir = os.path.join(args.workdir, config)
    os.makedirs(run_dir, exist_ok=True)
    t0 = time.time()
    before = _evaluate(args, args.checkpoint, config, None)  # the model as published, at its own base
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    with open(os.path.join(run_dir, "pretrain.log"), "w") as log:
        rc = subprocess.run([sys.executable, "-m", "megatron_sparsebalance.pretrain",
                             *_pretrain_argv(args, config, base, run_dir)], env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc.returncode:
        raise RuntimeError(f"{config}: pretrain exited {rc.returncode}; see {run_dir}/pretrain.log")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    after = _evaluate(args, os.path.join(run_dir, "ckpt"), config, base)
    tokens = _tokens_per_iteration(args, config)
    measured = [m for m in metrics if m["iteration"] > args.warmup_iters]
    seconds = sum(m["elapsed_ms"] for m in measured) / 1e3
    budgets = [m["mean_budget"] for m in metrics if m.get("mean_budget") == m.get("mean_budget")]  # drop NaN
    row = {"config": config, "steps": len(metrics), "val_loss": after["val_loss"],
           "val_loss_last_quarter": after["val_loss_last_quarter"], "passkey": after["passkey"],
           "tokens_per_s": sum(tokens[m["iteration"] - 1] for m in measured) / seconds if seconds else None,
           "mean_budget": sum(budgets) / len(budgets) if budgets and config != "dense" else None,
           "before": {"val_loss": before["val_loss"], "val_loss_last_quarter": before["val_loss_last_quarter"],
                      "passkey": before["passkey"], "rotary_base": rotary_base_of(args.checkpoint)},
           "train_loss_first": metrics[0]["loss"], "train_loss_last": metrics[-1]["loss"],
           "eval_windows": after["windows"], "rotary_base": base, "wall_s": time.time() - t0}
    with open(os.path.join(run_dir, "row.json"), "w") as f:
        json.dump(row, f, indent=1)
    return row


# ---- the driver -------------------------------------------------------------------------------


def build_training_mix(args, log=print) -> dict:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_sparsebalance.data.mixes import mix_summary, plan_mix, write_mix

    if not IndexedDataset.exists(args.train_documents):
        raise ValueError(f"--train-documents {args.train_documents!r}: no .bin/.idx")
    docs = IndexedDataset(args.train_documents, mmap=True)
    count = args.train_iters * args.global_batch_size
    cuts = plan_mix(docs.sequence_lengths, args.distribution, count, args.seq_length, args.seed)
    write_mix(docs, cuts, os.path.join(args.workdir, "mix"))
    summary = mix_summary(cuts, args.distribution, args.seq_length, args.seed)
    log(f"training mix: {count} samples, {summary['tokens']} tokens, rules {summary['rules']}")
    return summary


def run(args, argv: Sequence[str], log=print) -> dict:
    """The driver; ``argv`` (this command's own arguments) is handed to each worker."""
    import torch

    validate(args)
    os.makedirs(args.workdir, exist_ok=True)
    mix = build_training_mix(args, log)
    base = rotary_base(args)
    gpus = args.gpus or max(1, torch.cuda.device_count())
    log(f"{len(args.configs)} configurations over {gpus} device(s), rotary base {base:.4g}")
    waiting, running, rows = list(args.configs), {}, {}
    free = list(range(gpus))
    while waiting or running:
        while waiting and free:
            config, gpu = waiting.pop(0), free.pop(0)
            env = dict(os.environ)
            if torch.cuda.is_available():
                env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            log_path = os.path.join(args.workdir, f"{config}.worker.log")
            os.makedirs(os.path.join(args.workdir, config), exist_ok=True)
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.realworld_extension", *argv, "--worker", config],
                                    env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
            running[config] = (proc, gpu, log_path)
            log(f"  {config} started on device {gpu}")
        time.sleep(1)
        for config, (proc, gpu, log_path) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[config]
            free.append(gpu)
            if proc.returncode:
                log(f"  {config} FAILED (exit {proc.returncode}); see {log_path}")
                continue
            with open(os.path.join(args.workdir, config, "row.json")) as f:
                rows[config] = json.load(f)
            r = rows[config]
            log(f"  {config}: val loss {r['before']['val_loss']:.3f} -> {r['val_loss']:.3f} (last quarter "
                f"{r['val_loss_last_quarter']:.3f}), passkey {r['passkey']}, {r['tokens_per_s'] or 0:.0f} tokens/s")
    result = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "rotary_base": base, "seq_length": args.seq_length, "trained_length": args.trained_length,
              "moba_block_size": args.moba_block_size, "k_base": args.moba_topk, "lr": args.lr,
              "global_batch_size": args.global_batch_size, "distribution": args.distribution,
              "mix": {k: mix[k] for k in ("samples", "tokens", "rules", "quantiles")},
              "eval": "sparse runs at the fixed budget k_base (DST off), dense runs dense; teacher-forced passkey",
              "rows": [rows[c] for c in args.configs if c in rows],
              "failed": [c for c in args.configs if c not in rows]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.worker:
            worker(args, args.worker)
            return 0
        result = run(args, argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
