"""Fidelity: does training with DST + SAB reach the quality of the fixed budget (and of dense)?

Each configuration is one ``megatron_sparsebalance.pretrain`` run from scratch on the mock
retrieval task (longtail lengths up to ``--seq-length``; many key/value records per sample, a
question for each, loss and accuracy on the answers: data/synthetic.py), on the same tokens (same
``--train-iters``, global batch and ``--seed``, hence the same samples in the same order),
evaluated on the held-out split at the fixed budget ``--moba-topk`` (training/evaluate.py)::

    python -m benchmarks.fidelity --out benchmarks/results          # all five, GPUs shared out
    python -m benchmarks.fidelity --configs dense sb_p0.1 --model tiny --seq-length 1024 --train-iters 2 \\
        --eval-interval 2 --eval-iters 1 --global-batch-size 4 --mock-vocab-size 64 --moba-block-size 64 \\
        --moba-topk 4 --sparse-attn-impl torch --out /tmp/fidelity            # CPU smoke (~15 s)

With ``--start-iters N`` the configurations do not start from random weights: one shared start is
trained first (dense attention, the same task at ``--start-seq-length``, default 1024 tokens) and
every configuration loads its weights (``--pretrained-checkpoint``), as a long-context run
continues a model pretrained on short samples; ``--start-checkpoint`` reuses an earlier call's.
From random weights no run of a few minutes left chance at 32K (docs/BENCHMARKS.md, Fidelity).

Configurations: ``dense`` (``--no-sparse-attention``), ``fixed`` (``--dst-anchor none``, samples in
arrival order: the paper's baseline), ``fixed_seed2`` (the same with ``--seed2``: how far two
seeds of one method land apart, the yardstick for the other gaps), ``sb_p0.1`` and ``sb_p0.2``
(``--dst-anchor mean --dst-p P --batching sab``). Runs go ``--gpus-per-run`` GPUs each, as many at
once as the visible GPUs allow (``CUDA_VISIBLE_DEVICES`` per slot; the next configuration starts
when a slot frees up); without GPUs one after the other, ``--gpus-per-run`` gloo processes each.
Flags this script does not know are passed on to every run, after its own, so they override them.

**Sizing (the defaults).** About 8 minutes of training per configuration on one H200: the sparse
configurations of ``fidelity-small`` at ``--seq-length 32768`` take 0.47-0.55 s per iteration of
16 longtail samples (measured), so 800 iterations are 380-440 s, plus start-up and evaluations.
``--timeout-s 540`` then stops whatever still runs (SIGTERM; pretrain ends its iteration, saves if
asked and evaluates a last time; killed if still there ``STOP_GRACE_S`` later): leave that
margin inside a device command's limit. Dense
attention is about 3x slower per iteration here (the 100-iteration run needed ~1.7 s per
iteration) and should reach ~300 iterations by then: its row
keeps what it logged (``stopped``, ``iterations``, ``eval_iteration``, and its eval curve, to
compare with the others at the same iterations). One configuration per GPU: on 4 GPUs, four run
at once and a fifth would start only after one ends (past the device limit), so split them over
two commands, the second with ``--merge`` to add its rows to the first's ``fidelity.json``::

    python -m benchmarks.fidelity --out $OUT --configs fixed sb_p0.1 dense fixed_seed2   # 4 GPUs, ~9.5 min
    python -m benchmarks.fidelity --out $OUT --configs sb_p0.2 --merge

Measured per run: ``wall_s``, the training iterations' own time (pretrain's per-iteration
``elapsed_ms`` summed: no start-up, no evaluation), and ``process_wall_s``, the whole torchrun
process. Writes ``<out>/fidelity.json`` (``{"gpu", "start", "rows": [{"config", "tokens", "val_loss",
"retrieval_acc", "acc_by_length", "acc_by_distance", "chance", "mean_budget", "mean_coverage",
"wall_s", ...}]}``; ``retrieval_acc`` is the exact match per question, budgets and coverage are
training means, None for dense), ``fidelity_loss.png``, ``fidelity_acc.png``, and keeps every
run's logs, config, ``metrics.jsonl`` and ``eval.jsonl`` under ``<runs-dir>/<config>/``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

# In the order they start: when GPUs are few, the baseline and SparseBalance come first.
CONFIGS = ("fixed", "sb_p0.1", "dense", "fixed_seed2", "sb_p0.2")


@dataclass
class Run:
    config: str
    seed: int
    flags: list
    log_dir: str


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="*", choices=CONFIGS, default=list(CONFIGS),
                   help="none: only train the start (--start-iters)")
    p.add_argument("--model", default="fidelity-small", help="pretrain --model preset")
    p.add_argument("--train-iters", type=int, default=800, help="about 8 minutes of the sparse runs on one H200")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=2, help="samples per micro-batch on average (packs)")
    p.add_argument("--seq-length", type=int, default=32768)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=4, help="validation global batches per evaluation")
    p.add_argument("--mock-vocab-size", type=int, default=512, help="at most the model's vocabulary")
    p.add_argument("--mock-retrieval-depth", default="uniform", choices=("early", "uniform"),
                   help="uniform spreads the record-to-question distance, so accuracy can be read by distance")
    p.add_argument("--mock-retrieval-records", default="auto",
                   help="records (questions) per sample: auto = one per 256 tokens, or a count")
    p.add_argument("--moba-block-size", type=int, default=128)
    p.add_argument("--moba-topk", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--lr-warmup-iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--seed2", type=int, default=4321, help="the seed of fixed_seed2")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: --bf16 on GPUs, fp32 on the CPU")
    p.add_argument("--gpus-per-run", type=int, default=1, help="processes (GPUs) per run: PP x DP")
    p.add_argument("--pp", type=int, default=1, help="--pipeline-model-parallel-size of every run")
    p.add_argument("--runs-per-gpu", type=int, default=1,
                   help="runs placed on one GPU at once (small models leave a GPU mostly idle); the first "
                        "configurations keep a GPU of their own longest, and rows say whom they shared with")
    p.add_argument("--start-iters", type=int, default=0,
                   help="first train one shared start this many iterations (dense, at --start-seq-length) and begin "
                        "every configuration from its weights; 0: every configuration from random weights")
    p.add_argument("--start-seq-length", type=int, default=1024, help="the start's --seq-length")
    p.add_argument("--start-global-batch-size", type=int, default=None,
                   help="the start's --global-batch-size (default: --global-batch-size)")
    p.add_argument("--start-micro-batch-size", type=int, default=None,
                   help="the start's --micro-batch-size (default: --micro-batch-size)")
    p.add_argument("--start-lr", type=float, default=1e-3, help="the start's --lr")
    p.add_argument("--start-checkpoint", default=None,
                   help="begin every configuration from this start (the start/checkpoint folder of an earlier "
                        "call's runs) instead of training one")
    p.add_argument("--timeout-s", type=float, default=540.0,
                   help="a run still going after this is stopped (and keeps what it logged)")
    p.add_argument("--total-timeout-s", type=float, default=None,
                   help="stop whatever still runs after this long, and start nothing new")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of configurations this call does not run from <out>/fidelity.json (written "
                        "by an earlier call with the same settings): splits the configurations over several calls")
    p.add_argument("--runs-dir", default=None, help="run logs (default: <out>/fidelity_runs)")
    args, extra = p.parse_known_args(argv)
    args.extra = extra
    if args.runs_per_gpu < 1:
        p.error(f"--runs-per-gpu must be >= 1, got {args.runs_per_gpu}")
    if args.gpus_per_run < 1 or args.gpus_per_run % args.pp:
        p.error(f"--gpus-per-run ({args.gpus_per_run}) must be a positive multiple of --pp ({args.pp})")
    if args.start_iters < 0:
        p.error(f"--start-iters must be >= 0, got {args.start_iters}")
    if args.start_iters and args.start_checkpoint:
        p.error("--start-iters trains a start, --start-checkpoint takes an earlier one: give one of them")
    if args.start_checkpoint and not os.path.isdir(args.start_checkpoint):
        p.error(f"--start-checkpoint {args.start_checkpoint}: no such directory")
    if not args.configs and not args.start_iters:
        p.error("--configs is empty and there is no start to train (--start-iters): nothing to run")
    args.runs_dir = args.runs_dir or os.path.join(args.out, "fidelity_runs")
    return args


def config_flags(config: str) -> list:
    """What sets a configuration apart (the rest of the command is common)."""
    if config == "dense":
        return ["--no-sparse-attention", "--dst-anchor", "none", "--batching", "none"]
    if config in ("fixed", "fixed_seed2"):
        return ["--dst-anchor", "none", "--batching", "none"]
    p = config.removeprefix("sb_p")
    return ["--dst-anchor", "mean", "--dst-p", p, "--batching", "sab"]


START = "start"
"""The run that trains the shared start (--start-iters): its logs, and its checkpoint under ``checkpoint``."""


def task_flags(args, on_gpus: bool, seed: int, seq_length: int, global_batch: int, micro_batch: int, iters: int,
               lr: float, eval_interval: int) -> list:
    """The model, the retrieval data and the schedule: what every run of one call shares."""
    bf16 = args.precision == "bf16" or (args.precision == "auto" and on_gpus)
    return [
        "--model", args.model, "--pipeline-model-parallel-size", str(args.pp),
        "--mock-data", "--mock-length-distribution", "longtail", "--mock-content", "retrieval",
        "--mock-retrieval-depth", args.mock_retrieval_depth, "--mock-retrieval-records", args.mock_retrieval_records,
        "--mock-vocab-size", str(args.mock_vocab_size),
        "--seq-length", str(seq_length), "--global-batch-size", str(global_batch),
        "--micro-batch-size", str(micro_batch), "--train-iters", str(iters),
        "--moba-block-size", str(args.moba_block_size), "--moba-topk", str(args.moba_topk),
        "--lr", str(lr), "--min-lr", str(args.min_lr), "--lr-warmup-iters", str(args.lr_warmup_iters),
        "--lr-decay-iters", str(iters), "--seed", str(seed),
        "--eval-interval", str(eval_interval), "--eval-iters", str(args.eval_iters),
        "--log-interval", str(max(1, iters // 20)), *(["--bf16"] if bf16 else []),
    ]


def start_checkpoint(args) -> str | None:
    """Where every configuration's weights begin: a start trained by this call, an earlier one, or none."""
    if args.start_iters:
        return os.path.join(args.runs_dir, START, "checkpoint")
    return args.start_checkpoint


