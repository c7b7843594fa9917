"""The training step of one pipeline stage, from megatron-core's parts and our schedule.

``Trainer`` owns the stage's model (megatron-core ``GPTModel`` with sparse core attention,
``Float16Module`` for bf16, megatron-core ``DistributedDataParallel``), megatron-core's
optimizer and LR/WD scheduler, and runs one global batch: DST plans the budgets, our 1F1B
schedule runs the micro-batches, the measured times calibrate the latency model. The pretrain
entry point, the end-to-end benchmarks and the tests all step through it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.balance.dst import CoverageFloor, DSTConfig
from megatron_sparsebalance.balance.feedback import calibrate_latency, learn_coverage_floor
from megatron_sparsebalance.pipeline.schedule import PipelinePlan, forward_backward_sparsebalance
from megatron_sparsebalance.pipeline.timeline import IterationMetrics
from megatron_sparsebalance.training.model import ModelShape, RecomputeSettings, build_gpt_model, transformer_config
from megatron_sparsebalance.training.outer_sync import DPCommConfig, OuterSync, replica_local_ddp_groups, ring_wire_bytes
from megatron_sparsebalance.training.step import gpt_forward_step, mean_loss, pipeline_plans, stage_flags


@dataclass
class OptimSettings:
    """Megatron-LM's optimizer flags (``--lr``, ``--min-lr``, ...)."""

    lr: float = 3e-4
    """Peak learning rate (Adam)."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    lr_warmup_iters: int = 0
    """Linear warm-up iterations."""
    lr_decay_iters: Optional[int] = None
    """Iterations of the decay from --lr to --min-lr (default: --train-iters, as Megatron-LM)."""
    lr_decay_style: str = "cosine"
    """constant, linear, cosine or inverse-square-root."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (megatron-core's distributed optimizer)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduce with the backward pass (megatron-core DDP's
    overlap_grad_reduce: buckets are reduced as their gradients become ready)."""

    def validate(self) -> "OptimSettings":
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr <= --lr and --lr > 0, got --lr {self.lr} --min-lr {self.min_lr}")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(f"--lr-decay-style must be constant, linear, cosine or inverse-square-root, got {self.lr_decay_style!r}")
        return self


# A Trainer built without a run length (benchmarks, tests that step it directly) decays over this
# many iterations when --lr-decay-iters is not given; the pretrain entry resolves it to --train-iters.
LR_DECAY_ITERS_WITHOUT_RUN_LENGTH = 1000


def _decay_iters(optim: OptimSettings) -> int:
    return LR_DECAY_ITERS_WITHOUT_RUN_LENGTH if optim.lr_decay_iters is None else optim.lr_decay_iters


@dataclass
class StepResult:
    loss: float
    grad_norm: Optional[float]
    skipped: bool
    plan: PipelinePlan
    metrics: Optional[IterationMetrics]
    dst_ms: float = 0.0
    extra: dict = field(default_factory=dict)


class Trainer:
    """One pipeline stage of a DP x PP (x TP) job."""

    def __init__(
        self,
        shape: ModelShape,
        sparse: SparseAttentionConfig,
        dst: DSTConfig,
        optim: OptimSettings,
        max_sequence_length: int,
        bf16: bool = False,
        latency_model=None,
        calibrate: bool = True,
        num_layers: Optional[int] = None,
        dp_comm: Optional[DPCommConfig] = None,
        first_stage_layers: Optional[int] = None,
        last_stage_layers: Optional[int] = None,
        pipeline_layout: Optional[str] = None,
        recompute: Optional[RecomputeSettings] = None,
        sequence_parallel: bool = False,
        calculate_per_token_loss: bool = False,
        cross_entropy_loss_fusion: bool = False,
        cross_entropy_fusion_impl: str = "native",
        use_transformer_engine: bool = False,
        empty_unused_memory_level: int = 0,
    ):
        self.empty_unused_memory_level = empty_unused_memory_level
        self.shape, self.sparse, self.dst = shape, sparse.validate(), dst.validate()
        optim.validate()
        self.dp_comm = (dp_comm or DPCommConfig()).validate(optim.use_distributed_optimizer)
        self.latency_model, self.calibrate = latency_model, calibrate
        # What the layers' coverage bound keeps of DST's shrinks, learned from the measured steps.
        self.coverage_floor = CoverageFloor() if dst.anchor != "none" and dst.p is not None else None
        # Every DP rank's plan of the current global batch; only this rank's own grows into bubbles.
        self._plans: list = []
        # Each stage's cost of a micro-batch, for --dst-growth critical-path (set by the entry from
        # the pipeline split: balance/split.py stage_cost_model); None: DST prices stages alike.
        self.stage_costs = None
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.config = transformer_config(shape, pipeline_parallel_size=pp, tensor_parallel_size=tp, bf16=bf16,
                                         num_layers=num_layers, first_stage_layers=first_stage_layers,
                                         last_stage_layers=last_stage_layers, pipeline_layout=pipeline_layout,
                                         recompute=recompute,
                                         sequence_parallel=sequence_parallel,
                                         calculate_per_token_loss=calculate_per_token_loss,
                                         cross_entropy_loss_fusion=cross_entropy_loss_fusion,
                                         cross_entropy_fusion_impl=cross_entropy_fusion_impl)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        model = build_gpt_model(shape, sparse, self.config, max_sequence_length, **stage_flags(),
                                use_transformer_engine=use_transformer_engine).to(device)
        if bf16:
            model = Float16Module(self.config, model)
        # DiLoCo/SparseLoCo replicas must not all-reduce gradients each step. Rather than replace
        # finalize_model_grads (it also all-reduces tied embeddings across pipeline stages), DDP is
        # given data-parallel groups of one rank: its gradient "all-reduce" then stays local, and
        # the replicas meet only in OuterSync, over the real DP group.
        self.model = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=optim.use_distributed_optimizer,
                                          overlap_grad_reduce=optim.overlap_grad_reduce),
            model,
            pg_collection=replica_local_ddp_groups() if self.dp_comm.local_steps else None,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, clip_grad=optim.clip_grad,
                            bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            use_distributed_optimizer=optim.use_distributed_optimizer),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if optim.lr_warmup_iters else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=optim.lr_warmup_iters,
            lr_decay_steps=max(_decay_iters(optim), optim.lr_warmup_iters + 1),
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
        )
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.device = device
        dp = parallel_state.get_data_parallel_world_size()
        self.outer = (OuterSync(self.dp_comm, self.optimizer, parallel_state.get_data_parallel_group())
                      if self.dp_comm.local_steps else None)
        # Bytes this stage sends per iteration under DDP: its fp32 gradient buffers, all-reduced.
        grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size()
                         for b in self.model.buffers + self.model.expert_parallel_buffers)
        self.ddp_step_bytes = ring_wire_bytes("all_reduce", grad_bytes, dp) if self.outer is None else 0
        numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.dense_bytes = {"fp32": ring_wire_bytes("all_reduce", 4 * numel, dp),
                            "bf16": ring_wire_bytes("all_reduce", 2 * numel, dp)}

    def plan(self, micro_batch_lengths: Sequence[Sequence[Sequence[int]]]) -> PipelinePlan:
        """This DP rank's plan for a global batch (``[dp_rank][micro_batch] -> lengths``)."""
        dp_rank = parallel_state.get_data_parallel_rank()
        self._plans = pipeline_plans(micro_batch_lengths, self.shape.hidden_size, self.dst, self.latency_model,
                                     parallel_state.get_pipeline_model_parallel_world_size(), self.coverage_floor,
                                     dp_rank, self.stage_costs)
        return self._plans[dp_rank]

    def train_step(self, micro_batch_lengths, batches, measure: bool = True) -> StepResult:
        """One global batch: plan, 1F1B forward/backward, optimizer step, calibration."""
        import time

        t0 = time.perf_counter()
        plan = self.plan(micro_batch_lengths)
        dst_ms = (time.perf_counter() - t0) * 1e3
        plan.measure = measure
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = forward_backward_sparsebalance(
            forward_step_func=gpt_forward_step, data_iterator=iter([b.to(self.device) for b in batches]),
            model=[self.model], num_microbatches=len(batches), plan=plan,
        )
        loss, lm_loss = self._loss_on_every_rank(reports)
        if self.empty_unused_memory_level >= 1:
            torch.cuda.empty_cache()  # a no-op where CUDA was never initialized
        # A non-finite loss or gradient skips the update (counted by the caller); megatron-core's
        # optimizer only checks for that itself under fp16 loss scaling.
        grad_norm = self.optimizer.get_grad_norm() if math.isfinite(loss) else float("nan")
        if math.isfinite(loss) and math.isfinite(grad_norm):
            ok, grad_norm, _ = self.optimizer.step()
        else:
            ok = False
        if ok:
            self.scheduler.step(increment=1)
        if self.empty_unused_memory_level >= 2:
            torch.cuda.empty_cache()
        if measure and self.calibrate and self.latency_model is not None and plan.measured is not None:
            self._calibrate(micro_batch_lengths, plan.measured)
        if self.coverage_floor is not None and plan.measured is not None:
            self._learn_floor(plan.measured)
        # Skipped inner steps count too: replicas skip on their own gradient norms, and the outer
        # steps must stay aligned across them.
        outer = self.outer.after_inner_step() if self.outer is not None else None
        comm = {"bytes_sent": outer["bytes_sent"] if outer else self.ddp_step_bytes, "outer_step": outer is not None}
        return StepResult(loss, grad_norm, not ok, plan, plan.measured, dst_ms, extra={"comm": comm, "lm_loss": lm_loss})

    def _loss_on_every_rank(self, reports) -> tuple:
        """The last stage's loss known to every rank, two ways: the mean of the micro-batches'
        per-token losses averaged over DP ranks (what the schedule's normalization weights), and
        Megatron-LM's logged ``lm loss`` (loss sum / loss tokens over the global batch)."""
        local = [mean_loss(reports), sum(float(r["loss_sum"]) for r in reports), sum(int(r["tokens"]) for r in reports)]
        value = torch.tensor(local if reports else [0.0, 0.0, 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(value)
        holders = parallel_state.get_data_parallel_world_size() * parallel_state.get_tensor_model_parallel_world_size()
        lm_loss = float(value[1] / value[2]) if value[2] > 0 else float("nan")
        if self.config.calculate_per_token_loss:
            # --calculate-per-token-loss: the schedule weighted every token alike, so the loss it
            # trained on is the global batch's loss sum over its tokens.
            return lm_loss, lm_loss
        return float(value[0]) / holders, lm_loss

    def _learn_floor(self, metrics: IterationMetrics) -> None:
        learn_coverage_floor(self.coverage_floor, self._plans, metrics, self.dst.k_base)

    def _calibrate(self, micro_batch_lengths, metrics: IterationMetrics) -> None:
        calibrate_latency(self.latency_model, micro_batch_lengths, metrics,
                          parallel_state.get_pipeline_model_parallel_world_size())
