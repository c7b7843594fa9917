"""Attention forward+backward under sustained load: step time, kernels, SM clock and power.

Training runs attention back to back for as long as the job lasts, while ``benchmarks.attention``
times 13 steps. On an H200 the two can differ: a step of dense tensor-core work draws the board to
its power limit within a fraction of a second, and the GPU then holds the limit by lowering the SM
clock. A change that only fills idle SMs (better balance) then buys little, since the busier chip
runs at a lower clock; what is left to gain is work and data movement per FLOP.

For each implementation, after an idle pause (the clock recovers), ``--steps`` forward+backward
steps run back to back, timed by CUDA events and traced by ``torch.profiler`` (CUDA activity),
while ``nvidia-smi`` samples the SM clock, the power draw and the clock-event reasons every
``--sample-ms``. Reported per implementation:

* ``burst_step_ms``: median of the first ``--burst`` steps (what a short benchmark sees);
* ``sustained_step_ms``: median of the second half of the run;
* ``window_ms``: medians of consecutive windows of 10 steps, to see when the clock drops;
* ``kernels_ms``: each kernel's device time per step, over the burst and over the second half;
* ``smi``: medians of the SM clock and power over the second half, the fraction of its samples
  in which the driver reports the software power cap or a thermal slowdown, and the idle clock.

``--impls`` may also name ``gemm``: a step of one cuBLAS bf16 GEMM with the matrix work of the
case's attention step (its nine products per kept tile, Flex's count as well as ours), run and
timed like the others. It is what that much matrix work takes on this GPU at the library's best
rate, with nothing else in the step: a bound on what any kernel of nine products per tile can
reach under the same power cap.

Usage: ``python3 -m benchmarks.sustained [--impls cuda,flex,gemm] [--shape qwen2.5-3b] [--seq 32768]
[--density 0.25] [--steps 300]``. Writes ``$OUT/sustained_h200.json`` (or ``--out``).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import threading
import time

import torch

from benchmarks.attention import (ALL_IMPLS, BLOCK, NEEDS_BLOCK_MASK, SHAPES, budget_for_density, flex_block_mask,
                                  make_inputs, run_case)
from megatron_sparsebalance.ops.layout import BlockLayout
from megatron_sparsebalance.ops.router import block_scores, select_blocks

# nvidia-smi's fields, newest names first: drivers before 535 call the reasons "throttle" reasons
# and have no instantaneous power reading.
SMI_FIELDS = (
    ("clocks.sm", "power.draw.instant", "clocks_event_reasons.sw_power_cap", "clocks_event_reasons.sw_thermal_slowdown",
     "clocks_event_reasons.hw_slowdown"),
    ("clocks.sm", "power.draw", "clocks_throttle_reasons.sw_power_cap", "clocks_throttle_reasons.sw_thermal_slowdown",
     "clocks_throttle_reasons.hw_slowdown"),
)


NOTES = (
    "fwd+bwd steps back to back after an idle pause, CUDA events per step, torch.profiler (CUDA activity) "
    "for the kernels; burst = the first --burst steps, sustained = the second half of the run; smi: medians "
    "of nvidia-smi's samples over the second half, power_capped/thermal = fraction of samples with that "
    "clock-event reason active. executed_tflop: the step's matrix products (nine per kept tile, 2*B^2*d "
    "FLOPs each; gemm: its own 2*M*N*K); *_tflops: executed_tflop over the step's ms."
)

# Matrix products per kept (query head, KV block) tile in one forward+backward: the forward's two
# (S = Q K^T, O += P V) and the backward's seven (dK/dV: S, dP, dV, dK; dQ recomputes S and dP and
# adds dS K). FlexAttention's backward runs the same seven (its dQ loop recomputes the scores).
PRODUCTS_PER_TILE = 9
GEMM_ROWS = 8192  # the ceiling GEMM's M = N (--gemm-rows)
IMPLS = ALL_IMPLS + ("gemm",)


def executed_tflop(kept_heads: int, d: int) -> float:
    """TFLOPs of a step's matrix products, from its kept tiles counted per query head."""
    return 2 * BLOCK * BLOCK * d * PRODUCTS_PER_TILE * kept_heads / 1e12


def gemm_inner_dim(tflop: float, rows: int = GEMM_ROWS) -> int:
    """K (a multiple of 64) of the [rows, K] @ [K, rows] GEMM nearest ``tflop`` TFLOPs."""
    return max(64, round(tflop * 1e12 / (2 * rows * rows) / 64) * 64)


