"""Accuracy of the latency model on held-out micro-batches (issue 4, DESIGN.md §3).

1. Profile one pipeline stage over a (length, budget) grid with ``tools/profile_latency.py``'s
   profiler (or load a table with ``--profile``).
2. Draw held-out random micro-batches: single sequences and packs of 2-6 sequences, 1K-64K tokens
   in all, random lengths (not on the grid) and random budgets (not only profiled ones).
3. Predict each with four models and measure it on the same stage:
   * ``profiled``: the table (no calibration);
   * ``analytic``: FLOPs and bytes over the H200's nominal achieved rates (no profile, no calibration);
   * ``length_only``: ``a + b * tokens`` fitted on the profile's grid points (what a length-based
     balancer assumes);
   * ``flop_only``: ``a + b * FLOPs`` fitted on the same points, FLOPs sparse-aware (the blocks
     actually computed);
   and, as extra rows, the profiled and analytic models with online calibration (each micro-batch is
   predicted before its measurement is fed to ``observe``, as the schedule does).
4. Report median and p90 of ``|measured - predicted| / measured`` and the cost of ``predict``;
   write ``latency_model_<gpu>.json``, the held-out records and a PNG (table; predicted vs measured).

With ``--rounds R`` the profile makes R passes over the grid and the held-out micro-batches are
timed in R rounds, round r right after pass r; after the first, passes and rounds repeat only
the host-bound points (their time is the CPU's and drifts from one moment to the next; the GPU's
does not). Each time is the median of its passes, so table and held-out times cover the same
stretch of the run. The first pass and the first round alone are scored too
(``profiled_first_pass``): what a table and a measurement taken at single moments give.

Run (H200, Qwen2.5-0.5B, PP=4 -> 6 layers per stage):
  python -m benchmarks.latency_model --model qwen2.5-0.5b --layers-per-stage 6 --out-dir "$OUT"
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time

import torch

from megatron_sparsebalance.balance.latency import (
    AnalyticLatencyModel,
    LatencyModel,
    ProfiledLatencyModel,
    device_name,
)
from megatron_sparsebalance.ops.implementations import IMPLEMENTATIONS, unavailable_reason
from megatron_sparsebalance.training.manual_gc import ManualGC
from megatron_sparsebalance.training.model import MODEL_PRESETS

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def _load_profiler_tool():
    """``tools/`` is scripts, not a package: load the profiler module from its file."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tools", "profile_latency.py")
    spec = importlib.util.spec_from_file_location("profile_latency", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class AffineModel:
    """``a + b * feature(lengths, k)``: the length-only and FLOP-only baselines."""

    def __init__(self, feature, a: float, b: float):
        self.feature, self.a, self.b = feature, a, b

    @classmethod
    def fit(cls, feature, samples):
        """Least squares of the RELATIVE error (weights 1/t^2) over ``(lengths, k, ms)`` samples,
        the metric it is judged by; ``a, b >= 0``."""
        xs = [feature(lengths, k) for lengths, k, _ in samples]
        ts = [t for _, _, t in samples]
        w = [1.0 / (t * t) for t in ts]
        sw = sum(w)
        sx = sum(wi * x for wi, x in zip(w, xs))
        st = sum(wi * t for wi, t in zip(w, ts))
        sxx = sum(wi * x * x for wi, x in zip(w, xs))
        sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts))
        det = sw * sxx - sx * sx
        if det <= 0:
            return cls(feature, 0.0, st / max(sx, 1e-30))
        b = (sw * sxt - sx * st) / det
        a = (st - b * sx) / sw
        if a < 0:  # through the origin
            a, b = 0.0, sxt / sxx
        return cls(feature, a, max(b, 0.0))

    def predict(self, lengths, k) -> float:
        return self.a + self.b * self.feature(lengths, k)


