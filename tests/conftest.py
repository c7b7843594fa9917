import os

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
