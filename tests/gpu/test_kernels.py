"""GPU correctness grid of the block-sparse attention kernels (Triton and CUDA).

flash-attention's rule: against an fp32 reference (``sparse_attention_naive(..., upcast=True)``),
the kernel's max error on the output and on dq/dk/dv is at most twice the error of the same math
run by the reference in the kernel's dtype, plus a small floor (a fraction of the reference's
magnitude, far under one bf16 ulp of it). NaN or Inf never passes.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_sparsebalance.ops.implementations import attention_function, resolve_impl, unavailable_reason
from megatron_sparsebalance.ops.naive import sparse_attention_naive
from megatron_sparsebalance.ops.router import block_scores, select_blocks
from tests.packs import random_pack

pytestmark = pytest.mark.gpu

IMPLS = ("triton", "cuda")


def _impl(name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reason = unavailable_reason(name, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    return attention_function(name)


def _pack(lens, hq, g, d, dtype, block, budget, seed=0, structured=True):
    """Random-but-structured q/k/v of a THD pack (requiring grad) and the MoBA route at ``budget``."""
    q, k, v, lay = random_pack(lens, hq, g, d, dtype, block, seed, structured)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    if budget == "all":
        budget = lay.max_blocks_per_seq
    elif budget == "half":
        budget = max(1, (lay.max_blocks_per_seq + 1) // 2)
    route = select_blocks(block_scores(q.detach(), k.detach(), lay), lay, budget)
    return q, k, v, route


def _grads(out, inputs, go):
    return torch.autograd.grad(out, inputs, go)


def _check_against_reference(fn, q, k, v, route, scale):
    go = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    out = fn(q, k, v, route, scale)
    dq, dk, dv = _grads(out, (q, k, v), go)
    ref = sparse_attention_naive(q, k, v, route, scale, upcast=True)
    rdq, rdk, rdv = _grads(ref, (q, k, v), go.float())
    low = sparse_attention_naive(q, k, v, route, scale, upcast=False)
    ldq, ldk, ldv = _grads(low, (q, k, v), go)
    for name, got, r, lo in (("out", out, ref, low), ("dq", dq, rdq, ldq), ("dk", dk, rdk, ldk), ("dv", dv, rdv, ldv)):
        assert got.dtype == q.dtype and got.shape == lo.shape, name
        assert torch.isfinite(got).all(), f"{name} has NaN/Inf"
        err = (got.float() - r).abs().max().item()
        base = (lo.float() - r).abs().max().item()
        floor = 1e-3 * r.abs().max().item() + 1e-5
        assert err <= 2 * base + floor, f"{name}: kernel error {err:.3e} > 2 x reference error {base:.3e} + {floor:.1e}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,hq,g", [(64, 14, 2), (128, 16, 2)])
@pytest.mark.parametrize("block", [64, 128, 256])
@pytest.mark.parametrize("lens", [[97], [1025], [300, 97, 1025, 64]], ids=["97", "1025", "varlen"])
@pytest.mark.parametrize("budget", [1, 2, "half", "all"])
def test_grid(impl, dtype, d, hq, g, block, lens, budget):
    fn = _impl(impl)
    q, k, v, route = _pack(lens, hq, g, d, dtype, block, budget)
    _check_against_reference(fn, q, k, v, route, 1.0 / math.sqrt(d))


# Group sizes R = hq / g that give the Hopper dK/dV kernel each shape of query tile (BoxWalk):
# whole tokens of the group's heads (R = 1, 2, 8) and one head's tokens (R = 3, and 7 at head
# dim 128, whose 64-row tiles R does not divide).
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,hq,g", [(64, 4, 4), (64, 8, 1), (64, 8, 4), (64, 6, 2), (128, 14, 2)])
def test_group_sizes_and_per_sequence_budgets(impl, d, hq, g):
    fn = _impl(impl)
    lens = [700, 1500, 33, 2048]
    q, k, v, _ = _pack(lens, hq, g, d, torch.bfloat16, 128, 1)
    route = select_blocks(block_scores(q.detach(), k.detach(), _.layout), _.layout, torch.tensor([2, 5, 1, 9]))
    _check_against_reference(fn, q, k, v, route, 0.1)


@pytest.mark.parametrize("impl", IMPLS)
def test_dense_when_budget_covers_all(impl):
    """With k >= blocks the output is dense causal attention (SDPA)."""
    fn = _impl(impl)
    q, k, v, route = _pack([1000], 8, 2, 128, torch.bfloat16, 128, "all")
    out = fn(q, k, v, route, 1 / math.sqrt(128))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1).repeat_interleave(4, 0),
        v.float().transpose(0, 1).repeat_interleave(4, 0), is_causal=True).transpose(0, 1)
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl):
    """Two runs give bitwise equal gradients: no floating-point atomics anywhere, and the CUDA
    dK/dV adds up the parts of the query lists it cuts in a fixed order. Its plan cuts lists here
    even with 100 slots, fewer than the backward has (about 122: dQ's 9.1 MB less 1 MiB over 64 KiB slots),
    and more slots never raise the cap."""
    fn = _impl(impl)
    q, k, v, route = _pack([4096, 1000], 14, 2, 64, torch.bfloat16, 128, 6)
    if impl == "cuda":
        from megatron_sparsebalance.ops import cuda_attention, native

        q_ptr, _ = cuda_attention.transpose_index_gpu(route.kv_idx, route.kv_cnt)
        _, split, _ = native.native().dkdv_plan_cuda(q_ptr, *route.kv_idx.shape[:2], 1, 100)
        assert (split[:, 1] > 1).any()
    go = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    a = _grads(fn(q, k, v, route, 0.125), (q, k, v), go)
    b = _grads(fn(q, k, v, route, 0.125), (q, k, v), go)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,block", [(128, 64), (128, 128), (64, 128)])
def test_large_values_no_nan(impl, d, block):
    """Scores in the hundreds (unscaled large activations) stay finite; at block 128 (the Hopper
    dK/dV kernel, at both head dims) the gradients also keep the 2x rule, where lse is far from 0."""
    fn = _impl(impl)
    q, k, v, route = _pack([1025], 16, 2, d, torch.bfloat16, block, 4)
    with torch.no_grad():
        q.mul_(8)
        k.mul_(8)
    go = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    out = fn(q, k, v, route, 1 / math.sqrt(d))
    for t in (out,) + _grads(out, (q, k, v), go):
        assert torch.isfinite(t).all()
    if block == 128:
        _check_against_reference(fn, q, k, v, route, 1 / math.sqrt(d))


@pytest.mark.parametrize("impl,block", [("triton", 64), ("cuda", 64), ("cuda", 128)])
def test_backward_peak_is_the_gradients_and_delta(impl, block):
    """The transposed index is freed before dQ is allocated, so at the backward's peak only the
    three gradients and delta are live (what FlexAttention's backward holds; its index comes with
    its BlockMask, built before the step). At block 64 the index is 128 KiB, above any rounding.
    At block 128 the Hopper dK/dV cuts the longest query lists (up to 64 blocks, 32.5 on average)
    and keeps their parts' fp32 sums (slots of 31 MiB here, 16 of them used) only while dQ is not
    yet allocated."""
    import importlib

    _impl(impl)
    ta = importlib.import_module(f"megatron_sparsebalance.ops.{impl}_attention")
    q, k, v, route = _pack([8192], 16, 2, 128, torch.bfloat16, block, "all")
    lay = route.layout
    scale = 1 / math.sqrt(128)
    args = (route.kv_idx, route.kv_cnt, lay.block_start, lay.block_end, scale, block)
    with torch.no_grad():
        out, lse = ta._forward(q, k, v, *args)
    go = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dq, dk, dv = ta._backward(go, q.detach(), k.detach(), v.detach(), out, lse, *args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base

    def block_bytes(n):  # the caching allocator hands out multiples of 512 bytes
        return -(-n // 512) * 512

    live = [t.numel() * t.element_size() for t in (dq, dk, dv)] + [q.shape[0] * q.shape[1] * 4]  # + delta
    index_bytes = route.kv_idx.numel() * 4
    assert block != 64 or index_bytes >= 128 * 1024
    assert peak <= sum(block_bytes(n) for n in live), (peak, sum(live), index_bytes)


@pytest.mark.parametrize("build", ["cuda", "torch"])
def test_transposed_index_matches_router(build):
    """The backward's per-KV-block index, by the CUDA extension and by torch ops, against the
    reference: the same CSR, each list ascending; over block sizes, varlen packs, budgets from 1
    to every block and mixed per-sequence budgets."""
    from megatron_sparsebalance.ops import cuda_attention, native
    from megatron_sparsebalance.ops.router import transpose_route_index

    _impl("triton")
    if build == "cuda" and not native.cuda_kernels_run_on(torch.device("cuda")):
        pytest.skip("the CUDA extension is not built for this GPU")
    transpose = cuda_attention.transpose_index_gpu if build == "cuda" else cuda_attention.transpose_index_torch
    cases = [([3000, 500, 129], 64, 7), ([3000, 500, 129], 64, 1), ([9000], 128, "all"), ([70, 4100, 1], 256, 3),
             ([2048] * 6, 128, [1, 16, 3, 16, 2, 9])]
    for lens, block, budget in cases:
        q, k, _, route = _pack(lens, 8, 2, 64, torch.bfloat16, block, 1 if isinstance(budget, list) else budget)
        if isinstance(budget, list):  # one budget per sequence
            lay = route.layout
            route = select_blocks(block_scores(q.detach(), k.detach(), lay), lay, torch.tensor(budget), max(budget))
        qp, qi = transpose(route.kv_idx, route.kv_cnt)
        rp, ri = transpose_route_index(route.kv_idx, route.kv_cnt)
        assert torch.equal(qp, rp) and torch.equal(qi[: ri.numel()], ri), (lens, block, budget)


def _expected_cap(lengths, share, max_slots):
    """The cap dkdv_plan_kernel picks: the smallest of cap0 << c (c < 16) whose cut lists'
    parts fit max_slots, cap0 = max(2, ceil(total / share)); None: no list is cut."""
    cap0 = max(2, -(-int(lengths.sum()) // share))
    for c in range(16):
        cap = cap0 << c
        parts = -(-lengths // cap)
        if int(parts[parts > 1].sum()) <= max_slots:
            return cap
    return None


def _check_plan(lengths, items, split, share, max_slots, shift):
    pairs = lengths.numel()
    cap = _expected_cap(lengths, share, max_slots)
    want = torch.ones_like(lengths) if cap is None else (-(-lengths // cap)).clamp(min=1)
    assert torch.equal(split[:, 1], want.int())
    n = int(want.sum())
    assert n <= pairs + share and items.shape[0] == pairs + share
    assert (items[:n, 0] >= 0).all() and (items[n:, 0] == -1).all()
    live = items[:n].long()
    # every list is covered by its parts, in order, without overlap: part j = [j L / n, (j + 1) L / n)
    live = live[(live[:, 0] * (pairs + share) + live[:, 3]).argsort()]
    first = torch.repeat_interleave(want.cumsum(0) - want, want)
    assert torch.equal(live[:, 0], torch.repeat_interleave(torch.arange(pairs), want))
    assert torch.equal(live[:, 3], torch.arange(n) - first)
    L, parts = lengths[live[:, 0]], want[live[:, 0]]
    assert torch.equal(live[:, 1], live[:, 3] * L // parts) and torch.equal(live[:, 2], (live[:, 3] + 1) * L // parts)
    # slots: one per part of a cut list, disjoint ranges within max_slots; whole lists take none
    cut = want > 1
    assert (split[~cut, 0] == -1).all()
    starts, counts = split[cut, 0].long(), want[cut]
    order = starts.argsort()
    ends = starts[order] + counts[order]
    assert (starts[order][1:] >= ends[:-1]).all() and int(counts.sum()) <= max_slots
    if cut.any():
        assert int(starts.min()) >= 0 and int(ends.max()) <= max_slots
    # longest part first (binned by length >> shift)
    lens = (items[:n, 2] - items[:n, 1]).long() >> shift
    assert (lens.diff() <= 0).all()
    return cap


def test_dkdv_plan_cuts_long_lists_and_orders_parts_longest_first():
    """The Hopper dK/dV's plan (dkdv_plan_kernel) from a transposed index's offsets: lists longer
    than the cap cut into equal parts that cover them exactly once, the cap the smallest whose
    parts' partial sums fit the slots given, each cut list's slots its own, the parts in order of
    length (binned by length >> shift above 1024 blocks); at small and large NB and G, with few
    slots and none, and as the backward builds it from a route's transposed index."""
    from megatron_sparsebalance.ops import cuda_attention, native

    _impl("cuda")
    ext = native.native()
    gen = torch.Generator().manual_seed(0)
    # short lists and a few that every query block selects (the lists the plan cuts)
    for G, NB, shift, max_slots in ((1, 1, 0, 528), (2, 512, 0, 528), (3, 700, 0, 40), (2, 5000, 3, 528),
                                    (2, 512, 0, 0), (2, 512, 0, 3)):
        lengths = torch.randint(0, 9, (G * NB,), generator=gen)
        lengths[torch.randperm(G * NB, generator=gen)[:3]] = NB
        q_ptr = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]).cuda()
        items, split, share = ext.dkdv_plan_cuda(q_ptr, G, NB, 1, max_slots)
        cap = _check_plan(lengths, items.cpu(), split.cpu(), share, max_slots, shift)
        # three lists of NB blocks: cut where 40 slots or more hold their parts, whole with 0 or 3
        assert bool((split[:, 1] > 1).any()) == (max_slots >= 40 and G * NB > 1), (G, NB, max_slots, cap)
    *_, route = _pack([9000, 3000], 8, 2, 64, torch.bfloat16, 128, 7)
    q_ptr, _ = cuda_attention.transpose_index_gpu(route.kv_idx, route.kv_cnt)
    G, NB = route.kv_idx.shape[:2]
    for nsub in (1, 2):
        items, split, share = ext.dkdv_plan_cuda(q_ptr, G, NB, nsub, 528)
        assert _check_plan(q_ptr.diff().cpu().long(), items.cpu(), split.cpu(), share, 528, 0) is not None


