"""The MoBA router on the GPU (Triton): pooling, then selection and coverage in one launch.

The torch router (``router.py``) is the oracle: about sixty small operations per layer (an fp32
copy of q, an ``index_add`` over every token, a candidate mask, two sorts, a softmax, a top-k,
cumulative sums, gathers). On a GPU each one is a kernel launch, so for short packs the router
cost the host more time than the attention cost the GPU. Here:

* :func:`pool_blocks_triton`: one program per (block, group) reads the block's rows once in
  their own dtype and sums in fp32, a single pass at memory bandwidth;
* :func:`pooled_dots`: the block-pair dot products, one batched GEMM (``[G, NB, NB]``, small);
* :func:`select_and_cover`: one program per (query block, group) ranks the row's candidates
  (the earlier blocks of its sequence), writes the selection in the layout the attention
  kernels read, and the row's coverage curve; the curve is the mean of the rows.

Same rules as the torch router: ties in score go to the lower block, the diagonal block is
always kept and comes last, ``C(k)`` is the softmax mass of the top ``k - 1`` candidates.

Shape legend: T tokens, H heads, G groups, R = H // G, D head dim, NB blocks.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from megatron_sparsebalance.ops.layout import BlockLayout


@triton.jit
def _pool_kernel(X, OUT, BSTART, BEND, R: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    t0 = tl.load(BSTART + b)
    nrows = (tl.load(BEND + b) - t0) * R
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_ROWS, D], tl.float32)
    for r0 in range(0, nrows, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        off = (t0 + rows // R).to(tl.int64) * (H * D) + (g * R + rows % R) * D
        acc += tl.load(X + off[:, None] + offs_d[None, :], mask=(rows < nrows)[:, None], other=0.0).to(tl.float32)
    tl.store(OUT + (b * G + g) * D + offs_d, tl.sum(acc, 0) / nrows.to(tl.float32))


def pool_blocks_triton(x: torch.Tensor, layout: BlockLayout, num_groups: int) -> torch.Tensor:
    """Mean of ``x [T, H, D]`` over each block's tokens and each group's heads: ``[NB, G, D]`` fp32."""
    T, H, D = x.shape
    x = x.contiguous()
    out = torch.empty(layout.num_blocks, num_groups, D, dtype=torch.float32, device=x.device)
    if layout.num_blocks:
        _pool_kernel[(layout.num_blocks, num_groups)](
            x, out, layout.block_start, layout.block_end, R=H // num_groups, H=H, G=num_groups, D=D,
            BLOCK_ROWS=max(16, 4096 // D), num_warps=4)
    return out


def block_scores_triton(q: torch.Tensor, k: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Same as :func:`megatron_sparsebalance.ops.router.block_scores` (up to fp32 summation order).

    Args:
        q: ``[T, HQ, D]``; k: ``[T, G, D]``; D a power of two.
    Returns:
        ``[G, NB, NB]`` float32, ``-inf`` where ``j`` is not a candidate of ``i``.
    """
    scores = pooled_dots(q, k, layout) / math.sqrt(q.shape[-1])
    return torch.where(layout.candidates, scores, float("-inf"))


def pooled_dots(q: torch.Tensor, k: torch.Tensor, layout: BlockLayout, pooled_query=None) -> torch.Tensor:
    """``pooled_q(i, g) . pooled_k(j, g)`` for every block pair: ``[G, NB, NB]`` fp32, unscaled and unmasked.

    The input of :func:`select_and_cover`, which scales it and keeps each row's candidates itself.
    ``pooled_query`` maps the pooled queries ``[NB, G, D]`` first (tensor parallelism:
    ``ops.sparse_attention.RouteSync``).
    """
    G = k.shape[1]
    with torch.no_grad():
        pq = pool_blocks_triton(q, layout, G)
        if pooled_query is not None:
            pq = pooled_query(pq)
        pk = pool_blocks_triton(k, layout, G)
        return torch.einsum("igd,jgd->gij", pq, pk)


# DST changes budgets every global batch and packs change their longest sequence, so every
# launch argument that follows them would compile a new kernel variant in the middle of a
# training step (hundreds of ms, in whichever micro-batch first meets it): the vector widths are
# floored so that one variant serves sequences up to MIN_CANDIDATE_WIDTH blocks and budgets up to
# MIN_BUDGET_WIDTH, and the integer arguments are not specialized on their values. A wider
# vector costs nothing measurable: the loop runs over a row's candidates, not over the width.
MIN_CANDIDATE_WIDTH = 512  # 64K tokens in blocks of 128
MIN_BUDGET_WIDTH = 128  # DST's largest default budget candidate


