"""Block layout of a packed (THD) micro-batch.

Owns the mapping between tokens, sequences and attention blocks. Every sparse-attention
implementation (torch reference, Triton, CUDA) reads the same layout, so the rules of
DESIGN.md §2 live here once: blocks are ``block_size`` tokens, never cross a sequence
boundary, and the last block of a sequence may be partial.

Shape legend: T tokens in the pack, N sequences, NB blocks in the pack (all sequences).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

SUPPORTED_BLOCK_SIZES = (64, 128, 256)


@dataclass(frozen=True)
class BlockLayout:
    """Blocks of a packed micro-batch.

    Attributes:
        cu_seqlens: ``[N+1]`` int32, token offsets of the sequences (``cu_seqlens[-1] == T``).
        block_size: tokens per block (the last block of a sequence may be shorter).
        cu_blocks: ``[N+1]`` int32, block offsets of the sequences.
        block_start: ``[NB]`` int32, first token (index into T) of each block.
        block_end: ``[NB]`` int32, one past the last token of each block.
        block_seq: ``[NB]`` int64, sequence of each block.
        block_pos: ``[NB]`` int64, index of each block inside its sequence.
        token_block: ``[T]`` int64, block of each token.
        num_blocks: NB.
        max_blocks_per_seq: the largest number of blocks of one sequence.
        rows_with_candidates: blocks that have an earlier block in their sequence (the router's
            rows with at least one candidate), known on the host.
    """

    cu_seqlens: torch.Tensor
    block_size: int
    cu_blocks: torch.Tensor
    block_start: torch.Tensor
    block_end: torch.Tensor
    block_seq: torch.Tensor
    block_pos: torch.Tensor
    token_block: torch.Tensor
    num_blocks: int
    max_blocks_per_seq: int
    rows_with_candidates: int

    @functools.cached_property
    def candidates(self) -> torch.Tensor:
        """``[NB, NB]`` bool: block ``j`` is an earlier block of the same sequence as block ``i``.

        The router's candidates (DESIGN.md §2). Built once per pack: every layer reads it.
        """
        same_seq = self.block_seq[:, None] == self.block_seq[None, :]
        return same_seq & (self.block_pos[None, :] < self.block_pos[:, None])

    @functools.cached_property
    def block_lengths(self) -> torch.Tensor:
        """``[NB]`` float32, tokens of each block (the router divides its block sums by them)."""
        return (self.block_end - self.block_start).to(torch.float32)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.token_block.numel()

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, block_size: int, num_tokens: int,
                        host_cu_seqlens: Optional[torch.Tensor] = None) -> "BlockLayout":
        """Build the layout, validating ``cu_seqlens`` against the tensor it describes.

        The layout is computed on the host (it is a few integers per block) and sent to the
        device of ``cu_seqlens`` in one non-blocking copy. ``host_cu_seqlens``, a host copy of
        ``cu_seqlens`` when the caller has one, spares the one wait of reading it back.
        """
        validate_block_size(block_size)
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D integer tensor [num_seqs + 1]")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        device = cu_seqlens.device
        cu = (host_cu_seqlens if host_cu_seqlens is not None else cu_seqlens).cpu().to(torch.int64)
        if cu.shape != cu_seqlens.shape:
            raise ValueError(f"host_cu_seqlens has shape {tuple(cu.shape)}, cu_seqlens {tuple(cu_seqlens.shape)}")
        if int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
        if int(cu[-1]) != num_tokens:
            raise ValueError(f"cu_seqlens[-1] = {int(cu[-1])} does not match the {num_tokens} tokens of the tensor")
        seqlens = cu[1:] - cu[:-1]
        blocks_per_seq = (seqlens + block_size - 1) // block_size
        cu_blocks = torch.zeros_like(cu)
        cu_blocks[1:] = torch.cumsum(blocks_per_seq, 0)
        num_blocks = int(cu_blocks[-1])
        block_seq = torch.repeat_interleave(torch.arange(seqlens.numel()), blocks_per_seq)
        block_pos = torch.arange(num_blocks) - cu_blocks[block_seq]
        block_start = cu[block_seq] + block_pos * block_size
        block_end = torch.minimum(block_start + block_size, cu[block_seq + 1])
        host = torch.cat([cu, cu_blocks, block_start, block_end, block_seq, block_pos])
        if device.type == "cuda":  # pinned + non_blocking: a pageable copy would wait for the device's queue
            host = host.pin_memory()
        on_device = host.to(device, non_blocking=True)
        cu_d, cu_blocks_d, start_d, end_d, seq_d, pos_d = on_device.split(
            [cu.numel(), cu.numel()] + [num_blocks] * 4)
        token_block = torch.repeat_interleave(
            torch.arange(num_blocks, device=device), end_d - start_d, output_size=num_tokens)
        return cls(
            cu_seqlens=cu_d.to(torch.int32),
            block_size=block_size,
            cu_blocks=cu_blocks_d.to(torch.int32),
            block_start=start_d.to(torch.int32),
            block_end=end_d.to(torch.int32),
            block_seq=seq_d,
            block_pos=pos_d,
            token_block=token_block,
            num_blocks=num_blocks,
            max_blocks_per_seq=int(blocks_per_seq.max()) if blocks_per_seq.numel() else 0,
            rows_with_candidates=num_blocks - int((blocks_per_seq > 0).sum()),
        )


class LayoutCache:
    """The layout of the last pack seen, reused while the same ``cu_seqlens`` tensor comes back.

    Every attention layer of a micro-batch gets the same ``PackedSeqParams`` (the same tensor
    object), and building a layout reads ``cu_seqlens`` on the host; without the cache each layer
    of each micro-batch would stop the host once for it. The tensor's identity and in-place
    version are the key, so a new pack or an edited tensor is never served a stale layout.
    """

    def __init__(self):
        self._key = None
        self._layout: BlockLayout | None = None

    def get(self, cu_seqlens: torch.Tensor, block_size: int, num_tokens: int,
            host_cu_seqlens: Optional[torch.Tensor] = None) -> BlockLayout:
        key = (cu_seqlens, cu_seqlens._version, block_size, num_tokens)
        if self._key is None or not (self._key[0] is key[0] and self._key[1:] == key[1:]):
            self._layout = BlockLayout.from_cu_seqlens(cu_seqlens, block_size, num_tokens, host_cu_seqlens)
            self._key = key
        return self._layout


_uniform_cache: dict = {}


def validate_block_size(block_size: int) -> None:
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size (--moba-block-size) must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}"
        )


def uniform_cu_seqlens(batch: int, seq_len: int, device=None) -> torch.Tensor:
    """``cu_seqlens`` of ``batch`` sequences of ``seq_len`` tokens (the sbhd case).

    The same tensor object for the same arguments, so that :class:`LayoutCache` hits across the
    layers of an sbhd micro-batch too. Treat it as read-only.
    """
    key = (batch, seq_len, str(torch.device(device) if device is not None else "cpu"))
    if key not in _uniform_cache:
        if len(_uniform_cache) > 64:  # a few shapes in a run; never grow without bound
            _uniform_cache.clear()
        _uniform_cache[key] = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
    return _uniform_cache[key]
