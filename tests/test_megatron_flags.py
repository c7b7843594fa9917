"""A Megatron-LM launch script's flags through ``python -m megatron_sparsebalance.pretrain``:
each accepted with Megatron-LM's meaning, or refused by name with the reason
(docs/MEGATRON_LM_FLAGS.md has the table)."""
import dataclasses
import json
import math
import os
import random
import re

import numpy as np
import pytest
import torch

from megatron_sparsebalance.config import build_parser, parse_config
from megatron_sparsebalance.training.model import MODEL_PRESETS, ModelShape
from tests import megatron_flags_cases as cases
from tests import pretrain_cases
from tests.distributed import run_workers
from tests.test_data import tokenizer_dir  # noqa: F401  (a fixture: a tiny local Hugging Face tokenizer)

# What Megatron-LM builds for the flags a script leaves out (megatron/training/arguments.py and
# TransformerConfig of megatron-core 0.19).
MEGATRON_LM_DEFAULTS = dict(normalization="LayerNorm", swiglu=False, add_bias_linear=True, add_qkv_bias=True,
                            position_embedding_type="learned_absolute", rotary_base=10000.0, rotary_percent=1.0,
                            hidden_dropout=0.1, norm_epsilon=1e-5, init_method_std=0.02,
                            untie_embeddings_and_output_weights=False)
REQUIRED = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "256"]


def test_flag_list_trains_three_iterations_at_pp2(tmp_path, capfd):
    prefix, save, tb = str(tmp_path / "docs"), str(tmp_path / "ckpt"), str(tmp_path / "tb")
    cases.write_documents(prefix)
    os.makedirs(save)  # --load of a directory without a checkpoint yet: warned, trains from iteration 1
    argv = cases.flag_list(prefix, save, tb)
    cfg = parse_config(argv).validate(2)
    assert any("Disabling sequence parallelism" in w for w in cfg.warnings())
    out = str(tmp_path / "out.json")
    run_workers(cases.run_flag_list, world=2, pp=2, args=(argv, out))
    result = json.load(open(out))
    err = capfd.readouterr().err  # the spawned ranks write to this process's stderr
    assert "WARNING: could not find the metadata file" in err and "WARNING: Disabling sequence parallelism" in err
    rows = result["rows"]
    assert [r["iteration"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["imbalance"] >= 1.0 and r["mean_budget"] > 0 for r in rows)
    # --seed seeds Python and NumPy too, the last stage (pipeline rank 1) at seed + 100 as Megatron-LM
    assert result["seeded"][0][0] == 1234
    assert result["seeded"][0][1:] == [random.Random(1334).random(), float(np.random.RandomState(1334).random_sample())]
    # checkpoints of --save-interval 2 and the end; the config records the resolved defaults
    assert sorted(d for d in os.listdir(save) if d.startswith("iter_")) == ["iter_0000002", "iter_0000003"]
    config = json.load(open(os.path.join(save, "config.json")))
    assert config["optim"]["lr_decay_iters"] == 3 and config["data"]["split"] == "90,9,1"
    # the architecture the flags describe is the one that was built and saved
    from megatron.core import dist_checkpointing

    from megatron_sparsebalance.training.checkpointing import iteration_dir

    path = iteration_dir(save, 3)
    shape = ModelShape(**dist_checkpointing.load_common_state_dict(path)["common"]["model_shape"])
    assert shape == ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                               num_query_groups=2, kv_channels=16, vocab_size=256, rotary_base=10000.0,
                               norm_epsilon=1e-6, add_qkv_bias=True, untie_embeddings_and_output_weights=True,
                               normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                               position_embedding_type="rope", max_position_embeddings=1024, hidden_dropout=0.1)
    keys = set(dist_checkpointing.load_tensors_metadata(path))
    layer = "decoder.layers.self_attention.linear_qkv"
    assert any(k.startswith(layer + ".bias") for k in keys), sorted(keys)[:20]
    assert not any("linear_proj.bias" in k or "linear_fc1.bias" in k for k in keys)
    assert "output_layer.weight" in keys and not any("position_embeddings" in k for k in keys)


    # --overlap-grad-reduce at DP=2 (the same two processes, regrouped): it runs on the CPU and
    # changes nothing
    plain, overlapped = result["overlap"]
    assert plain[1] != plain[0]  # the second step saw the first's reduced update
    assert sum(overlapped, []) == pytest.approx(sum(plain, []), rel=1e-6)


# ---- refused by name, with the reason, before any process group --------------------------------

