"""Run megatron-core's modules on a CPU-only host (CI, ``make demo`` without a GPU).

megatron-core hard-codes ``torch.cuda.current_device()`` in a few places that a CPU run
reaches (RoPE moves its frequencies to the GPU on the first forward). Rather than editing the
installed package, :func:`enable_cpu_megatron` gives those modules a view of ``torch`` whose
``cuda.current_device()`` names the CPU. Explicit, opt-in and idempotent; it does nothing when
CUDA is available. Call it before building the model.
"""
from __future__ import annotations

import importlib
import types

import torch

# Modules of megatron-core that call torch.cuda.current_device() on paths a CPU run takes.
_PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
)
_MARKER = "_sparsebalance_cpu_torch"


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


class _CpuTorch(types.ModuleType):
    """``torch`` with ``cuda`` replaced by :class:`_CpuCuda`; every other name is torch's."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


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
    return True
