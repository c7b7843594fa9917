"""What a finished iteration teaches the balancer, shared by both entries (standalone and
Megatron-LM's loop): the latency model's calibration and DST's coverage floor.

Both read the gathered :class:`IterationMetrics`, which are identical on every rank, so every
rank's latency model and floor stay identical and the next plan needs no communication.
"""
from __future__ import annotations

from typing import Sequence

from megatron_sparsebalance.pipeline.timeline import IterationMetrics


def calibrate_latency(latency_model, micro_batch_lengths: Sequence[Sequence[Sequence[int]]], metrics: IterationMetrics,
                      pipeline_stages: int) -> None:
    """Feed each micro-batch's measured time per stage (``[dp_rank][micro_batch] -> lengths``)."""
    flat = [lengths for rank in micro_batch_lengths for lengths in rank]
    for lengths, used, ms in zip(flat, metrics.budgets, metrics.micro_batch_ms):
        if used > 0:
            latency_model.observe(lengths, max(1, round(used)), ms / pipeline_stages)


def learn_coverage_floor(floor, plans: Sequence, metrics: IterationMetrics, k_base: int) -> None:
    """What the layers' coverage bound kept of each shrink DST asked for (every DP rank's plans)."""
    asked = [mb for plan in plans for mb in plan.micro_batches]
    for mb, used in zip(asked, metrics.budgets):
        if mb.budget < k_base and used > 0:
            floor.observe(mb.lengths, mb.budget, used)
