"""Block-sparse attention: layout, router, implementations (torch reference, Triton, CUDA)."""
from megatron_sparsebalance.ops.layout import SUPPORTED_BLOCK_SIZES, BlockLayout, uniform_cu_seqlens
from megatron_sparsebalance.ops.router import (
    BlockRoute,
    block_scores,
    coverage_bounded_budget,
    coverage_curve,
    select_blocks,
    transpose_route_index,
)
from megatron_sparsebalance.ops.sparse_attention import RouteStats, route, sparse_attention

__all__ = [
    "SUPPORTED_BLOCK_SIZES", "BlockLayout", "uniform_cu_seqlens", "BlockRoute", "block_scores",
    "coverage_bounded_budget", "coverage_curve", "select_blocks", "transpose_route_index",
    "RouteStats", "route", "sparse_attention",
]
