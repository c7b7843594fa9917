"""Block-sparse causal attention through flash-attn-4's block-sparse kernels (``--sparse-attn-impl fa4``).

Owns the translation of our selection (DESIGN.md §2, a :class:`BlockRoute` over a THD pack) into
FA4's block-sparse tensors, and the one call into FA4. FA4's block sparsity has no varlen
backward, so the pack is laid out as ONE batch-1 sequence in which every block of ours starts on
a 128-token boundary:

* each of our blocks (block size ``B`` = 128 or 256) takes ``B`` slots of the padded sequence,
  so a sequence's partial last block is padded to whole 128-token blocks and no 128-block of the
  padded sequence holds tokens of two sequences. The padded length is ``NB * B``, known on the
  host without reading the device (nothing here waits for the GPU);
* a block of 256 is two 128-blocks ("sub-blocks"); FA4's SM90 kernels need the KV sparse block
  to equal their 128-wide KV tile, and block 64 has no such tile: it is refused by name;
* query sub-block ``m`` attends to sub-block ``n`` when our selection of ``m``'s block holds
  ``n``'s block and ``n <= m``: ``n < m`` as a *full* block (no mask evaluated), ``n == m`` as
  the one *partial* block, masked by ``q >= kv``. Selected earlier blocks of ours are always in
  the same sequence (the router's candidates are), so the global ``q >= kv`` of the padded
  sequence is each sequence's own causal mask;
* the selection of a KV group is given to each of its query heads (FA4 reads the block-sparse
  tensors per query head; broadcasting one head would make it pack GQA heads, which it does
  only with a single shared selection).

Padding tokens are zeros; their outputs are dropped and the gradient flowing into them is zero,
so they add nothing to dq/dk/dv of real tokens. A padding-only sub-block (the missing second
half of a sequence's partial 256-block) attends only to itself and is attended by nobody.

FA4's backward adds dQ with fp32 atomics on Hopper (its deterministic block-sparse backward
needs SM100+), so this implementation is not deterministic: ``--deterministic-mode`` refuses it
(``implementations.py``).

The index construction (:func:`fa4_block_plan`) is plain torch and runs on any device; the
tests check it on the CPU against a naive per-element construction.

Shape legend: T tokens, HQ query heads, G KV-head groups, D head dim, NB our blocks, K max budget,
f = B / 128 sub-blocks per block, M = NB * f sub-blocks (128-token blocks of the padded sequence),
Tp = M * 128 padded tokens.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_sparsebalance.ops.layout import BlockLayout
from megatron_sparsebalance.ops.router import BlockRoute

FA4_BLOCK = 128  # FA4's SM90 KV tile: the sparse block of every call
FA4_BLOCK_SIZES = (128, 256)  # ours that map onto whole FA4 blocks
FA4_VERSION = "4.0.0b36"  # the version this module was written against (block-sparse API)


def check_block_size(block_size: int) -> None:
    """Refuse block sizes FA4's kernels cannot tile (64: its SM90 KV tile is 128 wide)."""
    if block_size not in FA4_BLOCK_SIZES:
        raise ValueError(f"--sparse-attn-impl fa4 needs --moba-block-size in {FA4_BLOCK_SIZES} (FA4's Hopper "
                         f"kernels tile keys in 128-token blocks), got --moba-block-size {block_size}")


@dataclass(frozen=True)
class FA4BlockPlan:
    """FA4's block-sparse tensors for one route, per query head, batch 1.

    Attributes (all int32, on the route's device):
        fwd_mask_cnt ``[1, HQ, M]``, fwd_mask_idx ``[1, HQ, M, 1]``: the partial (diagonal) block.
        fwd_full_cnt ``[1, HQ, M]``, fwd_full_idx ``[1, HQ, M, Wf]``: full KV blocks, ascending.
        bwd_mask_cnt ``[1, HQ, M]``, bwd_mask_idx ``[1, HQ, M, 1]``: per KV block, its partial query block.
        bwd_full_cnt ``[1, HQ, M]``, bwd_full_idx ``[1, HQ, M, Wb]``: per KV block, the query blocks
            that read it as a full block, ascending.
        num_sub_blocks: M.
    """

    fwd_mask_cnt: torch.Tensor
    fwd_mask_idx: torch.Tensor
    fwd_full_cnt: torch.Tensor
    fwd_full_idx: torch.Tensor
    bwd_mask_cnt: torch.Tensor
    bwd_mask_idx: torch.Tensor
    bwd_full_cnt: torch.Tensor
    bwd_full_idx: torch.Tensor
    num_sub_blocks: int


