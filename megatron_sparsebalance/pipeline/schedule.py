"""SparseBalance's 1F1B pipeline schedule (non-interleaved), driven by a plan.

A drop-in for megatron-core's ``forward_backward_pipelining_without_interleaving``: same
keyword-only signature, same ``forward_step_func`` / ``loss_func`` contract and loss
normalization, plus ``plan``. The plan gives every micro-batch's packed lengths (hence the
activation shapes: no shape exchange between stages) and the budget DST chose for it; the
schedule opens a budget scope around each forward so every sparse attention layer uses that
budget, measures every forward and backward, and leaves the iteration's figures in
``plan.measured``. Device-agnostic: NCCL on GPUs, gloo on CPUs. See ``pipeline/README.md``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron_sparsebalance.attention.budget import budget_scope, read_reports
from megatron_sparsebalance.pipeline.p2p import StageLinks
from megatron_sparsebalance.pipeline.timeline import IterationMetrics, StageClock, StageRecord, gather_iteration_metrics


@dataclass
class MicroBatchPlan:
    lengths: list
    """Sequence lengths packed (THD) in this micro-batch."""
    budget: Optional[int] = None
    """DST's budget (None: every layer's --moba-topk)."""
    predicted_ms: Optional[float] = None
    """The latency model's forward+backward prediction for this stage."""

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))