REFUSED = [
    (["--bf16"], r"--bf16 needs a GPU: megatron-core's mixed-precision optimizer accepts only CUDA parameters"),
    (["--use-distributed-optimizer"], r"--use-distributed-optimizer needs a GPU: megatron-core's distributed optimizer"),
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     r"--num-layers-per-virtual-pipeline-stage is not supported: Megatron-LM's interleaved .* schedule is not built"),
    (["--attention-dropout", "0.1"], r"--attention-dropout must be 0, got 0.1: .* no attention dropout"),
    (["--position-embedding-type", "relative"], r"--position-embedding-type relative is not supported: .*allowed: rope"),
    (["--position-embedding-type", "yarn"], r"--position-embedding-type yarn is not supported"),
    (["--attention-backend", "flash"], r"--attention-backend flash selects .* use auto or local"),
    (["--attention-backend", "fused"], r"--attention-backend fused selects"),
    (["--transformer-impl", "transformer_engine"], r"--transformer-impl transformer_engine needs Transformer Engine"),
    (["--ckpt-format", "torch"], r"--ckpt-format torch is not supported: .*torch_dist"),
    (["--tokenizer-type", "GPT2BPETokenizer"], r"--tokenizer-type GPT2BPETokenizer is not built here: use HuggingFaceTokenizer"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], r"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
    (["--num-query-groups", "2"], r"--num-query-groups 2 needs --group-query-attention"),
    (["--tensor-model-parallel-size", "2"], r"--tensor-model-parallel-size"),
    (["--context-parallel-size", "2"], r"--context-parallel-size must be 1 \(sparse attention has no context-parallel"),
    (["--normalization", "BatchNorm"], r"--normalization must be RMSNorm or LayerNorm"),
    (["--rotary-percent", "0"], r"--rotary-percent must be in \(0, 1\]"),
    (["--max-position-embeddings", "512"], r"--max-position-embeddings \(512\) must be >= --seq-length \(1024\)"),
    (["--split", "a,b"], r"--split must be up to three non-negative weights"),
    (["--mock-vocab-size", "100000"], r"--mock-vocab-size \(100000\) must be <= the model's vocabulary"),
    (["--data-path", "0.3", "a", "0.7", "b"], r"--data-path takes one path here .*weighted blend of several"),
    (["--account-for-embedding-in-pipeline-split", "--decoder-first-pipeline-num-layers", "1"],
     r"--account-for-embedding/loss-in-pipeline-split and --decoder-first/last-pipeline-num-layers"),
]


@pytest.mark.parametrize("extra, match", REFUSED, ids=[r[0][0] for r in REFUSED])
def test_refused_flags_name_the_flag_and_why(extra, match, capsys, monkeypatch):
    if extra[0] in ("--bf16", "--use-distributed-optimizer") and torch.cuda.is_available():
        pytest.skip("runs on a GPU")
    rc, err = pretrain_cases.refused_in_process(pretrain_cases.TINY + ["--train-iters", "1"] + extra, capsys, monkeypatch)
    assert rc == 2 and re.search(match, err), err


def test_a_flag_this_entry_lacks_points_to_the_megatron_lm_entry(capsys, monkeypatch):
    rc, err = pretrain_cases.refused_in_process(pretrain_cases.TINY + ["--fp16", "--rampup-batch-size", "4", "4", "8"],
                                                capsys, monkeypatch)
    assert rc == 2 and "unrecognized arguments: --fp16 --rampup-batch-size 4 4 8" in err, err
    assert "python -m megatron_sparsebalance.megatron_lm with the same flags" in err, err


def test_megatron_lm_command_line_needs_its_required_flags(capsys, monkeypatch):
    rc, err = pretrain_cases.refused_in_process(["--mock-data", "--hidden-size", "64", "--attention-dropout", "0"],
                                                capsys, monkeypatch)
    assert rc == 2 and "without --model, Megatron-LM's required flags must be given: --num-layers, " \
                       "--num-attention-heads, --vocab-size" in err, err


# ---- Megatron-LM's meaning ---------------------------------------------------------------------

