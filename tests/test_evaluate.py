"""Evaluation (--eval-interval): the numbers against independent computations, buckets, the
validation split, the retrieval depth option, forward_only through the pipeline, and the flags."""
import hashlib
import json
import math
import os
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_sparsebalance.config import parse_config
from megatron_sparsebalance.data.datasets import (
    DataConfig,
    MockDataset,
    build_dataset,
    build_validation_dataset,
    pack_micro_batch,
)
from megatron_sparsebalance.data.synthetic import RETRIEVAL_KEY_TOKENS, RETRIEVAL_VALUE_TOKENS, retrieval_distance
from megatron_sparsebalance.training.evaluate import SampleScore, bucket_of, bucketed, summarize
from tests import evaluate_cases, pipeline_cases
from tests.distributed import run_workers

RECORD = 2 + RETRIEVAL_KEY_TOKENS + RETRIEVAL_VALUE_TOKENS


# ---- reductions ------------------------------------------------------------------------------


def test_bucket_of_is_power_of_two_upper_inclusive():
    assert [bucket_of(v) for v in (1, 2, 3, 4, 5, 8192, 12000, 16384, 16385)] == [
        "0-1", "1-2", "2-4", "2-4", "4-8", "4096-8192", "8192-16384", "8192-16384", "16384-32768"]


def test_summarize_counts_exact_match_only_when_every_target_is_right():
    scores = [
        SampleScore(length=100, distance=20, loss_sum=0.4, targets=4, correct=4),
        SampleScore(length=120, distance=90, loss_sum=2.0, targets=4, correct=3),  # 3 of 4: wrong
        SampleScore(length=3000, distance=2900, loss_sum=8.0, targets=4, correct=0),
        SampleScore(length=3500, distance=40, loss_sum=1.0, targets=4, correct=4),
        SampleScore(length=50, distance=30, loss_sum=0.0, targets=0, correct=0),  # nothing to score
    ]
    out = summarize(scores, retrieval=True)
    assert out["samples"] == 4 and out["target_tokens"] == 16 and out["tokens"] == 100 + 120 + 3000 + 3500 + 50
    assert out["acc"] == pytest.approx(2 / 4) and out["token_acc"] == pytest.approx(11 / 16)
    assert out["loss"] == pytest.approx(11.4 / 16) and out["ppl"] == pytest.approx(math.exp(11.4 / 16))
    assert list(out["acc_by_length"]) == ["64-128", "2048-4096"]
    assert out["acc_by_length"]["64-128"] == pytest.approx({"samples": 2, "acc": 0.5, "token_acc": 7 / 8, "loss": 2.4 / 8})
    assert out["acc_by_length"]["2048-4096"]["acc"] == 0.5
    assert list(out["acc_by_distance"]) == ["16-32", "32-64", "64-128", "2048-4096"]
    assert out["acc_by_distance"]["2048-4096"] == pytest.approx({"samples": 1, "acc": 0.0, "token_acc": 0.0, "loss": 2.0})
    assert "acc_by_distance" not in summarize(scores, retrieval=False)
    assert bucketed([], key=lambda s: s.length) == {}


# ---- data: retrieval depth and the validation split --------------------------------------------


def test_training_data_is_unchanged_by_the_split_and_depth_options():
    """Digest of the mock training data as the code before these options produced it."""
    h = hashlib.sha1()
    for content in ("random", "retrieval"):
        ds = MockDataset(8, "longtail", 2048, content=content, vocab_size=1000, seed=7)
        h.update(ds.lengths.tobytes())
        for i in range(8):
            h.update(ds[i].tokens.numpy().tobytes())
            h.update(ds[i].target_mask.numpy().tobytes())
    assert h.hexdigest() == "4af4265a37bc210e5944193772581e35b92ef5d9"


def _distances(depth):
    ds = MockDataset(300, "uniform", 2048, content="retrieval", vocab_size=1000, seed=5, retrieval_depth=depth)
    return np.array([retrieval_distance(ds[i].tokens) for i in range(len(ds))]), ds.lengths


