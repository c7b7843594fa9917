"""The Triton kernels' logic on the CPU, under Triton's interpreter (TRITON_INTERPRET=1).

Runs in a subprocess because the interpreter is chosen when the kernels are decorated, at
import. Tiny shapes: partial blocks, a varlen pack, GQA with R = 3, fp16; outputs and
dq/dk/dv against the fp32 reference; the Triton router pooling against the torch router.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_sparsebalance.ops import BlockLayout, block_scores, select_blocks
    from megatron_sparsebalance.ops.naive import sparse_attention_naive
    from megatron_sparsebalance.ops.router import transpose_route_index
    from megatron_sparsebalance.ops import triton_attention as ta

    torch.manual_seed(0)
    for lens, block, hq, g, budget in (([97, 70], 64, 6, 2, 2), ([200], 64, 3, 1, 3)):
        T = sum(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        lay = BlockLayout.from_cu_seqlens(cu, block, T)
        q = torch.randn(T, hq, 64, dtype=torch.float16, requires_grad=True)
        k = torch.randn(T, g, 64, dtype=torch.float16, requires_grad=True)
        v = torch.randn(T, g, 64, dtype=torch.float16, requires_grad=True)
        route = select_blocks(block_scores(q.detach(), k.detach(), lay), lay, budget)
        qp, qi = ta.transpose_index_gpu(route.kv_idx, route.kv_cnt)
        rp, ri = transpose_route_index(route.kv_idx, route.kv_cnt)
        assert torch.equal(qp, rp) and torch.equal(qi[: ri.numel()], ri)
        go = torch.randn(T, hq, 64, dtype=torch.float16)
        out = ta.block_sparse_attention(q, k, v, route, 0.125)
        grads = torch.autograd.grad(out, (q, k, v), go)
        ref = sparse_attention_naive(q, k, v, route, 0.125, upcast=True)
        rgrads = torch.autograd.grad(ref, (q, k, v), go.float())
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out,) + grads, (ref,) + rgrads):
            assert torch.isfinite(a).all(), name
            rel = ((a.float() - b).norm() / b.norm()).item()
            assert rel < 3e-3, (name, rel)
    from megatron_sparsebalance.ops.router import block_scores
    from megatron_sparsebalance.ops.triton_router import block_scores_triton

    ref = block_scores(q.detach(), k.detach(), lay)
    got = block_scores_triton(q.detach(), k.detach(), lay)
    assert torch.equal(torch.isinf(ref), torch.isinf(got))
    fin = torch.isfinite(ref)
    assert torch.allclose(got[fin], ref[fin], atol=1e-4, rtol=1e-4)
    print("OK")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("triton's interpreter is too slow here")
    if proc.returncode != 0 and "interpret" in proc.stderr.lower() and "not supported" in proc.stderr.lower():
        pytest.skip(f"triton's interpreter cannot run here: {proc.stderr[-300:]}")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
