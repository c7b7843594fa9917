"""The latency model: predicted forward+backward time of one micro-batch on one pipeline stage.

Owns DESIGN.md §3. ``predict(lengths, k)`` is the time of a packed (THD) micro-batch holding
sequences of ``lengths`` at budget ``k``; ``align(lengths, T)`` the largest budget candidate whose
prediction fits under ``T``; ``observe`` corrects the prediction from the times the pipeline
schedule measures. DST calls ``predict``/``align`` for every micro-batch of every global batch,
so a prediction is pure Python arithmetic on a handful of numbers (no numpy, no torch).

Two models share that interface:

* :class:`AnalyticLatencyModel`: FLOPs and bytes of the stage over achieved hardware rates. No
  profile needed (CPU runs, planning before a profile exists).
* :class:`ProfiledLatencyModel`: a table measured by ``tools/profile_latency.py`` on the real
  layer stack, interpolated between profiled lengths and budgets.

Both split a micro-batch into the same two parts, because that is how the work splits:

* a **dense part** that depends only on the pack's total tokens ``T`` (QKV/output projections,
  MLP, norms, the output layer, and the fixed per-micro-batch cost: kernel launches, weights
  read, the attention's own launch overhead), and
* an **attention part** driven by the pack's block pairs at ``k``: blocks never cross sequence
  boundaries, so the work is the sum of the sequences' block pairs, not ``T^2``. The analytic
  model charges each pair at a fixed rate; the profiled model maps the pack's total pairs
  through the measured time-versus-work curve, because the attention is one kernel launch over
  the whole pack: a short sequence alone under-fills the GPU, inside a pack it does not.

The shape of the work is :func:`attention_block_pairs`: query block ``i`` (1-based) attends
``min(k, i)`` blocks, so it grows ~``L^2/(2B)`` while ``L/B <= k`` and ~``k*L`` after; the
profiled model interpolates and extrapolates along that shape.
"""
from __future__ import annotations

import bisect
import json
import logging
import copy
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

# DST's budget candidates K when the run names none: dense enough around the paper's k_base = 32
# for DST to fine-tune a budget, coarse at the ends where the latency step per candidate is large.
DEFAULT_CANDIDATES = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 36, 40, 48, 56, 64, 80, 96, 128)

# Keys of a table's metadata that must match the run that loads it (DESIGN.md §3).
METADATA_KEYS = (
    "gpu", "model_shape", "dtype", "block_size", "kernel_impl", "kernel_version",
    "layers_per_stage", "pre_process", "post_process", "parallel_layout",
)


# --------------------------------------------------------------------------------------------
# Cost shape