def gemm_step(tflop: float, gen: torch.Generator, rows: int = GEMM_ROWS):
    """One bf16 cuBLAS GEMM, [rows, K] @ [K, rows], of about ``tflop`` TFLOPs.

    A large output and a long K is the regime where the library's GEMM runs at its best rate (no
    split-K; over a thousand output tiles for 132 SMs at 8192 rows), so its time is a generous
    ceiling for the same matrix work done in attention tiles. Returns (step, the GEMM's
    own TFLOPs).
    """
    k = gemm_inner_dim(tflop, rows)
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(k, rows, device="cuda", dtype=torch.bfloat16, generator=gen)
    c = torch.empty(rows, rows, device="cuda", dtype=torch.bfloat16)
    return (lambda: torch.matmul(a, b, out=c)), 2 * rows * rows * k / 1e12


def parse_smi_line(line: str) -> dict | None:
    """One ``--format=csv,noheader,nounits`` line of SMI_FIELDS as numbers; None if it is not one."""
    parts = [x.strip() for x in line.split(",")]
    if len(parts) != 5:
        return None
    try:
        clock, power = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    active = [x.lower() == "active" for x in parts[2:]]
    return dict(sm_clock_mhz=clock, power_w=power, power_capped=active[0], thermal=active[1] or active[2])


