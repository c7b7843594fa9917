"""The CUDA router (csrc/cuda/router.cu) against the torch router, its oracle (GPU only).

Pooling is compared up to fp32 summation order. Selection is compared bit for bit on pooled
vectors rounded to a grid where every block-pair product is exact in fp32, whatever the order of
its sums, so the CUDA kernel and the reference see the same scores (the coarse grid is full of
ties, which go to the lower block); the coverage curve equal to rounding.
"""
import pytest
import torch

from megatron_sparsebalance.ops import native
from megatron_sparsebalance.ops.router import coverage_bounded_budget, coverage_curve, pool_blocks, select_blocks
from tests.packs import random_pack

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not native.cuda_kernels_run_on(torch.device("cuda")):
        pytest.skip("the CUDA extension is not built for this GPU (MSB_CUDA=1, MSB_CUDA_ARCH)")
    return native.native()


def _pack(lens, hq, g, d, dtype, block, seed=0):
    q, k, _, lay = random_pack(lens, hq, g, d, dtype, block, seed)
    return q, k, lay


def _pooled(ext, q, k, lay, grid=None):
    """Pooled q and k ``[G, NB, D]``; with ``grid``, rounded to multiples of it (exact products)."""
    g = k.shape[1]
    pq, pk = (ext.router_pool_cuda(x, lay.block_start, lay.block_end, g) for x in (q, k))
    if grid is not None:
        pq, pk = ((x / grid).round() * grid for x in (pq, pk))
    return pq, pk


def _scores(pq, pk, lay, scale):
    return torch.where(lay.candidates, torch.einsum("gid,gjd->gij", pq, pk) * scale, float("-inf"))


def _select(ext, pq, pk, lay, scale, k_request, k_base=0, p=None, curve_len=0):
    return ext.router_select_cuda(pq, pk, lay.block_pos, lay.max_blocks_per_seq, lay.rows_with_candidates, scale,
                                  k_request, k_base, -1.0 if p is None else p, curve_len)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d,block", [(64, 64), (128, 128), (96, 256), (4, 64)])
def test_pooling_matches_the_torch_router(ext, dtype, d, block):
    """The mean over each block's tokens and each group's heads, by 16-byte vectors (and by single
    elements where a row is not made of them: head dim 4 in bf16); head dim 96 too (the Triton
    router takes powers of two only)."""
    q, k, lay = _pack([5000, 300, 1025, 7], 14, 2, d, dtype, block)
    for x, g in ((q, 2), (k, 2), (q, 14)):
        got = ext.router_pool_cuda(x, lay.block_start, lay.block_end, g)
        ref = pool_blocks(x, lay, g).transpose(0, 1)
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (dtype, d, g)


@pytest.mark.parametrize("lens,block", [([5000, 300, 1025, 7], 64), ([9000], 128), ([3000, 3000], 256)])
def test_selection_and_coverage_equal_the_torch_router_on_the_same_scores(ext, lens, block):
    q, k, lay = _pack(lens, 14, 2, 64, torch.bfloat16, block, seed=3)
    for grid in (1 / 64, 1.0):  # few ties; ties everywhere
        pq, pk = _pooled(ext, q, k, lay, grid)
        scores = _scores(pq, pk, lay, 0.125)
        for budget in (1, 3, 17, 64, lay.max_blocks_per_seq + 5):
            n = max(budget, 32)
            kv, cnt, curve, coverage, k_used = _select(ext, pq, pk, lay, 0.125, budget, curve_len=n)
            ref = select_blocks(scores, lay, budget)
            assert k_used is None
            assert torch.equal(kv, ref.kv_idx) and torch.equal(cnt, ref.kv_cnt), (lens, grid, budget)
            assert torch.allclose(curve, coverage_curve(scores, n), atol=1e-5), (lens, grid, budget)
            assert torch.equal(coverage, torch.stack([curve[budget - 1], curve[budget - 1]]))
            kv, cnt, none_curve, none_cov, _ = _select(ext, pq, pk, lay, 0.125, budget)  # no curve asked
            assert torch.equal(kv, ref.kv_idx) and none_curve is None and none_cov is None


def test_coverage_bound_chooses_the_torch_rules_budget(ext):
    """Under the bound the budget is chosen inside the launches: the same rule
    (``coverage_bounded_budget``) on the same curve, and the selection at that budget, k_base wide."""
    q, k, lay = _pack([6000, 2000, 100], 14, 2, 64, torch.bfloat16, 128, seed=5)
    pq, pk = _pooled(ext, q, k, lay, 1 / 64)
    scores = _scores(pq, pk, lay, 0.125)
    chosen = set()
    for p in (0.0, 0.05, 0.3, 1.0):
        for k_request in (1, 2, 4, 9, 20):
            kv, cnt, curve, coverage, k_used = _select(ext, pq, pk, lay, 0.125, k_request, k_base=24, p=p,
                                                       curve_len=24)
            want = int(coverage_bounded_budget(curve, k_request, 24, p))
            assert int(k_used) == want, (p, k_request)
            assert torch.allclose(curve, coverage_curve(scores, 24), atol=1e-5)
            ref = select_blocks(scores, lay, want, 24)
            assert torch.equal(kv, ref.kv_idx) and torch.equal(cnt, ref.kv_cnt), (p, k_request)
            assert torch.equal(coverage, torch.stack([curve[want - 1], curve[23]]))
            chosen.add(want)
    assert len(chosen) > 5  # the bound chose between requests and k_base, not one budget for all


def test_rows_longer_than_the_default_shared_memory(ext):
    """A sequence of 4100 blocks: its rows sort 8192 keys in 96 KB of shared memory (opt-in)."""
    q, k, lay = _pack([4100 * 64], 2, 1, 64, torch.bfloat16, 64, seed=1)
    pq, pk = _pooled(ext, q, k, lay, 1 / 64)
    scores = _scores(pq, pk, lay, 0.125)
    kv, cnt, curve, _, _ = _select(ext, pq, pk, lay, 0.125, 16, curve_len=16)
    ref = select_blocks(scores, lay, 16)
    assert torch.equal(kv, ref.kv_idx) and torch.equal(cnt, ref.kv_cnt)
    assert torch.allclose(curve, coverage_curve(scores, 16), atol=1e-5)


def test_bad_input_is_refused_with_the_argument_named(ext):
    q, k, lay = _pack([300], 4, 2, 64, torch.bfloat16, 64)
    pq, pk = _pooled(ext, q, k, lay)
    with pytest.raises(RuntimeError, match="budget must be >= 1, got 0"):
        _select(ext, pq, pk, lay, 0.125, 0)
    with pytest.raises(RuntimeError, match="needs a curve of k_base = 8 entries, got 4"):
        _select(ext, pq, pk, lay, 0.125, 2, k_base=8, p=0.1, curve_len=4)
    with pytest.raises(RuntimeError, match="pooled_q and pooled_k differ in shape"):
        _select(ext, pq, pk[:, :-1].contiguous(), lay, 0.125, 2)
    with pytest.raises(RuntimeError, match="block_start must be a contiguous 1-D Int CUDA tensor"):
        ext.router_pool_cuda(q, lay.block_start.long(), lay.block_end, 2)
    with pytest.raises(RuntimeError, match=r"heads \(3\) must be a multiple of the groups \(2\)"):
        ext.router_pool_cuda(q[:, :3], lay.block_start, lay.block_end, 2)
    with pytest.raises(RuntimeError, match="pools bf16, fp16 or fp32, got Int"):
        ext.router_pool_cuda(q.int(), lay.block_start, lay.block_end, 2)
