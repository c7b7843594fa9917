"""Synthetic packed micro-batches whose loss needs attention far back: the copy task.

Each sequence is ``prefix + prefix`` with random tokens, so the second half is predictable
only by attending to the block holding the same token one half-length earlier. A block-sparse
router that picks the right blocks learns it; that makes it a small end-to-end check that the
sparse attention trains.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def thd_params(cu_seqlens: torch.Tensor, host_cu_seqlens: torch.Tensor) -> PackedSeqParams:
    """megatron-core's THD parameters of a pack, with its sequence offsets on the device and the host.

    Megatron's unfused RoPE for THD reads the sequence lengths with ``.tolist()`` in every
    attention layer, from ``cu_seqlens_q_padded`` when it is set. With no padding the padded
    offsets equal the real ones, so handing their host copy there makes RoPE stop the host zero
    times instead of four per layer (q and k, lengths and a size check). The core attention keeps
    the device tensor (``cu_seqlens_q``) and takes the host copy for its block layout. Megatron's
    fused RoPE (Transformer Engine, ``apply_rope_fusion``) wants device offsets; the models built
    here leave it off.
    """
    lengths = (host_cu_seqlens[1:] - host_cu_seqlens[:-1]).tolist()
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=host_cu_seqlens, cu_seqlens_kv_padded=host_cu_seqlens,
        max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
    )


@dataclass
class PackedBatch:
    """One THD micro-batch: tokens ``[1, T]``, labels ``[1, T]``, loss mask ``[1, T]``.

    ``host_cu_seqlens`` is a copy of ``cu_seqlens`` kept on the host when the batch moves to a
    GPU: the sequence lengths are then known without asking the device (see
    :meth:`packed_seq_params`).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    host_cu_seqlens: Optional[torch.Tensor] = None

    def _host_offsets(self) -> torch.Tensor:
        if self.cu_seqlens.device.type == "cpu":
            return self.cu_seqlens
        if self.host_cu_seqlens is None:
            self.host_cu_seqlens = self.cu_seqlens.cpu()  # one wait, then cached
        return self.host_cu_seqlens

    @property
    def lengths(self) -> list[int]:
        cu = self._host_offsets()
        return (cu[1:] - cu[:-1]).tolist()

    def packed_seq_params(self) -> PackedSeqParams:
        return thd_params(self.cu_seqlens, self._host_offsets())

    def to(self, device) -> "PackedBatch":
        tensors = (self.tokens, self.labels, self.loss_mask, self.position_ids, self.cu_seqlens)
        # Through pinned memory and non_blocking: a copy from pageable memory makes the host wait
        # for the device's whole queue, once per tensor of every micro-batch. The caching host
        # allocator keeps each pinned buffer alive until its copy has run.
        to_gpu = torch.device(device).type == "cuda"
        moved = [t.pin_memory().to(device, non_blocking=True) if to_gpu and t.device.type == "cpu" else t.to(device)
                 for t in tensors]
        return PackedBatch(*moved, host_cu_seqlens=self._host_offsets())


