"""The MoBA router: block pooling, block scores, top-k selection, coverage.

Owns the selection half of the sparse-attention contract (DESIGN.md §2); the attention
kernels only consume its output, a :class:`BlockRoute`. Everything here is plain PyTorch and
runs on any device; it is the oracle that the C++ index kernels and the GPU router are tested
against.

Shape legend: T tokens, HQ query heads, G KV-head groups, D head dim, NB blocks in the pack,
K the largest budget of the pack.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_sparsebalance.ops.layout import BlockLayout


@dataclass
class BlockRoute:
    """Which KV blocks every query block attends to, per KV-head group.

    Attributes:
        layout: the block layout of the pack.
        kv_idx: ``[G, NB, K]`` int32, selected KV blocks (global block ids, ascending, the
            diagonal block always included), padded with -1.
        kv_cnt: ``[G, NB]`` int32, number of valid entries of ``kv_idx``.
        budgets: the budgets it was selected with: ``[N]`` int64 on the host, or on the device
            when DST's coverage bound chose them there.
    """

    layout: BlockLayout
    kv_idx: torch.Tensor
    kv_cnt: torch.Tensor
    budgets: torch.Tensor
    _transposed: Optional[tuple] = None

    @property
    def num_groups(self) -> int:
        return self.kv_idx.shape[0]

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-KV-block index for backward: ``(q_ptr [G*NB+1] int32, q_idx [nnz] int32)``.

        Query blocks that selected KV block ``j`` of group ``g`` are
        ``q_idx[q_ptr[g*NB + j] : q_ptr[g*NB + j + 1]]``, ascending.
        """
        if self._transposed is None:
            self._transposed = transpose_route_index(self.kv_idx, self.kv_cnt)
        return self._transposed

    def kept_blocks(self) -> int:
        """Number of (group, query block, KV block) triples computed: the sparse work."""
        return int(self.kv_cnt.sum())