def test_cuda_extension_refuses_bad_input_with_a_message():
    """A bad argument reaching the C++ entry points raises a RuntimeError that names it (on the
    H200 image a message formatted by TORCH_CHECK itself crashed the process: csrc/check.h)."""
    from megatron_sparsebalance.ops import native

    _impl("cuda")
    ext = native.native()
    q = torch.zeros(256, 4, 96, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(2, 2, 1, dtype=torch.int32, device="cuda")
    cnt = torch.ones(2, 2, dtype=torch.int32, device="cuda")
    bounds = torch.zeros(2, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="head dim must be 64 or 128, got 96"):
        ext.sparse_attn_fwd_cuda(q, q[:, :2], q[:, :2], idx, cnt, bounds, bounds, 0.1, 128)
    with pytest.raises(RuntimeError, match="kv_idx must be a contiguous int32 CUDA tensor"):
        ext.transpose_index_cuda(idx.long(), cnt)


def test_triton_op_compiles_fullgraph():
    """The custom op traces under torch.compile(fullgraph=True), forward and backward."""
    from megatron_sparsebalance.ops import triton_attention as ta

    _impl("triton")
    q, k, v, route = _pack([1500], 8, 2, 64, torch.bfloat16, 128, 3)
    lay = route.layout

    def f(q, k, v):
        out, _ = ta.triton_attn_fwd(q, k, v, route.kv_idx, route.kv_cnt, lay.block_start, lay.block_end, 0.125, 128)
        return out.float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    g1 = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    g2 = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_triton_router_matches_torch_router():
    from megatron_sparsebalance.ops.triton_router import block_scores_triton

    _impl("triton")
    for d, block in ((64, 64), (128, 128), (128, 256)):
        q, k, _, _ = _pack([5000, 300, 1025], 16, 2, d, torch.bfloat16, block, 3)
        lay = _.layout
        ref = block_scores(q.detach(), k.detach(), lay)
        got = block_scores_triton(q.detach(), k.detach(), lay)
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(got))
        assert torch.allclose(got[fin], ref[fin], atol=1e-4, rtol=1e-4)
        a = select_blocks(ref, lay, 9)
        b = select_blocks(got, lay, 9)
        assert torch.equal(a.kv_cnt, b.kv_cnt)
        assert (a.kv_idx != b.kv_idx).float().mean().item() < 1e-3  # only near-ties may flip


