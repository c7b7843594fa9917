"""HF <-> megatron-core conversion on small random Qwen2 (tied, untied) and Llama models.

hf -> mcore -> hf gives identical tensors; the megatron model (our attention at a budget
covering every block) reproduces the HF logits to fp32 tolerance at PP = 1 and at PP = 2 (two
gloo processes loading the converted checkpoint); the converter's errors name what is wrong.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from megatron_sparsebalance.convert import converter, mapping
from megatron_sparsebalance.convert.converter import (VerificationError, VerifySettings, checkpoint_common,
                                                      convert_hf_to_mcore, convert_mcore_to_hf, hf_logits,
                                                      verify_tokens)
from megatron_sparsebalance.convert.hf_config import hf_model_info
from megatron_sparsebalance.convert.hf_io import load_hf_config, load_hf_weights
from tests.convert_cases import FP32, pipelined_logits
from tests.distributed import run_workers
from tools.convert_checkpoint import main as cli

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6)
# vocab 300 is padded to 384 on the megatron side; the Llama case has head_dim 32 != hidden / heads.
CASES = {
    "qwen2_tied": ("Qwen2", dict(vocab_size=300, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2_untied": ("Qwen2", dict(vocab_size=256, tie_word_embeddings=False, rope_theta=1e6)),
    "llama": ("Llama", dict(vocab_size=300, tie_word_embeddings=False, rope_theta=5e5, head_dim=32)),
}
# Not a multiple of the 64-token block: the last block is partial.
VERIFY = VerifySettings(seq_length=160, batch_size=2, seed=7, tolerance=FP32)


def make_hf_model(family: str, overrides: dict, out_dir: str, seed: int = 0) -> str:
    """A randomly initialised HF model saved as safetensors. Every tensor is random (norm gains
    around 1, biases non-zero), so a mis-mapped tensor cannot hide behind HF's zero/one init."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**SMALL, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def converted(tmp_path_factory, megatron_world):
    """Each case: HF dir -> (CLI) mcore checkpoint with --verify -> (CLI) HF dir."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for name, (family, overrides) in CASES.items():
        hf_dir = make_hf_model(family, overrides, str(root / f"{name}_hf"))
        mc, back = str(root / f"{name}_mcore"), str(root / f"{name}_back")
        verify = ["--verify", "--verify-seq-length", str(VERIFY.seq_length), "--verify-batch-size", "2",
                  "--verify-seed", str(VERIFY.seed), "--verify-atol", "1e-4", "--verify-rtol", "1e-5",
                  "--verify-max-kl", "1e-8"]
        assert cli(["hf-to-mcore", "--hf-dir", hf_dir, "--save", mc, "--target-pipeline-model-parallel-size", "2",
                    *verify]) == 0
        assert cli(["mcore-to-hf", "--load", mc, "--save", back, *verify]) == 0
        out[name] = dict(hf=hf_dir, mcore=mc, back=back, ckpt=os.path.join(mc, "iter_0000000"))
    return out


def _file_tensors(model_dir):
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_mcore_to_hf_gives_identical_tensors(converted, case):
    src, _ = _file_tensors(converted[case]["hf"])
    back, meta = _file_tensors(converted[case]["back"])
    assert sorted(src) == sorted(back)
    for k in src:
        assert src[k].dtype == back[k].dtype and torch.equal(src[k], back[k]), k
    assert ("lm_head.weight" in back) == (not CASES[case][1]["tie_word_embeddings"])
    a = json.load(open(os.path.join(converted[case]["hf"], "config.json")))
    b = json.load(open(os.path.join(converted[case]["back"], "config.json")))
    for key in ("architectures", "vocab_size", "tie_word_embeddings", "rope_parameters", "rms_norm_eps",
                "num_key_value_heads", "hidden_size", "intermediate_size", "num_hidden_layers"):
        assert a.get(key) == b.get(key), key
    assert json.loads(meta["megatron_sparsebalance.converter"])["converter"]["command"] == "mcore-to-hf"


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_logits_match_hf_at_pp1(converted, case):
    """The checkpoint read back from disk, run by megatron at PP=1, against transformers."""
    report = json.load(open(os.path.join(converted[case]["ckpt"], converter.REPORT)))
    v = report["verify"]
    assert v["passed"] and v["tokens"] == VERIFY.batch_size * VERIFY.seq_length
    assert v["max_abs_logit_diff"] <= 1e-4 and v["kl_mean"] <= 1e-8
    assert v["max_abs_logit"] > 1.0  # logits that carry information, not a degenerate model
    back = json.load(open(os.path.join(converted[case]["back"], converter.REPORT)))["verify"]
    assert back["passed"] and back["max_abs_logit_diff"] <= 1e-4


def test_checkpoint_records_converter_args_versions_and_shape(converted):
    common = checkpoint_common(converted["llama"]["ckpt"])
    assert common["iteration"] == 0 and common["format"] == "megatron-sparsebalance/1"
    rec = common["converter"]
    assert rec["command"] == "hf-to-mcore" and rec["args"]["hf_dir"] == converted["llama"]["hf"]
    assert rec["args"]["verify"] is True and rec["versions"]["megatron-core"] and rec["versions"]["transformers"]
    shape = common["model_shape"]
    assert shape["vocab_size"] == 384 and common["hf_vocab_size"] == 300  # padded to a multiple of 128
    assert shape["kv_channels"] == 32 and not shape["add_qkv_bias"] and shape["rotary_base"] == 5e5
    assert shape["untie_embeddings_and_output_weights"]
    qwen = checkpoint_common(converted["qwen2_tied"]["ckpt"])["model_shape"]
    assert qwen["add_qkv_bias"] and not qwen["untie_embeddings_and_output_weights"]


def test_megatron_logits_match_hf_at_pp2(converted, tmp_path):
    """Two gloo processes load each converted checkpoint at PP=2 (2 layers per stage; tied
    embeddings: the last stage's output layer comes from the embedding) and match the HF logits."""
    cases = []
    for name, c in converted.items():
        tokens = verify_tokens(CASES[name][1]["vocab_size"], 96, 2, seed=11)
        torch.save(tokens, tmp_path / f"{name}_tokens.pt")
        torch.save(hf_logits(c["hf"], tokens), tmp_path / f"{name}_ref.pt")
        cases.append((c["mcore"], str(tmp_path / f"{name}_tokens.pt"), str(tmp_path / f"{name}_ref.pt")))
    run_workers(pipelined_logits, world=2, pp=2, args=(cases,), timeout_s=120)


def test_vocabulary_padded_for_a_target_tp_loads_at_tp2(converted, tmp_path):
    """--target-tensor-model-parallel-size 2 pads the vocabulary as Megatron-LM does at TP=2 (a
    multiple of --make-vocab-size-divisible-by x 2: 300 -> 512, where TP=1 gives 384); two gloo
    processes load the checkpoint at TP=2 and match the HF logits."""
    name = "qwen2_tied"
    mc = str(tmp_path / "tp2_mcore")
    assert cli(["hf-to-mcore", "--hf-dir", converted[name]["hf"], "--save", mc,
                "--target-tensor-model-parallel-size", "2"]) == 0
    common = checkpoint_common(os.path.join(mc, "iter_0000000"))
    assert common["model_shape"]["vocab_size"] == 512 and "--vocab-size 512" in common["megatron_flags"]
    assert common["target_tensor_model_parallel_size"] == 2
    tokens = verify_tokens(CASES[name][1]["vocab_size"], 96, 2, seed=11)
    torch.save(tokens, tmp_path / "tokens.pt")
    torch.save(hf_logits(converted[name]["hf"], tokens), tmp_path / "ref.pt")
    run_workers(pipelined_logits, world=2, tp=2, args=([(mc, str(tmp_path / "tokens.pt"), str(tmp_path / "ref.pt"))],),
                timeout_s=120)
    assert cli(["hf-to-mcore", "--hf-dir", converted[name]["hf"], "--save", str(tmp_path / "tp3"),
                "--target-tensor-model-parallel-size", "3"]) == 2  # 3 does not divide the 4 heads


def test_verify_catches_a_naive_qkv_concatenation(converted, tmp_path, monkeypatch):
    """[Q; K; V] instead of the per-group layout has the right shapes and runs: --verify must fail."""
    monkeypatch.setattr(mapping, "_group_qkv", lambda q, k, v, ng: torch.cat([q, k, v], 0))
    with pytest.raises(VerificationError, match="differ"):
        convert_hf_to_mcore(converted["qwen2_untied"]["hf"], str(tmp_path / "bad"), verify=VERIFY)


def test_a_trained_checkpoint_goes_back_with_the_original_config(converted, tmp_path):
    """A checkpoint written by training (no converter records, iteration > 0) converts back to HF
    given the original model's config, and the HF model reproduces the trained weights' logits."""
    from megatron_sparsebalance.training.checkpointing import save_checkpoint

    model, _ = converter.load_converted(converted["qwen2_tied"]["mcore"])
    with torch.no_grad():  # stands in for training: every weight moves
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_checkpoint(str(tmp_path / "run"), 5, model, None, common={"run": "pretrain"})
    with pytest.raises(ValueError, match="already holds a run"):  # would point 'latest' back at iteration 0
        convert_hf_to_mcore(converted["qwen2_tied"]["hf"], str(tmp_path / "run"))
    with pytest.raises(ValueError, match="pass --hf-config"):
        convert_mcore_to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    report = convert_mcore_to_hf(str(tmp_path / "run"), str(tmp_path / "hf"), hf_config=converted["qwen2_tied"]["hf"],
                                 verify=VERIFY)
    assert report["source_iteration"] == 5 and report["verify"]["passed"]
    trained = {k: v.detach() for k, v in model.named_parameters()}
    info = hf_model_info(load_hf_config(str(tmp_path / "hf")))
    expected = mapping.mcore_to_hf(trained, info)
    written, _ = _file_tensors(str(tmp_path / "hf"))
    assert sorted(written) == sorted(expected) and all(torch.equal(written[k], expected[k]) for k in expected)
    assert "generation_config.json" in report["copied"]  # side files come from --hf-config's directory


def test_vocab_padding_rows_are_zero_and_dropped_on_the_way_back():
    from megatron_sparsebalance.convert.hf_config import HFModelInfo
    from megatron_sparsebalance.training.model import ModelShape

    shape = ModelShape(1, 8, 16, 2, 1, 4, 128, add_qkv_bias=False, untie_embeddings_and_output_weights=True)
    info = HFModelInfo("LlamaForCausalLM", 100, False, shape, 128)
    hf = {k: torch.randn(s) for k, s in mapping.expected_hf_shapes(info).items()}
    mc = mapping.hf_to_mcore(hf, info)
    assert mc["embedding.word_embeddings.weight"].shape == (128, 8)
    assert not mc["output_layer.weight"][100:].any() and not mc["embedding.word_embeddings.weight"][100:].any()
    back = mapping.mcore_to_hf(mc, info)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


# ----------------------------------------------------------------------------- errors

def _edited_copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    config = json.load(open(path))
    config.update(config_changes)
    json.dump(config, open(path, "w"))
    return str(dst)


def test_unsupported_architecture_names_the_supported_ones(converted, tmp_path):
    bad = _edited_copy(converted["llama"]["hf"], tmp_path / "m", architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match=r"unsupported architecture \['MistralForCausalLM'\].*Qwen2ForCausalLM.*LlamaForCausalLM"):
        convert_hf_to_mcore(bad, str(tmp_path / "out"))
    assert cli(["hf-to-mcore", "--hf-dir", bad, "--save", str(tmp_path / "out")]) == 2


def test_scaled_rope_and_sliding_window_are_refused(converted, tmp_path):
    scaled = _edited_copy(converted["llama"]["hf"], tmp_path / "a", rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})
    with pytest.raises(ValueError, match="RoPE scaling 'llama3'"):
        convert_hf_to_mcore(scaled, str(tmp_path / "out"))
    sliding = _edited_copy(converted["qwen2_tied"]["hf"], tmp_path / "b", use_sliding_window=True, sliding_window=64)
    with pytest.raises(ValueError, match="sliding-window"):
        convert_hf_to_mcore(sliding, str(tmp_path / "out"))


