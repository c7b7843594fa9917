"""Block-sparse causal attention through the CUDA C++ kernels of ``megatron_sparsebalance._C``.

Owns the Python face of ``csrc/cuda/attention.cu``: ``torch.library`` ops (with fake
implementations, so ``torch.compile`` traces them) and their autograd rule. Same contract as
every implementation (DESIGN.md §2). The backward has no atomics, so it is deterministic; its
transposed (per-KV-block) index is built on the GPU without a host synchronisation.

Shape legend: T tokens, HQ query heads, G KV-head groups, D head dim, NB blocks, K max budget.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_sparsebalance.ops import native
from megatron_sparsebalance.ops.router import BlockRoute


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels load 16-byte vectors)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def transpose_index_gpu(kv_idx: torch.Tensor, kv_cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_ptr [G*NB+1], q_idx [G*NB*K])`` int32: query blocks per (group, KV block), ascending.

    Same CSR as :func:`megatron_sparsebalance.ops.router.transpose_route_index` (only the first
    ``q_ptr[-1]`` entries of ``q_idx`` are meaningful), by a stable sort, with no host sync.
    """
    G, NB, K = kv_idx.shape
    dev = kv_idx.device
    # int32 keys and early frees: this runs inside the backward, at its memory peak.
    g = torch.arange(G, device=dev, dtype=torch.int32).view(G, 1, 1)
    key = torch.where(kv_idx >= 0, g * NB + kv_idx, G * NB).reshape(-1)
    skey, order = torch.sort(key, stable=True)
    del key
    q_idx = ((order // K) % NB).to(torch.int32)
    del order
    q_ptr = torch.searchsorted(skey, torch.arange(G * NB + 1, device=dev, dtype=torch.int32)).to(torch.int32)
    return q_ptr, q_idx


@torch.library.custom_op("sparsebalance::cuda_attn_fwd", mutates_args=())
def cuda_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor,
    block_start: torch.Tensor, block_end: torch.Tensor, softmax_scale: float, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out [T, HQ, D], lse [T, HQ] float32)``."""
    out, lse = native.native().sparse_attn_fwd_cuda(
        q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size)
    return out, lse


@cuda_attn_fwd.register_fake
def _(q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("sparsebalance::cuda_attn_bwd", mutates_args=())
def cuda_attn_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor, block_start: torch.Tensor,
    block_end: torch.Tensor, softmax_scale: float, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: ``(dq [T, HQ, D], dk [T, G, D], dv [T, G, D])``."""
    q_ptr, q_idx = transpose_index_gpu(kv_idx, kv_cnt)
    dq, dk, dv = native.native().sparse_attn_bwd_cuda(
        _aligned(do), q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end, q_ptr, q_idx,
        softmax_scale, block_size)
    return dq, dk, dv


@cuda_attn_bwd.register_fake
def _(do, q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kv_idx, kv_cnt, bstart, bend, scale, block_size = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_idx, kv_cnt, bstart, bend)
    ctx.scale = scale
    ctx.block_size = block_size


def _backward_rule(ctx, dout, dlse):
    q, k, v, out, lse, kv_idx, kv_cnt, bstart, bend = ctx.saved_tensors
    dq, dk, dv = cuda_attn_bwd(dout, q, k, v, out, lse, kv_idx, kv_cnt, bstart, bend, ctx.scale, ctx.block_size)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("sparsebalance::cuda_attn_fwd", _backward_rule, setup_context=_setup_context)


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: BlockRoute, softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Block-sparse causal attention (CUDA C++).

    Args:
        q: ``[T, HQ, D]`` bf16/fp16, D in {64, 128}; k, v: ``[T, G, D]``, ``HQ % G == 0``.
        route: the selection (``kv_idx [G, NB, K]``, diagonal block last in each row).
        softmax_scale: defaults to ``1/sqrt(D)``.
    Returns:
        ``[T, HQ, D]``, differentiable with respect to q, k and v.
    """
    if not native.HAVE_NATIVE_CUDA:
        raise RuntimeError("the CUDA kernels are not built (build with MSB_CUDA=1 where nvcc exists)")
    lay = route.layout
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    out, _ = cuda_attn_fwd(
        _aligned(q), _aligned(k), _aligned(v), route.kv_idx.contiguous(), route.kv_cnt.contiguous(),
        lay.block_start, lay.block_end, float(softmax_scale), int(lay.block_size),
    )
    return out
