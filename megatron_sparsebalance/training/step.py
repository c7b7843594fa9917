"""One global batch through the pipeline: the GPT forward step, stage models, DST plans.

Shared by the pretrain loop, the benchmarks and the tests, so each builds a stage and a plan
the same way.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from megatron_sparsebalance.balance.dst import CoverageFloor, DSTConfig, PipelineShape, plan_budgets
from megatron_sparsebalance.data.synthetic import PackedBatch
from megatron_sparsebalance.pipeline.schedule import MicroBatchPlan, PipelinePlan


def gpt_forward_step(data_iterator, model):
    """megatron-core's ``forward_step_func`` for packed GPT micro-batches (``PackedBatch``):
    :func:`gpt_forward` of the iterator's next micro-batch."""
    return gpt_forward(next(data_iterator), model)


def gpt_forward(batch: PackedBatch, model):
    """``model``'s forward of one packed micro-batch, and its loss function.

    The loss function returns ``(sum of masked token losses, number of loss tokens, report)``,
    so the schedule normalizes per token and per micro-batch as megatron-core does.
    """
    config = get_model_config(model)
    if config.sequence_parallel:
        batch = pad_for_sequence_parallel(batch, config.tensor_model_parallel_size)
    output = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                   packed_seq_params=batch.packed_seq_params())

    def loss_func(per_token_loss):
        mask = batch.loss_mask.to(per_token_loss.device)
        loss = (per_token_loss.float() * mask).sum()
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"loss_sum": loss.detach().clone(), "tokens": tokens.detach().clone()}

    return output, loss_func


def pad_for_sequence_parallel(batch: PackedBatch, tp: int) -> PackedBatch:
    """``batch`` with its token count made a multiple of ``tp`` (sequence parallelism splits the
    pack's tokens evenly over the TP ranks).

    The padding is a sequence of its own (``cu_seqlens`` gains an entry) with no loss tokens, as
    Megatron-LM users pad packs: attention is causal within a sequence, so no real token sees a
    pad token, the pad tokens add nothing to the loss or its token count, and the pad sequence's
    single block has no routing candidates, so it is left out of the coverage curve. The loss, the
    gradients and the routing of the real tokens are those of the unpadded pack, exactly. The
    schedule's activation shapes round up the same way (``PipelinePlan.activation_shape``).
    """
    tokens = batch.tokens.shape[-1]
    pad = -tokens % tp
    if pad == 0:
        return batch
    host = batch._host_offsets()
    host_cu = torch.cat([host, host[-1:] + pad])
    device = batch.tokens.device

    def extend(t, fill):
        return torch.cat([t, torch.full((*t.shape[:-1], pad), fill, dtype=t.dtype, device=t.device)], -1)

    cu = host_cu if batch.cu_seqlens.device.type == "cpu" else torch.cat(
        [batch.cu_seqlens, batch.cu_seqlens[-1:] + pad])
    positions = torch.cat([batch.position_ids, torch.arange(pad, device=device, dtype=batch.position_ids.dtype)[None]], -1)
    return PackedBatch(extend(batch.tokens, 0), extend(batch.labels, 0), extend(batch.loss_mask, 0), positions, cu,
                       host_cu_seqlens=host_cu)


def mean_loss(reports: Sequence[dict]) -> float:
    """Per-token loss averaged over micro-batches, as the schedule normalized it."""
    return sum(float(r["loss_sum"]) / max(1, int(r["tokens"])) for r in reports) / max(1, len(reports))