def test_config_weights_mismatch_names_the_tensor_and_shapes(converted, tmp_path):
    wider = _edited_copy(converted["qwen2_tied"]["hf"], tmp_path / "a", intermediate_size=128)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \(96, 64\) "
                                         r"in the weights but the config .*intermediate_size 128.* implies \(128, 64\)"):
        convert_hf_to_mcore(wider, str(tmp_path / "out"))
    deeper = _edited_copy(converted["llama"]["hf"], tmp_path / "b", num_hidden_layers=6)
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.4\."):
        convert_hf_to_mcore(deeper, str(tmp_path / "out"))
    shallower = _edited_copy(converted["llama"]["hf"], tmp_path / "d", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.2\."):
        convert_hf_to_mcore(shallower, str(tmp_path / "out"))
    # transformers' own validation of config.json (layer_types has 4 entries) surfaces as a ValueError
    inconsistent = _edited_copy(converted["qwen2_tied"]["hf"], tmp_path / "e", num_hidden_layers=6)
    with pytest.raises(ValueError, match="cannot read the config"):
        convert_hf_to_mcore(inconsistent, str(tmp_path / "out"))
    untied = _edited_copy(converted["qwen2_untied"]["hf"], tmp_path / "c", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        convert_hf_to_mcore(untied, str(tmp_path / "out"))
    # Back to HF with the config of another model: the checkpoint's recorded shape disagrees.
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        convert_mcore_to_hf(converted["qwen2_tied"]["mcore"], str(tmp_path / "hf"), hf_config=wider)
    assert load_hf_weights(converted["qwen2_tied"]["hf"])  # the source itself is intact


def test_target_layout_that_does_not_divide_the_layers(converted, tmp_path):
    with pytest.raises(ValueError, match=r"--target-pipeline-model-parallel-size 3 does not divide the 4 layers.*\[1, 2, 4\]"):
        convert_hf_to_mcore(converted["llama"]["hf"], str(tmp_path / "out"), target_pipeline_parallel_size=3)
    assert not os.path.exists(tmp_path / "out")  # refused before anything is written


def test_pretrain_starts_from_a_converted_llama(converted):
    """`pretrain --pretrained-checkpoint ... --use-checkpoint-args` trains a converted model whose
    shape the preset flags cannot express (no QKV bias, head dim != hidden / heads)."""
    from tests.pretrain_cases import run_pretrain

    rc, err = run_pretrain(["--pretrained-checkpoint", converted["llama"]["mcore"], "--use-checkpoint-args",
                            "--mock-data", "--mock-length-distribution", "uniform", "--seq-length", "256",
                            "--mock-samples", "64", "--mock-vocab-size", "256", "--global-batch-size", "2",
                            "--moba-block-size", "64", "--moba-topk", "2", "--sparse-attn-impl", "torch",
                            "--train-iters", "2", "--lr", "1e-4", "--min-lr", "1e-5"])
    assert rc == 0, err
    rc, err = run_pretrain(["--use-checkpoint-args", "--mock-data", "--train-iters", "1"])
    assert rc == 2 and "--use-checkpoint-args needs --load or --pretrained-checkpoint" in err, err
