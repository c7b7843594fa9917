"""The naive reference against dense attention and against an independent per-token loop."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_sparsebalance.ops import BlockLayout, block_scores, select_blocks, sparse_attention
from megatron_sparsebalance.ops.dense import dense_causal_attention
from megatron_sparsebalance.ops.naive import sparse_attention_naive


def pack(lengths, hq=4, g=2, d=16, dtype=torch.float32):
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, h, d, dtype=dtype, requires_grad=True) for h in (hq, g, g))
    return q, k, v, cu


def route_for(q, k, cu, block, budget):
    lay = BlockLayout.from_cu_seqlens(cu, block, q.shape[0])
    return select_blocks(block_scores(q, k, lay), lay, budget)


def sdpa_per_sequence(q, k, v, cu, scale):
    outs = []
    for t0, t1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[t0:t1].transpose(0, 1)[None] for x in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1), is_causal=True, scale=scale)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("lengths", [[97], [1025], [64], [300, 97, 1], [128, 640, 129]])
@pytest.mark.parametrize("block", [64, 128, 256])
def test_full_budget_equals_dense(lengths, block):
    q, k, v, cu = pack(lengths)
    scale = 1 / math.sqrt(16)
    route = route_for(q, k, cu, block, budget=10_000)
    out = sparse_attention_naive(q, k, v, route, scale)
    ref = sdpa_per_sequence(q, k, v, cu, scale)
    assert torch.allclose(out, ref, atol=2e-5)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=2e-5)
    dense = dense_causal_attention(q, k, v, cu, scale)  # the backend's dense path
    assert torch.allclose(dense, ref, atol=2e-5)


def loop_reference(q, k, v, route, scale):
    """Token by token: softmax over the keys of the selected blocks that are not in the future."""
    lay = route.layout
    out = torch.zeros_like(q)
    rep = q.shape[1] // k.shape[1]
    for t in range(q.shape[0]):
        i = int(lay.token_block[t])
        for h in range(q.shape[1]):
            g = h // rep
            blocks = route.kv_idx[g, i, : route.kv_cnt[g, i]].tolist()
            keys = [u for j in blocks for u in range(int(lay.block_start[j]), int(lay.block_end[j])) if u <= t]
            att = torch.softmax(q[t, h] @ k[keys, g].T * scale, 0)
            out[t, h] = att @ v[keys, g]
    return out


def test_sparse_equals_token_loop():
    q, k, v, cu = pack([64 * 4 + 5, 130], hq=4, g=2, d=8)
    route = route_for(q, k, cu, 64, budget=torch.tensor([2, 1]))
    with torch.no_grad():
        assert torch.allclose(sparse_attention_naive(q, k, v, route, 0.3), loop_reference(q, k, v, route, 0.3), atol=1e-5)


def test_no_attention_across_packed_sequences():
    q, k, v, cu = pack([200, 300])
    scale = 0.25
    with torch.no_grad():
        base = sparse_attention_naive(q, k, v, route_for(q, k, cu, 64, 2), scale)
        k2, v2 = k.clone(), v.clone()
        k2[200:] += 5 * torch.randn_like(k2[200:])
        v2[200:] += 5 * torch.randn_like(v2[200:])
        out = sparse_attention_naive(q, k2, v2, route_for(q, k2, cu, 64, 2), scale)
    assert torch.equal(out[:200], base[:200])
    assert not torch.allclose(out[200:], base[200:])


def test_small_budget_differs_from_dense():
    q, k, v, cu = pack([64 * 8])
    with torch.no_grad():
        sparse = sparse_attention(q, k, v, cu, 64, budget=2, impl="torch")
        dense = dense_causal_attention(q, k, v, cu, 0.25)
    assert torch.allclose(sparse[:128], dense[:128], atol=1e-5)  # blocks 0, 1 see everything at k=2
    assert not torch.allclose(sparse[128:], dense[128:], atol=1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(budget=0), "budget must be >= 1"),
        (dict(block_size=96), "--moba-block-size"),
        (dict(impl="cuda"), "--sparse-attn-impl=cuda is not available"),
        (dict(impl="triton"), "--sparse-attn-impl=triton is not available"),
        (dict(impl="flash"), "--sparse-attn-impl must be one of"),
        (dict(cu=torch.tensor([0, 100, 150], dtype=torch.int32)), "does not match"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, match):
    q, k, v, cu = pack([128, 64])
    args = dict(budget=2, block_size=64, impl="torch", cu=cu)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, k, v, args["cu"], args["block_size"], args["budget"], impl=args["impl"])


def test_head_counts_must_divide():
    q, k, v, cu = pack([128], hq=5, g=2)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        sparse_attention(q, k, v, cu, 64, 2, impl="torch")


@pytest.mark.parametrize("lengths, block, budget", [([97], 64, 1), ([1025], 64, 3), ([300, 97, 1], 128, 2),
                                                     ([640, 129, 64], 64, [4, 1, 2]), ([600, 700], 256, 100)])
def test_gather_path_equals_oracle(lengths, block, budget):
    from megatron_sparsebalance.ops.gather import sparse_attention_gather

    q, k, v, cu = pack(lengths, hq=6, g=2)
    route = route_for(q, k, cu, block, torch.tensor(budget) if isinstance(budget, list) else budget)
    out = sparse_attention_gather(q, k, v, route, 0.3)
    ref = sparse_attention_naive(q, k, v, route, 0.3)
    assert torch.allclose(out, ref, atol=2e-5)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        assert torch.allclose(a, b, atol=2e-5)


def test_gather_path_cost_grows_with_budget():
    """What makes DST meaningful on a CPU: fewer blocks, less time.

    The best of several interleaved runs per budget: a busy CI machine preempts some runs, never
    makes one faster than the work allows.
    """
    import time

    from megatron_sparsebalance.ops.gather import sparse_attention_gather

    q, k, v, cu = pack([64 * 48], hq=4, g=2, d=32)
    routes = {budget: route_for(q, k, cu, 64, budget) for budget in (2, 24)}
    times = {budget: float("inf") for budget in routes}
    with torch.no_grad():
        for budget, route in routes.items():
            sparse_attention_gather(q, k, v, route, 0.2)
        for _ in range(5):
            for budget, route in routes.items():
                t0 = time.perf_counter()
                sparse_attention_gather(q, k, v, route, 0.2)
                times[budget] = min(times[budget], time.perf_counter() - t0)
    assert times[2] * 3 < times[24], times
