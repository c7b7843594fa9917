"""Router semantics (DESIGN.md §2): layout, selection, coverage, and the C++ index kernels."""
import itertools

import pytest
import torch

from megatron_sparsebalance.ops import native
from megatron_sparsebalance.ops.layout import BlockLayout
from megatron_sparsebalance.ops.router import (
    block_scores,
    coverage_bounded_budget,
    coverage_curve,
    select_blocks,
    transpose_route_index,
)


def layout(lengths, block=64):
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    return BlockLayout.from_cu_seqlens(cu, block, int(cu[-1]))


def test_layout_blocks_stay_inside_sequences():
    lay = layout([97, 64, 1, 200], block=64)
    assert lay.cu_blocks.tolist() == [0, 2, 3, 4, 8]
    assert lay.block_start.tolist() == [0, 64, 97, 161, 162, 226, 290, 354]
    assert lay.block_end.tolist() == [64, 97, 161, 162, 226, 290, 354, 362]
    assert lay.block_pos.tolist() == [0, 1, 0, 0, 0, 1, 2, 3]
    assert lay.token_block[96].item() == 1 and lay.token_block[97].item() == 2


@pytest.mark.parametrize(
    "cu, match",
    [([1, 10], "start at 0"), ([0, 10, 5], "non-decreasing"), ([0, 10, 30], "does not match")],
)
def test_layout_rejects_bad_cu_seqlens(cu, match):
    with pytest.raises(ValueError, match=match):
        BlockLayout.from_cu_seqlens(torch.tensor(cu, dtype=torch.int32), 64, 20)


@pytest.mark.parametrize("block", [0, 32, 100, 512])
def test_layout_rejects_unsupported_block_size(block):
    with pytest.raises(ValueError, match="--moba-block-size"):
        BlockLayout.from_cu_seqlens(torch.tensor([0, 128], dtype=torch.int32), block, 128)


def test_pooled_scores_match_definition():
    lay = layout([200, 130])
    q, k = torch.randn(330, 6, 16), torch.randn(330, 2, 16)
    s = block_scores(q, k, lay)
    # block 1 of sequence 0 is tokens 64..127; block 6 (the last of seq 1) is tokens 328..329
    pq = q[64:128, 3:6].mean((0, 1))
    pk = k[0:64, 1].mean(0)
    assert torch.allclose(s[1, 1, 0], pq @ pk / 4.0, atol=1e-5)
    pq2 = q[328:330, 0:3].mean((0, 1))
    pk2 = k[264:328, 0].mean(0)
    assert torch.allclose(s[0, 6, 5], pq2 @ pk2 / 4.0, atol=1e-5)
    assert torch.isinf(s[:, 4, :4]).all()  # blocks of another sequence are never candidates
    assert torch.isinf(s[:, 2, 2]).all()  # nor is the block itself


def brute_force_select(scores, lay, budgets):
    G, NB, _ = scores.shape
    out = {}
    for g, i in itertools.product(range(G), range(NB)):
        cands = [j for j in range(NB) if torch.isfinite(scores[g, i, j])]
        cands.sort(key=lambda j: (-scores[g, i, j].item(), j))
        b = int(budgets[lay.block_seq[i]])
        out[g, i] = sorted(cands[: b - 1] + [i])
    return out


def route_as_dict(kv_idx, kv_cnt):
    G, NB, _ = kv_idx.shape
    return {(g, i): kv_idx[g, i, : kv_cnt[g, i]].tolist() for g in range(G) for i in range(NB)}


def test_selection_hand_checked():
    lay = layout([64 * 5])
    scores = torch.full((1, 5, 5), float("-inf"))
    scores[0, 4, :4] = torch.tensor([0.1, 0.9, 0.5, 0.9])  # tie between blocks 1 and 3
    scores[0, 3, :3] = torch.tensor([0.3, 0.2, 0.1])
    scores[0, 2, :2] = torch.tensor([0.3, 0.2])
    scores[0, 1, 0] = 0.7
    route = select_blocks(scores, lay, 3)
    got = route_as_dict(route.kv_idx, route.kv_cnt)
    assert got[0, 4] == [1, 3, 4]
    assert got[0, 3] == [0, 1, 3]
    assert got[0, 0] == [0] and got[0, 1] == [0, 1]  # fewer candidates than budget: all of them
    assert select_blocks(scores, lay, 2).kv_idx[0, 4].tolist()[:2] == [1, 4]  # tie -> lower index


@pytest.mark.parametrize("seed", range(4))
def test_selection_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 700, (3,), generator=g).tolist()
    lay = layout(lens)
    scores = block_scores(torch.randn(sum(lens), 4, 8, generator=g), torch.randn(sum(lens), 2, 8, generator=g), lay)
    scores = torch.where(torch.isfinite(scores), scores.round(decimals=1), scores)  # force ties
    budgets = torch.randint(1, 8, (3,), generator=g)
    route = select_blocks(scores, lay, budgets)
    assert route_as_dict(route.kv_idx, route.kv_cnt) == brute_force_select(scores, lay, budgets)