def test_without_model_megatron_lm_defaults_apply():
    cfg = parse_config(REQUIRED + ["--mock-data", "--attention-dropout", "0"])
    shape = cfg.validate(1).model_shape()
    for name, value in MEGATRON_LM_DEFAULTS.items():
        assert getattr(shape, name) == value, name
    # one KV head per head without --group-query-attention; ffn 4h; head dim h / heads
    assert (shape.num_query_groups, shape.ffn_hidden_size, shape.kv_channels) == (4, 256, 16)
    swiglu = parse_config(REQUIRED + ["--swiglu", "--group-query-attention", "--attention-dropout", "0"]).model_shape()
    assert swiglu.swiglu and swiglu.ffn_hidden_size == 128 and swiglu.num_query_groups == 4  # int(8/3 * 64 / 64) * 64
    # Megatron-LM: --disable-bias-linear drops the QKV bias too unless --add-qkv-bias
    assert not parse_config(REQUIRED + ["--disable-bias-linear"]).model_shape().add_qkv_bias
    assert parse_config(REQUIRED + ["--disable-bias-linear", "--add-qkv-bias"]).model_shape().add_qkv_bias


def test_the_default_attention_dropout_of_megatron_lm_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Megatron-LM's default is 0.1: pass --attention-dropout 0"):
        parse_config(REQUIRED + ["--mock-data"]).validate(1)
    with pytest.raises(ValueError, match=r"--hidden-size \(64\) must be a multiple of --num-attention-heads \(3\)"):
        parse_config(REQUIRED + ["--mock-data", "--attention-dropout", "0", "--num-attention-heads", "3"]).validate(1)


def test_architecture_flags_override_a_preset():
    shape = parse_config(["--model", "qwen2.5-0.5b", "--no-add-qkv-bias", "--norm-epsilon", "1e-5", "--hidden-dropout",
                          "0.05", "--init-method-std", "0.01", "--rotary-percent", "0.5", "--normalization", "LayerNorm",
                          "--no-swiglu", "--position-embedding-type", "learned_absolute"]).model_shape()
    assert shape == dataclasses.replace(MODEL_PRESETS["qwen2.5-0.5b"], add_qkv_bias=False, norm_epsilon=1e-5,
                                        hidden_dropout=0.05, init_method_std=0.01, rotary_percent=0.5,
                                        normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute")
    assert parse_config(["--model", "qwen2.5-0.5b"]).model_shape() == MODEL_PRESETS["qwen2.5-0.5b"]
    assert parse_config([]).model_shape() == MODEL_PRESETS["tiny"]  # no architecture flag at all: the tiny preset


def test_the_built_model_follows_the_architecture_flags():
    from megatron_sparsebalance.training.model import transformer_config

    megatron = parse_config(REQUIRED + ["--attention-dropout", "0", "--norm-epsilon", "1e-4", "--init-method-std",
                                        "0.01", "--hidden-dropout", "0.2"]).model_shape()
    tc = transformer_config(megatron)
    assert (tc.normalization, tc.gated_linear_unit, tc.activation_func, tc.add_bias_linear, tc.add_qkv_bias) == \
        ("LayerNorm", False, torch.nn.functional.gelu, True, True)
    assert (tc.layernorm_epsilon, tc.init_method_std, tc.hidden_dropout, tc.attention_dropout) == (1e-4, 0.01, 0.2, 0.0)
    qwen = transformer_config(dataclasses.replace(MODEL_PRESETS["tiny"], add_qkv_bias=False))
    assert (qwen.normalization, qwen.gated_linear_unit, qwen.add_bias_linear, qwen.add_qkv_bias) == \
        ("RMSNorm", True, False, False)
    assert transformer_config(megatron, calculate_per_token_loss=True).calculate_per_token_loss


def test_lr_decay_iters_defaults_to_train_iters():
    assert parse_config(["--mock-data", "--train-iters", "77"]).validate(1).optim.lr_decay_iters == 77
    assert parse_config(["--mock-data", "--train-iters", "77", "--lr-decay-iters", "50"]).validate(1).optim.lr_decay_iters == 50


def test_save_interval_without_save_is_allowed_with_a_warning():
    cfg = parse_config(["--mock-data", "--save-interval", "5"]).validate(1)
    assert any("--save-interval 5 without --save: no checkpoint will be saved" in w for w in cfg.warnings())


def test_mock_ids_stay_below_the_vocabulary():
    from megatron_sparsebalance.data.datasets import build_dataset

    cfg = parse_config(["--mock-data", "--vocab-size", "1024", "--mock-samples", "32"]).validate(1)
    assert cfg.data.mock_vocab_size == 1024
    dataset = build_dataset(cfg.data)
    assert max(int(dataset[i].tokens.max()) for i in range(len(dataset))) < 1024
    assert parse_config(["--mock-data", "--model", "qwen2.5-0.5b"]).validate(1).data.mock_vocab_size == 32000


def test_split_and_eod_mask_loss(tmp_path):
    from megatron_sparsebalance.data.datasets import build_dataset, build_validation_dataset, pack_micro_batch, split_ranges

    assert split_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, "99,1") == [(0, 10), (10, 10), (10, 10)]
    prefix = str(tmp_path / "docs")
    cases.write_documents(prefix, count=20)
    cfg = parse_config(cases.ARCHITECTURE + ["--data-path", prefix, "--split", "80,20,0", "--tokenizer-type",
                                             "NullTokenizer", "--eod-mask-loss", "--moba-topk", "4"]).validate(1)
    train, valid = build_dataset(cfg.data, cases.VOCAB), build_validation_dataset(cfg.data, 4, cases.VOCAB)
    assert (len(train), len(valid)) == (16, 4) and torch.equal(valid[0].tokens, train.base[16].tokens)
    batch = pack_micro_batch(train, [0])  # document 0 has an EOD in its middle and at its end
    tokens, mask = batch.tokens[0], batch.loss_mask[0]
    at_eod = tokens == cases.VOCAB - 1
    assert at_eod.sum() == 2 and (mask[at_eod] == 0).all() and mask[~at_eod][:-1].all()
    cfg.data.eod_mask_loss = False
    unmasked = pack_micro_batch(build_dataset(cfg.data, cases.VOCAB), [0]).loss_mask[0]
    assert unmasked[at_eod].sum() == 1  # the mid-document EOD predicts its successor without the flag


