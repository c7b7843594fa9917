"""The MoBA router's block pooling on the GPU (Triton), for :func:`block_scores_triton`.

The torch router (``router.py``) pools with an fp32 copy of q and an ``index_add`` over every
token; at S = 32K that costs about 10% of a sparse forward+backward. Here one program per
(block, group) reads the block's rows once in their own dtype and sums in fp32, so pooling is a
single pass at memory bandwidth. Scores and selection reuse the torch router (they are
``[G, NB, NB]``, small), so the selection rule (ties to the lower block) is unchanged.

Shape legend: T tokens, H heads, G groups, R = H // G, D head dim, NB blocks.
"""
from __future__ import annotations

import math

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
    G = k.shape[1]
    with torch.no_grad():
        pq = pool_blocks_triton(q, layout, G)
        pk = pool_blocks_triton(k, layout, G)
        scores = torch.einsum("igd,jgd->gij", pq, pk) / math.sqrt(q.shape[-1])
        return torch.where(layout.candidates, scores, float("-inf"))
