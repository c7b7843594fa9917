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
from megatron_sparsebalance.data.synthetic import (
    KEY_MARK,
    QUERY_MARK,
    RETRIEVAL_RECORD_TOKENS,
    RETRIEVAL_VALUE_TOKENS,
    retrieval_questions,
)
from megatron_sparsebalance.training.evaluate import Score, bucket_of, bucketed, summarize
from tests import evaluate_cases, pipeline_cases
from tests.distributed import launch_cases, once_per_run, relayout


# ---- reductions ------------------------------------------------------------------------------


def test_bucket_of_is_power_of_two_upper_inclusive():
    assert [bucket_of(v) for v in (1, 2, 3, 4, 5, 8192, 12000, 16384, 16385)] == [
        "0-1", "1-2", "2-4", "2-4", "4-8", "4096-8192", "8192-16384", "8192-16384", "16384-32768"]


def test_summarize_counts_exact_match_only_when_every_target_is_right():
    scores = [
        Score(length=100, distance=None, loss_sum=0.4, targets=4, correct=4),
        Score(length=120, distance=None, loss_sum=2.0, targets=4, correct=3),  # 3 of 4: wrong
        Score(length=3000, distance=None, loss_sum=8.0, targets=4, correct=0),
        Score(length=3500, distance=None, loss_sum=1.0, targets=4, correct=4),
        Score(length=50, distance=None, loss_sum=0.0, targets=0, correct=0),  # nothing to score
    ]
    out = summarize(scores)
    assert out["samples"] == 4 and out["target_tokens"] == 16 and out["tokens"] == 100 + 120 + 3000 + 3500 + 50
    assert out["acc"] == pytest.approx(2 / 4) and out["token_acc"] == pytest.approx(11 / 16)
    assert out["loss"] == pytest.approx(11.4 / 16) and out["ppl"] == pytest.approx(math.exp(11.4 / 16))
    assert list(out["acc_by_length"]) == ["64-128", "2048-4096"]
    assert out["acc_by_length"]["64-128"] == pytest.approx({"n": 2, "acc": 0.5, "token_acc": 7 / 8, "loss": 2.4 / 8})
    assert out["acc_by_length"]["2048-4096"]["acc"] == 0.5
    assert "acc_by_distance" not in out and "questions" not in out
    assert bucketed([], key=lambda s: s.length) == {}


def test_summarize_scores_retrieval_per_question():
    """Two samples of three and two questions (2 answer tokens each): accuracy is per question,
    bucketed by the sample's length and by the question's distance; loss and token accuracy stay
    per target token."""
    samples = [Score(300, None, 3.0, 6, 4), Score(1500, None, 4.0, 4, 1)]
    questions = [
        Score(300, 200, 0.5, 2, 2),    # right
        Score(300, 100, 1.0, 2, 1),    # one token of two: wrong
        Score(300, 40, 1.5, 2, 1),     # wrong
        Score(1500, 1200, 1.0, 2, 1),  # wrong
        Score(1500, 90, 3.0, 2, 0),    # wrong
    ]
    out = summarize(samples, questions)
    assert out["samples"] == 2 and out["questions"] == 5 and out["target_tokens"] == 10
    assert out["acc"] == pytest.approx(1 / 5) and out["token_acc"] == pytest.approx(5 / 10)
    assert out["loss"] == pytest.approx(7.0 / 10)
    expect_by_length = {
        "256-512": {"n": 3, "acc": 1 / 3, "token_acc": 4 / 6, "loss": 3.0 / 6},
        "1024-2048": {"n": 2, "acc": 0.0, "token_acc": 1 / 4, "loss": 4.0 / 4}}
    expect_by_distance = {
        "32-64": {"n": 1, "acc": 0.0, "token_acc": 0.5, "loss": 1.5 / 2},
        "64-128": {"n": 2, "acc": 0.0, "token_acc": 1 / 4, "loss": 4.0 / 4},
        "128-256": {"n": 1, "acc": 1.0, "token_acc": 1.0, "loss": 0.5 / 2},
        "1024-2048": {"n": 1, "acc": 0.0, "token_acc": 0.5, "loss": 1.0 / 2}}
    for got, expect in ((out["acc_by_length"], expect_by_length), (out["acc_by_distance"], expect_by_distance)):
        assert list(got) == list(expect)
        assert all(got[b] == pytest.approx(expect[b]) for b in expect)


