import fcntl
import os
import tempfile

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests need CUDA; say so instead of failing deep inside a kernel."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on the device)")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def gloo_world_of_one():
    """torch.distributed and megatron's parallel state for one CPU process (gloo), per test module."""
    from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
    from megatron_sparsebalance.training.dist import destroy_distributed, init_distributed

    enable_cpu_megatron()
    init_distributed(backend="gloo")
    yield
    destroy_distributed()


@pytest.fixture(scope="module")
def megatron_world():
    """One gloo process for the in-process conversions; undone afterwards unless set up before."""
    import torch.distributed as dist

    from megatron_sparsebalance.training.dist import destroy_distributed

    was = dist.is_initialized()
    yield
    if not was:
        destroy_distributed()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# Tests spawn several gloo processes; one intra-op thread each keeps a 2-core machine responsive.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# --- two pytest-xdist workers on CI's two cores (`make test`) -----------------------------------
# A test marked ``alone`` times this machine (the DST claim profiles it, then compares measured
# imbalance): it waits for the other worker's current test to end and keeps the other worker from
# starting one until it is done. Every other test holds the machine shared. Two locks: a waiting
# ``alone`` test holds the turnstile, so the other worker cannot slip in test after test ahead of
# it. Without xdist there is one process and nothing to wait for.


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: no other xdist worker runs a test meanwhile (it times the machine)")


def _machine_locks(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    base = os.path.join(tempfile.gettempdir(), f"msb-pytest-{workerinput['testrunuid']}")
    return base + ".turnstile", base + ".machine"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    paths = _machine_locks(item.config)
    if paths is None:
        yield
        return
    with open(paths[0], "a") as turnstile, open(paths[1], "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if item.get_closest_marker("alone") is not None:
            fcntl.flock(machine, fcntl.LOCK_EX)  # once the other worker's test has ended
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(machine, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