def heldout_batches(rng: random.Random, n: int, min_tokens: int, max_tokens: int, kmax: int, block: int):
    """``n`` random (lengths, k): 40% single sequences, 60% packs of 2-6; tokens log-uniform."""
    out = []
    for i in range(n):
        total = int(round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens)))))
        k = rng.randint(1, kmax)
        if rng.random() < 0.4 or total < 2 * block:
            out.append(([total], k))
            continue
        parts = rng.randint(2, 6)
        weights = [rng.expovariate(1.0) for _ in range(parts)]
        lengths = [max(block // 2, int(total * w / sum(weights))) for w in weights]
        lengths[0] += max(0, total - sum(lengths))
        out.append((lengths, k))
    return out


class HeldoutRounds:
    """The held-out micro-batches' times, measured in rounds: the first round times every one,
    each later round the host-bound ones again (issuing them took at least ``host_bound`` of
    their wall time: their time is the CPU's and drifts; a GPU-bound time does not). Rounds run
    between the profile's passes (``tools/profile_latency.profile(after_pass=...)``), so the
    table and the held-out times are medians over the same stretch of the run.

    ``measure_once(n, lengths, k)`` returns ``(ms, host_fraction)`` or None (out of memory).
    When ``out_of_time()`` turns true, the first round drops the micro-batches it has not
    reached and later rounds measure nothing more (each keeps the rounds it has)."""

    def __init__(self, batches, measure_once, out_of_time, host_bound: float):
        self.batches, self.measure_once, self.out_of_time = batches, measure_once, out_of_time
        self.host_bound = host_bound
        self.times: list = [[] for _ in batches]
        self.repeat: list = [False] * len(batches)
        self.stopped = False

    def run(self, r: int) -> None:
        """Round ``r`` (0-based)."""
        if self.stopped:
            return
        gc.collect()  # the caller keeps the collector off while timing; one collection per round
        todo = [n for n in range(len(self.batches)) if r == 0 or self.repeat[n]]
        for n in todo:
            if self.out_of_time():
                self.stopped = True
                print(f"time budget reached in round {r + 1}: {sum(1 for t in self.times if len(t) > r)} of "
                      f"{len(self.batches)} held-out micro-batches measured {r + 1} times", flush=True)
                return
            lengths, k = self.batches[n]
            got = self.measure_once(n + 1, lengths, k)
            if got is None:
                continue
            ms, host_fraction = got
            self.times[n].append(ms)
            if r == 0:
                self.repeat[n] = host_fraction >= self.host_bound
        print(f"held-out round {r + 1}: {len(todo)} micro-batches timed", flush=True)

    def results(self) -> list:
        """Per micro-batch: its times, one per round, or None where it was never measured."""
        return [t or None for t in self.times]


def first_pass_table(table: ProfiledLatencyModel, profile_info: dict):
    """The table of the profile's first pass alone (``tools/profile_latency.py --rounds``), or None."""
    first = (profile_info or {}).get("first_pass")
    if first is None:
        return None
    return ProfiledLatencyModel(table.lengths, table.budgets, first["total_ms"], first["attention_ms"],
                                table.block_size, metadata=table.metadata)


def check_impl(impl: str, device: torch.device) -> str | None:
    """Why ``impl`` should not be profiled here (unavailable, or its output is wrong), else None."""
    from megatron_sparsebalance.ops.sparse_attention import sparse_attention

    reason = unavailable_reason(impl, device)
    if reason is not None:
        return reason
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        lens = [700, 1300]
        T = sum(lens)
        cu = torch.tensor([0, lens[0], T], dtype=torch.int32, device=device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        q, k, v = (torch.randn(T, h, 64, generator=g).to(device, dtype).requires_grad_() for h in (14, 2, 2))
        outs = {}
        for name in (impl, "torch"):
            o = sparse_attention(q, k, v, cu, 128, 4, impl=name)
            (dq,) = torch.autograd.grad(o.float().square().sum(), (q,))
            outs[name] = (o.float(), dq.float())
        for got, ref in zip(outs[impl], outs["torch"]):
            err = (got - ref).abs().max().item()
            if not math.isfinite(err) or err > 0.05 * ref.abs().max().item() + 1e-3:
                return f"output differs from the torch reference (max error {err:.3g})"
    except Exception as exc:  # a kernel that fails to compile or launch is not profiled
        return f"{type(exc).__name__}: {exc}"
    return None


def summarize(pred, meas) -> dict:
    errs = sorted(abs(m - p) / m for p, m in zip(pred, meas))
    p90 = errs[min(len(errs) - 1, int(math.ceil(0.9 * len(errs))) - 1)]
    return {"median_rel_err": round(statistics.median(errs), 4), "p90_rel_err": round(p90, 4),
            "max_rel_err": round(errs[-1], 4)}


def predict_cost_us(model: LatencyModel, batches) -> tuple[float, float]:
    """Mean µs per ``predict`` on a fresh copy of the model (cold: every length new) and again (warm)."""
    fresh = LatencyModel.from_dict(model.to_dict())
    fresh.predict([10**7], 1)  # the one-off extrapolation warnings are not a per-call cost
    res = []
    for _ in range(2):
        t0 = time.perf_counter()
        for lengths, k in batches:
            fresh.predict(lengths, k)
        res.append((time.perf_counter() - t0) / len(batches) * 1e6)
    return res[0], res[1]


def plot(path, table: ProfiledLatencyModel, records, names):
    if not HAVE_MATPLOTLIB:
        print("matplotlib is not installed: no PNG")
        return False
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 5))
    for i, k in enumerate(table.budgets):
        ax0.plot(table.lengths, [row[i] for row in table.total_ms], marker="o", ms=3, label=f"k={k}")
    ax0.set_xscale("log", base=2)
    ax0.set_yscale("log")
    ax0.set_xlabel("sequence length (tokens)")
    ax0.set_ylabel("stage forward+backward (ms)")
    ax0.set_title("profiled table")
    ax0.legend(fontsize=7, ncol=2)
    meas = [r["measured_ms"] for r in records]
    lo, hi = min(meas) * 0.8, max(meas) * 1.25
    ax1.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    for name in names:
        ax1.scatter(meas, [r["predicted_ms"][name] for r in records], s=9, label=name, alpha=0.7)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlim(lo, hi)
    ax1.set_ylim(lo, hi)
    ax1.set_xlabel("measured (ms)")
    ax1.set_ylabel("predicted (ms)")
    ax1.set_title(f"held-out micro-batches ({len(records)})")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--layers-per-stage", type=int, default=6)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=4)
    p.add_argument("--moba-block-size", type=int, default=128)
    p.add_argument("--sparse-attn-impl", nargs="+", default=["cuda", "triton", "torch"],
                   help="implementations to try in order: the first that is available and agrees with the "
                        f"torch reference is profiled (choices: {IMPLEMENTATIONS})")
    p.add_argument("--profile", default=None, help="load this table instead of profiling")
    p.add_argument("--lengths", type=int, nargs="+",
                   default=[1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536])
    p.add_argument("--budgets", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--heldout", type=int, default=80, help="held-out micro-batches to draw")
    p.add_argument("--min-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--max-budget", type=int, default=64)
    p.add_argument("--heldout-iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="profile the grid in this many passes and measure the held-out micro-batches in this many "
                        "rounds, each point's time the median of its passes (a short pack's time drifts with the "
                        "host's speed: docs/LATENCY.md); the first pass alone is scored too")
    p.add_argument("--min-time-s", type=float, default=0.3,
                   help="time every grid point and held-out micro-batch past its iterations until this many "
                        "seconds are measured (tools/profile_latency.py --min-time-s)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop measuring held-out micro-batches after this many seconds of the whole run")
    p.add_argument("--profile-time-budget-s", type=float, default=None,
                   help="stop profiling longer lengths after this many seconds (the table then extrapolates), "
                        "and start no further --rounds pass")
    p.add_argument("--seed", type=int, default=20260)
    p.add_argument("--replay", default=None, metavar="DIR",
                   help="re-predict the held-out measurements recorded in DIR (latency_table_<tag>.json, "
                        "latency_model_<tag>[_heldout].json) with the current code; no GPU needed")
    p.add_argument("--tag", default=None, help="results file suffix (default: h200 on an H200, else the device)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "benchmarks/results")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    if args.replay:
        return replay(args)
    t_start = time.perf_counter()
    tool = _load_profiler_tool()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impl, skipped = None, {}
    for name in args.sparse_attn_impl:
        reason = check_impl(name, device)
        if reason is None:
            impl = name
            break
        skipped[name] = reason
        print(f"not profiling {name}: {reason}", flush=True)
    if impl is None:
        raise SystemExit(f"no usable attention implementation among {args.sparse_attn_impl}: {skipped}")
    max_len = max(args.max_tokens, max(args.lengths))
    profiler = tool.StageProfiler(args.model, args.layers_per_stage, block_size=args.moba_block_size,
                                  impl=impl, max_length=max_len, min_time_s=args.min_time_s)
    gpu = device_name() if device.type == "cuda" else "cpu"
    tag = args.tag or ("h200" if "H200" in gpu else gpu.lower().replace(" ", "_"))
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"{args.model}, {args.layers_per_stage} layers per stage, block {args.moba_block_size}, attention {impl}, "
          f"{profiler.dtype}, on {gpu}", flush=True)

    analytic = AnalyticLatencyModel(
        profiler.shape, args.layers_per_stage, block_size=args.moba_block_size,
        hardware="h200" if device.type == "cuda" else "cpu", dtype_bytes=2 if profiler.bf16 else 4,
    )
    rng = random.Random(args.seed)
    batches = heldout_batches(rng, args.heldout, args.min_tokens, args.max_tokens, args.max_budget, args.moba_block_size)

    def measure_once(n, lengths, k):
        try:
            ms = profiler.measure(lengths, k, warmup=1, iters=args.heldout_iters)
            return ms, profiler.last_host_fraction
        except torch.cuda.OutOfMemoryError:
            print(f"[{n:3d}/{len(batches)}] {lengths} k={k}: out of GPU memory, skipped")
            gc.collect()  # the round keeps the collector off; free what only it can
            torch.cuda.empty_cache()
            return None

    def out_of_time():
        return args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s

    heldout = HeldoutRounds(batches, measure_once, out_of_time, tool.HOST_BOUND_FRACTION)
    if args.profile:
        table = ProfiledLatencyModel.load(args.profile, expect=profiler.metadata(args.pipeline_model_parallel_size))
        print(f"loaded {args.profile}")
        with ManualGC(True, 0):
            for r in range(args.rounds):
                heldout.run(r)
    else:
        # each held-out round right after the profile's pass of the same number
        table = tool.profile(profiler, args.lengths, args.budgets, args.warmup, args.iters,
                             pipeline_parallel_size=args.pipeline_model_parallel_size,
                             time_budget_s=args.profile_time_budget_s, rounds=args.rounds, after_pass=heldout.run)
        tool.save_profile(table, os.path.join(args.out_dir, f"latency_table_{tag}.json"))
    first_pass = first_pass_table(table, getattr(table, "profile_info", {}))

    rounds_ms = heldout.results()
    records, result = evaluate(table, analytic, batches, lambda n, lengths, k: rounds_ms[n - 1], first_pass)
    result["gpu"] = gpu
    result["setup"] = {
        "model": args.model, "layers_per_stage": args.layers_per_stage, "stage": "middle (no embedding, no output layer)",
        "block_size": args.moba_block_size, "attention_impl": impl, "impl_skipped": skipped,
        "dtype": str(profiler.dtype), "torch": torch.__version__,
        "grid": {"lengths": table.lengths, "budgets": table.budgets, "warmup": args.warmup, "iters": args.iters},
        "heldout": {"tokens": [args.min_tokens, args.max_tokens], "budgets": [1, args.max_budget],
                    "iters": args.heldout_iters, "seed": args.seed},
        "min_time_s": args.min_time_s, "rounds": args.rounds,
        "rounds_made": (getattr(table, "profile_info", None) or {}).get("rounds", args.rounds),
        "seconds": {"total": round(time.perf_counter() - t_start, 1)},
        "command": "python -m benchmarks.latency_model " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    write_results(args.out_dir, tag, table, records, result)
    return result


def evaluate(table: ProfiledLatencyModel, analytic: AnalyticLatencyModel, batches, measure, first_pass=None):
    """Predict every held-out ``(lengths, k)`` with every model, then get its time from
    ``measure(n, lengths, k)``: ms, or a list of ms from several rounds (their median is its
    time), or None to skip it. Calibrated models predict before they observe, as in training.
    Given the profile's ``first_pass`` table, the first pass is also scored against each
    micro-batch's first round alone (``profiled_first_pass``): both at single moments.
    Returns the records and the summary."""
    grid = [([L], k, table.total_ms[j][i]) for j, L in enumerate(table.lengths) for i, k in enumerate(table.budgets)]
    length_only = AffineModel.fit(lambda lengths, k: float(sum(lengths)), grid)
    flop_only = AffineModel.fit(analytic.flops, grid)
    models = {"profiled": table, "analytic": analytic, "length_only": length_only, "flop_only": flop_only}
    calibrated = {"profiled_calibrated": LatencyModel.from_dict(table.to_dict()),
                  "analytic_calibrated": LatencyModel.from_dict(analytic.to_dict())}
    records = []
    for n, (lengths, k) in enumerate(batches, 1):
        pred = {name: m.predict(lengths, k) for name, m in {**models, **calibrated}.items()}
        got = measure(n, lengths, k)
        if got is None:
            continue
        rounds = list(got) if isinstance(got, (list, tuple)) else [got]
        ms = statistics.median(rounds)
        for m in calibrated.values():
            m.observe(lengths, k, ms)
        if first_pass is not None:
            pred["profiled_first_pass"] = first_pass.predict(lengths, k)
        record = {"lengths": list(lengths), "k": k, "measured_ms": ms, "predicted_ms": pred}
        if len(rounds) > 1:
            record["measured_rounds_ms"] = rounds
        records.append(record)
        print(f"[{n:3d}/{len(batches)}] {len(lengths)} seq, {sum(lengths):6d} tokens, k={k:2d}: measured {ms:8.2f} ms"
              + (f" (rounds {min(rounds):.1f}-{max(rounds):.1f})" if len(rounds) > 1 else "") + ", "
              + ", ".join(f"{name} {v:8.2f}" for name, v in pred.items()), flush=True)
    meas = [r["measured_ms"] for r in records]
    summary = {name: summarize([r["predicted_ms"][name] for r in records], meas) for name in [*models, *calibrated]}
    # single moments: the first pass's table against each micro-batch's first round (a GPU-bound
    # micro-batch has only that one)
    if first_pass is not None and records:
        summary["profiled_first_pass"] = summarize(
            [r["predicted_ms"]["profiled_first_pass"] for r in records],
            [r.get("measured_rounds_ms", [r["measured_ms"]])[0] for r in records])
    single = [r for r in records if len(r["lengths"]) == 1]
    packed = [r for r in records if len(r["lengths"]) > 1]
    cold_us, warm_us = predict_cost_us(table, [(r["lengths"], r["k"]) for r in records])
    result = {
        "gpu": None,
        "n_heldout": len(records),
        "predict_us": round(cold_us, 2),
        "predict_us_warm": round(warm_us, 2),
        "models": summary,
        "profiled_by_kind": {
            kind: summarize([r["predicted_ms"]["profiled"] for r in rs], [r["measured_ms"] for r in rs]) if rs else None
            for kind, rs in (("single", single), ("packed", packed))
        },
        # short micro-batches are bound by host overhead and jitter; long ones by the GPU
        "profiled_by_tokens": {
            f"{lo}-{hi}": summarize([r["predicted_ms"]["profiled"] for r in rs], [r["measured_ms"] for r in rs]) | {"n": len(rs)}
            for lo, hi in ((0, 6000), (6000, 20000), (20000, 1 << 30))
            if (rs := [r for r in records if lo <= sum(r["lengths"]) < hi])
        },
        "baselines": {"length_only": {"a_ms": length_only.a, "b_ms_per_token": length_only.b},
                      "flop_only": {"a_ms": flop_only.a, "b_ms_per_flop": flop_only.b}},
    }
    return records, result


def replay(args) -> dict:
    """Re-predict recorded held-out measurements with the current code (no GPU needed): how a
    model revision is scored on the measurements of an earlier run. Says so in the results."""
    prefix = os.path.join(args.replay, "latency_model_" + (args.tag or "h200"))
    with open(prefix + ".json") as f:
        before = json.load(f)
    with open(prefix + "_heldout.json") as f:
        recorded = json.load(f)
    table_path = os.path.join(args.replay, "latency_table_" + (args.tag or "h200") + ".json")
    table = ProfiledLatencyModel.load(table_path)
    with open(table_path) as f:
        first_pass = first_pass_table(table, json.load(f).get("profile"))
    meta = table.metadata
    analytic = AnalyticLatencyModel(meta["model_shape"], meta["layers_per_stage"], block_size=meta["block_size"],
                                    hardware="h200" if "H200" in meta["gpu"] else "cpu",
                                    dtype_bytes=2 if meta["dtype"] in ("bfloat16", "float16") else 4)
    times = {(tuple(r["lengths"]), r["k"], i): r.get("measured_rounds_ms", r["measured_ms"]) for i, r in enumerate(recorded)}
    batches = [(r["lengths"], r["k"]) for r in recorded]
    records, result = evaluate(table, analytic, batches, lambda n, lengths, k: times[(tuple(lengths), k, n - 1)],
                               first_pass)
    result["gpu"] = before["gpu"]
    result["setup"] = before.get("setup", {})
    result["evaluation"] = {
        "mode": "replay: the recorded measurements of the run in setup, re-predicted by the current code",
        # the figures the recorded run itself printed (kept through repeated replays)
        "previous_models": before["evaluation"]["previous_models"] if "evaluation" in before else before["models"],
        "command": "python -m benchmarks.latency_model --replay " + args.replay,
    }
    write_results(args.out_dir, args.tag or "h200", table, records, result)
    return result


def write_results(out_dir: str, tag: str, table, records, result) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"latency_model_{tag}.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    with open(os.path.join(out_dir, f"latency_model_{tag}_heldout.json"), "w") as f:
        json.dump(records, f)
    plot(os.path.join(out_dir, f"latency_model_{tag}.png"), table, records,
         ["profiled", "analytic", "length_only", "flop_only"])
    print(f"\n{result['gpu']}: {len(records)} held-out micro-batches; predict {result['predict_us']:.1f} us (cold), "
          f"{result['predict_us_warm']:.1f} us (warm)")
    print(f"{'model':22s} {'median':>8s} {'p90':>8s} {'max':>8s}")
    for name, s in result["models"].items():
        print(f"{name:22s} {s['median_rel_err']:8.2%} {s['p90_rel_err']:8.2%} {s['max_rel_err']:8.2%}")


if __name__ == "__main__":
    main()
