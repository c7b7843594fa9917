"""Our fused RoPE (ops/triton_rope.py) against megatron-core's unfused RoPE, on the CPU.

The kernels run under Triton's interpreter (TRITON_INTERPRET=1) in a subprocess, since the
interpreter is chosen when the kernels are decorated, at import. Tiny shapes: THD packs with odd
and empty sequences, 3 and 1 heads, all or half of the 64 channels rotated, fp32 and fp16, every
way a pack's positions are found; sbhd and bshd; a strided key view as megatron passes it; the
call through megatron's own ``apply_rotary_pos_emb``. The reference is megatron's
``_apply_rotary_pos_emb_thd`` / ``_apply_rotary_pos_emb_bshd`` in fp32.
"""
from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from tests.checks import run_interpreted

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

SCRIPT = textwrap.dedent(
    """
    import types
    import torch
    from megatron.core.models.common.embeddings import rope_utils
    from megatron_sparsebalance.ops import triton_rope as tr

    CP_ONE = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    D = 64

    def freqs_table(rows, rot_dim, base=10000.0):
        # megatron's RotaryEmbedding.get_emb (non-interleaved), without its move to the GPU
        inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
        f = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq)
        return torch.cat((f, f), dim=-1)[:, None, None, :]

    def check(name, fn, reference, x, dtype):
        # fp32: as megatron to 1e-5. fp16: one rounding of the fp32 result (half an ulp, 2**-11).
        rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2 ** -10, 1e-4)
        x = x.to(dtype)
        xin = x.detach().clone().requires_grad_()
        xref = x.detach().float().requires_grad_()
        out = fn(xin)
        go = torch.randn(out.shape).to(dtype)
        grad, = torch.autograd.grad(out, xin, go)
        ref = reference(xref)
        rgrad, = torch.autograd.grad(ref, xref, go.float())
        for what, got, want in (("out", out, ref), ("grad", grad, rgrad)):
            assert got.dtype == dtype and got.shape == want.shape, (name, what, got.dtype, got.shape)
            assert torch.isfinite(got).all(), (name, what)
            err = (got.float() - want).abs().max().item()
            assert torch.allclose(got.float(), want, rtol=rtol, atol=atol), (name, what, dtype, err)
        assert out.shape != x.shape or not torch.equal(out.float(), x.float()), name  # something was rotated

    torch.manual_seed(0)
    packs = ([5, 13, 7], [3, 0, 1, 9, 4, 11, 2, 6, 5, 0])  # odd lengths; empty sequences, N not a power of 2
    for lens in packs:
        T = sum(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        for rot in (64, 32):
            freqs = freqs_table(max(lens) + 3, rot)
            exact = freqs_table(T, rot)  # a row per token of the pack: megatron reads it by pack index
            for heads in (3, 1):
                x = torch.randn(T, heads, D)
                for dtype in (torch.float32, torch.float16):
                    ref = lambda t: rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=CP_ONE)
                    check(f"search {lens} {rot} {heads}",
                          lambda t: tr.fused_apply_rotary_pos_emb_thd(t, cu, freqs), ref, x, dtype)
                    check(f"table {lens} {rot} {heads}",
                          lambda t: tr.rotary_thd(t, freqs, positions=tr.build_positions(cu, T, t.device)),
                          ref, x, dtype)
                    check(f"exact {lens} {rot} {heads}",
                          lambda t: tr.fused_apply_rotary_pos_emb_thd(t, cu, exact),
                          lambda t: rope_utils._apply_rotary_pos_emb_thd(t, cu, exact, cp_group=CP_ONE), x, dtype)

    # sbhd / bshd, with int64 offsets and a strided key view (megatron splits k out of mixed qkv)
    S, B, H = 11, 2, 3
    for rot in (64, 32):
        freqs = freqs_table(16, rot)
        x = torch.randn(S, B, H, D)
        for dtype in (torch.float32, torch.float16):
            check(f"sbhd {rot}", lambda t: tr.fused_apply_rotary_pos_emb(t, freqs),
                  lambda t: rope_utils._apply_rotary_pos_emb_bshd(t, freqs[:S]), x, dtype)
            check(f"bshd {rot}", lambda t: tr.rotary_sbhd(t, freqs, tensor_format="bshd"),
                  lambda t: rope_utils._apply_rotary_pos_emb_bshd(t.transpose(0, 1), freqs[:S]).transpose(0, 1),
                  x.transpose(0, 1).contiguous(), dtype)
    lens = [6, 9, 2]
    T, G, R = sum(lens), 2, 3
    cu64 = torch.tensor([0, 6, 15, 17], dtype=torch.int64)
    freqs = freqs_table(12, D)
    mixed = torch.randn(T, G, (R + 2) * D)
    key = lambda t: t[:, :, R * D:(R + 1) * D]
    assert not key(mixed).is_contiguous()
    check("strided key", lambda t: tr.fused_apply_rotary_pos_emb_thd(key(t), cu64, freqs),
          lambda t: rope_utils._apply_rotary_pos_emb_thd(key(t), cu64, freqs, cp_group=CP_ONE), mixed, torch.float32)

    # through megatron's router, as attention.py calls it
    rope_utils.fused_apply_rotary_pos_emb = tr.fused_apply_rotary_pos_emb
    rope_utils.fused_apply_rotary_pos_emb_thd = tr.fused_apply_rotary_pos_emb_thd
    fused = types.SimpleNamespace(apply_rope_fusion=True, mrope_section=None, rotary_interleaved=False,
                                  multi_latent_attention=False)
    unfused = types.SimpleNamespace(**{**vars(fused), "apply_rope_fusion": False})
    cu = torch.tensor([0, 6, 15, 17], dtype=torch.int32)
    for t, c in ((torch.randn(T, 3, D), cu), (torch.randn(S, B, H, D), None)):
        f = freqs if c is not None else freqs[:S]
        got = rope_utils.apply_rotary_pos_emb(t, f, fused, cu_seqlens=c, cp_group=CP_ONE)
        want = rope_utils.apply_rotary_pos_emb(t, f, unfused, cu_seqlens=c, cp_group=CP_ONE)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    print("OK")
    """
)


