"""Registry of the sparse-attention implementations and the ``--sparse-attn-impl`` choice.

Every implementation computes the same function (DESIGN.md §2) from a :class:`BlockRoute`:
``fn(q [T, HQ, D], k [T, G, D], v [T, G, D], route, softmax_scale) -> [T, HQ, D]``,
differentiable with respect to q, k and v.

``torch`` is the block-gather path (``gather.py``, cost grows with the budget); the masked-dense
``naive.py`` is the oracle of the tests and is not selectable. ``fa4`` runs flash-attn-4's
block-sparse kernels (``fa4_attention.py``) where that package is installed; its backward adds
dQ with atomics, so it is the one non-deterministic implementation.

``auto`` takes the first available entry of :func:`auto_order`: the order measured on this GPU
(``measured_order.py``, derived from ``benchmarks/results/attention_<gpu>.json`` by
``python -m benchmarks.attention --auto-table``), else the built-in order. In deterministic mode
(``--deterministic-mode``, Megatron-LM's flag and TransformerConfig field) it skips the
non-deterministic implementations, and asking for one of them by name is an error. An
implementation asked for by name that cannot run is an error that says why, never a silent
fallback.
"""
from __future__ import annotations

import functools
import importlib.util
import math
from typing import Callable, Optional

import torch

from megatron_sparsebalance.ops import native

IMPLEMENTATIONS = ("auto", "cuda", "triton", "fa4", "torch")
NON_DETERMINISTIC = frozenset({"fa4"})  # FA4's Hopper backward adds dQ with fp32 atomics
# Built-in order where no measurement of the GPU exists, fastest first
# (benchmarks/results/attention_h200.json). On Hopper, with its wgmma kernels built (sm_90a), CUDA
# is 1.4-2.4x faster than Triton at every measured case; elsewhere the extension runs its mma.sync
# kernels, which Triton beats. fa4 is tried only where it was measured.
AUTO_ORDER_HOPPER = ("cuda", "triton", "torch")
AUTO_ORDER = ("triton", "cuda", "torch")
# Benchmark row name -> implementation name (benchmarks/attention.py measures our fa4 path as
# ``fa4_backend``; its ``fa4`` row is FA4's API called directly, an anchor, not an implementation).
BENCHMARK_ROWS = {"cuda": "cuda", "triton": "triton", "fa4_backend": "fa4", "torch": "torch"}


def device_name(device: torch.device) -> Optional[str]:
    """The name measurements are filed under (``torch.cuda.get_device_name``), None off a usable GPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else None


def builtin_order(device: torch.device) -> tuple:
    """Today's order without a measurement of this GPU."""
    if native.wgmma_kernels_for(device):
        return AUTO_ORDER_HOPPER
    return AUTO_ORDER


def order_from_table(table: dict, gpu: Optional[str], builtin: tuple, deterministic: bool = False,
                     cuda_as_measured: bool = True) -> tuple:
    """The order ``auto`` tries on ``gpu``: the measured order, then the built-in entries it lacks.

    ``table`` maps GPU names to ``{"order": [...], ...}`` (``measured_order.MEASURED``).
    ``cuda_as_measured`` False (the extension lacks the kernels the GPU was measured with, e.g.
    Hopper's sm_90a wgmma) puts ``cuda`` after ``triton``. Deterministic mode drops the
    non-deterministic implementations.
    """
    measured = list(table.get(gpu, {}).get("order", ()))
    order = measured + [name for name in builtin if name not in measured]
    # triton may be in the built-in order only (a GPU measured against fa4 alone): cuda's measured
    # rank was its wgmma kernels', not the mma.sync ones that run in their place
    if not cuda_as_measured and "cuda" in measured and "triton" in order:
        order.remove("cuda")
        order.insert(order.index("triton") + 1, "cuda")
    if deterministic:
        order = [name for name in order if name not in NON_DETERMINISTIC]
    return tuple(order)


def auto_order(device: torch.device, deterministic: bool = False) -> tuple:
    """The order in which ``auto`` tries the implementations on ``device``."""
    from megatron_sparsebalance.ops.measured_order import MEASURED

    device = torch.device(device)
    builtin = builtin_order(device)
    lacks_wgmma = (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
                   and not native.HAVE_NATIVE_SM90A)
    return order_from_table(MEASURED, device_name(device), builtin, deterministic, cuda_as_measured=not lacks_wgmma)


def measured_entry(result: dict) -> dict:
    """``measured_order.MEASURED``'s entry from a ``benchmarks/attention.py`` results file.

    The implementations measured at every sparse case of the file, ordered by the geometric mean
    of their fwd+bwd ms over those cases (a failed or missing case leaves an implementation out:
    ``auto`` must not rank what it has not seen run everywhere).
    """
    cases = {}
    for r in result["rows"]:
        name = BENCHMARK_ROWS.get(r["impl"])
        if name is None or r.get("density", 1.0) >= 1.0:
            continue
        cases.setdefault((r["shape"], r["seq"], r["density"]), {})[name] = r.get("ms")
    if not cases:
        raise ValueError("the results file has no sparse rows of our implementations")
    names = sorted({n for got in cases.values() for n in got})
    complete = [n for n in names if all(got.get(n) for got in cases.values())]
    geomean = {n: math.exp(sum(math.log(got[n]) for got in cases.values()) / len(cases)) for n in complete}
    order = sorted(complete, key=lambda n: geomean[n])
    return dict(order=order, geomean_ms={n: round(geomean[n], 4) for n in order}, cases=len(cases))


