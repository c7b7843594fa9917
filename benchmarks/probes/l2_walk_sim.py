"""Probe (CPU only): how often dK/dV's reads of the query tiles could hit in L2, by the order in which
the CTAs walk their lists (docs/FA4.md, "What it would take", which has the figures).

A dK/dV CTA owns one (KV group, KV block) pair and walks the query blocks that select it, reading
each one's Q and dO tiles; a query block is read once for every KV block it selects. This
simulates the walk at 3B 64K 25% (512 blocks of 128, 2 groups, 69 selected blocks a query block as
the benchmark's random selection picks them: the diagonal and the rest at random), with the plan's
cut into parts no longer than an SM's share and its longest-first order on 132 SMs, one time unit
a list entry, and counts hits of those reads in an LRU cache of whole query blocks (Q and dO of a
group's 8 heads: 512 KiB each) of 40 MB. Orders:

* ``plan``: every part walks its entries from the end (the kernels' order);
* ``rotated``: every part starts where the CTAs running when it starts stand (their median query
  block, known here, which a kernel could only estimate) and wraps around, its diagonal last;
* ``query order``: every read of the whole backward in descending query block, group by group (what
  bands tend to);
* ``head order``: every part walks its entries a head at a time (all of them for head 0, then
  for head 1, ...), tiles of one head (64 KiB) cached apart; ``block order`` is the plan's order
  counted the same way, a block's heads one after the other (in L2s of 40 and 25 MB);
* ``window W``: a soft barrier instead of bands: the parts run group by group, each walks its query
  blocks in one circular sweep from the group's front (the least position any running part of the
  group reads next, unwrapped), and a read waits while it lies W or more blocks past the front. The
  makespan (time units until the last read) says what the waits cost against the plan's.

    python3 -m benchmarks.probes.l2_walk_sim
"""
from __future__ import annotations

import heapq
import random
from collections import OrderedDict

NB, K, GROUPS, SMS = 512, 69, 2, 132
TILE_BYTES, L2_BYTES = 8 * 128 * 128 * 2 * 2, 40 << 20


def selection(seed: int = 0) -> dict:
    """Per (group, KV block): the query blocks selecting it, ascending (the transposed index)."""
    rnd = random.Random(seed)
    lists = {(g, kb): [] for g in range(GROUPS) for kb in range(NB)}
    for g in range(GROUPS):
        for q in range(NB):
            for kb in [q] + rnd.sample(range(q), min(K - 1, q)):
                lists[(g, kb)].append(q)
    for blocks in lists.values():
        blocks.sort()
    return lists


