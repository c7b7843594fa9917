"""What the real-model benchmarks share: a converted checkpoint (or its architecture at random init)
on one device, held-out token windows, per-token loss, and passkey retrieval prompts.

Used by ``benchmarks/realworld_coverage.py`` and ``benchmarks/realworld_extension.py`` (see
docs/REAL_MODEL.md). One process, TP = PP = 1: the 135M model fits any GPU many times over.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.convert.converter import checkpoint_common, ensure_single_process_megatron, resolve_checkpoint
from megatron_sparsebalance.training.checkpointing import load_checkpoint
from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
from megatron_sparsebalance.training.dist import init_distributed
from megatron_sparsebalance.training.model import ModelShape, build_gpt_model, transformer_config

# Passkey prompts: a number planted at a depth of a held-out document, asked for at the end.
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def checkpoint_shape(checkpoint: str) -> ModelShape:
    common = checkpoint_common(resolve_checkpoint(checkpoint))
    if "model_shape" not in common:
        raise ValueError(f"{checkpoint} records no model_shape (not written by the converter or pretrain)")
    return ModelShape(**common["model_shape"])


def build(shape: ModelShape, sparse: SparseAttentionConfig, max_sequence_length: int,
          checkpoint: Optional[str] = None, bf16: bool = False, seed: int = 1234):
    """The model on this process's device: the checkpoint's weights, or (``checkpoint`` None)
    megatron-core's random initialisation of the same architecture with ``seed``."""
    # NCCL on a GPU (the checkpoint loads straight into CUDA tensors), gloo on a CPU; on a GPU this
    # also seeds megatron-core's CUDA RNG tracker, from which the random-init comparison draws.
    enable_cpu_megatron()
    init_distributed(1, 1, backend="auto", seed=seed)
    ensure_single_process_megatron()
    torch.manual_seed(seed)  # CPU initialisation draws from here
    config = transformer_config(shape, bf16=bf16)
    config.perform_initialization = checkpoint is None
    model = build_gpt_model(shape, sparse, config, max_sequence_length=max_sequence_length)
    model = model.to(device())
    if checkpoint is not None:
        load_checkpoint(resolve_checkpoint(checkpoint), model)
    return model.eval()


def sparse_config(block_size: int, topk: int, impl: str = "auto", sparse: bool = True) -> SparseAttentionConfig:
    return SparseAttentionConfig(sparse_attention=sparse, sparse_attn_impl=impl, moba_block_size=block_size,
                                 moba_topk=topk, track_coverage=True).validate()


def heldout_windows(prefix: str, length: int, count: int) -> list:
    """``count`` windows of ``length`` tokens from the held-out documents of ``prefix`` (.bin/.idx).

    The documents (each ending with its EOD token, as preprocess_data --append-eod writes them) are
    concatenated in stored order and cut into consecutive windows, as Megatron's pretraining
    samples are; fewer windows come back when the documents run out.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not IndexedDataset.exists(prefix):
        raise ValueError(f"held-out data {prefix!r}: no {prefix}.bin / .idx")
    data = IndexedDataset(prefix, mmap=True)
    windows, buf, have = [], [], 0
    for i in range(len(data)):
        buf.append(np.asarray(data[i], dtype=np.int64))
        have += len(buf[-1])
        while have >= length and len(windows) < count:
            flat = np.concatenate(buf)
            windows.append(torch.from_numpy(flat[:length].copy()))
            buf, have = [flat[length:]], len(flat) - length
        if len(windows) == count:
            break
    return windows


@torch.no_grad()
def token_losses(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[s - 1]`` per-token cross entropy of one sequence (megatron-core's own loss, labels given)."""
    tokens = tokens.to(device()).unsqueeze(0)
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    labels = torch.roll(tokens, -1, dims=1)
    loss = model(tokens, position_ids, None, labels=labels)  # [b, s]
    return loss[0, :-1].float().cpu()


def loss_summary(per_window: list) -> dict:
    """Mean loss over every position and over the last quarter of positions."""
    if not per_window:
        return {"val_loss": float("nan"), "val_loss_last_quarter": float("nan"), "windows": 0}
    stacked = torch.stack(per_window)
    n = stacked.shape[1]
    return {"val_loss": float(stacked.mean()), "val_loss_last_quarter": float(stacked[:, n - n // 4:].mean()),
            "windows": len(per_window)}


@dataclass
class PasskeyPrompt:
    tokens: torch.Tensor
    answer_at: int
    """Position of the first answer token; the answer runs to the end."""
    depth: float


def passkey_prompts(tokenizer, filler: torch.Tensor, length: int, keys: int = 2, seed: int = 0) -> list:
    """Prompts of exactly ``length`` tokens: held-out text with the needle at each depth, the question
    and the answer at the end (teacher-forced: a prompt counts as retrieved when every answer token
    is the argmax)."""
    rng = np.random.default_rng([seed, length])
    prompts = []
    for _ in range(keys):
        key = str(int(rng.integers(10000, 99999)))
        needle = tokenizer(PASSKEY_NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
        question = tokenizer(PASSKEY_QUESTION, add_special_tokens=False)["input_ids"]
        answer = tokenizer(" " + key, add_special_tokens=False)["input_ids"]
        room = length - len(needle) - len(question) - len(answer)
        if room < 1 or len(filler) < room:
            raise ValueError(f"passkey at {length}: the held-out filler has {len(filler)} tokens, needs {room}")
        for depth in PASSKEY_DEPTHS:
            at = int(room * depth)
            ids = filler[:at].tolist() + needle + filler[at:room].tolist() + question + answer
            prompts.append(PasskeyPrompt(torch.tensor(ids), len(ids) - len(answer), depth))
    return prompts


@torch.no_grad()
def passkey_accuracy(model, prompts: list, vocab_size: int) -> float:
    """Share of prompts whose answer tokens are all the argmax (over the tokenizer's ``vocab_size``
    columns: the embedding's padding rows are no tokens)."""
    right = 0
    for p in prompts:
        tokens = p.tokens.to(device()).unsqueeze(0)
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        logits = model(tokens, position_ids, None)[0, :, :vocab_size]  # [s, V]
        predicted = logits[p.answer_at - 1: tokens.shape[1] - 1].argmax(-1)
        right += int(torch.equal(predicted, tokens[0, p.answer_at:]))
    return right / max(1, len(prompts))


def ntk_rotary_base(base: float, head_dim: int, factor: float) -> float:
    """RoPE base that stretches every frequency's angle range by ``factor`` at the lowest frequency
    (the "NTK-aware" rule: base * factor^(d / (d - 2)))."""
    return base * factor ** (head_dim / (head_dim - 2))


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


__all__ = ["PASSKEY_DEPTHS", "build", "checkpoint_shape", "device", "gpu_name", "heldout_windows", "loss_summary",
           "ntk_rotary_base", "passkey_accuracy", "passkey_prompts", "sparse_config", "token_losses"]
