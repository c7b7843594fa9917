"""Naive reference of block-sparse causal attention and of dense causal attention.

The oracle of every kernel test: a masked dense computation per sequence, differentiable by
autograd. It materializes a ``[G, L, L]`` mask per sequence, so it is for tests and small
CPU runs only; the Triton and CUDA kernels never build anything of size O(S^2).

Shape legend: T tokens, HQ query heads, G KV-head groups, D head dim, L tokens of one sequence.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_sparsebalance.ops.router import BlockRoute

_DENSE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    B = lay.block_size
    for s in range(lay.num_seqs):
        t0, t1 = int(lay.cu_seqlens[s]), int(lay.cu_seqlens[s + 1])
        L = t1 - t0
        if L == 0:
            continue
        bmask = block_mask_of_sequence(route, s)  # [G, nb, nb]
        tmask = bmask.repeat_interleave(B, 1).repeat_interleave(B, 2)[:, :L, :L]
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        allowed = (tmask & causal).repeat_interleave(HQ // G, 0)  # [HQ, L, L]
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


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    softmax_scale: float,
    host_cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense causal attention over a THD pack with torch SDPA, one call per sequence.

    The reference row of every benchmark (sparse attention off). ``q: [T, HQ, D]``,
    ``k, v: [T, G, D]``; returns ``[T, HQ, D]``. ``host_cu_seqlens``: a host copy of the offsets,
    when the caller has one (spares reading ``cu_seqlens`` back from the GPU).

    cuDNN's SDPA is left out: it builds an execution plan for every new sequence length, about
    150 ms per call forward+backward on an H200 (measured), and every sequence of a training pack
    has a length of its own. Flash attention needs no plan; SDPA falls back to the memory-efficient
    and math kernels where flash does not apply (fp32, the CPU).
    """
    cu = (host_cu_seqlens if host_cu_seqlens is not None else cu_seqlens).tolist()
    outs = []
    with sdpa_kernel(_DENSE_BACKENDS):
        for t0, t1 in zip(cu[:-1], cu[1:]):
            if t1 == t0:
                continue
            o = F.scaled_dot_product_attention(
                q[t0:t1].transpose(0, 1).unsqueeze(0),
                k[t0:t1].transpose(0, 1).unsqueeze(0),
                v[t0:t1].transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=softmax_scale, enable_gqa=True,
            )
            outs.append(o.squeeze(0).transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, 0)
