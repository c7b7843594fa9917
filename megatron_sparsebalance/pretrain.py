"""``python -m megatron_sparsebalance.pretrain``: SparseBalance training on megatron-core.

Launch with torchrun, with Megatron-LM's flag names plus ours::

    torchrun --nproc_per_node 4 -m megatron_sparsebalance.pretrain --model qwen2.5-0.5b \\
        --pipeline-model-parallel-size 4 --micro-batch-size 2 --global-batch-size 16 \\
        --seq-length 65536 --mock-data --mock-length-distribution longtail --bf16 \\
        --moba-block-size 128 --moba-topk 32 --dst-anchor mean --dst-p 0.1 --batching sab \\
        --train-iters 100 --save ckpt --save-interval 50 --tensorboard-dir tb

Per iteration: the sampler draws a global batch, SAB splits it over DP ranks and micro-batches,
DST picks each micro-batch's budget from the latency model, our 1F1B schedule runs it, the
measured times calibrate the latency model and the budgets used feed SAB's estimator. With
``--dp-comm diloco|sparseloco`` replicas step locally and meet every ``--outer-steps-interval``
iterations (``training/outer_sync.py``); the bytes each replica sends are logged either way.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import signal
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_sparsebalance.balance.latency import (
    AnalyticLatencyModel,
    LatencyModel,
    attention_block_pairs,
    latency_metadata,
)
from megatron_sparsebalance.balance.sab import SparsityAwareBatcher
from megatron_sparsebalance.config import SparseBalanceConfig, build_parser, config_from_args
from megatron_sparsebalance.data.datasets import build_dataset
from megatron_sparsebalance.data.sampler import GlobalBatchSampler
from megatron_sparsebalance.ops.implementations import resolve_impl
from megatron_sparsebalance.training.checkpointing import (
    latest_checkpoint,
    load_checkpoint,
    load_rank_file,
    missing_tracker_warning,
    save_checkpoint,
)
from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
from megatron_sparsebalance.training.dist import init_distributed
from megatron_sparsebalance.training.evaluate import Evaluator
from megatron_sparsebalance.training.manual_gc import ManualGC
from megatron_sparsebalance.training.trainer import Trainer

try:
    from torch.utils.tensorboard import SummaryWriter

    HAVE_TENSORBOARD = True
except ImportError:  # optional: only --tensorboard-dir needs it
    HAVE_TENSORBOARD = False


# ---- set-up --------------------------------------------------------------------------------


def attention_impl_name(cfg: SparseBalanceConfig, device: torch.device) -> str:
    """The attention implementation the run's layers resolve to ('dense' without sparse attention)."""
    if not cfg.sparse.sparse_attention:
        return "dense"
    return resolve_impl(cfg.sparse.sparse_attn_impl, device, cfg.sparse.deterministic_mode, cfg.sparse.moba_block_size)


def build_latency_model(cfg: SparseBalanceConfig, device: torch.device) -> LatencyModel:
    """The table of --latency-table (checked against this run) or the analytic model."""
    shape = cfg.model_shape()
    # DST plans every stage with one model, of an average stage: with an uneven pipeline
    # (--decoder-first/last-pipeline-num-layers) online calibration absorbs the difference.
    nl = shape.num_layers // cfg.parallel.pipeline_model_parallel_size
    if cfg.latency.latency_table:
        impl = resolve_impl(cfg.sparse.sparse_attn_impl, device, cfg.sparse.deterministic_mode,
                            cfg.sparse.moba_block_size)
        expect = latency_metadata(shape, cfg.sparse.moba_block_size, nl, "bfloat16" if cfg.training.bf16 else "float32",
                                  kernel_impl=impl, pipeline_parallel_size=cfg.parallel.pipeline_model_parallel_size,
                                  tensor_parallel_size=cfg.parallel.tensor_model_parallel_size,
                                  sequence_parallel=cfg.sequence_parallel,
                                  gpu=None if device.type == "cuda" else "cpu",
                                  recompute=cfg.recompute.transformer_config_kwargs())
        # The plan must be the same on every rank, so all stages plan with one table; which stage
        # it was profiled on is not part of the match.
        for key in ("pre_process", "post_process"):
            expect.pop(key)
        expect["model_shape"] = _shape_as_the_table_records_it(shape, cfg.latency.latency_table)
        model = LatencyModel.load(cfg.latency.latency_table, expect=expect, force=cfg.latency.latency_table_force)
    else:
        hardware = cfg.latency.latency_hardware
        if hardware == "auto":
            hardware = "h200" if device.type == "cuda" else "cpu"
        model = AnalyticLatencyModel(shape, nl, block_size=cfg.sparse.moba_block_size, hardware=hardware,
                                     dtype_bytes=2 if cfg.training.bf16 else 4,
                                     tensor_parallel_size=cfg.parallel.tensor_model_parallel_size)
    # DST's choices: --dst-budgets (else the model's own set), always with k_base among them.
    model.candidates = tuple(sorted(set(cfg.dst.dst_budgets or model.candidates) | {cfg.sparse.moba_topk}))
    model.k_min = max(model.k_min, cfg.dst.dst_k_min)
    return model


