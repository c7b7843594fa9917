"""Probe: an A/B of kernel variants built into one extension and picked on the host, at each call,
by an environment variable (a patch under benchmarks/probes/ adds the variable; main reads none).
One build and one process for all variants, so they see the same machine and, in rotating turns,
the same clocks, with no FA4 needed as the reference between builds.

For each of issue 44's eight cases: our ``cuda`` step, and at head dim 128 the stored-dS step
(``cuda_ds``), with the variable at each value, taken in rotating turns (``interleaved_medians``);
before that, each value's output, dQ, dK and dV are compared with the first value's as the
benchmark compares implementations (``compare``), here held to a relative L2 error below 1e-2
(variants that only reorder fp32 sums differ by rounding).

    python3 -m benchmarks.probes.env_ab_probe VAR VALUE,VALUE[,...] [ROUNDS] [SHAPE]

SHAPE (``qwen2.5-0.5b`` or ``qwen2.5-3b``) takes that shape's four cases alone (``routed_cases``): a
variant built at one head dim is measured at its cases only.
"""
import os
import sys

import torch

from benchmarks.attention import SHAPES, compare, interleaved_medians, outputs_and_grads, run_case
from benchmarks.probes.step_probe import routed_cases


def with_env(fn, **env: str):
    """fn, called with the environment variables ``env`` set first (the probes' kernel variants are
    picked on the host at each call): each of a set of variants timed in turns runs as itself."""
    def run():
        os.environ.update(env)
        return fn()
    return run


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    var, values = sys.argv[1], sys.argv[2].split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    only = sys.argv[4] if len(sys.argv) > 4 else None
    if only is not None and only not in SHAPES:
        raise SystemExit(f"SHAPE must be one of {', '.join(SHAPES)}, not {only!r}")
    for shape, S, density, q, k, v, route, _ in routed_cases(only):
        go = torch.randn_like(q)
        impls = ("cuda", "cuda_ds") if q.shape[-1] == 128 else ("cuda",)
        steps, worst = {}, 0.0
        for impl in impls:
            ref = None
            for value in values:
                os.environ[var] = value
                inputs = [x.detach().requires_grad_() for x in (q, k, v)]
                forward, step = run_case(impl, *inputs, go, route, S, q.shape[1], None, None)
                got = outputs_and_grads(forward)
                if ref is None:
                    ref = got
                err = max(c["rel_l2"] for c in compare(got, ref).values())  # inf where not finite
                worst = max(worst, err)
                if not err < 1e-2:
                    raise SystemExit(f"{shape} {S} {density} {impl} {var}={value}: rel. L2 {err:.2e} "
                                     f"against {var}={values[0]}")
                steps[f"{impl}/{value}"] = with_env(step, **{var: value})
        med = interleaved_medians(steps, rounds, 10, 3)
        cells = [f"{key} {ms:.3f} ({med[key.split('/')[0] + '/' + values[0]] / ms:.3f})" for key, ms in med.items()]
        print(f"{shape} {S // 1024}K {density:.2f} | worst rel. L2 vs {values[0]} {worst:.1e} | " + " | ".join(cells),
              flush=True)
        del steps
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
