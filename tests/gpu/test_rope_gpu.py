"""Our fused RoPE (ops/triton_rope.py) on the GPU: kernels, a megatron-core stage, host syncs.

Kernels: against megatron-core's unfused RoPE run in fp32 on upcast inputs, the kernel's error
(output and input gradient) is at most twice the error of megatron's own path in the kernel's
dtype plus a small floor (flash-attention's rule; in fp32 both are a few ulps). The stage: a
megatron GPTModel stage built as training builds it (``transformer_config`` installs the hook)
gives the same output and gradients with the hook as with megatron's unfused path, within bf16
rounding. Syncs: a call with host offsets never stops the host, cache warm or not.
"""
from __future__ import annotations

import types

import pytest
import torch

from tests.checks import run_without_sync

pytestmark = pytest.mark.gpu

CP_ONE = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _freqs(head_dim: int, rotary_percent: float, rows: int) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=head_dim, rotary_percent=rotary_percent, rotary_base=1_000_000)
    return rope(rows, packed_seq=True)  # [rows, 1, 1, rot_dim] float32 angles, as GPTModel hands them


def _offsets(lengths):
    host = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    host[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return host, host.cuda()


def _check(fn, reference, x):
    """fn(x) and its input gradient against megatron's path in fp32 (truth) and in x's dtype."""
    xin = x.detach().clone().requires_grad_()
    out = fn(xin)
    go = torch.randn(out.shape, device="cuda").to(x.dtype)
    grad, = torch.autograd.grad(out, xin, go)
    xref = x.detach().float().requires_grad_()
    ref = reference(xref)
    rgrad, = torch.autograd.grad(ref, xref, go.float())
    xlow = x.detach().clone().requires_grad_()
    low = reference(xlow)
    lgrad, = torch.autograd.grad(low, xlow, go)
    for name, got, truth, lo in (("out", out, ref, low), ("grad", grad, rgrad, lgrad)):
        assert got.dtype == x.dtype and got.shape == truth.shape, name
        assert torch.isfinite(got).all(), f"{name} has NaN/Inf"
        err = (got.float() - truth).abs().max().item()
        base = (lo.float() - truth).abs().max().item()
        floor = 1e-5 * truth.abs().max().item() + 1e-6  # fp32: megatron's path is the truth, base is 0
        assert err <= 2 * base + floor, f"{name}: kernel error {err:.3e} > 2 x megatron's {base:.3e} + {floor:.1e}"
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [14, 2])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_thd_matches_megatron(dtype, head_dim, heads, rotary_percent):
    _cuda()
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_sparsebalance.ops import triton_rope as tr

    lengths = [1000, 3000, 17]
    host, device = _offsets(lengths)
    freqs = _freqs(head_dim, rotary_percent, max(lengths))
    x = torch.randn(sum(lengths), heads, head_dim, device="cuda").to(dtype)
    reference = lambda t: rope_utils._apply_rotary_pos_emb_thd(t, host, freqs, cp_group=CP_ONE)
    from_host = _check(lambda t: tr.fused_apply_rotary_pos_emb_thd(t, host, freqs), reference, x)
    from_device = _check(lambda t: tr.fused_apply_rotary_pos_emb_thd(t, device, freqs), reference, x)
    torch.testing.assert_close(from_host, from_device)  # the position table and the in-kernel search agree


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sbhd_matches_megatron(dtype, head_dim):
    _cuda()
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_sparsebalance.ops import triton_rope as tr

    S, B, H = 2048, 2, 14
    freqs = _freqs(head_dim, 1.0, S)
    x = torch.randn(S, B, H, head_dim, device="cuda").to(dtype)
    _check(lambda t: tr.fused_apply_rotary_pos_emb(t, freqs),
           lambda t: rope_utils._apply_rotary_pos_emb_bshd(t, freqs), x)


# ----------------------------------------------------------------------------- a megatron stage

@pytest.fixture(scope="module")
def stage():
    _cuda()
    from tools.profile_latency import StageProfiler

    prof = StageProfiler("fidelity-small", 2, block_size=64, impl="triton", max_length=4096)
    if not prof.model.config.apply_rope_fusion:
        pytest.skip("megatron's fused RoPE is Transformer Engine's on this machine")
    return prof


