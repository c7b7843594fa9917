"""Bodies of the multi-process DiLoCo / SparseLoCo tests (importable by spawned workers)."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_sparsebalance.balance.dst import DSTConfig
from megatron_sparsebalance.training.model import MODEL_PRESETS
from megatron_sparsebalance.training.outer_sync import DPCommConfig, main_params
from megatron_sparsebalance.training.trainer import OptimSettings, Trainer
from tests.pipeline_cases import SHAPE, SPARSE, micro_batches

LENGTHS = [[200, 120], [310]]  # per micro-batch, the same layout on every replica


def _replica_params(trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in main_params(trainer.optimizer)])


def replicas_stay_identical(modes, interval, iters, out_path):
    """Per mode: train ``iters`` steps; record after each whether the DP replicas hold the same weights."""
    results = {mode: _replicas(mode, interval, iters) for mode in modes}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def _replicas(mode, interval, iters):
    torch.manual_seed(7)  # same initial weights on every replica, as in pretrain
    shape = MODEL_PRESETS["tiny"] if parallel_state.get_pipeline_model_parallel_world_size() == 1 else SHAPE
    cfg = DPCommConfig(dp_comm=mode, outer_steps_interval=interval, sparseloco_chunk=16, sparseloco_topk=8)
    trainer = Trainer(shape, SPARSE, DSTConfig(anchor="none", k_base=2), OptimSettings(lr=3e-3, min_lr=3e-4), 4096,
                      dp_comm=cfg)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    group = parallel_state.get_data_parallel_group()
    rows = []
    for it in range(1, iters + 1):
        lengths = [LENGTHS] * dp
        step = trainer.train_step(lengths, micro_batches(LENGTHS, seed=100 * it + dp_rank), measure=False)
        mine = _replica_params(trainer)
        everyone = [torch.empty_like(mine) for _ in range(dp)]
        dist.all_gather(everyone, mine, group=group)
        rows.append({"iteration": it, "outer_step": step.extra["comm"]["outer_step"],
                     "bytes_sent": step.extra["comm"]["bytes_sent"], "loss": step.loss,
                     "identical": all(torch.equal(everyone[0], e) for e in everyone[1:])})
    if trainer.outer is not None:
        rows.append({"payload_bytes": trainer.outer.payload_bytes, "numel": trainer.outer.numel,
                     "dense_fp32": trainer.dense_bytes["fp32"], "replicas": dp})
    return rows
