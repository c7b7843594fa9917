"""--cross-entropy-loss-fusion: megatron-core's fused cross entropy in our model, the same loss and
gradients as the unfused one, and the cheaper output layer the latency model and the split price."""
import dataclasses

import pytest
import torch

from megatron_sparsebalance.attention import SparseAttentionConfig
from megatron_sparsebalance.balance.latency import AnalyticLatencyModel, HARDWARE
from megatron_sparsebalance.balance.split import choose_split, stage_costs_from_model
from megatron_sparsebalance.config import MegatronLMFlags
from megatron_sparsebalance.data.synthetic import copy_task_batch
from megatron_sparsebalance.training.model import MODEL_PRESETS, build_gpt_model, transformer_config


def _loss_and_grads(fused: bool):
    shape = MODEL_PRESETS["tiny"]
    sparse = SparseAttentionConfig(moba_block_size=64, moba_topk=2, sparse_attn_impl="torch")
    torch.manual_seed(0)
    model = build_gpt_model(shape, sparse, transformer_config(shape, cross_entropy_loss_fusion=fused),
                            max_sequence_length=512)
    batch = copy_task_batch([256, 130], 32, torch.Generator().manual_seed(0))
    per_token = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                      packed_seq_params=batch.packed_seq_params())
    loss = (per_token * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    return per_token.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.usefixtures("gloo_world_of_one")
def test_the_fused_loss_equals_the_unfused_one_with_its_gradients():
    unfused, grads = _loss_and_grads(False)
    fused, fused_grads = _loss_and_grads(True)
    assert torch.allclose(fused, unfused, rtol=1e-5, atol=1e-5), (fused - unfused).abs().max()
    # The fused backward hands the logits' gradient on in bf16 (megatron-core casts it): within
    # bf16's rounding (2^-8 relative) of the fp32 path's, parameter by parameter.
    for name, g in grads.items():
        assert (fused_grads[name] - g).norm() <= 2 ** -8 * g.norm(), (name, ((fused_grads[name] - g).norm() / g.norm()).item())
    # Not the same path under another name: megatron-core's fused backward casts the logits'
    # gradient to bf16, so the (tied) output weights' gradient differs from the fp32 path's.
    name = "embedding.word_embeddings.weight"
    assert not torch.equal(fused_grads[name], grads[name])


def test_the_flag_reaches_megatron_core():
    config = transformer_config(MODEL_PRESETS["tiny"], cross_entropy_loss_fusion=True)
    assert config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == "native"
    assert not transformer_config(MODEL_PRESETS["tiny"]).cross_entropy_loss_fusion


def test_the_fused_output_layer_is_priced_by_its_bytes_per_logit():
    """38 bytes per logit fused against 58 unfused (balance/latency.py counts both pass by pass):
    only the output layer's memory term changes, by exactly 20 bytes x vocabulary per token."""
    shape = MODEL_PRESETS["qwen2.5-0.5b"]
    hw = HARDWARE["h200"]

    def stage(post, fused):
        return AnalyticLatencyModel(shape, 6, post_process=post, fused_cross_entropy=fused)

    tokens = [65536]
    saved = (stage(True, False).predict(tokens, 32) - stage(True, True).predict(tokens, 32)) / tokens[0]
    assert saved == pytest.approx(20 * shape.vocab_size / (hw.memory_gbps * 1e6), rel=1e-9)
    assert stage(False, True).predict(tokens, 32) == stage(False, False).predict(tokens, 32)
    # the flag survives the model's JSON (a saved analytic model keeps what it priced)
    model = stage(True, True)
    assert AnalyticLatencyModel.from_dict(model.to_dict()).predict(tokens, 32) == model.predict(tokens, 32)


def test_a_cheaper_output_layer_moves_the_split_toward_the_last_stage():
    """Qwen2.5-0.5B at PP=4 on 64K micro-batches: the unfused output layer alone outweighs a
    quarter of the model, so the automatic split leaves the last stage no layer; the fused one
    costs less, and the split's largest stage is shorter."""
    shape = MODEL_PRESETS["qwen2.5-0.5b"]
    mbs = [[65536], [32768, 32768], [8192] * 8]
    plain = stage_costs_from_model(shape, mbs, 32)
    fused = stage_costs_from_model(shape, mbs, 32, fused_cross_entropy=True)
    assert fused.layer_ms == plain.layer_ms and fused.embedding_ms == plain.embedding_ms
    assert fused.output_ms < 0.8 * plain.output_ms
    unfused_choice, fused_choice = choose_split(24, 4, plain), choose_split(24, 4, fused)
    assert max(fused_choice.stage_ms) < max(unfused_choice.stage_ms)
    assert fused_choice.split[-1] >= unfused_choice.split[-1]


@pytest.mark.parametrize("flags, message", [
    (dict(cross_entropy_fusion_impl="te"), "needs --cross-entropy-loss-fusion"),
    (dict(cross_entropy_fusion_impl="fast", cross_entropy_loss_fusion=True), "must be native or te"),
])
def test_refused_loss_fusion_flags_name_themselves(flags, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MegatronLMFlags(), **flags).validate()


def test_te_loss_fusion_needs_transformer_engine(monkeypatch):
    import megatron_sparsebalance.config as config

    monkeypatch.setattr(config, "HAVE_TE", False)
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        MegatronLMFlags(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te").validate()


def test_the_entry_prices_the_last_stage_with_the_flag():
    """pretrain's stage costs (DST's critical path, the simulated count) read the flag: the same
    run priced with the fused loss has a cheaper last stage and the same layers."""
    from megatron_sparsebalance.config import build_parser, config_from_args
    from megatron_sparsebalance.pretrain import build_latency_model, stage_costs_of

    def costs(*extra):
        cfg = config_from_args(build_parser().parse_args(
            ["--model", "qwen2.5-0.5b", "--pipeline-model-parallel-size", "4", "--seq-length", "65536",
             "--dst-growth", "critical-path", "--latency-hardware", "h200", *extra]))
        return stage_costs_of(cfg, cfg.model_shape(), build_latency_model(cfg, torch.device("cpu")))

    plain, fused = costs(), costs("--cross-entropy-loss-fusion")
    assert fused.layer_fractions == plain.layer_fractions
    assert 0.5 * plain.per_token_last < fused.per_token_last < 0.8 * plain.per_token_last


@pytest.mark.usefixtures("gloo_world_of_one")
def test_out_of_memory_advice_names_the_fused_loss_and_its_fp32_logits():
    """Out of memory on the last stage under the fused loss: the advice names the flag and the fp32
    logits of the largest micro-batch (tokens x vocabulary x 4 bytes); without it, no such line."""
    from megatron_sparsebalance.config import build_parser, config_from_args
    from megatron_sparsebalance.pretrain import out_of_memory_advice

    def advice(*extra):
        cfg = config_from_args(build_parser().parse_args(["--model", "qwen2.5-0.5b", "--seq-length", "65536", *extra]))
        return out_of_memory_advice(cfg, cfg.model_shape(), 4, [[[60000, 3906], [20000]]])

    fused = advice("--cross-entropy-loss-fusion")
    gib = 63906 * MODEL_PRESETS["qwen2.5-0.5b"].vocab_size * 4 / 2 ** 30
    assert "--cross-entropy-loss-fusion" in fused and f"fp32 ({gib:.1f} GiB)" in fused and "36.2 GiB" in fused
    assert "--cross-entropy-loss-fusion" not in advice() and "fp32 (" not in advice()
