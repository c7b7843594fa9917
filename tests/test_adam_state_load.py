"""megatron-core's distributed optimizer over torch's Adam, loaded from a checkpoint
(megatron_sparsebalance/compat.py: fill_empty_adam_state, restore_adam_steps). The distributed
optimizer itself needs CUDA (tests/gpu/test_megatron_flags_gpu.py resumes it); here, the inner
torch Adam in the states that its load_state_dict leaves."""
import copy

import torch

from megatron_sparsebalance.compat import fill_empty_adam_state, restore_adam_steps


def _adam(seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))]
    return params, torch.optim.AdamW(params, lr=0.1, foreach=True)


def _step(params, adam, seed):
    torch.manual_seed(seed)
    for p in params:
        p.grad = torch.randn_like(p)
    adam.step()


def test_fill_empty_adam_state_is_what_the_first_step_creates():
    params, adam = _adam()
    fill_empty_adam_state(adam)
    assert {float(s["step"]) for s in adam.state.values()} == {0.0}  # the distributed optimizer's assertion
    # Stepping from the filled state equals stepping from none.
    ref_params, ref = _adam()
    _step(params, adam, 1)
    _step(ref_params, ref, 1)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    # Existing state is kept.
    before = {id(p): adam.state[p]["exp_avg"].clone() for p in params}
    fill_empty_adam_state(adam)
    assert all(torch.equal(adam.state[p]["exp_avg"], before[id(p)]) for p in params)


def _resumed_as_the_distributed_optimizer_leaves_it(params_from, adam_from):
    """A copy of ``adam_from`` whose parameters all share one ``step`` tensor holding the value the
    state had when the load was requested (0: a fresh optimizer filled by fill_empty_adam_state)."""
    params = [torch.nn.Parameter(p.detach().clone()) for p in params_from]
    adam = torch.optim.AdamW(params, lr=0.1, foreach=True)
    adam.load_state_dict(copy.deepcopy(adam_from.state_dict()))
    stale = torch.tensor(0.0)
    for s in adam.state.values():
        s["step"] = stale
    return params, adam


def test_the_checkpoints_step_is_restored_per_parameter_so_resumed_steps_match():
    # An unbroken run of three steps ...
    params, adam = _adam()
    for i in range(3):
        _step(params, adam, i)
    # ... against two steps, a load, then the third.
    saved_params, saved = _adam()
    for i in range(2):
        _step(saved_params, saved, i)
    resumed_params, resumed = _resumed_as_the_distributed_optimizer_leaves_it(saved_params, saved)
    broken_params, broken = _resumed_as_the_distributed_optimizer_leaves_it(saved_params, saved)
    restore_adam_steps(resumed, 2)
    assert len({id(s["step"]) for s in resumed.state.values()}) == len(params)
    _step(resumed_params, resumed, 2)
    _step(broken_params, broken, 2)
    assert [float(s["step"]) for s in resumed.state.values()] == [3.0, 3.0]
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)
    # Left as loaded, the shared step restarts from 0 and advances once per parameter: the
    # bias correction, and with it the update, differ.
    assert {float(s["step"]) for s in broken.state.values()} == {2.0}
    assert not all(torch.equal(p, q) for p, q in zip(params, broken_params))
