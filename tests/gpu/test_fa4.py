"""GPU tests of ``--sparse-attn-impl fa4`` (flash-attn-4's block-sparse kernels through our backend).

The correctness grid of the other kernels (``test_kernels.py``: THD packs, odd lengths, budgets 1
to all) under the same 2x-the-low-precision-reference rule, plus what is particular to fa4: block
64 refused by name, and ``auto`` never resolving to it in deterministic mode. Skipped where
``flash_attn.cute`` does not import (see docs/FA4.md for the packages and PYTHONPATH).
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from megatron_sparsebalance.ops import fa4_attention, implementations, measured_order
from megatron_sparsebalance.ops.implementations import resolve_impl, unavailable_reason
from megatron_sparsebalance.ops.router import block_scores, select_blocks
from tests.gpu.test_kernels import _check_against_reference, _grads, _pack

pytestmark = pytest.mark.gpu


def _fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reason = unavailable_reason("fa4", torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"fa4: {reason}")
    return implementations.attention_function("fa4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,hq,g", [(64, 14, 2), (128, 16, 2)])
@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("lens", [[97], [1025], [300, 97, 1025, 64]], ids=["97", "1025", "varlen"])
@pytest.mark.parametrize("budget", [1, 2, "half", "all"])
def test_grid(dtype, d, hq, g, block, lens, budget):
    fn = _fa4()
    q, k, v, route = _pack(lens, hq, g, d, dtype, block, budget)
    _check_against_reference(fn, q, k, v, route, 1.0 / math.sqrt(d))


@pytest.mark.parametrize("d,hq,g", [(64, 4, 4), (64, 8, 1), (64, 6, 2), (128, 14, 2)])
def test_group_sizes_and_per_sequence_budgets(d, hq, g):
    fn = _fa4()
    q, k, v, route = _pack([700, 1500, 33, 2048], hq, g, d, torch.bfloat16, 128, 1)
    lay = route.layout
    route = select_blocks(block_scores(q.detach(), k.detach(), lay), lay, torch.tensor([2, 5, 1, 9]))
    _check_against_reference(fn, q, k, v, route, 0.1)


@pytest.mark.parametrize("d,hq,g", [(64, 14, 2), (128, 16, 2)])
@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("own_forward", [True, False], ids=["own-forward", "fa4-forward"])
def test_both_forwards(d, hq, g, block, own_forward):
    """The grid runs whichever forward this GPU gets (ours on Hopper with the extension built);
    here both, on the varlen pack: ours with FA4's backward, and FA4's own in both directions."""
    _fa4()
    q, k, v, route = _pack([300, 97, 1025, 64], hq, g, d, torch.bfloat16, block, "half")
    if own_forward and not fa4_attention.own_forward_runs_on(q):
        pytest.skip("our forward kernel does not run here (not Hopper, or the extension not built)")
    fn = functools.partial(fa4_attention.block_sparse_attention, own_forward_kernel=own_forward)
    _check_against_reference(fn, q, k, v, route, 1.0 / math.sqrt(d))


def test_whole_blocks_need_no_padding_and_match_too():
    """A pack of whole blocks goes to FA4 as it is (no copy): same rule."""
    fn = _fa4()
    q, k, v, route = _pack([1024, 2048, 128], 14, 2, 64, torch.bfloat16, 128, 3)
    _check_against_reference(fn, q, k, v, route, 0.125)


def test_large_values_no_nan():
    fn = _fa4()
    q, k, v, route = _pack([1025], 16, 2, 128, torch.bfloat16, 128, 4)
    with torch.no_grad():
        q.mul_(8)
        k.mul_(8)
    go = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    out = fn(q, k, v, route, 1 / math.sqrt(128))
    for t in (out,) + _grads(out, (q, k, v), go):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("hq,g", [(14, 2), (16, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("lens,budget", [([97], 1), ([1025], "all"), ([300, 97, 1025, 64], "half"),
                                         ([4000, 129, 2048], 3), ([9000], 7)])
def test_backward_plan_of_the_extension_equals_the_torch_one(block, hq, g, lens, budget):
    """The backward's tensors from our one-launch CUDA index (fa4_backward_plan) against the torch
    construction the CPU tests check against FA4's semantics (fa4_block_plan): the same counts, the
    same first cnt entries of every row, the same partial blocks. Needs the extension, not FA4."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reason = unavailable_reason("cuda", torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"the CUDA extension: {reason}")
    *_, route = _pack(lens, hq, g, 64, torch.bfloat16, block, budget)
    got = fa4_attention.fa4_backward_plan(route, hq)
    want = fa4_attention.fa4_block_plan(route, hq, forward=False)
    assert got.num_sub_blocks == want.num_sub_blocks
    assert got.fwd_full_cnt is None and got.fwd_full_idx is None
    for name in ("bwd_mask_cnt", "bwd_mask_idx", "bwd_full_cnt"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    cnt = want.bwd_full_cnt.cpu()
    assert int(cnt.max()) <= got.bwd_full_idx.shape[-1] and got.bwd_full_idx.shape[:3] == want.bwd_full_idx.shape[:3]
    assert int(cnt.sum()) > 0 or budget == 1
    width = want.bwd_full_idx.shape[-1]
    valid = torch.arange(width) < cnt[..., None]
    assert torch.equal(got.bwd_full_idx[..., :width].cpu()[valid], want.bwd_full_idx.cpu()[valid])


def test_block_64_is_refused_by_name():
    fn = _fa4()
    q, k, v, route = _pack([300], 4, 2, 64, torch.bfloat16, 64, 2)
    with pytest.raises(ValueError, match="--moba-block-size"):
        fn(q, k, v, route, 0.125)
    with pytest.raises(ValueError, match="--moba-block-size"):
        resolve_impl("fa4", "cuda", block_size=64)
    assert resolve_impl("auto", "cuda", block_size=64) != "fa4"


def test_auto_never_picks_fa4_in_deterministic_mode(monkeypatch):
    """Even where FA4 is measured fastest on this GPU, deterministic mode resolves auto to one of
    our deterministic kernels, and asking for fa4 by name is refused."""
    _fa4()
    name = torch.cuda.get_device_name()
    monkeypatch.setattr(measured_order, "MEASURED", {name: {"order": ["fa4", "cuda", "triton"]}})
    implementations._resolve_impl.cache_clear()
    try:
        assert resolve_impl("auto", "cuda") == "fa4"
        assert resolve_impl("auto", "cuda", deterministic=True) in ("cuda", "triton")
        with pytest.raises(ValueError, match="--deterministic-mode"):
            resolve_impl("fa4", "cuda", deterministic=True)
    finally:
        implementations._resolve_impl.cache_clear()