class SmiSampler:
    """``nvidia-smi`` sampling the current GPU every ``period_ms`` in a thread; samples carry host time."""

    def __init__(self, period_ms: int):
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        self.samples: list[tuple[float, dict]] = []
        for fields in SMI_FIELDS:
            cmd = ["nvidia-smi", f"--id=GPU-{uuid}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
            probe = subprocess.run(cmd, capture_output=True, text=True)
            lines = probe.stdout.strip().splitlines()
            if probe.returncode == 0 and lines and parse_smi_line(lines[0]) is not None:
                break
        else:
            raise RuntimeError(
                f"nvidia-smi does not report the fields of SMI_FIELDS here: {probe.stdout}{probe.stderr}")
        self.proc = subprocess.Popen(cmd + ["--loop-ms", str(period_ms)], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            sample = parse_smi_line(line)
            if sample is not None:
                self.samples.append((time.perf_counter(), sample))

    def between(self, t0: float, t1: float) -> list[dict]:
        return [s for t, s in self.samples if t0 <= t <= t1]

    def close(self):
        self.proc.terminate()
        self.proc.wait()


def summarize_samples(samples: list[dict]) -> dict:
    if not samples:
        return {}
    return dict(sm_clock_mhz=statistics.median(s["sm_clock_mhz"] for s in samples),
                power_w=statistics.median(s["power_w"] for s in samples),
                power_capped=sum(s["power_capped"] for s in samples) / len(samples),
                thermal=sum(s["thermal"] for s in samples) / len(samples), samples=len(samples))


def short_kernel_name(name: str) -> str:
    """``void ns::kernels::sm90::dkdv_kernel<__nv_bfloat16, 128>(...)`` -> ``sm90::dkdv_kernel<__nv_bfloat16, 128>``."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").split("(")[0]
    return name.removeprefix("sparsebalance::").removeprefix("kernels::")


def kernels_per_step(kernels: list[tuple[float, float, str]], steps: int, window: range) -> dict:
    """Device ms per step of each kernel over the steps in ``window``.

    ``kernels``: (start, duration us, name) of every kernel of ``steps`` identical steps. A step
    launches the same kernels each time, so the i-th step's are the i-th run of len/steps.
    """
    if not kernels or len(kernels) % steps:
        raise ValueError(f"{len(kernels)} kernels do not split into {steps} identical steps")
    per = len(kernels) // steps
    ordered = sorted(kernels)
    totals: dict[str, float] = collections.defaultdict(float)
    for i in window:
        for _, dur, name in ordered[i * per:(i + 1) * per]:
            totals[short_kernel_name(name)] += dur / 1e3 / len(window)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def sustained_run(step, steps: int, burst: int, pause_s: float, sampler: SmiSampler) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    idle_t0 = time.perf_counter()
    time.sleep(pause_s)  # the clock comes back up while the GPU idles
    idle = sampler.between(idle_t0 + pause_s / 2, time.perf_counter())
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for a, b in events:
            a.record()
            step()
            b.record()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
    ms = [a.elapsed_time(b) for a, b in events]
    kernels = [(e.time_range.start, e.device_time, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    half = range(steps // 2, steps)
    return dict(
        steps=steps, burst_step_ms=statistics.median(ms[:burst]), sustained_step_ms=statistics.median(ms[steps // 2:]),
        window_ms=[round(statistics.median(ms[i:i + 10]), 3) for i in range(0, steps, 10)],
        kernels_ms=dict(burst=kernels_per_step(kernels, steps, range(burst)),
                        sustained=kernels_per_step(kernels, steps, half)),
        smi=dict(summarize_samples(sampler.between((t0 + t1) / 2, t1)),
                 idle_sm_clock_mhz=summarize_samples(idle).get("sm_clock_mhz")),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", default="cuda,flex")
    ap.add_argument("--shape", default="qwen2.5-3b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--density", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--burst", type=int, default=10, help="steps counted as the burst (from the start of a run)")
    ap.add_argument("--pause-s", type=float, default=3.0, help="idle seconds before each run")
    ap.add_argument("--sample-ms", type=int, default=50)
    ap.add_argument("--gemm-rows", type=int, default=GEMM_ROWS, help="M = N of the gemm step's GEMM")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/sustained_h200.json)")
    args = ap.parse_args(argv)
    if args.seq % BLOCK or args.seq <= 0:
        ap.error(f"--seq must be a positive multiple of the block size {BLOCK}")
    if not 0 < args.density < 1:
        ap.error("--density must be in (0, 1)")
    if not 2 <= args.burst <= args.steps // 2:
        ap.error("--burst must be at least 2 and at most half of --steps")
    if args.sample_ms < 1 or args.pause_s < 0:
        ap.error("--sample-ms must be >= 1 and --pause-s >= 0")
    if args.gemm_rows < 128 or args.gemm_rows % 128:
        ap.error("--gemm-rows must be a positive multiple of 128")
    impls = [x for x in args.impls.split(",") if x]
    if not impls or set(impls) - set(IMPLS):
        ap.error(f"--impls takes a comma-separated list of {', '.join(IMPLS)}; got {args.impls!r}")

    hq, g, d = SHAPES[args.shape]
    S = args.seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = make_inputs(S, hq, g, d, gen)
    for x in (q, k, v):
        x.requires_grad_()
    go = torch.randn_like(q)
    lay = BlockLayout.from_cu_seqlens(torch.tensor([0, S], dtype=torch.int32, device="cuda"), BLOCK, S)
    kk = budget_for_density(S // BLOCK, args.density)
    with torch.no_grad():
        route = select_blocks(block_scores(q, k, lay), lay, kk)
    attention_tflop = executed_tflop(route.kept_blocks() * (hq // g), d)
    sampler = SmiSampler(args.sample_ms)
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape, seq=S,
                  density=args.density, k=kk, executed_tflop=attention_tflop, gemm_rows=args.gemm_rows, notes=NOTES,
                  impls={})
    try:
        for impl in impls:
            tflop = attention_tflop
            if impl == "gemm":
                step, tflop = gemm_step(attention_tflop, gen, args.gemm_rows)
            else:
                flex_fn = bm = None
                if impl in NEEDS_BLOCK_MASK:
                    from torch.nn.attention.flex_attention import flex_attention

                    flex_fn, bm = torch.compile(flex_attention, dynamic=False), flex_block_mask(route, hq, S)
                _, step = run_case(impl, q, k, v, go, route, S, hq, flex_fn, bm)
            result["impls"][impl] = row = sustained_run(step, args.steps, args.burst, args.pause_s, sampler)
            row.update(executed_tflop=tflop, burst_tflops=tflop / row["burst_step_ms"] * 1e3,
                       sustained_tflops=tflop / row["sustained_step_ms"] * 1e3)
            summary = {key: row[key] for key in ("burst_step_ms", "sustained_step_ms", "burst_tflops",
                                                 "sustained_tflops", "smi")}
            print(impl, json.dumps(summary), flush=True)
            print("  windows of 10 steps (ms):", row["window_ms"])
            for phase in ("burst", "sustained"):
                print(f"  {phase}:", ", ".join(f"{n} {t:.3f}" for n, t in row["kernels_ms"][phase].items() if t > 0.01))
    finally:
        sampler.close()
    out = args.out or (os.path.join(os.environ["OUT"], "sustained_h200.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
