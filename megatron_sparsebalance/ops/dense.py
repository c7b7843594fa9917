"""Dense causal attention over THD packs: the path of ``--no-sparse-attention``.

The reference row of every benchmark and the quality reference of the fidelity runs, so it is
a training path, not a test oracle: it must be as fast as a Megatron user's dense attention.

Shape legend: T tokens, HQ query heads, G KV-head groups, D head dim.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN left out on purpose: see dense_causal_attention.
_DENSE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    softmax_scale: float,
    host_cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense causal attention over a THD pack with torch SDPA, one call per sequence.

    ``q: [T, HQ, D]``, ``k, v: [T, G, D]``; returns ``[T, HQ, D]``. ``host_cu_seqlens``: a host copy of the offsets,
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
