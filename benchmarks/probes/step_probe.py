"""Probe: our CUDA forward and two-pass backward, and FA4's forward+backward of the same selection
(where flash-attn-4 imports), at issue 44's eight cases: ms, medians of interleaved rounds. For A/B
runs of two builds on one machine (FA4's row is the clock reference between them).

    python3 -m benchmarks.probes.step_probe [ROUNDS]"""
import math
import statistics
import sys

import torch

from benchmarks.attention import SHAPES, cuda_times, fa4_direct_tensors, flex_block_mask, routed_case
from megatron_sparsebalance.ops import cuda_attention as ca


def fa4_step(q, k, v, go, route):
    """FA4's forward+backward of the selection, or None where flash-attn-4 does not import."""
    try:
        from megatron_sparsebalance.ops.fa4_attention import _fa4
        flash_attn_func, _, causal_mask_mod = _fa4()
    except Exception:
        return None
    fwd_t, bwd_t = fa4_direct_tensors(flex_block_mask(route, q.shape[1], q.shape[0]))
    inputs = [x.detach().unsqueeze(0).requires_grad_() for x in (q, k, v)]

    def step():
        out = flash_attn_func(*inputs, softmax_scale=1 / math.sqrt(q.shape[-1]), mask_mod=causal_mask_mod,
                              block_sparse_tensors=fwd_t, block_sparse_tensors_bwd=bwd_t)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, inputs, go.unsqueeze(0))
    return step


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in ("qwen2.5-0.5b", "qwen2.5-3b"):
        hq, g, d = SHAPES[shape]
        for S in (32768, 65536):
            for dens in (0.1, 0.25):
                q, k, v, route, args = routed_case(S, hq, g, d, dens, gen)
                out, lse = ca._forward(q, k, v, *args)
                go = torch.randn_like(q)
                runs = {"fwd": lambda: ca._forward(q, k, v, *args),
                        "bwd": lambda: ca._backward(go, q, k, v, out, lse, *args)}
                fa4 = fa4_step(q, k, v, go, route)
                if fa4 is not None:
                    runs["fa4_step"] = fa4
                times = {n: [] for n in runs}
                for _ in range(rounds):
                    for n, fn in runs.items():
                        times[n] += cuda_times(fn, 5, 2)
                med = {n: round(statistics.median(t), 3) for n, t in times.items()}
                if "fa4_step" in med:
                    med["fa4/ours"] = round(med["fa4_step"] / (med["fwd"] + med["bwd"]), 3)
                print(shape, S, dens, med, flush=True)


if __name__ == "__main__":
    main()
