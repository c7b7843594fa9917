"""Probe: what ``--sparse-attn-impl fa4`` (our forward, FA4's backward) pays that FA4 called
directly does not, at issue 44's eight cases: each one's forward and forward+backward (medians of
interleaved rounds), our backward's block-sparse plan alone (``fa4_backward_plan``, and the torch
construction ``fa4_block_plan`` it replaced on the GPU: event-timed, and the host's time to issue
it), and, at 0.5B 10%, a torch.profiler view of three fa4 steps (kernels by GPU time, the GPU's
busy time against its span, the largest idle gaps).

    python3 -m benchmarks.probes.fa4_backend_probe [ROUNDS]"""
import time

import torch

from benchmarks.attention import flex_block_mask, interleaved_medians, run_case
from benchmarks.probes.step_probe import print_profile, rounds_from_argv, routed_cases
from megatron_sparsebalance.ops import fa4_attention


def plan_host_ms(build_plan, repeats=20) -> float:
    """The host's ms to issue one backward plan (the GPU drained before and after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        build_plan()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / repeats * 1e3


def main():
    rounds = rounds_from_argv()
    for shape, S, density, q, k, v, route, _ in routed_cases():
        hq = q.shape[1]
        go = torch.randn_like(q)
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        block_mask = flex_block_mask(route, hq, S)
        runs = {}
        for impl in ("fa4_backend", "fa4"):
            runs[impl + ".fwd"], runs[impl] = run_case(impl, *inputs, go, route, S, hq, None, block_mask)
        plans = {"plan": lambda: fa4_attention.fa4_backward_plan(route, hq),  # what the backward builds
                 "plan (torch)": lambda: fa4_attention.fa4_block_plan(route, hq, forward=False)}
        med = interleaved_medians({**runs, **plans}, rounds, 10, 2)
        med["bwd fa4_backend-fa4"] = round((med["fa4_backend"] - med["fa4_backend.fwd"])
                                           - (med["fa4"] - med["fa4.fwd"]), 3)
        host = ", ".join("%s host %.3f ms" % (name, plan_host_ms(build)) for name, build in plans.items())
        print(shape, S, density, med, host, flush=True)
        if shape == "qwen2.5-0.5b" and density == 0.1:
            print_profile({"fa4_backend": runs["fa4_backend"]})


if __name__ == "__main__":
    main()