def pack_sequences(sequences: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> PackedBatch:
    """Concatenate whole sequences (next-token labels inside each sequence) into one pack."""
    lengths = [len(s) for s in sequences]
    tokens = torch.cat(sequences)
    labels = torch.cat([torch.cat([s[1:], s[-1:]]) for s in sequences])
    # The last token of each sequence has no next token: it is never a loss position.
    mask = torch.cat([torch.cat([m[1:], m.new_zeros(1)]) for m in loss_masks]).float()
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return PackedBatch(tokens[None], labels[None], mask[None], pos[None], cu)


def copy_task_batch(lengths: list[int], vocab_size: int, generator: torch.Generator) -> PackedBatch:
    """Sequences of the given (even) lengths, each a random half repeated; loss on the second half."""
    seqs, masks = [], []
    for n in lengths:
        half = torch.randint(1, vocab_size, (n // 2,), generator=generator)
        seqs.append(torch.cat([half, half, half[: n % 2]]))
        m = torch.zeros(n)
        m[n // 2 :] = 1.0
        masks.append(m)
    return pack_sequences(seqs, masks)


# The synthetic retrieval task (``--mock-content retrieval``). Token ids below RETRIEVAL_RESERVED
# are markers; keys, values and the filler are drawn above them, so a marker never appears by chance.
KEY_MARK, VALUE_MARK, QUERY_MARK, ANSWER_MARK = 1, 2, 3, 4
RETRIEVAL_RESERVED = 5
RETRIEVAL_KEY_TOKENS = 4
RETRIEVAL_VALUE_TOKENS = 4
_RECORD = 2 + RETRIEVAL_KEY_TOKENS + RETRIEVAL_VALUE_TOKENS
# Two records (the plant and the question) and at least a few filler tokens between them.
RETRIEVAL_MIN_LENGTH = 2 * _RECORD + 4
RETRIEVAL_DEPTHS = ("early", "uniform")


def random_token_sample(length: int, vocab_size: int, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random tokens in ``[1, vocab_size)``; every token is a loss target."""
    tokens = torch.from_numpy(rng.integers(1, vocab_size, length, dtype="int64"))
    return tokens, torch.ones(length)


def retrieval_sample(length: int, vocab_size: int, rng, depth: str = "early") -> tuple[torch.Tensor, torch.Tensor]:
    """A key/value record planted early (or anywhere, ``depth``), asked for at the very end.

    Layout: ``filler .. KEY k1..k4 VALUE v1..v4 .. filler .. QUERY k1..k4 ANSWER v1..v4``. The
    target mask (what ``pack_sequences`` turns into the loss mask) is 1 exactly on the answer
    tokens ``v1..v4`` at the end: they are predictable only from the planted record, so the loss
    and the answer accuracy measure whether attention (the sparse router included) reaches it.

    ``depth`` (``--mock-retrieval-depth``): ``early`` plants the record in the first tenth, so the
    distance to the question is about the whole length; ``uniform`` plants it anywhere before the
    question, so distances spread from a few tokens to the length and accuracy can be told apart
    by distance (:func:`retrieval_distance`).
    """
    if length < RETRIEVAL_MIN_LENGTH:
        raise ValueError(f"--seq-length must be >= {RETRIEVAL_MIN_LENGTH} for --mock-content retrieval, got a sample of {length}")
    if vocab_size <= RETRIEVAL_RESERVED + 1:
        raise ValueError(f"--mock-vocab-size must be > {RETRIEVAL_RESERVED + 1} for --mock-content retrieval, got {vocab_size}")
    tokens = rng.integers(RETRIEVAL_RESERVED, vocab_size, length, dtype="int64")
    key = rng.integers(RETRIEVAL_RESERVED, vocab_size, RETRIEVAL_KEY_TOKENS, dtype="int64")
    value = rng.integers(RETRIEVAL_RESERVED, vocab_size, RETRIEVAL_VALUE_TOKENS, dtype="int64")
    plant = [KEY_MARK, *key, VALUE_MARK, *value]
    question = [QUERY_MARK, *key, ANSWER_MARK, *value]
    if depth not in RETRIEVAL_DEPTHS:
        raise ValueError(f"--mock-retrieval-depth must be one of {RETRIEVAL_DEPTHS}, got {depth!r}")
    if depth == "early":
        start = int(rng.integers(0, max(1, length // 10 - _RECORD)))
    else:
        start = int(rng.integers(0, length - 2 * _RECORD + 1))
    tokens[start:start + _RECORD] = plant
    tokens[length - _RECORD:] = question
    mask = torch.zeros(length)
    mask[length - RETRIEVAL_VALUE_TOKENS:] = 1.0
    return torch.from_numpy(tokens), mask


def retrieval_distance(tokens: torch.Tensor) -> int:
    """Tokens from the planted record to the question in one retrieval sample (``[n]`` ids).

    Read from the markers, which filler never contains, rather than carried beside the sample:
    it is then a fact about the tokens the model saw, and needs no metadata through packing.
    """
    key = (tokens == KEY_MARK).nonzero()
    query = (tokens == QUERY_MARK).nonzero()
    if len(key) != 1 or len(query) != 1:
        raise ValueError(f"not a retrieval sample: {len(key)} KEY and {len(query)} QUERY markers")
    return int(query[0, 0] - key[0, 0])