def test_seed_seeds_python_and_numpy(monkeypatch):
    from megatron.core import parallel_state

    from megatron_sparsebalance.training.dist import seed_everything

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    seed_everything(7)
    drawn = (random.random(), float(np.random.random()), float(torch.rand(1)))
    seed_everything(7)
    assert drawn == (random.random(), float(np.random.random()), float(torch.rand(1)))
    assert drawn[:2] == (random.Random(107).random(), float(np.random.RandomState(107).random_sample()))


def test_log_throughput_prints_the_throughput_field():
    from megatron_sparsebalance.pretrain import Metrics

    row = dict(iteration=1, consumed_samples=4, elapsed_ms=10.0, tflops_per_gpu=1.5, lr=1e-3, loss=2.0, grad_norm=1.0,
               skipped=0, nan=0, imbalance=1.0, bubble=0.1, predicted_ms=1.0, measured_ms=1.0, mean_budget=4.0,
               mean_coverage=1.0, sab_ms=0.0, dst_ms=0.0)
    quiet = Metrics(parse_config(["--train-iters", "3"]), 0, is_logger=False).line(row, 1.0)
    loud = Metrics(parse_config(["--train-iters", "3", "--log-throughput"]), 0, is_logger=False).line(row, 1.0)
    assert "throughput per GPU (TFLOP/s/GPU): 1.5 |" in loud and "throughput" not in quiet


def test_account_for_embedding_and_loss_in_pipeline_split():
    from megatron_sparsebalance.training.step import pipeline_layer_split

    assert pipeline_layer_split(6, 2, account_for_embedding=True, account_for_loss=True) == [3, 3]
    assert pipeline_layer_split(5, 2, account_for_embedding=True) == [2, 3]
    assert pipeline_layer_split(5, 2, account_for_loss=True) == [3, 2]
    assert pipeline_layer_split(10, 4, account_for_embedding=True, account_for_loss=True) == [2, 3, 3, 2]
    with pytest.raises(ValueError, match="not divisible by --pipeline-model-parallel-size 2"):
        pipeline_layer_split(4, 2, account_for_embedding=True)
    cfg = parse_config(["--mock-data", "--num-layers", "5", "--model", "tiny", "--pipeline-model-parallel-size", "2",
                        "--account-for-loss-in-pipeline-split"])
    assert cfg.end_stage_layers() == (3, 2)


def test_no_flags_help_says_what_the_negation_does():
    helps = {o: a.help for a in build_parser()._actions for o in a.option_strings}
    assert "do not restore the optimizer state" in helps["--no-load-optim"]
    assert helps["--no-track-coverage"].startswith("Do not compute the coverage")
    for flag, text in helps.items():
        # a generated --no-X flag's help must not describe X being on (the dataclass field's docstring)
        if flag.startswith("--no-") and "--" + flag[5:] not in helps:
            assert re.match(r"(With .*, )?[Dd]o not|Accepted for Megatron-LM", text), (flag, text)


# ---- checkpoints -------------------------------------------------------------------------------

def _fake_checkpoint(root, iteration, complete=True):
    from megatron_sparsebalance.training.checkpointing import COMPLETE, iteration_dir

    os.makedirs(iteration_dir(root, iteration))
    if complete:
        open(os.path.join(iteration_dir(root, iteration), COMPLETE), "w").close()


