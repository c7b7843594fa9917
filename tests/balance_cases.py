"""Bodies of the multi-process balance tests (importable by spawned workers): a variable number of
micro-batches per replica and iteration trains exactly as a fixed number does."""
from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_sparsebalance.balance.dst import DSTConfig
from megatron_sparsebalance.data.synthetic import pack_sequences
from megatron_sparsebalance.training.trainer import OptimSettings, Trainer
from tests.pipeline_cases import SHAPE, SPARSE

LENGTHS = [130, 64, 200, 96, 321, 64, 150, 90]
# [dp_rank][micro_batch] -> sample ids, per iteration. The same samples every iteration; the
# variable plans move samples between replicas and give them 2 and 3, then 3 and 1 micro-batches.
FIXED = [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]] * 2
VARIABLE = [[[[0], [1, 2]], [[3, 4], [5], [6, 7]]],
            [[[0, 1, 2, 3], [4], [7]], [[5, 6]]]]


def sample(i: int):
    """A copy-task sequence of ``LENGTHS[i]`` tokens from its own seed: the same in any pack."""
    gen = torch.Generator().manual_seed(1000 + i)
    n = LENGTHS[i]
    half = torch.randint(1, 64, (n // 2,), generator=gen)
    mask = torch.zeros(n)
    mask[n // 2:] = 1.0
    return torch.cat([half, half, half[: n % 2]]), mask


def _train(plans, initial):
    torch.manual_seed(7)
    trainer = Trainer(SHAPE, SPARSE, DSTConfig(anchor="none", k_base=2), OptimSettings(lr=3e-3, min_lr=3e-3), 4096,
                      calculate_per_token_loss=True)
    params = [p for p in trainer.model.parameters()]
    if initial is None:
        initial = [p.detach().clone() for p in params]
    else:
        with torch.no_grad():
            for p, q in zip(params, initial):
                p.copy_(q)
    dp_rank = parallel_state.get_data_parallel_rank()
    losses, counts = [], []
    for plan in plans:
        lengths = [[[LENGTHS[i] for i in mb] for mb in rank] for rank in plan]
        batches = [pack_sequences(*zip(*[sample(i) for i in mb])) for mb in plan[dp_rank]]
        step = trainer.train_step(lengths, batches)
        losses.append((step.extra["lm_loss"], float(step.grad_norm)))
        counts.append(len(step.metrics.micro_batch_ms))
        assert not step.skipped
    return losses, counts, [p.detach().clone() for p in params], initial


def variable_equals_fixed():
    fixed, fixed_counts, fixed_params, initial = _train(FIXED, None)
    variable, variable_counts, variable_params, _ = _train(VARIABLE, initial)
    assert fixed_counts == [4, 4] and variable_counts == [5, 4], (fixed_counts, variable_counts)
    # The global per-token loss and the gradient norm (which a wrong normalization scales), step
    # by step. Adam's update is nearly scale-free, so the weights are compared at 1% of the
    # learning rate: fp32 sums in another order move near-zero gradients' updates by more than
    # 1e-6, while a wrong weighting of samples moves whole updates (lr = 3e-3).
    for (la, ga), (lb, gb) in zip(fixed, variable):
        assert abs(la - lb) <= 1e-6 * abs(la) and abs(ga - gb) <= 1e-5 * ga, (fixed, variable)
    assert fixed[1][0] < fixed[0][0]  # it trained
    for a, b in zip(fixed_params, variable_params):
        assert torch.allclose(a, b, atol=3e-5, rtol=0), (a - b).abs().max()
