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

On Hopper, where our CUDA extension runs, the forward is our own kernel (``cuda_attention``) and
only the backward is FA4's: our forward kernel was faster than FA4's at most of issue 44's eight
cases and within a run's spread at the others, while our two-pass backward is slower than FA4's
at 64K (docs/FA4.md). The forward then needs no FA4 block-sparse tensors, no FA4 host call and no
padding of q, k, v. FA4's backward takes our output and log-sum-exp, the latter converted from
our base 2 (``lse2 = log2(sum exp2(S scale log2 e))``) to FA4's base e. Elsewhere (Blackwell, no
extension, or a head dim other than 64 and 128) both directions are FA4's.

The index construction (:func:`fa4_block_plan`) is plain torch and runs on any device; the
tests check it on the CPU against a naive per-element construction. The backward, which builds
its tensors in every layer, takes them from one launch of our extension where it runs
(:func:`fa4_backward_plan`), tested on the GPU against the torch construction.

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

from megatron_sparsebalance.ops import cuda_attention, native
from megatron_sparsebalance.ops.layout import BlockLayout
from megatron_sparsebalance.ops.router import BlockRoute

FA4_BLOCK = 128  # FA4's SM90 KV tile: the sparse block of every call
FA4_BLOCK_SIZES = (128, 256)  # ours that map onto whole FA4 blocks
FA4_VERSION = "4.0.0b36"  # the version this module was written against (block-sparse API)
LN2 = math.log(2.0)  # our lse is in base 2, FA4's in base e


def check_block_size(block_size: int) -> None:
    """Refuse block sizes FA4's kernels cannot tile (64: its SM90 KV tile is 128 wide)."""
    if block_size not in FA4_BLOCK_SIZES:
        raise ValueError(f"--sparse-attn-impl fa4 needs --moba-block-size in {FA4_BLOCK_SIZES} (FA4's Hopper "
                         f"kernels tile keys in 128-token blocks), got --moba-block-size {block_size}")


def heads_per_group(route: BlockRoute, num_query_heads: int) -> int:
    """R, the query heads of each KV group, after the checks every plan of ``route`` needs."""
    check_block_size(route.layout.block_size)
    G = route.kv_idx.shape[0]
    if num_query_heads % G:
        raise ValueError(f"query heads ({num_query_heads}) must be a multiple of KV groups ({G})")
    return num_query_heads // G


@dataclass(frozen=True)
class FA4BlockPlan:
    """FA4's block-sparse tensors for one route, per query head, batch 1.

    Attributes (all int32, on the route's device; the ``fwd_*`` ones None in a backward-only plan):
        fwd_mask_cnt ``[1, HQ, M]``, fwd_mask_idx ``[1, HQ, M, 1]``: the partial (diagonal) block.
        fwd_full_cnt ``[1, HQ, M]``, fwd_full_idx ``[1, HQ, M, Wf]``: full KV blocks, ascending.
        bwd_mask_cnt ``[1, HQ, M]``, bwd_mask_idx ``[1, HQ, M, 1]``: per KV block, its partial query block.
        bwd_full_cnt ``[1, HQ, M]``, bwd_full_idx ``[1, HQ, M, Wb]``: per KV block, the query blocks
            that read it as a full block, ascending.
        num_sub_blocks: M.
    """

    fwd_mask_cnt: Optional[torch.Tensor]
    fwd_mask_idx: Optional[torch.Tensor]
    fwd_full_cnt: Optional[torch.Tensor]
    fwd_full_idx: Optional[torch.Tensor]
    bwd_mask_cnt: torch.Tensor
    bwd_mask_idx: torch.Tensor
    bwd_full_cnt: torch.Tensor
    bwd_full_idx: torch.Tensor
    num_sub_blocks: int