def compact_rows(dense: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cnt [..., R] int32, idx [..., R, width] int32)``: the True columns of each row, ascending,
    packed to the left (the rest 0). ``width`` must be at least the largest count."""
    cnt = dense.sum(-1)
    slot = torch.cumsum(dense.to(torch.int32), -1) - 1
    # unselected columns write into a spill slot that is cut off
    slot = torch.where(dense, slot, torch.full_like(slot, width)).long()
    cols = torch.arange(dense.shape[-1], device=dense.device, dtype=torch.int32).expand_as(slot)
    idx = torch.zeros(*dense.shape[:-1], width + 1, dtype=torch.int32, device=dense.device)
    idx.scatter_(-1, slot, cols)
    return cnt.to(torch.int32), idx[..., :width].contiguous()


def selected_sub_blocks(route: BlockRoute) -> torch.Tensor:
    """``[G, M, M]`` bool: sub-block ``m`` reads sub-block ``n`` (``n <= m``, ``n``'s block selected by ``m``'s)."""
    lay = route.layout
    G, NB, _ = route.kv_idx.shape
    f = lay.block_size // FA4_BLOCK
    dev = route.kv_idx.device
    sel = torch.zeros(G, NB, NB + 1, dtype=torch.bool, device=dev)
    kv = route.kv_idx.long()
    sel.scatter_(-1, torch.where(kv >= 0, kv, NB), True)
    sel = sel[..., :NB]
    if f > 1:
        sel = sel.repeat_interleave(f, 1).repeat_interleave(f, 2)
    M = NB * f
    lower = torch.ones(M, M, dtype=torch.bool, device=dev).tril()
    return sel & lower


def fa4_block_plan(route: BlockRoute, num_query_heads: int) -> FA4BlockPlan:
    """FA4's forward and transposed (backward) block-sparse tensors for ``route``.

    The diagonal sub-block is the one partial block of every row and column; every other
    selected sub-block is full. Index widths are bounds known on the host: ``K * f - 1`` for a
    query block, ``max_blocks_per_seq * f - 1`` for a KV block (its readers are in its sequence).
    """
    lay = route.layout
    check_block_size(lay.block_size)
    G, NB, K = route.kv_idx.shape
    if num_query_heads % G:
        raise ValueError(f"query heads ({num_query_heads}) must be a multiple of KV groups ({G})")
    R = num_query_heads // G
    f = lay.block_size // FA4_BLOCK
    M = NB * f
    dev = route.kv_idx.device
    full = selected_sub_blocks(route)
    full &= ~torch.eye(M, dtype=torch.bool, device=dev)
    fwd_cnt, fwd_idx = compact_rows(full, max(1, min(M, K * f - 1)))
    bwd_cnt, bwd_idx = compact_rows(full.transpose(1, 2), max(1, min(M, lay.max_blocks_per_seq * f - 1)))
    diag_cnt = torch.ones(G, M, dtype=torch.int32, device=dev)
    diag_idx = torch.arange(M, dtype=torch.int32, device=dev).view(1, M, 1).expand(G, M, 1)

    def per_head(x):
        return x.repeat_interleave(R, 0).unsqueeze(0).contiguous()

    return FA4BlockPlan(
        fwd_mask_cnt=per_head(diag_cnt), fwd_mask_idx=per_head(diag_idx),
        fwd_full_cnt=per_head(fwd_cnt), fwd_full_idx=per_head(fwd_idx),
        bwd_mask_cnt=per_head(diag_cnt), bwd_mask_idx=per_head(diag_idx),
        bwd_full_cnt=per_head(bwd_cnt), bwd_full_idx=per_head(bwd_idx),
        num_sub_blocks=M,
    )


def padded_positions(layout: BlockLayout) -> Optional[torch.Tensor]:
    """``[T]`` int64: the slot of each token in the padded sequence (block ``b`` at ``b * B``),
    or None when the pack needs no padding (every sequence a whole number of blocks)."""
    if layout.num_tokens == layout.num_blocks * layout.block_size:
        return None
    tb = layout.token_block
    offset = torch.arange(layout.num_tokens, device=tb.device) - layout.block_start.long()[tb]
    return tb * layout.block_size + offset


class _PaddingCache:
    """The padded positions of the last layout seen: every layer of a micro-batch shares one layout."""

    def __init__(self):
        self._layout = None
        self._dst = None

    def get(self, layout: BlockLayout) -> Optional[torch.Tensor]:
        if self._layout is not layout:
            self._dst, self._layout = padded_positions(layout), layout
        return self._dst


_PADDING = _PaddingCache()


@functools.lru_cache(maxsize=None)
def _fa4():
    """``(flash_attn_func, BlockSparseTensorsTorch, causal mask_mod)``; imports flash-attn-4 once."""
    import cutlass.cute as cute
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import flash_attn_func

    @cute.jit
    def causal_mask_mod(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        # evaluated only on the partial (diagonal) blocks: the full ones are causal by selection
        return q_idx >= kv_idx

    return flash_attn_func, BlockSparseTensorsTorch, causal_mask_mod


def import_error() -> Optional[str]:
    """Why flash-attn-4's block-sparse API cannot be imported here, or None when it can."""
    try:
        _fa4()
    except Exception as e:  # ImportError, or the CuTe DSL failing to load its libraries
        hint = ""
        if "cutlass" in str(e):
            hint = (" (installed with pip --target, the CuTe DSL is found only with "
                    "<target>/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH; see docs/FA4.md)")
        return f"flash-attn-4 ({FA4_VERSION}) does not import: {type(e).__name__}: {e}{hint}"
    return None