@needs_triton
def test_rope_kernels_match_megatron_under_interpreter():
    run_interpreted(SCRIPT)


@needs_triton
def test_position_cache_follows_the_offsets_tensor():
    from megatron_sparsebalance.ops.triton_rope import PositionCache

    cache, cpu = PositionCache(), torch.device("cpu")
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    first = cache.get(cu, 5, cpu)
    assert first.table.tolist() == [0, 1, 2, 0, 1] and first.table.dtype == torch.int32 and first.longest == 3
    assert cache.get(cu, 5, cpu) is first  # q, then k, then the next layer: built once
    cu[1] = 1  # an in-place edit is a new pack
    edited = cache.get(cu, 5, cpu)
    assert edited is not first and edited.table.tolist() == [0, 0, 1, 0, 1] and edited.longest == 2
    fresh = torch.tensor([0, 1, 3, 5], dtype=torch.int32)  # equal values, another tensor: rebuilt
    again = cache.get(fresh, 5, cpu)
    assert again is not edited and again.table.tolist() == [0, 0, 1, 0, 1]
    assert cache.get(fresh, 5, cpu) is again


@needs_triton
@pytest.mark.parametrize("cu,tokens", [([0, 3, 2], 2), ([1, 3], 3), ([0, 3], 4)])
def test_positions_refuse_bad_offsets(cu, tokens):
    from megatron_sparsebalance.ops.triton_rope import build_positions

    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
        build_positions(torch.tensor(cu), tokens, torch.device("cpu"))


@needs_triton
def test_hook_refuses_context_parallelism_and_interleaving():
    from megatron_sparsebalance.ops import triton_rope as tr

    t, freqs = torch.randn(8, 2, 64), torch.randn(8, 1, 1, 64)
    with pytest.raises(ValueError, match="context parallelism"):
        tr.fused_apply_rotary_pos_emb_thd(t, torch.tensor([0, 8], dtype=torch.int32), freqs, cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="non-interleaved"):
        tr.fused_apply_rotary_pos_emb(t[:, None], freqs, interleaved=True)


@needs_triton
def test_thd_refuses_freqs_shorter_than_a_sequence():
    from megatron_sparsebalance.ops import triton_rope as tr

    cu = torch.tensor([0, 9, 12], dtype=torch.int32)
    positions = tr.build_positions(cu, 12, torch.device("cpu"))
    with pytest.raises(ValueError, match="9 tokens"):
        tr.rotary_thd(torch.randn(12, 2, 64), torch.randn(8, 1, 1, 64), positions=positions)


def test_transformer_config_keeps_unfused_rope_on_cpu(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_sparsebalance.training.model import MODEL_PRESETS, transformer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = (rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd)
    assert transformer_config(MODEL_PRESETS["tiny"]).apply_rope_fusion is False
    assert (rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd) == before


@needs_triton
def test_install_is_idempotent_and_leaves_transformer_engine_alone(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_sparsebalance.ops import triton_rope as tr

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)  # restored after the test
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tr.install_fused_rope() and tr.install_fused_rope()
    assert rope_utils.fused_apply_rotary_pos_emb is tr.fused_apply_rotary_pos_emb
    assert rope_utils.fused_apply_rotary_pos_emb_thd is tr.fused_apply_rotary_pos_emb_thd

    def te_sbhd(t, freqs, interleaved=False):  # stand-ins for Transformer Engine's kernels
        return t

    def te_thd(t, cu_seqlens, freqs, cp_size=1, cp_rank=0):
        return t

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te_sbhd)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", te_thd)
    assert tr.install_fused_rope() is False
    assert rope_utils.fused_apply_rotary_pos_emb is te_sbhd and rope_utils.fused_apply_rotary_pos_emb_thd is te_thd