def compact_rows(dense: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cnt [..., R] int32, idx [..., R, width] int32)``: the True columns of each row, ascending,
    packed to the left; entries past a row's count are unspecified (FA4 reads ``cnt`` of them).
    ``width`` must be at least the largest count."""
    # A stable descending sort of the 0/1 keys keeps the True columns in ascending order: three
    # launches, where a compaction by cumsum and scatter takes ten (the backward plan is built in
    # every backward, and a short micro-batch's backward is bound by its launches).
    order = torch.sort(dense.view(torch.uint8), dim=-1, descending=True, stable=True).indices
    return dense.sum(-1, dtype=torch.int32), order[..., :width].to(torch.int32)


def full_sub_blocks(route: BlockRoute) -> torch.Tensor:
    """``[G, M, M]`` bool: sub-block ``m`` reads sub-block ``n`` as a full block (``n < m``, ``n``'s
    block selected by ``m``'s); the diagonal sub-block, each row's partial one, is left out."""
    G, NB, _ = route.kv_idx.shape
    f = route.layout.block_size // FA4_BLOCK
    sel = torch.zeros(G, NB, NB + 1, dtype=torch.bool, device=route.kv_idx.device)
    sel.scatter_(-1, route.kv_idx.long().remainder(NB + 1), True)  # unused slots (-1) go to column NB
    sel = sel[..., :NB]
    if f > 1:
        sel = sel.repeat_interleave(f, 1).repeat_interleave(f, 2)
    # strictly below the diagonal: also drops, in a block of 256, the second half read by the first
    return sel.tril(-1)


def backward_width(layout: BlockLayout) -> int:
    """Width of the backward's index: the longest list of a KV sub-block, ``f * (the most blocks
    of one sequence) - 1``, since a block's readers are in its sequence (a bound on the host)."""
    f = layout.block_size // FA4_BLOCK
    return max(1, layout.max_blocks_per_seq * f - 1)


@functools.lru_cache(maxsize=16)
def _diagonal_tensors(num_query_heads: int, num_sub_blocks: int, device: torch.device) -> tuple:
    """``(cnt [1, HQ, M], idx [1, HQ, M, 1])``: each sub-block's one partial block, its own. They
    depend on the shape alone, so every layer's backward of a micro-batch reuses one pair."""
    cnt = torch.ones(1, num_query_heads, num_sub_blocks, dtype=torch.int32, device=device)
    idx = torch.arange(num_sub_blocks, dtype=torch.int32, device=device).view(1, 1, num_sub_blocks, 1)
    return cnt, idx.expand(1, num_query_heads, num_sub_blocks, 1).contiguous()


def fa4_block_plan(route: BlockRoute, num_query_heads: int, forward: bool = True) -> FA4BlockPlan:
    """FA4's forward and transposed (backward) block-sparse tensors for ``route``; with
    ``forward=False`` the backward's alone (our forward kernel needs none of FA4's).

    The diagonal sub-block is the one partial block of every row and column; every other
    selected sub-block is full. Index widths are bounds known on the host: ``K * f - 1`` for a
    query block, ``max_blocks_per_seq * f - 1`` for a KV block (its readers are in its sequence).
    """
    lay = route.layout
    R = heads_per_group(route, num_query_heads)
    _, NB, K = route.kv_idx.shape
    f = lay.block_size // FA4_BLOCK
    M = NB * f
    dev = route.kv_idx.device
    full = full_sub_blocks(route)
    diag = list(_diagonal_tensors(num_query_heads, M, dev))  # the partial block, the same in both directions

    def per_head(*tensors):
        return [x.repeat_interleave(R, 0).unsqueeze(0) for x in tensors]

    bwd = diag + per_head(*compact_rows(full.transpose(1, 2), min(M, backward_width(lay))))
    fwd = diag + per_head(*compact_rows(full, max(1, min(M, K * f - 1)))) if forward else [None] * 4
    return FA4BlockPlan(*fwd, *bwd, num_sub_blocks=M)


