"""Block-sparse causal attention through the CUDA C++ kernels of ``megatron_sparsebalance._C``.

Owns the Python face of ``csrc/cuda/attention.cu``: its forward and backward, registered as
``torch.library`` ops with an eager autograd path (``registration.py``). Same contract as
every implementation (DESIGN.md §2). The backward adds no floating-point values atomically (the
Hopper dK/dV sums the parts of the long query lists it cuts in a fixed order), so it is
deterministic; its transposed (per-KV-block) index and the dK/dV's plan are built on the GPU
without a host synchronisation. With ``--sparse-attn-ds-buffer-gib`` the backward may store dS
instead of forming it twice (:func:`takes_stored_ds`): memory for speed, deterministic as well.

Shape legend: T tokens, HQ query heads, G KV-head groups, D head dim, NB blocks, K max budget.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_sparsebalance.ops import native
from megatron_sparsebalance.ops.registration import register_attention
from megatron_sparsebalance.ops.router import BlockRoute


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels load 16-byte vectors)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def transpose_index_gpu(kv_idx: torch.Tensor, kv_cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_ptr [G*NB+1], q_idx [G*NB*K])`` int32: query blocks per (group, KV block), ascending.

    Same CSR as :func:`megatron_sparsebalance.ops.router.transpose_route_index` (only the first
    ``q_ptr[-1]`` entries of ``q_idx`` are meaningful), with no host sync: three launches of the
    CUDA extension (``csrc/cuda/transpose_index.cu``) where it is built for this GPU, else torch ops.
    """
    if kv_idx.is_cuda and native.cuda_kernels_run_on(kv_idx.device):
        return tuple(native.native().transpose_index_cuda(kv_idx.contiguous(), kv_cnt.contiguous()))
    return transpose_index_torch(kv_idx, kv_cnt)


