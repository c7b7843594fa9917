"""Host overhead of one pipeline stage: how long the CPU takes, how often it waits, how idle the GPU is.

A stage's forward+backward is host-bound when the CPU needs longer to launch its kernels than the
GPU needs to run them, and every host synchronisation (a ``.tolist()``, a copy from pageable
memory, ...) makes it worse: the CPU stops until the GPU drains its queue, so the two stop
overlapping and the step costs their sum. Short micro-batches live in that regime, and there the
latency model's predictions are only as steady as the host is.

For each pack length it reports, on the stage of ``tools/profile_latency.py`` (real megatron-core
layers, our sparse attention):

* ``wall_ms``: forward+backward between CUDA events (what the profiler and the schedule measure);
* ``kernel_ms``: the GPU's busy time, the sum of the kernels' durations (``torch.profiler``);
* ``host_ms``: CPU time to issue the step (``perf_counter``, waits included);
* ``syncs``: host synchronisations in one step (``torch.cuda.set_sync_debug_mode``);
* ``gpu_idle``: ``1 - kernel_ms / wall_ms``.

Medians over ``--iters`` after ``--warmup``, with the garbage collector off while timing (as
``tools/profile_latency.py`` times and ``--manual-gc`` trains).

``--rounds R`` then times every pack again in R round-robin rounds (a few seconds apart) and
reports how far one pack's median moves from round to round (``round_wall_ms``, and
``between_rounds``: ``|a - b| / b`` over all pairs of rounds of a pack). That is the error even a
perfect latency table of the same pack would have, since it was measured at another moment: the
floor under the latency benchmark's error, for host-bound and GPU-bound packs separately.

Rows carry ``--label`` and are merged into ``--out`` by label, so two code versions can be
measured into one file::

    python -m benchmarks.host_overhead --label after --out benchmarks/results/host_overhead_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch

from megatron_sparsebalance.balance.latency import device_name
from megatron_sparsebalance.training.manual_gc import ManualGC
from tools.profile_latency import StageProfiler


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--layers-per-stage", type=int, default=6)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 32768])
    p.add_argument("--packs", type=int, default=2, help="also time packs of this many equal sequences (0: none)")
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--sparse-attn-impl", default="triton")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--label", default="current")
    p.add_argument("--out", default=None, help="JSON file; rows of other labels already there are kept")
    p.add_argument("--rounds", type=int, default=0,
                   help="then time every pack again in this many round-robin rounds (drift of the same pack)")
    p.add_argument("--host-fraction", type=float, default=0.9,
                   help="a pack counts as host-bound in the round summary when issuing it takes this fraction "
                        "of its wall time or more")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also print the N functions with the most host time (cProfile) of the first pack")
    return p.parse_args(argv)


def count_syncs(step) -> int:
    """Host synchronisations during one ``step()``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def kernel_ms(step) -> float:
    """Sum of the durations of the GPU kernels and copies of one ``step()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total_us = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total_us += evt.device_time
    return total_us / 1e3


def print_host_profile(step, top: int) -> None:
    """Where the host time of ``step()`` goes: cProfile's top functions by own time and by total."""
    import cProfile
    import pstats

    step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def measure(step, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    walls, hosts = [], []
    with ManualGC(True, 0):  # as the latency profiler times (tools/profile_latency.py)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            step()
            hosts.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end))
    kernels = statistics.median(kernel_ms(step) for _ in range(3))
    wall = statistics.median(walls)
    return {"wall_ms": wall, "host_ms": statistics.median(hosts), "kernel_ms": kernels,
            "gpu_idle": max(0.0, 1.0 - kernels / wall), "syncs": count_syncs(step)}


def relative_spread(values: list) -> list:
    """``|a - b| / b`` over all ordered pairs of ``values``."""
    return [abs(a - b) / b for i, a in enumerate(values) for j, b in enumerate(values) if i != j]


def is_host_bound(row: dict, host_fraction: float = 0.9) -> bool:
    """The step lasts as long as the CPU takes to issue it: the GPU waits for the host."""
    return row["host_ms"] >= host_fraction * row["wall_ms"]