def build_start(args, on_gpus: bool) -> Run:
    """The shared start: dense attention on short samples of the same task, like the short-context
    pretraining a long-context run continues from. Every configuration then begins from the same
    weights, so what they learn at long lengths is what the comparison sees, and a run of a few
    minutes need not first learn the lookup itself from random weights at 32K, where none did."""
    log_dir = os.path.join(args.runs_dir, START)
    flags = [*task_flags(args, on_gpus, args.seed, args.start_seq_length,
                         args.start_global_batch_size or args.global_batch_size,
                         args.start_micro_batch_size or args.micro_batch_size, args.start_iters, args.start_lr,
                         eval_interval=args.start_iters),
             *config_flags("dense"), *args.extra, "--save", os.path.join(log_dir, "checkpoint")]
    return Run(START, args.seed, flags, log_dir)


def build_runs(args, on_gpus: bool) -> list:
    start = start_checkpoint(args)
    runs = []
    for config in args.configs:
        seed = args.seed2 if config == "fixed_seed2" else args.seed
        flags = [
            *task_flags(args, on_gpus, seed, args.seq_length, args.global_batch_size, args.micro_batch_size,
                        args.train_iters, args.lr, args.eval_interval),
            *config_flags(config), *(["--pretrained-checkpoint", start] if start else []), *args.extra,
        ]
        runs.append(Run(config, seed, flags, os.path.join(args.runs_dir, config)))
    return runs


