"""Probe: our CUDA forward and two-pass backward, and FA4's forward+backward of the same selection
(where flash-attn-4 imports), at issue 44's eight cases: ms, medians of interleaved rounds. For A/B
runs of two builds on one machine (FA4's row is the clock reference between them).

    python3 -m benchmarks.probes.step_probe [ROUNDS]
    python3 -m benchmarks.probes.step_probe --once SHAPE S DENSITY [ds]
    python3 -m benchmarks.probes.step_probe --profile [ROUNDS]
    python3 -m benchmarks.probes.step_probe --clocks
    python3 -m benchmarks.probes.step_probe --energy
    python3 -m benchmarks.probes.step_probe --forward-energy

``--once``: one forward and three two-pass backwards of one case and nothing else, for a profiler
(``benchmarks/probes/ncu_source.sh`` profiles a kernel's third launch); with ``ds``, three
stored-dS backwards instead. ``--profile``: per case,
our ``cuda`` forward+backward step as the benchmark times it (``run_case``) and FA4's where it
imports, their event-timed medians, then torch.profiler's view of both taking turns
(:func:`print_profile`): each kernel's device time, and what of a step lies outside its kernels.
``--clocks``: at the two 64K 25% cases, our ``cuda`` step and FA4's, each run 20 times in a row
(as the benchmark's rounds do) and then taking turns call by call, with the SM clock, the
board's power and the clock event reasons that ``nvidia-smi`` samples meanwhile: how far each
step's time depends on the clock it holds, and why the clock moves. ``--energy``: at the eight
cases, each step run in a row for a few seconds, twice, after a rest: the energy a call takes
(NVML's energy counter, and the sampled power over the same seconds) and the clock it ran at;
under the board's power cap a step's time follows the energy it spends. ``--forward-energy``: the same
for our forward alone, then our step, then the forward again, at the two 64K 25% cases: the clock
the forward holds in a row, against Nsight Compute's fixed one (``ncu_source.sh``)."""
import collections
import ctypes
import datetime
import statistics
import subprocess
import sys
import threading
import time

import torch

from benchmarks.attention import SHAPES, cuda_times, flex_block_mask, interleaved_medians, routed_case, run_case
from megatron_sparsebalance.ops import cuda_attention as ca

CASES = [(shape, S, density) for shape in ("qwen2.5-0.5b", "qwen2.5-3b") for S in (32768, 65536)
         for density in (0.1, 0.25)]  # issue 44's eight


def routed_cases(shape: str | None = None):
    """Issue 44's eight cases as the probes take them, one after the other from one generator:
    ``(shape, S, density, q, k, v, route, args)``, as :func:`benchmarks.attention.routed_case` builds them.
    With ``shape``, that shape's four alone, the others not built: the 0.5B cases come first, so
    theirs are the inputs of the whole run; the 3B ones then start from the generator's seed."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, S, density in CASES:
        if shape is None or name == shape:
            yield (name, S, density, *routed_case(S, *SHAPES[name], density, gen))


def rounds_from_argv(position: int = 1) -> int:
    """The probes' one argument, at ``sys.argv[position]``: interleaved rounds (3 when left out)."""
    return int(sys.argv[position]) if len(sys.argv) > position else 3


def fa4_step(q, k, v, go, route):
    """FA4's forward+backward of the selection, as the benchmark times it (``run_case``'s fa4), or
    None where flash-attn-4 does not import."""
    from megatron_sparsebalance.ops.fa4_attention import import_error

    if import_error() is not None:
        return None
    S, hq = q.shape[0], q.shape[1]
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    _, step = run_case("fa4", *inputs, go, route, S, hq, None, flex_block_mask(route, hq, S))
    return step


def benchmark_steps(q, k, v, go, route) -> dict:
    """Our ``cuda`` forward+backward step and FA4's (where flash-attn-4 imports), each as the
    benchmark times it (``run_case``)."""
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    steps = {"cuda": run_case("cuda", *inputs, go, route, q.shape[0], q.shape[1], None, None)[1]}
    fa4 = fa4_step(q, k, v, go, route)
    if fa4 is not None:
        steps["fa4"] = fa4
    return steps


