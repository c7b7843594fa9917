"""Tensor and sequence parallelism over real gloo processes (bodies in tests/tp_cases.py).

One TP=1 unpipelined reference, then two launches: TP=2 (world 2: with and without sequence
parallelism, the latency profiler on the TP group, the standalone entry's pretrain) and world 4
(TP=2 x PP=2 with SP: equality, stop + resume bitwise, checkpoint to TP=1 x PP=4 and back; TP=4,
where megatron-core replicates each KV group on two ranks; TP=2 x DP=2). Every TP run uses DST
with the coverage bound and checks that all TP ranks of a stage used the same budget in every
layer, and the same as the TP=1 run. Then single-process checks of the pieces.
"""
import json
import os

import pytest

from megatron_sparsebalance.balance.latency import ProfiledLatencyModel
from tests import tp_cases
from tests.distributed import once_per_run, run_workers


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return once_per_run(tmp_path_factory, "tp-reference", launch_reference)


def launch_reference(root):
    root = str(root)
    run_workers(tp_cases.reference, world=1, args=(root, 7))
    return root


def test_tp2_with_and_without_sequence_parallel_equals_tp1_profiles_and_trains(reference, tmp_path):
    """TP=2 (world 2): equality with and without SP; the profiler on the TP group (its table's
    layout); the standalone entry's ``pretrain`` at TP=2 with SP, DST, SAB and validation."""
    from tests.pretrain_cases import TINY

    table, log_dir = str(tmp_path / "tp2_sp.json"), str(tmp_path / "run")
    argv = [*TINY, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--dst-anchor", "mean", "--dst-p", "0.1",
            "--batching", "sab", "--train-iters", "6", "--log-dir", log_dir, "--eval-interval", "6", "--eval-iters", "1"]
    run_workers(tp_cases.equality_cases, world=2, tp=2, args=(reference, 7, table, argv))
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
    with open(os.path.join(log_dir, "eval.jsonl")) as f:  # validation at TP=2: the vocabulary-parallel argmax
        (row,) = [json.loads(line) for line in f]
    assert row["iteration"] == 6 and 0 < row["loss"] < losses[0] and 0.0 <= row["token_acc"] <= 1.0, row
    meta = json.load(open(table))["metadata"]
    assert meta["parallel_layout"] == {"tp": 2, "pp": 1, "cp": 1, "sequence_parallel": True}
    run = dict(meta, parallel_layout={"tp": 2, "pp": 1, "cp": 1, "sequence_parallel": True})
    ProfiledLatencyModel.load(table, expect=run)
    for other in ({"tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False},
                  {"tp": 2, "pp": 1, "cp": 1, "sequence_parallel": False}):
        with pytest.raises(ValueError, match="parallel_layout"):
            ProfiledLatencyModel.load(table, expect=dict(meta, parallel_layout=other))


def test_tp2_pp2_trains_resumes_bitwise_and_reshards_to_tp1_pp4_and_back_then_tp4(reference):
    run_workers(tp_cases.world4_cases, world=4, tp=2, pp=2, args=(reference, 7), timeout_s=400)


def test_vocabulary_parallel_argmax_matches_the_whole_vocabulary():
    import torch

    from megatron_sparsebalance.training.evaluate import combine_vocab_parallel_argmax

    gen = torch.Generator().manual_seed(0)
    for tp in (2, 4):
        logits = torch.randint(0, 5, (7, 3, 8 * tp), generator=gen).float()  # many ties
        shards = logits.chunk(tp, dim=-1)
        best = torch.stack([s.max(-1).values for s in shards])
        index = torch.stack([s.max(-1).indices + r * 8 for r, s in enumerate(shards)]).float()
        assert torch.equal(combine_vocab_parallel_argmax(best, index), logits.argmax(-1))


# --- single-process checks of the pieces ---------------------------------------------------------

def test_layouts_that_cannot_work_are_refused_by_name_before_any_process_group():
    from megatron_sparsebalance.config import build_parser, config_from_args

    parser = build_parser()

    def validate(*flags, world):
        config_from_args(parser.parse_args(["--model", "tiny", "--mock-data", *flags])).validate(world)

    validate("--tensor-model-parallel-size", "2", "--sequence-parallel", world=2)
    validate("--tensor-model-parallel-size", "4", "--sequence-parallel", world=4)  # 2 groups replicated on 4 ranks
    # Megatron-LM's rule: with TP = 1, --sequence-parallel is turned off (with a warning), not refused.
    cfg = config_from_args(parser.parse_args(["--model", "tiny", "--mock-data", "--sequence-parallel"]))
    assert not cfg.validate(1).sequence_parallel
    for flags, world, match in (
            (["--tensor-model-parallel-size", "8"], 8,
             r"--tensor-model-parallel-size \(8\) must divide --num-attention-heads \(4\)"),
            (["--tensor-model-parallel-size", "3"], 3, "must divide --num-attention-heads"),
            (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6, "not divisible")):
        with pytest.raises(ValueError, match=match):
            validate(*flags, world=world)


def test_tensor_parallel_rules_of_the_shape():
    from dataclasses import replace

    from megatron_sparsebalance.training.model import MODEL_PRESETS
    from megatron_sparsebalance.training.tensor_parallel import validate_tensor_parallel

    qwen3b = MODEL_PRESETS["qwen2.5-3b"]  # 16 heads, 2 KV groups
    for tp in (1, 2, 4, 8):
        validate_tensor_parallel(qwen3b, tp, sequence_parallel=tp > 1)
    for shape, tp, match in ((replace(qwen3b, num_query_groups=4), 8, None),
                             (replace(qwen3b, num_query_groups=6, num_attention_heads=24), 4,
                              "must divide --num-query-groups"),
                             (replace(qwen3b, num_query_groups=3, num_attention_heads=24), 4, "multiple of it"),
                             (replace(qwen3b, num_query_groups=4), 3, "--num-attention-heads"),
                             (replace(qwen3b, ffn_hidden_size=1001), 2, "--ffn-hidden-size"),
                             (replace(qwen3b, vocab_size=151937), 2, "--make-vocab-size-divisible-by")):
        if match is None:
            validate_tensor_parallel(shape, tp, False)
        else:
            with pytest.raises(ValueError, match=match):
                validate_tensor_parallel(shape, tp, False)
    with pytest.raises(ValueError, match="--context-parallel-size"):
        validate_tensor_parallel(qwen3b, 2, True, context_parallel=2)


def test_padding_for_sequence_parallel_is_a_masked_sequence_of_its_own():
    import torch

    from megatron_sparsebalance.data.synthetic import copy_task_batch
    from megatron_sparsebalance.pipeline.schedule import MicroBatchPlan, PipelinePlan
    from megatron_sparsebalance.training.step import pad_for_sequence_parallel

    batch = copy_task_batch([515, 64, 9], 64, torch.Generator().manual_seed(0))  # 588 tokens
    assert pad_for_sequence_parallel(batch, 2) is batch  # already a multiple
    padded = pad_for_sequence_parallel(batch, 4)  # 588 = 4 x 147: also unchanged
    assert padded is batch
    padded = pad_for_sequence_parallel(batch, 5)  # 2 pad tokens
    assert padded.tokens.shape == (1, 590) and padded.lengths == [515, 64, 9, 2]
    assert torch.equal(padded.tokens[:, :588], batch.tokens) and torch.equal(padded.loss_mask[:, :588], batch.loss_mask)
    assert padded.loss_mask[0, 588:].sum() == 0 and padded.position_ids[0, 588:].tolist() == [0, 1]
    assert padded.packed_seq_params().cu_seqlens_q.tolist() == [0, 515, 579, 588, 590]
    plan = PipelinePlan([MicroBatchPlan([515, 64, 9])], hidden_size=8)
    assert plan.activation_shape(0) == (588, 1, 8)
    assert plan.activation_shape(0, 5, sequence_parallel=True) == (118, 1, 8)  # ceil(588 / 5)
    assert plan.activation_shape(0, 5, sequence_parallel=False) == (588, 1, 8)


def test_tables_without_sequence_parallel_recorded_count_as_sp_off(tmp_path):
    from megatron_sparsebalance.balance.latency import AnalyticLatencyModel, LatencyModel, latency_metadata
    from megatron_sparsebalance.training.model import MODEL_PRESETS

    shape = MODEL_PRESETS["tiny"]
    run_sp = latency_metadata(shape, 64, 2, "float32", "torch", "v1", gpu="cpu", tensor_parallel_size=2,
                              sequence_parallel=True)
    older = dict(run_sp, parallel_layout={"tp": 2, "pp": 1, "cp": 1})  # saved before SP was recorded
    path = str(tmp_path / "older.json")
    AnalyticLatencyModel(shape, 2, block_size=64, metadata=older).save(path)
    LatencyModel.load(path, expect=dict(run_sp, parallel_layout={**run_sp["parallel_layout"], "sequence_parallel": False}))
    with pytest.raises(ValueError, match="parallel_layout"):
        LatencyModel.load(path, expect=run_sp)


def test_analytic_model_prices_tensor_parallelism():
    from megatron_sparsebalance.balance.latency import AnalyticLatencyModel
    from megatron_sparsebalance.training.model import MODEL_PRESETS

    shape = MODEL_PRESETS["qwen2.5-3b"]
    one, two = (AnalyticLatencyModel(shape, 18, tensor_parallel_size=tp) for tp in (1, 2))
    sp = AnalyticLatencyModel(shape, 18, tensor_parallel_size=2, sequence_parallel=True)
    linked = AnalyticLatencyModel(shape, 18, tensor_parallel_size=2, sequence_parallel=True, tp_link_gbps=300)
    for lengths in ([65536], [8192] * 8):
        t1, t2, tsp, tlink = (m.predict(lengths, 32) for m in (one, two, sp, linked))
        assert t1 / 2 < t2 < t1  # half the work, not half the fixed costs
        assert tsp < t2  # SP splits the norms' and residuals' traffic
        # four collectives per layer, each moving 2 (tp-1)/tp of [tokens, h] bf16 at 300 GB/s
        comm_ms = 18 * 4 * 1.0 * 2048 * 2 * sum(lengths) / 300e6
        assert tlink - tsp == pytest.approx(comm_ms, rel=1e-6)
        assert two.attention_flops(lengths, 32) == pytest.approx(one.attention_flops(lengths, 32) / 2)
    with pytest.raises(ValueError, match="sequence_parallel needs"):
        AnalyticLatencyModel(shape, 18, sequence_parallel=True)
    back = AnalyticLatencyModel.from_dict(linked.to_dict())
    assert back.predict([65536], 16) == pytest.approx(linked.predict([65536], 16))


def test_simulator_models_tp_and_refuses_a_table_of_another_layout(tmp_path, capsys):
    from megatron_sparsebalance.balance.latency import AnalyticLatencyModel, latency_metadata
    from megatron_sparsebalance.training.model import MODEL_PRESETS
    from tools.simulate_pipeline import main as simulate

    common = ["--model", "qwen2.5-3b", "--pp", "2", "--gpus", "8", "--iters", "1", "--warmup", "1", "--dist", "bimodal"]
    rows = {tp: simulate(common + ["--tp", str(tp), "--sequence-parallel"] * (tp > 1)) for tp in (1, 2)}
    base = {tp: next(r for r in rs if r["config"] == "baseline") for tp, rs in rows.items()}
    assert base[2]["tp"] == 2 and base[2]["sequence_parallel"] and base[2]["dp"] == 2 and base[1]["dp"] == 4
    shape = MODEL_PRESETS["qwen2.5-3b"]
    table = str(tmp_path / "tp1.json")
    AnalyticLatencyModel(shape, 18, metadata=latency_metadata(shape, 128, 18, pipeline_parallel_size=2,
                                                              gpu="x", kernel_version="v")).save(table)
    with pytest.raises(ValueError, match="parallel_layout"):
        simulate(common + ["--tp", "2", "--sequence-parallel", "--latency-table", table])
    with pytest.raises(SystemExit):
        simulate(common + ["--tp", "3"])
    assert "--tensor-model-parallel-size (3) must divide" in capsys.readouterr().err


def test_e2e_tp_runs_are_valid_pretrain_configs_and_rows_follow_the_schema():
    from benchmarks import e2e_tp
    from megatron_sparsebalance.config import build_parser, config_from_args

    parser = build_parser()
    for smoke in (False, True):
        args = e2e_tp.parse_args(["--smoke"] if smoke else [])
        for layout in e2e_tp.LAYOUTS:
            for config in layout.configs:
                cfg = config_from_args(parser.parse_args(e2e_tp.pretrain_flags(args, layout, config)))
                cfg.validate(4)
                assert cfg.parallel.tensor_model_parallel_size == layout.tp
                assert cfg.parallel.sequence_parallel == layout.sequence_parallel
                assert (cfg.recompute.recompute_granularity == "full") == (layout.recompute == "full")
    args = e2e_tp.parse_args(["--tp2pp2-recompute", "mlp"])
    (tp2pp2,) = [lay for lay in e2e_tp.selected_layouts(args) if lay.tp == 2]
    cfg = config_from_args(parser.parse_args(e2e_tp.pretrain_flags(args, tp2pp2, "sab+dst")))
    cfg.validate(4)
    assert tp2pp2.recompute == "selective:mlp" and cfg.recompute.recompute_modules == ("mlp",)
    summary = dict(iter_ms=100.0, imbalance=1.2, bubble=0.3, loss=5.0, layout="x", stage_shares=[])
    rows = [e2e_tp.schema_row(lay, 1, "m", "bimodal", c, dict(summary, iter_ms=ms), [1.0, 2.0])
            for lay, c, ms in ((e2e_tp.LAYOUTS[0], "baseline", 300.0), (e2e_tp.LAYOUTS[1], "baseline", 200.0),
                               (e2e_tp.LAYOUTS[1], "sab+dst", 160.0))]
    e2e_tp.add_layout_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 1.0, 1.25]
    schema = {"model": str, "tp": int, "pp": int, "dp": int, "sequence_parallel": bool, "recompute": str, "dist": str,
              "config": str, "iter_ms": float, "peak_mem_gib": float, "imbalance": float, "bubble": float,
              "speedup": float}
    for r in rows:
        for key, kind in schema.items():
            assert isinstance(r[key], kind), (key, r[key])