def parts_longest_first(lists: dict) -> list:
    """The plan's parts ``(pair, lo, hi)``: lists longer than an SM's share cut into equal parts."""
    cap = max(2, -(-sum(map(len, lists.values())) // SMS))
    parts = []
    for pair, blocks in lists.items():
        n = max(1, -(-len(blocks) // cap))
        parts += [(pair, j * len(blocks) // n, (j + 1) * len(blocks) // n) for j in range(n)]
    return sorted((p for p in parts if p[2] > p[1]), key=lambda p: p[1] - p[2])


def run_on_sms(parts: list, walk) -> list:
    """The parts run on SMS SMs in turn, each on the first SM free, one time unit a read.
    ``walk(part, t, running)`` gives a part's reads in order when it starts at time t, where
    ``running`` holds ``(start, reads)`` of the parts still running then. Every read as
    ``(time, read)``, in time order."""
    free = [(0, sm) for sm in range(SMS)]
    walking = {}  # sm -> (start, its part's reads)
    out = []
    for part in parts:
        t, sm = heapq.heappop(free)
        seq = walk(part, t, [(t0, s) for t0, s in walking.values() if 0 <= t - t0 < len(s)])
        walking[sm] = (t, seq)
        out += [(t + i, read) for i, read in enumerate(seq)]
        heapq.heappush(free, (t + len(seq), sm))
    return sorted(out)


def reads(lists: dict, parts: list, rotated: bool) -> list:
    """Every query block read, as ``(time, group, query block)``, the parts run on SMS SMs in turn."""
    def walk(part, t, running):
        pair, lo, hi = part
        blocks = lists[pair]
        order = list(range(hi - 1, lo - 1, -1))
        here = sorted(seq[t - t0][1] for t0, seq in running)
        if rotated and here:
            stand = here[len(here) // 2]
            body = [e for e in order if e != 0]
            first = next((i for i, e in enumerate(body) if blocks[e] <= stand), len(body))
            order = body[first:] + body[:first] + ([0] if lo == 0 else [])  # the diagonal last
        return [(pair[0], blocks[e]) for e in order]
    return [(t, g, q) for t, (g, q) in run_on_sms(parts, walk)]


def head_tile_reads(lists: dict, parts: list, head_outer: bool, heads: int = 8) -> list:
    """``head order`` / ``block order`` (module docstring): every query tile of one head read, as
    ``(group, query block, head)`` in time order, one time unit a tile."""
    def walk(part, t, running):
        pair, lo, hi = part
        blocks = [lists[pair][e] for e in range(hi - 1, lo - 1, -1)]
        if head_outer:
            return [(pair[0], q, h) for h in range(heads) for q in blocks]
        return [(pair[0], q, h) for q in blocks for h in range(heads)]
    return [read for _, read in run_on_sms(parts, walk)]


def windowed_reads(lists: dict, parts: list, window: int) -> tuple[list, int]:
    """``window W`` (module docstring): the reads ``(group, query block)`` in time order, and the makespan."""
    queue = iter(sorted(parts, key=lambda p: (p[0][0], p[1] - p[2])))
    front = [0] * GROUPS
    running = {}  # sm -> [group, unwrapped positions of its reads in sweep order, reads done]

    def start(sm):
        part = next(queue, None)
        if part is not None:
            (g, kb), lo, hi = part
            x0 = front[g]
            running[sm] = [g, sorted(x0 + (q - x0) % NB for q in lists[(g, kb)][lo:hi]), 0]

    for sm in range(SMS):
        start(sm)
    out, t = [], 0
    while running:
        for g in range(GROUPS):
            front[g] = min((pos[i] for gg, pos, i in running.values() if gg == g), default=front[g])
        for sm, (g, pos, i) in sorted(running.items()):
            if pos[i] < front[g] + window:
                out.append((g, pos[i] % NB))
                running[sm][2] += 1
                if running[sm][2] == len(pos):
                    del running[sm]
                    start(sm)
        t += 1
    return out, t


def hit_rate(accesses, room: int = L2_BYTES // TILE_BYTES) -> float:
    """Hits of ``accesses`` in an LRU cache of ``room`` entries."""
    cache, hits = OrderedDict(), 0
    for key in accesses:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = True
            if len(cache) > room:
                cache.popitem(last=False)
    return hits / len(accesses)


def main():
    lists = selection()
    parts = parts_longest_first(lists)
    makespan = 0
    for name, rotated in (("plan", False), ("rotated", True)):
        walk = reads(lists, parts, rotated)
        makespan = makespan or walk[-1][0] + 1
        print("%-12s %.3f" % (name, hit_rate([(g, q) for _, g, q in walk])))
    in_query_order = sorted(((g, -q) for (g, _), blocks in lists.items() for q in blocks))
    print("%-12s %.3f" % ("query order", hit_rate(in_query_order)))
    for name, head_outer in (("block order", False), ("head order", True)):
        walk = head_tile_reads(lists, parts, head_outer)
        print("%-12s %.3f (40 MB), %.3f (25 MB)" % (name, hit_rate(walk, L2_BYTES // (TILE_BYTES // 8)),
                                                   hit_rate(walk, (25 << 20) // (TILE_BYTES // 8))))
    for window in (16, 64, 96, 128, 256):
        walk, t = windowed_reads(lists, parts, window)
        print("%-12s %.3f, makespan %.2fx the plan's" % ("window %d" % window, hit_rate(walk), t / makespan))


if __name__ == "__main__":
    main()