def visible_gpus() -> list:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries for the runs."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited:  # a run's "0" must be the first GPU given to us, not physical GPU 0
        return [g.strip() for g in inherited.split(",") if g.strip()][:count]
    return [str(i) for i in range(count)]


def launch(run: Run, nproc: int, gpus: list, threads: int = 1) -> tuple:
    """Start one run (torchrun, its own log dir) with ``threads`` CPU threads per process; returns
    (process, start time, log file)."""
    shutil.rmtree(run.log_dir, ignore_errors=True)  # pretrain appends to metrics.jsonl / eval.jsonl
    os.makedirs(run.log_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "megatron_sparsebalance.pretrain", *run.flags, "--log-dir", run.log_dir]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    # Runs share the host: left alone, every process sizes its thread pools to all the cores. Five
    # runs of the tiny model took 0.68 s per iteration on 4 H200s that way, and 0.17 s on one H200
    # with a share of the cores each.
    env["OMP_NUM_THREADS"] = str(threads)
    log = open(os.path.join(run.log_dir, "pretrain.log"), "w")
    log.write(" ".join(cmd) + "\n\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, time.perf_counter(), log


# After SIGTERM pretrain ends its iteration, saves (with --save) and runs its last evaluation: on
# the GPUs that took more than 15 s for the start's checkpoint and evaluation, and a kill then
# lost the evaluation.
STOP_GRACE_S = 60


def stop(proc: subprocess.Popen) -> None:
    """Stop a run: torchrun and its workers (their own process group), politely first."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def run_all(runs: list, args, gpus: list, deadline: float = math.inf, shared: dict | None = None) -> dict:
    """Run every configuration, ``len(gpus) // --gpus-per-run`` at a time (one after the other
    without GPUs); returns ``{config: (exit code, process seconds, stopped)}``. A run past
    ``--timeout-s``, or still going at ``deadline`` (``time.perf_counter()``: the end of
    ``--total-timeout-s``), is stopped (SIGTERM: pretrain ends the iteration it is in and exits;
    ``stopped`` is True); runs not started by then are left out. ``shared``, if given, gets
    ``{config: [configs that ran on one of its GPUs at the same time]}``."""
    if gpus and len(gpus) < args.gpus_per_run:
        raise SystemExit(f"--gpus-per-run {args.gpus_per_run} but only {len(gpus)} GPUs are visible")
    own = [gpus[i * args.gpus_per_run:(i + 1) * args.gpus_per_run] for i in range(len(gpus) // args.gpus_per_run)]
    # Second runs go to the last GPUs first: the first configurations (the baseline, then
    # SparseBalance) keep a GPU to themselves, so their wall times stay comparable.
    slots = (own + [slot for _ in range(args.runs_per_gpu - 1) for slot in reversed(own)]) if gpus else [[]]
    spans = []  # (config, GPUs, start, end)
    processes = len(slots) * args.gpus_per_run if gpus else 1
    threads = max(1, (os.cpu_count() or 1) // processes) if gpus else 1
    pending, running, done, stopped = list(runs), {}, {}, set()
    while running or (pending and time.perf_counter() < deadline):
        for slot_id, slot in enumerate(slots):
            if slot_id not in running and pending and time.perf_counter() < deadline:
                run = pending.pop(0)
                running[slot_id] = (run, *launch(run, args.gpus_per_run, slot, threads))
                print(f"[fidelity] {run.config}: started on {'GPUs ' + ','.join(slot) if slot else 'CPU'}", flush=True)
        time.sleep(0.5)
        for slot_id, (run, proc, t0, log) in list(running.items()):
            now = time.perf_counter()
            if proc.poll() is None and (now - t0 > args.timeout_s or now > deadline):
                print(f"[fidelity] {run.config}: stopped after {now - t0:.0f} s (time limit)", flush=True)
                stop(proc)
                stopped.add(run.config)
            if proc.poll() is not None:
                log.close()
                done[run.config] = (proc.returncode, time.perf_counter() - t0, run.config in stopped)
                spans.append((run.config, set(slots[slot_id]), t0, time.perf_counter()))
                del running[slot_id]
                print(f"[fidelity] {run.config}: exit {proc.returncode} after {done[run.config][1]:.1f} s", flush=True)
    for run in pending:
        print(f"[fidelity] {run.config}: not started (--total-timeout-s)", flush=True)
    if shared is not None:
        for config, on, begin, end in spans:
            shared[config] = [other for other, on2, b2, e2 in spans
                              if other != config and on & on2 and b2 < end and begin < e2]
    return done


# ---- results ---------------------------------------------------------------------------------


def read_jsonl(path: str) -> list:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def trained_tokens(config: dict, iterations: int) -> int:
    """Tokens of the samples a run trained on: its data set and sample order, rebuilt from the
    run's own config.json (so pass-through flags are honoured)."""
    from megatron_sparsebalance.data.datasets import DataConfig, build_dataset
    from megatron_sparsebalance.data.sampler import GlobalBatchSampler

    dataset = build_dataset(DataConfig(**config["data"]))
    sampler = GlobalBatchSampler(dataset.lengths, config["training"]["global_batch_size"], batcher=None,
                                 seed=config["data"]["seed"])
    return int(sum(dataset.lengths[sampler.next_indices()].sum() for _ in range(iterations)))