def _choose_pipeline_split(cfg: SparseBalanceConfig, shape, latency, lengths, is_logger: bool) -> None:
    """--decoder-pipeline-split auto: set --decoder-first/last-pipeline-num-layers (or, for a last
    stage holding the output layer alone, --pipeline-model-parallel-layout) from the predicted
    stage costs of the data's first global batches (the same on every rank: no communication)."""
    from megatron_sparsebalance.balance.split import run_split

    pp = cfg.parallel.pipeline_model_parallel_size
    if pp < 2:
        return
    choice = run_split(shape, pp, cfg.training.micro_batch_size, cfg.training.global_batch_size, lengths,
                       cfg.sparse.moba_topk, latency, cfg.sparse.moba_block_size,
                       fused_cross_entropy=cfg.megatron_lm.cross_entropy_loss_fusion)
    if choice.layout is not None:  # the output layer and loss alone on the last stage
        cfg.parallel.pipeline_model_parallel_layout = choice.layout
    else:
        cfg.parallel.decoder_first_pipeline_num_layers, cfg.parallel.decoder_last_pipeline_num_layers = choice.first, choice.last
    if is_logger:
        print(f"--decoder-pipeline-split auto: {'/'.join(map(str, choice.split))} layers per stage "
              f"({shlex.join(choice.flags()) or 'even'}), predicted stage ms "
              + " ".join(f"{t:.1f}" for t in choice.stage_ms)
              + f" against the even split's " + " ".join(f"{t:.1f}" for t in choice.even_stage_ms), flush=True)


def _shape_as_the_table_records_it(shape, table_path: str) -> dict:
    """The run's shape in the form of the table's record: tables profiled before ModelShape had its
    later fields (normalization, swiglu, ...) match a shape whose later fields hold their defaults."""
    try:
        with open(table_path) as f:
            recorded = json.load(f).get("metadata", {}).get("model_shape") or {}
    except (OSError, ValueError, AttributeError):
        recorded = {}
    full = dataclasses.asdict(shape)
    return {**shape.record(), **{k: full[k] for k in recorded if k in full}}


def build_batcher(cfg: SparseBalanceConfig, latency, dp: int, micro_batches_per_rank: int) -> SparsityAwareBatcher:
    """SAB (or LBB, Hydraulis, arrival order) for this run: the same in both entries."""
    return SparsityAwareBatcher(cfg.batching.batching, dp, micro_batches_per_rank, latency_model=latency,
                                k_base=cfg.sparse.moba_topk, micro_batch_tokens=cfg.batching.micro_batch_tokens,
                                order=cfg.batching.micro_batch_order,
                                pipeline_stages=cfg.parallel.pipeline_model_parallel_size,
                                variable_micro_batches=cfg.batching.variable_micro_batches,
                                count_objective=cfg.batching.micro_batch_count_objective)