def test_retrieval_depth_spreads_the_distance():
    early, lengths = _distances("early")
    assert np.all(early > 0.9 * lengths - RECORD) and np.all(early <= lengths - RECORD)
    uniform, lengths = _distances("uniform")
    frac = uniform / lengths
    assert np.all(uniform >= RECORD) and np.all(uniform <= lengths - RECORD)
    # anywhere before the question: the relative distance is about uniform on (0, 1)
    assert 0.4 < frac.mean() < 0.6 and 0.15 < np.mean(frac < 0.25) < 0.35 and 0.15 < np.mean(frac > 0.75) < 0.35
    with pytest.raises(ValueError, match="--mock-retrieval-depth must be one of"):
        MockDataset(4, "uniform", 2048, content="retrieval", retrieval_depth="late")


def test_retrieval_distance_reads_the_markers():
    ds = MockDataset(3, "uniform", 512, content="retrieval", vocab_size=100, seed=1, retrieval_depth="uniform")
    tokens = ds[0].tokens
    key = int((tokens == 1).nonzero()[0, 0])
    assert retrieval_distance(tokens) == len(tokens) - RECORD - key
    with pytest.raises(ValueError, match="not a retrieval sample"):
        retrieval_distance(torch.full((40,), 9))


def test_validation_split_is_held_out_and_independent_of_the_seed():
    cfg = DataConfig(seq_length=2048, mock_data=True, mock_length_distribution="longtail", mock_content="retrieval",
                     mock_samples=400, mock_vocab_size=1000, seed=3)
    train, val = build_dataset(cfg), build_validation_dataset(cfg, 64)
    assert len(val) == 64 and val.split == "validation" and val.content == "retrieval"
    digest = lambda s: hashlib.sha1(s.tokens.numpy().tobytes()).hexdigest()  # noqa: E731
    seen = {digest(train[i]) for i in range(len(train))}
    assert not any(digest(val[i]) in seen for i in range(len(val)))
    # the same distribution: longtail scaled to 2048 (shortest 8K * 2048 / 72K)
    assert val.lengths.min() >= 2048 * 8192 // 73728 and val.lengths.max() <= 2048
    other = build_validation_dataset(replace(cfg, seed=99), 64)
    assert np.array_equal(other.lengths, val.lengths) and torch.equal(other[5].tokens, val[5].tokens)
    with pytest.raises(ValueError, match="--valid-data-path, or --mock-data"):
        build_validation_dataset(replace(cfg, mock_data=False, data_path="x.bin"), 4)


# ---- flags -----------------------------------------------------------------------------------

MOCK = ["--mock-data", "--seq-length", "1024", "--moba-block-size", "64", "--moba-topk", "4"]


@pytest.mark.parametrize("argv, match", [
    (MOCK + ["--eval-interval", "-1"], r"--eval-interval must be >= 0"),
    (MOCK + ["--eval-interval", "5", "--eval-iters", "0"], r"--eval-iters must be >= 1"),
    (MOCK + ["--valid-data-path", "/nonexistent.jsonl", "--eval-interval", "5"], r"--valid-data-path /nonexistent.jsonl"),
    (MOCK + ["--mock-retrieval-depth", "late"], r"--mock-retrieval-depth must be one of"),
    (MOCK + ["--eval-interval", "6", "--dp-comm", "diloco", "--outer-steps-interval", "4"],
     r"--eval-interval \(6\) must be a multiple of --outer-steps-interval \(4\)"),
])
def test_bad_eval_flags_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_config(argv).validate(1)


