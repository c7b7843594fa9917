"""Run megatron-core's modules on a CPU-only host (CI, ``make demo`` without a GPU).

megatron-core hard-codes the GPU in a few places a CPU run reaches: RoPE moves its
frequencies to ``torch.cuda.current_device()``, DDP's gradient buffers and the optimizer's
scalars are created with ``device="cuda"``, the grad-norm clip checks for CUDA tensor types,
activation recomputation saves the GPU's RNG state.
Rather than editing the installed package, :func:`enable_cpu_megatron` gives those modules a
view of ``torch`` in which ``cuda.current_device()`` names the CPU and the tensor factories
turn ``device="cuda"`` into the CPU. Explicit, opt-in and idempotent; it does nothing when
CUDA is available. Call it before building the model.
"""
from __future__ import annotations

import functools
import importlib
import types

import torch

# Modules of megatron-core that name the GPU on paths a CPU run takes.
_PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")
_MARKER = "_sparsebalance_cpu_torch"


def _on_cpu(device):
    if device is None:
        return None
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return torch.device("cpu") if d.type == "cuda" else d


class _CpuCuda(types.SimpleNamespace):
    """Stands in for ``torch.cuda`` inside the patched modules."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def synchronize(*args, **kwargs):
        return None

    @staticmethod
    def empty_cache():
        return None

    # The model-parallel RNG tracker's states (a CPU has no GPU generator to fork).
    @staticmethod
    def get_rng_state(*args, **kwargs):
        return None

    @staticmethod
    def manual_seed(*args, **kwargs):
        return None


class _CpuTorch(types.ModuleType):
    """``torch`` with the GPU mapped to the CPU; every other name is torch's."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._cpu_factory(getattr(torch, name)))

    @staticmethod
    def _cpu_factory(fn):
        @functools.wraps(fn)
        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _on_cpu(kwargs["device"])
            return fn(*args, **kwargs)

        return factory

    def __getattr__(self, name):
        return getattr(torch, name)


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's ``clip_grad_by_total_norm_fp32`` without its CUDA-type assertion.

    The original asserts ``grad.type() == 'torch.cuda.FloatTensor'`` (a tensor method, out of
    reach of the module view above); the scaling is the same: grads *= max_norm / (norm + 1e-6)
    when that is below one.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)


def cpu_rng_tracker_enabled() -> bool:
    """Whether megatron-core's model-parallel RNG tracker runs on this CPU (:func:`enable_cpu_megatron` ran).

    Its states are placeholders here: the CPU has one RNG, so a dropout inside a tensor-parallel
    region draws the same mask on every TP rank (the layers here run without dropout in tests)."""
    return getattr(importlib.import_module("megatron.core.tensor_parallel.random"), _MARKER, False)


def enable_cpu_megatron() -> bool:
    """Patch the listed megatron modules for CPU. Returns True if anything is patched."""
    if torch.cuda.is_available():
        return False
    cpu_torch = _CpuTorch()
    for name in _PATCHED_MODULES:
        module = importlib.import_module(name)
        if not getattr(module, _MARKER, False):
            module.torch = cpu_torch
            setattr(module, _MARKER, True)
    importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    # Activation recomputation saves and restores the GPU's RNG state around the recomputed
    # forward; a CPU has none (its own RNG state is saved beside it, by torch).
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    return True
