"""The latency model (DESIGN.md §3): exactness, monotonicity, align, JSON, metadata, calibration.

Most tests use a synthetic table generated from a known ground truth with the cost's shape:
``stage(L, k) = c0 + c1*L + a*pairs(L, k)`` for single sequences, and for a pack
``c0 + c1*sum(L) + a*sum pairs(L_s, k)``. The profiled model must reproduce it exactly at grid
points and wherever the shape is exactly linear in its interpolation coordinate.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import random
import time

import pytest

from megatron_sparsebalance.balance.latency import (
    AnalyticLatencyModel,
    LatencyModel,
    ProfiledLatencyModel,
    attention_block_pairs,
    latency_metadata,
)

B = 128
LENGTHS = [1024, 2048, 4096, 8192, 16384]
BUDGETS = [1, 4, 8, 16, 32]
C0, C1, A = 2.0, 1e-3, 4e-3  # ms, ms per token, ms per block pair

SHAPE_05B = dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                 num_query_groups=2, kv_channels=64, vocab_size=151936)


def truth(lengths, k):
    return C0 + C1 * sum(lengths) + A * sum(attention_block_pairs(n, k, B) for n in lengths)


def synthetic_table(**kw):
    total = [[truth([L], k) for k in BUDGETS] for L in LENGTHS]
    attention = [[A * attention_block_pairs(L, k, B) for k in BUDGETS] for L in LENGTHS]
    return ProfiledLatencyModel(LENGTHS, BUDGETS, total, attention, B, **kw)


def analytic():
    return AnalyticLatencyModel(SHAPE_05B, layers_per_stage=6, block_size=B, hardware="h200")


def test_block_pairs_shape():
    # one block: the diagonal only; dense while k covers all blocks; linear in blocks after
    assert attention_block_pairs(B, 5, B) == 1.0
    assert attention_block_pairs(4 * B, 8, B) == 1 + 2 + 3 + 4
    assert attention_block_pairs(10 * B, 3, B) == 1 + 2 + 3 * 8
    assert attention_block_pairs(B // 2, 1, B) == 0.5  # a half block weighs half
    assert attention_block_pairs(0, 4, B) == 0.0


def test_exact_at_grid_points():
    m = synthetic_table()
    for j, L in enumerate(LENGTHS):
        for i, k in enumerate(BUDGETS):
            assert m.predict([L], k) == pytest.approx(m.total_ms[j][i], rel=1e-12)


def test_packs_follow_the_decomposition():
    # off-grid lengths and packs at profiled budgets: the shape is linear in the interpolation
    # coordinates (tokens for dense, block pairs for attention), so the prediction is exact
    m = synthetic_table()
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(LENGTHS[0], LENGTHS[-1] // 4) for _ in range(rng.randint(1, 4))]
        k = rng.choice(BUDGETS)
        assert m.predict(lengths, k) == pytest.approx(truth(lengths, k), rel=1e-9)
    # between profiled budgets: bounded by its neighbours
    assert m.predict([12000], 8) <= m.predict([12000], 12) <= m.predict([12000], 16)


def test_pack_attention_follows_total_work():
    # A pack's sparse attention is one kernel over all its sequences' block pairs, so it costs
    # what one sequence with the same pairs costs; a table whose attention is concave in work
    # (under-filled GPU at small sizes) must not charge that floor once per sequence.
    def g(pairs):
        return 3.0 * math.sqrt(pairs)

    total = [[C0 + C1 * L + g(attention_block_pairs(L, k, B)) for k in BUDGETS] for L in LENGTHS]
    attention = [[g(attention_block_pairs(L, k, B)) for k in BUDGETS] for L in LENGTHS]
    m = ProfiledLatencyModel(LENGTHS, BUDGETS, total, attention, B)
    # at k=1 a sequence of L tokens has L/B pairs: two 4K sequences = one 8K sequence of work
    assert m.predict([4096, 4096], 1) == pytest.approx(m.predict([8192], 1), rel=1e-12)
    assert m.predict([4096, 4096], 1) == pytest.approx(C0 + C1 * 8192 + g(64), rel=1e-12)
    # and the sum of separate sequences over-charges it
    separate = m.predict([4096], 1) + m.predict([4096], 1) - (C0 + C1 * 4096)
    assert separate > m.predict([4096, 4096], 1) * 1.05


def _check_monotone(model, rng, lo=200, hi=100_000, trials=150):
    ks = list(range(1, 70))
    for _ in range(trials):
        lengths = [rng.randint(lo, hi) for _ in range(rng.randint(1, 5))]
        preds = [model.predict(lengths, k) for k in ks]
        assert all(b >= a - 1e-12 for a, b in zip(preds, preds[1:])), (lengths, preds)
        k = rng.choice(ks)
        s = rng.randrange(len(lengths))
        base = model.predict(lengths, k)
        for step in (1, 7, 128, 1000, 20_000):
            longer = list(lengths)
            longer[s] += step
            assert model.predict(longer, k) >= base - 1e-12, (lengths, s, step, k)
        assert model.predict(lengths + [rng.randint(1, 5000)], k) >= base  # one more sequence


def test_monotone_in_k_and_length_profiled():
    _check_monotone(synthetic_table(), random.Random(1))


def test_monotone_on_concave_table():
    total = [[C0 + C1 * L + 3.0 * math.sqrt(attention_block_pairs(L, k, B)) for k in BUDGETS] for L in LENGTHS]
    attention = [[3.0 * math.sqrt(attention_block_pairs(L, k, B)) for k in BUDGETS] for L in LENGTHS]
    _check_monotone(ProfiledLatencyModel(LENGTHS, BUDGETS, total, attention, B), random.Random(7))


def test_monotone_on_noisy_table():
    # a measured table is noisy: non-monotone entries must not make the prediction non-monotone
    rng = random.Random(2)
    total = [[truth([L], k) * rng.uniform(0.85, 1.15) for k in BUDGETS] for L in LENGTHS]
    attention = [[A * attention_block_pairs(L, k, B) * rng.uniform(0.7, 1.3) for k in BUDGETS] for L in LENGTHS]
    m = ProfiledLatencyModel(LENGTHS, BUDGETS, total, attention, B)
    _check_monotone(m, rng)


def test_monotone_analytic():
    m = analytic()
    _check_monotone(m, random.Random(3))
    # the attention grows with k only while it has blocks to add: a one-block sequence is flat
    assert m.predict([B], 1) == m.predict([B], 64)
    assert m.predict([65536], 64) > 1.5 * m.predict([65536], 8)


def test_extrapolation_follows_shape_and_warns_once(caplog):
    m = synthetic_table()
    caplog.set_level(logging.WARNING, logger="megatron_sparsebalance.balance.latency")
    for n in (32768, 65536, 40000):
        assert m.predict([n], 8) == pytest.approx(truth([n], 8), rel=1e-9)
    warnings = [r for r in caplog.records if "beyond the profiled" in r.getMessage()]
    assert len(warnings) == 2  # one for the dense part, one for the attention part; not per call
    assert "extrapolating" in warnings[0].getMessage()
    # budgets above the profile scale with block pairs
    assert m.predict([16384], 64) == pytest.approx(truth([16384], 64), rel=1e-9)


def test_align_returns_largest_feasible_budget():
    for m in (synthetic_table(candidates=(1, 2, 4, 6, 8, 12, 16, 24, 32, 48)), analytic()):
        rng = random.Random(4)
        for _ in range(100):
            lengths = [rng.randint(512, 40000) for _ in range(rng.randint(1, 3))]
            target = m.predict(lengths, rng.choice(m.candidates)) * rng.uniform(0.9, 1.3)
            k = m.align(lengths, target)
            feasible = [c for c in m.candidates if m.predict(lengths, c) <= target]
            assert k == (max(feasible) if feasible else m.k_min)
        # nothing fits: k_min
        assert m.align([50000], 1e-6) == m.k_min
        # exactly at a candidate's prediction: that candidate fits
        assert m.align([30000], m.predict([30000], m.candidates[3])) >= m.candidates[3]


def test_align_k_min_when_set():
    m = synthetic_table(candidates=(2, 4, 8, 16, 32), k_min=4)
    assert m.align([16384], 0.0) == 4
    assert m.align([16384], m.predict([16384], 2)) == 4  # 2 fits but DST may not go below k_min
    assert m.align([16384], 1e9) == 32


def test_json_round_trip(tmp_path):
    meta = latency_metadata(SHAPE_05B, B, 6, kernel_impl="triton", kernel_version="v1", gpu="NVIDIA H200",
                            pipeline_parallel_size=4)
    for m in (synthetic_table(metadata=meta, candidates=(1, 4, 8, 16)), analytic()):
        m.observe([5000], 8, m.predict([5000], 8) * 1.3)
        path = str(tmp_path / f"{m.kind}.json")
        m.save(path)
        back = LatencyModel.load(path, expect=m.metadata)
        assert type(back) is type(m)
        assert back.candidates == m.candidates and back.k_min == m.k_min
        for lengths, k in (([1000], 1), ([5000, 3000], 8), ([70000], 40)):
            assert back.predict(lengths, k) == pytest.approx(m.predict(lengths, k), rel=1e-12)
        assert back.scale == pytest.approx(m.scale)
        assert json.load(open(path))["type"] == m.kind


def test_metadata_mismatch_is_an_error_unless_forced(tmp_path):
    meta = latency_metadata(SHAPE_05B, B, 6, kernel_impl="triton", kernel_version="v1", gpu="NVIDIA H200")
    path = str(tmp_path / "t.json")
    synthetic_table(metadata=meta).save(path)
    ProfiledLatencyModel.load(path, expect=meta)  # matching: fine
    run = latency_metadata(dict(SHAPE_05B, hidden_size=2048), 256, 6, kernel_impl="triton", kernel_version="v1",
                           gpu="NVIDIA H200")
    with pytest.raises(ValueError) as err:
        ProfiledLatencyModel.load(path, expect=run)
    msg = str(err.value)
    assert "block_size" in msg and "model_shape" in msg and "force" in msg
    assert "gpu" not in msg.split("(")[0]  # only the mismatching keys are named
    forced = ProfiledLatencyModel.load(path, expect=run, force=True)
    assert forced.predict([4096], 8) == pytest.approx(truth([4096], 8))
    with pytest.raises(ValueError, match="kernel_version"):
        ProfiledLatencyModel.load(path, expect={"kernel_version": "v2"})
    with pytest.raises(ValueError, match="not a 'analytic'"):
        AnalyticLatencyModel.load(path)


def test_recomputation_must_match_between_table_and_run(tmp_path):
    """A stage that recomputes runs its forward twice: a table and a run must agree on it, both ways;
    a table saved before the key existed counts as profiled without recomputation."""
    full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    plain = latency_metadata(SHAPE_05B, B, 6, kernel_impl="triton", kernel_version="v1", gpu="NVIDIA H200")
    recomputing = latency_metadata(SHAPE_05B, B, 6, kernel_impl="triton", kernel_version="v1", gpu="NVIDIA H200",
                                   recompute=full)
    assert plain["recompute"] is None and recomputing["recompute"] == full
    paths = {}
    for name, meta in (("plain", plain), ("recomputing", recomputing),
                       ("older", {k: v for k, v in plain.items() if k != "recompute"})):
        paths[name] = str(tmp_path / f"{name}.json")
        synthetic_table(metadata=meta).save(paths[name])
    for table, run in (("plain", plain), ("older", plain), ("recomputing", recomputing)):
        ProfiledLatencyModel.load(paths[table], expect=run)
    for table, run in (("plain", recomputing), ("older", recomputing), ("recomputing", plain)):
        with pytest.raises(ValueError, match="does not match this run in recompute "):
            ProfiledLatencyModel.load(paths[table], expect=run)


def test_calibration_converges_on_drift():
    rng = random.Random(5)
    m = synthetic_table()
    assert m.scale == 1.0
    for drift, steps in ((1.4, 40), (0.75, 40)):  # the GPU gets slower, then faster than profiled
        for _ in range(steps):
            lengths = [rng.randint(1000, 30000) for _ in range(rng.randint(1, 3))]
            k = rng.choice(BUDGETS)
            m.observe(lengths, k, truth(lengths, k) * drift * rng.uniform(0.97, 1.03))
        errs = [abs(m.predict([L], k) - drift * truth([L], k)) / (drift * truth([L], k))
                for L in (3000, 9000, 20000) for k in (4, 16)]
        assert max(errs) < 0.03, (drift, errs)
    # one stray measurement (10x) moves the scale by at most 2**alpha
    before = m.scale
    m.observe([8000], 8, truth([8000], 8) * 10)
    assert m.scale <= before * 2 ** m.calibration_alpha + 1e-12
    _check_monotone(m, rng, trials=20)  # calibration keeps monotonicity


def test_predict_cost_under_50us():
    rng = random.Random(6)
    packs = [[rng.randint(1000, 64000) for _ in range(rng.randint(1, 8))] for _ in range(200)]
    ks = [rng.choice((4, 12, 32)) for _ in packs]
    for m in (synthetic_table(), analytic()):
        m.predict([70000], 8)  # the one-off extrapolation warning is not a per-call cost
        rounds = []
        for _ in range(5):  # best round: the cost of the code, not of a busy CI host's scheduler
            t0 = time.perf_counter()
            for lengths, k in zip(packs, ks):
                m.predict(lengths, k)
            rounds.append((time.perf_counter() - t0) / len(packs) * 1e6)
        assert min(rounds) <= 50.0, f"{m.kind}: {min(rounds):.1f} us per predict"


def test_analytic_attention_flops_are_sparse_aware():
    m = analytic()
    # a pack of 8 x 8K costs 8 sequences' blocks, not (64K)^2
    assert m.attention_flops([8192] * 8, 32) == pytest.approx(8 * m.attention_flops([8192], 32))
    assert m.attention_flops([65536], 32) > 7 * m.attention_flops([8192], 32)
    per_pair = 14 * B * B * 64 * 14 * 6
    assert m.attention_flops([4 * B], 64) == pytest.approx(per_pair * 10)


def _load_tool():
    path = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "profile_latency.py")
    spec = importlib.util.spec_from_file_location("profile_latency", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def own_process_group():
    """The tool initialises torch.distributed (Megatron needs its groups); undo it afterwards
    unless something else had set it up, so later tests find the state they expect."""
    import torch.distributed as dist

    from megatron_sparsebalance.training.dist import destroy_distributed

    was = dist.is_initialized()
    yield
    if not was:
        destroy_distributed()


def test_cpu_profile_round_trip(tmp_path, capsys, own_process_group):
    tool = _load_tool()
    out = str(tmp_path / "tiny.json")
    model = tool.main(["--model", "tiny", "--layers-per-stage", "2", "--moba-block-size", "64",
                       "--lengths", "128", "384", "--budgets", "1", "4", "--warmup", "1", "--iters", "1",
                       "--min-time-s", "0", "--out", out])
    printed = capsys.readouterr().out
    assert "[  4/4]" in printed and "wrote" in printed  # progress per point
    meta = model.metadata
    assert meta["kernel_impl"] == "torch" and meta["gpu"] == "cpu" and meta["layers_per_stage"] == 2
    assert meta["model_shape"]["hidden_size"] == 128 and meta["block_size"] == 64
    back = ProfiledLatencyModel.load(out, expect=meta)
    d = json.load(open(out))
    assert d["profile"]["timer"] == "wall_clock"
    assert all(v > 0 for row in d["params"]["total_ms"] for v in row)
    for lengths, k in (([128], 1), ([384], 4), ([200, 100], 2), ([1000], 8)):
        p = back.predict(lengths, k)
        assert p > 0 and p == pytest.approx(model.predict(lengths, k))
    assert back.predict([384], 4) >= back.predict([128], 1)
    with pytest.raises(ValueError, match="layers_per_stage"):
        ProfiledLatencyModel.load(out, expect=dict(meta, layers_per_stage=6))


def test_timing_runs_past_iters_until_min_time_and_stops_at_the_cap():
    """Short packs jitter: a point is timed until ``min_time_s`` is measured, never past the cap."""
    import torch

    tool = _load_tool()
    profiler = tool.StageProfiler.__new__(tool.StageProfiler)  # _timed needs only device and min_time_s
    profiler.device = torch.device("cpu")
    calls = []

    def step(seconds):
        calls.append(1)
        time.sleep(seconds)

    for min_time_s, seconds, expect in ((0.0, 0.002, 3), (0.03, 0.002, None), (100.0, 0.0, tool.MAX_TIMED_ITERS)):
        profiler.min_time_s = min_time_s
        calls.clear()
        ms = profiler._timed(lambda: step(seconds), warmup=1, iters=3)
        timed = len(calls) - 1
        if expect is not None:
            assert timed == expect
        else:  # 30 ms at ~2 ms a call: well past the 3 iterations, well under the cap
            assert 8 <= timed < tool.MAX_TIMED_ITERS
        assert ms >= seconds * 1e3


class ScriptedStage:
    """``profile()``'s view of a StageProfiler, with known times: every time of pass ``r`` is the
    truth times ``drift[r]`` (the host's speed at that moment). A pass starts with the fixed-cost
    measurement on a one-block sequence, which is how the script knows which pass it is in."""

    def __init__(self, drift, gpu_bound=()):
        import torch

        self.device, self.block_size, self.layers_per_stage, self.min_time_s = torch.device("cpu"), 64, 2, 0.0
        self.drift, self.pass_index, self.calls = drift, -1, []
        self.gpu_bound, self.last_host_fraction = set(gpu_bound), 1.0

    def _scale(self):
        return self.drift[max(self.pass_index, 0)]

    def measure(self, lengths, k, warmup=2, iters=5):
        self.calls.append((self.pass_index, lengths[0], k))
        self.last_host_fraction = 0.2 if (lengths[0], k) in self.gpu_bound else 0.9
        return (10.0 + lengths[0] / 64 * k) * self._scale()

    def measure_attention(self, lengths, k, warmup=2, iters=5):
        if lengths == [self.block_size]:
            self.pass_index += 1
        return (1.0 + 0.5 * lengths[0] / 64 * k * (lengths != [self.block_size])) * self._scale()

    def metadata(self, pipeline_parallel_size=1, tensor_parallel_size=1):
        return {}


def test_profile_rounds_keep_each_host_bound_points_median_over_passes():
    """Passes over the grid, each host-bound point the median of its passes: one slow or fast
    moment does not enter the table. A GPU-bound point is timed once. The first pass alone is
    kept for comparison, and ``after_pass`` runs after every pass."""
    tool = _load_tool()
    stage = ScriptedStage(drift=[1.3, 1.0, 0.9], gpu_bound={(256, 8)})
    lengths, budgets = [128, 256], [1, 2, 8]
    after = []
    model = tool.profile(stage, lengths, budgets, warmup=1, iters=1, log=lambda *a, **k: None, rounds=3,
                         after_pass=lambda r: after.append((r, len(stage.calls))))
    # two blocks are dense from k=2 on: k=8 of the 128-token row is copied from k=2, not measured
    measured = [(128, 1), (128, 2), (256, 1), (256, 2), (256, 8)]
    timed = [c for c in stage.calls if c[0] >= 0]
    assert timed == [(0, L, k) for L, k in measured] + [(r, L, k) for r in (1, 2) for L, k in measured[:-1]]
    assert after == [(0, 6), (1, 10), (2, 14)]  # the untimed first call, then each pass's points
    for j, L in enumerate(lengths):
        for i, k in enumerate(budgets):
            kk = k if L == 256 else min(k, 2)
            drift = 1.3 if (L, kk) == (256, 8) else 1.0  # the GPU-bound point: its one (first) pass
            assert model.total_ms[j][i] == pytest.approx(drift * (10.0 + L / 64 * kk))  # the median pass
            assert model.attention_ms[j][i] == pytest.approx(drift * 2 * 0.5 * L / 64 * kk)
            first = model.profile_info["first_pass"]
            assert first["total_ms"][j][i] == pytest.approx(1.3 * (10.0 + L / 64 * kk))
    assert model.profile_info["rounds"] == 3 and len(model.profile_info["pass_seconds"]) == 3
    assert model.profile_info["host_bound_points"] == 4
    with pytest.raises(ValueError, match="rounds"):
        tool.profile(ScriptedStage([1.0]), lengths, budgets, rounds=0)


def test_heldout_rounds_repeat_host_bound_batches_and_stop_when_out_of_time():
    from benchmarks.latency_model import HeldoutRounds

    calls, clock = [], {"t": 0}

    def measure_once(n, lengths, k):
        calls.append(n)
        clock["t"] += 1
        if n == 2:
            return None  # out of memory
        return 10.0 * n + len(calls), (0.3 if n == 4 else 0.9)  # batch 4 is GPU-bound

    batches = [([100], 1), ([200], 1), ([300], 2), ([40000], 8)]
    rounds = HeldoutRounds(batches, measure_once, out_of_time=lambda: clock["t"] >= 7, host_bound=0.5)
    for r in range(4):
        rounds.run(r)
    # round 1: all four; round 2: the host-bound 1 and 3; round 3: out of time after batch 1
    assert calls == [1, 2, 3, 4, 1, 3, 1]
    assert rounds.results() == [[11.0, 15.0, 17.0], None, [33.0, 36.0], [44.0]]
    assert rounds.stopped


def test_evaluate_scores_the_median_of_rounds_and_the_first_pass_alone():
    """The median of a micro-batch's rounds is scored against the table of medians, and the first
    round against the first pass's table: a host at 1.2x in the first pass and round is exact in
    both comparisons, and off by 20% if the two were crossed."""
    from benchmarks.latency_model import evaluate

    table = synthetic_table()
    fast = ProfiledLatencyModel(LENGTHS, BUDGETS, [[1.2 * v for v in row] for row in table.total_ms],
                                [[1.2 * v for v in row] for row in table.attention_ms], B)
    batches = [([L], k) for L in LENGTHS for k in BUDGETS]
    records, result = evaluate(table, analytic(), batches,
                               lambda n, lengths, k: [1.2 * truth(lengths, k), truth(lengths, k), 0.9 * truth(lengths, k)],
                               first_pass=fast)
    assert len(records) == len(batches)
    assert all(r["measured_ms"] == pytest.approx(truth(r["lengths"], r["k"])) for r in records)
    assert all(len(r["measured_rounds_ms"]) == 3 for r in records)
    assert result["models"]["profiled"]["max_rel_err"] < 1e-9
    assert result["models"]["profiled_first_pass"]["max_rel_err"] < 1e-9
    # a single measurement (a GPU-bound micro-batch: one round) is its own first round
    _, plain = evaluate(table, analytic(), batches, lambda n, lengths, k: truth(lengths, k), first_pass=fast)
    assert plain["models"]["profiled"]["max_rel_err"] < 1e-9
    assert plain["models"]["profiled_first_pass"]["median_rel_err"] == pytest.approx(0.2)
    _, no_first = evaluate(table, analytic(), batches, lambda n, lengths, k: truth(lengths, k))
    assert "profiled_first_pass" not in no_first["models"]


def test_cuda_kernel_version_follows_the_compiled_sources(tmp_path, monkeypatch):
    """The CUDA implementation's version hashes the .cu/.cuh sources compiled into ``_C``, not
    only its Python launcher: a kernel edit must invalidate tables profiled with the old kernel."""
    from megatron_sparsebalance.balance import latency

    sources = latency.kernel_sources("cuda")
    assert any(p.endswith(os.path.join("csrc", "cuda", "attention_kernels.cuh")) for p in sources)
    launcher, kernel = tmp_path / "launcher.py", tmp_path / "kernels.cuh"
    launcher.write_text("def launch(): pass\n")
    kernel.write_text("__global__ void k() {}\n")
    monkeypatch.setattr(latency, "kernel_sources", lambda impl: [str(launcher), str(kernel)])
    before = latency.kernel_version_of("cuda")
    kernel.write_text("__global__ void k() { /* faster */ }\n")
    assert latency.kernel_version_of("cuda") != before


def test_profiler_takes_selective_recomputation_as_pretrain_does():
    """A table for a run with --recompute-granularity selective --recompute-modules mlp must be
    profiled with the same settings: the profiler takes pretrain's flags and refuses what pretrain does."""
    tool = _load_tool()
    base = ["--model", "tiny", "--layers-per-stage", "2", "--out", "t.json", "--recompute-granularity", "selective"]
    args = tool.parse_args(base + ["--recompute-modules", "mlp"])
    assert args.recompute.recompute_modules == ("mlp",)
    assert args.recompute.transformer_config_kwargs()["recompute_modules"] == ["mlp"]
    with pytest.raises(SystemExit):
        tool.parse_args(base + ["--recompute-modules", "layernorm"])
    with pytest.raises(SystemExit):
        tool.parse_args(["--model", "tiny", "--out", "t.json", "--layers-per-stage", "2", "--recompute-modules", "mlp"])