def _stage_pass(prof, hidden, grad, psp):
    """Output, input gradient and parameter gradients of one forward+backward of the stage."""
    from megatron_sparsebalance.attention import budget_scope

    prof.model.set_input_tensor(hidden)
    with budget_scope(k=64):  # >= the blocks of every sequence: dense, routing cannot flip
        out = prof.model(None, None, None, packed_seq_params=psp)
    out.backward(grad)
    grads = {name: p.grad.detach().float().clone() for name, p in prof.model.named_parameters() if p.grad is not None}
    prof.model.zero_grad(set_to_none=True)
    hidden_grad, hidden.grad = hidden.grad.detach().float().clone(), None
    return out.detach().float(), hidden_grad, grads


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_stage_with_fused_rope_equals_unfused(stage, monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_sparsebalance.data.synthetic import thd_params

    config = stage.model.config
    assert stage.model.decoder.layers[0].self_attention.config is config  # one switch for every layer
    lengths = [1000, 1500, 17]
    host, device = _offsets(lengths)
    psp = thd_params(device, host)
    T, h = sum(lengths), stage.shape.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, 1, h, device="cuda", generator=gen).to(stage.dtype).requires_grad_()
    grad = torch.randn(T, 1, h, device="cuda", generator=gen).to(stage.dtype)

    calls = []
    ours = rope_utils.fused_apply_rotary_pos_emb_thd

    def counted(*args, **kwargs):
        calls.append(args[1])
        return ours(*args, **kwargs)

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", counted)
    try:
        config.apply_rope_fusion = True
        fused = _stage_pass(stage, hidden, grad, psp)
        # q and k of every layer, with the host offsets thd_params puts in cu_seqlens_q_padded
        assert len(calls) == 2 * stage.layers_per_stage and all(c is host for c in calls)
        config.apply_rope_fusion = False
        unfused = _stage_pass(stage, hidden, grad, psp)
        assert len(calls) == 2 * stage.layers_per_stage
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda t, *a, **k: t)
        config.apply_rope_fusion = True
        unrotated = _stage_pass(stage, hidden, grad, psp)
    finally:
        config.apply_rope_fusion = True

    out, hidden_grad, grads = fused
    ref_out, ref_hidden_grad, ref_grads = unfused
    assert _rel(out, ref_out) < 1e-2 and _rel(hidden_grad, ref_hidden_grad) < 2e-2
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert _rel(grads[name], ref_grads[name]) < 3e-2, name
    # The q and k rows of the first layer's fused QKV weight ([groups, q heads per group + 2, head dim, h]):
    # the gradients RoPE acts on directly. Without any rotation they move far, so the comparison has teeth.
    qkv = next(name for name in grads if "linear_qkv.weight" in name)
    shape = stage.shape
    per_group = shape.num_attention_heads // shape.num_query_groups
    q_k_rows = lambda g: g.view(shape.num_query_groups, per_group + 2, shape.kv_channels, -1)[:, : per_group + 1]
    assert _rel(q_k_rows(grads[qkv]), q_k_rows(ref_grads[qkv])) < 3e-2
    assert _rel(q_k_rows(unrotated[2][qkv]), q_k_rows(ref_grads[qkv])) > 0.1, "q/k gradients barely depend on RoPE"


# ----------------------------------------------------------------------------- host syncs

def _q_k_step(tr, q, k, cu, freqs):
    out_q = tr.fused_apply_rotary_pos_emb_thd(q, cu, freqs)
    out_k = tr.fused_apply_rotary_pos_emb_thd(k, cu, freqs)
    torch.autograd.backward((out_q, out_k), (torch.ones_like(out_q), torch.ones_like(out_k)))


@pytest.mark.parametrize("offsets", ["host", "device"])
def test_thd_call_does_not_sync(offsets):
    _cuda()
    from megatron_sparsebalance.ops import triton_rope as tr

    lengths = [1000, 3000, 17]
    host, device = _offsets(lengths)
    cu = host if offsets == "host" else device
    freqs = _freqs(64, 1.0, max(lengths))
    q = torch.randn(sum(lengths), 14, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _q_k_step(tr, q, k, cu, freqs)  # warm-up: Triton compiles, the position cache fills
    run_without_sync(lambda: _q_k_step(tr, q, k, cu, freqs), warmup=False)
    if offsets == "host":  # the next micro-batch: a new offsets tensor rebuilds the cache, still without a sync
        fresh, _ = _offsets(lengths)
        run_without_sync(lambda: _q_k_step(tr, q, k, fresh, freqs), warmup=False)