def attention_block_pairs(length: int, k: int, block_size: int) -> float:
    """(query block, KV block) pairs one sequence computes at budget ``k``, in full-block units.

    Query block ``i`` (1-based) of ``n = ceil(L/B)`` attends ``min(k, i)`` blocks (the diagonal
    included). The last block of a sequence holds ``r <= B`` tokens, so its row weighs ``r/B``:
    this keeps the count continuous and strictly increasing in ``L`` (adding a token never makes
    a pack cheaper) instead of jumping once per block.
    """
    if length <= 0:
        return 0.0
    k = max(1, int(k))
    n = -(-int(length) // block_size)
    r = length - (n - 1) * block_size
    full = n - 1  # complete query blocks before the last one
    if full <= k:
        pairs = full * (full + 1) / 2.0
    else:
        pairs = k * (k + 1) / 2.0 + (full - k) * k
    return pairs + (r / block_size) * min(k, n)


# --------------------------------------------------------------------------------------------
# Base


class LatencyModel:
    """Base of the profiled and the analytic model: candidates, alignment, calibration, JSON.

    Subclasses implement :meth:`_dense_ms` (the part that depends on the pack's total tokens)
    and :meth:`_attention_ms` (one sequence's attention part); the prediction is their sum times
    the calibration scale, so it is monotone whenever both parts are.

    Args:
        candidates: DST's budget candidate set ``K`` (sorted and deduplicated here).
        k_min: smallest budget DST may give; ``candidates[0]`` unless set.
        calibration_alpha: weight of a new observation in the EMA of log(measured/predicted).
        metadata: what the model describes (GPU, model shape, kernel ...; see :data:`METADATA_KEYS`).
    """

    kind = "base"

    def __init__(
        self,
        candidates: Sequence[int] = DEFAULT_CANDIDATES,
        k_min: Optional[int] = None,
        calibration_alpha: float = 0.2,
        metadata: Optional[Mapping[str, Any]] = None,
    ):
        cands = tuple(sorted({int(c) for c in candidates}))
        if not cands or cands[0] < 1:
            raise ValueError(f"budget candidates must be a non-empty set of integers >= 1, got {tuple(candidates)}")
        self.candidates: tuple[int, ...] = cands
        self.k_min: int = cands[0] if k_min is None else int(k_min)
        if self.k_min < 1:
            raise ValueError(f"k_min must be >= 1, got {self.k_min}")
        if not 0.0 < calibration_alpha <= 1.0:
            raise ValueError(f"calibration_alpha must be in (0, 1], got {calibration_alpha}")
        self.calibration_alpha = float(calibration_alpha)
        self.metadata: dict = dict(metadata or {})
        self._log_scale = 0.0
        self.observations = 0

    # ---- to be provided by subclasses -------------------------------------------------------

    def _dense_ms(self, total_tokens: int) -> float:
        raise NotImplementedError

    def _attention_ms(self, length: int, k: int) -> float:
        raise NotImplementedError

    # ---- prediction -------------------------------------------------------------------------

    @property
    def scale(self) -> float:
        """Calibration factor applied to the raw prediction (1.0 until observations arrive)."""
        return math.exp(self._log_scale)

    def predict_raw(self, lengths: Sequence[int], k: int) -> float:
        """Uncalibrated forward+backward ms of the pack ``lengths`` at budget ``k``."""
        total = 0
        attn = 0.0
        for n in lengths:
            if n > 0:
                total += n
                attn += self._attention_ms(n, k)
        if total == 0:
            return 0.0
        return self._dense_ms(total) + attn

    def uncalibrated(self) -> "LatencyModel":
        """This model at calibration scale 1, sharing its tables: what plans are priced with.

        Calibration is one scale factor fed from wall-clock measurements. It cancels between the
        micro-batches of a plan in exact arithmetic, but not in floating point (a budget at a tie
        with the anchor flips), so a plan priced with it would depend on how fast the last steps
        happened to run: a resumed run, whose first steps compile kernels, would plan differently
        from an uninterrupted one. Priced uncalibrated, a plan depends on the samples alone.
        """
        view = copy.copy(self)
        view._log_scale = 0.0
        return view

    def predict(self, lengths: Sequence[int], k: int) -> float:
        """Predicted forward+backward ms of one micro-batch (``lengths`` packed, THD) on one stage.

        Calibrated; monotone non-decreasing in ``k`` and in each length.
        """
        return self.predict_raw(lengths, k) * math.exp(self._log_scale)

    def align(self, lengths: Sequence[int], target_ms: float) -> int:
        """The largest ``k`` in :attr:`candidates` with ``predict(lengths, k) <= target_ms``, else ``k_min``.

        Bisection over the candidates (the prediction is monotone in ``k``), so a call costs
        about log2(len(K)) predictions.
        """
        cands = self.candidates
        lo, hi = 0, len(cands)  # invariant: cands[:lo] fit, cands[hi:] do not
        while lo < hi:
            mid = (lo + hi) // 2
            if self.predict(lengths, cands[mid]) <= target_ms:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return self.k_min
        return max(cands[lo - 1], self.k_min)

    # ---- online calibration -----------------------------------------------------------------

    def observe(self, lengths: Sequence[int], k: int, measured_ms: float) -> None:
        """Online calibration from one measured forward+backward time of this stage.

        Keeps an EMA of ``log(measured / raw prediction)``; the prediction is the raw one times
        ``exp`` of it. Log space makes over- and under-prediction symmetric; one observation may
        move the scale by at most 2x, so a stray measurement (a GC pause, a profiler hiccup)
        cannot wreck the plan, while a real drift is still followed within a few steps.
        """
        if not (measured_ms > 0.0 and math.isfinite(measured_ms)):
            return
        raw = self.predict_raw(lengths, k)
        if raw <= 0.0:
            return
        step = math.log(measured_ms / raw) - self._log_scale
        step = max(-math.log(2.0), min(math.log(2.0), step))
        self._log_scale += self.calibration_alpha * step
        self.observations += 1

    def calibrate(self, measured: Iterable[tuple[Sequence[int], int, float]]) -> None:
        """Feed many ``(lengths, k, measured_ms)`` records to :meth:`observe`, in order."""
        for lengths, k, ms in measured:
            self.observe(lengths, k, ms)

    def reset_calibration(self) -> None:
        self._log_scale = 0.0
        self.observations = 0

    def calibration_state(self) -> dict:
        """What calibration has learned (saved with checkpoints, so a resumed run plans the same)."""
        return {"log_scale": self._log_scale, "observations": self.observations}

    def load_calibration(self, state: Mapping[str, Any]) -> None:
        self._log_scale = float(state["log_scale"])
        self.observations = int(state["observations"])

    # ---- serialization ----------------------------------------------------------------------

    def _params(self) -> dict:
        raise NotImplementedError

    def to_dict(self) -> dict:
        return {
            "type": self.kind,
            "format_version": 1,
            "metadata": _jsonable(self.metadata),
            "candidates": list(self.candidates),
            "k_min": self.k_min,
            "calibration": {"alpha": self.calibration_alpha, "log_scale": self._log_scale, "observations": self.observations},
            "params": self._params(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LatencyModel":
        kind = d.get("type")
        target = _MODEL_TYPES.get(kind)
        if target is None:
            raise ValueError(f"unknown latency model type {kind!r} (known: {sorted(_MODEL_TYPES)})")
        if cls is not LatencyModel and not issubclass(target, cls):
            raise ValueError(f"the table holds a {kind!r} model, not a {cls.kind!r} one")
        model = target._from_params(
            d["params"], candidates=d.get("candidates", DEFAULT_CANDIDATES), k_min=d.get("k_min"),
            calibration_alpha=d.get("calibration", {}).get("alpha", 0.2), metadata=d.get("metadata", {}),
        )
        cal = d.get("calibration", {})
        model._log_scale = float(cal.get("log_scale", 0.0))
        model.observations = int(cal.get("observations", 0))
        return model

    @classmethod
    def _from_params(cls, params, **common) -> "LatencyModel":
        raise NotImplementedError

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str, expect: Optional[Mapping[str, Any]] = None, force: bool = False) -> "LatencyModel":
        """Load a saved model; ``expect`` is the run's metadata (see :func:`latency_metadata`).

        Every key of ``expect`` must equal the table's value (a key the table lacks counts as a
        mismatch), else a ValueError names the mismatching keys; ``force=True`` loads anyway and
        logs the mismatch as a warning.
        """
        with open(path) as f:
            d = json.load(f)
        mismatched = metadata_mismatch(d.get("metadata", {}), expect or {})
        if mismatched:
            detail = "; ".join(
                f"{key}: table has {d.get('metadata', {}).get(key, '<missing>')!r}, run expects {_jsonable(expect[key])!r}"
                for key in mismatched
            )
            if not force:
                raise ValueError(
                    f"latency table {path} does not match this run in {', '.join(mismatched)} ({detail}); "
                    "profile this configuration with tools/profile_latency.py, or pass force=True "
                    "(--latency-table-force) to use it anyway"
                )
            logger.warning("using latency table %s despite mismatching metadata: %s", path, detail)
        return cls.from_dict(d)


# Metadata keys added after tables were first committed: a table without one was profiled with
# the setting off (None), so it still matches runs with it off.
_KEYS_NONE_WHEN_ABSENT = ("recompute",)
_ABSENT = object()


def metadata_mismatch(table: Mapping[str, Any], expect: Mapping[str, Any]) -> list[str]:
    """Keys of ``expect`` whose value differs from (or is absent in) ``table``, JSON-normalised."""
    table = _jsonable(dict(table))

    def recorded(key):
        value = table.get(key, None if key in _KEYS_NONE_WHEN_ABSENT else _ABSENT)
        if key == "parallel_layout" and isinstance(value, dict):
            value = {"sequence_parallel": False, **value}  # tables from before TP recorded it ran without
        return value

    return sorted(key for key, value in expect.items() if recorded(key) != _jsonable(value))


def _jsonable(x):
    """The value as it reads back from JSON (tuples become lists, dataclasses dicts)."""
    if hasattr(x, "__dataclass_fields__"):
        x = asdict(x)
    return json.loads(json.dumps(x))


def latency_metadata(
    shape,
    block_size: int,
    layers_per_stage: int,
    dtype: str = "bfloat16",
    kernel_impl: str = "triton",
    kernel_version: Optional[str] = None,
    gpu: Optional[str] = None,
    pre_process: bool = False,
    post_process: bool = False,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    context_parallel_size: int = 1,
    recompute: Optional[Mapping[str, Any]] = None,
    sequence_parallel: bool = False,
) -> dict:
    """The metadata a table is saved with and a run expects when loading one (same function for both).

    ``shape`` is a :class:`~megatron_sparsebalance.training.model.ModelShape` (or its dict).
    ``kernel_version`` defaults to :func:`kernel_version` of ``kernel_impl``; ``gpu`` to the
    current device's name. ``recompute``: megatron's recompute settings when the stage recomputes
    activations (its backward then repeats the forward), else None; a table and a run must agree
    on it either way. ``parallel_layout`` records TP, PP, CP and sequence parallelism: a TP stage
    computes ``1/TP`` of every layer plus its TP collectives, whose cost sequence parallelism changes
    (reduce-scatter + all-gather instead of all-reduce), so a table is refused for another layout.
    """
    return {
        "gpu": gpu if gpu is not None else device_name(),
        "model_shape": _jsonable(shape),
        "dtype": str(dtype).replace("torch.", ""),
        "block_size": int(block_size),
        "kernel_impl": kernel_impl,
        "kernel_version": kernel_version if kernel_version is not None else kernel_version_of(kernel_impl),
        "layers_per_stage": int(layers_per_stage),
        "pre_process": bool(pre_process),
        "post_process": bool(post_process),
        "parallel_layout": {"tp": int(tensor_parallel_size), "pp": int(pipeline_parallel_size),
                            "cp": int(context_parallel_size), "sequence_parallel": bool(sequence_parallel)},
        "recompute": _jsonable(dict(recompute)) if recompute else None,
    }


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


# The module that launches each attention implementation.
_KERNEL_MODULES = {
    "torch": "megatron_sparsebalance.ops.naive",
    "triton": "megatron_sparsebalance.ops.triton_attention",
    "cuda": "megatron_sparsebalance.ops.cuda_attention",
}


def kernel_sources(impl: str) -> list[str]:
    """The files whose text defines an attention implementation: its Python module, and for
    ``cuda`` the CUDA sources next to the package when it runs from a checkout (they are compiled
    into ``_C``; the module alone only launches them)."""
    import importlib.util
    import os

    module = _KERNEL_MODULES.get(impl)
    if module is None:
        return []
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return []
    paths = [spec.origin]
    if impl == "cuda":
        csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(spec.origin))), "csrc", "cuda")
        if os.path.isdir(csrc):
            paths += sorted(os.path.join(csrc, f) for f in os.listdir(csrc) if f.endswith((".cu", ".cuh", ".h")))
    return paths


