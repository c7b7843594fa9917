"""Loader of the native extension ``megatron_sparsebalance._C``.

Importing it is optional for the package (the torch reference works without it), so the
import error is kept and reported when something explicitly asks for native code.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch  # loads libc10 before the extension

try:
    from megatron_sparsebalance import _C as _native

    NATIVE_IMPORT_ERROR: Optional[str] = None
except ImportError as exc:  # not built: `pip install -e .` or `make install` builds it
    _native = None
    NATIVE_IMPORT_ERROR = str(exc)

HAVE_NATIVE = _native is not None
HAVE_NATIVE_CUDA = HAVE_NATIVE and bool(getattr(_native, "with_cuda", False))
HAVE_NATIVE_SM90A = HAVE_NATIVE_CUDA and bool(getattr(_native, "with_sm90a", False))  # Hopper wgmma kernels


def native() -> ModuleType:
    """The extension module; a clear error if it was not built."""
    if _native is None:
        raise RuntimeError(
            "megatron_sparsebalance._C is not built (run `make install` or `pip install -e .`): "
            f"{NATIVE_IMPORT_ERROR}"
        )
    return _native


@functools.lru_cache(maxsize=None)
def cuda_kernels_run_on(device: torch.device) -> bool:
    """Whether the extension's CUDA kernels have machine code for ``device`` (a CUDA device); asked once."""
    if not HAVE_NATIVE_CUDA:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return bool(_native.kernels_run_on(index))


def wgmma_kernels_for(device: torch.device) -> bool:
    """Whether ``device`` is the GPU our Hopper (sm_90a, wgmma) kernels are built for: compute
    capability 9.0 exactly (sm_90a code runs on no other) and an extension built with them."""
    return device.type == "cuda" and HAVE_NATIVE_SM90A and torch.cuda.get_device_capability(device) == (9, 0)
