"""SparseCoreAttention in megatron-core: the core_attention contract, budgets, and a GPT that trains."""
import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from megatron_sparsebalance.attention import SparseAttentionConfig, SparseCoreAttention, budget_scope, get_gpt_layer_spec
from megatron_sparsebalance.data.synthetic import copy_task_batch
from megatron_sparsebalance.ops.dense import dense_causal_attention
from megatron_sparsebalance.training.model import MODEL_PRESETS, build_gpt_model, transformer_config


pytestmark = pytest.mark.usefixtures("gloo_world_of_one")


def core_attention(**sparse):
    cfg = transformer_config(MODEL_PRESETS["tiny"])  # 4 heads, 2 groups, head dim 32
    return SparseCoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                               sparse_config=SparseAttentionConfig(**{"sparse_attn_impl": "torch", **sparse}))


def test_spec_puts_our_attention_in_the_core_attention_slot():
    spec = get_gpt_layer_spec(SparseAttentionConfig(moba_topk=4))
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is SparseCoreAttention and core.params["sparse_config"].moba_topk == 4


def test_sbhd_equals_thd_and_returns_megatron_shapes():
    attn = core_attention(moba_block_size=64, moba_topk=2)
    s, b = 200, 2
    q, k, v = torch.randn(s, b, 4, 32), torch.randn(s, b, 2, 32), torch.randn(s, b, 2, 32)
    out = attn(q, k, v, None)
    assert out.shape == (s, b, 128)
    thd = lambda x: x.transpose(0, 1).reshape(b * s, x.shape[2], 32)  # noqa: E731
    cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
    out_thd = attn(thd(q), thd(k), thd(v), None, packed_seq_params=psp)
    assert out_thd.shape == (b * s, 128)
    assert torch.allclose(out_thd, out.transpose(0, 1).reshape(b * s, 128), atol=1e-6)


def test_dense_mode_is_sdpa():
    attn = core_attention(sparse_attention=False)
    q, k, v = torch.randn(300, 4, 32), torch.randn(300, 2, 32), torch.randn(300, 2, 32)
    cu = torch.tensor([0, 120, 300], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=180, max_seqlen_kv=180)
    out = attn(q, k, v, None, packed_seq_params=psp)
    assert torch.allclose(out, dense_causal_attention(q, k, v, cu, 32 ** -0.5).reshape(300, 128), atol=1e-6)


def test_budget_scope_overrides_and_reports():
    attn = core_attention(moba_block_size=64, moba_topk=6)
    q, k, v = torch.randn(64 * 10, 1, 4, 32), torch.randn(64 * 10, 1, 2, 32), torch.randn(64 * 10, 1, 2, 32)
    attn(q, k, v, None)
    assert attn.last_stats.k_used == 6  # no scope: --moba-topk
    with budget_scope(k=2) as report:
        attn(q, k, v, None)
    assert attn.last_stats.k_used == 2 and report.layers[0].stats.k_used == 2
    with budget_scope(k=2, k_base=6, p=0.0) as report:  # no coverage may be lost: stays at k_base
        attn(q, k, v, None)
    assert report.layers[0].stats.k_used == 6
    with budget_scope(k=2, k_base=6, p=1.0) as report:  # anything goes
        attn(q, k, v, None)
    st = report.layers[0].stats
    assert st.k_used == 2 and st.coverage_used <= st.coverage_base


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(moba_block_size=100), "--moba-block-size"), (dict(moba_topk=0), "--moba-topk"),
     (dict(sparse_attn_impl="fast"), "--sparse-attn-impl"),
     (dict(sparse_attn_ds_buffer_gib=-1.0), "--sparse-attn-ds-buffer-gib"),
     (dict(sparse_attn_ds_buffer_gib=float("nan")), "--sparse-attn-ds-buffer-gib"),
     (dict(sparse_attn_ds_buffer_gib=1.0), "--sparse-attn-ds-buffer-gib .* --sparse-attn-impl cuda or auto, got torch"),
     (dict(sparse_attn_ds_buffer_gib=1.0, sparse_attn_impl="auto", moba_block_size=64),
      "--sparse-attn-ds-buffer-gib needs --moba-block-size 128"),
     (dict(sparse_attn_ds_buffer_gib=1.0, sparse_attn_impl="auto"), "--sparse-attn-ds-buffer-gib needs head dim 128")],
)
def test_bad_config_names_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        core_attention(**kwargs)