def transpose_index_torch(kv_idx: torch.Tensor, kv_cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`transpose_index_gpu` by torch ops (a stable sort): eight launches from Python."""
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


def _forward(q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale: float, block_size: int):
    """``(out [T, HQ, D], lse [T, HQ] float32)``."""
    return native.native().sparse_attn_fwd_cuda(
        q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size)


def _backward_stored_ds(do, q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end, softmax_scale: float,
                        block_size: int):
    """:func:`_backward` with dS stored: dK/dV writes every dS tile it forms, and dQ = dS K reads them
    back, one product a tile instead of the three of the two-pass dQ (csrc/cuda/attention_kernels_sm90.cuh,
    "Stored dS"). Its buffer is sized by the route's shape (:func:`stored_ds_bytes`), not by its true
    count of tiles, which only the device knows: reading it would stop the host in every layer."""
    ext = native.native()
    do = _aligned(do)
    q_ptr, q_idx, slots = ext.transpose_index_cuda(kv_idx.contiguous(), kv_cnt.contiguous(), True)
    ds = q.new_empty(stored_ds_bytes(q, k, kv_idx, block_size) // q.element_size())
    dk, dv, delta = ext.sparse_attn_bwd_dkdv_cuda(
        do, q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end, q_ptr, q_idx, softmax_scale, block_size, ds)
    del q_ptr, q_idx, delta
    dq = ext.sparse_attn_bwd_dq_from_ds_cuda(q, k, ds, slots, kv_idx, kv_cnt, block_start, block_end,
                                             softmax_scale, block_size)
    return dq, dk, dv


def _backward(do, q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end, softmax_scale: float, block_size: int):
    """``(dq [T, HQ, D], dk [T, G, D], dv [T, G, D])``."""
    do = _aligned(do)
    # The transposed index lives only through the dK/dV kernel and is freed before dQ is
    # allocated: the backward's peak is the three gradients and delta, as FlexAttention's.
    q_ptr, q_idx = transpose_index_gpu(kv_idx, kv_cnt)
    dk, dv, delta = native.native().sparse_attn_bwd_dkdv_cuda(
        do, q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end, q_ptr, q_idx, softmax_scale, block_size)
    del q_ptr, q_idx
    dq = native.native().sparse_attn_bwd_dq_cuda(
        do, q, k, v, lse, delta, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size)
    return dq, dk, dv


# torch.library ops (traced by torch.compile) and the eager autograd path, see registration.py
cuda_attention = register_attention("cuda", _forward, _backward)
cuda_attn_fwd, cuda_attn_bwd = cuda_attention.forward_op, cuda_attention.backward_op
cuda_stored_ds_attention = register_attention("cuda_stored_ds", _forward, _backward_stored_ds)


HEAD_DIMS = (64, 128)  # the kernels' tiles (csrc/cuda/attention.cu checks it too)


def stored_ds_bytes(q: torch.Tensor, k: torch.Tensor, kv_idx: torch.Tensor, block_size: int) -> int:
    """Bytes of the stored-dS backward's buffer: a 16-bit value per (query head, query token of a
    block, key of a selected block) for every entry the route's shape can hold (``G * NB * K``
    entries of ``R * block * 128`` values)."""
    groups, blocks, width = kv_idx.shape
    return groups * blocks * width * (q.shape[1] // k.shape[1]) * block_size * 128 * q.element_size()


def takes_stored_ds(q: torch.Tensor, k: torch.Tensor, route: BlockRoute, ds_buffer_bytes: int) -> bool:
    """Whether the backward of this call stores dS (``--sparse-attn-ds-buffer-gib``): on Hopper at
    block 128 and head dim 128, where its buffer fits ``ds_buffer_bytes``."""
    block = int(route.layout.block_size)
    return (ds_buffer_bytes > 0 and native.HAVE_NATIVE_CUDA and q.is_cuda
            and native.native().stored_ds_supported(block, q.shape[-1])
            and stored_ds_bytes(q, k, route.kv_idx, block) <= ds_buffer_bytes)


def _kernel_args(q, k, v, route: BlockRoute, softmax_scale: float) -> tuple:
    """The extension's arguments: inputs contiguous and aligned, the route's tensors, host scalars."""
    if not native.HAVE_NATIVE_CUDA:
        raise RuntimeError("the CUDA kernels are not built (build with MSB_CUDA=1 where nvcc exists)")
    lay = route.layout
    return (_aligned(q), _aligned(k), _aligned(v), route.kv_idx.contiguous(), route.kv_cnt.contiguous(),
            lay.block_start, lay.block_end, float(softmax_scale), int(lay.block_size))


def forward_with_lse(q, k, v, route: BlockRoute, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel alone, not differentiable: ``(out [T, HQ, D], lse [T, HQ] float32)``,
    ``lse`` in base 2 of the scaled scores (``log2 sum_j exp2(s_j * scale * log2 e)``). For
    ``fa4``, whose backward is FA4's."""
    return _forward(*_kernel_args(q, k, v, route, softmax_scale))


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: BlockRoute, softmax_scale: Optional[float] = None,
    ds_buffer_bytes: int = 0,
) -> torch.Tensor:
    """Block-sparse causal attention (CUDA C++).

    Args:
        q: ``[T, HQ, D]`` bf16/fp16, D in {64, 128}; k, v: ``[T, G, D]``, ``HQ % G == 0``.
        route: the selection (``kv_idx [G, NB, K]``, diagonal block last in each row).
        softmax_scale: defaults to ``1/sqrt(D)``.
        ds_buffer_bytes: memory the backward may take to store dS (:func:`takes_stored_ds`); 0, the
            default, keeps the two-pass backward. Both are deterministic.
    Returns:
        ``[T, HQ, D]``, differentiable with respect to q, k and v.
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    attention = cuda_stored_ds_attention if takes_stored_ds(q, k, route, ds_buffer_bytes) else cuda_attention
    return attention(*_kernel_args(q, k, v, route, softmax_scale))
