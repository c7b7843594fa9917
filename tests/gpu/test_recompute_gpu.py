"""Activation recomputation on the GPU: autograd runs the recomputed forward on its own device
thread there, which a thread-local budget scope would not reach (the CPU suite cannot show it)."""
import pytest
import torch

from tests.checks import recompute_gradient_errors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_recomputed_layers_route_as_their_forward_did_on_the_gpu(impl):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from megatron_sparsebalance.training.dist import init_distributed

    init_distributed()
    # bf16 and head dim 64: what the Triton kernels take
    in_scope, outside = recompute_gradient_errors("cuda", impl, head_dim=64, bf16=True)
    assert in_scope < 1e-3, in_scope
    assert outside > 1e-2, outside
