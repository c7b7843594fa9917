"""SAB, sparsity-aware batching: how one global batch is split over DP ranks and micro-batches.

Owns DESIGN.md §5. Per global batch, from the samples' lengths alone (no communication, so every
rank computes the same plan):

1. **Weights.** A sample's weight is its predicted cost in a pack at the budget DST is expected to
   give it: the :class:`SparsityEstimator` keeps, per length bin, an EMA of the budgets DST
   actually used (starting at ``k_base``). The weight is the *marginal* cost of the sequence in a
   pack, ``predict([L, L], k) - predict([L], k)``, so the fixed cost is counted once per pack, not
   once per sequence: a micro-batch's predicted time is ``overhead + sum(weights)`` exactly for the
   analytic model (additive over sequences) and approximately for the profiled one, which reads a
   pack's attention from its total block pairs (balance/latency.py). ``BatchPlan.loads`` are
   ``overhead + sum(weights)``. ``--batching lbb`` weighs by length,
   ``none`` keeps arrival order.
2. **Two-level partition.** The DP ranks first (balanced total weight, each rank with at least
   as many samples as it has micro-batches and at most as many tokens as they can hold), then
   each rank's samples into its fixed number of micro-batches (balanced weight, at most
   ``--micro-batch-tokens`` tokens each). Both levels use :func:`balanced_partition`: LPT
   (longest processing time first) followed by pairwise improvement (moves and swaps out of the
   heaviest part), and where that stalls above :func:`partition_lower_bound`, MULTIFIT (best
   fit under a bisected capacity) improved the same way, the better of the two kept. Samples
   never leave their global batch.
3. **Pipeline order** of each rank's micro-batches (``--micro-batch-order``): see
   :func:`pipeline_order` (and :func:`simulated_order`, which searches the order on the simulated
   1F1B with each stage's predicted cost).

``--batching hydraulis`` replaces step 2 with Hydraulis's pipeline-aware objectives (arXiv
2412.07894): samples to the replica minimising the largest ``sum + (PP - 1) * max`` of predicted
costs (:func:`assign_replicas`), then each replica's packs, their number chosen per global batch
under ``--variable-micro-batches`` (:func:`choose_micro_batch_count`).

The result is a :class:`BatchPlan`; :class:`SparsityAwareBatcher` holds the method, the latency
model and the estimator, and its state (the estimator) is checkpointed with the sampler's.
"""
from __future__ import annotations

import bisect
import heapq
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

BATCHING_METHODS = ("sab", "lbb", "none", "hydraulis")
COUNT_OBJECTIVES = ("hydraulis", "simulated")
MICRO_BATCH_ORDERS = ("light-ends", "descending", "ascending", "as-planned", "simulated")
# Swap passes of ``--micro-batch-order simulated``'s search; each pass tries every pair once.
ORDER_SEARCH_PASSES = 4
# Upper edges of the estimator's length bins (tokens): powers of two, because DST's budget choice
# follows the attention cost, which changes shape with length on a log scale (quadratic while a
# sequence has fewer blocks than k, linear after).
DEFAULT_LENGTH_BINS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class PartitionError(ValueError):
    """No partition satisfies the constraints (token cap, sample counts)."""


# --------------------------------------------------------------------------------------------
# The sparsity estimator