def flash_attn_block_sparse(q1, k1, v1, plan: FA4BlockPlan, softmax_scale: float) -> torch.Tensor:
    """One FA4 call on batch-1 tensors ``[1, Tp, H, D]`` with ``plan``'s tensors; returns ``[1, Tp, HQ, D]``."""
    flash_attn_func, Tensors, mask_mod = _fa4()
    fwd = Tensors(plan.fwd_mask_cnt, plan.fwd_mask_idx, plan.fwd_full_cnt, plan.fwd_full_idx,
                  block_size=(FA4_BLOCK, FA4_BLOCK))
    bwd = Tensors(plan.bwd_mask_cnt, plan.bwd_mask_idx, plan.bwd_full_cnt, plan.bwd_full_idx,
                  block_size=(FA4_BLOCK, FA4_BLOCK))
    out = flash_attn_func(q1, k1, v1, softmax_scale=softmax_scale, causal=False, mask_mod=mask_mod,
                          block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd, deterministic=False)
    return out[0] if isinstance(out, tuple) else out


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: BlockRoute, softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Block-sparse causal attention (flash-attn-4), our semantics over a THD pack.

    Args:
        q: ``[T, HQ, D]`` bf16/fp16; k, v: ``[T, G, D]``, ``HQ % G == 0``.
        route: the selection; its layout's block size must be 128 or 256.
        softmax_scale: defaults to ``1/sqrt(D)``.
    Returns:
        ``[T, HQ, D]``, differentiable with respect to q, k and v (non-deterministic backward).
    """
    lay = route.layout
    check_block_size(lay.block_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    plan = fa4_block_plan(route, q.shape[1])
    dst = _PADDING.get(lay)
    Tp = plan.num_sub_blocks * FA4_BLOCK

    def pad(x):
        if dst is None:
            return x.contiguous().unsqueeze(0)
        return x.new_zeros(Tp, *x.shape[1:]).index_copy(0, dst, x).unsqueeze(0)

    out = flash_attn_block_sparse(pad(q), pad(k), pad(v), plan, float(softmax_scale))[0]
    return out if dst is None else out.index_select(0, dst)
