"""Run test bodies in real processes over gloo, with a timeout so a deadlock fails instead of hanging:
one body per launch, several named bodies in one shared launch, and a module's shared launch built
once per pytest run however many xdist workers reach it."""
from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megatron_sparsebalance.training.ports import free_port


# Ranks are forked from a server that imported torch, megatron-core, the package and the test
# bodies once per pytest process (Python's forkserver): a spawned rank spent 5-9 s of a 2-core
# machine importing them (docs/DESIGN_DECISIONS.md). The server runs no test body and has one
# thread when it forks; what a spawned rank took from this process at its start (environment,
# working directory, stdout and stderr) a forked one takes over in _worker. Where CUDA is
# available the ranks are spawned: a child of a server whose imports touched the driver could not
# use CUDA.
_SERVER_PRELOAD = ["torch", "megatron.core", "megatron_sparsebalance.pretrain",
                   "megatron_sparsebalance.training.trainer", "tests.pipeline_cases", "tests.balance_cases",
                   "tests.convert_cases", "tests.evaluate_cases", "tests.sparseloco_cases", "tests.tp_cases",
                   "tests.pretrain_cases", "tests.megatron_flags_cases"]


def _context():
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_SERVER_PRELOAD)  # read when the server starts, the first launch
    return ctx


def _rank_output(log_dir: str, rank: int, stream: str) -> str:
    return os.path.join(log_dir, f"rank{rank}.{stream}")


def _worker(rank, world, port, tp, pp, fn, args, errors, env, cwd, log_dir):
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    os.chdir(cwd)
    for fd, stream in ((1, "out"), (2, "err")):  # replayed into this test's output by run_workers
        out = os.open(_rank_output(log_dir, rank, stream), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
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
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _replay_output(log_dir: str, world: int) -> None:
    """Each rank's stdout and stderr onto this process's, rank by rank: where a test captures the
    process's output (pytest's capfd), the ranks' is in it, as a spawned rank's was."""
    for fd, stream in ((1, "out"), (2, "err")):
        for rank in range(world):
            path = Path(_rank_output(log_dir, rank, stream))
            data = path.read_bytes() if path.exists() else b""
            while data:
                data = data[os.write(fd, data):]


def run_workers(fn, world: int, pp: int = 1, tp: int = 1, args=(), timeout_s: float = 180.0) -> None:
    """Run ``fn(*args)`` on ``world`` ranks (TP x PP x DP) and fail on any error or on a hang."""
    ctx = _context()
    errors = ctx.SimpleQueue()
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="ranks-")
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_worker, args=(r, world, port, tp, pp, fn, args, errors, env, cwd, log_dir))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    finally:
        _replay_output(log_dir, world)
        shutil.rmtree(log_dir, ignore_errors=True)
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
# A launch still costs each rank its process group and megatron's parallel state, and the bodies
# of one layout often need the same trained start: tests of one layout share a launch (a
# module-scoped fixture) and each test then checks that its own body passed on every rank.


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
