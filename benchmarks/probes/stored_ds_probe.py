"""Probe: where the stored-dS backward's time goes against the two-pass one's, kernel by kernel,
at issue 44's 3B cases (``cuda`` and ``cuda_ds`` of benchmarks/attention.py, each step profiled
on its own, three calls; torch.profiler).

    python3 -m benchmarks.probes.stored_ds_probe [S DENSITY]

Each step runs alone, so each holds its own clock under the board's power cap: the forward
kernel, the same in both, tells the two clocks apart."""
import sys

import torch

from benchmarks.attention import run_case
from benchmarks.probes.step_probe import print_profile, routed_cases


def main():
    wanted = (int(sys.argv[1]), float(sys.argv[2])) if len(sys.argv) > 2 else None
    for shape, S, density, q, k, v, route, _ in routed_cases():
        if shape != "qwen2.5-3b" or (wanted and (S, density) != wanted):
            continue
        go = torch.randn_like(q)
        for impl in ("cuda", "cuda_ds"):
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            _, step = run_case(impl, *inputs, go, route, S, q.shape[1], None, None)
            print(f"{shape} S={S} density={density} {impl}", flush=True)
            print_profile({impl: step}, calls=3)
            del step, inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
