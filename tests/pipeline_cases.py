"""Bodies of the multi-process pipeline tests (importable by spawned workers)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch
from megatron.core import parallel_state

from megatron_sparsebalance.attention import SparseAttentionConfig
from megatron_sparsebalance.data.synthetic import copy_task_batch
from megatron_sparsebalance.pipeline.schedule import MicroBatchPlan, PipelinePlan, forward_backward_sparsebalance
from megatron_sparsebalance.training.step import gpt_forward_step as forward_step, mean_loss
from megatron_sparsebalance.training.model import MODEL_PRESETS, build_gpt_model, transformer_config, with_layers

NUM_LAYERS = 4
# Untied: megatron-core syncs tied embeddings across first and last stage with a .cuda() copy.
SHAPE = replace(with_layers(MODEL_PRESETS["tiny"], NUM_LAYERS), untie_embeddings_and_output_weights=True)
SPARSE = SparseAttentionConfig(moba_block_size=64, moba_topk=2, sparse_attn_impl="torch")


def micro_batches(lengths_per_mb, seed):
    gen = torch.Generator().manual_seed(seed)
    return [copy_task_batch(lengths, 64, gen) for lengths in lengths_per_mb]


def reference(weights_path, out_path, lengths_per_dp, seed):
    """Single process, no pipeline: loss and gradients of every DP rank's micro-batches."""
    torch.manual_seed(seed)
    model = build_gpt_model(SHAPE, SPARSE, transformer_config(SHAPE), max_sequence_length=4096)
    torch.save(model.state_dict(), weights_path)
    results = []
    for d, lengths in enumerate(lengths_per_dp):
        model.zero_grad(set_to_none=True)
        batches = micro_batches(lengths, seed + d)
        total = 0.0
        for batch in batches:
            out, loss_func = forward_step(iter([batch]), model)
            loss, n, _ = loss_func(out)
            scaled = loss / n / len(batches)
            scaled.backward()
            total += float(scaled)
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        results.append({"loss": total, "grads": grads})
    torch.save(results, out_path)


def each_case(fn, cases):
    """``fn(*args)`` for each ``(name, args)`` of ``cases`` in one launch of processes: starting
    the processes takes longer than a small case. A failure names its case."""
    for name, args in cases:
        try:
            fn(*args)
        except Exception as e:
            raise AssertionError(f"case {name!r} failed") from e


class ScheduleRecorder:
    """What the schedule calls of the config, in order: Megatron-LM's ``Timers``
    (``timers(name, log_level=...)``, then ``start(barrier=...)`` / ``stop()``) and, where used as
    such, ``no_sync`` and ``grad_sync`` (DDP's, as Megatron-LM puts them in the config); each call
    recorded as ``(name, log_level, what)``."""

    def __init__(self):
        self.events = []

    @contextlib.contextmanager
    def no_sync(self):
        self.events.append(("no_sync", None, "enter"))
        yield
        self.events.append(("no_sync", None, "exit"))

    def grad_sync(self, params):
        self.events.append(("grad_sync", None, "call"))

    def __call__(self, name, log_level=None):
        events = self.events

        class Timer:
            def start(self, barrier=False):
                events.append((name, log_level, "start"))

            def stop(self, barrier=False):
                events.append((name, log_level, "stop"))

        return Timer()


def stage_key_to_full(key: str, pp_rank: int, pp: int) -> str:
    """Name of a stage model's parameter in the full model (layers are numbered per stage)."""
    if key.startswith("decoder.layers."):
        _, _, idx, rest = key.split(".", 3)
        return f"decoder.layers.{int(idx) + pp_rank * NUM_LAYERS // pp}.{rest}"
    return key


