"""Random THD packs for the GPU tests of the kernels and the router."""
from __future__ import annotations

import torch

from megatron_sparsebalance.ops.layout import BlockLayout


def random_pack(lens, hq, g, d, dtype, block, seed=0, structured=True):
    """``(q [T, hq, d], k [T, g, d], v [T, g, d], layout)`` on the GPU for sequences of ``lens``.

    ``structured`` adds a random offset per block to k, so that routing is not a coin toss.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    lay = BlockLayout.from_cu_seqlens(cu, block, T)
    q = torch.randn(T, hq, d, device="cuda", generator=gen)
    k = torch.randn(T, g, d, device="cuda", generator=gen)
    v = torch.randn(T, g, d, device="cuda", generator=gen)
    if structured:
        k = k + torch.randn(lay.num_blocks, g, d, device="cuda", generator=gen)[lay.token_block]
    return q.to(dtype), k.to(dtype), v.to(dtype), lay