def test_load_without_tracker_warns_and_a_deleted_iteration_names_the_newest(tmp_path):
    from megatron_sparsebalance.training.checkpointing import LATEST, latest_checkpoint, missing_tracker_warning

    root = str(tmp_path)
    assert "could not find the metadata file" in missing_tracker_warning(root)
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4)
    _fake_checkpoint(root, 6, complete=False)
    assert latest_checkpoint(root) is None and "pass --load" in missing_tracker_warning(root)
    with open(os.path.join(root, LATEST), "w") as f:
        f.write("8\n")  # a deleted iteration
    with pytest.raises(ValueError, match=r"names .*iter_0000008, which is not a complete checkpoint .*newest complete "
                                         r"checkpoint there is .*iter_0000004"):
        latest_checkpoint(root)
    assert missing_tracker_warning(root) is None


# ---- the converter's printed flags -------------------------------------------------------------

@pytest.mark.parametrize("shape", [
    MODEL_PRESETS["qwen2.5-0.5b"], MODEL_PRESETS["qwen2.5-3b"],
    ModelShape(2, 64, 176, 4, 2, 16, 512, rotary_base=500000.0, norm_epsilon=1e-5, add_qkv_bias=False,
               untie_embeddings_and_output_weights=True),  # Llama-style
], ids=["qwen2.5-0.5b", "qwen2.5-3b", "llama"])
def test_converter_flags_round_trip_into_pretrain(shape):
    from megatron_sparsebalance.convert.hf_config import megatron_flags

    flags = megatron_flags(shape).split()
    cfg = parse_config(flags + ["--mock-data"])
    assert cfg.validate(1).model_shape() == shape


def test_latency_tables_profiled_before_the_later_shape_fields_still_match():
    from megatron_sparsebalance.pretrain import _shape_as_the_table_records_it

    table = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "e2e", "latency_table_h200_3b.json")
    recorded = json.load(open(table))["metadata"]["model_shape"]
    assert "swiglu" not in recorded  # written before ModelShape had its later fields
    assert _shape_as_the_table_records_it(MODEL_PRESETS["qwen2.5-3b"], table) == recorded
    gelu = dataclasses.replace(MODEL_PRESETS["qwen2.5-3b"], swiglu=False)
    assert _shape_as_the_table_records_it(gelu, table) != recorded  # another MLP is another table


def test_hugging_face_tokenizer_gives_the_vocabulary_and_the_eod(tokenizer_dir, tmp_path):  # noqa: F811
    from megatron_sparsebalance.data.datasets import eod_id

    path, vocab = tokenizer_dir
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--attention-dropout", "0",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", path, "--data-path", str(data),
            "--seq-length", "1024", "--moba-topk", "4", "--moba-block-size", "64"]
    cfg = parse_config(argv).validate(1)
    assert cfg.model_shape().vocab_size == 128 >= len(vocab)  # Megatron-LM pads the tokenizer's size to 128
    # ... to a multiple of --make-vocab-size-divisible-by x TP, as Megatron-LM's tokenizer set-up
    tp2 = parse_config(argv + ["--tensor-model-parallel-size", "2"]).validate(2)
    assert tp2.model_shape().vocab_size == 256
    assert parse_config(argv + ["--make-vocab-size-divisible-by", "48"]).validate(1).model_shape().vocab_size == 48 * (
        -(-len(vocab) // 48))
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by must be >= 1"):
        parse_config(argv + ["--make-vocab-size-divisible-by", "0"]).validate(1)
    assert eod_id(cfg.data) == vocab["</s>"]
    with pytest.raises(ValueError, match="NullTokenizer reads no --tokenizer-model"):
        parse_config([a if a != "HuggingFaceTokenizer" else "NullTokenizer" for a in argv]).validate(1)


def test_distributed_timeout_minutes_reaches_init_process_group(monkeypatch):
    import datetime

    import torch.distributed as dist

    from megatron_sparsebalance.training import dist as msb_dist

    seen = {}

    class Stop(Exception):
        pass

    def init_process_group(backend, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.setenv(var, "")  # recorded, so what init_distributed sets is undone afterwards
        monkeypatch.delenv(var)
    with pytest.raises(Stop):
        msb_dist.init_distributed(backend="gloo", timeout_minutes=parse_config(
            ["--distributed-timeout-minutes", "7"]).parallel.distributed_timeout_minutes)
    assert seen["timeout"] == datetime.timedelta(minutes=7)
