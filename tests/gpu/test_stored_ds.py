"""GPU tests of the stored-dS backward (``--sparse-attn-ds-buffer-gib``): dK/dV writes every dS tile
and dQ = dS K reads them back (csrc/cuda/attention_kernels_sm90.cuh, "Stored dS").

The same rule as the kernel grid (tests/gpu/test_kernels.py): against the fp32 reference, at most
twice the error of the reference run in the kernel's dtype. Head dim 128 only, where it runs
(``stored_ds_supported``).
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from megatron_sparsebalance.ops import cuda_attention, native
from tests.gpu.test_kernels import _check_against_reference, _grads, _pack

pytestmark = pytest.mark.gpu

UNLIMITED = 1 << 50


@pytest.fixture
def stored_ds():
    """``cuda`` with an unlimited dS buffer; skips where the kernels do not run."""
    if not torch.cuda.is_available() or not native.HAVE_NATIVE_CUDA:
        pytest.skip("needs CUDA and the CUDA extension")
    if not native.native().stored_ds_supported(128, 128):
        pytest.skip("the stored-dS backward needs the Hopper kernels (sm_90a)")
    return functools.partial(cuda_attention.block_sparse_attention, ds_buffer_bytes=UNLIMITED)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# R = 8, 1, 4 and 7: dK/dV tiles of whole tokens of the group's heads and (R = 7, which does not
# divide the tile's 64 rows) of one head's tokens; the slot's rows follow them.
@pytest.mark.parametrize("d,hq,g", [(128, 16, 2), (128, 4, 4), (128, 8, 2), (128, 14, 2)])
@pytest.mark.parametrize("lens", [[97], [1025], [300, 97, 1025, 64]], ids=["97", "1025", "varlen"])
@pytest.mark.parametrize("budget", [1, 2, "half", "all"])
def test_grid(stored_ds, dtype, d, hq, g, lens, budget):
    q, k, v, route = _pack(lens, hq, g, d, dtype, 128, budget)
    assert cuda_attention.takes_stored_ds(q, k, route, UNLIMITED)
    _check_against_reference(stored_ds, q, k, v, route, 1.0 / math.sqrt(d))


@pytest.mark.parametrize("d,hq,g", [(128, 16, 2), (128, 14, 2)])
def test_dk_dv_equal_the_two_pass_ones_and_dq_is_deterministic(stored_ds, d, hq, g):
    """dK and dV come from the same kernel with its stores added: bitwise the two-pass ones. dQ
    sums each row's tiles in the route's order: bitwise equal over two runs."""
    q, k, v, route = _pack([4096, 1000], hq, g, d, torch.bfloat16, 128, 6)
    go = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    two_pass = _grads(cuda_attention.block_sparse_attention(q, k, v, route, 0.125), (q, k, v), go)
    a = _grads(stored_ds(q, k, v, route, 0.125), (q, k, v), go)
    b = _grads(stored_ds(q, k, v, route, 0.125), (q, k, v), go)
    assert torch.equal(a[1], two_pass[1]) and torch.equal(a[2], two_pass[2])
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_slots_name_each_route_entry_in_the_transposed_lists(stored_ds):
    """transpose_index_cuda's slots: entry i of row (g, qb) holds kv block j = kv_idx[g, qb, i], and
    its slot lies in j's list and names qb there."""
    q, k, _, route = _pack([3000, 500, 129, 2048], 8, 2, 128, torch.bfloat16, 128, 7)
    q_ptr, q_idx, slots = native.native().transpose_index_cuda(route.kv_idx, route.kv_cnt, True)
    G, NB, _ = route.kv_idx.shape
    idx, cnt, slots, q_ptr, q_idx = (x.cpu() for x in (route.kv_idx, route.kv_cnt, slots, q_ptr, q_idx))
    seen = set()
    for g in range(G):
        for qb in range(NB):
            for i in range(int(cnt[g, qb])):
                j, s = int(idx[g, qb, i]), int(slots[g, qb, i])
                assert q_ptr[g * NB + j] <= s < q_ptr[g * NB + j + 1] and int(q_idx[s]) == qb, (g, qb, i)
                seen.add(s)
    assert len(seen) == int(q_ptr[-1])  # every slot named once


def test_taken_only_where_the_buffer_fits_at_block_128(stored_ds):
    q, k, _, route = _pack([2048, 700], 16, 2, 128, torch.bfloat16, 128, 4)
    need = cuda_attention.stored_ds_bytes(q, k, route.kv_idx, 128)
    G, NB, K = route.kv_idx.shape
    assert need == G * NB * K * 8 * 128 * 128 * 2
    assert cuda_attention.takes_stored_ds(q, k, route, need)
    assert not cuda_attention.takes_stored_ds(q, k, route, need - 1)
    assert not cuda_attention.takes_stored_ds(q, k, route, 0)
    q, k, _, route = _pack([2048, 700], 16, 2, 128, torch.bfloat16, 64, 4)
    assert not cuda_attention.takes_stored_ds(q, k, route, UNLIMITED)  # block 64
    q, k, _, route = _pack([2048, 700], 14, 2, 64, torch.bfloat16, 128, 4)
    assert not cuda_attention.takes_stored_ds(q, k, route, UNLIMITED)  # head dim 64


def test_a_buffer_short_of_the_routes_shape_is_refused(stored_ds):
    """The kernels index slots up to a count only the device knows: a buffer of any other size than
    the route's shape holds is an error naming it, before a kernel runs."""
    q, k, _, route = _pack([1000], 16, 2, 128, torch.bfloat16, 128, 3)
    ext = native.native()
    _, _, slots = ext.transpose_index_cuda(route.kv_idx, route.kv_cnt, True)
    lay = route.layout
    short = q.new_empty(cuda_attention.stored_ds_bytes(q, k, route.kv_idx, 128) // 2 - 8 * 128 * 128)
    with pytest.raises(RuntimeError, match="G \\* NB \\* K slots"):
        ext.sparse_attn_bwd_dq_from_ds_cuda(q.detach(), k.detach(), short, slots, route.kv_idx, route.kv_cnt,
                                            lay.block_start, lay.block_end, 0.1, 128)
