"""megatron-core's distributed optimizer over torch's Adam, loaded from a checkpoint
(megatron_sparsebalance/compat.py: fill_empty_adam_state, restore_adam_steps, and
mend_optimizer_loading around Megatron-LM's loader). The distributed optimizer itself needs CUDA
(tests/gpu/test_megatron_flags_gpu.py and test_megatron_lm_gpu.py resume it); here, the inner torch
Adam in the states that its load_state_dict leaves, and the order of the mends around a loader."""
import copy

import pytest
import torch

from megatron_sparsebalance import compat
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


class _RecordingOptimizer:
    def __init__(self, calls):
        self.calls = calls

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, **kwargs):
        self.calls.append(("sharded_state_dict", is_loading))
        return {"request": is_loading}

    def load_state_dict(self, state_dict):
        self.calls.append(("load_state_dict", state_dict))


def test_megatron_lms_loader_gets_the_state_filled_before_its_request_and_the_steps_after_its_load(monkeypatch):
    """Megatron-LM's load_checkpoint asks sharded_state_dict(..., is_loading=True), then calls
    load_state_dict: the fill must come before the request (whose own state_dict() asserts one step),
    the steps after the load; a save's request is left alone."""
    calls = []
    monkeypatch.setattr(compat, "_distributed_optimizers_over_torch_adam", lambda optimizer: [(0, optimizer)])
    monkeypatch.setattr(compat, "prepare_optimizer_for_load", lambda optimizer: calls.append(("fill", optimizer)))
    monkeypatch.setattr(compat, "finish_optimizer_load", lambda optimizer, sd: calls.append(("steps", optimizer, sd)))
    optimizer = _RecordingOptimizer(calls)
    assert compat.mend_optimizer_loading(optimizer) is optimizer
    assert optimizer.sharded_state_dict({}, metadata={}) == {"request": False}  # a save
    assert optimizer.sharded_state_dict({}, is_loading=True, metadata={}) == {"request": True}
    optimizer.load_state_dict({"optimizer": 1})
    assert calls == [("sharded_state_dict", False), ("fill", optimizer), ("sharded_state_dict", True),
                     ("load_state_dict", {"optimizer": 1}), ("steps", optimizer, {"optimizer": 1})]


def test_an_optimizer_without_the_faults_is_not_wrapped(monkeypatch):
    monkeypatch.setattr(compat, "_distributed_optimizers_over_torch_adam", lambda optimizer: [])
    optimizer = _RecordingOptimizer([])
    compat.mend_optimizer_loading(optimizer)
    assert "sharded_state_dict" not in vars(optimizer) and "load_state_dict" not in vars(optimizer)


class _LegacyFormatOptimizer:
    """The distributed optimizer's legacy-format load as megatron-core 0.19.2 does it
    (``_set_main_param_and_optimizer_states``): each tensor of a parameter's state is copied from
    the saved tensors of that name, and the saved ones are the parameter, exp_avg and exp_avg_sq."""

    def __init__(self, adam):
        self.optimizer = adam

    def sharded_state_dict(self, *args, **kwargs):
        return {}

    def load_state_dict(self, state_dict):
        pass

    def load_parameter_state(self, saved):
        for param, tensors in zip(self.optimizer.param_groups[0]["params"], saved):
            state = self.optimizer.state[param]
            for key in ("param", *[k for k, v in state.items() if isinstance(v, torch.Tensor)]):
                (param.data if key == "param" else state[key]).copy_(tensors[key])


def test_the_legacy_formats_parameter_state_loads_around_the_steps(monkeypatch):
    """``--ckpt-format torch``: load_parameter_state copies into every tensor of the state, and the
    saved tensors hold no step (megatron-core 0.19.2: KeyError 'step'); mended, it loads the rest and
    leaves each parameter's own step (set by the earlier load_state_dict) as it was."""
    params, adam = _adam()
    _step(params, adam, 0)
    saved = [{"param": torch.full_like(p, 0.5), "exp_avg": torch.full_like(p, 0.25),
              "exp_avg_sq": torch.full_like(p, 0.125)} for p in params]
    with pytest.raises(KeyError, match="step"):
        _LegacyFormatOptimizer(adam).load_parameter_state(saved)
    restore_adam_steps(adam, 7)
    steps = [adam.state[p]["step"] for p in params]
    optimizer = _LegacyFormatOptimizer(adam)
    monkeypatch.setattr(compat, "_distributed_optimizers_over_torch_adam", lambda o: [(0, optimizer)])
    compat.mend_optimizer_loading(optimizer).load_parameter_state(saved)
    for p, step in zip(params, steps):
        assert adam.state[p]["step"] is step and float(step) == 7.0
        assert torch.equal(p.data, torch.full_like(p, 0.5))
        assert torch.equal(adam.state[p]["exp_avg_sq"], torch.full_like(p, 0.125))
