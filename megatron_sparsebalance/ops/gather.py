"""Block-sparse attention in plain PyTorch that computes only the selected blocks.

The ``torch`` implementation of ``--sparse-attn-impl``: it gathers, for every (KV group,
query block), the K/V tokens of its selected blocks and runs one batched softmax attention over
them, so its cost grows with the budget like the GPU kernels' does (the masked-dense oracle in
``naive.py`` costs the same at every budget). That makes CPU runs of DST meaningful. Memory is
O(NB * k * B^2) per group, never O(S^2).

Shape legend: T tokens, HQ query heads, G KV-head groups, R = HQ / G, D head dim, NB blocks,
B block size, K the largest budget of the pack.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_sparsebalance.ops.router import BlockRoute


def sparse_attention_gather(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: BlockRoute, softmax_scale: float
) -> torch.Tensor:
    """``q: [T, HQ, D]``, ``k, v: [T, G, D]`` -> ``[T, HQ, D]``; same function as the naive reference."""
    lay = route.layout
    T, HQ, D = q.shape
    G = k.shape[1]
    R, B, NB = HQ // G, lay.block_size, lay.num_blocks
    K = route.kv_idx.shape[-1]
    if NB == 0:
        return q.new_zeros(q.shape)
    tok = lay.block_start.long()[:, None] + torch.arange(B, device=q.device)  # [NB, B]
    tok_valid = tok < lay.block_end.long()[:, None]
    tok_safe = torch.where(tok_valid, tok, torch.full_like(tok, T))  # row T is a zero pad row
    pad = lambda x: F.pad(x, (0, 0, 0, 0, 0, 1))  # noqa: E731

    q_blk = pad(q)[tok_safe].view(NB, B, G, R, D).permute(2, 0, 3, 1, 4).reshape(G, NB, R * B, D)
    sel = route.kv_idx.long()
    sel_valid = sel >= 0
    kv_tok = tok_safe[sel.clamp(min=0)]  # [G, NB, K, B]
    kv_valid = tok_valid[sel.clamp(min=0)] & sel_valid[..., None]
    group = torch.arange(G, device=q.device).view(G, 1, 1, 1)
    k_blk = pad(k)[kv_tok, group].reshape(G, NB, K * B, D)
    v_blk = pad(v)[kv_tok, group].reshape(G, NB, K * B, D)

    kv_tok = kv_tok.reshape(G, NB, 1, 1, K * B)
    allowed = kv_valid.reshape(G, NB, 1, 1, K * B) & (kv_tok <= tok.view(1, NB, 1, B, 1))  # [G, NB, 1, B, K*B]
    scores = torch.matmul(q_blk, k_blk.transpose(-1, -2)).view(G, NB, R, B, K * B) * softmax_scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(G, NB, R * B, K * B)
    out = torch.matmul(probs, v_blk).view(G, NB, R, B, D).permute(1, 3, 0, 2, 4).reshape(NB * B, HQ, D)
    return out[tok_valid.reshape(-1)]