# ---- data: retrieval depth and the validation split --------------------------------------------


def test_training_data_is_unchanged_by_the_split_and_depth_options():
    """Digest of the mock training data with the default options: the split and depth options leave
    it as it is, and a change of the content itself must be deliberate (and update the digest)."""
    h = hashlib.sha1()
    for content in ("random", "retrieval"):
        ds = MockDataset(8, "longtail", 2048, content=content, vocab_size=1000, seed=7)
        h.update(ds.lengths.tobytes())
        for i in range(8):
            h.update(ds[i].tokens.numpy().tobytes())
            h.update(ds[i].target_mask.numpy().tobytes())
    assert h.hexdigest() == "bce6e0d2de1b6bd4a07c2d6f23a32edc558354a3"


def _distances(depth):
    ds = MockDataset(300, "uniform", 2048, content="retrieval", vocab_size=1000, seed=5, retrieval_depth=depth)
    pairs = [(q.distance, n) for i, n in enumerate(ds.lengths) for q in retrieval_questions(ds[i].tokens)]
    return np.array(pairs).T


def test_retrieval_depth_spreads_the_distance():
    early, lengths = _distances("early")
    # plants in the first tenth, questions in the last: about a whole sample apart
    assert np.all(early > 0.75 * lengths) and np.all(early < lengths)
    uniform, lengths = _distances("uniform")
    frac = uniform / lengths
    assert np.all(uniform >= RETRIEVAL_RECORD_TOKENS) and np.all(uniform < lengths)
    # plant and question at two random points: the relative distance is |U1 - U2|, of density
    # 2 (1 - x) on (0, 1): mean 1/3, 44% below 1/4, 6% above 3/4
    assert 0.3 < frac.mean() < 0.37 and 0.4 < np.mean(frac < 0.25) < 0.48 and 0.04 < np.mean(frac > 0.75) < 0.09
    with pytest.raises(ValueError, match="--mock-retrieval-depth must be one of"):
        MockDataset(4, "uniform", 2048, content="retrieval", retrieval_depth="late")


def test_retrieval_questions_read_the_markers():
    f, k1, k2, a, b, c, d = 3, 20, 21, 40, 41, 42, 43  # filler, keys, values (any ids above the markers)
    tokens = torch.tensor([f, KEY_MARK, k1, a, b, f, KEY_MARK, k2, c, d, f, f, QUERY_MARK, k2, c, d, QUERY_MARK, k1, a, b])
    assert [tuple(q) for q in retrieval_questions(tokens)] == [(12 - 6, range(14, 16)), (16 - 1, range(18, 20))]
    with pytest.raises(ValueError, match="not a retrieval sample: no QUERY marker"):
        retrieval_questions(tokens[:12])
    with pytest.raises(ValueError, match="the question at 11 has no planted record"):
        retrieval_questions(tokens[5:])


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


def _model_and_batch(vocab):
    from megatron_sparsebalance.attention import SparseAttentionConfig
    from megatron_sparsebalance.training.model import MODEL_PRESETS, build_gpt_model, transformer_config

    shape = replace(MODEL_PRESETS["tiny"], vocab_size=vocab)
    torch.manual_seed(0)
    model = build_gpt_model(shape, SparseAttentionConfig(moba_block_size=64, moba_topk=2, sparse_attn_impl="torch"),
                            transformer_config(shape), max_sequence_length=1024)
    ds = MockDataset(6, "uniform", 300, content="retrieval", vocab_size=vocab, seed=2, retrieval_depth="uniform",
                     retrieval_records=3)
    return model, pack_micro_batch(ds, [0, 1, 2, 3])


