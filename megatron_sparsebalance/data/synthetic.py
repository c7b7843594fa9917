"""Synthetic packed micro-batches whose loss needs attention far back: the copy task.

Each sequence is ``prefix + prefix`` with random tokens, so the second half is predictable
only by attending to the block holding the same token one half-length earlier. A block-sparse
router that picks the right blocks learns it; that makes it a small end-to-end check that the
sparse attention trains.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedBatch:
    """One THD micro-batch: tokens ``[1, T]``, labels ``[1, T]``, loss mask ``[1, T]``."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def packed_seq_params(self) -> PackedSeqParams:
        longest = max(self.lengths)
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=longest, max_seqlen_kv=longest,
        )

    def to(self, device) -> "PackedBatch":
        return PackedBatch(*(t.to(device) for t in (self.tokens, self.labels, self.loss_mask, self.position_ids, self.cu_seqlens)))


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