def test_budget_below_one_is_rejected():
    lay = layout([128])
    with pytest.raises(ValueError, match="budget"):
        select_blocks(torch.zeros(1, 2, 2), lay, 0)


def test_coverage_curve_monotone_and_reaches_one():
    lay = layout([64 * 12, 64 * 5 + 3])
    scores = block_scores(torch.randn(lay.num_tokens, 4, 16) * 3, torch.randn(lay.num_tokens, 2, 16) * 3, lay)
    curve = coverage_curve(scores, 14)
    assert curve[0] == 0.0
    assert (curve[1:] >= curve[:-1] - 1e-6).all()
    assert curve[11:].eq(1.0).all()  # k-1 = 11 covers every candidate of the longest sequence
    assert curve[10] < 1.0


def test_coverage_curve_by_hand():
    scores = torch.full((1, 3, 3), float("-inf"))
    scores[0, 1, 0] = 0.0
    scores[0, 2, :2] = torch.log(torch.tensor([0.25, 0.75]))
    curve = coverage_curve(scores, 3)
    # rows with candidates: block 1 (one candidate) and block 2 (0.75 then 0.25)
    assert torch.allclose(curve, torch.tensor([0.0, (1.0 + 0.75) / 2, 1.0]))


def test_coverage_bound():
    curve = torch.tensor([0.0, 0.5, 0.7, 0.8, 0.85, 0.9])
    assert coverage_bounded_budget(curve, 5, 6, 0.1) == 5  # loses 0.05
    assert coverage_bounded_budget(curve, 2, 6, 0.07) == 5  # would lose 0.4: smallest within 0.07
    assert coverage_bounded_budget(curve, 2, 6, 0.15) == 4
    assert coverage_bounded_budget(curve, 3, 6, 0.25) == 3  # loses 0.2, within the bound
    assert coverage_bounded_budget(curve, 2, 6, None) == 2  # no bound
    assert coverage_bounded_budget(curve, 9, 6, 0.0) == 9  # growth is never bounded


def test_candidates_are_strictly_earlier_same_sequence():
    lay = layout([130, 64])
    m = lay.candidates
    assert m.tolist() == [
        [False, False, False, False],
        [True, False, False, False],
        [True, True, False, False],
        [False, False, False, False],
    ]


def test_transposed_index_inverts_selection():
    lay = layout([64 * 9, 300])
    scores = block_scores(torch.randn(lay.num_tokens, 4, 8), torch.randn(lay.num_tokens, 2, 8), lay)
    route = select_blocks(scores, lay, torch.tensor([3, 2]))
    q_ptr, q_idx = route.transposed()
    NB = lay.num_blocks
    for g, j in itertools.product(range(2), range(NB)):
        readers = q_idx[q_ptr[g * NB + j] : q_ptr[g * NB + j + 1]].tolist()
        expected = [i for i in range(NB) if j in route.kv_idx[g, i, : route.kv_cnt[g, i]].tolist()]
        assert readers == expected


needs_native = pytest.mark.skipif(not native.HAVE_NATIVE, reason=f"native extension not built: {native.NATIVE_IMPORT_ERROR}")


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_cpp_selection_equals_python(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 1500, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
    lay = layout(lens, block=[64, 128, 256][seed % 3])
    scores = block_scores(torch.randn(sum(lens), 6, 8, generator=g), torch.randn(sum(lens), 3, 8, generator=g), lay)
    if seed % 2:
        scores = torch.where(torch.isfinite(scores), scores.round(decimals=1), scores)
    budgets = torch.randint(1, 10, (len(lens),), generator=g)
    ref = select_blocks(scores, lay, budgets)
    kmax = ref.kv_idx.shape[-1]
    kv, cnt = native.native().select_blocks_cpu(scores, budgets[lay.block_seq], kmax)
    assert torch.equal(kv, ref.kv_idx) and torch.equal(cnt, ref.kv_cnt)
    qp, qi = native.native().transpose_index_cpu(kv, cnt)
    rqp, rqi = transpose_route_index(ref.kv_idx, ref.kv_cnt)
    assert torch.equal(qp, rqp) and torch.equal(qi, rqi)


def test_layout_cache_reuses_only_the_same_unchanged_tensor():
    from megatron_sparsebalance.ops.layout import LayoutCache

    cache = LayoutCache()
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    first = cache.get(cu, 64, 300)
    assert cache.get(cu, 64, 300) is first  # every layer of a micro-batch: built once
    assert cache.get(cu.clone(), 64, 300) is not first  # a new pack: rebuilt
    assert cache.get(cu, 128, 300).block_size == 128  # another block size: rebuilt
    cu[1] = 200  # edited in place: never served stale
    assert cache.get(cu, 64, 300).cu_blocks.tolist() == [0, 4, 6]