def test_ds_buffer_where_auto_resolves_to_another_kernel_is_an_error_at_the_first_call():
    """On this CPU auto runs the torch implementation: the dS buffer could never be used, and the
    layer says so rather than ignoring the flag."""
    cfg = transformer_config(MODEL_PRESETS["tiny"])
    cfg.kv_channels = 128
    sparse = SparseAttentionConfig(sparse_attn_impl="auto", sparse_attn_ds_buffer_gib=1.0)
    attn = SparseCoreAttention(cfg, 1, AttnMaskType.causal, sparse_config=sparse)
    with pytest.raises(ValueError, match="--sparse-attn-ds-buffer-gib .* resolved to torch"):
        attn(torch.randn(256, 1, 4, 128), torch.randn(256, 1, 2, 128), torch.randn(256, 1, 2, 128), None)


def test_ds_buffer_reaches_only_the_cuda_backward():
    """--sparse-attn-ds-buffer-gib is the cuda kernels' budget for storing dS, in bytes; 0 leaves
    the function as it is."""
    from megatron_sparsebalance.ops import cuda_attention
    from megatron_sparsebalance.ops.implementations import attention_function

    fn = attention_function("cuda", 1.5)
    assert fn.func is cuda_attention.block_sparse_attention and fn.keywords == {"ds_buffer_bytes": 3 << 29}
    assert attention_function("cuda", 0.0) is cuda_attention.block_sparse_attention
    assert attention_function("torch", 1.5) is attention_function("torch")


def test_explicit_cuda_impl_on_cpu_is_an_error():
    attn = SparseCoreAttention(transformer_config(MODEL_PRESETS["tiny"]), 1, AttnMaskType.causal,
                               sparse_config=SparseAttentionConfig(sparse_attn_impl="cuda"))
    with pytest.raises(ValueError, match="--sparse-attn-impl=cuda is not available"):
        attn(torch.randn(128, 1, 4, 32), torch.randn(128, 1, 2, 32), torch.randn(128, 1, 2, 32), None)


@pytest.mark.parametrize("device,sm90a,capability,first", [
    ("cuda", True, (9, 0), "cuda"),    # Hopper with the wgmma kernels built
    ("cuda", False, (9, 0), "triton"),  # built without sm_90a: CUDA runs its mma.sync kernels
    ("cuda", True, (8, 0), "triton"),  # not Hopper
    ("cpu", True, (9, 0), "triton"),
])
def test_auto_order_puts_cuda_first_only_where_its_hopper_kernels_run(monkeypatch, device, sm90a, capability,
                                                                       first):
    from megatron_sparsebalance.ops import implementations, native

    monkeypatch.setattr(native, "HAVE_NATIVE_SM90A", sm90a)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    order = implementations.auto_order(torch.device(device))
    assert order[0] == first and sorted(order) == ["cuda", "torch", "triton"]