def _scored(model, batch):
    """The eval step's loss and token count, and the pack's sample and question scores."""
    from megatron_sparsebalance.training.evaluate import eval_forward_step, pack_scores

    with torch.no_grad():
        output, loss_func = eval_forward_step(iter([batch]), model)
        total, tokens, report = loss_func(output)
    return total, tokens, pack_scores(batch, report["per_token"], retrieval=True)


def test_eval_step_equals_a_naive_recomputation_from_the_logits(gloo_world_of_one):
    # vocab 16: five value ids, so the argmax of an untrained model is right often enough to matter
    model, batch = _model_and_batch(vocab=16)
    total, tokens, (samples, questions) = _scored(model, batch)
    with torch.no_grad():
        logits = model(batch.tokens, batch.position_ids, None, labels=None, packed_seq_params=batch.packed_seq_params())[0]

    def naive(positions):  # summed loss, targets, right of the predictions at these pack positions
        loss = sum(float(F.cross_entropy(logits[t].double(), batch.labels[0, t])) for t in positions)
        right = sum(int(logits[t].argmax()) == int(batch.labels[0, t]) for t in positions)
        return [loss, len(positions), right]

    cu = batch.cu_seqlens.tolist()
    expect_questions = []
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        targets = [t for t in range(lo, hi) if batch.loss_mask[0, t]]
        assert len(targets) == 3 * RETRIEVAL_VALUE_TOKENS
        assert samples[i].length == hi - lo and samples[i].distance is None
        assert list(samples[i][2:]) == pytest.approx(naive(targets), rel=1e-5)
        for q in retrieval_questions(batch.tokens[0, lo:hi]):  # the answer at a is predicted at a - 1
            expect_questions.append([hi - lo, q.distance, *naive([lo + a - 1 for a in q.answers])])
    assert [list(q) for q in questions] == [pytest.approx(e, rel=1e-5) for e in expect_questions]
    right = sum(s.correct for s in samples)
    assert 0 < right < sum(s.targets for s in samples)  # some right, some wrong: a real check
    assert right == sum(q.correct for q in questions)
    assert float(total) == pytest.approx(sum(s.loss_sum for s in samples), rel=1e-6) and int(tokens) == 24


def test_eval_step_with_logits_we_choose(gloo_world_of_one):
    """Logits forced to c at a chosen token: sample 0 all right, sample 1 all but its last answer
    token, the rest wrong; so 3 + 2 of the 12 questions are right."""
    vocab, c = 16, 5.0
    model, batch = _model_and_batch(vocab)
    labels, mask, cu = batch.labels[0], batch.loss_mask[0], batch.cu_seqlens.tolist()
    right = torch.zeros_like(mask, dtype=torch.bool)
    right[cu[0]:cu[1]] = True
    answers_1 = mask[cu[1]:cu[2]].nonzero().flatten() + cu[1]
    right[answers_1[:-1]] = True
    chosen = torch.where(right, labels, (labels + 1) % vocab)

    def force(_module, _inputs, out):
        logits = torch.zeros_like(out[0])
        logits[torch.arange(len(chosen)), 0, chosen] = c
        return logits, out[1]

    model.output_layer.register_forward_hook(force)
    _, _, (samples, questions) = _scored(model, batch)
    log_z = math.log(math.exp(c) + vocab - 1)
    for sample, k in zip(samples, [6, 5, 0, 0]):
        assert (sample.targets, sample.correct) == (6, k)
        assert sample.loss_sum == pytest.approx(6 * log_z - k * c, rel=1e-6)
    assert [q.correct for q in questions] == [2, 2, 2, 2, 2, 1] + [0] * 6
    out = summarize(samples, questions)
    assert out["acc"] == pytest.approx(5 / 12) and out["questions"] == 12
    assert out["token_acc"] == pytest.approx(11 / 24)
    assert out["loss"] == pytest.approx(log_z - 11 * c / 24, rel=1e-6)