def test_eval_needs_validation_data(tmp_path):
    from megatron_sparsebalance.data.datasets import write_indexed_dataset

    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, [torch.randint(1, 60, (n,)) for n in (300, 200)], vocab_size=64)
    with pytest.raises(ValueError, match="--eval-interval needs validation data"):
        parse_config(["--data-path", prefix, "--eval-interval", "5"]).validate(1)
    with pytest.raises(ValueError, match="--valid-data-path is read only by evaluation"):
        parse_config(["--data-path", prefix, "--valid-data-path", prefix]).validate(1)
    cfg = parse_config(["--data-path", prefix, "--valid-data-path", prefix, "--eval-interval", "5", "--eval-iters", "2"])
    assert cfg.validate(1).eval.enabled and not parse_config(MOCK + ["--eval-interval", "0"]).eval.enabled
    assert build_validation_dataset(cfg.data, 100).lengths.tolist() == [300, 200]  # the file, whole


# ---- the last stage: the eval forward step against independent computations -------------------


@pytest.fixture(scope="module")
def gloo_world_of_one():
    from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
    from megatron_sparsebalance.training.dist import destroy_distributed, init_distributed

    enable_cpu_megatron()
    init_distributed(backend="gloo")
    yield
    destroy_distributed()


def _model_and_batch(vocab):
    from megatron_sparsebalance.attention import SparseAttentionConfig
    from megatron_sparsebalance.training.model import MODEL_PRESETS, build_gpt_model, transformer_config

    shape = replace(MODEL_PRESETS["tiny"], vocab_size=vocab)
    torch.manual_seed(0)
    model = build_gpt_model(shape, SparseAttentionConfig(moba_block_size=64, moba_topk=2, sparse_attn_impl="torch"),
                            transformer_config(shape), max_sequence_length=1024)
    ds = MockDataset(6, "uniform", 300, content="retrieval", vocab_size=vocab, seed=2, retrieval_depth="uniform")
    return model, pack_micro_batch(ds, [0, 1, 2, 3])


def _per_sample(model, batch):
    from megatron_sparsebalance.training.evaluate import eval_forward_step

    with torch.no_grad():
        output, loss_func = eval_forward_step(iter([batch]), model)
        total, tokens, report = loss_func(output)
    return total, tokens, report["per_sample"]


def test_eval_step_equals_a_naive_recomputation_from_the_logits(gloo_world_of_one):
    # vocab 8: three value tokens, so the argmax of an untrained model is right often enough to matter
    model, batch = _model_and_batch(vocab=8)
    total, tokens, per_sample = _per_sample(model, batch)
    with torch.no_grad():
        logits = model(batch.tokens, batch.position_ids, None, labels=None, packed_seq_params=batch.packed_seq_params())[0]
    cu = batch.cu_seqlens.tolist()
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        loss = correct = targets = 0.0
        for t in range(lo, hi):
            if batch.loss_mask[0, t]:
                loss += float(F.cross_entropy(logits[t].double(), batch.labels[0, t]))
                correct += float(int(logits[t].argmax()) == int(batch.labels[0, t]))
                targets += 1
        assert targets == RETRIEVAL_VALUE_TOKENS
        assert per_sample[:, i].tolist() == pytest.approx([loss, targets, correct], rel=1e-5)
    assert 0 < per_sample[2].sum() < per_sample[1].sum()  # some right, some wrong: a real check
    assert float(total) == pytest.approx(float(per_sample[0].sum()), rel=1e-6) and int(tokens) == 16