def pipelined(weights_path, ref_path, lengths_per_dp, seed, budget, ddp=False, force_all_reduce=False):
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    cfg = transformer_config(SHAPE, pipeline_parallel_size=pp)
    model = build_gpt_model(SHAPE, SPARSE, cfg, max_sequence_length=4096,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    full = torch.load(weights_path)
    model.load_state_dict({k: full[stage_key_to_full(k, rank, pp)] for k in model.state_dict()})
    if ddp:  # megatron-core's DDP: grads in main_grad, reduced over DP once per global batch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

        # force_all_reduce: the distributed optimizer's layout, whose reduce-scatter leaves each rank
        # its own shard reduced; Megatron-LM asks for an all-reduce in the iterations whose gradients
        # it saves (--save-wgrads-interval), and the schedule must pass that on (ignored, the
        # main_grad checks below fail outside each rank's shard).
        model = DistributedDataParallel(
            cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=force_all_reduce), model)
        cfg.no_sync_func = model.no_sync
        cfg.finalize_model_grads_func = finalize_model_grads
        model.zero_grad_buffer()
    lengths = lengths_per_dp[dp_rank]
    batches = micro_batches(lengths, seed + dp_rank)
    plan = PipelinePlan([MicroBatchPlan(l, budget=budget) for l in lengths], hidden_size=SHAPE.hidden_size)
    sent = []  # each micro-batch's stage output, as the schedule holds it for the backward

    def recorded_forward_step(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        sent.append(output)
        return output, loss_func

    cfg.timers = ScheduleRecorder()
    if not ddp:  # megatron-core's DDP brings its own no_sync; here the order of sync and backward is recorded
        cfg.no_sync_func, cfg.grad_sync_func = cfg.timers.no_sync, cfg.timers.grad_sync
    losses = forward_backward_sparsebalance(
        forward_step_func=recorded_forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=0, micro_batch_size=1, plan=plan, force_all_reduce=force_all_reduce,
    )
    # Megatron-LM's timers, started and stopped in pairs under megatron-core's names and levels.
    n = len(batches)
    assert cfg.timers.events[0] == ("forward-backward", 1, "start") and cfg.timers.events[-1][::2] == ("forward-backward", "stop")
    for name in ("forward-compute", "backward-compute"):
        assert [e for e in cfg.timers.events if e[0] == name] == [(name, 2, "start"), (name, None, "stop")] * n
    if not ddp:  # with a grad_sync_func (Megatron-LM's --align-grad-reduce), megatron-core's order
        last_backward = max(i for i, e in enumerate(cfg.timers.events) if e[0] == "backward-compute")
        released = cfg.timers.events.index(("no_sync", None, "exit"))
        if parallel_state.is_pipeline_first_stage():  # the last backward launches the reductions
            assert released < last_backward and ("grad_sync", None, "call") not in cfg.timers.events
        else:  # the others launch theirs after the cool-down, all at once
            assert cfg.timers.events[released:released + 2] == [("no_sync", None, "exit"), ("grad_sync", None, "call")]
            assert released > last_backward
    # deallocate_pipeline_outputs (transformer_config sets it, as Megatron-LM does): every output a
    # stage sent was freed down to one value, and the gradients below still equal the reference's.
    assert cfg.deallocate_pipeline_outputs and len(sent) == n
    if not parallel_state.is_pipeline_last_stage():
        assert all(y.numel() == 1 for y in sent), [tuple(y.shape) for y in sent]
    refs = torch.load(ref_path)
    ref = refs[dp_rank]
    if parallel_state.is_pipeline_last_stage():
        got = mean_loss(losses)
        assert abs(got - ref["loss"]) < 1e-5 * max(1.0, abs(ref["loss"])), (got, ref["loss"])
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        if ddp:  # the DP average of every rank's reference gradient
            expect = sum(r["grads"][stage_key_to_full(name, rank, pp)] for r in refs) / len(refs)
            grad = p.main_grad
        else:
            expect, grad = ref["grads"][stage_key_to_full(name, rank, pp)], p.grad
        assert torch.allclose(grad, expect, atol=1e-5, rtol=1e-4), (name, (grad - expect).abs().max())
    m = plan.measured
    assert m is not None and len(m.micro_batch_ms) == len(batches) * parallel_state.get_data_parallel_world_size()
    assert all(t > 0 for t in m.micro_batch_ms) and m.imbalance >= 1.0
    assert all(0.0 <= b < 1.0 for b in m.bubble) and len(m.bubble) == pp
    if budget is not None:
        assert all(abs(b - budget) < 1e-9 for b in m.budgets)


# --- the claim on CPU: DST (mean anchor) lowers measured imbalance against the fixed budget ---

CLAIM_K_BASE = 16
CLAIM_MICRO_BATCHES = [[3072], [640, 384], [896], [512, 256, 128]]  # one long straggler


def profile_cpu_stage(path):
    """Profile one middle stage (1 layer) of the claim's model on this CPU: the latency table.

    Three passes, median per point: DST shrinks the straggler until its predicted time meets the
    mean, and one pass on a loaded 2-core machine once priced the 3072-token point at budget 8 low
    enough for that (the straggler then shrank to 8 blocks instead of 4-6, too little for the
    claim)."""
    from tools.profile_latency import main as profile_main

    profile_main(["--model", "tiny", "--layers-per-stage", "1", "--moba-block-size", "64", "--sparse-attn-impl", "torch",
                  "--fp32", "--lengths", "128", "512", "1024", "2048", "3072", "--budgets", "1", "2", "4", "8", "16",
                  "--warmup", "1", "--iters", "3", "--rounds", "3", "--out", path])


def dst_claim(table_path, out_path):
    import json

    from megatron_sparsebalance.balance.dst import DSTConfig
    from megatron_sparsebalance.balance.latency import LatencyModel
    from megatron_sparsebalance.training.step import pipeline_plans

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(0)
    sparse = SparseAttentionConfig(moba_block_size=64, moba_topk=CLAIM_K_BASE, sparse_attn_impl="torch")
    model = build_gpt_model(SHAPE, sparse, transformer_config(SHAPE, pipeline_parallel_size=pp), max_sequence_length=4096,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    latency = LatencyModel.load(table_path)
    results = {}
    for anchor in ("none", "mean", "none", "mean"):  # interleaved, so drift in machine load hits both
        dst = DSTConfig(anchor=anchor, p=None, k_base=CLAIM_K_BASE)
        plan = pipeline_plans([CLAIM_MICRO_BATCHES], SHAPE.hidden_size, dst, latency, pp)[0]
        batches = micro_batches(CLAIM_MICRO_BATCHES, seed=3)
        model.zero_grad(set_to_none=True)
        forward_backward_sparsebalance(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                                       num_microbatches=len(batches), plan=plan)
        results.setdefault(anchor, []).append(dict(imbalance=plan.measured.imbalance, budgets=[m.budget for m in plan.micro_batches],
                                                   micro_batch_ms=plan.measured.micro_batch_ms))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def megatron_oracle(lengths, seed):
    """Our schedule and megatron-core's 1F1B give the same losses and gradients (fixed budget)."""
    from megatron_sparsebalance.pipeline.oracle import compare_with_megatron

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    torch.manual_seed(seed)
    cfg = transformer_config(SHAPE, pipeline_parallel_size=pp)
    cfg.moe_token_dispatcher_type = "alltoall"  # megatron-core refuses variable_seq_lengths otherwise
    model = build_gpt_model(SHAPE, SPARSE, cfg, max_sequence_length=4096,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    diff = compare_with_megatron(model, cfg, micro_batches(lengths, seed), SHAPE.hidden_size, budget=2)
    assert diff["max_loss_diff"] < 1e-6, diff
    assert diff["max_grad_diff"] <= 1e-6 * max(1.0, diff["max_grad"]), diff


def trainer_benchmark(out_dir):
    """benchmarks/pipeline_dst.py end to end on CPU: Trainer (megatron DDP + optimizer), DST, metrics."""
    from benchmarks.pipeline_dst import main

    main(["--pp", "2", "--model", "tiny", "--seq-length", "1024", "--micro-batches", "3", "--iters", "2", "--warmup", "1",
          "--moba-block-size", "64", "--moba-topk", "4", "--sparse-attn-impl", "torch", "--anchors", "none", "mean",
          "--check-megatron", "--out", out_dir])


# --- the balance figures themselves, from spans whose answer is known ---

def metrics_from_known_spans():
    """Two stages x one DP rank, three micro-batches of forward+backward; figures computed by hand.

    Stage 0 computes 2+4, 2+4, 2+4 ms (F+B of mbs 0, 1, 2); stage 1 computes 1+2, 5+10, 1+2 ms.
    Micro-batch times summed over stages: 9, 21, 9 ms, so imbalance = 21 / 13. The iteration ends at
    40 ms; stage 0 is busy 18 ms (bubble 1 - 18/40), stage 1 is busy 21 ms (bubble 1 - 21/40).
    """
    from megatron_sparsebalance.pipeline.timeline import Span, StageRecord, gather_iteration_metrics

    rank = parallel_state.get_pipeline_model_parallel_rank()
    if rank == 0:
        spans = [Span(0, "F", 0, 2), Span(1, "F", 2, 4), Span(2, "F", 4, 6),
                 Span(0, "B", 10, 14), Span(1, "B", 26, 30), Span(2, "B", 34, 38)]
    else:
        spans = [Span(0, "F", 2, 3), Span(0, "B", 3, 5), Span(1, "F", 5, 10),
                 Span(1, "B", 10, 20), Span(2, "F", 20, 21), Span(2, "B", 38, 40)]
    # Stage 0 has three attention layers, stage 1 one: budgets and coverage are means over the
    # four layers (micro-batch 0: (3 * 4 + 8) / 4 = 5), not over the two stages.
    budgets, coverage = ({0: 4.0, 1: 2.0, 2: 4.0}, {0: 1.0, 1: 0.5, 2: 1.0}) if rank == 0 else \
        ({0: 8.0, 1: 2.0, 2: 4.0}, {0: 0.6, 1: 0.5, 2: 1.0})
    record = StageRecord(pp_rank=rank, dp_rank=0, spans=spans, budgets=budgets, coverage=coverage,
                         predicted_ms={0: 3.0 * (rank + 1), 1: 6.0, 2: 3.0},
                         layers={mb: 3 if rank == 0 else 1 for mb in range(3)})
    m = gather_iteration_metrics(record, 3)
    assert m.micro_batch_ms == [9.0, 21.0, 9.0]
    assert abs(m.imbalance - 21.0 / 13.0) < 1e-12
    assert m.iteration_ms == 40.0
    assert [round(b, 12) for b in m.bubble] == [round(1 - 18 / 40, 12), round(1 - 21 / 40, 12)]
    assert m.budgets == [5.0, 2.0, 4.0] and m.coverage == [0.9, 0.5, 1.0]
    assert m.predicted_ms == [9.0, 12.0, 6.0]

    # A last stage with the output layer alone reports no budgets: the figures are stage 0's,
    # not halved by a budget of 0 (which would also mislead DST's coverage floor).
    if rank == 0:
        record = StageRecord(pp_rank=0, dp_rank=0, spans=spans, budgets={0: 4.0, 1: 2.0, 2: 4.0},
                             coverage={0: 1.0, 1: 0.5, 2: 1.0}, predicted_ms={0: 3.0, 1: 6.0, 2: 3.0},
                             layers={0: 3, 1: 3, 2: 3})
    else:
        record = StageRecord(pp_rank=1, dp_rank=0, spans=spans, budgets={}, coverage={},
                             predicted_ms={0: 6.0, 1: 6.0, 2: 3.0})
    m = gather_iteration_metrics(record, 3)
    assert m.budgets == [4.0, 2.0, 4.0] and m.coverage == [1.0, 0.5, 1.0]


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward first sleeps: a backward of known length on CPU."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def figures_from_known_sleeps():
    """The balance figures the schedule measures, on a run whose times are known: PP=2, three
    micro-batches, every forward 100 ms and every backward 200 ms, except stage 1's backward of
    micro-batch 1 (1,000 ms). Micro-batch times summed over both stages are then 600, 1,400 and
    600 ms (imbalance 1,400 / 866.7 = 1.62); in 1F1B the iteration takes 2,000 ms, of which
    stage 0 is busy 900 and stage 1 1,700 (bubbles 0.55 and 0.15). The tiny model's own compute
    adds 20-30 ms to each micro-batch here; the bounds leave room for more on a loaded machine."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    cfg = transformer_config(SHAPE, pipeline_parallel_size=2)
    torch.manual_seed(0)
    model = build_gpt_model(SHAPE, SPARSE, cfg, max_sequence_length=4096,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    lengths = [[64], [64], [64]]
    calls = iter(range(len(lengths)))

    def timed_forward_step(data_iterator, model):
        mb = next(calls)
        time.sleep(0.1)
        output, loss_func = forward_step(data_iterator, model)
        return _SleepInBackward.apply(output, 1.0 if (pp_rank, mb) == (1, 1) else 0.2), loss_func

    plan = PipelinePlan([MicroBatchPlan(l, budget=2) for l in lengths], hidden_size=SHAPE.hidden_size)
    forward_backward_sparsebalance(forward_step_func=timed_forward_step, data_iterator=iter(micro_batches(lengths, 5)),
                                   model=[model], num_microbatches=len(lengths), plan=plan)
    m = plan.measured
    expect = [600.0, 1400.0, 600.0]
    assert all(e <= t < e + 150 for t, e in zip(m.micro_batch_ms, expect)), m.micro_batch_ms
    assert abs(m.imbalance - 1400 / (2600 / 3)) < 0.12, m.imbalance
    assert 2000 <= m.iteration_ms < 2300, m.iteration_ms
    assert abs(m.bubble[0] - 0.55) < 0.06 and abs(m.bubble[1] - 0.15) < 0.06, m.bubble


def groups_kept_across_calls():
    """init_distributed again with the same sizes keeps the groups; other sizes are refused by flag."""
    import pytest

    from megatron_sparsebalance.training.dist import init_distributed

    group = parallel_state.get_pipeline_model_parallel_group()
    init_distributed(tensor_parallel_size=1, pipeline_parallel_size=2, backend="gloo")
    assert parallel_state.get_pipeline_model_parallel_group() is group
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 1 differ"):
        init_distributed(tensor_parallel_size=1, pipeline_parallel_size=1, backend="gloo")
