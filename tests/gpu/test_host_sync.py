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


@pytest.fixture(scope="module", params=["triton", "cuda"])
def stage(request):
    """A 2-layer stage on each GPU implementation (``auto`` takes CUDA on Hopper, Triton elsewhere)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from megatron_sparsebalance.ops.implementations import unavailable_reason
    from tools.profile_latency import StageProfiler

    reason = unavailable_reason(request.param, torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    return StageProfiler("fidelity-small", 2, block_size=64, impl=request.param, max_length=4096)


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


def test_stage_runs_in_trainings_precision(stage):
    """The profiled stage is the one training runs (Float16Module): every parameter in bf16, the
    norms' included, so RMSNorm takes torch's fused kernel instead of its fp32-weight fallback."""
    assert {p.dtype for p in stage.model.parameters()} == {torch.bfloat16}
    assert stage.model.decoder.layers[0].input_layernorm.weight.dtype == torch.bfloat16
