"""Public entry of the sparse attention: route a pack, then attend with one implementation.

Routing and attention are separate steps because DST's coverage bound (DESIGN.md §4, step 4)
sits between them: the budget a layer finally uses depends on the coverage curve of the
scores, which the router computes.

Shape legend: T tokens, HQ query heads, G KV-head groups, D head dim, N sequences.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from megatron_sparsebalance.ops import native
from megatron_sparsebalance.ops.implementations import attention_function, resolve_impl, unavailable_reason
from megatron_sparsebalance.ops.layout import BlockLayout
from megatron_sparsebalance.ops.router import (
    BlockRoute,
    block_scores,
    coverage_bounded_budget,
    coverage_curve,
    select_blocks,
    validate_budgets,
)


@dataclass
class RouteStats:
    """What a layer did with the budget it was handed (reported to the schedule and SAB).

    The budget used (when the coverage bound chose it) and the coverages stay on the device until
    read: a layer that only reports them must not stop the host for them. The schedule reads all
    the layers of an iteration at once (:func:`~megatron_sparsebalance.attention.budget.read_reports`).
    """

    k_requested: int
    _k_used: Union[int, torch.Tensor]  # an int, or 0-dim on the device when the coverage bound chose it
    _coverage: Optional[torch.Tensor] = None  # [C(k_used), C(k_base)] (the second only with a k_base)
    _has_base: bool = False

    @property
    def k_used(self) -> int:
        """The budget the layer attended with."""
        return int(self._k_used)

    def unread(self) -> tuple:
        """``(k_used, C(k_used))`` as they are: each a number or a 0-dim device tensor (NaN coverage when untracked)."""
        return self._k_used, self._coverage[0] if self._coverage is not None else float("nan")

    @property
    def coverage_used(self) -> float:
        """``C(k_used)``; NaN when coverage was not tracked."""
        return float(self._coverage[0]) if self._coverage is not None else float("nan")

    @property
    def coverage_base(self) -> Optional[float]:
        """``C(k_base)``, when a ``k_base`` was given."""
        return float(self._coverage[1]) if self._coverage is not None and self._has_base else None


@dataclass(frozen=True)
class RouteSync:
    """How the router of one tensor-parallel rank agrees with the other ranks of its group.

    A rank holds some heads of a layer; the router must select as if it saw them all, so that
    every rank of the group selects the same blocks for a replicated KV group and chooses the
    same coverage-bounded budget. Both hooks run on the device (collectives, no host wait).
    """

    pooled_query: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """``[NB, G, D]`` pooled queries of this rank's heads -> those of all the group's heads
    (set when a KV group's query heads are split over ranks: ``num_query_groups < TP``)."""
    curve: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """This rank's coverage curve ``[K]`` -> the curve over all ranks' groups."""


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in tokens or head dim")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads / num_query_groups ({k.shape[1]})"
        )


def select(scores: torch.Tensor, layout: BlockLayout, budgets, kmax: Optional[int] = None) -> BlockRoute:
    """Selection through the native CPU kernel where it applies, else the torch router."""
    if scores.device.type == "cpu" and native.HAVE_NATIVE:
        budgets = validate_budgets(budgets, layout)
        kmax = max(1, min(int(budgets.max()) if kmax is None else kmax, layout.max_blocks_per_seq))
        kv_idx, kv_cnt = native.native().select_blocks_cpu(scores, budgets[layout.block_seq], kmax)
        return BlockRoute(layout, kv_idx, kv_cnt, budgets)
    return select_blocks(scores, layout, budgets, kmax)


def _curve_at(curve: torch.Tensor, k: Union[int, torch.Tensor]) -> torch.Tensor:
    """``C(k)`` as a 0-dim tensor, for ``k`` an int or a 0-dim device tensor, without a host wait."""
    if isinstance(k, int):
        return curve[k - 1]
    return curve.index_select(0, (k - 1).view(1)).squeeze(0)


