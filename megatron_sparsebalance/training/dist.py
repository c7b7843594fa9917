"""Process-group set-up shared by the demo, the tests and the pretrain entry point."""
from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_sparsebalance.compat import initialize_model_parallel
from megatron_sparsebalance.training.ports import free_port


def init_distributed(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, backend: str = "auto",
                     seed: int = 1234, timeout_minutes: int = 10) -> None:
    """``init_process_group`` from torchrun's env (or a single local process) plus Megatron's groups.

    ``backend='auto'`` is NCCL when CUDA is available, else gloo. On a GPU this also seeds
    megatron-core's CUDA RNG tracker, which its layers need to initialize their weights.
    ``timeout_minutes`` (``--distributed-timeout-minutes``, Megatron-LM's default 10) bounds every
    collective of the process group.
    """
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            # Not launched by torchrun: a world of one on a port of its own (an inherited
            # MASTER_PORT may belong to the parent's still-open store).
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(free_port())
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    if not parallel_state.model_parallel_is_initialized():
        initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)
    elif (parallel_state.get_tensor_model_parallel_world_size(),
          parallel_state.get_pipeline_model_parallel_world_size()) != (tensor_parallel_size, pipeline_parallel_size):
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_parallel_size} / --pipeline-model-parallel-size "
            f"{pipeline_parallel_size} differ from this process's model-parallel groups "
            f"({parallel_state.get_tensor_model_parallel_world_size()} / "
            f"{parallel_state.get_pipeline_model_parallel_world_size()}): destroy them first")
    # Every call, also when the groups already exist (several runs in one process): a run starts
    # from its seed, so its weights do not depend on the runs before it.
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    """Megatron-LM's meaning of ``--seed``: Python's, NumPy's, torch's and megatron-core's CUDA RNG
    tracker, each stage at ``seed + 100 * pipeline rank`` (Megatron-LM's ``_set_random_seed``), so a
    run starts from the same weights in both entries (standalone and Megatron-LM's loop)."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    # The tracker is megatron-core's per tensor-parallel rank: it exists once the groups do.
    if parallel_state.model_parallel_is_initialized() and (torch.cuda.is_available() or _cpu_rng_shimmed()):
        # On a CPU (under training.cpu_compat) the tracker's states are placeholders, but
        # megatron-core's tensor-parallel regions (the sequence-parallel embedding) fork them.
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def _cpu_rng_shimmed() -> bool:
    from megatron_sparsebalance.training.cpu_compat import cpu_rng_tracker_enabled

    return cpu_rng_tracker_enabled()


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
