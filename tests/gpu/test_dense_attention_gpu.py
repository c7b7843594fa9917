"""The dense reference path (``--no-sparse-attention``) on the GPU.

Every sequence of a training pack has a length of its own, so the dense path must cost no
per-length set-up: cuDNN's SDPA built an execution plan per new length (~150 ms forward+backward
on an H200), which made the dense rows of the end-to-end and fidelity benchmarks ~10x slower than
their attention.
"""
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_sparsebalance.ops.dense import dense_causal_attention
from tests.checks import run_without_sync

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _pack(lengths, hq=4, g=2, d=64, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, d, generator=gen).to("cuda", dtype).requires_grad_() for h in (hq, g, g))
    host = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return q, k, v, host.cuda(), host


def _fwd_bwd(q, k, v, cu, host=None, grad=None):
    out = dense_causal_attention(q, k, v, cu, q.shape[-1] ** -0.5, host)
    out.backward(grad if grad is not None else torch.ones_like(out))
    return out


def _math_reference(q, k, v, host, grad, dtype):
    """The same attention by PyTorch's math kernel in ``dtype``, K/V heads repeated; returns (out, dq, dk, dv)."""
    ins = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.cat([
            F.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1).unsqueeze(0).repeat_interleave(r, 1) for x, r in zip(ins, (1, rep, rep))),
                is_causal=True, scale=q.shape[-1] ** -0.5).squeeze(0).transpose(0, 1)
            for a, b in zip(host[:-1].tolist(), host[1:].tolist())])
    out.backward(grad.to(dtype))
    return [out] + [x.grad for x in ins]


def test_dense_pack_matches_the_fp32_reference():
    """Output and gradients within 2x the error of the same math in bf16 (flash-attention's rule)."""
    lengths = [1000, 64, 1500, 3000, 1]
    q, k, v, cu, host = _pack(lengths)
    grad = torch.randn(q.shape, generator=torch.Generator(device="cpu").manual_seed(1)).to("cuda", q.dtype)
    out = _fwd_bwd(q, k, v, cu, host, grad)
    ref = _math_reference(q, k, v, host, grad, torch.float32)
    low = _math_reference(q, k, v, host, grad, torch.bfloat16)
    for name, ours, theirs, bf16 in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref, low):
        assert torch.isfinite(ours).all(), name
        err = (ours.float() - theirs).abs().max().item()
        bound = (bf16.float() - theirs).abs().max().item()
        assert err <= 2 * bound + 1e-5, f"{name}: {err} > 2 x {bound}"


def test_new_sequence_lengths_cost_no_set_up():
    """Eight calls on eight new lengths take about as long as eight calls on one length."""
    def timed(lengths):
        times = []
        for L in lengths:
            q, k, v, cu, host = _pack([L])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _fwd_bwd(q, k, v, cu, host)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    timed([4096] * 3)  # warm-up: kernels loaded, allocator grown
    same = timed([4096] * 8)
    new = timed([4096 + 64 * i + 7 for i in range(1, 9)])
    assert new < 3 * same + 2e-3, f"new lengths {new * 1e3:.2f} ms vs one length {same * 1e3:.2f} ms per call"


def test_dense_pack_with_host_offsets_does_not_stop_the_host():
    q, k, v, cu, host = _pack([700, 1300, 64])
    run_without_sync(lambda: _fwd_bwd(q, k, v, cu, host))
