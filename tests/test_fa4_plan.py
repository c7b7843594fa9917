"""The ``fa4`` implementation's pure logic, on the CPU: FA4's block-sparse tensors built from our
router's selection, the padding of a THD pack, and ``auto``'s choice (deterministic mode included).

The block-sparse tensors are checked against a naive construction of what they must mean: read
the way FA4's kernels read them (full blocks whole, the partial block under ``q >= kv``), they
must give, on the real tokens of the padded pack, exactly our token mask (DESIGN.md §2), and never
let a real query read a padding key. The wrapper itself runs end to end with FA4's call replaced by
a dense emulation of those semantics, against the naive reference, gradients included.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.ops import fa4_attention
from megatron_sparsebalance.ops.fa4_attention import FA4_BLOCK, fa4_block_plan, padded_positions
from megatron_sparsebalance.ops.implementations import (
    NON_DETERMINISTIC,
    check_request,
    measured_entry,
    order_from_table,
    resolve_impl,
    unavailable_reason,
)
from megatron_sparsebalance.ops.layout import BlockLayout
from megatron_sparsebalance.ops.naive import sparse_attention_naive, token_mask_of_sequence
from megatron_sparsebalance.ops.router import block_scores, select_blocks

PACKS = {"97": [97], "256": [256], "varlen": [300, 97, 530, 64, 1]}


def _route(lens, hq, g, d, block, budget, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    lay = BlockLayout.from_cu_seqlens(cu, block, T)
    q = torch.randn(T, hq, d, generator=gen)
    k = torch.randn(T, g, d, generator=gen) + torch.randn(lay.num_blocks, g, d, generator=gen)[lay.token_block]
    v = torch.randn(T, g, d, generator=gen)
    if budget == "all":
        budget = lay.max_blocks_per_seq
    return q, k, v, select_blocks(block_scores(q, k, lay), lay, budget)


def _our_token_mask(route, group):
    """``[T, T]`` bool: query token i reads key token j (our semantics, from the naive oracle)."""
    lay = route.layout
    T = lay.num_tokens
    mask = torch.zeros(T, T, dtype=torch.bool)
    for s in range(lay.num_seqs):
        t0, t1 = int(lay.cu_seqlens[s]), int(lay.cu_seqlens[s + 1])
        if t1 > t0:
            mask[t0:t1, t0:t1] = token_mask_of_sequence(route, s)[group]
    return mask


def _fa4_token_mask(cnt_full, idx_full, cnt_mask, idx_mask, head, num_sub, transposed=False):
    """``[Tp, Tp]`` bool (query, key): what FA4 computes for query head ``head`` from its forward
    tensors (rows are query blocks), or from its backward ones with ``transposed`` (rows are KV
    blocks), read one entry at a time: full blocks whole, partial blocks under the mask_mod ``q >= kv``."""
    FULL, PARTIAL = 1, 2
    kind = torch.zeros(num_sub, num_sub, dtype=torch.int8)
    for m in range(num_sub):
        for s in range(int(cnt_full[0, head, m])):
            kind[m, int(idx_full[0, head, m, s])] |= FULL
        for s in range(int(cnt_mask[0, head, m])):
            kind[m, int(idx_mask[0, head, m, s])] |= PARTIAL
    if transposed:
        kind = kind.T
    tokens = kind.repeat_interleave(FA4_BLOCK, 0).repeat_interleave(FA4_BLOCK, 1)
    pos = torch.arange(num_sub * FA4_BLOCK)
    return (tokens & FULL).bool() | ((tokens & PARTIAL).bool() & (pos[:, None] >= pos[None, :]))


def _entries(cnt, idx, head):
    """``{(row, col)}`` of one head's block-sparse tensors, each row's entries checked ascending and unique."""
    pairs = set()
    for r in range(cnt.shape[-1]):
        cols = idx[0, head, r, : int(cnt[0, head, r])].tolist()
        assert cols == sorted(set(cols)), f"row {r}: {cols} not ascending"
        pairs.update((r, c) for c in cols)
    return pairs


@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("lens", list(PACKS.values()), ids=list(PACKS))
@pytest.mark.parametrize("budget", [1, 3, "all"])
def test_plan_reads_exactly_our_mask_and_its_transpose_is_the_backward(block, lens, budget):
    hq, g = 4, 2
    _, _, _, route = _route(lens, hq, g, 8, block, budget)
    plan = fa4_block_plan(route, hq)
    lay = route.layout
    M = plan.num_sub_blocks
    assert M * FA4_BLOCK == lay.num_blocks * block
    for t in (plan.fwd_full_cnt, plan.fwd_full_idx, plan.bwd_full_cnt, plan.bwd_full_idx, plan.fwd_mask_cnt):
        assert t.dtype == torch.int32 and t.shape[:3] == (1, hq, M)
    dst = padded_positions(lay)
    dst = torch.arange(lay.num_tokens) if dst is None else dst
    pad = torch.ones(M * FA4_BLOCK, dtype=torch.bool)
    pad[dst] = False
    for h in range(hq):
        fa4 = _fa4_token_mask(plan.fwd_full_cnt, plan.fwd_full_idx, plan.fwd_mask_cnt, plan.fwd_mask_idx, h, M)
        # head h reads its KV group's selection (heads of a group contiguous)
        assert torch.equal(fa4[dst][:, dst], _our_token_mask(route, h // (hq // g)))
        assert not fa4[dst][:, pad].any(), "a real query reads a padding key"
        # the backward's per-KV-block lists are the forward's, transposed, full and partial alike
        fwd_full = _entries(plan.fwd_full_cnt, plan.fwd_full_idx, h)
        fwd_mask = _entries(plan.fwd_mask_cnt, plan.fwd_mask_idx, h)
        assert {(n, m) for m, n in fwd_full} == _entries(plan.bwd_full_cnt, plan.bwd_full_idx, h)
        assert {(n, m) for m, n in fwd_mask} == _entries(plan.bwd_mask_cnt, plan.bwd_mask_idx, h)
        assert not fwd_full & fwd_mask


def test_padding_puts_every_block_on_a_128_boundary():
    lay = _route([300, 97, 256], 2, 1, 8, 256, 1)[3].layout
    dst = padded_positions(lay)
    # blocks of 256: [0,256) [256,300) | [300,397) | [397,653) -> slots 0, 256, 512, 768
    assert dst[:256].tolist() == list(range(256))
    assert dst[256:300].tolist() == list(range(256, 300))
    assert dst[300:397].tolist() == list(range(512, 609))
    assert dst[397:].tolist() == list(range(768, 1024))
    whole = _route([256, 512], 2, 1, 8, 128, 1)[3].layout
    assert padded_positions(whole) is None  # nothing to pad: the pack goes to FA4 as it is


def _emulated_fa4(q1, k1, v1, plan, scale):
    """FA4's block-sparse call as a dense torch computation of the same semantics (for the CPU)."""
    _, Tp, HQ, D = q1.shape
    G = k1.shape[2]
    outs = []
    for h in range(HQ):
        allowed = _fa4_token_mask(plan.fwd_full_cnt, plan.fwd_full_idx, plan.fwd_mask_cnt, plan.fwd_mask_idx, h,
                                  plan.num_sub_blocks)
        s = (q1[0, :, h] @ k1[0, :, h // (HQ // G)].T) * scale
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        outs.append(p @ v1[0, :, h // (HQ // G)])
    return torch.stack(outs, 1).unsqueeze(0)


@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("lens", [[300, 97, 530, 64], [256, 128]], ids=["varlen", "whole"])
def test_wrapper_pads_calls_once_and_unpads_with_gradients(monkeypatch, block, lens):
    calls = []

    def fake(q1, k1, v1, plan, scale):
        calls.append((q1.shape, k1.shape))
        return _emulated_fa4(q1, k1, v1, plan, scale)

    monkeypatch.setattr(fa4_attention, "flash_attn_block_sparse", fake)
    q, k, v, route = _route(lens, 4, 2, 16, block, 2)
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    scale = 1.0 / math.sqrt(16)
    go = torch.randn(q.shape, dtype=torch.float64)
    out = fa4_attention.block_sparse_attention(q, k, v, route, scale)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = sparse_attention_naive(q, k, v, route, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    assert len(calls) == 1 and calls[0][0][0] == 1  # one batch-1 call
    assert calls[0][0][1] == route.layout.num_blocks * block
    assert torch.allclose(out, ref, atol=1e-5)  # the reference takes its softmax in fp32
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-5)


def _emulated_own_forward(q, k, v, route, scale):
    """Our forward kernel's ``(out, lse)`` by dense torch, lse in the kernel's base 2."""
    HQ, G = q.shape[1], k.shape[1]
    outs, lses = [], []
    for h in range(HQ):
        s = (q[:, h] @ k[:, h // (HQ // G)].T) * scale
        s = s.masked_fill(~_our_token_mask(route, h // (HQ // G)), float("-inf"))
        outs.append(torch.softmax(s, -1) @ v[:, h // (HQ // G)])
        lses.append(torch.logsumexp(s, -1) / math.log(2.0))
    return torch.stack(outs, 1), torch.stack(lses, 1)


def _emulated_fa4_backward(q1, k1, v1, o1, do1, lse1, plan, scale):
    """FA4's backward as dense torch: P recomputed from ``lse1`` (natural log), the block sets read
    from the plan's transposed (per-KV-block) tensors alone."""
    assert plan.fwd_full_cnt is None, "the backward-only plan carries no forward tensors"
    _, Tp, HQ, D = q1.shape
    G = k1.shape[2]
    dq, dk, dv = (torch.zeros_like(x) for x in (q1, k1, v1))
    for h in range(HQ):
        g = h // (HQ // G)
        allowed = _fa4_token_mask(plan.bwd_full_cnt, plan.bwd_full_idx, plan.bwd_mask_cnt, plan.bwd_mask_idx, h,
                                  plan.num_sub_blocks, transposed=True)
        qh, doh, kg, vg = q1[0, :, h], do1[0, :, h], k1[0, :, g], v1[0, :, g]
        p = torch.exp(qh @ kg.T * scale - lse1[0, h, :, None]).masked_fill(~allowed, 0.0)
        ds = p * (doh @ vg.T - (doh * o1[0, :, h]).sum(-1, keepdim=True))
        dq[0, :, h] = ds @ kg * scale
        dk[0, :, g] += ds.T @ qh * scale
        dv[0, :, g] += p.T @ doh
    return dq, dk, dv


@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("lens", [[300, 97, 530, 64], [256, 128]], ids=["varlen", "whole"])
def test_own_forward_and_fa4_backward_match_the_reference(monkeypatch, block, lens):
    """On Hopper fa4's forward is our kernel and its backward FA4's: the lse crosses from base 2 to
    base e, the pack is padded for the backward alone, and the gradients are the reference's."""
    calls = []

    def fake_backward(q1, k1, v1, o1, do1, lse1, plan, scale):
        calls.append((q1.shape, lse1.shape))
        return _emulated_fa4_backward(q1, k1, v1, o1, do1, lse1, plan, scale)

    monkeypatch.setattr(fa4_attention, "own_forward", _emulated_own_forward)
    monkeypatch.setattr(fa4_attention, "flash_attn_block_sparse_backward", fake_backward)
    monkeypatch.setattr(fa4_attention, "flash_attn_block_sparse", None)  # FA4's forward is not called
    q, k, v, route = _route(lens, 4, 2, 16, block, 2)
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    assert not fa4_attention.own_forward_runs_on(q)  # by default only on Hopper: forced here
    scale = 1.0 / math.sqrt(16)
    go = torch.randn(q.shape, dtype=torch.float64)
    out = fa4_attention.block_sparse_attention(q, k, v, route, scale, own_forward_kernel=True)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = sparse_attention_naive(q, k, v, route, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    Tp = route.layout.num_blocks * block
    assert calls == [(torch.Size([1, Tp, 4, 16]), torch.Size([1, 4, Tp]))]
    assert torch.allclose(out, ref, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-5)


def test_block_64_and_deterministic_mode_are_refused_by_name():
    with pytest.raises(ValueError, match="--moba-block-size"):
        fa4_block_plan(_route([200], 2, 1, 8, 64, 2)[3], 2)
    with pytest.raises(ValueError, match="--moba-block-size"):
        SparseAttentionConfig(sparse_attn_impl="fa4", moba_block_size=64).validate()
    with pytest.raises(ValueError, match="--deterministic-mode"):
        SparseAttentionConfig(sparse_attn_impl="fa4", deterministic_mode=True).validate()
    with pytest.raises(ValueError, match="not deterministic"):
        resolve_impl("fa4", "cpu", deterministic=True)
    SparseAttentionConfig(sparse_attn_impl="fa4").validate()
    SparseAttentionConfig(sparse_attn_impl="auto", deterministic_mode=True, moba_block_size=64).validate()
    check_request("cuda", deterministic=True)


def test_fa4_requested_where_it_cannot_run_says_why():
    assert "CUDA device" in unavailable_reason("fa4", torch.device("cpu"))
    assert "--moba-block-size" in unavailable_reason("fa4", torch.device("cpu"), block_size=64)
    with pytest.raises(ValueError, match="--sparse-attn-impl=fa4 is not available: flash-attn-4 needs a CUDA"):
        resolve_impl("fa4", "cpu")


def test_import_error_names_the_missing_package(monkeypatch):
    def broken():
        raise ModuleNotFoundError("No module named 'cutlass'")

    monkeypatch.setattr(fa4_attention, "_fa4", broken)
    reason = fa4_attention.import_error()
    assert "flash-attn-4" in reason and "cutlass" in reason and "dsl_packages" in reason


TABLE = {"GPU X": {"order": ["fa4", "cuda", "triton"]}, "GPU Y": {"order": ["cuda", "triton"]}}


def test_auto_follows_the_measured_order_and_deterministic_mode_drops_fa4():
    builtin = ("cuda", "triton", "torch")
    assert order_from_table(TABLE, "GPU X", builtin) == ("fa4", "cuda", "triton", "torch")
    det = order_from_table(TABLE, "GPU X", builtin, deterministic=True)
    assert det == ("cuda", "triton", "torch") and not NON_DETERMINISTIC & set(det)
    assert order_from_table(TABLE, "unmeasured GPU", ("triton", "cuda", "torch")) == ("triton", "cuda", "torch")
    # the extension lacks the kernels cuda was measured with: it goes behind triton
    assert order_from_table(TABLE, "GPU Y", builtin, cuda_as_measured=False) == ("triton", "cuda", "torch")
    # ... also where triton was not measured there (an H100 measured against fa4 alone)
    assert order_from_table({"H": {"order": ["cuda", "fa4"]}}, "H", ("triton", "cuda", "torch"),
                            cuda_as_measured=False) == ("fa4", "triton", "cuda", "torch")


def test_auto_never_resolves_to_fa4_in_deterministic_mode_on_the_cpu():
    assert resolve_impl("auto", "cpu", deterministic=True) == "torch"
    assert resolve_impl("auto", "cpu", deterministic=False, block_size=64) == "torch"


def _row(impl, density, ms, seq=32768):
    return dict(impl=impl, shape="qwen2.5-3b", seq=seq, density=density, ms=ms)


def test_measured_order_ranks_by_geometric_mean_and_leaves_out_incomplete_implementations():
    result = dict(rows=[
        _row("cuda", 0.1, 2.0), _row("cuda", 0.25, 8.0),          # geomean 4
        _row("fa4_backend", 0.1, 1.0), _row("fa4_backend", 0.25, 9.0),  # geomean 3
        _row("triton", 0.1, 1.0), _row("triton", 0.25, None),     # failed one case: not ranked
        _row("fa4", 0.1, 0.5), _row("fa4", 0.25, 0.5),            # FA4 direct: an anchor, not ours
        _row("cudnn_dense", 1.0, 0.1),
    ])
    entry = measured_entry(result)
    assert entry["order"] == ["fa4", "cuda"]
    assert entry["geomean_ms"] == {"fa4": 3.0, "cuda": 4.0} and entry["cases"] == 2


def test_one_sequence_plan_is_the_flex_block_mask_the_benchmark_gives_fa4_directly():
    """The benchmark's ``fa4`` row calls FA4 with the BlockMask's own tensors (its KV-direction
    ones forward, its transposed Q-direction ones backward); ``fa4_backend`` with our plan. On one
    sequence of whole blocks they must be the same block sets, head by head."""
    from benchmarks.attention import flex_block_mask

    hq, S = 4, 1024
    _, _, _, route = _route([S], hq, 2, 8, 128, 3)
    plan = fa4_block_plan(route, hq)
    bm = flex_block_mask(route, hq, S)
    for h in range(hq):
        pairs = [(bm.full_kv_num_blocks, bm.full_kv_indices, plan.fwd_full_cnt, plan.fwd_full_idx),
                 (bm.kv_num_blocks, bm.kv_indices, plan.fwd_mask_cnt, plan.fwd_mask_idx),
                 (bm.full_q_num_blocks, bm.full_q_indices, plan.bwd_full_cnt, plan.bwd_full_idx),
                 (bm.q_num_blocks, bm.q_indices, plan.bwd_mask_cnt, plan.bwd_mask_idx)]
        for flex_cnt, flex_idx, our_cnt, our_idx in pairs:
            assert _entries(flex_cnt.int(), flex_idx.int(), h) == _entries(our_cnt, our_idx, h)