def pool_blocks(x: torch.Tensor, layout: BlockLayout, num_groups: int) -> torch.Tensor:
    """Mean of ``x`` over the tokens of each block and over the heads of each group.

    Args:
        x: ``[T, H, D]`` with ``H`` a multiple of ``num_groups`` (heads of a group contiguous).
    Returns:
        ``[NB, G, D]`` float32.
    """
    T, H, D = x.shape
    sums = torch.zeros(layout.num_blocks, H, D, dtype=torch.float32, device=x.device)
    sums.index_add_(0, layout.token_block, x.float())
    pooled = sums / layout.block_lengths[:, None, None]
    return pooled.view(layout.num_blocks, num_groups, H // num_groups, D).mean(2)


def block_scores(q: torch.Tensor, k: torch.Tensor, layout: BlockLayout,
                 pooled_query: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Router scores ``s(i, j) = pooled_q(i, g) . pooled_k(j, g) / sqrt(D)``.

    Args:
        q: ``[T, HQ, D]``; k: ``[T, G, D]``.
        pooled_query: maps this rank's pooled queries ``[NB, G, D]`` to the group's (a KV group
            whose query heads are split over tensor-parallel ranks pools all of them).
    Returns:
        ``[G, NB, NB]`` float32; ``-inf`` where ``j`` is not a candidate of ``i``.
    """
    G = k.shape[1]
    with torch.no_grad():
        pq = pool_blocks(q, layout, G)
        if pooled_query is not None:
            pq = pooled_query(pq)
        pk = pool_blocks(k, layout, G)
        scores = torch.einsum("igd,jgd->gij", pq, pk) / math.sqrt(q.shape[-1])
        return torch.where(layout.candidates, scores, float("-inf"))


def validate_budgets(budgets: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``[N]`` int64 budgets on the host (checked there, so no device sync)."""
    budgets = torch.as_tensor(budgets, dtype=torch.int64).reshape(-1).cpu()
    if budgets.numel() == 1 and layout.num_seqs != 1:
        budgets = budgets.expand(layout.num_seqs)
    if budgets.numel() != layout.num_seqs:
        raise ValueError(f"budgets has {budgets.numel()} entries for {layout.num_seqs} sequences")
    if budgets.numel() and int(budgets.min()) < 1:
        raise ValueError(f"budget (--moba-topk / DST budget) must be >= 1, got {int(budgets.min())}")
    return budgets


def block_budgets(budgets, layout: BlockLayout, device) -> tuple[torch.Tensor, Optional[int]]:
    """``[NB]`` int64 budget of every block on ``device``, and the largest budget when it is known on the host.

    Nothing here waits for the device. Host budgets (an int, a list or a CPU tensor, one per
    sequence) are validated on the host; a uniform budget is filled in on the device and a mixed
    one is copied from pinned memory without blocking (a copy from pageable memory would make the
    host wait for the device's whole queue, once per layer). A 0-dim or ``[N]`` budget already on
    the device (the coverage bound's choice) is taken as it is, and its maximum is not known.
    """
    if isinstance(budgets, torch.Tensor) and budgets.device.type != "cpu":
        per_seq = budgets.reshape(-1).to(device=device, dtype=torch.int64)
        if per_seq.numel() == 1:
            return per_seq.expand(layout.num_blocks), None
        if per_seq.numel() != layout.num_seqs:
            raise ValueError(f"budgets has {per_seq.numel()} entries for {layout.num_seqs} sequences")
        return per_seq[layout.block_seq], None
    host = validate_budgets(budgets, layout)
    kmax = int(host.max()) if host.numel() else 1
    if host.numel() == 0 or bool((host == host[0]).all()):
        return torch.full((layout.num_blocks,), kmax, dtype=torch.int64, device=device), kmax
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)[layout.block_seq], kmax
    return host.to(device)[layout.block_seq], kmax


def select_blocks(scores: torch.Tensor, layout: BlockLayout, budgets, kmax: Optional[int] = None) -> BlockRoute:
    """Top-(k-1) candidates by score plus the diagonal block, per (group, query block).

    Ties in score go to the lower block index, so every implementation selects the same set.

    Args:
        scores: ``[G, NB, NB]`` from :func:`block_scores`.
        budgets: ``[N]`` (or a scalar) budget per sequence, each >= 1: on the host, or on the
            device (then ``kmax`` is required).
        kmax: an upper bound of the budgets, the width of ``kv_idx`` (default: their maximum).
    """
    G, NB, _ = scores.shape
    device = scores.device
    blk_budget, host_kmax = block_budgets(budgets, layout, device)
    if kmax is None:
        if host_kmax is None:
            raise ValueError("select_blocks: budgets on the device need kmax, an upper bound of them")
        kmax = host_kmax
    kmax = max(1, min(int(kmax), layout.max_blocks_per_seq))
    diag = torch.arange(NB, device=device).view(1, NB, 1).expand(G, NB, 1)
    if kmax > 1:
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : kmax - 1]
        top = scores.gather(-1, order)
        rank = torch.arange(kmax - 1, device=device)
        keep = (rank.view(1, 1, -1) < (blk_budget - 1).view(1, NB, 1)) & torch.isfinite(top)
        chosen = torch.where(keep, order, torch.full_like(order, NB))  # NB sorts after every real id
        kv = torch.sort(torch.cat([chosen, diag], -1), dim=-1).values
        cnt = keep.sum(-1) + 1
    else:
        kv = diag.clone()
        cnt = torch.ones(G, NB, dtype=torch.int64, device=device)
    kv = torch.where(kv >= NB, torch.full_like(kv, -1), kv)
    return BlockRoute(layout, kv.to(torch.int32).contiguous(), cnt.to(torch.int32).contiguous(), budgets)