def test_gpu_router_selection_and_coverage_equal_torch_router_on_the_same_scores():
    """One launch of ``select_and_cover`` against ``select_blocks`` + ``coverage_curve``: same
    selection bit for bit (ties to the lower block: the rounded scores are full of ties)."""
    from megatron_sparsebalance.ops.router import coverage_curve
    from megatron_sparsebalance.ops.triton_router import pooled_dots, select_and_cover

    _impl("triton")
    for lens, block in (([5000, 300, 1025, 7], 64), ([9000], 128), ([3000, 3000], 256)):
        q, k, _, route = _pack(lens, 14, 2, 64, torch.bfloat16, block, 3)
        lay = route.layout
        dots = pooled_dots(q.detach(), k.detach(), lay)
        for d in (dots, dots.mul(8).round()):
            scores = torch.where(lay.candidates, d * 0.125, float("-inf"))
            for budget in (1, 3, 17, 64):
                n = max(budget, 32)
                kv, cnt, curve = select_and_cover(d, lay, 0.125, budget=budget, width=budget, curve_len=n)
                ref = select_blocks(scores, lay, budget)
                assert torch.equal(kv, ref.kv_idx) and torch.equal(cnt, ref.kv_cnt), (lens, budget)
                assert torch.allclose(curve, coverage_curve(scores, n), atol=1e-5), (lens, budget)
            per_seq = torch.tensor([2, 9, 1, 5][: len(lens)], device="cuda")
            kv, cnt, _ = select_and_cover(d, lay, 0.125, budget=per_seq, width=9)
            ref = select_blocks(scores, lay, per_seq.cpu(), 9)
            assert torch.equal(kv, ref.kv_idx) and torch.equal(cnt, ref.kv_cnt), lens