def pipeline_plans(
    micro_batch_lengths: Sequence[Sequence[Sequence[int]]],
    hidden_size: int,
    dst: DSTConfig,
    latency_model=None,
    pipeline_stages: int = 1,
    coverage_floor: Optional[CoverageFloor] = None,
    dp_rank: Optional[int] = None,
    stage_costs=None,
) -> list[PipelinePlan]:
    """Plans of every DP rank for one global batch, computed by every rank from the same inputs (no
    communication): each rank's own plan is the one that rank computes for itself.

    Args:
        micro_batch_lengths: ``[dp_rank][micro_batch] -> sequence lengths``.
        latency_model: needed unless ``dst.anchor == 'none'``; its predictions go into the plan.
        pipeline_stages: stages per DP replica (DST's ``bubble`` growth simulates the pipeline).
        coverage_floor: what the layers' coverage bound is expected to keep of a shrink.
        dp_rank: the rank asking. Only its own replica's micro-batches grow into bubbles (the
            growth that matters to it, whose cost does not grow with DP); the other ranks' plans keep
            their shrinks. Default: every replica's.
        stage_costs: each stage's cost of a micro-batch (``--dst-growth critical-path``;
            ``pipeline/simulate.py: StageCostModel``); None: stages alike.
    """
    flat = [mb for rank in micro_batch_lengths for mb in rank]
    if dst.anchor == "none" and latency_model is None:
        budgets, predicted = [dst.k_base] * len(flat), [None] * len(flat)
    else:
        if latency_model is None:
            raise ValueError(f"--dst-anchor {dst.anchor} needs a latency model (--latency-table or the analytic model)")
        shape = PipelineShape(pipeline_stages, tuple(len(rank) for rank in micro_batch_lengths), stage_costs)
        decision = plan_budgets(flat, latency_model, dst, shape, coverage_floor, dp_rank)
        budgets, predicted = decision.budgets, decision.predicted_ms
    plans, i = [], 0
    for rank in micro_batch_lengths:
        mbs = []
        for lengths in rank:
            mbs.append(MicroBatchPlan(list(lengths), budget=budgets[i], predicted_ms=predicted[i]))
            i += 1
        plans.append(PipelinePlan(mbs, hidden_size=hidden_size, k_base=dst.k_base,
                                  p=dst.p if dst.anchor != "none" else None))
    return plans


def stage_flags() -> dict:
    """``pre_process`` / ``post_process`` of this rank's pipeline stage."""
    return dict(pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage())


def layers_per_stage(num_layers: int, pp: Optional[int] = None) -> int:
    pp = pp or parallel_state.get_pipeline_model_parallel_world_size()
    if num_layers % pp:
        raise ValueError(f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})")
    return num_layers // pp


LAYOUT_FLAG = "--pipeline-model-parallel-layout"


def layout_layer_split(layout: str, num_layers: int, pp: int) -> list[int]:
    """Transformer layers per pipeline stage of Megatron-LM's ``--pipeline-model-parallel-layout``.

    Parsed by megatron-core's own parser (``PipelineParallelLayerLayout.parse_str_to_list``: ``|``
    between stages, ``E`` the embedding, ``t`` a transformer layer, ``L`` the output layer and loss,
    ``x*n`` repeats). Of that grammar this schedule takes one stage per pipeline rank (no virtual
    stages), ``E`` first on the first stage, ``L`` last on the last, no other layer types, and a
    transformer layer on every stage but the last: the last may hold the output layer and loss
    alone (``"Et*8|t*8|t*8|L"``), which ``--decoder-last-pipeline-num-layers`` cannot say.
    """
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    except (AssertionError, ValueError) as e:
        raise ValueError(f"{LAYOUT_FLAG} {layout!r}: {e}") from None
    names = [[t.name for t in stage] for stage in stages]
    if len(names) != pp:
        raise ValueError(f"{LAYOUT_FLAG} {layout!r} has {len(names)} stages; --pipeline-model-parallel-size is {pp} "
                         "(one stage per pipeline rank: virtual pipeline stages are not supported by this 1F1B schedule)")
    other = sorted({n for stage in names for n in stage} - {"embedding", "decoder", "loss"})
    if other:
        raise ValueError(f"{LAYOUT_FLAG} {layout!r}: layer types {other} are not supported (E, t and L only)")
    flat = [n for stage in names for n in stage]
    if flat.count("embedding") != 1 or names[0][:1] != ["embedding"]:
        raise ValueError(f"{LAYOUT_FLAG} {layout!r}: E (the embedding) must open the first stage, once")
    if flat.count("loss") != 1 or names[-1][-1:] != ["loss"]:
        raise ValueError(f"{LAYOUT_FLAG} {layout!r}: L (the output layer and loss) must close the last stage, once")
    split = [stage.count("decoder") for stage in names]
    if sum(split) != num_layers:
        raise ValueError(f"{LAYOUT_FLAG} {layout!r} places {sum(split)} transformer layers; --num-layers is {num_layers}")
    if pp > 1 and min(split[:-1]) < 1:
        raise ValueError(f"{LAYOUT_FLAG} {layout!r}: every stage but the last needs a transformer layer ({split})")
    return split