def transpose_route_index(kv_idx: torch.Tensor, kv_cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of query blocks per (group, KV block); see :meth:`BlockRoute.transposed`."""
    G, NB, K = kv_idx.shape
    device = kv_idx.device
    valid = kv_idx >= 0
    g = torch.arange(G, device=device).view(G, 1, 1).expand(G, NB, K)
    i = torch.arange(NB, device=device).view(1, NB, 1).expand(G, NB, K)
    key = (g * NB + kv_idx.long())[valid]
    qi = i[valid]
    order = torch.argsort(key, stable=True)
    q_ptr = torch.zeros(G * NB + 1, dtype=torch.int64, device=device)
    q_ptr[1:] = torch.cumsum(torch.bincount(key, minlength=G * NB), 0)
    return q_ptr.to(torch.int32), qi[order].to(torch.int32)


def coverage_curve(scores: torch.Tensor, kmax: int) -> torch.Tensor:
    """``C(k)`` for ``k = 1..kmax``: routing mass kept by a budget of ``k`` blocks.

    For each (group, query block) with at least one candidate, the softmax of its scores over
    its candidates; ``C(k)`` is the mass of the top-(k-1) candidates (the diagonal block is
    always kept and is not a candidate), averaged over those (group, query block) pairs. Query
    blocks without candidates (the first block of each sequence) carry no information and are
    left out; a pack with none at all has ``C = 1``.

    Returns:
        ``[kmax]`` float32 on the device of ``scores``; non-decreasing, exactly 1 once ``k - 1``
        covers every candidate of every query block.
    """
    if kmax < 1:
        raise ValueError(f"kmax must be >= 1, got {kmax}")
    G, NB, _ = scores.shape
    finite = torch.isfinite(scores)
    ncand = finite.sum(-1).reshape(-1)  # [G*NB]
    # Rows without candidates are masked out of the mean rather than indexed away: boolean
    # indexing (and testing whether any row is left) would stop the host once per layer.
    valid = ncand > 0
    s = torch.where(valid.view(-1, 1), scores.reshape(G * NB, NB), torch.zeros((), device=scores.device))
    probs = torch.softmax(s, dim=-1)
    width = max(1, min(kmax - 1, NB))
    top = torch.topk(probs, width, dim=-1).values
    cum = torch.cumsum(top, -1)
    k = torch.arange(1, kmax + 1, device=scores.device)
    take = torch.minimum((k - 1).view(1, -1), ncand.view(-1, 1))  # candidates kept, [rows, kmax]
    got = cum.gather(-1, (take - 1).clamp(min=0, max=width - 1))
    got = torch.where(take == 0, torch.zeros_like(got), got)
    got = torch.where(take >= ncand.view(-1, 1), torch.ones_like(got), got)
    n_valid = valid.sum()
    mean = (got * valid.view(-1, 1)).sum(0) / n_valid.clamp(min=1)
    return torch.where(n_valid > 0, mean, torch.ones_like(mean))


def coverage_bounded_budget(curve: torch.Tensor, k_request: int, k_base: int, p: Optional[float]) -> torch.Tensor:
    """The budget a layer uses when DST asks for ``k_request`` (DESIGN.md §4, step 4).

    Growth (``k_request >= k_base``) is taken as asked. A shrink is taken unless it loses more
    than ``p`` of coverage against ``k_base``; then the smallest ``k`` within ``p`` is used.
    ``curve`` is :func:`coverage_curve` with at least ``k_base`` entries.

    Returns:
        0-dim int64 on the device of ``curve``. The choice is made there: reading the curve on
        the host would stop it in every layer of every shrunk micro-batch.
    """
    if p is None or k_request >= k_base:
        return torch.full((), k_request, dtype=torch.int64, device=curve.device)
    if curve.numel() < k_base:
        raise ValueError(f"coverage curve has {curve.numel()} entries, needs k_base={k_base}")
    loss = curve[k_base - 1] - curve[k_request - 1 : k_base]  # coverage lost at k = k_request..k_base
    # loss is non-increasing in k and 0 at k_base, so the first k within p exists; argmax finds it.
    return k_request + torch.argmax((loss <= p + 1e-7).to(torch.int32))