def kernel_version_of(impl: str) -> str:
    """A version string of an attention implementation: its module's ``KERNEL_VERSION`` if it
    declares one, else a hash of :func:`kernel_sources`, so a table is invalidated when the
    kernel changes."""
    import hashlib

    paths = kernel_sources(impl)
    if not paths:
        return "unavailable" if impl in _KERNEL_MODULES else "unknown"
    sources = []
    for path in paths:
        with open(path, "rb") as f:
            sources.append(f.read())
    for line in sources[0].decode(errors="replace").splitlines():
        if line.startswith("KERNEL_VERSION"):
            return line.split("=", 1)[1].strip().strip("'\"")
    digest = hashlib.sha1()
    for source in sources:
        digest.update(source)
    return "src-" + digest.hexdigest()[:12]


# --------------------------------------------------------------------------------------------
# Analytic model


@dataclass(frozen=True)
class Hardware:
    """Achieved (not peak) rates of a device, and its fixed costs.

    The analytic model divides FLOPs and bytes by these; online calibration (:meth:`observe`)
    absorbs what they get wrong as a common factor.
    """

    name: str
    matmul_tflops: float
    """Dense GEMM rate of the linear layers (TFLOP/s achieved)."""
    attention_tflops: float
    """Rate of the block-sparse attention kernels, forward and backward together."""
    memory_gbps: float
    """HBM bandwidth achieved by elementwise kernels (GB/s)."""
    layer_overhead_ms: float
    """Fixed time per layer and micro-batch, forward+backward (launches, router, host syncs)."""
    microbatch_overhead_ms: float
    """Fixed time per micro-batch and stage (loss, schedule, layout building)."""


