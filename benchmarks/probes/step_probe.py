"""Probe: our CUDA forward and two-pass backward, and FA4's forward+backward of the same selection
(where flash-attn-4 imports), at issue 44's eight cases: ms, medians of interleaved rounds. For A/B
runs of two builds on one machine (FA4's row is the clock reference between them).

    python3 -m benchmarks.probes.step_probe [ROUNDS]
    python3 -m benchmarks.probes.step_probe --once SHAPE S DENSITY

``--once``: one forward and three two-pass backwards of one case and nothing else, for a profiler
(``benchmarks/probes/ncu_source.sh`` profiles a kernel's third launch)."""
import sys

import torch

from benchmarks.attention import SHAPES, flex_block_mask, interleaved_medians, routed_case, run_case
from megatron_sparsebalance.ops import cuda_attention as ca

CASES = [(shape, S, density) for shape in ("qwen2.5-0.5b", "qwen2.5-3b") for S in (32768, 65536)
         for density in (0.1, 0.25)]  # issue 44's eight


def routed_cases():
    """Issue 44's eight cases as the probes take them, one after the other from one generator:
    ``(shape, S, density, q, k, v, route, args)``, as :func:`benchmarks.attention.routed_case` builds them."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, S, density in CASES:
        yield (shape, S, density, *routed_case(S, *SHAPES[shape], density, gen))


def rounds_from_argv() -> int:
    """The probes' one argument: interleaved rounds (3 when left out)."""
    return int(sys.argv[1]) if len(sys.argv) > 1 else 3


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


def once(shape: str, S: int, density: float):
    """The ``--once`` run: one case by :func:`benchmarks.attention.routed_case` from a generator seeded
    0, a forward, three backwards."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, _, args = routed_case(S, *SHAPES[shape], density, gen)
    out, lse = ca._forward(q, k, v, *args)
    go = torch.randn_like(q)
    for _ in range(3):
        ca._backward(go, q, k, v, out, lse, *args)
    torch.cuda.synchronize()


def main():
    if sys.argv[1:2] == ["--once"]:
        once(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
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
