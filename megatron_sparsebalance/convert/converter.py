"""Whole-checkpoint conversion and its numerical check.

Conversion runs in one process at TP = PP = 1 on the CPU: the full megatron model is built, the
mapped tensors are copied in, and ``save_checkpoint`` writes a weights-only checkpoint
(``iteration = 0``) in our layout. megatron-core's ``dist_checkpointing`` reshards it on load to
any pipeline (and tensor) layout, so the layout is chosen when training starts, not here.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Dict, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.compat import initialize_model_parallel
from megatron_sparsebalance.convert.hf_config import check_pipeline_layout, hf_model_info, megatron_flags
from megatron_sparsebalance.convert.hf_io import (copy_side_files, load_hf_config, load_hf_weights,
                                                  save_hf_weights)
from megatron_sparsebalance.convert.mapping import hf_to_mcore, mcore_to_hf
from megatron_sparsebalance.training.checkpointing import (COMPLETE, iteration_dir, latest_checkpoint, load_checkpoint,
                                                           save_checkpoint)
from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
from megatron_sparsebalance.training.dist import init_distributed
from megatron_sparsebalance.training.model import ModelShape, build_gpt_model, transformer_config
from megatron_sparsebalance.training.tensor_parallel import validate_tensor_parallel

REPORT = "conversion.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VerificationError(RuntimeError):
    """The converted model's logits differ from the source's beyond the tolerance."""


# ----------------------------------------------------------------------------- provenance

def provenance(command: str, args: dict) -> dict:
    """What produced a converted checkpoint: the converter's arguments and the library versions."""
    versions = {"python": platform.python_version()}
    for dist_name in ("torch", "megatron-core", "transformers", "safetensors", "megatron-sparsebalance"):
        try:
            versions[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            versions[dist_name] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(__file__), capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "tool": "tools/convert_checkpoint.py",
        "command": command,
        "args": {k: v for k, v in args.items() if k != "func"},
        "versions": versions,
        "megatron_sparsebalance_commit": commit,
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------- megatron side

def ensure_single_process_megatron() -> None:
    """Process group and Megatron's groups for a one-process, TP = PP = 1, CPU conversion."""
    enable_cpu_megatron()
    if not dist.is_initialized():
        init_distributed(1, 1, backend="gloo")
    elif not parallel_state.model_parallel_is_initialized():
        initialize_model_parallel(1, 1)
    if (dist.get_world_size() != 1 or parallel_state.get_pipeline_model_parallel_world_size() != 1
            or parallel_state.get_tensor_model_parallel_world_size() != 1):
        raise ValueError("conversion runs in a single process (TP = PP = 1); the checkpoint reshards on load")


def full_budget_sparse_config(seq_length: int, block_size: int = 64) -> SparseAttentionConfig:
    """Our sparse attention with a budget covering every block: dense, through our own code path."""
    return SparseAttentionConfig(sparse_attention=True, moba_block_size=block_size,
                                 moba_topk=max(1, math.ceil(seq_length / block_size)), track_coverage=False)


@contextlib.contextmanager
def _cpu_tied_embedding_sync(shape: ModelShape, pipeline_parallel_size: int):
    """Let megatron-core's construction-time sync of tied embeddings run on a CPU-only host.

    With PP > 1 and tied embeddings, GPTModel zeroes the last stage's copy of the embedding and
    all-reduces it with the first stage's over the embedding group after ``weight.data.cuda()``,
    which raises without CUDA. For the length of the construction ``.cuda()`` is the identity
    (gloo reduces CPU tensors); loading the checkpoint then overwrites both copies anyway.
    """
    if torch.cuda.is_available() or pipeline_parallel_size == 1 or shape.untie_embeddings_and_output_weights:
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def build_model(shape: ModelShape, sparse: Optional[SparseAttentionConfig] = None, initialize: bool = True,
                max_sequence_length: int = 4096):
    """This rank's stage of the model for the current Megatron groups (any PP/TP layout)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    check_pipeline_layout(shape.num_layers, pp)
    config = transformer_config(shape, pipeline_parallel_size=pp, tensor_parallel_size=tp)
    # Every parameter is overwritten by the converted or loaded weights: skip the random init.
    config.perform_initialization = initialize
    with _cpu_tied_embedding_sync(shape, pp):
        return build_gpt_model(shape, sparse or full_budget_sparse_config(max_sequence_length), config,
                               max_sequence_length=max_sequence_length,
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage())


def assign_parameters(model, params: Dict[str, torch.Tensor]) -> None:
    """Copy ``params`` into the model's parameters; every parameter must be given, with its shape."""
    own = dict(model.named_parameters())
    missing, unexpected = sorted(set(own) - set(params)), sorted(set(params) - set(own))
    if missing or unexpected:
        raise ValueError(f"mapped tensors do not match the megatron model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in own.items():
            if tuple(params[name].shape) != tuple(p.shape):
                raise ValueError(f"tensor {name}: mapped shape {tuple(params[name].shape)}, megatron model {tuple(p.shape)}")
            p.copy_(params[name])


def checkpoint_common(path: str) -> dict:
    return dist_checkpointing.load_common_state_dict(path).get("common", {})


def resolve_checkpoint(load: str) -> str:
    path = latest_checkpoint(load)
    if path is None:
        raise ValueError(f"{load} holds no checkpoint (no 'complete' marker, no latest_checkpointed_iteration.txt)")
    return path


def load_converted(load: str, sparse: Optional[SparseAttentionConfig] = None, max_sequence_length: int = 4096):
    """Build this rank's stage (current Megatron groups) from a converted checkpoint's recorded
    shape and load its weights; returns ``(model, common)``. Works at any PP that divides the layers."""
    path = resolve_checkpoint(load)
    common = checkpoint_common(path)
    if "model_shape" not in common:
        raise ValueError(f"{path} records no model_shape: not written by the converter")
    shape = ModelShape(**common["model_shape"])
    check_pipeline_layout(shape.num_layers, parallel_state.get_pipeline_model_parallel_world_size(), what=path)
    model = build_model(shape, sparse, initialize=False, max_sequence_length=max_sequence_length)
    load_checkpoint(path, model)
    return model, common


# ----------------------------------------------------------------------------- verification

@dataclass
class Tolerance:
    atol: float = 1e-3
    """Largest logit difference allowed, plus rtol times the largest |logit| of the source."""
    rtol: float = 1e-4
    max_kl: float = 1e-5
    """Largest mean KL(source || converted) per token, in nats."""


@dataclass
class VerifyReport:
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    max_abs_logit: float
    kl_mean: float
    kl_max: float
    tokens: int
    tolerance: dict = field(default_factory=dict)
    passed: bool = False

    def line(self) -> str:
        return (f"verify: max |logit diff| {self.max_abs_logit_diff:.3e} (mean {self.mean_abs_logit_diff:.3e}, "
                f"max |logit| {self.max_abs_logit:.2f}), KL mean {self.kl_mean:.3e} max {self.kl_max:.3e} "
                f"over {self.tokens} tokens: {'PASS' if self.passed else 'FAIL'}")


def compare_logits(reference: torch.Tensor, converted: torch.Tensor, tol: Tolerance = Tolerance()) -> VerifyReport:
    """Compare ``[..., V]`` logits of the source (reference) and the converted model."""
    if reference.shape != converted.shape:
        raise VerificationError(f"logit shapes differ: source {tuple(reference.shape)}, converted {tuple(converted.shape)}")
    ref = reference.double().reshape(-1, reference.shape[-1])
    out = converted.double().reshape(-1, converted.shape[-1])
    diff = (ref - out).abs()
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    finite = bool(torch.isfinite(out).all())  # NaN never passes
    report = VerifyReport(
        max_abs_logit_diff=float(diff.max()) if finite else float("inf"),
        mean_abs_logit_diff=float(diff.mean()) if finite else float("inf"),
        max_abs_logit=float(ref.abs().max()),
        kl_mean=float(kl.mean()) if finite else float("inf"),
        kl_max=float(kl.max()) if finite else float("inf"),
        tokens=ref.shape[0],
        tolerance=asdict(tol),
    )
    report.passed = (finite and report.max_abs_logit_diff <= tol.atol + tol.rtol * report.max_abs_logit
                     and report.kl_mean <= tol.max_kl)
    return report


def verify_tokens(vocab_size: int, seq_length: int, batch_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_length), generator=gen)


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[b, s, vocab_size]`` logits of a full (PP = 1) megatron model; the padding columns dropped."""
    model.eval()
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, position_ids, None)[..., :vocab_size].float()


@torch.no_grad()
def hf_logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the HF model in ``model_dir``, run by transformers in fp32 (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True)
    model.eval()
    return model(input_ids=tokens).logits.float()


@dataclass
class VerifySettings:
    seq_length: int = 256
    batch_size: int = 2
    seed: int = 1234
    block_size: int = 64
    tolerance: Tolerance = field(default_factory=Tolerance)


# ----------------------------------------------------------------------------- conversions

def _finish(out: str, report: dict, log, result=None, failure: str = "") -> None:
    """Write the report beside the output (with the verification, if any) and fail if it failed.

    The report is written before raising, so a failed conversion still says what it compared.
    """
    if result is not None:
        report["verify"] = asdict(result)
    _write_report(out, report)
    if result is not None:
        log(result.line())
        if not result.passed:
            raise VerificationError(f"{out}: {failure}: {result.line()}")


def _write_report(directory: str, report: dict) -> None:
    with open(os.path.join(directory, REPORT), "w") as f:
        json.dump(report, f, indent=2, default=str)


def _refuse_to_overwrite_a_run(save: str) -> None:
    """Writing iteration 0 into a directory whose latest checkpoint is later would point its
    ``latest_checkpointed_iteration.txt`` back at the untrained weights."""
    if os.path.exists(os.path.join(save, COMPLETE)):
        raise ValueError(f"--save {save} is a checkpoint directory itself; give the root to write iter_0000000 under")
    try:
        latest = latest_checkpoint(save)
    except ValueError:
        latest = None
    if latest is not None and os.path.normpath(latest) != os.path.normpath(iteration_dir(save, 0)):
        raise ValueError(f"--save {save} already holds a run (latest checkpoint {latest}); choose an empty directory")


def convert_hf_to_mcore(hf_dir: str, save: str, make_vocab_size_divisible_by: int = 128,
                        target_pipeline_parallel_size: int = 1, verify: Optional[VerifySettings] = None,
                        record: Optional[dict] = None, log=print, target_tensor_parallel_size: int = 1) -> dict:
    """HF model directory -> weights-only checkpoint ``<save>/iter_0000000``; returns the report.

    ``target_pipeline_parallel_size`` only checks that the intended layout divides the layers
    (the checkpoint itself loads at any such layout). ``target_tensor_parallel_size`` pads the
    vocabulary as Megatron-LM does at that TP (a multiple of ``make_vocab_size_divisible_by`` x TP)
    and checks that the TP splits the model; the checkpoint loads at any TP dividing that padded
    vocabulary (dist_checkpointing reshards). With ``verify``, the checkpoint is read back
    from disk and its logits compared with the HF model's; a VerificationError above tolerance.
    """
    _refuse_to_overwrite_a_run(save)
    config = load_hf_config(hf_dir)
    info = hf_model_info(config, make_vocab_size_divisible_by, target_tensor_parallel_size)
    check_pipeline_layout(info.shape.num_layers, target_pipeline_parallel_size, what=hf_dir,
                          flag="--target-pipeline-model-parallel-size")
    try:
        validate_tensor_parallel(info.shape, target_tensor_parallel_size, sequence_parallel=False)
    except ValueError as e:
        raise ValueError(f"--target-tensor-model-parallel-size: {e}") from None
    params = hf_to_mcore(load_hf_weights(hf_dir), info)
    # fp32 on the megatron side: lossless for bf16/fp16 sources, and what the optimizer keeps.
    params = {k: v.float() for k, v in params.items()}
    ensure_single_process_megatron()
    model = build_model(info.shape, initialize=False)
    assign_parameters(model, params)
    del params
    common = {
        "converter": record or provenance("hf-to-mcore", {"hf_dir": hf_dir, "save": save}),
        "source": os.path.abspath(hf_dir),
        "model_shape": asdict(info.shape),
        "megatron_flags": megatron_flags(info.shape),
        "hf_architecture": info.architecture,
        "hf_vocab_size": info.hf_vocab_size,
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
        "target_tensor_model_parallel_size": target_tensor_parallel_size,
        "hf_config": config.to_dict(),
    }
    path = save_checkpoint(save, 0, model, None, common=common)
    log(f"wrote {path} ({info.architecture}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")
    log(f"megatron model flags: {common['megatron_flags']}")
    report = {k: common[k] for k in ("converter", "source", "model_shape", "megatron_flags", "hf_architecture")}
    report["checkpoint"] = path
    if verify is not None:
        del model
        tokens = verify_tokens(info.hf_vocab_size, verify.seq_length, verify.batch_size, verify.seed)
        reloaded, _ = load_converted(path, full_budget_sparse_config(verify.seq_length, verify.block_size),
                                     max_sequence_length=verify.seq_length)
        result = compare_logits(hf_logits(hf_dir, tokens), megatron_logits(reloaded, tokens, info.hf_vocab_size),
                                verify.tolerance)
        _finish(path, report, log, result, f"converted logits differ from {hf_dir}")
    else:
        _finish(path, report, log)
    return report


def _config_from_common(common: dict, path: str):
    from transformers import AutoConfig

    saved = dict(common.get("hf_config") or {})
    if not saved:
        raise ValueError(f"{path} records no Hugging Face config (a training checkpoint?): pass --hf-config "
                         f"with the original model's directory or config.json")
    return AutoConfig.for_model(saved.pop("model_type"), **saved)


def convert_mcore_to_hf(load: str, save: str, hf_config: Optional[str] = None, dtype: str = "auto",
                        make_vocab_size_divisible_by: Optional[int] = None, verify: Optional[VerifySettings] = None,
                        record: Optional[dict] = None, max_shard_bytes: int = 5 * 1024**3, log=print) -> dict:
    """Checkpoint (converted or trained) -> HF model directory; returns the report.

    The HF config comes from ``hf_config`` (a model directory or config.json; its tokenizer files
    are copied too) or from the one the converter recorded. ``dtype`` ``auto`` keeps the config's.
    """
    path = resolve_checkpoint(load)
    common = checkpoint_common(path)
    config = load_hf_config(hf_config) if hf_config else _config_from_common(common, path)
    divisible_by = make_vocab_size_divisible_by or common.get("make_vocab_size_divisible_by", 128)
    info = hf_model_info(config, divisible_by, common.get("target_tensor_model_parallel_size", 1))
    recorded = common.get("model_shape")
    if recorded is not None and recorded != asdict(info.shape):
        diff = {k: (recorded.get(k), v) for k, v in asdict(info.shape).items() if recorded.get(k) != v}
        raise ValueError(f"the HF config does not match the shape {path} was written with: "
                         f"{ {k: f'checkpoint {a}, config {b}' for k, (a, b) in diff.items()} }")
    ensure_single_process_megatron()
    seq = verify.seq_length if verify else 4096
    sparse = full_budget_sparse_config(seq, verify.block_size if verify else 64)
    model = build_model(info.shape, sparse, initialize=False, max_sequence_length=seq)
    try:
        load_checkpoint(path, model)
    except ValueError:
        raise
    except Exception as e:  # dist_checkpointing's shape/key errors: say which config they came from
        raise ValueError(f"checkpoint {path} does not match the model of the HF config "
                         f"({megatron_flags(info.shape)}): {e}") from e
    params = {name: p.detach() for name, p in model.named_parameters()}
    out_dtype = _output_dtype(dtype, config)
    tensors = {k: v.to(out_dtype) for k, v in mcore_to_hf(params, info).items()}
    report = {
        "converter": record or provenance("mcore-to-hf", {"load": load, "save": save}),
        "source": path,
        "source_converter": common.get("converter"),
        "source_iteration": common.get("iteration"),
        "hf_architecture": info.architecture,
        "dtype": str(out_dtype).replace("torch.", ""),
    }
    os.makedirs(save, exist_ok=True)
    config.architectures = [info.architecture]
    config.dtype = report["dtype"]
    config.save_pretrained(save)
    files = save_hf_weights(tensors, save, {"megatron_sparsebalance.converter": json.dumps(report, default=str)},
                            max_shard_bytes)
    if hf_config and os.path.isdir(hf_config):
        report["copied"] = copy_side_files(hf_config, save)
    log(f"wrote {save}: {', '.join(files)} ({info.architecture}, {report['dtype']})")
    if verify is not None:
        tokens = verify_tokens(info.hf_vocab_size, verify.seq_length, verify.batch_size, verify.seed)
        result = compare_logits(megatron_logits(model, tokens, info.hf_vocab_size), hf_logits(save, tokens),
                                _dtype_tolerance(verify.tolerance, out_dtype))
        _finish(save, report, log, result, f"HF logits differ from {path}")
    else:
        _finish(save, report, log)
    return report


def _output_dtype(dtype: str, config) -> torch.dtype:
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        dtype = str(dtype).replace("torch.", "")
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _dtype_tolerance(tol: Tolerance, dtype: torch.dtype) -> Tolerance:
    """Rounding the weights to 16 bits moves the logits by far more than fp32 arithmetic does;
    the check then guards against mapping errors (order-one differences), not rounding."""
    if dtype == torch.float32:
        return tol
    return Tolerance(atol=max(tol.atol, 0.1), rtol=max(tol.rtol, 0.02), max_kl=max(tol.max_kl, 1e-2))
