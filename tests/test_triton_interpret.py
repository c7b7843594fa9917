"""The Triton kernels' logic on the CPU, under Triton's interpreter (TRITON_INTERPRET=1).

Runs in a subprocess because the interpreter is chosen when the kernels are decorated, at
import. Tiny shapes: partial blocks, a varlen pack, GQA with R = 3, fp16; outputs and
dq/dk/dv against the fp32 reference; the Triton router (pooling, selection, coverage) against
the torch router.
"""
from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.checks import run_interpreted

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


ROUTER_SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_sparsebalance.ops import BlockLayout
    from megatron_sparsebalance.ops.router import coverage_curve, select_blocks
    from megatron_sparsebalance.ops.triton_router import pooled_dots, select_and_cover

    torch.manual_seed(0)
    inf = float("inf")
    for lens, block in (([300, 64, 1000, 5], 64), ([1100], 128)):
        T = sum(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        lay = BlockLayout.from_cu_seqlens(cu, block, T)
        q = torch.randn(T, 4, 64, dtype=torch.float16)
        k = torch.randn(T, 2, 64, dtype=torch.float16)
        # rounded dots make ties: they must go to the lower block, as in the torch router
        for dots in (pooled_dots(q, k, lay), pooled_dots(q, k, lay).mul(4).round()):
            scale = 0.125
            scores = torch.where(lay.candidates, dots * scale, -inf)
            for budget in (1, 2, 5, 40):
                n = max(budget, 8)
                kv, cnt, curve = select_and_cover(dots, lay, scale, budget=budget, width=budget, curve_len=n)
                ref = select_blocks(scores, lay, budget)
                assert torch.equal(kv, ref.kv_idx) and torch.equal(cnt, ref.kv_cnt), (lens, budget)
                assert torch.allclose(curve, coverage_curve(scores, n), atol=1e-5), (lens, budget)
            # budgets already on the device: one per sequence, or one for all; kv_idx wider than them
            per_seq = torch.tensor([3, 1, 7, 2][: len(lens)])
            kv, cnt, none = select_and_cover(dots, lay, scale, budget=per_seq, width=8)
            ref = select_blocks(scores, lay, per_seq.tolist(), 8)
            assert none is None and torch.equal(kv, ref.kv_idx) and torch.equal(cnt, ref.kv_cnt)
            kv, cnt, _ = select_and_cover(dots, lay, scale, budget=torch.tensor(4), width=8)
            ref = select_blocks(scores, lay, 4, 8)
            assert torch.equal(kv, ref.kv_idx) and torch.equal(cnt, ref.kv_cnt)
            # the coverage curve alone (the coverage bound's first pass)
            none_idx, none_cnt, curve = select_and_cover(dots, lay, scale, curve_len=12)
            assert none_idx is None and none_cnt is None
            assert torch.allclose(curve, coverage_curve(scores, 12), atol=1e-5)
    print("OK")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    run_interpreted(SCRIPT)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_router_selection_and_coverage_under_interpreter():
    """The GPU router's one-launch selection and coverage equal the torch router's, ties included."""
    run_interpreted(ROUTER_SCRIPT)