TRITON_ROUTER_WITH_TP_HOOKS = """
# The Triton router with RouteSync hooks against the torch router with the same hooks (interpreter on CPU).
import torch
from megatron_sparsebalance.ops import BlockLayout
from megatron_sparsebalance.ops.sparse_attention import RouteSync, _route_torch, _route_triton
torch.manual_seed(0)
lens = [300, 130]
T = sum(lens)
cu = torch.tensor([0, 300, 430], dtype=torch.int32)
lay = BlockLayout.from_cu_seqlens(cu, 64, T)
q, k = torch.randn(T, 2, 64), torch.randn(T, 1, 64)
other = torch.randn(lay.num_blocks, 1, 64)
sync = RouteSync(pooled_query=lambda pq: (pq + other) / 2, curve=lambda c: c * 0.9 + 0.1)
for p in (None, 0.05):
    a = _route_torch(q, k, lay, 2, 4, p, 4, sync)
    b = _route_triton(q, k, lay, 2, 4, p, 4, sync)
    va, vb = a[0].kv_idx >= 0, b[0].kv_idx >= 0
    assert torch.equal(a[0].kv_cnt, b[0].kv_cnt) and torch.equal(a[0].kv_idx[va], b[0].kv_idx[vb])
    assert torch.allclose(a[1], b[1], atol=1e-5), (a[1], b[1])
    assert int(a[2]) == int(b[2])
print("OK")
"""


def test_triton_router_applies_the_tensor_parallel_hooks_as_the_torch_router_does():
    """Under TP the Triton router serves layers with replicated KV groups and bounded budgets: its
    pooled queries and curve go through the same hooks as the torch router's (Triton's interpreter)."""
    pytest.importorskip("triton")
    from tests.checks import run_interpreted

    run_interpreted(TRITON_ROUTER_WITH_TP_HOOKS, timeout_s=300)