def test_validation_line_is_megatrons():
    from megatron_sparsebalance.training.evaluate import validation_lines

    row = {"iteration": 40, "loss": 2.5, "ppl": math.exp(2.5), "acc": 0.25, "token_acc": 0.5, "samples": 64,
           "questions": 900, "budget": 16, "mean_coverage": 0.875, "acc_by_length": {"4096-8192": {"acc": 0.5, "n": 10}},
           "acc_by_distance": {"64-128": {"acc": 1.0, "n": 3}}}
    text = validation_lines(row, retrieval=True)
    line = text.splitlines()[1]
    assert line.startswith(" validation loss at iteration 40 | lm loss value: 2.500000E+00 | lm loss PPL: 1.218249E+01 |")
    fields = dict(p.strip().rsplit(":", 1) for p in line.split("|")[1:] if ":" in p)
    assert float(fields["retrieval acc"]) == 0.25 and float(fields["token acc"]) == 0.5
    assert int(fields["samples"]) == 64 and int(fields["questions"]) == 900
    assert "4096-8192: 0.500 (n=10)" in text and "64-128: 1.000 (n=3)" in text
    assert set(text.splitlines()[0]) == {"-"}


# ---- forward_only through the pipeline, and the pretrain loop -------------------------------


FORWARD_ONLY_LENGTHS = [[200, 90], [300], [64, 64, 100]]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return once_per_run(tmp_path_factory, "evaluate-layouts", launch_layouts)


def launch_layouts(root):
    """The module's launches: one process (the forward-only reference; train 2 iterations with
    evaluation and a save, and without evaluation), then two ranks (forward_only at PP=2; the saved
    weights evaluated at PP=2 and, regrouped, at DP=2 with --train-iters 0)."""
    from tests.pretrain_cases import run

    p = {name: str(root / name) for name in ("w.pt", "ref.pt", "ck", "a", "tb", "a.json", "plain.json", "a.stdout",
                                             "pp2", "dp2")}
    base = evaluate_cases.RETRIEVAL
    one = launch_cases([
        ("reference", pipeline_cases.reference, (p["w.pt"], p["ref.pt"], [FORWARD_ONLY_LENGTHS], 5)),
        ("a", evaluate_cases.run_printing_to, (base + ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2",
                                                       "--save", p["ck"], "--log-dir", p["a"], "--tensorboard-dir",
                                                       p["tb"]], p["a.json"], p["a.stdout"])),
        ("plain", run, (base + ["--train-iters", "2"], p["plain.json"])),
    ], world=1, done_dir=str(root / "done1"))

    def evaluated(name, pp):
        return name, run, (base + ["--train-iters", "0", "--eval-interval", "100", "--eval-iters", "2",
                                   "--pretrained-checkpoint", p["ck"], "--log-dir", p[name],
                                   "--pipeline-model-parallel-size", str(pp)],)

    two = launch_cases([
        ("forward-only", evaluate_cases.forward_only_pipelined, (p["w.pt"], p["ref.pt"], FORWARD_ONLY_LENGTHS, 5, 2)),
        evaluated("pp2", 2),
        ("regroup", relayout, (1, 1)),
        evaluated("dp2", 1),
    ], world=2, pp=2, done_dir=str(root / "done2"))
    return one, two, p


@pytest.mark.slow
def test_forward_only_pp2_equals_single_process(layouts):
    one, two, _ = layouts
    one.check("reference")
    two.check("forward-only")