def unavailable_reason(impl: str, device: torch.device, block_size: Optional[int] = None) -> Optional[str]:
    """Why ``impl`` cannot run on ``device`` (with ``--moba-block-size`` ``block_size`` when given), or None."""
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
    if impl == "fa4":
        from megatron_sparsebalance.ops import fa4_attention

        if block_size is not None and block_size not in fa4_attention.FA4_BLOCK_SIZES:
            return (f"flash-attn-4's kernels tile keys in 128-token blocks: --moba-block-size must be one of "
                    f"{fa4_attention.FA4_BLOCK_SIZES}, got {block_size}")
        if device.type != "cuda":
            return f"flash-attn-4 needs a CUDA device, the tensors are on {device}"
        major = torch.cuda.get_device_capability(device)[0]
        if major not in (9, 10, 11):
            return (f"flash-attn-4's block-sparse backward runs on Hopper and Blackwell (sm_90, sm_100, sm_110), "
                    f"not on {torch.cuda.get_device_name(device)} (sm_{major}x)")
        return fa4_attention.import_error()
    raise ValueError(f"--sparse-attn-impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def check_request(impl: str, deterministic: bool = False, block_size: Optional[int] = None) -> None:
    """The checks of an ``--sparse-attn-impl`` request that need no device (config validation)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"--sparse-attn-impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if deterministic and impl in NON_DETERMINISTIC:
        raise ValueError(f"--sparse-attn-impl {impl} is not deterministic (flash-attn-4's backward adds dQ with "
                         "fp32 atomics on Hopper) and --deterministic-mode is set: use cuda, triton, torch or auto")
    if impl == "fa4" and block_size is not None:
        from megatron_sparsebalance.ops.fa4_attention import check_block_size

        check_block_size(block_size)


def check_ds_buffer_request(ds_buffer_gib: float, impl: str, block_size: Optional[int] = None,
                            head_dim: Optional[int] = None) -> None:
    """The checks of ``--sparse-attn-ds-buffer-gib`` that need no device: a memory the stored-dS
    backward of the cuda kernels may take, so it must be a size, and where it could never take
    effect (another implementation named, blocks or heads the kernels do not store dS for) it is
    an error rather than a flag that does nothing."""
    if not ds_buffer_gib >= 0:
        raise ValueError(f"--sparse-attn-ds-buffer-gib must be >= 0 (GiB), got {ds_buffer_gib}")
    if ds_buffer_gib == 0:
        return
    if impl not in ("auto", "cuda"):
        raise ValueError(f"--sparse-attn-ds-buffer-gib is memory for the cuda kernels' backward: it needs "
                         f"--sparse-attn-impl cuda or auto, got {impl}")
    if block_size is not None and block_size != 128:
        raise ValueError(f"--sparse-attn-ds-buffer-gib needs --moba-block-size 128 (the stored dS tiles are 128 "
                         f"keys), got {block_size}")
    if head_dim is not None and head_dim != 128:
        raise ValueError(f"--sparse-attn-ds-buffer-gib needs head dim 128 (--kv-channels; at 64 the stored-dS "
                         f"backward is slower and less exact than the two-pass one), got {head_dim}")


def check_stored_ds_runs(requested: str, impl: str, device: torch.device, block_size: int, head_dim: int) -> None:
    """``--sparse-attn-ds-buffer-gib`` where the layer first runs: the resolved implementation is
    cuda and this GPU has the Hopper kernels that store dS."""
    if impl != "cuda":
        raise ValueError(f"--sparse-attn-ds-buffer-gib is memory for the cuda kernels' backward, and "
                         f"--sparse-attn-impl {requested} resolved to {impl} on {device_name(device) or device}")
    if not native.native().stored_ds_supported(block_size, head_dim):
        raise ValueError(f"--sparse-attn-ds-buffer-gib needs the Hopper (sm_90a) kernels, which "
                         f"{device_name(device)} with this build does not run")


def resolve_impl(impl: str, device, deterministic: bool = False, block_size: Optional[int] = None) -> str:
    """The implementation that runs for the requested ``--sparse-attn-impl`` on ``device``.

    Every attention layer asks, on every micro-batch: the answer is cached per argument set.
    """
    return _resolve_impl(impl, torch.device(device), bool(deterministic), block_size)


@functools.lru_cache(maxsize=None)
def _resolve_impl(impl: str, device: torch.device, deterministic: bool, block_size: Optional[int]) -> str:
    check_request(impl, deterministic, block_size)
    if impl == "auto":
        return next(name for name in auto_order(device, deterministic)
                    if unavailable_reason(name, device, block_size) is None)
    reason = unavailable_reason(impl, device, block_size)
    if reason is not None:
        raise ValueError(f"--sparse-attn-impl={impl} is not available: {reason}")
    return impl


def attention_function(impl: str, ds_buffer_gib: float = 0.0) -> Callable:
    """The attention function of a resolved implementation name; ``cuda``'s backward may take up to
    ``ds_buffer_gib`` GiB to store dS (``--sparse-attn-ds-buffer-gib``, read by no other)."""
    if impl == "torch":
        from megatron_sparsebalance.ops.gather import sparse_attention_gather

        return sparse_attention_gather
    if impl == "triton":
        from megatron_sparsebalance.ops.triton_attention import block_sparse_attention

        return block_sparse_attention
    if impl == "cuda":
        from megatron_sparsebalance.ops.cuda_attention import block_sparse_attention

        if ds_buffer_gib > 0:
            return functools.partial(block_sparse_attention, ds_buffer_bytes=int(min(ds_buffer_gib, 2.0**40) * 2**30))
        return block_sparse_attention
    if impl == "fa4":
        from megatron_sparsebalance.ops.fa4_attention import block_sparse_attention

        return block_sparse_attention
    raise ValueError(f"unknown resolved implementation {impl!r}")