def test_eval_step_with_logits_we_choose(gloo_world_of_one):
    """Logits forced to c at a chosen token: sample 0 all right, sample 1 three of four, the rest wrong."""
    vocab, c = 16, 5.0
    model, batch = _model_and_batch(vocab)
    labels, mask, cu = batch.labels[0], batch.loss_mask[0], batch.cu_seqlens.tolist()
    right = torch.zeros_like(mask, dtype=torch.bool)
    right[cu[0]:cu[1]] = True
    answers_1 = mask[cu[1]:cu[2]].nonzero().flatten() + cu[1]
    right[answers_1[:3]] = True
    chosen = torch.where(right, labels, (labels + 1) % vocab)

    def force(_module, _inputs, out):
        logits = torch.zeros_like(out[0])
        logits[torch.arange(len(chosen)), 0, chosen] = c
        return logits, out[1]

    model.output_layer.register_forward_hook(force)
    _, _, per_sample = _per_sample(model, batch)
    log_z = math.log(math.exp(c) + vocab - 1)
    expect_right = [4, 3, 0, 0]
    for i, k in enumerate(expect_right):
        assert per_sample[:, i].tolist() == pytest.approx([4 * log_z - k * c, 4, k], rel=1e-6)
    scores = [SampleScore(n, 0, *per_sample[:, i].tolist()) for i, n in enumerate(batch.lengths)]
    out = summarize([s._replace(targets=round(s.targets), correct=round(s.correct)) for s in scores], retrieval=False)
    assert out["acc"] == 0.25 and out["token_acc"] == pytest.approx(7 / 16)
    assert out["loss"] == pytest.approx(log_z - 7 * c / 16, rel=1e-6)


def test_validation_line_is_megatrons():
    from megatron_sparsebalance.training.evaluate import validation_lines

    row = {"iteration": 40, "loss": 2.5, "ppl": math.exp(2.5), "acc": 0.25, "token_acc": 0.5, "samples": 64,
           "budget": 16, "mean_coverage": 0.875, "acc_by_length": {"4096-8192": {"acc": 0.5, "samples": 10}},
           "acc_by_distance": {"64-128": {"acc": 1.0, "samples": 3}}}
    text = validation_lines(row, retrieval=True)
    line = text.splitlines()[1]
    assert line.startswith(" validation loss at iteration 40 | lm loss value: 2.500000E+00 | lm loss PPL: 1.218249E+01 |")
    fields = dict(p.strip().rsplit(":", 1) for p in line.split("|")[1:] if ":" in p)
    assert float(fields["retrieval acc"]) == 0.25 and float(fields["token acc"]) == 0.5
    assert "4096-8192: 0.500 (n=10)" in text and "64-128: 1.000 (n=3)" in text
    assert set(text.splitlines()[0]) == {"-"}


# ---- forward_only through the pipeline, and the pretrain loop -------------------------------


@pytest.mark.slow
def test_forward_only_pp2_equals_single_process(tmp_path):
    weights, ref = str(tmp_path / "w.pt"), str(tmp_path / "ref.pt")
    lengths = [[200, 90], [300], [64, 64, 100]]
    run_workers(pipeline_cases.reference, world=1, args=(weights, ref, [lengths], 5))
    run_workers(evaluate_cases.forward_only_pipelined, world=2, pp=2, args=(weights, ref, lengths, 5, 2))