def _eval_rows(log_dir):
    with open(os.path.join(log_dir, "eval.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_pretrain_evaluates_the_same_under_any_layout(layouts):
    """Train 2 iterations (PP=1) and evaluate; the saved weights evaluated under PP=2 and under DP=2
    (--train-iters 0: the evaluation at the end) give the same numbers; evaluating leaves the
    training losses bit for bit as they are without it."""
    one, two, p = layouts
    one.check("a")
    one.check("plain")
    a, tb, rows_a, rows_plain = p["a"], p["tb"], p["a.json"], p["plain.json"]
    assert [r["loss"] for r in json.load(open(rows_a))] == [r["loss"] for r in json.load(open(rows_plain))]
    (ref,) = _eval_rows(a)  # iteration 2 is both an interval and the end: evaluated once
    assert ref["iteration"] == 2 and ref["samples"] == 8 and ref["budget"] == 4
    assert ref["questions"] >= 8 and ref["target_tokens"] == ref["questions"] * RETRIEVAL_VALUE_TOKENS
    assert sum(c["n"] for c in ref["acc_by_length"].values()) == ref["questions"]
    assert sum(c["n"] for c in ref["acc_by_distance"].values()) == ref["questions"]
    assert "validation loss at iteration 2 | lm loss value:" in open(p["a.stdout"]).read()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb)
    acc.Reload()
    assert [e.value for e in acc.Scalars("eval/loss")] == pytest.approx([ref["loss"]])
    assert any(t.startswith("eval/acc_by_distance/") for t in acc.Tags()["scalars"])

    two.check("regroup")
    for name in ("pp2", "dp2"):
        two.check(name)
        out = p[name]
        (row,) = _eval_rows(out)
        assert row["iteration"] == 0, name
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
        for key in ("samples", "questions", "tokens", "acc", "token_acc"):
            assert row[key] == ref[key], (name, key)
        for group in ("acc_by_length", "acc_by_distance"):
            assert {b: c["n"] for b, c in row[group].items()} == {b: c["n"] for b, c in ref[group].items()}


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
        assert 0.0 <= r["retrieval_acc"] <= 1.0 and r["val_samples"] == 4 and r["val_questions"] >= 4
        assert sum(c["n"] for c in r["acc_by_length"].values()) == r["val_questions"] and r["acc_by_distance"]
        assert r["eval_iteration"] == 2 and "stopped" not in r
        assert r["gpu"] == "cpu" and r["gpus_visible"] == 0  # where the row ran, kept through --merge
        assert len(r["loss_curve"]) == 2 and r["eval_curve"][-1][0] == 2
    assert dense["tokens"] == sb["tokens"]  # same seed, same samples
    assert dense["mean_budget"] is None and sb["mean_budget"] > 0 and 0 < sb["mean_coverage"] <= 1
    assert "--no-sparse-attention" in result["commands"]["dense"]
    assert re.search(r"--dst-p', '0.1'", str(result["commands"]["sb_p0.1"]))
    for png in ("fidelity_loss.png", "fidelity_acc.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000


@pytest.mark.slow
def test_fidelity_begins_every_configuration_from_the_trained_start(tmp_path):
    from benchmarks.fidelity import main

    out = str(tmp_path / "out")
    common = ["--model", "tiny", "--seq-length", "1024", "--train-iters", "2", "--eval-interval", "2",
              "--eval-iters", "1", "--global-batch-size", "4", "--mock-vocab-size", "64", "--moba-block-size", "64",
              "--moba-topk", "4", "--out", out, "--sparse-attn-impl", "torch"]
    assert main(["--configs", "fixed", "--start-iters", "3", "--start-seq-length", "512", *common]) == 0
    result = json.load(open(os.path.join(out, "fidelity.json")))
    start, (fixed,) = result["start"], result["rows"]
    assert start["iterations"] == 3 and start["eval_iteration"] == 3 and 0.0 <= start["retrieval_acc"] <= 1.0
    assert "--no-sparse-attention" in start["command"] and start["command"][start["command"].index("--seq-length") + 1] == "512"
    assert open(os.path.join(start["checkpoint"], "latest_checkpointed_iteration.txt")).read().strip() == "3"
    flags = result["commands"]["fixed"]
    assert flags[flags.index("--pretrained-checkpoint") + 1] == start["checkpoint"]
    log = open(os.path.join(fixed["log_dir"], "pretrain.log")).read()
    assert f"initialized weights from {os.path.join(start['checkpoint'], 'iter_0000003')}" in log
    assert fixed["iterations"] == 2 and "error" not in fixed

    # An earlier call's start, given back: no new start is trained, the same weights begin the run.
    again = str(tmp_path / "again")
    assert main(["--configs", "dense", "--start-checkpoint", start["checkpoint"], *common[:-4], "--out", again,
                 "--sparse-attn-impl", "torch"]) == 0
    result = json.load(open(os.path.join(again, "fidelity.json")))
    assert result["start"] == {"checkpoint": start["checkpoint"]} and not os.path.isdir(os.path.join(again, "fidelity_runs", "start"))
    assert "initialized weights from" in open(os.path.join(result["rows"][0]["log_dir"], "pretrain.log")).read()


def test_fidelity_runs_per_gpu_keep_the_first_configurations_alone(monkeypatch):
    import subprocess
    import time

    from benchmarks import fidelity

    placed = {}

    def fake_launch(run, nproc, gpus, threads):  # a run that takes a second, wherever it is put
        placed[run.config] = list(gpus)
        return subprocess.Popen(["sleep", "1"]), time.perf_counter(), open(os.devnull, "w")

    monkeypatch.setattr(fidelity, "launch", fake_launch)
    args = fidelity.parse_args(["--configs", "fixed", "sb_p0.1", "dense", "--runs-per-gpu", "2"])
    runs = fidelity.build_runs(args, on_gpus=True)
    shared = {}
    done = fidelity.run_all(runs, args, ["0", "1"], shared=shared)
    assert set(done) == {"fixed", "sb_p0.1", "dense"} and all(rc == 0 for rc, _, _ in done.values())
    assert placed == {"fixed": ["0"], "sb_p0.1": ["1"], "dense": ["1"]}
    assert shared == {"fixed": [], "sb_p0.1": ["dense"], "dense": ["sb_p0.1"]}


def test_fidelity_stops_runs_at_the_total_time_limit(tmp_path):
    from benchmarks.fidelity import main

    out = str(tmp_path / "out")
    rc = main(["--configs", "fixed", "dense", "--model", "tiny", "--seq-length", "1024", "--train-iters", "50",
               "--moba-block-size", "64", "--moba-topk", "4", "--total-timeout-s", "1", "--out", out])
    rows = json.load(open(os.path.join(out, "fidelity.json")))["rows"]
    assert rc == 1 and rows[0]["config"] == "fixed" and rows[0]["exit_code"] != 0 and "error" in rows[0]
    assert rows[1] == {"config": "dense", "seed": 1234, "exit_code": None, "error": "not started: --total-timeout-s",
                       "gpu": "cpu", "gpus_visible": 0}


def _fake_run(tmp_path, config, iterations, evaluated):
    """A run directory as pretrain leaves it after ``iterations``, evaluated at ``evaluated``."""
    from dataclasses import asdict

    from benchmarks.fidelity import Run

    run = Run(config, 1234, [], str(tmp_path / config))
    os.makedirs(run.log_dir)
    data = asdict(DataConfig(seq_length=1024, mock_data=True, mock_content="retrieval", mock_samples=64,
                             mock_vocab_size=64))
    with open(os.path.join(run.log_dir, "config.json"), "w") as f:
        json.dump({"data": data, "training": {"global_batch_size": 4, "train_iters": 10},
                   "sparse": {"sparse_attention": True}}, f)
    with open(os.path.join(run.log_dir, "metrics.jsonl"), "w") as f:
        for it in range(1, iterations + 1):
            f.write(json.dumps({"iteration": it, "loss": 3.0, "elapsed_ms": 100.0, "mean_budget": 4.0,
                                "mean_coverage": 0.9}) + "\n")
    with open(os.path.join(run.log_dir, "eval.jsonl"), "w") as f:
        for it in evaluated:
            f.write(json.dumps({"iteration": it, "loss": 2.0, "acc": 0.5, "token_acc": 0.6, "samples": 8,
                                "questions": 20, "acc_by_length": {}, "acc_by_distance": {}, "mean_coverage": 0.8,
                                "eval_ms": 50.0}) + "\n")
    with open(os.path.join(run.log_dir, "pretrain.log"), "w") as f:
        f.write("exiting at iteration 7 (SIGTERM)\n")
    return run


def test_fidelity_keeps_what_a_stopped_run_logged(tmp_path):
    from benchmarks.fidelity import result_row

    run = _fake_run(tmp_path, "dense", iterations=7, evaluated=[3, 6])
    row = result_row(run, exit_code=-15, process_s=30.0, stopped=True, nproc=1, pp=1)
    assert "error" not in row and row["stopped"] == "time limit: 7 of 10 iterations, last evaluation at 6"
    assert row["iterations"] == 7 and row["eval_iteration"] == 6 and row["wall_s"] == pytest.approx(0.7)
    assert row["retrieval_acc"] == 0.5 and row["val_questions"] == 20 and row["tokens"] > 0
    # a run that failed on its own is an error, whatever it logged
    assert "error" in result_row(run, exit_code=1, process_s=30.0, stopped=False, nproc=1, pp=1)
    finished = result_row(_fake_run(tmp_path, "fixed", 10, [5, 10]), 0, 30.0, False, 1, 1)
    assert "stopped" not in finished and finished["eval_iteration"] == 10


def test_fidelity_merge_keeps_the_other_configurations(tmp_path):
    from benchmarks.fidelity import merge_earlier, parse_args

    path = str(tmp_path / "fidelity.json")
    first = parse_args(["--configs", "fixed", "dense", "--out", str(tmp_path)])
    earlier = {"rows": [{"config": "fixed", "val_loss": 1.0}, {"config": "dense", "val_loss": 2.0}],
               "commands": {"fixed": ["a"], "dense": ["b"]}, "settings": dict(vars(first)), "total_wall_s": 500.0}
    with open(path, "w") as f:
        json.dump(earlier, f)
    second = parse_args(["--configs", "dense", "sb_p0.2", "--merge", "--out", str(tmp_path), "--timeout-s", "100"])
    ours = {"rows": [{"config": "dense", "val_loss": 3.0}, {"config": "sb_p0.2", "val_loss": 4.0}],
            "commands": {"dense": ["c"], "sb_p0.2": ["d"]}, "settings": dict(vars(second)), "total_wall_s": 400.0}
    merged = merge_earlier(path, ours)
    assert [(r["config"], r["val_loss"]) for r in merged["rows"]] == [("fixed", 1.0), ("dense", 3.0), ("sb_p0.2", 4.0)]
    assert merged["commands"] == {"fixed": ["a"], "dense": ["c"], "sb_p0.2": ["d"]} and merged["total_wall_s"] == 900.0
    other = parse_args(["--configs", "sb_p0.2", "--merge", "--out", str(tmp_path), "--lr", "0.01"])
    with pytest.raises(SystemExit, match=r"other settings \(lr\)"):
        merge_earlier(path, {**ours, "settings": dict(vars(other))})



def test_fidelity_runs_one_configuration_per_gpu_slot(tmp_path, monkeypatch):
    """Four visible GPUs, one per run: four configurations start at once, each on its own GPU, and
    the fifth when the first slot frees up."""
    import subprocess
    import time

    import benchmarks.fidelity as fidelity

    started = []

    def fake_launch(run, nproc, gpus, threads):
        assert threads == max(1, os.cpu_count() // 4)  # the host's cores shared by the four slots
        started.append((run.config, tuple(gpus), time.perf_counter()))
        log = open(os.path.join(tmp_path, run.config + ".log"), "w")
        return subprocess.Popen(["sleep", "1"]), time.perf_counter(), log

    monkeypatch.setattr(fidelity, "launch", fake_launch)
    args = fidelity.parse_args(["--out", str(tmp_path)])
    runs = fidelity.build_runs(args, on_gpus=True)
    done = fidelity.run_all(runs, args, gpus=["0", "1", "2", "3"])
    assert [c for c, _, _ in started] == list(fidelity.CONFIGS) and set(done) == set(fidelity.CONFIGS)
    assert [g for _, g, _ in started[:4]] == [("0",), ("1",), ("2",), ("3",)]
    assert started[4][2] >= started[0][2] + 0.9  # waited for a slot to free up
    assert all(code == 0 and not stopped for code, _, stopped in done.values())