# Rough achieved figures; calibration corrects them.  H200 SXM: 989 dense bf16 TFLOP/s peak,
# 4.8 TB/s HBM3e.  CPU: a few-core host running fp32 (the CI machines).
HARDWARE = {
    "h200": Hardware("h200", matmul_tflops=600.0, attention_tflops=250.0, memory_gbps=3500.0,
                     layer_overhead_ms=0.25, microbatch_overhead_ms=1.0),
    "h100": Hardware("h100", matmul_tflops=550.0, attention_tflops=230.0, memory_gbps=2700.0,
                     layer_overhead_ms=0.25, microbatch_overhead_ms=1.0),
    "cpu": Hardware("cpu", matmul_tflops=0.1, attention_tflops=0.02, memory_gbps=10.0,
                    layer_overhead_ms=1.0, microbatch_overhead_ms=2.0),
}

# FLOPs of one (query block x KV block) pair per query head, per B^2*d: forward QK^T and PV are
# 2 matmuls (4 FLOPs per multiply-add pair counted as 2 each); backward recomputes QK^T and runs
# dV, dP, dQ, dK: 5 more. 7 matmuls x 2 FLOPs.
# Bytes moved per logit (one token, one vocabulary entry) by the output layer and megatron-core's
# vocab-parallel cross entropy (the unfused path: no Transformer Engine, no
# --cross-entropy-loss-fusion), forward and backward, counted pass by pass. Forward: the GEMM writes
# bf16 logits (2); ``.float()`` reads them and writes fp32 (2 + 4); the row max reads (4); the max is
# subtracted in place (4 + 4); exp in place (4 + 4); the row sum reads (4); the division into the
# softmax kept for backward (4 + 4). Backward: the gradient scaled in place (4 + 4); cast back to
# bf16 (4 + 2); read by the data- and the weight-gradient GEMMs (2 + 2). 58 in all: at a 152K
# vocabulary these passes, not the GEMM, are most of the output layer's time. (Counting only the
# logits, softmax and gradient, 16, priced Qwen2.5-0.5B's output layer at ~4.8 of its layers at
# 64K; the 4xH200 stage shares measure ~12, and its fitted per-token cost 3.9 us against 3.9 us here.)
_LOSS_BYTES_PER_LOGIT = 2 + (2 + 4) + 4 + (4 + 4) + (4 + 4) + 4 + (4 + 4) + (4 + 4) + (4 + 2) + (2 + 2)
# The same with --cross-entropy-loss-fusion (megatron-core's fused_vocab_parallel_cross_entropy,
# each of its four steps one torch.compile'd kernel): the GEMM writes bf16 logits (2); the max
# reads them and writes the fp32 copy it returns (2 + 4); the shift, exp and row sum in one pass
# (4 + 4); the division into the softmax kept for backward (4 + 4); backward, the gradient scaled
# in place and cast to bf16 in one pass, the in-place result written back too (4 + 4 + 2); read by
# the two gradient GEMMs (2 + 2). 38 in all: with the GEMM's FLOPs, 0.78 of the unfused output term at
# Qwen2.5-0.5B's shapes on an H200, as measured there (4xH200, 64K, the same global batches: 0.78-0.79).
_FUSED_LOSS_BYTES_PER_LOGIT = 2 + (2 + 4) + (4 + 4) + (4 + 4) + (4 + 4 + 2) + (2 + 2)
_ATTN_FLOPS_PER_PAIR_UNIT = 14.0
# Forward+backward FLOPs of a linear layer per weight per token: 2 forward, 4 backward.
_LINEAR_FLOPS_PER_WEIGHT = 6.0
# Bytes moved by the elementwise work of one layer per token, in units of hidden (and ffn) values,
# forward+backward: norms, residuals, RoPE, bias, SiLU*gate, their gradients, activations saved
# for backward and read back.
_ELEMENTWISE_HIDDEN_RW = 40.0
_ELEMENTWISE_FFN_RW = 12.0