@pytest.mark.parametrize("router", ["cuda", "triton"])
@pytest.mark.parametrize("k_base,p", [(None, None), (32, 0.1), (32, 0.0), (32, 1.0)])
def test_route_on_gpu_matches_the_torch_router(monkeypatch, router, k_base, p):
    """``route`` on a GPU (each GPU router) against the torch router on the same q, k: the same
    budget under the coverage bound, the same coverage, the same selection up to near-ties (they
    pool in different fp32 summation orders)."""
    import importlib

    from megatron_sparsebalance.ops.sparse_attention import RouteSync, _route_torch, route

    # the module itself: megatron_sparsebalance.ops exports a function of the same name
    sparse_attention = importlib.import_module("megatron_sparsebalance.ops.sparse_attention")
    _impl(router)
    monkeypatch.setattr(sparse_attention, "gpu_router",
                        lambda q, layout, sync=None, bounded=False: getattr(sparse_attention, f"_route_{router}"))
    q, k, _, rt = _pack([6000, 2000, 100], 14, 2, 64, torch.bfloat16, 128, 3)
    for budget in (4, 16, 48):
        got, stats = route(q.detach(), k.detach(), rt.layout, budget, k_base=k_base, p=p)
        bounded = p is not None and budget < k_base
        ref, curve, k_used, _ = _route_torch(q.detach(), k.detach(), rt.layout, budget, k_base or 0,
                                             p if bounded else None, max(budget, k_base or 1), RouteSync())
        assert stats.k_used == int(k_used)
        assert got.kv_idx.shape == ref.kv_idx.shape
        assert (got.kv_idx != ref.kv_idx).float().mean().item() < 1e-3
        assert abs(stats.coverage_used - float(curve[int(k_used) - 1])) < 1e-4
        if k_base:
            assert abs(stats.coverage_base - float(curve[k_base - 1])) < 1e-4