def stage_costs_of(cfg: SparseBalanceConfig, shape, latency):
    """Each stage's cost of a micro-batch from the split (the last with the output layer), for
    DST's critical path and the simulated micro-batch count; None where neither is asked for."""
    if cfg.dst.dst_growth != "critical-path" and cfg.batching.micro_batch_count_objective != "simulated":
        return None
    from megatron_sparsebalance.balance.split import stage_cost_model

    return stage_cost_model(shape, cfg.pipeline_layer_split(shape), cfg.sparse.moba_topk, latency,
                            cfg.sparse.moba_block_size, cfg.data.seq_length,
                            fused_cross_entropy=cfg.megatron_lm.cross_entropy_loss_fusion)


def iteration_flops(cfg: SparseBalanceConfig, micro_batch_lengths, budgets) -> float:
    """FLOPs of one iteration (forward + backward), attention counted by the blocks computed.

    Dense part: 6 x (linear weights per token) x tokens, plus the output layer. Attention: every
    (query block, KV block) pair a sequence computes at the budget its layers used, 4*B^2*d per
    query head forward, times 3 for forward + backward; packs are summed per sequence, never
    as (total tokens)^2.
    """
    s = cfg.model_shape()
    H, d, nq, ng, F = s.hidden_size, s.kv_channels, s.num_attention_heads, s.num_query_groups, s.ffn_hidden_size
    B = cfg.sparse.moba_block_size
    mlp_matrices = 3 if s.swiglu else 2  # gate, up, down / up, down
    linear_per_layer = H * (nq + 2 * ng) * d + nq * d * H + mlp_matrices * H * F
    tokens = sum(sum(mb) for mb in micro_batch_lengths)
    dense = 6 * tokens * (s.num_layers * linear_per_layer + H * s.vocab_size)
    attention = 0.0
    for lengths, k in zip(micro_batch_lengths, budgets):
        k_eff = k if cfg.sparse.sparse_attention else 1 << 30
        attention += sum(attention_block_pairs(L, max(1, round(k_eff)), B) for L in lengths)
    attention *= 3 * 4 * B * B * d * nq * s.num_layers
    return dense + attention