def fa4_backward_plan(route: BlockRoute, num_query_heads: int) -> FA4BlockPlan:
    """The backward's tensors of :func:`fa4_block_plan` (``forward=False``), built in every layer's
    backward: by one launch of our CUDA extension where it runs on the route's device
    (``fa4_backward_index_cuda``; the torch ops are about twenty launches, 0.4-0.6 ms of host time
    on an H100), else by :func:`fa4_block_plan`. Both give the same counts and the same first ``cnt``
    entries of every row (the rest of a row is unspecified in both)."""
    kv_idx = route.kv_idx
    if not (kv_idx.is_cuda and native.cuda_kernels_run_on(kv_idx.device)):
        return fa4_block_plan(route, num_query_heads, forward=False)
    lay = route.layout
    R = heads_per_group(route, num_query_heads)
    NB = kv_idx.shape[1]
    f = lay.block_size // FA4_BLOCK
    cnt, idx = native.native().fa4_backward_index_cuda(kv_idx.contiguous(), route.kv_cnt.contiguous(), R, f,
                                                       backward_width(lay))
    return FA4BlockPlan(None, None, None, None, *_diagonal_tensors(num_query_heads, NB * f, kv_idx.device),
                        cnt, idx, num_sub_blocks=NB * f)


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


@functools.lru_cache(maxsize=None)
def _fa4_backward():
    """FA4's backward alone: the function its autograd rule calls (there is no public one)."""
    from flash_attn.cute.interface import _flash_attn_bwd

    return _flash_attn_bwd


def import_error() -> Optional[str]:
    """Why flash-attn-4's block-sparse API cannot be imported here, or None when it can."""
    try:
        _fa4()
        _fa4_backward()  # our forward is followed by FA4's backward alone
    except Exception as e:  # ImportError, or the CuTe DSL failing to load its libraries
        hint = ""
        if "cutlass" in str(e):
            hint = (" (installed with pip --target, the CuTe DSL is found only with "
                    "<target>/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH; see docs/FA4.md)")
        return f"flash-attn-4 ({FA4_VERSION}) does not import: {type(e).__name__}: {e}{hint}"
    return None


def _sparse_tensors(mask_cnt, mask_idx, full_cnt, full_idx):
    """One direction's ``BlockSparseTensorsTorch`` in FA4's 128 x 128 blocks."""
    return _fa4()[1](mask_cnt, mask_idx, full_cnt, full_idx, block_size=(FA4_BLOCK, FA4_BLOCK))


def flash_attn_block_sparse(q1, k1, v1, plan: FA4BlockPlan, softmax_scale: float) -> torch.Tensor:
    """One FA4 call on batch-1 tensors ``[1, Tp, H, D]`` with ``plan``'s tensors; returns ``[1, Tp, HQ, D]``."""
    flash_attn_func, _, mask_mod = _fa4()
    fwd = _sparse_tensors(plan.fwd_mask_cnt, plan.fwd_mask_idx, plan.fwd_full_cnt, plan.fwd_full_idx)
    bwd = _sparse_tensors(plan.bwd_mask_cnt, plan.bwd_mask_idx, plan.bwd_full_cnt, plan.bwd_full_idx)
    out = flash_attn_func(q1, k1, v1, softmax_scale=softmax_scale, causal=False, mask_mod=mask_mod,
                          block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd, deterministic=False)
    return out[0] if isinstance(out, tuple) else out


def flash_attn_block_sparse_backward(q1, k1, v1, out1, dout1, lse1, plan: FA4BlockPlan, softmax_scale: float):
    """FA4's backward on batch-1 tensors ``[1, Tp, H, D]`` and ``lse1 [1, HQ, Tp]`` (natural log)
    with ``plan``'s transposed tensors; returns ``(dq, dk, dv)`` in the same layout."""
    bwd = _sparse_tensors(plan.bwd_mask_cnt, plan.bwd_mask_idx, plan.bwd_full_cnt, plan.bwd_full_idx)
    dq, dk, dv = _fa4_backward()(q1, k1, v1, out1, dout1, lse1, softmax_scale, causal=False,
                                 mask_mod=_fa4()[2], block_sparse_tensors=bwd, deterministic=False)
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _own_forward_device(device: torch.device) -> bool:
    """Whether our sm_90a kernels run on ``device`` (a Hopper GPU); asked once per device."""
    return native.wgmma_kernels_for(device) and native.cuda_kernels_run_on(device)