def route(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: BlockLayout,
    budget: int,
    k_base: Optional[int] = None,
    p: Optional[float] = None,
    track_coverage: bool = True,
    sync: Optional[RouteSync] = None,
) -> tuple[BlockRoute, RouteStats]:
    """Route a pack at ``budget`` (bounded by coverage ``p`` against ``k_base`` when shrinking).

    Nothing here waits for the device: under the coverage bound the budget is chosen on the
    device, and the selection is made ``k_base`` wide (the bound never goes above it) with each
    row's count set by the chosen budget. On a GPU the router runs as a handful of launches:
    from C++ where the CUDA extension is built (``csrc/cuda/router.cu``), else Triton's
    (``triton_router.py``); elsewhere as the torch reference.

    Args:
        q: ``[T, HQ, D]``; k: ``[T, G, D]``.
        budget: blocks per query block asked for (DST's ``k_anchor``, or ``--moba-topk``).
        k_base: the fixed budget DST shrinks from; with ``p`` it enables the coverage bound.
        track_coverage: compute ``C(k)`` for the stats even when no bound applies.
        sync: tensor parallelism's hooks (:class:`RouteSync`); the curve is reduced before the
            coverage bound chooses, so every rank of the group chooses the same budget.
    """
    if int(budget) < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    k_request = int(budget)
    bounded = p is not None and k_base is not None and k_request < k_base
    curve_len = max(k_request, k_base or 1) if (bounded or track_coverage) else 0
    sync = sync or RouteSync()
    routed = gpu_router(q, layout, sync, bounded) or _route_torch
    blocks, curve, k_used, coverage = routed(q, k, layout, k_request, int(k_base or 0), p if bounded else None,
                                             curve_len, sync)
    stats = RouteStats(k_request, k_used, coverage, bool(k_base) and curve is not None)
    return blocks, stats


def gpu_router(q: torch.Tensor, layout: BlockLayout, sync: Optional[RouteSync] = None, bounded: bool = False):
    """The GPU router that serves this pack (``_route_cuda`` or ``_route_triton``), or None.

    Under tensor parallelism the CUDA router serves only where nothing must cross ranks inside
    its launches: it pools the queries and chooses the bounded budget there, from this rank's
    heads. Queries pooled over ranks (``num_query_groups < TP``) and a coverage bound over the
    reduced curve take the Triton router (pooling, then the hook; curve, then the reduce, then
    the selection at the device budget), else the torch router.
    """
    if q.device.type != "cuda":
        return None
    sync = sync or RouteSync()
    crosses_ranks_in_launch = sync.pooled_query is not None or (bounded and sync.curve is not None)
    head_dim = q.shape[-1]
    if (not crosses_ranks_in_launch and native.cuda_kernels_run_on(q.device)
            and head_dim <= native.native().router_max_head_dim
            and layout.max_blocks_per_seq - 1 <= native.native().router_max_candidates):
        return _route_cuda
    # the Triton pooling reads a head as one power-of-two vector; other head dims use the torch router
    if _triton_router(q.device) and head_dim & (head_dim - 1) == 0:
        return _route_triton
    return None


def _coverage(curve: Optional[torch.Tensor], k_used: Union[int, torch.Tensor], k_ref: int) -> Optional[torch.Tensor]:
    """``[C(k_used), C(k_ref)]`` on the device, or None without a curve."""
    if curve is None:
        return None
    return torch.stack([_curve_at(curve, k_used), _curve_at(curve, k_ref)])


# Each router returns ``(route, curve or None, k_used, [C(k_used), C(k_base or k_request)] or
# None)``; ``p`` set means the coverage bound applies.

def _reduced(curve: Optional[torch.Tensor], sync: RouteSync) -> Optional[torch.Tensor]:
    return sync.curve(curve) if curve is not None and sync.curve is not None else curve