def test_cuda_without_machine_code_for_the_gpu_is_refused_with_the_build_flag(monkeypatch):
    """An extension built for other GPUs (MSB_CUDA_ARCH) must not be launched: the first kernel
    would fail deep in a layer. The reason names the flag; the router and index fall back."""
    import types

    from megatron_sparsebalance.ops import implementations, native

    monkeypatch.setattr(native, "HAVE_NATIVE", True)
    monkeypatch.setattr(native, "HAVE_NATIVE_CUDA", True)
    monkeypatch.setattr(native, "_native", types.SimpleNamespace(kernels_run_on=lambda index: index != 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    native.cuda_kernels_run_on.cache_clear()
    try:
        assert not native.cuda_kernels_run_on(torch.device("cuda", 0))
        assert native.cuda_kernels_run_on(torch.device("cuda", 1))
        reason = implementations.unavailable_reason("cuda", torch.device("cuda", 0))
        assert "no machine code for NVIDIA A100" in reason and "MSB_CUDA_ARCH" in reason
        assert implementations.unavailable_reason("cuda", torch.device("cuda", 1)) is None
    finally:
        native.cuda_kernels_run_on.cache_clear()


def test_auto_on_cpu_resolves_to_torch():
    from megatron_sparsebalance.ops.implementations import resolve_impl

    assert resolve_impl("auto", "cpu") == "torch"


def test_gpt_with_sparse_attention_trains_on_cpu():
    torch.manual_seed(0)
    shape = MODEL_PRESETS["tiny"]
    sparse = SparseAttentionConfig(moba_block_size=64, moba_topk=2, sparse_attn_impl="torch")
    model = build_gpt_model(shape, sparse, transformer_config(shape), max_sequence_length=512)
    batch = copy_task_batch([256, 192, 65], 32, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):  # a tiny repeated batch: the loss must fall
        with budget_scope() as report:
            per_token = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                              packed_seq_params=batch.packed_seq_params())
        loss = (per_token * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
        opt.step()
        losses.append(loss.item())
    assert len(report.layers) == shape.num_layers and report.mean_budget() == 2
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("granularity, method, layers, modules, attention_recomputed", [
    ("full", "uniform", 1, None, True),
    ("full", "block", 1, None, True),
    ("selective", None, None, ("core_attn",), True),
    ("selective", None, None, ("mlp",), False),
])
def test_recomputed_layers_route_as_their_forward_did(granularity, method, layers, modules, attention_recomputed):
    """Activation recomputation: gradients equal those without it when the backward runs in the
    micro-batch's budget scope (as the schedule runs it); where the attention itself is recomputed,
    they differ without that scope (so the first check can fail)."""
    from megatron_sparsebalance.training.model import RecomputeSettings
    from tests.checks import recompute_gradient_errors

    settings = RecomputeSettings(granularity, method, layers, modules)
    in_scope, outside = recompute_gradient_errors("cpu", "torch", recompute=settings)
    assert in_scope < 1e-5, in_scope
    if attention_recomputed:
        assert outside > 1e-2, outside
    else:
        assert outside < 1e-5, outside


def test_megatron_deterministic_mode_reaches_the_layer_and_refuses_fa4():
    """Megatron-LM's --deterministic-mode sets TransformerConfig.deterministic_mode: the layer then
    resolves auto among deterministic kernels only, and refuses fa4 (atomic dQ) when it is built."""
    import dataclasses

    cfg = dataclasses.replace(transformer_config(MODEL_PRESETS["tiny"]), deterministic_mode=True)
    with pytest.raises(ValueError, match="--deterministic-mode"):
        SparseCoreAttention(cfg, 1, AttnMaskType.causal, sparse_config=SparseAttentionConfig(sparse_attn_impl="fa4"))
    attn = SparseCoreAttention(cfg, 1, AttnMaskType.causal, sparse_config=SparseAttentionConfig(sparse_attn_impl="auto"))
    assert attn.deterministic
    assert not core_attention().deterministic
    assert core_attention(deterministic_mode=True).deterministic


@pytest.mark.parametrize("sparse", [dict(sparse_attention=False), dict(moba_block_size=64, moba_topk=8)])
def test_query_key_layer_scaling_leaves_the_attention_function_as_it_is(sparse):
    """--apply-query-key-layer-scaling: megatron scales QK^T down by the layer number and its fp32
    softmax scales it back, so deep layers still compute softmax(QK^T / sqrt(d)) V (here with every
    block selected, the naive dense reference)."""
    import dataclasses

    cfg = dataclasses.replace(transformer_config(MODEL_PRESETS["tiny"]), apply_query_key_layer_scaling=True)
    attn = SparseCoreAttention(cfg, layer_number=5, attn_mask_type=AttnMaskType.causal,
                               sparse_config=SparseAttentionConfig(sparse_attn_impl="torch", **sparse))
    q, k, v = torch.randn(300, 4, 32), torch.randn(300, 2, 32), torch.randn(300, 2, 32)
    cu = torch.tensor([0, 120, 300], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=180, max_seqlen_kv=180)
    out = attn(q, k, v, None, packed_seq_params=psp)
    assert torch.allclose(out, dense_causal_attention(q, k, v, cu, 32 ** -0.5).reshape(300, 128), atol=1e-5)


@pytest.mark.parametrize("change, layer, match", [
    (dict(window_size=(128, 0)), 1, r"--window-size \(128, 0\) \(layer 1\)"),
    (dict(window_size=(128, 0), window_attn_skip_freq=2), 3, "--window-size"),  # layers 1, 3 windowed
    (dict(window_size=(128, 0), window_attn_skip_freq=2), 2, None),  # every second layer is full attention
    (dict(softmax_type="off-by-one"), 1, "--softmax-type off-by-one"),
    (dict(softmax_type="learnable"), 1, "--softmax-type learnable"),
])
def test_core_attention_settings_it_does_not_compute_are_refused_by_flag(change, layer, match):
    import dataclasses

    cfg = dataclasses.replace(transformer_config(MODEL_PRESETS["tiny"]), **change)
    build = lambda: SparseCoreAttention(cfg, layer, AttnMaskType.causal,  # noqa: E731
                                        sparse_config=SparseAttentionConfig(sparse_attn_impl="torch"))
    if match is None:
        build()
    else:
        with pytest.raises(ValueError, match=match):
            build()


def test_max_logit_flags_are_refused_as_megatron_lm_arguments_name_them():
    """Megatron-LM's arguments carry the TransformerConfig's field names: the same check reads both."""
    from types import SimpleNamespace

    from megatron_sparsebalance.attention.core_attention import refuse_unbuilt_attention

    refuse_unbuilt_attention(SimpleNamespace(window_size=None, softmax_type="vanilla"), 1)
    for field, flag in (("qk_clip", "--qk-clip"), ("log_max_attention_logit", "--log-max-attention-logit")):
        with pytest.raises(ValueError, match=flag):
            refuse_unbuilt_attention(SimpleNamespace(**{field: True}), 1)


def test_local_spec_norms_take_sequence_parallel_and_refuse_what_torch_norms_drop():
    """The q/k norms of --qk-layernorm build under --sequence-parallel (megatron-core's
    WrappedTorchNorm asserts there) and are not marked sequence_parallel: they see whole sequences,
    and megatron-core sums their gradients over TP by name."""
    import dataclasses

    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_sparsebalance.attention.spec import HeadTorchNorm, SequenceParallelTorchNorm

    spec = get_gpt_layer_spec(SparseAttentionConfig(), qk_layernorm=True)
    attention = spec.submodules.self_attention.submodules
    assert attention.q_layernorm is HeadTorchNorm and attention.k_layernorm is HeadTorchNorm
    cfg = dataclasses.replace(transformer_config(MODEL_PRESETS["tiny"]), tensor_model_parallel_size=2,
                              sequence_parallel=True)
    with pytest.raises(AssertionError, match="sequence parallel"):
        build_module(WrappedTorchNorm, config=cfg, hidden_size=32, eps=1e-6)
    q_norm = build_module(attention.q_layernorm, config=cfg, hidden_size=32, eps=1e-6)
    input_norm = build_module(spec.submodules.input_layernorm, config=cfg, hidden_size=128, eps=1e-6)
    assert isinstance(q_norm, torch.nn.RMSNorm) and q_norm.weight.shape == (32,)
    assert not getattr(q_norm.weight, "sequence_parallel", False) and input_norm.weight.sequence_parallel
    l2 = get_gpt_layer_spec(SparseAttentionConfig(), qk_l2_norm=True).submodules.self_attention.submodules
    assert l2.q_layernorm.__name__ == "L2Norm" and l2.k_layernorm.__name__ == "L2Norm"  # --qk-l2-norm is built


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_apply_layernorm_1p_norms_hold_gamma_minus_one_and_compute_the_same_function(normalization):
    """--apply-layernorm-1p (megatron-core asserts against it in its torch norm): every norm the
    local spec builds starts with weights of zeros and scales by 1 + weight, so it computes, with
    the same gradients, what the plain norm computes with weight + 1."""
    import dataclasses

    from megatron.core.transformer.spec_utils import build_module

    from megatron_sparsebalance.attention.spec import HeadTorchNorm, SequenceParallelTorchNorm

    plain_cfg = dataclasses.replace(transformer_config(MODEL_PRESETS["tiny"]), normalization=normalization)
    one_p_cfg = dataclasses.replace(plain_cfg, layernorm_zero_centered_gamma=True)
    torch.manual_seed(0)
    x = torch.randn(6, 32)
    for norm in (SequenceParallelTorchNorm, HeadTorchNorm):
        one_p = build_module(norm, config=one_p_cfg, hidden_size=32, eps=1e-6)
        plain = build_module(norm, config=plain_cfg, hidden_size=32, eps=1e-6)
        assert torch.equal(one_p.weight, torch.zeros(32)) and torch.equal(plain.weight, torch.ones(32))
        with torch.no_grad():
            one_p.weight.normal_()
            plain.weight.copy_(one_p.weight + 1)
            for a, b in zip(one_p.parameters(), plain.parameters()):
                if a is not one_p.weight:
                    b.copy_(a.normal_())  # LayerNorm's bias
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = one_p(x1), plain(x2)
        torch.testing.assert_close(y1, y2, rtol=1e-6, atol=1e-6)
        g = torch.randn_like(y1)
        y1.backward(g)
        y2.backward(g)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)
        for a, b in zip(one_p.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)
    # The whole model: every norm of a 1p model (input, pre-MLP, final) starts at zeros.
    model = build_gpt_model(MODEL_PRESETS["tiny"], SparseAttentionConfig(), one_p_cfg, 256)
    norm_weights = [p for n, p in model.named_parameters() if "layernorm" in n and n.endswith(".weight")]
    assert len(norm_weights) == 2 * MODEL_PRESETS["tiny"].num_layers + 1
    assert all(torch.count_nonzero(w) == 0 for w in norm_weights)
