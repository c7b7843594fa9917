"""Probe: where the one-pass backward's step spends its cycles (docs/FA4.md, "Where the one-pass
step's time goes"), at issue 44's head-dim-128 cases.

Needs `benchmarks/probes/onepass_backward.patch` and `benchmarks/probes/onepass_phases.patch`
applied and built (the second says how). Per case: the one-pass backward's event-timed ms (median
of five calls, phases not summed), then three calls with MSB_PROBE set, and the cycles a consumer
warpgroup spends a step in each phase, averaged over every step of every CTA. Run it once per
variant of the patch, e.g. ``MSB_NO_ADDS=1 MSB_CONV=2 python3 -m benchmarks.probes.onepass_phases``.
"""
import os

import torch

from benchmarks.probes.step_probe import routed_cases
from megatron_sparsebalance.ops import cuda_attention as ca
from megatron_sparsebalance.ops import native

PHASES = ("wait_full", "scores", "ds_dv", "barrier", "dq_dk", "dq_empty", "dq_store", "tail")
CALLS = 3


def event_ms(fn, calls: int = 5) -> float:
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[calls // 2]


def main():
    _C = native.native()
    variant = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MSB_")) or "base"
    print(f"{torch.cuda.get_device_name()}, variant: {variant}", flush=True)
    for shape, S, density, q, k, v, route, args in routed_cases():
        if q.shape[-1] != 128:
            continue
        out, lse = ca._forward(q, k, v, *args)
        go = torch.randn_like(q)
        q_ptr, q_idx = ca.transpose_index_gpu(route.kv_idx, route.kv_cnt)

        def backward():
            return _C.sparse_attn_bwd_onepass_cuda(go, q, k, v, out, lse, *args[:4], q_ptr, q_idx, *args[4:])

        os.environ.pop("MSB_PROBE", None)
        ms = event_ms(backward)
        os.environ["MSB_PROBE"] = "1"
        sums = sum(backward()[3].cpu() for _ in range(CALLS))
        del os.environ["MSB_PROBE"]
        steps = int(sums[8])  # both consumers count each step
        per_step = [int(sums[i]) / steps for i in range(len(PHASES))]
        print(f"{shape} {S} {density}: bwd {ms:.2f} ms; {steps // (2 * CALLS)} steps a call; cycles a step "
              + ", ".join(f"{name} {c:.0f}" for name, c in zip(PHASES, per_step)) + f"; total {sum(per_step):.0f}",
              flush=True)
        del q, k, v, out, lse, go, q_ptr, q_idx
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