class Metrics:
    """The iteration line, TensorBoard scalars, ``metrics.jsonl`` and the summary the demo prints."""

    def __init__(self, cfg: SparseBalanceConfig, start_iteration: int, is_logger: bool, jsonl_path: str | None = None):
        self.cfg, self.is_logger = cfg, is_logger
        self.start, self.t_start = start_iteration, time.perf_counter()
        self.writer = SummaryWriter(cfg.logging.tensorboard_dir) if (is_logger and cfg.logging.tensorboard_dir) else None
        # A row per iteration, written and flushed as it is logged: a run killed by a scheduler's
        # time limit keeps every iteration it finished.
        self.jsonl = open(jsonl_path, "a") if jsonl_path else None
        self.history: list = []

    def record(self, iteration, consumed, step, elapsed_ms, lr, flops, skipped_total, nan_total, comm=None, sab_ms=0.0):
        m = step.metrics
        world = dist.get_world_size()
        row = dict(
            iteration=iteration, consumed_samples=consumed, elapsed_ms=elapsed_ms,
            tflops_per_gpu=flops / (elapsed_ms / 1e3) / world / 1e12, lr=lr, loss=step.loss,
            lm_loss=step.extra.get("lm_loss", float("nan")),
            grad_norm=float(step.grad_norm) if step.grad_norm is not None else float("nan"),
            skipped=skipped_total, nan=nan_total,
            **(m.figures(parallel_state.get_pipeline_model_parallel_world_size()) if m else dict(
                imbalance=float("nan"), bubble=float("nan"), predicted_ms=float("nan"), measured_ms=elapsed_ms,
                mean_budget=float("nan"), mean_coverage=float("nan"))),
            dst_ms=step.dst_ms, sab_ms=sab_ms,
            **(comm or {}),
        )
        self.history.append(row)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tflops_per_gpu", "elapsed_ms", "imbalance", "bubble", "mean_budget",
                        "mean_coverage", "predicted_ms", "measured_ms", "dst_ms", "sab_ms"):
                if math.isfinite(row[key]):
                    self.writer.add_scalar(f"train/{key}", row[key], iteration)
            for key in ("bytes_sent", "bytes_sent_total", "dense_fp32_bytes", "dense_bf16_bytes"):
                if key in row:
                    self.writer.add_scalar(f"comm/{key}", row[key], iteration)
            self.writer.flush()
        if self.is_logger and iteration % self.cfg.logging.log_interval == 0:
            done = iteration - self.start
            remaining = (time.perf_counter() - self.t_start) / max(1, done) * (self.cfg.training.train_iters - iteration)
            print(self.line(row, remaining), flush=True)
        return row

    def line(self, r: dict, eta_s: float) -> str:
        """Megatron-LM's iteration line, then SparseBalance's figures."""
        total = self.cfg.training.train_iters
        return (
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {r['iteration']:8d}/{total:8d} |"
            f" consumed samples: {r['consumed_samples']:12d} |"
            f" elapsed time per iteration (ms): {r['elapsed_ms']:.1f} |"
            # Megatron-LM prints the throughput only with --log-throughput.
            + (f" throughput per GPU (TFLOP/s/GPU): {r['tflops_per_gpu']:.3g} |" if self.cfg.logging.log_throughput
               else "") +
            f" learning rate: {r['lr']:.6E} |"
            f" global batch size: {self.cfg.training.global_batch_size:5d} |"
            f" lm loss: {r['loss']:.6E} |"
            f" grad norm: {r['grad_norm']:.3f} |"
            f" number of skipped iterations: {r['skipped']:3d} |"
            f" number of nan iterations: {r['nan']:3d} |"
            f" imbalance: {r['imbalance']:.3f} |"
            f" bubble: {100 * r['bubble']:.1f}% |"
            f" step time predicted/measured (ms): {r['predicted_ms']:.1f}/{r['measured_ms']:.1f} |"
            f" mean budget: {r['mean_budget']:.1f} |"
            f" coverage: {r['mean_coverage']:.3f} |"
            f" SAB/DST planning (ms): {r['sab_ms']:.2f}/{r['dst_ms']:.2f} |"
            + (f" bytes sent (replica, total): {r['bytes_sent_total']:.4g} vs dense fp32/bf16 all-reduce "
               f"{r['dense_fp32_bytes'] * r['iteration']:.4g}/{r['dense_bf16_bytes'] * r['iteration']:.4g} |"
               if "bytes_sent_total" in r else "")
            + f" ETA: {time.strftime('%H:%M:%S', time.gmtime(max(0.0, eta_s)))}"
        )

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


class _Sigterm:
    """Remembers a SIGTERM so the run saves at the end of the current iteration and exits."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


# ---- the run -------------------------------------------------------------------------------


def out_of_memory_advice(cfg: SparseBalanceConfig, shape, iteration: int, lengths) -> str:
    """What ran out of memory, and the flags that lower it: a stage's peak is its in-flight
    micro-batches' activations (1F1B keeps ``PP - stage`` of them), plus the output layer's logits
    on the last stage, and neither is visible from the flags alone."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    layers = cfg.pipeline_layer_split(shape)[stage]
    micro_batches = lengths[parallel_state.get_data_parallel_rank()]
    largest = max((sum(mb) for mb in micro_batches), default=0)
    what = f"{layers} layers" + (" and the output layer" if stage == pp - 1 else "")
    fused_loss = ""
    if stage == pp - 1 and cfg.megatron_lm.cross_entropy_loss_fusion:
        # Measured on 4xH200 at 64K (PP=2, 12 layers and the output layer): the fused loss's
        # compiled kernel asked for fp32 logits and ran out where the unfused loss did not.
        tp = parallel_state.get_tensor_model_parallel_world_size()
        gib = largest * shape.vocab_size / tp * 4 / 2**30
        fused_loss = (f" The fused cross entropy (--cross-entropy-loss-fusion) holds this micro-batch's logits in "
                      f"fp32 ({gib:.1f} GiB): the unfused loss peaks lower (docs/BATCHING.md).")
    return (
        f"pipeline stage {stage} of {pp} ({what}) ran out of GPU memory in iteration {iteration}, with "
        f"micro-batches of up to {largest} tokens and {min(pp - stage, len(micro_batches))} of them in flight "
        f"on this stage. What lowers it: activation recomputation (--recompute-granularity selective "
        f"--recompute-modules mlp, or --recompute-granularity full --recompute-method uniform "
        f"--recompute-num-layers 1); fewer layers on this stage (--decoder-first-pipeline-num-layers, "
        f"--decoder-last-pipeline-num-layers); --tensor-model-parallel-size 2 --sequence-parallel; a shorter "
        f"--seq-length. Where NCCL reported it (a communicator created on its first use at the stage's peak), "
        f"--empty-unused-memory-level 1 releases PyTorch's cache first, at a cost per iteration.{fused_loss}"
    )


