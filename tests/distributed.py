"""Run test bodies in real processes over gloo, with a timeout so a deadlock fails instead of hanging:
one body per launch, several named bodies in one shared launch, and a module's shared launch built
once per pytest run however many xdist workers reach it."""
from __future__ import annotations

import fcntl
import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from megatron_sparsebalance.training.ports import free_port


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


# --- several test bodies in one launch --------------------------------------------------------
# Starting gloo processes costs ~5 s per rank on a 2-core CI machine (torch and megatron-core
# imports), more than most test bodies: tests of one layout share a launch (a module-scoped
# fixture) and each test then checks that its own body passed on every rank.


def _cases_in_order(cases, done_dir):
    """Each ``(name, fn, args)`` in turn; a body that passed leaves a marker per rank. The first
    failure ends the launch (the other ranks may be waiting in a collective of that body)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for name, fn, args in cases:
        try:
            fn(*args)
        except Exception as e:
            raise AssertionError(f"case {name!r} failed") from e
        open(os.path.join(done_dir, f"{name}.rank{rank}"), "w").close()


class SharedLaunch:
    """The outcome of one launch of several named test bodies (see :func:`launch_cases`)."""

    def __init__(self, world: int, done_dir: str, failure: str | None):
        self.world, self.done_dir, self.failure = world, done_dir, failure

    def check(self, name: str) -> None:
        """Fail unless body ``name`` ran to its end on every rank; the launch's errors say why."""
        missing = [r for r in range(self.world) if not os.path.exists(os.path.join(self.done_dir, f"{name}.rank{r}"))]
        if missing:
            raise AssertionError(f"case {name!r} did not pass on ranks {missing}:\n{self.failure or '(no error reported)'}")


def launch_cases(cases, world: int, done_dir: str, pp: int = 1, tp: int = 1, timeout_s: float = 300.0) -> SharedLaunch:
    """Run every ``(name, fn, args)`` of ``cases`` in order in one launch of ``world`` ranks.
    Never raises: each test calls ``.check(name)`` on the result for its own body."""
    os.makedirs(done_dir, exist_ok=True)
    failure = None
    try:
        run_workers(_cases_in_order, world, pp=pp, tp=tp, args=(cases, done_dir), timeout_s=timeout_s)
    except AssertionError as e:
        failure = str(e)
    return SharedLaunch(world, done_dir, failure)


def relayout(tp: int, pp: int) -> None:
    """Rebuild megatron's model-parallel groups at another TP x PP in the same processes (one
    launch serves several layouts)."""
    from megatron.core import parallel_state

    from megatron_sparsebalance.training.dist import init_distributed

    parallel_state.destroy_model_parallel()
    init_distributed(tensor_parallel_size=tp, pipeline_parallel_size=pp, backend="gloo")


def once_per_run(tmp_path_factory, name: str, build):
    """``build(root)`` once per pytest run, its (picklable) result shared by every xdist worker.

    ``make test`` runs two workers that hand out tests one by one, so both may reach the tests of
    one module: the first to need a shared launch runs it, the other waits for it and reads the
    result (pytest-xdist's own grouping of tests by mark does not work on pytest 9)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # an xdist worker's temporary folder lies in the run's, which both share
    result = base / f"once-{name}.pkl"
    with open(base / f"once-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if result.exists():
                with open(result, "rb") as f:
                    return pickle.load(f)
            # a folder per build: a build that failed leaves the other worker a clean start
            value = build(Path(tempfile.mkdtemp(prefix=f"once-{name}-", dir=base)))
            with open(result, "wb") as f:
                pickle.dump(value, f)
            return value
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