def own_forward_runs_on(q: torch.Tensor) -> bool:
    """Whether our Hopper forward kernel takes ``q`` (its device and head dim; then fa4's forward
    is ours, see the top). Other head dims go to FA4's forward, which has more."""
    return q.is_cuda and q.shape[-1] in cuda_attention.HEAD_DIMS and _own_forward_device(q.device)


def own_forward(q, k, v, route: BlockRoute, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, HQ, D], lse [T, HQ] float32, base 2)`` of our CUDA forward kernel."""
    return cuda_attention.forward_with_lse(q, k, v, route, softmax_scale)


class _Padding:
    """The pack laid out as FA4's padded batch-1 sequence (``Tp`` slots) and back."""

    def __init__(self, layout: BlockLayout, num_sub_blocks: int):
        self.dst = _PADDING.get(layout)
        self.slots = num_sub_blocks * FA4_BLOCK

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` -> ``[1, Tp, ...]``; padding slots are zeros."""
        if self.dst is None:
            return x.contiguous().unsqueeze(0)
        return x.new_zeros(self.slots, *x.shape[1:]).index_copy(0, self.dst, x).unsqueeze(0)

    def unpad(self, x1: torch.Tensor) -> torch.Tensor:
        """``[1, Tp, ...]`` -> ``[T, ...]``."""
        return x1[0] if self.dst is None else x1[0].index_select(0, self.dst)


class _OwnForwardFA4Backward(torch.autograd.Function):
    """Our forward kernel and FA4's backward (Hopper; see the top of the module)."""

    @staticmethod
    def forward(ctx, q, k, v, route: BlockRoute, softmax_scale: float):
        out, lse = own_forward(q, k, v, route, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.route, ctx.softmax_scale = route, softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = fa4_backward_plan(ctx.route, q.shape[1])
        padding = _Padding(ctx.route.layout, plan.num_sub_blocks)
        # padding rows get lse 0: their q, out and dout are zeros, so P is finite and dS = 0
        lse1 = (padding.pad(lse) * LN2).transpose(1, 2).contiguous()
        grads = flash_attn_block_sparse_backward(
            padding.pad(q), padding.pad(k), padding.pad(v), padding.pad(out), padding.pad(dout), lse1, plan,
            ctx.softmax_scale)
        return (*(padding.unpad(g) for g in grads), None, None)


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: BlockRoute, softmax_scale: Optional[float] = None,
    own_forward_kernel: Optional[bool] = None,
) -> torch.Tensor:
    """Block-sparse causal attention (flash-attn-4), our semantics over a THD pack.

    Args:
        q: ``[T, HQ, D]`` bf16/fp16; k, v: ``[T, G, D]``, ``HQ % G == 0``.
        route: the selection; its layout's block size must be 128 or 256.
        softmax_scale: defaults to ``1/sqrt(D)``.
        own_forward_kernel: the forward by our CUDA kernel (True) or FA4's (False); None: ours
            where it takes ``q`` (:func:`own_forward_runs_on`).
    Returns:
        ``[T, HQ, D]``, differentiable with respect to q, k and v (non-deterministic backward).
    """
    lay = route.layout
    check_block_size(lay.block_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if own_forward_kernel is None:
        own_forward_kernel = own_forward_runs_on(q)
    if own_forward_kernel:
        return _OwnForwardFA4Backward.apply(q, k, v, route, float(softmax_scale))
    plan = fa4_block_plan(route, q.shape[1])
    padding = _Padding(lay, plan.num_sub_blocks)
    out1 = flash_attn_block_sparse(padding.pad(q), padding.pad(k), padding.pad(v), plan, float(softmax_scale))
    return padding.unpad(out1)
