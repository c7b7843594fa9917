"""Run a test body in real processes over gloo, with a timeout so a deadlock fails instead of hanging."""
from __future__ import annotations

import os
import time
import traceback

import torch.multiprocessing as mp

from megatron_sparsebalance.training.dist import free_port


def _worker(rank, world, port, tp, pp, fn, args, errors):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
    from megatron_sparsebalance.training.dist import destroy_distributed, init_distributed

    try:
        enable_cpu_megatron()
        init_distributed(tensor_parallel_size=tp, pipeline_parallel_size=pp, backend="gloo")
        fn(*args)
        destroy_distributed()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def run_workers(fn, world: int, pp: int = 1, tp: int = 1, args=(), timeout_s: float = 180.0) -> None:
    """Run ``fn(*args)`` on ``world`` ranks (TP x PP x DP) and fail on any error or on a hang."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, tp, pp, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if messages:
        raise AssertionError("\n".join(messages))
    if hung:
        raise AssertionError(f"ranks {hung} still running after {timeout_s:.0f} s: deadlock")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with errors: {bad}")