def summarize_rounds(rows: list, host_fraction: float = 0.9) -> dict:
    """Spread of each pack's median between rounds (``round_wall_ms``), host- and GPU-bound
    packs apart: median and p90 of ``|a - b| / b`` over all pairs of rounds of a pack."""
    summary = {}
    for name, bound in (("host_bound", True), ("gpu_bound", False)):
        group = [r for r in rows if is_host_bound(r, host_fraction) == bound]
        diffs = sorted(d for r in group for d in relative_spread(r["round_wall_ms"]))
        if diffs:
            summary[name] = {"packs": len(group), "median_rel_diff": statistics.median(diffs),
                             "p90_rel_diff": diffs[min(len(diffs) - 1, int(0.9 * len(diffs)))]}
    return summary


def time_rounds(prof, rows: list, args) -> dict:
    """Time every pack of ``rows`` again in ``args.rounds`` round-robin rounds with the latency
    profiler's own timing (``StageProfiler.measure``), add each pack's round medians to its row
    (``round_wall_ms``) and return :func:`summarize_rounds`."""
    for r in rows:
        r["round_wall_ms"] = []
    for n in range(args.rounds):
        for r in rows:
            r["round_wall_ms"].append(prof.measure(r["lengths"], r["budget"], warmup=1, iters=args.iters))
        print(f"round {n + 1}/{args.rounds}: " + " ".join(f"{r['round_wall_ms'][-1]:.1f}" for r in rows), flush=True)
    summary = summarize_rounds(rows, args.host_fraction)
    for name, x in summary.items():
        print(f"between rounds, {x['packs']} {name} packs: median |a-b|/b {x['median_rel_diff']:.3f}, "
              f"p90 {x['p90_rel_diff']:.3f}")
    return {"rounds": args.rounds, "iters": args.iters, "host_fraction": args.host_fraction, **summary}


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/host_overhead.py measures a GPU stage; no CUDA device is visible")
    prof = StageProfiler(args.model, args.layers_per_stage, impl=args.sparse_attn_impl,
                         max_length=max(args.lengths))
    cases = [[n] for n in args.lengths]
    if args.packs > 1:
        cases += [[n // args.packs] * args.packs for n in args.lengths if n // args.packs >= 256]
    rows = []
    print(f"{'label':>8} {'pack':>16} {'wall ms':>8} {'kernel ms':>9} {'host ms':>8} {'idle':>5} {'syncs':>5}")
    for lengths in cases:
        row = {"label": args.label, "lengths": lengths, "tokens": sum(lengths), "budget": args.budget,
               **measure(prof.stage_step(lengths, args.budget), args.warmup, args.iters)}
        rows.append(row)
        print(f"{args.label:>8} {'x'.join(map(str, lengths)) if len(lengths) < 3 else len(lengths):>16} "
              f"{row['wall_ms']:8.2f} {row['kernel_ms']:9.2f} {row['host_ms']:8.2f} {row['gpu_idle']:5.2f} "
              f"{row['syncs']:5d}", flush=True)
    between = time_rounds(prof, rows, args) if args.rounds > 1 else None
    if args.cprofile:
        print_host_profile(prof.stage_step(cases[0], args.budget), args.cprofile)
    if args.out:
        old = json.load(open(args.out)) if os.path.exists(args.out) else {"rows": []}
        # other labels' rows and round summaries, and the notes, are kept
        result = {**old, "gpu": device_name(), "torch": torch.__version__, "model": args.model,
                  "layers_per_stage": args.layers_per_stage, "impl": args.sparse_attn_impl,
                  "stage": "middle (no embedding, no output layer)",
                  "rows": [r for r in old["rows"] if r["label"] != args.label] + rows}
        rounds = {k: v for k, v in old.get("between_rounds", {}).items() if k != args.label}
        if between is not None:
            rounds[args.label] = between
        if rounds:
            result["between_rounds"] = rounds
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