def test_eager_path_equals_the_registered_op():
    """Outside tracing the attention skips the custom op's dispatch; it must compute the same."""
    from megatron_sparsebalance.ops import triton_attention as ta

    _impl("triton")
    q, k, v, route = _pack([1500, 700], 14, 2, 64, torch.bfloat16, 128, 5)
    lay = route.layout
    args = (route.kv_idx, route.kv_cnt, lay.block_start, lay.block_end, 0.125, 128)
    go = torch.randn_like(q)
    eager = ta.triton_attention(q, k, v, *args)
    op, _ = ta.triton_attn_fwd(q, k, v, *args)
    assert torch.equal(eager, op)
    for a, b in zip(torch.autograd.grad(eager, (q, k, v), go), torch.autograd.grad(op, (q, k, v), go)):
        assert torch.equal(a, b)
    compiled = torch.compile(lambda q, k, v: ta.triton_attention(q, k, v, *args).float().square().sum(), fullgraph=True)
    assert torch.allclose(compiled(q, k, v), eager.float().square().sum(), rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper GPU")
def test_auto_takes_cuda_on_hopper_when_its_wgmma_kernels_are_built():
    """cuda before triton; ahead of cuda only fa4 (measured faster on some GPUs, e.g. the H100),
    and only where flash-attn-4 imports and deterministic mode is off."""
    from megatron_sparsebalance.ops import native
    from megatron_sparsebalance.ops.implementations import auto_order

    assert native.HAVE_NATIVE_SM90A, "build with MSB_CUDA=1 (MSB_CUDA_ARCH defaults to 90a)"
    dev = torch.device("cuda")
    assert resolve_impl("auto", dev, deterministic=True) == "cuda"
    order = auto_order(dev)
    assert order.index("cuda") < order.index("triton")
    fa4_first = "fa4" in order and order.index("fa4") < order.index("cuda") and unavailable_reason("fa4", dev) is None
    assert resolve_impl("auto", dev) == ("fa4" if fa4_first else "cuda")
