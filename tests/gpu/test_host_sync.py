"""A stage's forward+backward never stops the host (GPU only).

Every host synchronisation in a layer makes the CPU wait for the GPU's queue to drain, so launch
and execution stop overlapping and short micro-batches pay both (benchmarks/host_overhead.py).
These run a real megatron-core stage (tools/profile_latency.py's) with CUDA's sync debug mode set
to raise on any synchronising call.
"""
import pytest
import torch

from tests.checks import run_without_sync

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def stage():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tools.profile_latency import StageProfiler

    return StageProfiler("fidelity-small", 2, block_size=64, impl="triton", max_length=4096)


@pytest.mark.parametrize("lengths", [[2048], [1000, 64, 1500], [4096]])
def test_fixed_budget_step_has_no_host_sync(stage, lengths):
    run_without_sync(stage.stage_step(lengths, 4))


def test_coverage_bounded_shrink_has_no_host_sync(stage):
    run_without_sync(stage.stage_step([3000, 1000], 2, k_base=16, p=0.05))


def test_sync_debug_mode_catches_a_sync():
    """The check itself can fail: a read of a device value raises under it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.ones(4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