def _eval_rows(log_dir):
    with open(os.path.join(log_dir, "eval.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_pretrain_evaluates_the_same_under_any_layout(tmp_path, capfd):
    """Train 2 iterations (PP=1) and evaluate; the saved weights evaluated under PP=2 and under DP=2
    (--train-iters 0: the evaluation at the end) give the same numbers; evaluating leaves the
    training losses bit for bit as they are without it."""
    from tests.pretrain_cases import run

    base = evaluate_cases.RETRIEVAL
    ck, a, tb = str(tmp_path / "ck"), str(tmp_path / "a"), str(tmp_path / "tb")
    rows_a, rows_plain = str(tmp_path / "a.json"), str(tmp_path / "plain.json")
    run_workers(run, world=1, args=(base + ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2", "--save", ck,
                                            "--log-dir", a, "--tensorboard-dir", tb], rows_a))
    run_workers(run, world=1, args=(base + ["--train-iters", "2"], rows_plain))
    assert [r["loss"] for r in json.load(open(rows_a))] == [r["loss"] for r in json.load(open(rows_plain))]
    (ref,) = _eval_rows(a)  # iteration 2 is both an interval and the end: evaluated once
    assert ref["iteration"] == 2 and ref["samples"] == 8 and ref["target_tokens"] == 32 and ref["budget"] == 4
    assert sum(c["samples"] for c in ref["acc_by_length"].values()) == 8
    assert sum(c["samples"] for c in ref["acc_by_distance"].values()) == 8
    assert "validation loss at iteration 2 | lm loss value:" in capfd.readouterr().out

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb)
    acc.Reload()
    assert [e.value for e in acc.Scalars("eval/loss")] == pytest.approx([ref["loss"]])
    assert any(t.startswith("eval/acc_by_distance/") for t in acc.Tags()["scalars"])

    for name, world, pp in (("pp2", 2, 2), ("dp2", 2, 1)):
        out = str(tmp_path / name)
        run_workers(run, world=world, pp=pp, args=(base + ["--train-iters", "0", "--eval-interval", "100", "--eval-iters",
                                                           "2", "--pretrained-checkpoint", ck, "--log-dir", out,
                                                           "--pipeline-model-parallel-size", str(pp)],))
        (row,) = _eval_rows(out)
        assert row["iteration"] == 0, name
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
        for key in ("samples", "tokens", "acc", "token_acc"):
            assert row[key] == ref[key], (name, key)
        for group in ("acc_by_length", "acc_by_distance"):
            assert {b: c["samples"] for b, c in row[group].items()} == {b: c["samples"] for b, c in ref[group].items()}


# ---- the benchmark ---------------------------------------------------------------------------


@pytest.mark.slow
def test_fidelity_benchmark_smoke(tmp_path):
    from benchmarks.fidelity import main

    out = str(tmp_path / "out")
    rc = main(["--configs", "dense", "sb_p0.1", "--model", "tiny", "--seq-length", "1024", "--train-iters", "2",
               "--eval-interval", "2", "--eval-iters", "1", "--global-batch-size", "4", "--mock-vocab-size", "64",
               "--moba-block-size", "64", "--moba-topk", "4", "--out", out, "--sparse-attn-impl", "torch"])
    assert rc == 0
    result = json.load(open(os.path.join(out, "fidelity.json")))
    assert result["gpu"] == "cpu" and [r["config"] for r in result["rows"]] == ["dense", "sb_p0.1"]
    dense, sb = result["rows"]
    for r in result["rows"]:
        assert isinstance(r["tokens"], int) and r["tokens"] > 0 and r["iterations"] == 2
        for key in ("val_loss", "retrieval_acc", "token_acc", "wall_s", "process_wall_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["config"], key)
        assert 0.0 <= r["retrieval_acc"] <= 1.0 and r["val_samples"] == 4
        assert sum(c["samples"] for c in r["acc_by_length"].values()) == 4 and r["acc_by_distance"]
        assert len(r["loss_curve"]) == 2 and r["eval_curve"][-1][0] == 2
    assert dense["tokens"] == sb["tokens"]  # same seed, same samples
    assert dense["mean_budget"] is None and sb["mean_budget"] > 0 and 0 < sb["mean_coverage"] <= 1
    assert "--no-sparse-attention" in result["commands"]["dense"]
    assert re.search(r"--dst-p', '0.1'", str(result["commands"]["sb_p0.1"]))
    for png in ("fidelity_loss.png", "fidelity_acc.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000


def test_fidelity_stops_runs_at_the_total_time_limit(tmp_path):
    from benchmarks.fidelity import main

    out = str(tmp_path / "out")
    rc = main(["--configs", "fixed", "dense", "--model", "tiny", "--seq-length", "1024", "--train-iters", "50",
               "--moba-block-size", "64", "--moba-topk", "4", "--total-timeout-s", "1", "--out", out])
    rows = json.load(open(os.path.join(out, "fidelity.json")))["rows"]
    assert rc == 1 and rows[0]["config"] == "fixed" and rows[0]["exit_code"] != 0 and "error" in rows[0]
    assert rows[1] == {"config": "dense", "seed": 1234, "exit_code": None, "error": "not started: --total-timeout-s"}
