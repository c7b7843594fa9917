"""Registry of the sparse-attention implementations and the ``--sparse-attn-impl`` choice.

Every implementation computes the same function (DESIGN.md §2) from a :class:`BlockRoute`:
``fn(q [T, HQ, D], k [T, G, D], v [T, G, D], route, softmax_scale) -> [T, HQ, D]``,
differentiable with respect to q, k and v.

``torch`` is the block-gather path (``gather.py``, cost grows with the budget); the masked-dense
``naive.py`` is the oracle of the tests and is not selectable.

``auto`` takes the first available entry of :func:`auto_order` (fastest first, as measured
by ``benchmarks/attention.py``); an implementation asked for by name that cannot run is an
error that says why, never a silent fallback.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Callable, Optional

import torch

from megatron_sparsebalance.ops import native

IMPLEMENTATIONS = ("auto", "cuda", "triton", "torch")
# Fastest first (benchmarks/results/attention_h200.json). On Hopper, with its wgmma kernels built
# (sm_90a), CUDA is 1.1-1.6x faster than Triton at every measured case; elsewhere the extension
# runs its mma.sync kernels, which Triton beats.
AUTO_ORDER_HOPPER = ("cuda", "triton", "torch")
AUTO_ORDER = ("triton", "cuda", "torch")


def auto_order(device: torch.device) -> tuple:
    """The order in which ``auto`` tries the implementations on ``device``."""
    if device.type == "cuda" and native.HAVE_NATIVE_SM90A and torch.cuda.get_device_capability(device) == (9, 0):
        return AUTO_ORDER_HOPPER
    return AUTO_ORDER


def unavailable_reason(impl: str, device: torch.device) -> Optional[str]:
    """Why ``impl`` cannot run on ``device``, or None when it can."""
    device = torch.device(device)
    if impl == "torch":
        return None
    if impl == "cuda":
        if device.type != "cuda":
            return f"the CUDA kernels need a CUDA device, the tensors are on {device}"
        if not native.HAVE_NATIVE:
            return f"the native extension is not built ({native.NATIVE_IMPORT_ERROR})"
        if not native.HAVE_NATIVE_CUDA:
            return "the native extension was built without CUDA (rebuild with MSB_CUDA=1 where nvcc exists)"
        if not native.cuda_kernels_run_on(device):
            return (f"the native extension has no machine code for {torch.cuda.get_device_name(device)} "
                    "(rebuild with MSB_CUDA_ARCH set to its architecture, e.g. MSB_CUDA_ARCH=80 for an A100)")
        return None
    if impl == "triton":
        if device.type != "cuda":
            return f"the Triton kernels need a CUDA device, the tensors are on {device}"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if importlib.util.find_spec("megatron_sparsebalance.ops.triton_attention") is None:
            return "this build has no Triton kernels"
        return None
    raise ValueError(f"--sparse-attn-impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def resolve_impl(impl: str, device) -> str:
    """The implementation that runs for the requested ``--sparse-attn-impl`` on ``device``.

    Every attention layer asks, on every micro-batch: the answer is cached per (impl, device).
    """
    return _resolve_impl(impl, torch.device(device))


@functools.lru_cache(maxsize=None)
def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"--sparse-attn-impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        return next(name for name in auto_order(device) if unavailable_reason(name, device) is None)
    reason = unavailable_reason(impl, device)
    if reason is not None:
        raise ValueError(f"--sparse-attn-impl={impl} is not available: {reason}")
    return impl


def attention_function(impl: str) -> Callable:
    """The attention function of a resolved implementation name."""
    if impl == "torch":
        from megatron_sparsebalance.ops.gather import sparse_attention_gather

        return sparse_attention_gather
    if impl == "triton":
        from megatron_sparsebalance.ops.triton_attention import block_sparse_attention

        return block_sparse_attention
    if impl == "cuda":
        from megatron_sparsebalance.ops.cuda_attention import block_sparse_attention

        return block_sparse_attention
    raise ValueError(f"unknown resolved implementation {impl!r}")