def layout_of_split(split: Sequence[int]) -> str:
    """The ``--pipeline-model-parallel-layout`` string of a per-stage layer split."""
    stages = [f"t*{n}" if n > 1 else "t" * n for n in split]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


def pipeline_layer_split(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None,
                         account_for_embedding: bool = False, account_for_loss: bool = False) -> list[int]:
    """Transformer layers per pipeline stage, Megatron-LM's rules for uneven pipelines.

    ``account_for_embedding`` / ``account_for_loss`` (``--account-for-embedding-in-pipeline-split``
    / ``--account-for-loss-in-pipeline-split``): the input embedding / the output layer and loss
    count as one layer of the first / last stage; the layers plus those split evenly over the
    stages (Megatron-LM requires that they divide), and the first / last stage gets one
    transformer layer fewer.

    ``first`` / ``last`` (``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers``) fix the end stages; the other stages share the
    remaining layers evenly. The last stage also holds the output layer and the loss, which for
    a 152K vocabulary costs as much as nine to twelve Qwen2.5-0.5B layers at 64K, so giving it fewer layers
    is how a Megatron user balances the stages.
    """
    if account_for_embedding or account_for_loss:
        if first is not None or last is not None:
            raise ValueError("--account-for-embedding/loss-in-pipeline-split and --decoder-first/last-pipeline-num-layers "
                             "both set the stages' layer counts: give one or the other")
        if pp == 1:
            return [num_layers]
        total = num_layers + account_for_embedding + account_for_loss
        if total % pp:
            raise ValueError(f"--num-layers {num_layers} plus {total - num_layers} for the embedding/loss accounted in "
                             f"the pipeline split is {total}, not divisible by --pipeline-model-parallel-size {pp}")
        split = [total // pp] * pp
        split[0] -= account_for_embedding
        split[-1] -= account_for_loss
        if min(split) < 1:
            raise ValueError(f"--account-for-embedding/loss-in-pipeline-split leave a stage without transformer layers "
                             f"({split}): every stage needs at least one here")
        return split
    if first is None and last is None:
        return [layers_per_stage(num_layers, pp)] * pp
    if pp < 2:
        raise ValueError("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
                         f"--pipeline-model-parallel-size >= 2, got {pp}")
    for flag, v in (("first", first), ("last", last)):
        if v is not None and v < 1:
            raise ValueError(f"--decoder-{flag}-pipeline-num-layers must be >= 1, got {v}")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_stages == 0 and middle_layers != 0 or middle_stages > 0 and (
            middle_layers < middle_stages or middle_layers % middle_stages):
        raise ValueError(
            f"--num-layers {num_layers} minus --decoder-first/last-pipeline-num-layers leaves {middle_layers} layers "
            f"for {middle_stages} other stage(s) of --pipeline-model-parallel-size {pp}: they must split evenly, "
            "at least one layer each")
    each = middle_layers // middle_stages if middle_stages else 0
    split = [each] * pp
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return split