@triton.jit(do_not_specialize=["NB", "K", "nsteps", "budget_scalar", "curve_len"])
def _select_cover_kernel(
    DOTS, BLOCK_POS, BLOCK_SEQ, BUDGET, KV_IDX, KV_CNT, COVER_ROWS,
    NB, K, nsteps, budget_scalar, curve_len, scale,
    WP: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr,
    BUDGET_MODE: tl.constexpr, SELECT: tl.constexpr, COVER: tl.constexpr,
):
    """One program per (query block i, group g): rank the row's candidates, select, and cover.

    Candidates of block ``i`` are the ``pos = BLOCK_POS[i]`` blocks before it in its sequence,
    ``first .. i-1``. They are ranked by repeated argmax (ties to the lower block, the torch
    router's rule); ``nsteps`` ranks are enough for the widest budget and the coverage curve.
    """
    i = tl.program_id(0)
    g = tl.program_id(1)
    row = g * NB + i
    pos = tl.load(BLOCK_POS + i).to(tl.int32)
    first = i - pos
    offs = tl.arange(0, WP)
    is_cand = offs < pos
    s = tl.load(DOTS + row.to(tl.int64) * NB + first + offs, mask=is_cand, other=float("-inf")) * scale
    rank = tl.full([WP], 1 << 30, tl.int32)
    if COVER:
        probs = tl.where(is_cand, tl.exp(s - tl.max(s, 0)), 0.0)
        probs = probs / tl.maximum(tl.sum(probs, 0), 1e-30)
        k_of = tl.arange(0, CP) + 1  # the budget k of each curve entry
        cover = tl.zeros([CP], tl.float32)
        mass = 0.0
    work = s
    for t in range(0, tl.minimum(nsteps, pos)):
        j = tl.argmax(work, 0, tie_break_left=True)
        hit = offs == j
        rank = tl.where(hit, t, rank)
        work = tl.where(hit, float("-inf"), work)
        if COVER:
            mass += tl.sum(tl.where(hit, probs, 0.0), 0)
            cover = tl.where(k_of == t + 2, mass, cover)  # C(k) keeps k - 1 candidates
    if COVER:
        # a budget past the row's candidates keeps all its mass; rows without candidates count 0
        # (the caller averages over the rows that have some)
        cover = tl.where(k_of - 1 >= pos, 1.0, cover)
        cover = tl.where(k_of == 1, 0.0, cover)
        cover = tl.where(pos > 0, cover, 0.0)
        tl.store(COVER_ROWS + row.to(tl.int64) * curve_len + k_of - 1, cover, mask=k_of <= curve_len)
    if SELECT:
        if BUDGET_MODE == 0:
            budget = budget_scalar
        elif BUDGET_MODE == 1:
            budget = tl.load(BUDGET).to(tl.int32)
        else:
            budget = tl.load(BUDGET + tl.load(BLOCK_SEQ + i)).to(tl.int32)
        keep = rank < budget - 1
        slot = tl.cumsum(keep.to(tl.int32), 0) - 1  # ascending block order
        base = KV_IDX + row.to(tl.int64) * K
        tl.store(base + slot, first + offs, mask=keep)
        cnt = tl.sum(keep.to(tl.int32), 0) + 1
        tl.store(base + cnt - 1, i)  # the diagonal block, last
        k_slot = tl.arange(0, KP)
        tl.store(base + k_slot, tl.full([KP], -1, tl.int32), mask=(k_slot >= cnt) & (k_slot < K))
        tl.store(KV_CNT + row, cnt)


def select_and_cover(
    dots: torch.Tensor,
    layout: BlockLayout,
    scale: float,
    budget=None,
    width: int = 1,
    curve_len: int = 0,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Selection and coverage curve of the router in one launch (``router.select_blocks`` and
    ``router.coverage_curve`` on the scores ``dots * scale``, same results).

    Args:
        dots: ``[G, NB, NB]`` from :func:`pooled_dots`.
        budget: per-sequence budget: a host int, a 0-dim device tensor, or an ``[N]`` device
            tensor; None: no selection (coverage only).
        width: ``kv_idx``'s width, an upper bound of the budgets.
        curve_len: entries of the coverage curve ``C(1..curve_len)``; 0: no curve.
    Returns:
        ``(kv_idx [G, NB, width] int32, kv_cnt [G, NB] int32, curve [curve_len] fp32)``, each None
        when not asked for.
    """
    G, NB, _ = dots.shape
    device = dots.device
    width = max(1, min(int(width), layout.max_blocks_per_seq))
    select, cover = budget is not None, curve_len > 0
    kv_idx = kv_cnt = rows = curve = None
    if select:
        kv_idx = torch.empty(G, NB, width, dtype=torch.int32, device=device)
        kv_cnt = torch.empty(G, NB, dtype=torch.int32, device=device)
    if cover:
        rows = torch.empty(G * NB, curve_len, dtype=torch.float32, device=device)
    if isinstance(budget, torch.Tensor):
        mode, budget_scalar, budget_ptr = (1 if budget.numel() == 1 else 2), 0, budget.reshape(-1)
    else:
        mode, budget_scalar, budget_ptr = 0, int(budget or 1), layout.block_pos  # pointer unused
    if NB:
        nsteps = max(width if select else 1, curve_len) - 1
        _select_cover_kernel[(NB, G)](
            dots, layout.block_pos, layout.block_seq, budget_ptr,
            kv_idx if select else dots, kv_cnt if select else dots, rows if cover else dots,
            NB, width, nsteps, budget_scalar, max(curve_len, 1), float(scale),
            WP=triton.next_power_of_2(max(MIN_CANDIDATE_WIDTH, layout.max_blocks_per_seq)),
            KP=triton.next_power_of_2(max(MIN_BUDGET_WIDTH, width)),
            CP=triton.next_power_of_2(max(2, curve_len)), BUDGET_MODE=mode, SELECT=select, COVER=cover,
            num_warps=4,
        )
    if cover:
        # rows without candidates (first blocks) hold no information: the mean is over the others
        n_valid = G * layout.rows_with_candidates
        curve = rows.sum(0) * (1.0 / n_valid) if n_valid else torch.ones(curve_len, device=device)
    return kv_idx, kv_cnt, curve