def chance(config: dict) -> dict:
    """What a model that never finds the records scores: answer tokens are uniform over the value ids,
    and a question is right when all its RETRIEVAL_VALUE_TOKENS are."""
    from megatron_sparsebalance.data.synthetic import RETRIEVAL_VALUE_TOKENS, retrieval_vocab

    values = len(retrieval_vocab(config["data"]["mock_vocab_size"]).values)
    return {"loss": math.log(values), "token_acc": 1 / values, "acc": values ** -RETRIEVAL_VALUE_TOKENS}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and v == v]  # drop None and NaN
    return sum(values) / len(values) if values else None


def result_row(run: Run, exit_code: int | None, process_s: float, stopped: bool, nproc: int, pp: int) -> dict:
    """One configuration's row. A run stopped by a time limit keeps what it logged until then (its
    iterations, its last evaluation) and says so under ``stopped``; one that failed, or stopped
    before it logged anything, is an ``error``."""
    if exit_code is None:
        return {"config": run.config, "seed": run.seed, "exit_code": None, "error": "not started: --total-timeout-s"}
    metrics = read_jsonl(os.path.join(run.log_dir, "metrics.jsonl"))
    evals = read_jsonl(os.path.join(run.log_dir, "eval.jsonl"))
    row = {"config": run.config, "seed": run.seed, "exit_code": exit_code, "process_wall_s": process_s,
           "layout": {"processes": nproc, "pp": pp, "dp": nproc // pp}, "log_dir": run.log_dir}
    if (exit_code != 0 and not stopped) or not metrics or not evals:
        with open(os.path.join(run.log_dir, "pretrain.log")) as f:
            row["error"] = f.read()[-3000:]
        return row
    with open(os.path.join(run.log_dir, "config.json")) as f:
        config = json.load(f)
    final = evals[-1]
    dense = not config["sparse"]["sparse_attention"]
    reached, planned = metrics[-1]["iteration"], config["training"]["train_iters"]
    if stopped or reached < planned:
        row["stopped"] = f"time limit: {reached} of {planned} iterations, last evaluation at {final['iteration']}"
    row.update({
        "iterations": reached,
        "eval_iteration": final["iteration"],
        "tokens": trained_tokens(config, reached),
        "val_loss": final["loss"],
        "retrieval_acc": final["acc"],
        "token_acc": final["token_acc"],
        "acc_by_length": final["acc_by_length"],
        "acc_by_distance": final.get("acc_by_distance", {}),
        "val_samples": final["samples"],
        "val_questions": final.get("questions"),
        "chance": chance(config),
        "mean_budget": None if dense else _mean(r["mean_budget"] for r in metrics),
        "mean_coverage": None if dense else _mean(r["mean_coverage"] for r in metrics),
        "eval_coverage": final["mean_coverage"],
        "wall_s": sum(r["elapsed_ms"] for r in metrics) / 1e3,
        "eval_s": sum(r["eval_ms"] for r in evals) / 1e3,
        "final_train_loss": _mean(r["loss"] for r in metrics[-max(1, len(metrics) // 10):]),
        "loss_curve": [[r["iteration"], r["loss"]] for r in metrics],
        "eval_curve": [[r["iteration"], r["loss"], r["acc"], r["token_acc"]] for r in evals],
    })
    return row


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    try:
        from importlib.metadata import version

        env["megatron_core"] = version("megatron-core")
    except Exception:  # not installed as a distribution: leave it out
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "gpus_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0, "versions": env}


def plot(rows: list, out_dir: str) -> list:
    """Loss curves and accuracy by length / distance bucket, as PNGs (matplotlib imported here only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "loss_curve" in r]
    if not ok:
        return []
    paths = []
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in ok:
        it, loss = zip(*r["loss_curve"])
        ax_train.plot(it, loss, label=r["config"], linewidth=1)
        ev = r["eval_curve"]
        ax_val.plot([e[0] for e in ev], [e[1] for e in ev], marker="o", label=r["config"])
    ax_train.set(xlabel="iteration", ylabel="training loss (answer tokens)", title="training loss")
    ax_val.set(xlabel="iteration", ylabel="validation loss", title="validation loss (fixed budget)")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "fidelity_loss.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # Exact match can sit at 0 for every configuration early in training; per-token accuracy
    # still tells them apart, so both are drawn.
    groups = [("acc_by_length", "sequence length"), ("acc_by_distance", "record-to-question distance")]
    metrics = [("acc", "retrieval accuracy (exact match)"), ("token_acc", "answer-token accuracy")]
    fig, axes = plt.subplots(len(metrics), len(groups), figsize=(12, 8), squeeze=False)
    width = 0.8 / len(ok)
    for col, (key, what) in enumerate(groups):
        labels = sorted({b for r in ok for b in r.get(key, {})}, key=lambda b: int(b.split("-")[1]))
        for row, (metric, name) in enumerate(metrics):
            ax = axes[row][col]
            for i, r in enumerate(ok):
                ax.bar([j + i * width for j in range(len(labels))],
                       [r.get(key, {}).get(b, {}).get(metric, 0.0) for b in labels], width, label=r["config"])
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=30, fontsize=8)
            ax.set(xlabel=f"{what} (tokens)", ylabel=name, ylim=(0, 1), title=f"{name} by {what}")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "fidelity_acc.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


# Settings that say how a call ran, not what it measured: calls joined by --merge may differ in these.
HOW_TO_RUN = ("configs", "timeout_s", "total_timeout_s", "out", "runs_dir", "merge")


def merge_earlier(path: str, result: dict) -> dict:
    """``result`` with the rows and commands of the configurations it did not run taken from the
    earlier call's ``path``, which must have measured with the same settings."""
    with open(path) as f:
        earlier = json.load(f)
    ours, theirs = result["settings"], earlier["settings"]
    differ = sorted(k for k in set(ours) | set(theirs) if k not in HOW_TO_RUN and ours.get(k) != theirs.get(k))
    if differ:
        raise SystemExit(f"--merge: {path} was measured with other settings ({', '.join(differ)}); "
                         f"run all its configurations again, or leave out --merge")
    configs = {r["config"] for r in result["rows"]}
    return {**result, "rows": [r for r in earlier["rows"] if r["config"] not in configs] + result["rows"],
            "commands": {**earlier["commands"], **result["commands"]},
            "total_wall_s": earlier["total_wall_s"] + result["total_wall_s"]}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv=None) -> int:
    args = parse_args(argv)
    gpus = visible_gpus()
    runs = build_runs(args, on_gpus=bool(gpus))
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    deadline = t0 + args.total_timeout_s if args.total_timeout_s else math.inf
    start = None
    if args.start_iters:
        start_run = build_start(args, on_gpus=bool(gpus))
        done = run_all([start_run], args, gpus, deadline)
        start = result_row(start_run, *done.get(START, (None, 0.0, False)), args.gpus_per_run, args.pp)
        start["checkpoint"] = start_checkpoint(args)
        if not os.path.isfile(os.path.join(start["checkpoint"], "latest_checkpointed_iteration.txt")):
            runs = []  # nothing to begin from: the configurations are not run
            start.setdefault("error", "the start left no checkpoint")
            print(f"[fidelity] the start left no checkpoint in {start['checkpoint']}: configurations not run", flush=True)
        start["command"] = start_run.flags
    elif args.start_checkpoint:
        start = {"checkpoint": args.start_checkpoint}
    shared = {}
    done = run_all(runs, args, gpus, deadline, shared)
    rows = [result_row(r, *done.get(r.config, (None, 0.0, False)), args.gpus_per_run, args.pp) for r in runs]
    env = environment()
    for row in rows:
        # rows of calls joined by --merge may come from different machines: each says where it ran
        row["gpu"], row["gpus_visible"] = env["gpu"], env["gpus_visible"]
        if shared.get(row["config"]):
            row["shared_gpu_with"] = shared[row["config"]]  # its wall time is not comparable
    result = {**env, "rows": rows, "total_wall_s": time.perf_counter() - t0,
              "settings": dict(vars(args)), "start": start,
              "commands": {r.config: r.flags for r in runs},
              "measured": "wall_s: training iterations only (sum of pretrain's elapsed_ms); process_wall_s: the "
                          "whole torchrun process (start-up, evaluations, exit); budgets and coverage: training "
                          "means; val_* and acc: the last evaluation (eval_iteration), at the fixed budget "
                          "--moba-topk; retrieval_acc: exact match per question"}
    path = os.path.join(args.out, "fidelity.json")
    if args.merge and os.path.isfile(path):
        result = merge_earlier(path, result)
        rows = result["rows"]
    try:
        result["plots"] = plot(rows, args.out)
    except ImportError as exc:  # matplotlib is optional: the JSON is the result
        print(f"[fidelity] no plots: {exc}", flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    if start and "iterations" in start:
        print(f"start (dense, {args.start_seq_length} tokens): {start['iterations']} iterations, val loss "
              f"{start['val_loss']:.4f}, retrieval acc {start['retrieval_acc']:.3f}, {start['wall_s']:.1f} s")
    print(f"{'config':<12} {'iters':>6} {'tokens':>10} {'val loss':>9} {'acc':>6} {'tok acc':>7} {'budget':>6} "
          f"{'cover':>6} {'train s':>8}")
    for r in rows:
        if "error" in r:
            why = r["error"] if r["exit_code"] is None else f"exit {r['exit_code']}, see {r['log_dir']}/pretrain.log"
            print(f"{r['config']:<12} FAILED: {why}")
            continue
        print(f"{r['config']:<12} {r['iterations']:>6d} {r['tokens']:>10d} {r['val_loss']:>9.4f} {r['retrieval_acc']:>6.3f} "
              f"{r['token_acc']:>7.3f} {_fmt(r['mean_budget'], '.2f'):>6} {_fmt(r['mean_coverage'], '.3f'):>6} "
              f"{r['wall_s']:>8.1f}" + (f"  (stopped, {r['stopped']})" if "stopped" in r else ""))
    # Runs stopped by the time limit end at other iterations: compare them where all were evaluated.
    curves = {r["config"]: {e[0]: e[2] for e in r["eval_curve"]} for r in rows if "eval_curve" in r}
    common = sorted(set.intersection(*(set(c) for c in curves.values()))) if curves else []
    if common:
        print("retrieval acc by iteration: " + " | ".join(
            f"{config} " + " ".join(f"{it}:{acc[it]:.3f}" for it in common) for config, acc in curves.items()))
    print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) or (start and "error" in start) else 0


if __name__ == "__main__":
    sys.exit(main())