class AnalyticLatencyModel(LatencyModel):
    """FLOP/byte latency model of one pipeline stage; no profile needed.

    ``T(pack, k) = fixed + dense(T_total) + sum_seq attention(L, k)``, with

    * attention(L, k) = ``attention_block_pairs(L, k, B) * 14 * B^2 * d * heads`` FLOPs (the
      blocks actually computed, forward and backward) plus the router's block scores, over the
      attention rate;
    * dense(T) = ``6 * weights * T`` FLOPs of the linear layers (plus the output layer on the
      last stage) over the matmul rate, plus the elementwise bytes over the memory rate;
    * fixed = per-layer and per-micro-batch overheads plus reading weights and writing their
      gradients once per micro-batch.

    Args:
        shape: a :class:`~megatron_sparsebalance.training.model.ModelShape`.
        layers_per_stage: transformer layers on this pipeline stage.
        block_size: attention block size ``B``.
        hardware: a :class:`Hardware` or a key of :data:`HARDWARE`.
        dtype_bytes: 2 for bf16/fp16, 4 for fp32.
        pre_process / post_process: the stage holds the embedding / the output layer and loss.
        tensor_parallel_size: heads and FFN columns split over this many GPUs.
        sequence_parallel: the norms and residuals run on ``1/TP`` of the tokens per GPU instead
            of all of them.
        tp_link_gbps: bus bandwidth of the TP collectives (GB/s achieved per GPU; NVLink within a
            node). Given, each layer adds its four collectives (an all-reduce of its ``[tokens, h]``
            activations after attention and after the MLP, forward and backward; under sequence
            parallelism the same bytes as all-gathers and reduce-scatters). Default: not priced
            (online calibration absorbs them as part of the per-token cost).
        fused_cross_entropy: the loss runs megatron-core's fused cross entropy
            (``--cross-entropy-loss-fusion``): fewer passes over the logits on a ``post_process`` stage.
    """

    kind = "analytic"

    def __init__(
        self,
        shape,
        layers_per_stage: int,
        block_size: int = 128,
        hardware="h200",
        dtype_bytes: int = 2,
        pre_process: bool = False,
        post_process: bool = False,
        tensor_parallel_size: int = 1,
        sequence_parallel: bool = False,
        tp_link_gbps: Optional[float] = None,
        fused_cross_entropy: bool = False,
        **common,
    ):
        super().__init__(**common)
        self.fused_cross_entropy = bool(fused_cross_entropy)
        self.shape = _shape_dict(shape)
        self.layers_per_stage = int(layers_per_stage)
        self.block_size = int(block_size)
        self.hardware = HARDWARE[hardware] if isinstance(hardware, str) else hardware
        self.dtype_bytes = int(dtype_bytes)
        self.pre_process = bool(pre_process)
        self.post_process = bool(post_process)
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_link_gbps = None if tp_link_gbps is None else float(tp_link_gbps)
        if self.tp_link_gbps is not None and self.tp_link_gbps <= 0:
            raise ValueError(f"tp_link_gbps must be > 0, got {tp_link_gbps}")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("sequence_parallel needs tensor_parallel_size > 1")
        if self.layers_per_stage < 1 or self.block_size < 1 or self.tensor_parallel_size < 1:
            raise ValueError("layers_per_stage, block_size and tensor_parallel_size must be >= 1")
        self._precompute()

    def _precompute(self) -> None:
        s, hw, tp, nl = self.shape, self.hardware, self.tensor_parallel_size, self.layers_per_stage
        h, d = s["hidden_size"], s["kv_channels"]
        nq, ng, ffn = s["num_attention_heads"] / tp, s["num_query_groups"] / tp, s["ffn_hidden_size"] / tp
        qkv = h * (nq + 2 * ng) * d
        weights = qkv + nq * d * h + 3 * h * ffn  # QKV, output projection, gated MLP (up, gate, down)
        out_weights = h * s["vocab_size"] / tp if self.post_process else 0.0
        flops_per_token = _LINEAR_FLOPS_PER_WEIGHT * (weights * nl + out_weights)
        self._dense_flops_per_token = flops_per_token
        hidden_share = 1.0 / tp if self.sequence_parallel else 1.0  # norms and residuals: SP splits their tokens
        bytes_per_token = nl * self.dtype_bytes * (_ELEMENTWISE_HIDDEN_RW * h * hidden_share + _ELEMENTWISE_FFN_RW * ffn)
        if self.post_process:
            loss_bytes = _FUSED_LOSS_BYTES_PER_LOGIT if self.fused_cross_entropy else _LOSS_BYTES_PER_LOGIT
            bytes_per_token += loss_bytes * s["vocab_size"] / tp
        # TP collectives: 4 per layer (attention and MLP, forward and backward), each a ring moving
        # 2 (tp - 1) / tp of the layer's [tokens, h] activations per GPU.
        comm_bytes_per_token = nl * 4 * 2 * (tp - 1) / tp * h * self.dtype_bytes
        comm_ms_per_token = comm_bytes_per_token / (self.tp_link_gbps * 1e6) if self.tp_link_gbps else 0.0
        self._dense_ms_per_token = (flops_per_token / (hw.matmul_tflops * 1e9) + bytes_per_token / (hw.memory_gbps * 1e6)
                                    + comm_ms_per_token)
        weight_bytes = (weights * nl + out_weights) * self.dtype_bytes
        if self.pre_process:
            weight_bytes += h * s["vocab_size"] / tp * self.dtype_bytes
        # weights read in forward and backward, their gradients written (fp32 main grads)
        fixed_bytes = weight_bytes * 2 + (weight_bytes / self.dtype_bytes) * 4
        self._fixed_ms = hw.microbatch_overhead_ms + nl * hw.layer_overhead_ms + fixed_bytes / (hw.memory_gbps * 1e6)
        B = self.block_size
        self._attn_ms_per_pair = nl * _ATTN_FLOPS_PER_PAIR_UNIT * B * B * d * nq / (hw.attention_tflops * 1e9)
        # router: mean-pooled q.k over all earlier block pairs of each group, forward only
        self._router_ms_per_block_pair = nl * 2.0 * d * ng / (hw.attention_tflops * 1e9)

    def _dense_ms(self, total_tokens: int) -> float:
        return self._fixed_ms + self._dense_ms_per_token * total_tokens

    def _attention_ms(self, length: int, k: int) -> float:
        n = length / self.block_size
        return (self._attn_ms_per_pair * attention_block_pairs(length, k, self.block_size)
                + self._router_ms_per_block_pair * n * (n + 1) / 2.0)

    def attention_flops(self, lengths: Sequence[int], k: int) -> float:
        """Forward+backward FLOPs of the pack's sparse attention on this stage (sparse-aware: the
        blocks actually computed, summed per sequence)."""
        s = self.shape
        B = self.block_size
        per_pair = _ATTN_FLOPS_PER_PAIR_UNIT * B * B * s["kv_channels"] * s["num_attention_heads"] / self.tensor_parallel_size
        return self.layers_per_stage * per_pair * sum(attention_block_pairs(n, k, B) for n in lengths if n > 0)

    def flops(self, lengths: Sequence[int], k: int) -> float:
        """Forward+backward FLOPs of the pack on this stage: linear layers (and output layer) per
        token plus the sparse-aware attention FLOPs (what a FLOP-only model would go by)."""
        tokens = sum(n for n in lengths if n > 0)
        return self._dense_flops_per_token * tokens + self.attention_flops(lengths, k)

    def _params(self) -> dict:
        return {
            "shape": self.shape, "layers_per_stage": self.layers_per_stage, "block_size": self.block_size,
            "hardware": asdict(self.hardware), "dtype_bytes": self.dtype_bytes, "pre_process": self.pre_process,
            "post_process": self.post_process, "tensor_parallel_size": self.tensor_parallel_size,
            "sequence_parallel": self.sequence_parallel, "tp_link_gbps": self.tp_link_gbps,
            "fused_cross_entropy": self.fused_cross_entropy,
        }

    @classmethod
    def _from_params(cls, params, **common) -> "AnalyticLatencyModel":
        p = dict(params)
        p["hardware"] = Hardware(**p["hardware"])
        return cls(**p, **common)