def pretrain(cfg: SparseBalanceConfig, on_iteration=None) -> list:
    """Train per ``cfg`` in this process (one rank of a torchrun job); returns the logged rows.

    ``on_iteration(row, step)``, if given, is called on every rank after each iteration with the
    logged row and the trainer's ``StepResult`` (benchmarks read the per-stage timings there).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world)
    if cfg.logging.tensorboard_dir and not HAVE_TENSORBOARD:
        raise ValueError("--tensorboard-dir needs the tensorboard package (pip install tensorboard)")
    enable_cpu_megatron()
    init_distributed(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                     cfg.parallel.distributed_backend, seed=cfg.data.seed,
                     timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rank, dp_rank = dist.get_rank(), parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    shape = cfg.model_shape()
    latency = build_latency_model(cfg, device)
    dataset = build_dataset(cfg.data, shape.vocab_size)
    if cfg.split.decoder_pipeline_split == "auto":
        _choose_pipeline_split(cfg, shape, latency, dataset.lengths, is_logger=rank == 0)
    batcher = build_batcher(cfg, latency, dp, cfg.micro_batches_per_rank(world))
    sampler = GlobalBatchSampler(dataset.lengths, cfg.training.global_batch_size, batcher, seed=cfg.data.seed)
    first_stage_layers, last_stage_layers = cfg.end_stage_layers(shape)
    trainer = Trainer(shape, cfg.sparse, cfg.dst_config(), cfg.optim, max_sequence_length=cfg.data.seq_length,
                      bf16=cfg.training.bf16, latency_model=latency, dp_comm=cfg.dp_comm,
                      first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                      pipeline_layout=cfg.parallel.pipeline_model_parallel_layout,
                      recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel,
                      # A micro-batch count that changes between iterations is exact only with per-token
                      # normalization, so --variable-micro-batches turns it on.
                      calculate_per_token_loss=(cfg.training.calculate_per_token_loss
                                                or cfg.batching.variable_micro_batches),
                      cross_entropy_loss_fusion=cfg.megatron_lm.cross_entropy_loss_fusion,
                      cross_entropy_fusion_impl=cfg.megatron_lm.cross_entropy_fusion_impl,
                      use_transformer_engine=cfg.megatron_lm.transformer_impl == "transformer_engine",
                      empty_unused_memory_level=cfg.training.empty_unused_memory_level)
    stage_costs = stage_costs_of(cfg, shape, latency)
    trainer.stage_costs = stage_costs if cfg.dst.dst_growth == "critical-path" else None
    batcher.stage_costs = stage_costs if cfg.batching.prices_stages() else None
    evaluator = Evaluator(cfg, trainer, batcher) if cfg.eval.enabled else None  # before a resume changes the batcher
    # Bytes are counted per stage; a replica is all its pipeline stages.
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    dense = torch.tensor([trainer.dense_bytes["fp32"], trainer.dense_bytes["bf16"]], dtype=torch.int64, device=device)
    dist.all_reduce(dense, group=pp_group)
    bytes_sent_total = 0

    start = 0
    ck = cfg.checkpoint
    resume = latest_checkpoint(ck.load) if ck.load else None
    if ck.load and resume is None and rank == 0:
        print(f"WARNING: {missing_tracker_warning(ck.load)}", file=sys.stderr, flush=True)
    if resume is not None:
        common = load_checkpoint(resume, trainer.model, trainer.optimizer, optimizer_state=ck.load_optim)
        start = int(common["iteration"])
        if ck.load_optim and "scheduler" in common:
            trainer.scheduler.load_state_dict(common["scheduler"])
        if "sampler" in common:
            sampler.load_state_dict(common["sampler"])
        if "latency" in common:
            latency.load_calibration(common["latency"])
        if "dst_floor" in common and trainer.coverage_floor is not None:
            trainer.coverage_floor.load_state_dict(common["dst_floor"])
        bytes_sent_total = common.get("bytes_sent_total", 0)
        if rank == 0:
            print(f"resumed from {resume} at iteration {start}", flush=True)
    elif ck.pretrained_checkpoint:
        path = latest_checkpoint(ck.pretrained_checkpoint)
        if path is None:
            raise ValueError(f"--pretrained-checkpoint {ck.pretrained_checkpoint}: no complete checkpoint there")
        load_checkpoint(path, trainer.model, trainer.optimizer, optimizer_state=False)
        if rank == 0:
            print(f"initialized weights from {path}", flush=True)
    if trainer.outer is not None:
        trainer.outer.snapshot()  # the loaded weights are the global ones ...
        outer_state = load_rank_file(resume, "dp_comm") if resume is not None and ck.load_optim else None
        if outer_state is not None:  # ... unless this replica's own state was saved
            trainer.outer.load_state_dict(outer_state)

    log_dir = cfg.logging.log_dir or ck.save or cfg.logging.tensorboard_dir
    if rank == 0:
        for warning in cfg.warnings():
            print(f"WARNING: {warning}", file=sys.stderr, flush=True)
    if rank == 0 and log_dir:
        cfg.write_json(os.path.join(log_dir, "config.json"))
    if rank == 0:
        print(f"megatron-sparsebalance: {shape.num_layers} layers over PP={cfg.parallel.pipeline_model_parallel_size} "
              f"({'/'.join(map(str, cfg.pipeline_layer_split(shape)))} per stage) "
              f"DP={dp}, {cfg.micro_batches_per_rank(world)} micro-batches per rank, attention "
              f"{attention_impl_name(cfg, device)}, "
              f"DST {cfg.dst.dst_anchor} (p={cfg.dst.dst_p}, growth {cfg.dst.dst_growth}), batching {cfg.batching.batching}, "
              f"latency model {type(latency).__name__}", flush=True)

    metrics = Metrics(cfg, start, is_logger=rank == dist.get_world_size() - 1,
                      jsonl_path=os.path.join(log_dir, "metrics.jsonl") if rank == 0 and log_dir else None)
    if evaluator is not None:
        evaluator.log_to(log_dir, metrics.writer, metrics.is_logger)
    sigterm = _Sigterm()
    skipped = nan_iters = in_a_row = 0
    last_saved = start if resume is not None else None

    def save(iteration):
        nonlocal last_saved
        save_checkpoint(ck.save, iteration, trainer.model, trainer.optimizer, common={
            "config": cfg.to_dict(), "model_shape": dataclasses.asdict(shape),
            "scheduler": trainer.scheduler.state_dict(), "sampler": sampler.state_dict(),
            "latency": latency.calibration_state(), "bytes_sent_total": bytes_sent_total,
            **({"dst_floor": trainer.coverage_floor.state_dict()} if trainer.coverage_floor is not None else {}),
        }, rank_files={"dp_comm": trainer.outer.state_dict()} if trainer.outer is not None else None)
        last_saved = iteration

    timeline_iters = set(cfg.logging.timeline_iters or ())
    with ManualGC(cfg.training.manual_gc, cfg.training.manual_gc_interval) as manual_gc:
        for iteration in range(start + 1, cfg.training.train_iters + 1):
            manual_gc.between_iterations(iteration)
            t0 = time.perf_counter()
            plan = sampler.next_plan()
            sab_ms = (time.perf_counter() - t0) * 1e3
            lengths = plan.rank_micro_batch_lengths()  # per rank: counts differ under --variable-micro-batches
            try:
                step = trainer.train_step(lengths, sampler.micro_batches(dataset, plan, dp_rank))
            except (torch.OutOfMemoryError, dist.DistBackendError) as exc:
                if isinstance(exc, dist.DistBackendError) and "out of memory" not in str(exc):
                    raise
                raise torch.OutOfMemoryError(out_of_memory_advice(cfg, shape, iteration, lengths)) from exc
            elapsed_ms = (time.perf_counter() - t0) * 1e3
            m = step.metrics
            if m is not None and cfg.sparse.sparse_attention:  # dense layers report no budgets for SAB's estimator
                per_rank = plan.split_by_rank(m.budgets)
                sampler.update(plan, per_rank)
            if step.skipped:
                skipped += 1
                in_a_row += 1
                nan_iters += 0 if math.isfinite(step.loss) else 1
            else:
                in_a_row = 0
            flops = iteration_flops(cfg, [mb for rank_mbs in lengths for mb in rank_mbs], m.budgets if m else
                                    [cfg.sparse.moba_topk] * sum(len(r) for r in lengths))
            sent = torch.tensor([step.extra["comm"]["bytes_sent"]], dtype=torch.int64, device=device)
            dist.all_reduce(sent, group=pp_group)
            bytes_sent_total += int(sent)
            comm = dict(bytes_sent=int(sent), bytes_sent_total=bytes_sent_total, dense_fp32_bytes=int(dense[0]),
                        dense_bf16_bytes=int(dense[1]))
            metrics.record(iteration, sampler.consumed_samples, step, elapsed_ms, trainer.optimizer.param_groups[0]["lr"],
                           flops, skipped, nan_iters, comm=comm, sab_ms=sab_ms)
            if on_iteration is not None:
                on_iteration(metrics.history[-1], step)
            if iteration in timeline_iters and m is not None and rank == 0 and log_dir:
                m.write_trace(os.path.join(log_dir, f"timeline_iter{iteration:07d}.json"))
            if evaluator is not None:
                evaluator.after_iteration(iteration, sampler.consumed_samples)
            if in_a_row >= cfg.training.max_nonfinite_iters:
                raise RuntimeError(f"{in_a_row} iterations in a row had a non-finite loss or gradient "
                                   f"(--max-nonfinite-iters {cfg.training.max_nonfinite_iters}); stopping")
            stop = sigterm.any_rank(device)
            exit_now = stop or (ck.exit_interval is not None and iteration % ck.exit_interval == 0)
            if ck.save and (exit_now or (ck.save_interval and iteration % ck.save_interval == 0)):
                save(iteration)
            if exit_now:
                if rank == 0:
                    print(f"exiting at iteration {iteration} ({'SIGTERM' if stop else '--exit-interval'})", flush=True)
                break
        else:
            if ck.save and last_saved != cfg.training.train_iters and cfg.training.train_iters > start:
                save(cfg.training.train_iters)
    if evaluator is not None:
        evaluator.finish(start, sampler.consumed_samples)
    metrics.close()
    return metrics.history


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as exc:
        # Every rank sees the same flags and fails here, before any process group: nobody hangs.
        # Every rank prints: torchrun stops the others as soon as one exits, so a message left to
        # rank 0 alone could be lost.
        if int(os.environ.get("RANK", "0")) == 0:
            parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        pretrain(cfg)
    except ValueError as exc:
        # Set-up errors (a latency table for another run, overlong samples, ...) happen on every
        # rank alike: each reports and leaves without waiting on anyone.
        print(f"{parser.prog}: error: {exc}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    if dist.is_initialized():
        dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
