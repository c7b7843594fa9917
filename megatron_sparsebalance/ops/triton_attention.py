"""Block-sparse causal attention in Triton: forward and backward (FlashAttention-2 style).

Owns the Triton implementation of DESIGN.md §2. The selection comes in as a
:class:`~megatron_sparsebalance.ops.router.BlockRoute`; the kernels read its ``kv_idx`` /
``kv_cnt`` and the block offsets of its layout, so nothing of size O(S^2) is ever built.

Kernel structure (why it looks like this):

* **GQA packing.** The rows of a tile are (token, head) pairs of ONE KV-head group, token-major:
  row ``r`` of a query block is token ``r // R``, query head ``g*R + r % R`` with ``R = HQ / G``.
  The group's heads share the selection, so every K/V tile a program loads serves all of its
  heads; ``R`` needs no power of two (Qwen2.5-0.5B has R = 7) and no row is padding except at the
  end of a partial block. A query block of ``B`` tokens is ``B*R`` rows, cut into sub-tiles.
* **No masks off the diagonal.** A selected block ``j < i`` is always full (only the last block of
  a sequence can be partial, and it is nobody's earlier block), so the main loops are mask-free;
  only the diagonal block (always the last ``kv_idx`` entry, always the first transposed entry)
  runs a causal mask. The diagonal loop also stops at the last token of the tile, skipping the
  upper triangle.
* **Backward without atomics** (deterministic by construction): one dK/dV program per
  (KV sub-tile, group) walks the transposed CSR index (query blocks that selected the block), and
  one dQ program per (query sub-tile, group) walks ``kv_idx``, recomputing P from the saved LSE.
  The transposed index is built on the GPU by a stable sort, with no host synchronisation.

Shape legend: T tokens, HQ query heads, G KV-head groups, R = HQ // G, D head dim,
NB blocks in the pack, K the largest budget. LSE and delta are ``[T, HQ]`` float32; the LSE is
kept in base 2 of the pre-scaled scores (``log2 sum 2^(s * scale * log2 e)``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from megatron_sparsebalance.ops.cuda_attention import transpose_index_gpu  # noqa: F401  (shared with the CUDA backward)
from megatron_sparsebalance.ops.registration import register_attention
from megatron_sparsebalance.ops.router import BlockRoute

LOG2E = 1.4426950408889634

# Tile choices per (kernel, head dim); the benchmark may overwrite them after a sweep. Each is
# (BLOCK_M rows, BLOCK_N keys, num_warps, num_stages); BLOCK_N is clamped to the block size.
# The dK/dV tiles fit two programs on an SM (4 warps, 2 stages). Triton waits for each of the
# kernel's four dependent products before the work that needs it, so one program leaves its
# tensor cores idle through its softmax work and a second program fills those gaps: at 3B, 32K
# 1.13-1.16x faster than the 8-warp tile (one program per SM); at 0.5B twice the rows per step
# while still two programs, 1.34-1.38x (docs/HISTORY.md, "How the CUDA kernels got here").
CONFIGS = {  # picked on an H200 at S=32K, density 25% (benchmarks/attention.py --tune)
    ("fwd", 64): (64, 64, 4, 3),
    ("fwd", 128): (128, 64, 4, 2),
    ("dq", 64): (64, 64, 4, 3),
    ("dq", 128): (128, 128, 8, 2),
    ("dkdv", 64): (128, 64, 4, 2),
    ("dkdv", 128): (64, 64, 4, 2),
}


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, KV_IDX, KV_CNT, BSTART, BEND,
    qk_scale, NB, KMAX,
    R: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, TPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    qb = pid // TPB
    row0 = (pid % TPB) * BLOCK_M
    q0 = tl.load(BSTART + qb)
    qlen = tl.load(BEND + qb) - q0
    nrows = qlen * R
    if row0 < nrows:
        rows = row0 + tl.arange(0, BLOCK_M)
        tok = rows // R
        head = g * R + rows % R
        rmask = rows < nrows
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        q_off = (q0 + tok).to(tl.int64) * (HQ * D) + head * D
        q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        cnt = tl.load(KV_CNT + g * NB + qb)
        idx_base = KV_IDX + (g * NB + qb).to(tl.int64) * KMAX
        NSUB: tl.constexpr = BLOCK // BLOCK_N
        # Earlier selected blocks: full, fully visible, no mask.
        for it in range(0, (cnt - 1) * NSUB):
            kb = tl.load(idx_base + it // NSUB)
            k0 = tl.load(BSTART + kb) + (it % NSUB) * BLOCK_N
            kv_off = (k0 + offs_n).to(tl.int64) * (G * D) + g * D
            k = tl.load(K + kv_off[:, None] + offs_d[None, :])
            v = tl.load(V + kv_off[:, None] + offs_d[None, :])
            s = tl.dot(q, tl.trans(k)) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # Diagonal block: causal, possibly partial; keys past the tile's last token are skipped.
        tok_hi = (tl.minimum(row0 + BLOCK_M, nrows) - 1) // R
        for n0 in range(0, tok_hi + 1, BLOCK_N):
            kt = n0 + offs_n
            kmask = kt < qlen
            kv_off = (q0 + kt).to(tl.int64) * (G * D) + g * D
            k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
            v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where((kt[None, :] <= tok[:, None]) & kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(O + q_off[:, None] + offs_d[None, :], acc.to(O.dtype.element_ty), mask=rmask[:, None])
        lse_off = (q0 + tok).to(tl.int64) * HQ + head
        tl.store(LSE + lse_off, m_i + tl.log2(l_i), mask=rmask)


@triton.jit
def _delta_kernel(O, DO, DELTA, NROWS, D: tl.constexpr, BLOCK_R: tl.constexpr):
    # delta[t, h] = sum_d o * do: the row term of dS = P * (dP - delta).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < NROWS
    offs = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(O + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=rmask)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, KV_IDX, KV_CNT, BSTART, BEND,
    qk_scale, sm_scale, NB, KMAX,
    R: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, TPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    qb = pid // TPB
    row0 = (pid % TPB) * BLOCK_M
    q0 = tl.load(BSTART + qb)
    qlen = tl.load(BEND + qb) - q0
    nrows = qlen * R
    if row0 < nrows:
        rows = row0 + tl.arange(0, BLOCK_M)
        tok = rows // R
        head = g * R + rows % R
        rmask = rows < nrows
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        q_off = (q0 + tok).to(tl.int64) * (HQ * D) + head * D
        q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
        do = tl.load(DO + q_off[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
        lse_off = (q0 + tok).to(tl.int64) * HQ + head
        lse = tl.load(LSE + lse_off, mask=rmask, other=0.0)
        delta = tl.load(DELTA + lse_off, mask=rmask, other=0.0)
        dq = tl.zeros([BLOCK_M, D], tl.float32)
        cnt = tl.load(KV_CNT + g * NB + qb)
        idx_base = KV_IDX + (g * NB + qb).to(tl.int64) * KMAX
        NSUB: tl.constexpr = BLOCK // BLOCK_N
        for it in range(0, (cnt - 1) * NSUB):
            kb = tl.load(idx_base + it // NSUB)
            k0 = tl.load(BSTART + kb) + (it % NSUB) * BLOCK_N
            kv_off = (k0 + offs_n).to(tl.int64) * (G * D) + g * D
            k = tl.load(K + kv_off[:, None] + offs_d[None, :])
            v = tl.load(V + kv_off[:, None] + offs_d[None, :])
            p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        tok_hi = (tl.minimum(row0 + BLOCK_M, nrows) - 1) // R
        for n0 in range(0, tok_hi + 1, BLOCK_N):
            kt = n0 + offs_n
            kmask = kt < qlen
            kv_off = (q0 + kt).to(tl.int64) * (G * D) + g * D
            k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
            v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where((kt[None, :] <= tok[:, None]) & kmask[None, :], s, float("-inf"))
            p = tl.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        dq = dq * sm_scale
        tl.store(DQ + q_off[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, Q_PTR, Q_IDX, BSTART, BEND,
    qk_scale, sm_scale, NB,
    R: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, KSUB: tl.constexpr, NSUBQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    kb = pid // KSUB
    n0 = (pid % KSUB) * BLOCK_N
    b0 = tl.load(BSTART + kb)
    blen = tl.load(BEND + kb) - b0
    if n0 < blen:
        offs_d = tl.arange(0, D)
        offs_m = tl.arange(0, BLOCK_M)
        kt = n0 + tl.arange(0, BLOCK_N)
        kmask = kt < blen
        kv_off = (b0 + kt).to(tl.int64) * (G * D) + g * D
        k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        # Diagonal block first (it is the first query block of the transposed list): causal.
        # Rows whose token precedes this key sub-tile see none of it and are skipped.
        nrows = blen * R
        for r0 in range((n0 * R) // BLOCK_M * BLOCK_M, nrows, BLOCK_M):
            rows = r0 + offs_m
            tok = rows // R
            rmask = rows < nrows
            q_off = (b0 + tok).to(tl.int64) * (HQ * D) + (g * R + rows % R) * D
            q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
            do = tl.load(DO + q_off[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
            lse_off = (b0 + tok).to(tl.int64) * HQ + g * R + rows % R
            lse = tl.load(LSE + lse_off, mask=rmask, other=float("inf"))
            delta = tl.load(DELTA + lse_off, mask=rmask, other=0.0)
            sT = tl.dot(k, tl.trans(q)) * qk_scale
            sT = tl.where((kt[:, None] <= tok[None, :]) & rmask[None, :], sT, float("-inf"))
            pT = tl.exp2(sT - lse[None, :])
            dv += tl.dot(pT.to(do.dtype), do)
            dpT = tl.dot(v, tl.trans(do))
            dsT = pT * (dpT - delta[None, :])
            dk += tl.dot(dsT.to(q.dtype), q)
        # Later query blocks that selected this block: the block is fully visible to them; only
        # the rows past a partial (last-of-sequence) query block are masked. The list is walked
        # from its end: every resident program then starts at the last query blocks of the
        # sequence and moves down at about the same pace, so programs that share a query block
        # read it at about the same time and mostly from L2 (hit rate 24% -> 44% at 3B, 32K, 25%).
        p0 = tl.load(Q_PTR + g * NB + kb)
        nq = tl.load(Q_PTR + g * NB + kb + 1) - p0
        for it in range(0, (nq - 1) * NSUBQ):
            qb = tl.load(Q_IDX + p0 + nq - 1 - it // NSUBQ)
            q0 = tl.load(BSTART + qb)
            qrows = (tl.load(BEND + qb) - q0) * R
            rows = (it % NSUBQ) * BLOCK_M + offs_m
            tok = rows // R
            rmask = rows < qrows
            q_off = (q0 + tok).to(tl.int64) * (HQ * D) + (g * R + rows % R) * D
            q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
            do = tl.load(DO + q_off[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)
            lse_off = (q0 + tok).to(tl.int64) * HQ + g * R + rows % R
            lse = tl.load(LSE + lse_off, mask=rmask, other=float("inf"))
            delta = tl.load(DELTA + lse_off, mask=rmask, other=0.0)
            pT = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
            dv += tl.dot(pT.to(do.dtype), do)
            dpT = tl.dot(v, tl.trans(do))
            dsT = pT * (dpT - delta[None, :])
            dk += tl.dot(dsT.to(q.dtype), q)
        dk = dk * sm_scale
        tl.store(DK + kv_off[:, None] + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kmask[:, None])
        tl.store(DV + kv_off[:, None] + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kmask[:, None])


def _tile(kind: str, D: int, block: int) -> tuple[int, int, int, int]:
    bm, bn, warps, stages = CONFIGS[(kind, D)]
    return bm, min(bn, block), warps, stages


def _check(q, k, v, block_size):
    if q.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q [T, HQ, D], k/v [T, G, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"HQ={q.shape[1]} is not a multiple of G={k.shape[1]}")
    if q.shape[2] not in (64, 128):
        raise ValueError(f"the Triton kernels support head dim 64 and 128, got {q.shape[2]}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"the Triton kernels take bf16 or fp16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    if block_size not in (64, 128, 256):
        raise ValueError(f"block size must be 64, 128 or 256, got {block_size}")


def _forward(q, k, v, kv_idx, kv_cnt, bstart, bend, scale: float, block_size: int):
    T, HQ, D = q.shape
    G = k.shape[1]
    R = HQ // G
    NB = bstart.numel()
    out = torch.empty_like(q)
    lse = torch.empty(T, HQ, dtype=torch.float32, device=q.device)
    if T == 0 or NB == 0:
        return out, lse
    bm, bn, warps, stages = _tile("fwd", D, block_size)
    tpb = triton.cdiv(block_size * R, bm)
    _fwd_kernel[(NB * tpb, G)](
        q, k, v, out, lse, kv_idx, kv_cnt, bstart, bend,
        scale * LOG2E, NB, kv_idx.shape[-1],
        R=R, HQ=HQ, G=G, D=D, BLOCK=block_size, TPB=tpb, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages,
    )
    return out, lse


def _backward(do, q, k, v, out, lse, kv_idx, kv_cnt, bstart, bend, scale: float, block_size: int):
    T, HQ, D = q.shape
    G = k.shape[1]
    R = HQ // G
    NB = bstart.numel()
    if T == 0 or NB == 0:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    do = do.contiguous()  # autograd may hand over a strided gradient; the kernels index it densely
    delta = torch.empty(T, HQ, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(T * HQ, 64),)](out, do, delta, T * HQ, D=D, BLOCK_R=64, num_warps=4)
    # The transposed index lives only through the dK/dV kernel: its sort temporaries are freed
    # before any gradient is allocated, and the index itself before dQ is, so the backward's
    # peak is the three gradients and delta, as in FlexAttention (whose index comes with its
    # BlockMask, built before the step).
    q_ptr, q_idx = transpose_index_gpu(kv_idx, kv_cnt)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    bm, bn, warps, stages = _tile("dkdv", D, block_size)
    ksub = block_size // bn
    _dkdv_kernel[(NB * ksub, G)](
        q, k, v, do, dk, dv, lse, delta, q_ptr, q_idx, bstart, bend,
        scale * LOG2E, scale, NB,
        R=R, HQ=HQ, G=G, D=D, BLOCK=block_size, KSUB=ksub, NSUBQ=triton.cdiv(block_size * R, bm),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
    )
    del q_ptr, q_idx
    dq = torch.empty_like(q)
    bm, bn, warps, stages = _tile("dq", D, block_size)
    tpb = triton.cdiv(block_size * R, bm)
    _dq_kernel[(NB * tpb, G)](
        q, k, v, do, dq, lse, delta, kv_idx, kv_cnt, bstart, bend,
        scale * LOG2E, scale, NB, kv_idx.shape[-1],
        R=R, HQ=HQ, G=G, D=D, BLOCK=block_size, TPB=tpb, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages,
    )
    return dq, dk, dv


# torch.library ops (traced by torch.compile) and the eager autograd path, see registration.py
triton_attention = register_attention("triton", _forward, _backward)
triton_attn_fwd, triton_attn_bwd = triton_attention.forward_op, triton_attention.backward_op


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: BlockRoute, softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Block-sparse causal attention (Triton).

    Args:
        q: ``[T, HQ, D]`` bf16/fp16, D in {64, 128}; k, v: ``[T, G, D]``, ``HQ % G == 0``.
        route: the selection (``kv_idx [G, NB, K]``, diagonal block last in each row).
        softmax_scale: defaults to ``1/sqrt(D)``.
    Returns:
        ``[T, HQ, D]``, differentiable with respect to q, k and v.
    """
    lay = route.layout
    _check(q, k, v, lay.block_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    return triton_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), route.kv_idx.contiguous(), route.kv_cnt.contiguous(),
        lay.block_start, lay.block_end, float(softmax_scale), int(lay.block_size),
    )