class SparsityEstimator:
    """Expected DST budget per sequence-length bin: an EMA of the budgets DST used.

    ``update`` must be fed the same numbers on every rank (e.g. DST's per-micro-batch budgets,
    identical by construction, or layer budgets after an all-reduce), otherwise the ranks'
    estimates, and with them their plans, drift apart; :meth:`fingerprint` lets a run check.

    Args:
        k_base: the starting estimate of every bin (``--moba-topk``).
        decay: weight of the old estimate in the EMA (``--sab-ema``); one EMA step per bin per
            :meth:`update` call (one global batch), whatever the number of samples in the bin.
        bins: upper edges of the length bins; lengths beyond the last edge share one more bin.
    """

    def __init__(self, k_base: int, decay: float = 0.8, bins: Sequence[int] = DEFAULT_LENGTH_BINS):
        if k_base < 1:
            raise ValueError(f"--moba-topk must be >= 1, got {k_base}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"--sab-ema must be in [0, 1), got {decay}")
        edges = tuple(int(b) for b in bins)
        if not edges or any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] < 1:
            raise ValueError(f"--sab-length-bins must be strictly increasing positive lengths, got {list(bins)}")
        self.k_base = int(k_base)
        self.decay = float(decay)
        self.edges = edges
        self.values = [float(k_base)] * (len(edges) + 1)
        self.counts = [0] * (len(edges) + 1)

    def bin_of(self, length: int) -> int:
        return bisect.bisect_left(self.edges, int(length))

    def estimate(self, length: int) -> float:
        return self.values[self.bin_of(length)]

    def update(self, lengths: Sequence[int], budgets: Sequence[float]) -> None:
        """One EMA step per bin from the budgets (one per sequence) DST used for ``lengths``."""
        if len(lengths) != len(budgets):
            raise ValueError(f"update needs one budget per length, got {len(lengths)} lengths and {len(budgets)} budgets")
        sums: dict[int, float] = {}
        counts: dict[int, int] = {}
        for n, k in zip(lengths, budgets):
            if not (k > 0 and math.isfinite(k)):
                raise ValueError(f"budgets must be positive and finite, got {k}")
            b = self.bin_of(n)
            sums[b] = sums.get(b, 0.0) + float(k)
            counts[b] = counts.get(b, 0) + 1
        for b in sorted(sums):
            self.values[b] = self.decay * self.values[b] + (1.0 - self.decay) * sums[b] / counts[b]
            self.counts[b] += counts[b]

    def update_from_plan(self, plan: "BatchPlan", budgets: Sequence[Sequence[float]]) -> None:
        """``budgets[r][j]``: the budget micro-batch ``j`` of DP rank ``r`` ran with."""
        lengths, ks = [], []
        for r, rank in enumerate(plan.micro_batches):
            if len(budgets[r]) != len(rank):
                raise ValueError(f"rank {r}: {len(rank)} micro-batches but {len(budgets[r])} budgets")
            for j, mb in enumerate(rank):
                for i in mb:
                    lengths.append(plan.length_of[i])
                    ks.append(budgets[r][j])
        self.update(lengths, ks)

    def state_dict(self) -> dict:
        return {"k_base": self.k_base, "decay": self.decay, "bins": list(self.edges),
                "values": list(self.values), "counts": list(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        if list(state["bins"]) != list(self.edges):
            raise ValueError(f"--sab-length-bins {list(self.edges)} differ from the checkpoint's {list(state['bins'])}")
        if len(state["values"]) != len(self.values):
            raise ValueError("the checkpoint's estimator has a different number of bins")
        self.values = [float(v) for v in state["values"]]
        self.counts = [int(c) for c in state["counts"]]

    def fingerprint(self) -> str:
        return hashlib.sha1(json.dumps(self.state_dict(), sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# The solver


def balanced_partition(
    weights: Sequence[float],
    parts: int,
    tokens: Optional[Sequence[int]] = None,
    token_cap: Optional[float] = None,
    min_count: int = 1,
    max_count: Optional[int] = None,
    improve: bool = True,
    max_rounds: Optional[int] = None,
    tolerance: float = 1e-3,
) -> list[list[int]]:
    """Split items ``0..n-1`` into ``parts`` lists minimising the largest total weight.

    Constraints: each part's token total at most ``token_cap``, between ``min_count`` and
    ``max_count`` items. LPT places items heaviest first, each into the lightest part that can
    still take it (and, once the items left are just enough to fill the parts still below
    ``min_count``, only into those). Then pairwise improvement (:func:`_improve`): the heaviest
    part gives an item to another part, or swaps one of its items for a lighter one, choosing
    each time the exchange that leaves the smaller maximum of the two parts; when it is stuck,
    the lightest part takes weight from a heavier one to unblock it.

    When that stalls above the target, a second start: MULTIFIT (:func:`_multifit`, best-fit
    packings under a bisected capacity), improved the same way; the lighter maximum wins (LPT on
    a tie). Neither start dominates: with many items per part LPT's exchanges reach the bound and
    best fit's packings (parts of look-alike items) leave less to exchange; with few items per
    part, LPT's last small items land beside large ones for good and best fit avoids that.

    The improvement stops early once the heaviest part reaches :func:`partition_lower_bound`, or
    the mean plus ``tolerance`` (relative) when that is higher: 0.1% is below the noise of any
    measured step time, and a perfectly even split is rarely possible. A bound above the mean (a
    sample heavier than the mean, forced pairs) often is reached exactly, and 0.1% above it can
    cross a target such as 1.05 x the mean for no reason. Reaching the target is also what skips
    the second start, so easy batches cost what LPT costs.

    Deterministic (no randomness; ties go to the lower item and part index), so every rank
    computes the same partition. Returns each part's items, ascending. ``improve=False``: LPT's
    placement alone. Raises :class:`PartitionError` when LPT finds no part for an item.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    t = np.zeros(n) if tokens is None else np.asarray(tokens, dtype=np.float64)
    cap = math.inf if token_cap is None else float(token_cap)
    max_count = n if max_count is None else int(max_count)
    if parts < 1:
        raise PartitionError(f"need at least one part, got {parts}")
    if n < parts * min_count or n > parts * max_count:
        raise PartitionError(f"{n} items cannot fill {parts} parts with {min_count}..{max_count} items each")
    if len(t) != n:
        raise PartitionError("one token count per item is needed")
    if n and t.max() > cap:
        raise PartitionError(f"an item of {int(t.max())} tokens exceeds the token cap {cap:g}")

    order = sorted(range(n), key=(-w).tolist().__getitem__)  # heaviest first; stable: ties by index
    best = _lpt(w, t, parts, cap, min_count, max_count, order)
    if improve and parts > 1:
        target = max(partition_lower_bound(w, parts), (1.0 + tolerance) * float(w.sum()) / parts)
        rounds = max_rounds or 20 * n + 100
        lpt_max = float(best[1].max())
        _improve(w, t, cap, min_count, max_count, *best, target, rounds)
        if best[1].max() > target:
            packed = _multifit(w, t, parts, cap, min_count, max_count, order, target, lpt_max)
            if packed is not None:
                _improve(w, t, cap, min_count, max_count, *packed, target, rounds)
                if packed[1].max() < best[1].max():
                    best = packed
    out: list[list[int]] = [[] for _ in range(parts)]
    for i, b in enumerate(best[0].tolist()):
        out[b].append(i)
    return out


def _lpt(w, t, parts, cap, min_count, max_count, order):
    """LPT with constraints: a heap of (load, part); parts that cannot take the item are set
    aside for that item only. Pure Python: a few hundred items and parts are too few for numpy's
    per-call overhead to pay off."""
    n = len(w)
    wl, tl = w.tolist(), t.tolist()
    load = [0.0] * parts
    toks = [0.0] * parts
    count = [0] * parts
    assign = [0] * n
    heap = [(0.0, b) for b in range(parts)]
    need = parts * min_count  # items still owed to parts below min_count
    for step, i in enumerate(order):
        restrict = n - step <= need
        aside = []
        while heap:
            lb, b = heapq.heappop(heap)
            if toks[b] + tl[i] <= cap and (not restrict or count[b] < min_count):
                break
            aside.append((lb, b))
        else:
            raise PartitionError(
                f"no part can take an item of {int(tl[i])} tokens (token cap {cap:g}, parts' tokens "
                f"{sorted(int(x) for x in toks)})")
        if count[b] < min_count:
            need -= 1
        assign[i] = b
        load[b] += wl[i]
        toks[b] += tl[i]
        count[b] += 1
        if count[b] < max_count:  # a full part never comes back
            heapq.heappush(heap, (load[b], b))
        for entry in aside:
            heapq.heappush(heap, entry)
    return (np.asarray(assign, dtype=np.int64), np.asarray(load), np.asarray(toks),
            np.asarray(count, dtype=np.int64))


def _multifit(w, t, parts, cap, min_count, max_count, order, lower, upper, passes=10):
    """MULTIFIT: bisection on a weight capacity between ``lower`` and ``upper`` (LPT's maximum),
    each candidate tried by :func:`_best_fit`; the packing of the lowest capacity that succeeded,
    or None when none did. Ten passes narrow the bracket a thousandfold (a few % to a few
    0.001%) for ~1.3 ms on 256 items.

    Why beside LPT: LPT gives the last (lightest) items to the lightest parts, whatever those
    already hold. With few items per part (longtail, 64 micro-batches of 4 samples) that pairs
    a sample of 0.94 x the mean with one of 0.12, and no single move or swap repairs it
    afterwards (every part the small one could go to is full). Best fit under a capacity leaves
    such a sample alone and sends the small one where it fits.
    """
    wl, tl = w.tolist(), t.tolist()
    best = None
    for _ in range(passes):
        if upper <= lower:
            break
        capacity = 0.5 * (lower + upper)
        packed = _best_fit(wl, tl, parts, cap, min_count, max_count, order, capacity)
        if packed is None:
            lower = capacity
        else:
            best, upper = packed, float(packed[1].max())
    return best


def _best_fit(wl, tl, parts, cap, min_count, max_count, order, capacity):
    """Best-fit decreasing: each item, heaviest first, into the fullest part it still fits (weight
    at most ``capacity``, the token cap, ``max_count``; the same ``min_count`` rule as
    :func:`_lpt`). None when an item fits nowhere. The open parts' loads are kept sorted, so the
    best fit is a bisection (plain floats: tuples would double the time)."""
    n = len(wl)
    load = [0.0] * parts
    toks = [0.0] * parts
    count = [0] * parts
    assign = [0] * n
    open_loads, open_parts = [0.0] * parts, list(range(parts))  # ascending load
    need = parts * min_count
    for step, i in enumerate(order):
        restrict = n - step <= need
        j = bisect.bisect_right(open_loads, capacity - wl[i]) - 1
        while j >= 0:
            b = open_parts[j]
            if toks[b] + tl[i] <= cap and (not restrict or count[b] < min_count):
                break
            j -= 1
        else:
            return None
        del open_loads[j], open_parts[j]
        if count[b] < min_count:
            need -= 1
        assign[i] = b
        load[b] += wl[i]
        toks[b] += tl[i]
        count[b] += 1
        if count[b] < max_count:
            k = bisect.bisect_right(open_loads, load[b])
            open_loads.insert(k, load[b])
            open_parts.insert(k, b)
    return (np.asarray(assign, dtype=np.int64), np.asarray(load), np.asarray(toks),
            np.asarray(count, dtype=np.int64))


# Light exchanges tried in a row before the improvement gives up. Allowing ``parts`` of them (up
# to 64 here, ~3 ms on a hard batch) instead of 4 changed the heaviest part in 1 of 1,500
# benchmark-like batches (by 0.04%) and in none of 383 token-capped ones, once MULTIFIT is there
# to restart from.
LIGHT_EXCHANGES_PER_STALL = 4


def _improve(w, t, cap, min_count, max_count, assign, load, toks, count, target, max_rounds) -> None:
    """Pairwise improvement of an assignment, in place (see :func:`balanced_partition`).

    Alternates two kinds of exchange (a move of one item, or a swap of two) between a pivot part
    and any other part: the heaviest part sheds weight (the pair's new maximum must be below the
    old one), and when it cannot, the lightest part takes weight from any heavier part (the
    pair's new minimum must be above the old one), which frees room in the parts that blocked
    the heaviest one. Every exchange narrows the two parts' spread, so the sum of squared part
    weights strictly decreases and the loop ends; the light phase may run at most
    :data:`LIGHT_EXCHANGES_PER_STALL` exchanges in a row without the heaviest part improving.
    Stops early once the heaviest part reaches ``target`` (see :func:`balanced_partition`).
    """
    n, parts = len(w), len(load)
    idx = np.arange(n)
    eps = 1e-12 * max(float(load.max()), 1e-300)
    light_streak = 0
    for _ in range(max_rounds):
        a = int(np.argmax(load))
        if load[a] <= target:
            return
        best = _heavy_exchange(a, w, t, cap, min_count, max_count, assign, load, toks, count, idx, eps)
        if best is None:
            if light_streak >= min(parts, LIGHT_EXCHANGES_PER_STALL):
                return
            best = _light_exchange(int(np.argmin(load)), w, t, cap, min_count, max_count, assign, load, toks, count, idx, eps)
            if best is None:
                return
            light_streak += 1
        else:
            light_streak = 0
        giver, x, receiver, y = best
        load[giver] -= w[x]; load[receiver] += w[x]
        toks[giver] -= t[x]; toks[receiver] += t[x]
        assign[x] = receiver
        if y is None:
            count[giver] -= 1; count[receiver] += 1
        else:
            load[giver] += w[y]; load[receiver] -= w[y]
            toks[giver] += t[y]; toks[receiver] -= t[y]
            assign[y] = giver


def _heavy_exchange(a, w, t, cap, min_count, max_count, assign, load, toks, count, idx, eps):
    """The exchange out of part ``a`` leaving the lowest maximum of the pair, if below ``load[a]``:
    ``(giver, item, receiver, item given back or None)``."""
    top = load[a]
    mine = idx[assign == a]
    wa, ta = w[mine], t[mine]
    best, best_score = None, top - eps
    if count[a] > min_count:  # moves: an item of a into part c
        score = np.maximum(top - wa[:, None], load[None, :] + wa[:, None])
        valid = (toks[None, :] + ta[:, None] <= cap) & (count < max_count)[None, :]
        valid[:, a] = False
        score = np.where(valid, score, np.inf)
        p = int(np.argmin(score))
        if score.flat[p] < best_score:
            best_score, best = score.flat[p], (a, mine[p // len(load)], p % len(load), None)
    other = idx[assign != a]
    if len(other):  # swaps: item x of a for a lighter item y of part c
        wb, tb, cb = w[other], t[other], assign[other]
        d = wa[:, None] - wb[None, :]
        score = np.maximum(top - d, load[cb][None, :] + d)
        valid = (d > 0) & (toks[cb][None, :] + ta[:, None] - tb[None, :] <= cap) & (toks[a] - ta[:, None] + tb[None, :] <= cap)
        score = np.where(valid, score, np.inf)
        p = int(np.argmin(score))
        if score.flat[p] < best_score:
            y = other[p % len(other)]
            best_score, best = score.flat[p], (a, mine[p // len(other)], int(assign[y]), y)
    return best


def _light_exchange(e, w, t, cap, min_count, max_count, assign, load, toks, count, idx, eps):
    """The exchange into part ``e`` leaving the highest minimum of the pair, if above ``load[e]``."""
    low = load[e]
    other = idx[assign != e]
    if not len(other):
        return None
    wb, tb, cb = w[other], t[other], assign[other]
    best, best_score = None, low + eps
    if count[e] < max_count:  # moves: an item x of part c into e
        score = np.minimum(low + wb, load[cb] - wb)
        valid = (toks[e] + tb <= cap) & (count[cb] > min_count)
        score = np.where(valid, score, -np.inf)
        p = int(np.argmax(score))
        if score[p] > best_score:
            x = other[p]
            best_score, best = score[p], (int(assign[x]), x, e, None)
    mine = idx[assign == e]
    if len(mine):  # swaps: item x of part c for a lighter item y of e
        wa, ta = w[mine], t[mine]
        d = wb[None, :] - wa[:, None]
        score = np.minimum(low + d, load[cb][None, :] - d)
        valid = (d > 0) & (toks[e] - ta[:, None] + tb[None, :] <= cap) & (toks[cb][None, :] - tb[None, :] + ta[:, None] <= cap)
        score = np.where(valid, score, -np.inf)
        p = int(np.argmax(score))
        if score.flat[p] > best_score:
            x = other[p % len(other)]
            best_score, best = score.flat[p], (int(assign[x]), x, e, mine[p // len(other)])
    return best


def partition_lower_bound(weights: Sequence[float], parts: int) -> float:
    """A lower bound on the heaviest part of any partition of (non-negative) ``weights`` into ``parts``.

    The mean; the heaviest item; for every ``q >= 1``, among the ``q*parts + 1`` heaviest items
    some part holds ``q + 1`` (pigeonhole), so it weighs at least the ``q + 1`` lightest of them;
    and the pairing bound. Among the ``k`` heaviest items, ``parts < k <= 2*parts``, either some
    part holds three (so weighs at least their three lightest), or none does and then at least
    ``r = k - parts`` parts hold two: ``r`` disjoint pairs, each inside one part. Of all ``r``
    disjoint pairs of those items, the ``2r`` lightest paired heaviest-with-lightest have the
    lightest heaviest pair (replacing items by lighter ones only lowers sums; then the classic
    exchange argument). The pairing bound is what the pigeonhole misses when a few more heavy
    samples than micro-batches must share: 47 samples of 0.36..0.72 x the mean in 32 parts force
    15 pairs, and their best pairing reaches 1.051 x the mean where the pigeonhole says 1.016.
    """
    w = np.sort(np.asarray(weights, dtype=np.float64))[::-1]
    n = len(w)
    if not n:
        return 0.0
    bound = max(float(w.sum()) / parts, float(w[0]))
    q = np.arange(1, (n - 1) // parts + 1)
    if len(q):
        c = np.concatenate([[0.0], np.cumsum(w)])
        top = q * parts + 1
        bound = max(bound, float((c[top] - c[top - q - 1]).max()))
    k = np.arange(parts + 1, min(n, 2 * parts) + 1)
    if len(k):
        r = k - parts
        i = np.arange(parts)[None, :]
        pair = w[np.minimum(2 * parts - k[:, None] + i, n - 1)] + w[np.maximum(k[:, None] - 1 - i, 0)]
        worst_pair = np.where(i < r[:, None], pair, -np.inf).max(axis=1)
        three = np.where(k >= 3, w[k - 1] + w[k - 2] + w[np.maximum(k - 3, 0)], np.inf)
        bound = max(bound, float(np.minimum(worst_pair, three).max()))
    return bound


def contiguous_chunks(n: int, parts: int) -> list[list[int]]:
    """``0..n-1`` in order, cut into ``parts`` runs whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def arrival_order_chunks(lengths: Sequence[int], parts: int, token_cap: Optional[int]) -> Optional[list[list[int]]]:
    """``--batching none``: positions ``0..n-1`` in arrival order, cut into ``parts`` non-empty runs.

    Without a cap (or when it holds) this is :func:`contiguous_chunks`: sample counts differ by at
    most one, what a fixed ``--micro-batch-size`` gives. When an even cut would put more than
    ``token_cap`` tokens in a run, the cut points move: among the cuts whose runs all fit, the one
    whose counts are closest to even (least sum of squared deviations; a dynamic program over
    cut points, run only in that case). ``None`` when no cut fits.
    """
    n = len(lengths)
    even = contiguous_chunks(n, parts)
    if token_cap is None or all(sum(lengths[i] for i in run) <= token_cap for run in even):
        return even
    prefix = np.concatenate([[0], np.cumsum(lengths)])
    target = n / parts
    inf = float("inf")
    # best[j][e]: least cost of cutting positions 0..e-1 into j runs; back[j][e]: where run j starts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[-1] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for j in range(1, parts + 1):
        for e in range(j, n - (parts - j) + 1):
            for s in range(e - 1, j - 2, -1):
                if prefix[e] - prefix[s] > token_cap:
                    break  # longer runs only add tokens
                if best[j - 1][s] == inf:
                    continue
                cost = best[j - 1][s] + (e - s - target) ** 2
                if cost < best[j][e]:
                    best[j][e], back[j][e] = cost, s
    if best[parts][n] == inf:
        return None
    runs, e = [], n
    for j in range(parts, 0, -1):
        s = back[j][e]
        runs.append(list(range(s, e)))
        e = s
    return runs[::-1]


def pipeline_order(loads: Sequence[float], rule: str = "light-ends",
                   stage_loads: Optional[Sequence[Sequence[float]]] = None) -> list[int]:
    """Execution order of one rank's micro-batches through the pipeline (indices into ``loads``).

    ``light-ends`` (default): the lightest micro-batch first, the second lightest last, then
    alternately inwards, so the heaviest run in the middle. In 1F1B with ``P`` stages the first
    micro-batch's forward crosses ``P - 1`` stages before the last stage has any work (warm-up)
    and the last micro-batch's backward crosses them again while earlier stages idle
    (cool-down); those two are paid ``P - 1`` times, every other micro-batch overlaps with
    others. benchmarks/batching.py simulates 1F1B with each rule (docs/BATCHING.md).
    ``descending``/``ascending``: sorted by load; ``as-planned``: the solver's order;
    ``simulated``: :func:`simulated_order` from ``light-ends``, on ``stage_loads``
    (``[micro-batch][stage] -> ms``, required for it).
    """
    if rule not in MICRO_BATCH_ORDERS:
        raise ValueError(f"--micro-batch-order must be one of {MICRO_BATCH_ORDERS}, got {rule!r}")
    if rule == "simulated":
        if stage_loads is None or len(stage_loads) != len(loads):
            raise ValueError("--micro-batch-order simulated needs each micro-batch's cost per stage")
        return simulated_order(stage_loads, pipeline_order(loads, "light-ends"))
    m = len(loads)
    asc = sorted(range(m), key=lambda j: (loads[j], j))
    if rule == "as-planned":
        return list(range(m))
    if rule == "ascending":
        return asc
    if rule == "descending":
        return asc[::-1]
    order = [0] * m
    lo, hi = 0, m - 1
    for rank, j in enumerate(asc):
        if rank % 2 == 0:
            order[lo] = j
            lo += 1
        else:
            order[hi] = j
            hi -= 1
    return order


def pack_stage_loads(packs: Sequence[Sequence[int]], lengths: Sequence[int], loads: Sequence[float],
                     stage_costs, stages: int) -> list:
    """``[pack][stage] -> ms`` of one replica's packs (indices into ``lengths``) of predicted
    ``loads``: each stage's cost from ``stage_costs(pack lengths, load)`` where the entry gave a
    stage cost model, else the whole load on every stage alike."""
    if stage_costs is None:
        return [[load] * stages for load in loads]
    return [stage_costs([lengths[i] for i in pack], load) for pack, load in zip(packs, loads)]


def simulated_iteration_ms(stage_loads: Sequence[Sequence[float]], order: Sequence[int]) -> float:
    """The simulated 1F1B iteration of one replica running its packs (``[pack][stage] -> ms``) in ``order``."""
    from megatron_sparsebalance.pipeline.simulate import simulate_iteration

    stages = len(stage_loads[0]) if stage_loads else 0
    return simulate_iteration([[[stage_loads[j][s] for j in order] for s in range(stages)]])


def simulated_order(stage_loads: Sequence[Sequence[float]], start: Sequence[int],
                    passes: int = ORDER_SEARCH_PASSES) -> list[int]:
    """The order of one replica's micro-batches that the simulated 1F1B finishes soonest, searched
    by swaps from ``start``.

    ``light-ends`` ranks micro-batches by one number, so it cannot see which stage a micro-batch
    loads: with the output layer on the last stage, a pack of many short samples costs the last
    stage as much as one long document of the same tokens but the others far less, and which of
    the two opens or closes the pipeline changes the warm-up and cool-down. On the 4xH200 64K
    runs (PP=4, measured per-stage times) the best order of each iteration was 1-6% shorter
    than the order that ran, most on bimodal data, and these swaps reached most of it. Each pass tries every pair of
    positions and keeps a swap that shortens the simulated iteration; it stops after a pass
    without one, or after ``passes``. About ``passes * m^2 / 2`` simulations of 50 us at
    ``P = 4, m = 8``: a few ms per replica and global batch, on the host.
    """
    P = len(stage_loads[0]) if stage_loads else 0
    order = list(start)
    m = len(order)
    if m < 2 or P < 2:
        return order
    best = simulated_iteration_ms(stage_loads, order)
    for _ in range(passes):
        improved = False
        for a in range(m - 1):
            for b in range(a + 1, m):
                order[a], order[b] = order[b], order[a]
                t = simulated_iteration_ms(stage_loads, order)
                if t < best * (1 - 1e-9):
                    best, improved = t, True
                else:
                    order[a], order[b] = order[b], order[a]
        if not improved:
            break
    return order


# --------------------------------------------------------------------------------------------
# Hydraulis's pipeline-aware objectives (``--batching hydraulis``)


def replica_pipeline_cost(costs: Sequence[float], pipeline_stages: int) -> float:
    """Hydraulis's cost of the samples one DP replica runs: ``sum + (P - 1) * max``.

    A replica's 1F1B iteration is its steady work (every micro-batch once per stage: the sum)
    plus warm-up and cool-down, where ``P - 1`` stages wait on single micro-batches. Before the
    replica's packing exists, its heaviest sample stands for its heaviest micro-batch: a long
    document is one micro-batch's floor whatever is packed beside it. Plain SAB balances the sum
    alone, so it can give one replica all the long documents' bubbles.
    """
    return float(sum(costs)) + (pipeline_stages - 1) * float(max(costs)) if len(costs) else 0.0


def assign_replicas(weights: Sequence[float], dp: int, pipeline_stages: int, tokens: Optional[Sequence[int]] = None,
                    token_cap: Optional[float] = None, min_count: int = 1, max_rounds: Optional[int] = None
                    ) -> list[list[int]]:
    """Samples to DP replicas minimising the largest :func:`replica_pipeline_cost`.

    Greedy, heaviest first, each sample to the replica whose cost after taking it is smallest
    (ties: lower replica), within ``token_cap`` tokens per replica and leaving enough samples for
    every replica to reach ``min_count``; then moves and swaps out of the costliest replica while
    they lower the pair's larger cost. Deterministic. Returns each replica's items, ascending.
    """
    w = [float(x) for x in weights]
    n = len(w)
    t = [0.0] * n if tokens is None else [float(x) for x in tokens]
    cap = math.inf if token_cap is None else float(token_cap)
    P = int(pipeline_stages)
    if dp < 1 or n < dp * min_count:
        raise PartitionError(f"{n} samples cannot give {dp} replicas {min_count} each")
    order = sorted(range(n), key=lambda i: (-w[i], i))
    parts: list[list[int]] = [[] for _ in range(dp)]
    total, top, toks = [0.0] * dp, [0.0] * dp, [0.0] * dp
    need = dp * min_count
    for step, i in enumerate(order):
        restrict = n - step <= need
        best = None
        for r in range(dp):
            if toks[r] + t[i] > cap or (restrict and len(parts[r]) >= min_count):
                continue
            cost = total[r] + w[i] + (P - 1) * max(top[r], w[i])
            if best is None or cost < best[0]:
                best = (cost, r)
        if best is None:
            raise PartitionError(f"no replica can take a sample of {int(t[i])} tokens (cap {cap:g} per replica)")
        r = best[1]
        if len(parts[r]) < min_count:
            need -= 1
        parts[r].append(i)
        total[r] += w[i]
        top[r] = max(top[r], w[i])
        toks[r] += t[i]

    def cost_of(items):
        return replica_pipeline_cost([w[i] for i in items], P)

    for _ in range(max_rounds or 4 * n + 16):
        costs = [cost_of(p) for p in parts]
        a = max(range(dp), key=lambda r: (costs[r], -r))
        best = None  # (new pair max, other replica, item out of a, item into a or None)
        for b in range(dp):
            if b == a:
                continue
            ta, tb = sum(t[i] for i in parts[a]), sum(t[i] for i in parts[b])
            for i in parts[a]:
                rest_a = [x for x in parts[a] if x != i]
                if len(rest_a) >= min_count and tb + t[i] <= cap:
                    new = max(cost_of(rest_a), cost_of(parts[b] + [i]))
                    if best is None or new < best[0]:
                        best = (new, b, i, None)
                for j in parts[b]:
                    if w[j] >= w[i] or ta - t[i] + t[j] > cap or tb - t[j] + t[i] > cap:
                        continue  # a swap that does not lighten a cannot lower its cost
                    new = max(cost_of(rest_a + [j]), cost_of([x for x in parts[b] if x != j] + [i]))
                    if best is None or new < best[0]:
                        best = (new, b, i, j)
        if best is None or best[0] >= costs[a] * (1 - 1e-12):
            break
        _, b, i, j = best
        parts[a].remove(i)
        parts[b].append(i)
        if j is not None:
            parts[b].remove(j)
            parts[a].append(j)
    return [sorted(p) for p in parts]


def choose_micro_batch_count(weights: Sequence[float], tokens: Sequence[int], pipeline_stages: int,
                             overhead: float = 0.0, token_cap: Optional[float] = None,
                             objective: str = "hydraulis", order: str = "light-ends", stage_costs=None) -> tuple:
    """Hydraulis's micro-batch count of one replica: the ``v`` minimising
    ``(heaviest micro-batch + c) x (P - 1 + v)``, ``c`` the latency model's fixed cost per pack
    (``overhead``), each ``v`` packed by :func:`balanced_partition` under ``token_cap``.

    ``(max + c) x (P - 1 + v)`` is the 1F1B iteration when every micro-batch costs the heaviest
    one: more micro-batches shorten the warm-up and cool-down (the heaviest gets lighter) but pay
    one more fixed cost and one more slot each. ``v`` runs from the fewest packs the token cap
    allows to one sample per pack, and stops once even a pack of the heaviest sample alone
    could not win. Ties: the smaller ``v``. Returns ``(v, parts, objective)``.

    ``objective="simulated"`` scores each ``v`` by the simulated 1F1B iteration of its packs
    instead, in their pipeline order (``order``, :func:`pipeline_order`), every stage alike:
    Hydraulis's product charges every slot at the heaviest pack, while 1F1B pays the heaviest
    one once per stage and the warm-up and cool-down only at the packs that open and close the
    pipeline (light ones under ``light-ends``), so the product picks too few packs when one long
    document sets the heaviest (docs/BATCHING.md has the numbers). ``stage_costs``
    (``(lengths, ms) -> [ms per stage]``, ``pipeline/simulate.py: StageCostModel``) prices each
    stage apart in that simulation, so the last stage's output layer, paid per token whatever
    the packing, is in it; ``tokens`` are then the samples' lengths.
    """
    if objective not in COUNT_OBJECTIVES:
        raise ValueError(f"--micro-batch-count-objective must be one of {COUNT_OBJECTIVES}, got {objective!r}")
    w = [float(x) for x in weights]
    n = len(w)
    if n == 0:
        raise PartitionError("a replica needs at least one sample")
    P = int(pipeline_stages)
    lo = 1 if token_cap is None else max(1, math.ceil(sum(tokens) / float(token_cap) - 1e-9))
    best = None
    for v in range(lo, n + 1):
        # Lower bounds of every larger v: the product's with the heaviest sample alone; a stage's
        # own work (all packs, each with its fixed cost) for the simulation.
        bound = (max(w) + overhead) * (P - 1 + v) if objective == "hydraulis" else sum(w) + v * overhead
        if best is not None and bound >= best[2]:
            break
        try:
            parts = balanced_partition(w, v, tokens, token_cap)
        except PartitionError:
            continue
        loads = [overhead + sum(w[i] for i in part) for part in parts]
        if objective == "hydraulis":
            score = max(loads) * (P - 1 + v)
        else:
            # The count is scored in light-ends order even under the simulated order: searched
            # on the costs at the budgets SAB expects, the order favoured fewer, heavier packs that
            # DST could then not spread (simulated: 1.30x against 1.37x, PP=4 bimodal, profiled).
            run = pipeline_order(loads, "light-ends" if order == "simulated" else order)
            score = simulated_iteration_ms(pack_stage_loads(parts, tokens, loads, stage_costs, P), run)
        if best is None or score < best[2] * (1 - 1e-12):
            best = (v, parts, score)
    if best is None:
        raise PartitionError(f"no packing of {n} samples fits the token cap {token_cap}")
    return best


# --------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class BatchPlan:
    """The split of one global batch: identical on every rank.

    ``micro_batches[r][j]`` holds the sample ids (as given to :meth:`SparsityAwareBatcher.plan`,
    usually dataset indices) of micro-batch ``j`` of DP rank ``r``, in pipeline execution order;
    ``loads[r][j]`` its predicted forward+backward ms on one stage at the estimated budgets
    (``None`` without a latency model), ``tokens[r][j]`` its token count.
    """

    method: str
    sample_ids: tuple
    lengths: tuple
    weights: tuple
    """Per sample (arrival order): the weight the partition balanced (ms for sab, tokens for lbb)."""
    micro_batches: tuple
    loads: Optional[tuple]
    tokens: tuple
    k_estimates: Optional[tuple] = None
    length_of: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def dp_size(self) -> int:
        return len(self.micro_batches)

    @property
    def micro_batch_counts(self) -> tuple:
        """Micro-batches of each DP rank (equal unless ``--variable-micro-batches``)."""
        return tuple(len(rank) for rank in self.micro_batches)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank; a ValueError when the ranks' counts differ (use
        :attr:`micro_batch_counts`): a caller assuming one count would cut the plan wrong."""
        counts = set(self.micro_batch_counts)
        if len(counts) != 1:
            raise ValueError(f"this plan has a different number of micro-batches per rank {self.micro_batch_counts} "
                             "(--variable-micro-batches): use micro_batch_counts")
        return counts.pop()

    def micro_batch_lengths(self, rank: int, j: int) -> list[int]:
        return [self.length_of[i] for i in self.micro_batches[rank][j]]

    def rank_micro_batch_lengths(self) -> list[list[list[int]]]:
        """``[dp_rank][micro_batch] -> lengths`` (what the trainer plans a global batch from)."""
        return [[self.micro_batch_lengths(r, j) for j in range(len(rank))] for r, rank in enumerate(self.micro_batches)]

    def all_micro_batch_lengths(self) -> list[list[int]]:
        """Lengths of every micro-batch of the global batch, rank by rank (what DST plans over)."""
        return [mb for rank in self.rank_micro_batch_lengths() for mb in rank]

    def split_by_rank(self, values: Sequence) -> list[list]:
        """Cut a flat per-micro-batch list (rank by rank, as :meth:`all_micro_batch_lengths`) per rank."""
        out, i = [], 0
        for c in self.micro_batch_counts:
            out.append(list(values[i:i + c]))
            i += c
        return out

    def max_over_mean(self) -> float:
        """Imbalance of the predicted micro-batch loads over all ranks (max / mean)."""
        if self.loads is None:
            raise ValueError("this plan was made without a latency model: no predicted loads")
        flat = [x for rank in self.loads for x in rank]
        return max(flat) / (sum(flat) / len(flat))

    def to_dict(self) -> dict:
        return {"method": self.method, "sample_ids": list(self.sample_ids),
                "micro_batches": [[list(mb) for mb in rank] for rank in self.micro_batches],
                "loads": None if self.loads is None else [list(r) for r in self.loads],
                "tokens": [list(r) for r in self.tokens]}

    def fingerprint(self) -> str:
        """A short hash of the plan: ranks compare it to check they agree."""
        return hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class BatchingConfig:
    """The batching flags."""

    batching: str = "sab"
    """How a global batch is split: sab (balanced predicted latency at the estimated budgets),
    lbb (balanced tokens, length-based batching), none (arrival order, equal sample counts) or
    hydraulis (Hydraulis's pipeline-aware objectives: samples to the DP replica minimising the
    largest sum + (PP - 1) x max of predicted costs, then each replica's micro-batches)."""

    variable_micro_batches: bool = False
    """With --batching hydraulis: each DP replica packs its samples into the number of micro-batches v
    (per iteration) minimising (heaviest micro-batch's predicted ms) x (PP - 1 + v) under
    --micro-batch-tokens, instead of global batch / (micro-batch size x DP). Exact per-token loss
    needs --calculate-per-token-loss semantics (the schedule's normalization; docs/BATCHING.md)."""

    micro_batch_count_objective: str = "hydraulis"
    """With --variable-micro-batches, what v minimises: hydraulis, Hydraulis's
    (heaviest + fixed cost) x (PP - 1 + v); simulated, the simulated 1F1B iteration of the packs in
    their --micro-batch-order (balance/sab.py choose_micro_batch_count)."""

    micro_batch_tokens: Optional[int] = None
    """Most tokens one packed micro-batch may hold (activation memory); None: no cap. Must be at
    least --seq-length so any sample fits."""

    micro_batch_order: str = "light-ends"
    """Order of a rank's micro-batches in the pipeline: light-ends, descending, ascending, as-planned, or
    simulated (searched on the simulated 1F1B with each stage's predicted cost, from light-ends)."""

    sab_ema: float = 0.8
    """Weight of the old value in the EMA of DST's budgets per length bin."""

    sab_length_bins: tuple = DEFAULT_LENGTH_BINS
    """Upper edges (tokens) of the estimator's length bins."""

    def prices_stages(self) -> bool:
        """Whether the plan simulates the pipeline (the count objective or the order), and so needs
        each stage's cost of a micro-batch (the entries give the batcher a stage cost model)."""
        return self.micro_batch_count_objective == "simulated" or self.micro_batch_order == "simulated"

    def validate(self, seq_length: Optional[int] = None) -> "BatchingConfig":
        if self.batching not in BATCHING_METHODS:
            raise ValueError(f"--batching must be one of {BATCHING_METHODS}, got {self.batching!r}")
        if self.micro_batch_order not in MICRO_BATCH_ORDERS:
            raise ValueError(f"--micro-batch-order must be one of {MICRO_BATCH_ORDERS}, got {self.micro_batch_order!r}")
        if self.micro_batch_tokens is not None:
            if self.micro_batch_tokens < 1:
                raise ValueError(f"--micro-batch-tokens must be >= 1, got {self.micro_batch_tokens}")
            if seq_length is not None and self.micro_batch_tokens < seq_length:
                raise ValueError(
                    f"--micro-batch-tokens ({self.micro_batch_tokens}) must be >= --seq-length ({seq_length}): "
                    "a sample of --seq-length tokens has to fit in one micro-batch")
        if not 0.0 <= self.sab_ema < 1.0:
            raise ValueError(f"--sab-ema must be in [0, 1), got {self.sab_ema}")
        if self.micro_batch_count_objective not in COUNT_OBJECTIVES:
            raise ValueError(f"--micro-batch-count-objective must be one of {COUNT_OBJECTIVES}, got "
                             f"{self.micro_batch_count_objective!r}")
        if self.micro_batch_count_objective != "hydraulis" and not self.variable_micro_batches:
            raise ValueError("--micro-batch-count-objective chooses the count of --variable-micro-batches: give both")
        if self.variable_micro_batches and self.batching != "hydraulis":
            raise ValueError(f"--variable-micro-batches needs --batching hydraulis (it chooses the count), got "
                             f"--batching {self.batching}")
        return self


class SparsityAwareBatcher:
    """Plans global batches: weights, two-level partition, pipeline order.

    Args:
        method: ``sab``, ``lbb`` or ``none`` (``--batching``).
        dp_size: data-parallel ranks.
        num_micro_batches: micro-batches per rank and global batch (fixed by the run).
        latency_model: ``predict(lengths, k) -> ms`` (docs/INTERFACES.md); required for ``sab``,
            optional otherwise (then plans carry no predicted loads).
        estimator: a :class:`SparsityEstimator`; required for ``sab`` unless ``k_base`` is given.
        k_base: builds a fresh estimator (``--moba-topk``) when none is passed.
        micro_batch_tokens: token cap per micro-batch (``--micro-batch-tokens``).
        order: ``--micro-batch-order``.
        levels: how the DP level is solved, ``grouped`` or ``nested`` (see :meth:`_two_level`).
        pipeline_stages: PP, for ``hydraulis``'s objectives (:func:`replica_pipeline_cost`,
            :func:`choose_micro_batch_count`).
        variable_micro_batches: ``hydraulis`` chooses each replica's count per global batch
            (``--variable-micro-batches``); ``num_micro_batches`` is then unused by the plan.
    """

    def __init__(self, method: str, dp_size: int, num_micro_batches: int, latency_model=None,
                 estimator: Optional[SparsityEstimator] = None, k_base: Optional[int] = None,
                 micro_batch_tokens: Optional[int] = None, order: str = "light-ends", levels: str = "grouped",
                 pipeline_stages: int = 1, variable_micro_batches: bool = False,
                 count_objective: str = "hydraulis"):
        if levels not in ("grouped", "nested"):
            raise ValueError(f"levels must be 'grouped' or 'nested', got {levels!r}")
        BatchingConfig(batching=method, micro_batch_tokens=micro_batch_tokens, micro_batch_order=order,
                       variable_micro_batches=variable_micro_batches,
                       micro_batch_count_objective=count_objective).validate()
        if pipeline_stages < 1:
            raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pipeline_stages}")
        if dp_size < 1:
            raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
        if num_micro_batches < 1:
            raise ValueError(f"micro-batches per rank must be >= 1, got {num_micro_batches}")
        if method in ("sab", "hydraulis") and latency_model is None:
            raise ValueError(f"--batching {method} needs a latency model (--latency-table, or the analytic model)")
        if estimator is None and k_base is not None:
            estimator = SparsityEstimator(k_base)
        if method in ("sab", "hydraulis") and estimator is None:
            raise ValueError(f"--batching {method} needs a sparsity estimator (or k_base, --moba-topk)")
        self.method = method
        self.dp_size = int(dp_size)
        self.num_micro_batches = int(num_micro_batches)
        # Weights priced at calibration scale 1 (LatencyModel.uncalibrated): the plan depends on the
        # samples alone, never on how fast the last steps ran.
        self.model = latency_model.uncalibrated() if hasattr(latency_model, "uncalibrated") else latency_model
        self.estimator = estimator
        self.token_cap = micro_batch_tokens
        self.order = order
        self.levels = levels
        self.pipeline_stages = int(pipeline_stages)
        self.variable = bool(variable_micro_batches)
        self.count_objective = count_objective
        # Each stage's cost of a pack for the simulated count objective (pipeline/simulate.py:
        # StageCostModel, from the pipeline split; set by the entry); None: stages alike.
        self.stage_costs = None
        self._cache: dict = {}
        self.last_solver_ms = 0.0

    # ---- weights ----------------------------------------------------------------------------

    def _marginal(self, length: int, k: int) -> float:
        key = (length, k)
        v = self._cache.get(key)
        if v is None:
            v = self.model.predict([length, length], k) - self.model.predict([length], k)
            if len(self._cache) >= 1 << 17:
                self._cache.clear()
            self._cache[key] = v
        return v

    def sample_cost(self, length: int, k: float) -> float:
        """Marginal predicted ms of one sequence in a pack at (possibly fractional) budget ``k``:
        linear between the two integer budgets around ``k`` (estimates are EMAs, not integers)."""
        lo = max(1, math.floor(k))
        c = self._marginal(int(length), lo)
        frac = k - lo
        if frac > 1e-9:
            c += frac * (self._marginal(int(length), lo + 1) - c)
        return c

    def pack_overhead(self) -> float:
        """The fixed predicted ms of a pack (paid once per micro-batch, whatever it holds)."""
        k = self.estimator.k_base if self.estimator is not None else 1
        probe = 128
        return max(0.0, 2.0 * self.model.predict([probe], k) - self.model.predict([probe, probe], k))

    def k_estimates(self, lengths: Sequence[int]) -> Optional[list[float]]:
        if self.estimator is None:
            return None
        return [self.estimator.estimate(n) for n in lengths]

    # ---- planning ---------------------------------------------------------------------------

    def plan(self, lengths: Sequence[int], sample_ids: Optional[Sequence[int]] = None) -> BatchPlan:
        """The plan of one global batch whose samples (in arrival order) have ``lengths``."""
        import time

        lengths = [int(n) for n in lengths]
        n = len(lengths)
        ids = list(range(n)) if sample_ids is None else [int(i) for i in sample_ids]
        if len(ids) != n or len(set(ids)) != n:
            raise ValueError("sample_ids must be distinct, one per length")
        dp, m = self.dp_size, (1 if self.variable else self.num_micro_batches)
        if n < dp * m:
            raise ValueError(
                f"--global-batch-size ({n} samples) must be >= data-parallel size x micro-batches per rank "
                f"({dp} x {m}): every micro-batch needs a sample")
        if min(lengths) < 1:
            raise ValueError("sample lengths must be >= 1")
        cap = self.token_cap
        if cap is not None and max(lengths) > cap:
            raise ValueError(
                f"a sample of {max(lengths)} tokens exceeds --micro-batch-tokens {cap}; raise it to at least "
                "--seq-length, or lower --seq-length")

        ks = self.k_estimates(lengths)
        cost = None
        if self.model is not None:
            k_for = ks if ks is not None else [1] * n
            cost = [self.sample_cost(L, k) for L, k in zip(lengths, k_for)]
        weights = cost if self.method in ("sab", "hydraulis") else [float(L) for L in lengths]

        t0 = time.perf_counter()
        if self.method == "none":
            ranks = []
            for chunk in contiguous_chunks(n, dp):
                parts = arrival_order_chunks([lengths[i] for i in chunk], m, cap)
                if parts is None:
                    raise ValueError(
                        f"--batching none keeps arrival order and cannot cut a rank's {len(chunk)} samples "
                        f"({sum(lengths[i] for i in chunk)} tokens) into {m} runs of at most --micro-batch-tokens "
                        f"{cap} tokens; use --batching sab or lbb, or raise --micro-batch-tokens")
                ranks.append([[chunk[i] for i in mb] for mb in parts])
        elif self.method == "hydraulis":
            ranks = self._hydraulis(weights, lengths)
        else:
            ranks = self._two_level(weights, lengths)
        self.last_solver_ms = (time.perf_counter() - t0) * 1e3

        overhead = self.pack_overhead() if cost is not None else 0.0
        micro, loads, tokens = [], [], []
        for rank in ranks:
            rank_loads = [overhead + sum(cost[i] for i in mb) for mb in rank] if cost is not None else None
            key = rank_loads if rank_loads is not None else [float(sum(lengths[i] for i in mb)) for mb in rank]
            stage_loads = (pack_stage_loads(rank, lengths, key, self.stage_costs, self.pipeline_stages)
                           if self.order == "simulated" else None)
            order = pipeline_order(key, self.order, stage_loads)
            micro.append(tuple(tuple(ids[i] for i in rank[j]) for j in order))
            tokens.append(tuple(sum(lengths[i] for i in rank[j]) for j in order))
            if rank_loads is not None:
                loads.append(tuple(rank_loads[j] for j in order))
        return BatchPlan(
            method=self.method, sample_ids=tuple(ids), lengths=tuple(lengths), weights=tuple(weights),
            micro_batches=tuple(micro), loads=tuple(loads) if cost is not None else None, tokens=tuple(tokens),
            k_estimates=None if ks is None else tuple(ks), length_of=dict(zip(ids, lengths)),
        )

    def _two_level(self, weights: list[float], lengths: list[int]) -> list[list[list[int]]]:
        """DP ranks first, then each rank's micro-batches (positions in the global batch).

        ``levels="grouped"`` (default) decides the DP split at micro-batch granularity: it
        partitions the whole global batch into ``dp x m`` balanced micro-batches, then gives each
        rank exactly ``m`` of them so that the ranks' totals balance (the same solver, with
        micro-batches as items). ``levels="nested"`` splits samples over ranks first and then
        each rank alone. Nested can be stuck with a rank whose samples cannot be cut into ``m``
        even parts (too many long samples and too few short ones to fill around them) while
        the global batch could; grouped never is: any balanced set of micro-batches yields
        balanced ranks. docs/BATCHING.md compares the two.

        Raises a ValueError naming the flags when the token cap cannot be met.
        """
        dp, m, cap = self.dp_size, self.num_micro_batches, self.token_cap
        try:
            if self.levels == "nested":
                rank_items = balanced_partition(weights, dp, lengths, None if cap is None else cap * m, min_count=m)
                ranks = []
                for items in rank_items:
                    parts = balanced_partition([weights[i] for i in items], m, [lengths[i] for i in items], cap)
                    ranks.append([[items[i] for i in part] for part in parts])
                return ranks
            micro = balanced_partition(weights, dp * m, lengths, cap)
            if dp == 1:
                return [micro]
            totals = [sum(weights[i] for i in mb) for mb in micro]
            groups = balanced_partition(totals, dp, min_count=m, max_count=m)
            return [[micro[j] for j in group] for group in groups]
        except PartitionError as e:
            raise ValueError(
                f"cannot pack the global batch into {dp} x {m} micro-batches of at most --micro-batch-tokens "
                f"{cap} tokens ({e}); raise --micro-batch-tokens or the number of micro-batches") from None

    def _hydraulis(self, weights: list[float], lengths: list[int]) -> list[list[list[int]]]:
        """Hydraulis's two stages: samples to replicas (:func:`assign_replicas`), then each
        replica's micro-batches: ``num_micro_batches`` balanced ones, or with
        ``variable_micro_batches`` the count :func:`choose_micro_batch_count` picks."""
        dp, m, cap, P = self.dp_size, self.num_micro_batches, self.token_cap, self.pipeline_stages
        try:
            if self.variable:
                groups = assign_replicas(weights, dp, P, lengths, None, 1)
            else:
                groups = assign_replicas(weights, dp, P, lengths, None if cap is None else cap * m, m)
            overhead = self.pack_overhead()
            ranks = []
            for items in groups:
                w, t = [weights[i] for i in items], [lengths[i] for i in items]
                if self.variable:
                    parts = choose_micro_batch_count(w, t, P, overhead, cap, self.count_objective, self.order,
                                                     self.stage_costs)[1]
                else:
                    parts = balanced_partition(w, m, t, cap)
                ranks.append([[items[i] for i in part] for part in parts])
            return ranks
        except PartitionError as e:
            raise ValueError(
                f"--batching hydraulis cannot pack the global batch over {dp} replicas under --micro-batch-tokens "
                f"{cap} ({e}); raise --micro-batch-tokens or the number of micro-batches") from None

    def update(self, plan: BatchPlan, budgets: Sequence[Sequence[float]]) -> None:
        """Feed DST's budgets of a planned global batch to the estimator (``budgets[r][j]``)."""
        if self.estimator is not None:
            self.estimator.update_from_plan(plan, budgets)

    def state_dict(self) -> dict:
        return {"method": self.method, "estimator": None if self.estimator is None else self.estimator.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("estimator") is not None and self.estimator is not None:
            self.estimator.load_state_dict(state["estimator"])