def _isotonic(values: Sequence[float]) -> list:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators)."""
    blocks: list = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out = []
    for s, c in blocks:
        out.extend([s / c] * c)
    return out


def _shape_dict(shape) -> dict:
    d = _jsonable(shape)
    missing = {"hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size"} - set(d)
    if missing:
        raise ValueError(f"model shape lacks {sorted(missing)}")
    return d


# --------------------------------------------------------------------------------------------
# Profiled model


class ProfiledLatencyModel(LatencyModel):
    """Lookup table over (sequence length, budget) measured on the real layer stack of a stage.

    The profile (``tools/profile_latency.py``) measures, for single-sequence micro-batches of
    each profiled length ``L_j`` and budget ``k_i``:

    * ``total[j][i]``: the stage's forward+backward ms;
    * ``attention[j][i]``: the attention part: the sparse attention (router included) of all the
      stage's layers run alone, minus its fixed launch cost (measured on a one-block sequence),
      since that cost is paid once per pack, not once per sequence.

    From those the model keeps ``dense[j] = median_i(total - attention)`` (a function of tokens
    only) and ``attn[j][i] = total[j][i] - dense[j]``, read as a curve of attention time against
    work ``P = attention_block_pairs(L_j, k_i)`` for each profiled budget ``k_i``. A pack is

        ``dense(sum L) + attn_k(sum_seq attention_block_pairs(L_s, k))``

    so a single sequence at a grid point is predicted exactly (``dense + attn = total``), and a
    pack pays the attention's latency floor once, as its single kernel launch does. (Summing
    isolated per-sequence attention times instead over-predicted packs by a median 21% on the
    H200: docs/LATENCY.md.)

    Interpolation, chosen so the prediction is monotone by construction:

    * in work, piecewise-linear in block pairs for ``attn`` (the cost's shape: ~L^2 while
      ``L/B <= k``, linear after), and in tokens for ``dense``;
    * in budget, linear in ``k`` between the two profiled budgets around it (weights that do not
      depend on the lengths);
    * outside the profiled range (with one logged warning per kind): beyond the longest profiled
      work, ``attn`` continues its last segment's slope per block pair, below the shortest it
      scales down to 0 at no work; ``dense`` continues its end segments' slopes; budgets beyond
      the largest add their extra block pairs at the largest budget's marginal rate, budgets
      below the smallest go linearly to 0 at ``k = 0``.

    The dense part is the median over budgets of ``total - attention`` (robust to one disturbed
    point), and the table is made monotone on load (isotonic regression along ``k``, then ``L``),
    which leaves a measured table that already is monotone unchanged.
    """

    kind = "profiled"

    def __init__(
        self,
        lengths: Sequence[int],
        budgets: Sequence[int],
        total_ms: Sequence[Sequence[float]],
        attention_ms: Sequence[Sequence[float]],
        block_size: int,
        **common,
    ):
        super().__init__(**common)
        self.lengths = [int(x) for x in lengths]
        self.budgets = [int(x) for x in budgets]
        self.block_size = int(block_size)
        self.total_ms = [[float(v) for v in row] for row in total_ms]
        self.attention_ms = [[float(v) for v in row] for row in attention_ms]
        nL, nK = len(self.lengths), len(self.budgets)
        if nL < 1 or nK < 1:
            raise ValueError("a latency table needs at least one length and one budget")
        if self.lengths != sorted(set(self.lengths)) or self.budgets != sorted(set(self.budgets)):
            raise ValueError("profiled lengths and budgets must be strictly increasing")
        if self.lengths[0] < 1 or self.budgets[0] < 1:
            raise ValueError("profiled lengths and budgets must be >= 1")
        for name, table in (("total_ms", self.total_ms), ("attention_ms", self.attention_ms)):
            if len(table) != nL or any(len(row) != nK for row in table):
                raise ValueError(f"{name} must be [{nL} lengths][{nK} budgets]")
            if any(not math.isfinite(v) or v < 0 for row in table for v in row):
                raise ValueError(f"{name} holds negative or non-finite times")
        self._warned: set = set()
        self._cache: dict = {}
        self._pairs_cache: dict = {}
        self._build()

    def _build(self) -> None:
        nL, nK = len(self.lengths), len(self.budgets)
        attn_meas = [[min(self.attention_ms[j][i], self.total_ms[j][i]) for i in range(nK)] for j in range(nL)]
        # The dense part of a length is the same at every budget: the median over budgets keeps
        # one disturbed measurement from shifting the whole row.
        dense = _isotonic([statistics.median(self.total_ms[j][i] - attn_meas[j][i] for i in range(nK)) for j in range(nL)])
        attn = [[max(0.0, self.total_ms[j][i] - dense[j]) for i in range(nK)] for j in range(nL)]
        # Monotone in k, then in L. Isotonic regression rather than a running maximum: an outlier
        # is averaged with its neighbours instead of being carried to every longer length; it is
        # order-preserving, so the second pass keeps the rows monotone; and a table that already
        # is monotone comes out unchanged (exact at its grid points).
        attn = [_isotonic(row) for row in attn]
        cols = [_isotonic([attn[j][i] for j in range(nL)]) for i in range(nK)]
        attn = [[cols[i][j] for i in range(nK)] for j in range(nL)]
        self._dense = dense
        self._attn = attn
        B = self.block_size
        # x-coordinates of the interpolation (block pairs of work), per budget column
        self._pairs = [[attention_block_pairs(L, k, B) for L in self.lengths] for k in self.budgets]
        self._attn_cols = [[attn[j][i] for j in range(nL)] for i in range(nK)]
        # ms per extra block pair beyond the profiled work: the last segment's slope (the GPU is
        # saturated there); the average rate of the largest point where that segment is flat
        self._slope_hi = []
        for xs, ys in zip(self._pairs, self._attn_cols):
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if nL >= 2 and xs[-1] > xs[-2] else 0.0
            if slope <= 0.0:
                slope = ys[-1] / xs[-1] if xs[-1] > 0 else 0.0
            self._slope_hi.append(slope)
        if nL >= 2:
            self._dense_slope_lo = (dense[1] - dense[0]) / (self.lengths[1] - self.lengths[0])
            self._dense_slope_hi = (dense[-1] - dense[-2]) / (self.lengths[-1] - self.lengths[-2])
        else:  # one length: dense proportional to tokens
            self._dense_slope_lo = self._dense_slope_hi = dense[0] / self.lengths[0]

    def _warn_once(self, what: str, detail: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("latency table: %s; extrapolating with the cost's shape (%s)", detail,
                           "dense part linear in tokens, attention ~ min(k, L/B) * L")

    def _dense_ms(self, total_tokens: int) -> float:
        Ls, dense = self.lengths, self._dense
        if total_tokens > Ls[-1]:
            self._warn_once("dense_hi", f"{total_tokens} tokens in a micro-batch, beyond the profiled {Ls[-1]}")
            return dense[-1] + self._dense_slope_hi * (total_tokens - Ls[-1])
        if total_tokens < Ls[0]:
            return max(0.0, dense[0] - self._dense_slope_lo * (Ls[0] - total_tokens))
        j = bisect.bisect_left(Ls, total_tokens)
        if Ls[j] == total_tokens:
            return dense[j]
        w = (total_tokens - Ls[j - 1]) / (Ls[j] - Ls[j - 1])
        return dense[j - 1] + w * (dense[j] - dense[j - 1])

    def _pair_vector(self, length: int) -> list:
        """Block pairs of one sequence at every profiled budget (cached: a run's lengths repeat)."""
        v = self._pairs_cache.get(length)
        if v is None:
            B = self.block_size
            v = [attention_block_pairs(length, k, B) for k in self.budgets]
            if len(self._pairs_cache) >= 65536:
                self._pairs_cache.clear()
            self._pairs_cache[length] = v
        return v

    def _column(self, i: int, pairs: float) -> float:
        """Attention ms of budget column ``i`` for ``pairs`` block pairs of work."""
        xs, ys = self._pairs[i], self._attn_cols[i]
        if pairs >= xs[-1]:
            if pairs == xs[-1]:
                return ys[-1]
            self._warn_once("len_hi", f"{pairs:.0f} block pairs at k={self.budgets[i]}, beyond the profiled {xs[-1]:.0f} "
                                      f"(a sequence of {self.lengths[-1]} tokens)")
            return ys[-1] + self._slope_hi[i] * (pairs - xs[-1])
        if pairs <= xs[0]:
            # Short sequences are common and the shape down to zero work is known: no warning.
            return ys[0] * pairs / xs[0]
        j = bisect.bisect_left(xs, pairs)
        if xs[j] == pairs:
            return ys[j]
        lo, hi = xs[j - 1], xs[j]
        if hi <= lo:
            return ys[j]
        return ys[j - 1] + (pairs - lo) / (hi - lo) * (ys[j] - ys[j - 1])

    def _pack_columns(self, lengths: tuple) -> tuple:
        """The pack's attention ms at every profiled budget (non-decreasing across budgets) and
        its block pairs at every profiled budget. Cached per pack: ``align`` bisects over
        budgets on the same pack."""
        hit = self._cache.get(lengths)
        if hit is not None:
            return hit
        nK = len(self.budgets)
        total = [0.0] * nK
        for n in lengths:
            v = self._pair_vector(n)
            for i in range(nK):
                total[i] += v[i]
        cols = [self._column(i, total[i]) for i in range(nK)]
        # each column follows its own budget's shape; two shapes can cross between grid points
        for i in range(1, nK):
            if cols[i] < cols[i - 1]:
                cols[i] = cols[i - 1]
        if len(self._cache) >= 65536:  # bounded: the packs of a long run are many
            self._cache.clear()
        self._cache[lengths] = hit = (cols, total)
        return hit

    def _pack_attention_ms(self, lengths: tuple, k: int) -> float:
        Ks = self.budgets
        cols, pairs = self._pack_columns(lengths)
        if k >= Ks[-1]:
            if k == Ks[-1]:
                return cols[-1]
            self._warn_once("k_hi", f"budget {k} beyond the profiled {Ks[-1]}")
            # the extra block pairs of the larger budget at the largest budget's marginal rate
            B = self.block_size
            extra = sum(attention_block_pairs(n, k, B) for n in lengths) - pairs[-1]
            return cols[-1] + self._slope_hi[-1] * max(0.0, extra)
        if k <= Ks[0]:
            if k == Ks[0]:
                return cols[0]
            self._warn_once("k_lo", f"budget {k} below the profiled {Ks[0]}")
            return cols[0] * max(k, 0) / Ks[0]
        i = bisect.bisect_left(Ks, k)
        if Ks[i] == k:
            return cols[i]
        w = (k - Ks[i - 1]) / (Ks[i] - Ks[i - 1])
        return cols[i - 1] + w * (cols[i] - cols[i - 1])

    def _attention_ms(self, length: int, k: int) -> float:
        return self._pack_attention_ms((length,), k)

    def predict_raw(self, lengths: Sequence[int], k: int) -> float:
        """Uncalibrated ms: ``dense(total tokens) + attention(total block pairs of the pack)``."""
        seqs = tuple(n for n in lengths if n > 0)
        if not seqs:
            return 0.0
        return self._dense_ms(sum(seqs)) + self._pack_attention_ms(seqs, k)

    def _params(self) -> dict:
        return {
            "lengths": self.lengths, "budgets": self.budgets, "block_size": self.block_size,
            "total_ms": self.total_ms, "attention_ms": self.attention_ms,
        }

    @classmethod
    def _from_params(cls, params, **common) -> "ProfiledLatencyModel":
        return cls(params["lengths"], params["budgets"], params["total_ms"], params["attention_ms"],
                   params["block_size"], **common)


_MODEL_TYPES = {"analytic": AnalyticLatencyModel, "profiled": ProfiledLatencyModel}
