"""Rotary position embedding (RoPE) in Triton, for megatron-core's fused-RoPE hook.

Owns the RoPE that megatron-core runs when ``TransformerConfig.apply_rope_fusion`` is set:
``rope_utils.apply_rotary_pos_emb`` then calls the module globals ``fused_apply_rotary_pos_emb``
(sbhd) and ``fused_apply_rotary_pos_emb_thd`` (packed THD), which Transformer Engine provides
where it is installed and which are None otherwise. Our target machines have no Transformer
Engine, and megatron's unfused THD path splits the pack per sequence, slices and concatenates the
frequencies, then computes cos, sin and rotate_half: about 110 small launches per call in forward
plus their backward, called for q and for k in every layer, which is a large share of the host
time of a short micro-batch (docs/LATENCY.md). Here a call is one kernel launch in forward and
one in backward. :func:`install_fused_rope` puts these functions into the hook.

Semantics are those of megatron's unfused path (``_apply_rotary_pos_emb_bshd`` /
``_apply_rotary_pos_emb_thd``, the reference of the tests), non-interleaved, mscale 1:

* ``freqs`` ``[F, 1, 1, R]`` are angles; the first ``R`` (even, ``<= D``) channels of each head
  are rotated, ``y = x * cos(f) + rotate_half(x) * sin(f)``, the other ``D - R`` pass through.
* sbhd: the angle row of token ``s`` is ``s``. THD: it is the token's position in its sequence
  (index in the pack minus its sequence's start), except where ``F == T``: megatron then reads
  ``freqs`` by index in the pack, and so do we.
* Backward is the transpose of forward, which for megatron's ``freqs`` (both halves equal) is
  the rotation by ``-f``.

Computation is in fp32 whatever the input dtype (fp32/bf16/fp16); megatron's reference rounds
cos/sin to the input dtype first, so in bf16 ours is the closer of the two to fp32 RoPE.

Where a THD pack's positions come from, without ever stopping the host:
* offsets on the host (``data/synthetic.thd_params`` passes a host copy in
  ``cu_seqlens_q_padded``, which megatron hands to RoPE): the per-token positions are built on the
  host and sent in one pinned non-blocking copy, once per micro-batch (:class:`PositionCache`);
* offsets on the device: each token finds its sequence by binary search over the offsets, in the
  kernel. Nothing is validated on this path (that would need a read back).

Context parallelism (``cp_size > 1``) and interleaved RoPE are not implemented and are refused.

Shape legend: T tokens of a pack, S sequence length, B batch, H heads, D head dim, R rotated
channels (``freqs.shape[-1]``), F rows of ``freqs``, N sequences of a pack.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# The interpreter (TRITON_INTERPRET=1, the CPU tests) has no libdevice.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Where a row's angle index comes from (the kernel's ANGLE_ROW).
_ROW_INDEX, _POSITION_TABLE, _OFFSET_SEARCH = 0, 1, 2

_TILE_ELEMENTS = 2048  # per rotated half, BLOCK_S * H_P * HALF_P: 16 fp32 registers a thread at 4 warps


@triton.jit(do_not_specialize=["S", "F_ROWS", "NUM_SEQS", "SEARCH_STEPS"])
def _rotary_kernel(
    X, Y, FREQS, INDEX,
    S, H, F_ROWS, NUM_SEQS, SEARCH_STEPS,
    stride_xs, stride_xb, stride_xh,
    stride_ys, stride_yb, stride_yh,
    stride_fs, stride_fb,
    HALF: tl.constexpr, HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr,
    H_P: tl.constexpr, BLOCK_S: tl.constexpr,
    ANGLE_ROW: tl.constexpr, BACKWARD: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """One program: BLOCK_S rows of one batch entry, all heads, all channels."""
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < S
    if ANGLE_ROW == 0:  # the row itself (sbhd, or THD with one freqs row per token of the pack)
        pos = rows
    elif ANGLE_ROW == 1:  # a table of per-token positions
        pos = tl.load(INDEX + rows, mask=row_ok, other=0)
    else:  # INDEX holds the N+1 offsets: find the last sequence starting at or before the row
        seq = tl.zeros([BLOCK_S], dtype=tl.int32)
        for i in range(SEARCH_STEPS):
            cand = seq + (1 << (SEARCH_STEPS - 1 - i))
            start = tl.load(INDEX + cand, mask=row_ok & (cand < NUM_SEQS), other=S)
            seq = tl.where(row_ok & (start <= rows), cand, seq)
        pos = rows - tl.load(INDEX + seq, mask=row_ok, other=0)
    pos = pos.to(tl.int64)
    rows = rows.to(tl.int64)

    ch = tl.arange(0, HALF_P)
    f_ptr = FREQS + pos[:, None] * stride_fs + b * stride_fb + ch[None, :]
    # Rows past the table cannot occur on the host-checked paths; on the device-offset path they
    # read nothing rather than out of bounds.
    f_mask = (row_ok & (pos >= 0) & (pos < F_ROWS))[:, None] & (ch < HALF)[None, :]
    f1 = tl.load(f_ptr, mask=f_mask, other=0.0).to(tl.float32)
    f2 = tl.load(f_ptr + HALF, mask=f_mask, other=0.0).to(tl.float32)
    if LIBDEVICE:
        # tl.cos/tl.sin may lower to approximate instructions, which lose accuracy at the large
        # angles of long sequences (position x inv_freq reaches ~6e4); libdevice reduces exactly.
        cos1, sin1 = libdevice.cos(f1), libdevice.sin(f1)
        cos2, sin2 = libdevice.cos(f2), libdevice.sin(f2)
    else:
        cos1, sin1 = tl.cos(f1), tl.sin(f1)
        cos2, sin2 = tl.cos(f2), tl.sin(f2)
    cos1, sin1 = cos1[:, None, :], sin1[:, None, :]
    cos2, sin2 = cos2[:, None, :], sin2[:, None, :]

    heads = tl.arange(0, H_P)
    x_ptr = X + rows[:, None, None] * stride_xs + b * stride_xb + heads[None, :, None] * stride_xh + ch[None, None, :]
    y_ptr = Y + rows[:, None, None] * stride_ys + b * stride_yb + heads[None, :, None] * stride_yh + ch[None, None, :]
    mask = row_ok[:, None, None] & (heads < H)[None, :, None] & (ch < HALF)[None, None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the forward map, per channel pair
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:  # x * cos(f) + rotate_half(x) * sin(f), rotate_half(x) = [-x2, x1]
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + HALF, y2.to(Y.dtype.element_ty), mask=mask)

    if PASS > 0:  # channels past the rotated ones are copied (and so is their gradient)
        pc = tl.arange(0, PASS_P)
        p_mask = row_ok[:, None, None] & (heads < H)[None, :, None] & (pc < PASS)[None, None, :]
        px = X + rows[:, None, None] * stride_xs + b * stride_xb + heads[None, :, None] * stride_xh
        py = Y + rows[:, None, None] * stride_ys + b * stride_yb + heads[None, :, None] * stride_yh
        pc = 2 * HALF + pc[None, None, :]
        tl.store(py + pc, tl.load(px + pc, mask=p_mask, other=0.0), mask=p_mask)


@dataclass(frozen=True)
class _Tile:
    half: int
    half_p: int
    passed: int
    passed_p: int
    heads_p: int
    block_s: int


@functools.lru_cache(maxsize=None)
def _tile(heads: int, head_dim: int, rot_dim: int, dtype: torch.dtype) -> _Tile:
    """The kernel's tile for a shape (validated here, once per shape: the launch path stays lean)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"RoPE supports float32, bfloat16 and float16 inputs, got {dtype}")
    if rot_dim <= 0 or rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"RoPE needs an even number of rotated channels <= the head dim {head_dim}, "
                         f"freqs has {rot_dim}")
    half, passed = rot_dim // 2, head_dim - rot_dim
    half_p, heads_p = triton.next_power_of_2(half), triton.next_power_of_2(heads)
    block_s = max(1, min(64, _TILE_ELEMENTS // (half_p * heads_p)))
    block_s = 1 << (block_s.bit_length() - 1)  # a power of two, for tl.arange
    return _Tile(half, half_p, passed, triton.next_power_of_2(passed) if passed else 1, heads_p, block_s)


def _rotate(x: torch.Tensor, freqs: torch.Tensor, index: torch.Tensor, angle_row: int, seq_dim: int,
            backward: bool) -> torch.Tensor:
    """One launch: ``x`` is ``[T, H, D]`` (THD) or 4-D with its sequence dim at ``seq_dim``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.dim() == 3:
        S, H, D = x.shape
        B, sxs, sxb, sxh, sys_, syb, syh = 1, x.stride(0), 0, x.stride(1), y.stride(0), 0, y.stride(1)
    else:
        bdim = 1 - seq_dim
        S, B, H, D = x.shape[seq_dim], x.shape[bdim], x.shape[2], x.shape[3]
        sxs, sxb, sxh = x.stride(seq_dim), x.stride(bdim), x.stride(2)
        sys_, syb, syh = y.stride(seq_dim), y.stride(bdim), y.stride(2)
    if y.numel() == 0:
        return y
    tile = _tile(H, D, freqs.shape[-1], x.dtype)
    num_seqs = index.shape[0] - 1 if angle_row == _OFFSET_SEARCH else 1  # read by the search only
    _rotary_kernel[(triton.cdiv(S, tile.block_s), B)](
        x, y, freqs, index,
        S, H, freqs.shape[0], num_seqs, max(num_seqs - 1, 0).bit_length(),
        sxs, sxb, sxh, sys_, syb, syh,
        freqs.stride(0), freqs.stride(1) if freqs.shape[1] > 1 else 0,
        HALF=tile.half, HALF_P=tile.half_p, PASS=tile.passed, PASS_P=tile.passed_p,
        H_P=tile.heads_p, BLOCK_S=tile.block_s,
        ANGLE_ROW=angle_row, BACKWARD=backward, LIBDEVICE=not _INTERPRET,
    )
    return y


class _Rotary(torch.autograd.Function):
    """RoPE with one launch in forward and one in backward.

    ``freqs`` and ``index`` are kept on ``ctx`` rather than through ``save_for_backward``: neither
    is an output or differentiable, and this skips the saved-variable packing on a path that runs
    twice per layer per micro-batch.
    """

    @staticmethod
    def forward(ctx, t, freqs, index, angle_row: int, seq_dim: int):
        ctx.freqs, ctx.index, ctx.angle_row, ctx.seq_dim = freqs, index, angle_row, seq_dim
        return _rotate(t, freqs, index, angle_row, seq_dim, backward=False)

    @staticmethod
    def backward(ctx, grad):
        return _rotate(grad, ctx.freqs, ctx.index, ctx.angle_row, ctx.seq_dim, backward=True), None, None, None, None


def _check_freqs(freqs: torch.Tensor) -> torch.Tensor:
    if freqs.dim() != 4:
        raise ValueError(f"freqs must be [F, 1, 1, rot_dim] (megatron's RotaryEmbedding), got {tuple(freqs.shape)}")
    return freqs if freqs.stride(-1) == 1 else freqs.contiguous()


@dataclass(frozen=True)
class Positions:
    """Per-token positions of a pack on one device: ``table`` ``[T]`` int32, ``longest`` sequence."""

    table: torch.Tensor
    longest: int


class PositionCache:
    """The positions of the last pack seen, reused while the same host offsets tensor comes back.

    Megatron hands the same ``cu_seqlens`` tensor object to RoPE for q and k of every layer of a
    micro-batch; keyed on its identity and in-place version (as ``ops/layout.LayoutCache``), the
    table is built and copied once per micro-batch, and a new or edited tensor is never served a
    stale one.
    """

    def __init__(self):
        self._key = None
        self._positions: Optional[Positions] = None

    def get(self, host_cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device) -> Positions:
        key = (host_cu_seqlens, host_cu_seqlens._version, num_tokens, device)
        if self._key is None or not (self._key[0] is key[0] and self._key[1:] == key[1:]):
            self._positions = build_positions(host_cu_seqlens, num_tokens, device)
            self._key = key
        return self._positions


def build_positions(host_cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device) -> Positions:
    """Positions of the tokens of a pack in their sequences, from host offsets ``[N+1]``, sent to ``device``."""
    cu = host_cu_seqlens
    if cu.device.type != "cpu" or cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 host tensor [num_seqs + 1], got "
                         f"{tuple(cu.shape)} {cu.dtype} on {cu.device}")
    cu = cu.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()) or int(cu[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must rise from 0 to the {num_tokens} tokens of the pack, "
                         f"got {cu.tolist() if cu.numel() <= 16 else cu}")
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=num_tokens)
    table = (torch.arange(num_tokens, dtype=torch.int64) - starts).to(torch.int32)
    if device.type == "cuda":  # pinned + non_blocking: a pageable copy would wait for the device's queue
        table = table.pin_memory().to(device, non_blocking=True)
    else:
        table = table.to(device)
    return Positions(table, int(lengths.max()))


_POSITIONS = PositionCache()


def rotary_sbhd(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd") -> torch.Tensor:
    """RoPE of ``t`` ``[S, B, H, D]`` (``"sbhd"``) or ``[B, S, H, D]`` (``"bshd"``), token ``s`` at angle row ``s``.

    ``freqs``: ``[F >= S, 1 or B, 1, R]``. Returns a tensor shaped as ``t``, differentiable in ``t``.
    """
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"tensor_format must be 'sbhd' or 'bshd', got {tensor_format!r}")
    seq_dim = 0 if tensor_format == "sbhd" else 1
    freqs = _check_freqs(freqs)
    if t.dim() != 4 or freqs.shape[0] < t.shape[seq_dim] or freqs.shape[1] not in (1, t.shape[1 - seq_dim]):
        raise ValueError(f"RoPE ({tensor_format}): t {tuple(t.shape)} does not match freqs {tuple(freqs.shape)}")
    return _Rotary.apply(t, freqs, freqs, _ROW_INDEX, seq_dim)


def rotary_thd(t: torch.Tensor, freqs: torch.Tensor, *, positions: Optional[Positions] = None,
               cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RoPE of a THD pack ``t`` ``[T, H, D]``, each token at its position in its sequence.

    Give exactly one of ``positions`` (from :class:`PositionCache` / :func:`build_positions`, on
    ``t``'s device; checked against ``freqs``) or ``cu_seqlens`` ``[N+1]`` on ``t``'s device
    (searched in the kernel, unchecked: no read back). ``freqs``: ``[F, 1, 1, R]``, F above the
    longest sequence.
    """
    freqs = _check_freqs(freqs)
    if t.dim() != 3:
        raise ValueError(f"RoPE (thd): t must be [T, H, D], got {tuple(t.shape)}")
    if (positions is None) == (cu_seqlens is None):
        raise ValueError("rotary_thd takes exactly one of positions or cu_seqlens")
    if positions is not None:
        if positions.longest > freqs.shape[0]:
            raise ValueError(f"RoPE (thd): a sequence of {positions.longest} tokens needs that many freqs rows, "
                             f"freqs has {freqs.shape[0]}")
        return _Rotary.apply(t, freqs, positions.table, _POSITION_TABLE, 0)
    return _Rotary.apply(t, freqs, cu_seqlens, _OFFSET_SEARCH, 0)


# ----------------------------------------------------------------------- megatron's hook

def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron-core's ``rope_utils.fused_apply_rotary_pos_emb``: RoPE of ``t`` ``[S, B, H, D]``."""
    if interleaved:
        raise ValueError("our fused RoPE (ops/triton_rope.py) is non-interleaved only: "
                         "set rotary_interleaved=False or apply_rope_fusion=False")
    return rotary_sbhd(t, freqs)


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                                   cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False) -> torch.Tensor:
    """megatron-core's ``rope_utils.fused_apply_rotary_pos_emb_thd``: RoPE of a pack ``t`` ``[T, H, D]``.

    ``cu_seqlens`` on the host: positions from the per-micro-batch cache; on ``t``'s device: the
    in-kernel search. (megatron-core 0.17+ passes ``interleaved``; 0.16 does not.)
    """
    if interleaved:
        raise ValueError("our fused RoPE (ops/triton_rope.py) is non-interleaved only: "
                         "set rotary_interleaved=False or apply_rope_fusion=False")
    if cp_size != 1:
        raise ValueError(f"our fused THD RoPE (ops/triton_rope.py) does not support context parallelism "
                         f"(cp_size={cp_size}); run with context parallel size 1 or apply_rope_fusion=False")
    if freqs.shape[0] == t.shape[0]:
        # megatron's "exact mapping": a freqs row per token of the pack, read by pack index
        freqs = _check_freqs(freqs)
        return _Rotary.apply(t, freqs, freqs, _ROW_INDEX, 0)
    if cu_seqlens.device != t.device:
        return rotary_thd(t, freqs, positions=_POSITIONS.get(cu_seqlens, t.shape[0], t.device))
    return rotary_thd(t, freqs, cu_seqlens=cu_seqlens)


def install_fused_rope() -> bool:
    """Make megatron-core's fused-RoPE hook run our kernels where Transformer Engine's are absent.

    Returns True when ``apply_rope_fusion`` runs our kernels (installed now or before), False
    where Transformer Engine's kernels are in place (left alone) or no CUDA device exists (CPU
    runs keep megatron's unfused path). Idempotent. Call it before building a
    ``TransformerConfig`` with ``apply_rope_fusion=True``: its ``__post_init__`` checks the hook.
    """
    from megatron.core.models.common.embeddings import rope_utils

    if not torch.cuda.is_available():
        return False
    if rope_utils.fused_apply_rotary_pos_emb_thd is fused_apply_rotary_pos_emb_thd:
        return True
    if rope_utils.fused_apply_rotary_pos_emb is not None or rope_utils.fused_apply_rotary_pos_emb_thd is not None:
        return False
    rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    rope_utils.fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd
    return True