def _route_torch(q, k, layout, k_request, k_base, p, curve_len, sync):
    """The torch router (the oracle)."""
    scores = block_scores(q, k, layout, sync.pooled_query)
    curve = _reduced(coverage_curve(scores, curve_len), sync) if curve_len else None
    if p is None:
        k_used = k_request
        blocks = select(scores, layout, k_request, k_request)
    else:
        k_used = coverage_bounded_budget(curve, k_request, k_base, p)
        blocks = select(scores, layout, k_used, k_base)
    return blocks, curve, k_used, _coverage(curve, k_used, k_base or k_request)


def _route_triton(q, k, layout, k_request, k_base, p, curve_len, sync):
    """The Triton router: pooling, one GEMM, one selection launch (two under the coverage bound:
    the curve must exist before the budget is chosen)."""
    from megatron_sparsebalance.ops import triton_router

    dots = triton_router.pooled_dots(q, k, layout, sync.pooled_query)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if p is None:
        kv_idx, kv_cnt, curve = triton_router.select_and_cover(
            dots, layout, scale, budget=k_request, width=k_request, curve_len=curve_len)
        curve = _reduced(curve, sync)
        k_used = k_request
    else:
        _, _, curve = triton_router.select_and_cover(dots, layout, scale, curve_len=curve_len)
        curve = _reduced(curve, sync)
        k_used = coverage_bounded_budget(curve, k_request, k_base, p)
        kv_idx, kv_cnt, _ = triton_router.select_and_cover(dots, layout, scale, budget=k_used, width=k_base)
    return BlockRoute(layout, kv_idx, kv_cnt, k_used), curve, k_used, _coverage(curve, k_used, k_base or k_request)


def _route_cuda(q, k, layout, k_request, k_base, p, curve_len, sync):
    """The CUDA router: three calls into C++, three to five launches. Each row's scores are computed
    where it is ranked; the coverage bound's budget and the coverage pair come out of the launches."""
    ext = native.native()
    groups = k.shape[1]
    pooled_q = ext.router_pool_cuda(q, layout.block_start, layout.block_end, groups)
    pooled_k = ext.router_pool_cuda(k, layout.block_start, layout.block_end, groups)
    kv_idx, kv_cnt, curve, coverage, k_used = ext.router_select_cuda(
        pooled_q, pooled_k, layout.block_pos, layout.max_blocks_per_seq, layout.rows_with_candidates,
        1.0 / math.sqrt(q.shape[-1]), k_request, k_base, -1.0 if p is None else float(p), curve_len)
    if k_used is None:
        k_used = k_request
    if sync.curve is not None and curve is not None:  # unbounded here (gpu_router): only the figures
        curve = sync.curve(curve)
        coverage = _coverage(curve, k_used, k_base or k_request)
    return BlockRoute(layout, kv_idx, kv_cnt, k_used), curve, k_used, coverage


@functools.lru_cache(maxsize=None)
def _triton_router(device: torch.device) -> bool:
    """Whether the GPU router runs for tensors on ``device`` (asked once per device: it is per layer)."""
    return unavailable_reason("triton", device) is None


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    budget: int,
    impl: str = "auto",
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """MoBA block-sparse causal attention over a THD pack, in one call.

    Args:
        q: ``[T, HQ, D]``; k, v: ``[T, G, D]``; cu_seqlens: ``[N+1]`` int32.
        block_size: 64, 128 or 256.
        budget: KV blocks per query block, the diagonal included.
        impl: ``auto``, ``cuda``, ``triton``, ``fa4`` or ``torch``.
    Returns:
        ``[T, HQ, D]``.
    """
    check_qkv(q, k, v)
    resolved = resolve_impl(impl, q.device, block_size=block_size)
    layout = BlockLayout.from_cu_seqlens(cu_seqlens, block_size, q.shape[0])
    blocks, _ = route(q, k, layout, budget, track_coverage=False)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return attention_function(resolved)(q, k, v, blocks, scale)