@dataclass
class PipelinePlan:
    """This DP rank's micro-batches in run order, and how DST bounds their budgets."""

    micro_batches: list
    hidden_size: int
    k_base: Optional[int] = None
    p: Optional[float] = None
    measure: bool = True
    measured: Optional[IterationMetrics] = field(default=None, repr=False)

    def activation_shape(self, i: int, tp_size: int = 1, sequence_parallel: bool = False) -> tuple:
        """``[T, 1, h]`` between stages; ``[ceil(T / tp), 1, h]`` under sequence parallelism, where each
        TP rank holds its share of the pack padded to a multiple of TP (``training.step.pad_for_sequence_parallel``)."""
        tokens = self.micro_batches[i].num_tokens
        if sequence_parallel:
            tokens = -(-tokens // tp_size)
        return (tokens, 1, self.hidden_size)


class _NoTimer:
    """What a timer of Megatron-LM's does where its training loop gave none (our standalone entry)."""

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


_NO_TIMER = _NoTimer()


def _normalized_loss(outputs, config, num_microbatches):
    """megatron-core's loss normalization of a ``loss_func`` result (schedules.forward_step)."""
    if len(outputs) == 3:
        loss, num_tokens, reduced = outputs
        if not config.calculate_per_token_loss:
            loss = loss / torch.clamp(num_tokens, min=1) / num_microbatches
        return loss, num_tokens, reduced
    loss, reduced = outputs
    return loss / num_microbatches, torch.tensor(0, dtype=torch.int), reduced


def forward_backward_sparsebalance(
    *,
    forward_step_func: Callable,
    data_iterator: Union[Iterator, list],
    model: Union[torch.nn.Module, list],
    num_microbatches: int,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    force_all_reduce: bool = False,
    plan: PipelinePlan,
    **unused,
) -> list:
    """Run one global batch's micro-batches through this stage; returns the last stage's loss reports.

    ``seq_length`` and ``micro_batch_size`` are accepted for signature compatibility and not
    used: shapes come from ``plan``. ``force_all_reduce`` (megatron-core's): the gradients are
    all-reduced over DP even where the distributed optimizer reduce-scatters them, so that every
    rank holds them whole (Megatron-LM asks for it in the iterations whose gradients it saves,
    --save-wgrads-interval).
    """
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("the non-interleaved schedule takes one model chunk (virtual pipeline is not supported)")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if len(plan.micro_batches) != num_microbatches:
        raise ValueError(f"plan has {len(plan.micro_batches)} micro-batches, num_microbatches={num_microbatches}")
    if collect_non_loss_data:
        raise ValueError("collect_non_loss_data is not supported by the SparseBalance schedule")
    config = get_model_config(model)
    device = next(model.parameters()).device
    links = StageLinks(config.pipeline_dtype, device)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    shape = lambda i: plan.activation_shape(i, tp, config.sequence_parallel)  # noqa: E731
    set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
    clock = StageClock(device)
    reports, losses = {}, []
    total_tokens = torch.zeros((), dtype=torch.int, device=device)
    # Megatron-LM's timers (config.timers, set by its training loop) under megatron-core's names and
    # log levels: they synchronize the device only at a --timing-log-level that prints them.
    timer = config.timers if config.timers is not None else lambda *args, **kwargs: _NO_TIMER
    timer("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    def micro_batch_scope(i: int):
        mb = plan.micro_batches[i]
        return budget_scope(k=mb.budget, k_base=plan.k_base if mb.budget is not None else None, p=plan.p)

    def run_forward(i: int, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        nonlocal total_tokens
        set_input_tensor(input_tensor)
        timer("forward-compute", log_level=2).start()
        clock.start(i, "F")
        with micro_batch_scope(i) as report:
            output, loss_func = forward_step_func(data_iterator, model)
        if links.last:
            output, num_tokens, reduced = _normalized_loss(loss_func(output), config, num_microbatches)
            total_tokens = total_tokens + num_tokens.to(device)
            losses.append(reduced)
        clock.stop(i, "F")
        timer("forward-compute").stop()
        reports[i] = report  # read after the schedule: reading now would stop the host here
        return output

    def run_backward(i, input_tensor, output_tensor, output_grad):
        timer("backward-compute", log_level=2).start()
        clock.start(i, "B")
        if output_grad is None and config.grad_scale_func is not None:
            output_tensor = config.grad_scale_func(output_tensor)
        # Recomputed layers (--recompute-granularity) run their forward again in here: the same
        # scope makes them route with this micro-batch's budget; their report is dropped.
        with micro_batch_scope(i):
            if config.deallocate_pipeline_outputs:
                custom_backward(output_tensor, output_grad)  # takes a pseudo-freed output (below)
            else:
                torch.autograd.backward(output_tensor, grad_tensors=output_grad)
        clock.stop(i, "B")
        timer("backward-compute").stop()
        return input_tensor.grad if input_tensor is not None else None

    def keep_for_backward(x, y):
        """The stage's input and output of a micro-batch, held until its backward. Once sent, the
        output's values are not needed (its backward starts from the gradient the next stage
        returns), so under the config's deallocate_pipeline_outputs (Megatron-LM always sets it)
        its storage is freed now, as megatron-core's 1F1B frees it: one activation less per
        micro-batch in flight. The last stage's output is the loss, a scalar, kept as it is."""
        inputs.append(x)
        outputs.append(y)
        if not links.last:
            deallocate_output_tensor(y, config.deallocate_pipeline_outputs)

    def recv_forward(i):
        x = links.recv_forward(shape(i))
        if x is not None:
            x.requires_grad_(True)
        return x

    M = num_microbatches
    pp, rank = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
    # Gradients are reduced across data-parallel ranks once per global batch: sync is held off
    # until the last micro-batch's backward, as megatron-core's 1F1B does. Given a grad_sync_func
    # (Megatron-LM's --align-grad-reduce, its default with --overlap-grad-reduce), only the first
    # stage launches its reductions from that backward; the others launch theirs after the
    # cool-down, all at once.
    no_sync = config.no_sync_func if config.no_sync_func is not None else contextlib.nullcontext
    sync_held = contextlib.ExitStack()
    sync_held.enter_context(no_sync())
    launch_in_last_backward = config.grad_sync_func is None or rank == 0
    warmup = M if forward_only else min(pp - rank - 1, M)
    steady = M - warmup
    inputs, outputs = [], []
    f = b = 0
    for _ in range(warmup):
        x = recv_forward(f)
        y = run_forward(f, x)
        links.send_forward(y)
        if not forward_only:
            keep_for_backward(x, y)
        f += 1
    x = recv_forward(f) if steady > 0 else None
    for j in range(steady):
        last_round = j == steady - 1
        y = run_forward(f, x)
        f += 1
        if forward_only:
            links.send_forward(y)
            x = None if last_round else recv_forward(f)
            continue
        out_grad = links.send_forward_recv_backward(y, shape(b))
        keep_for_backward(x, y)
        if b == M - 1 and launch_in_last_backward:
            sync_held.close()
        g = run_backward(b, inputs.pop(0), outputs.pop(0), out_grad)
        if last_round:
            links.send_backward(g)
            x = None
        else:
            x = links.send_backward_recv_forward(g, shape(f))
            if x is not None:
                x.requires_grad_(True)
        b += 1
    if not forward_only:
        while b < M:
            if b == M - 1 and launch_in_last_backward:
                sync_held.close()
            out_grad = links.recv_backward(shape(b))
            g = run_backward(b, inputs.pop(0), outputs.pop(0), out_grad)
            links.send_backward(g)
            b += 1
        if not launch_in_last_backward:
            sync_held.close()
            config.grad_sync_func(model.parameters())
    sync_held.close()

    if not forward_only and config.finalize_model_grads_func is not None:
        # Passed only when asked for: a finalize function of the caller's may not take it.
        extra = {"force_all_reduce": True} if force_all_reduce else {}
        config.finalize_model_grads_func([model], total_tokens if config.calculate_per_token_loss else None, **extra)
    timer("forward-backward").stop()

    if plan.measure:
        budgets, coverage, layers = read_reports(reports)
        record = StageRecord(
            pp_rank=rank, dp_rank=parallel_state.get_data_parallel_rank(), spans=clock.spans(),
            budgets=budgets, coverage=coverage, layers=layers,
            predicted_ms={i: mb.predicted_ms for i, mb in enumerate(plan.micro_batches)},
        )
        plan.measured = gather_iteration_metrics(record, M)
    return losses
