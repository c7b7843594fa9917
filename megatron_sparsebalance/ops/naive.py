"""Naive reference of block-sparse causal attention.

The oracle of every kernel test: a masked dense computation per sequence, differentiable by
autograd. It materializes a ``[G, L, L]`` mask per sequence, so it is for tests and small
CPU runs only; the Triton and CUDA kernels never build anything of size O(S^2).

Shape legend: T tokens, HQ query heads, G KV-head groups, D head dim, L tokens of one sequence.
"""
from __future__ import annotations

import torch

from megatron_sparsebalance.ops.router import BlockRoute


def block_mask_of_sequence(route: BlockRoute, seq: int) -> torch.Tensor:
    """``[G, nb, nb]`` bool: KV block ``j`` selected by query block ``i`` of sequence ``seq``."""
    lay = route.layout
    b0, b1 = int(lay.cu_blocks[seq]), int(lay.cu_blocks[seq + 1])
    nb = b1 - b0
    G = route.num_groups
    kv = route.kv_idx[:, b0:b1].long()  # [G, nb, K]
    valid = kv >= 0
    local = torch.where(valid, kv - b0, torch.full_like(kv, nb))  # invalid -> a spill column
    mask = torch.zeros(G, nb, nb + 1, dtype=torch.bool, device=kv.device)
    mask.scatter_(-1, local, valid)
    return mask[..., :nb]


def token_mask_of_sequence(route: BlockRoute, seq: int) -> torch.Tensor:
    """``[G, L, L]`` bool: query token ``i`` of sequence ``seq`` reads its key token ``j`` (the
    selected blocks, token by token, under the causal rule)."""
    lay = route.layout
    B = lay.block_size
    L = int(lay.cu_seqlens[seq + 1]) - int(lay.cu_seqlens[seq])
    tmask = block_mask_of_sequence(route, seq).repeat_interleave(B, 1).repeat_interleave(B, 2)[:, :L, :L]
    return tmask & torch.ones(L, L, dtype=torch.bool, device=tmask.device).tril()


def sparse_attention_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: BlockRoute, softmax_scale: float,
    upcast: bool = False,
) -> torch.Tensor:
    """Block-sparse causal attention by masking dense scores.

    Args:
        q: ``[T, HQ, D]``; k, v: ``[T, G, D]``; route: selection for the same pack.
        upcast: compute in float32 (the fp32 reference of the kernel tests) and return float32.
    Returns:
        ``[T, HQ, D]``.
    """
    lay = route.layout
    HQ, G = q.shape[1], k.shape[1]
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    outs = []
    for s in range(lay.num_seqs):
        t0, t1 = int(lay.cu_seqlens[s]), int(lay.cu_seqlens[s + 1])
        if t1 == t0:
            continue
        allowed = token_mask_of_sequence(route, s).repeat_interleave(HQ // G, 0)  # [HQ, L, L]
        qs = q[t0:t1].transpose(0, 1)  # [HQ, L, D]
        ks = k[t0:t1].transpose(0, 1).repeat_interleave(HQ // G, 0)
        vs = v[t0:t1].transpose(0, 1).repeat_interleave(HQ // G, 0)
        att = torch.matmul(qs, ks.transpose(1, 2)) * softmax_scale
        att = att.masked_fill(~allowed, float("-inf"))
        att = torch.softmax(att.float(), dim=-1).to(qs.dtype)
        outs.append(torch.matmul(att, vs).transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, 0)