def warm_steps_beside_fa4(q, k, v, route, mode: str) -> dict:
    """:func:`benchmark_steps` for a run (``mode``) that compares our step with FA4's: each step run
    once (FA4 compiles its kernels in its first call); an exit that says so where flash-attn-4
    does not import."""
    steps = benchmark_steps(q, k, v, torch.randn_like(q), route)
    if "fa4" not in steps:
        raise SystemExit("%s compares our step with FA4's, and flash-attn-4 does not import here "
                         "(docs/FA4.md, 'GPU commands')" % mode)
    for step in steps.values():
        step()
    return steps


def print_profile(steps: dict, calls: int = 3, owner=None) -> None:
    """torch.profiler over ``calls`` rounds of every step of ``steps`` in turn, each followed by a
    synchronisation (each run once before, not profiled), so that all see the same clocks: per
    step, each kernel's device ms per call, its kernels' busy time against the span from its first
    kernel to its last, the largest idle gaps inside it. ``owner`` names the step a kernel belongs
    to (by its name) where there is more than one."""
    from torch.profiler import ProfilerActivity, profile

    for step in steps.values():
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for step in steps.values():
                step()
                torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    by_step = collections.defaultdict(list)
    for e in kernels:
        by_step[owner(e.name) if owner else next(iter(steps))].append(e)
    # A step launches the same kernels in every call: its kernels in time order, cut into equal calls.
    runs = {}
    for name, its in by_step.items():
        assert len(its) % calls == 0, f"{name}: {len(its)} kernels over {calls} calls"
        per_call = len(its) // calls
        runs[name] = [its[i:i + per_call] for i in range(0, len(its), per_call)]
    for name, calls_of in runs.items():
        per_kernel = collections.Counter()
        for e in (e for call in calls_of for e in call):
            per_kernel[e.name[:70]] += (e.time_range.end - e.time_range.start) / len(calls_of) / 1e3
        print("  %s:" % name)
        for kernel, ms in per_kernel.most_common():
            print("   %8.4f ms  %s" % (ms, kernel))
        busy = sum(e.time_range.end - e.time_range.start for call in calls_of for e in call)
        span = sum(call[-1].time_range.end - call[0].time_range.start for call in calls_of)
        print("   per call (%d): GPU span %.3f ms, kernels %.3f ms (%d launches); largest gaps (us):"
              % (len(calls_of), span / len(calls_of) / 1e3, busy / len(calls_of) / 1e3,
                 sum(map(len, calls_of)) // len(calls_of)))
        gaps = sorted(((b.time_range.start - a.time_range.end, a.name[:50], b.name[:50])
                       for call in calls_of for a, b in zip(call, call[1:])), reverse=True)
        for gap in gaps[:4]:
            print("   %.1f  %s -> %s" % gap)


def profile_cases(rounds: int):
    """The ``--profile`` run (see the module's docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):  # its start-up, off the first case
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    for shape, S, density, q, k, v, route, _ in routed_cases():
        steps = benchmark_steps(q, k, v, torch.randn_like(q), route)
        med = interleaved_medians(steps, rounds, 10, 2)
        print("== %s %d %.2f: event-timed fwd+bwd ms %s" % (shape, S, density, med), flush=True)
        # Our kernels are named in our namespace; every other kernel of the two steps is FA4's.
        print_profile(steps, owner=lambda kernel: "cuda" if "sparsebalance" in kernel else "fa4")


class ClockSampler:
    """GPU 0's SM clock (MHz), board power (W, instantaneous) and active clock event reasons (the
    NVML bitmask: 0x4 the software power cap, 0x20/0x40 thermal slowdowns, 0x8/0x80 hardware
    slowdowns) from ``nvidia-smi`` every 20 ms. Each sample is placed in time by nvidia-smi's own
    stamp (ms): through a pipe its lines arrive in bursts, so their arrival time would misplace
    them."""

    def __init__(self):
        self.samples = []  # (host seconds, MHz, W, reasons)
        self.proc = subprocess.Popen(["nvidia-smi", "-i", "0", "--format=csv,noheader,nounits", "-lms", "20",
                                      "--query-gpu=timestamp,clocks.sm,power.draw.instant,clocks_event_reasons.active"],
                                     stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            stamp, mhz, watts, reasons = (x.strip() for x in line.split(","))
            t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            self.samples.append((t, float(mhz), float(watts), int(reasons, 16)))

    def between(self, t0: float, t1: float) -> str:
        """The samples stamped in [t0, t1]: median MHz and W, and each reason mask's share."""
        inside = [s[1:] for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return "no samples"
        masks = collections.Counter(r for _, _, r in inside)
        return "SM %.0f MHz, %.0f W, reasons %s" % (
            statistics.median(m for m, _, _ in inside), statistics.median(w for _, w, _ in inside),
            " ".join("%#x %d%%" % (mask, 100 * n // len(inside)) for mask, n in masks.most_common()))

    def stop(self):
        self.proc.terminate()


def clocks(calls: int = 20):
    """The ``--clocks`` run (see the module's docstring)."""
    sampler = ClockSampler()
    try:
        for shape, S, density, q, k, v, route, _ in routed_cases():
            if (S, density) != (65536, 0.25):
                continue
            steps = warm_steps_beside_fa4(q, k, v, route, "--clocks")
            for block in [("cuda",), ("fa4",), ("fa4",), ("cuda",), ("cuda", "fa4"), ("fa4", "cuda")]:
                time.sleep(2)  # every block starts from the same rest
                times = {impl: [] for impl in block}
                t0 = time.time()
                for _ in range(calls):
                    for impl in block:
                        times[impl] += cuda_times(steps[impl], 1, 0)
                clocks_seen = sampler.between(t0, time.time())
                ms = ", ".join("%s median %.2f ms, first three %s" % (impl, statistics.median(t),
                                                                       " ".join("%.2f" % x for x in t[:3]))
                               for impl, t in times.items())
                print("%s %d %.2f %-9s %s; %s" % (shape, S, density, "+".join(block), ms, clocks_seen), flush=True)
    finally:  # nvidia-smi would outlive a case that fails
        sampler.stop()


class EnergyCounter:
    """GPU 0's energy since the driver loaded (NVML's total energy consumption, in mJ), read from
    libnvidia-ml itself through ctypes, so that the probe needs no NVML binding installed."""

    def __init__(self):
        self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.nvml.nvmlInit_v2(), "nvmlInit_v2")
        self.device = ctypes.c_void_p()
        self._check(self.nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.device)),
                    "nvmlDeviceGetHandleByIndex_v2")

    @staticmethod
    def _check(status: int, call: str):
        if status != 0:
            raise SystemExit("--energy: %s returned NVML error %d" % (call, status))

    def joules(self) -> float:
        millijoules = ctypes.c_ulonglong()
        self._check(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.device, ctypes.byref(millijoules)),
                    "nvmlDeviceGetTotalEnergyConsumption")
        return millijoules.value / 1e3


def in_a_row(fn, label: str, meter: EnergyCounter, sampler: ClockSampler, seconds: float) -> float:
    """fn called back to back for `seconds` after a 2 s rest (every block starts from the same
    rest), as :func:`benchmarks.attention.cuda_times` times it (a synchronisation after each call,
    so a call's energy includes its share of the host's gaps between calls); prints the block and
    returns the energy a call (J)."""
    time.sleep(2)
    torch.cuda.synchronize()
    e0, t0, times = meter.joules(), time.time(), []
    while time.time() - t0 < seconds:
        times += cuda_times(fn, 1, 0)
    e1, t1 = meter.joules(), time.time()
    print("%s %3d calls in a row: median %.2f ms, %.3f J a call (%.0f W by the counter); %s"
          % (label, len(times), statistics.median(times), (e1 - e0) / len(times), (e1 - e0) / (t1 - t0),
             sampler.between(t0, t1)), flush=True)
    return (e1 - e0) / len(times)


def energy(seconds: float = 2.5):
    """The ``--energy`` run (see the module's docstring)."""
    sampler, meter = ClockSampler(), EnergyCounter()
    try:
        for shape, S, density, q, k, v, route, _ in routed_cases():
            steps = warm_steps_beside_fa4(q, k, v, route, "--energy")
            per_call = {impl: [] for impl in steps}
            for impl in ("cuda", "fa4", "fa4", "cuda"):
                label = "%s %d %.2f %-4s" % (shape, S, density, impl)
                per_call[impl].append(in_a_row(steps[impl], label, meter, sampler, seconds))
            ours, fa4 = (statistics.mean(per_call[impl]) for impl in ("cuda", "fa4"))
            print("%s %d %.2f energy a call: ours %.3f J, FA4 %.3f J, FA4 / ours %.3f"
                  % (shape, S, density, ours, fa4, fa4 / ours), flush=True)
    finally:  # nvidia-smi would outlive a case that fails
        sampler.stop()


def forward_energy(seconds: float = 2.5):
    """The ``--forward-energy`` run (see the module's docstring)."""
    sampler, meter = ClockSampler(), EnergyCounter()
    try:
        for shape, S, density, q, k, v, route, _ in routed_cases():
            if (S, density) != (65536, 0.25):
                continue
            go = torch.randn_like(q)
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            forward, step = run_case("cuda", *inputs, go, route, S, q.shape[1], None, None)
            cuda_times(step, 2, 1)  # the first calls set up what later ones reuse
            for name, fn in (("forward", forward), ("step", step), ("forward", forward)):
                in_a_row(fn, "%s %d %.2f %-7s" % (shape, S, density, name), meter, sampler, seconds)
    finally:  # nvidia-smi would outlive a case that fails
        sampler.stop()


def once(shape: str, S: int, density: float, stored_ds: bool = False):
    """The ``--once`` run: one case by :func:`benchmarks.attention.routed_case` from a generator seeded
    0, a forward, three backwards (two-pass, or with dS stored)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, _, args = routed_case(S, *SHAPES[shape], density, gen)
    out, lse = ca._forward(q, k, v, *args)
    go = torch.randn_like(q)
    backward = ca._backward_stored_ds if stored_ds else ca._backward
    for _ in range(3):
        backward(go, q, k, v, out, lse, *args)
    torch.cuda.synchronize()


def main():
    if sys.argv[1:2] == ["--once"]:
        once(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5:6] == ["ds"])
        return
    if sys.argv[1:2] == ["--clocks"]:
        clocks()
        return
    if sys.argv[1:2] == ["--energy"]:
        energy()
        return
    if sys.argv[1:2] == ["--forward-energy"]:
        forward_energy()
        return
    if sys.argv[1:2] == ["--profile"]:
        profile_cases(rounds_from_argv(2))
        return
    rounds = rounds_from_argv()
    for shape, S, dens, q, k, v, route, args in routed_cases():
        out, lse = ca._forward(q, k, v, *args)
        go = torch.randn_like(q)
        runs = {"fwd": lambda: ca._forward(q, k, v, *args),
                "bwd": lambda: ca._backward(go, q, k, v, out, lse, *args)}
        fa4 = fa4_step(q, k, v, go, route)
        if fa4 is not None:
            runs["fa4_step"] = fa4
        med = interleaved_medians(runs, rounds, 5, 2)
        if "fa4_step" in med:
            med["fa4/ours"] = round(med["fa4_step"] / (med["fwd"] + med["bwd"]), 3)
        print(shape, S, dens, med, flush=True)


if __name__ == "__main__":
    main()
