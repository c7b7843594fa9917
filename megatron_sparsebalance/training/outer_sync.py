"""Communication-efficient data parallelism: DiLoCo and SparseLoCo outer steps (``--dp-comm``).

This module owns everything that happens between data-parallel replicas when they do *not*
all-reduce gradients every step:

- ``DPCommConfig``: the ``--dp-comm``, ``--outer-*`` and ``--sparseloco-*`` flags;
- ``ChunkLayout``: how one stage's parameters are cut into chunks (64x64 tiles of matrices,
  1-D runs of ``chunk**2`` elements of everything else) and put back;
- ``SparseLoCoCompressor``: per-chunk top-k, sign-magnitude quantization of the kept values, and
  the bit-packed message (indices + value codes + per-chunk scales) a replica sends;
- ``OuterSync``: the outer loop of one pipeline stage of one replica. Every ``H`` inner steps it
  forms the pseudo-gradient (global weights - local weights), exchanges it over the stage's
  data-parallel group (dense all-reduce for DiLoCo; all-gather of compressed messages for
  SparseLoCo), applies the outer step and resets the local weights to the new global ones;
- the byte accounting logged by ``pretrain``: bytes a replica actually hands to the network per
  outer step, next to what a dense fp32/bf16 all-reduce of the same parameters would send.

Quantization scheme (``--sparseloco-quant-bits b``): per chunk, the kept values are coded as one
sign bit plus ``b-1`` magnitude bits; the ``L = 2**(b-1)`` magnitude levels are evenly spaced on
``[lo, hi]``, the smallest and largest kept magnitude of the chunk (both sent as fp32). Top-k
keeps the large entries, so spending no levels near zero is what makes 2 bits workable. Error of a
kept value ``v``: ``|v - deq(q(v))| <= (hi - lo) / (2 (L - 1))`` for ``L >= 2`` and
``(hi - lo) / 2`` for ``b = 1`` (level ``(lo + hi) / 2``), up to fp32 rounding. With the default
``b = 2`` the levels are ``lo`` and ``hi``. The quantization error is not lost: the error-feedback
buffer keeps ``accumulated - dequantized`` at the sent positions.

Byte accounting: ``payload`` is the size of the tensors one replica gives the collective;
``wire`` is what a ring algorithm makes each replica send: ``(n - 1) x payload`` for an
all-gather, ``2 (n - 1) / n x payload`` for an all-reduce (equal to the payload at n = 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

DP_COMM_MODES = ("ddp", "diloco", "sparseloco")
DEFAULT_OUTER_LR = {"diloco": 0.7, "sparseloco": 1.0}


@dataclass
class DPCommConfig:
    dp_comm: str = "ddp"
    """Data-parallel communication: ddp (gradient all-reduce every step), diloco (H local steps, then a
    dense pseudo-gradient all-reduce and an outer Nesterov step) or sparseloco (H local steps, then
    top-k + quantized pseudo-gradients with error feedback, exchanged by all-gather)."""
    outer_steps_interval: int = 16
    """H: inner optimizer steps per replica between outer steps (diloco, sparseloco)."""
    outer_lr: Optional[float] = None
    """Outer learning rate (default: 0.7 for diloco, 1.0 for sparseloco)."""
    outer_momentum: float = 0.9
    """Nesterov momentum of DiLoCo's outer SGD (sparseloco has none: its error feedback stands in)."""
    sparseloco_error_decay: float = 0.999
    """Decay of SparseLoCo's error-feedback buffer: e <- decay * e + pseudo-gradient, before compression."""
    sparseloco_chunk: int = 64
    """Chunk side: matrices are cut into chunk x chunk tiles, other tensors into runs of chunk**2 elements."""
    sparseloco_topk: int = 32
    """Entries kept per chunk (largest magnitudes), e.g. 32 of 4096."""
    sparseloco_quant_bits: int = 2
    """Bits per kept value: 1 sign bit + (bits-1) magnitude bits on the chunk's [min, max] kept magnitude."""

    @property
    def local_steps(self) -> bool:
        """True when replicas skip the per-step gradient all-reduce."""
        return self.dp_comm != "ddp"

    def resolved_outer_lr(self) -> float:
        return self.outer_lr if self.outer_lr is not None else DEFAULT_OUTER_LR.get(self.dp_comm, 1.0)

    def validate(self, use_distributed_optimizer: bool = False) -> "DPCommConfig":
        if self.dp_comm not in DP_COMM_MODES:
            raise ValueError(f"--dp-comm must be one of {', '.join(DP_COMM_MODES)}, got {self.dp_comm!r}")
        if self.local_steps and use_distributed_optimizer:
            raise ValueError(f"--dp-comm {self.dp_comm} keeps a full optimizer per replica: "
                             "--use-distributed-optimizer is not allowed with it")
        if self.outer_steps_interval < 1:
            raise ValueError(f"--outer-steps-interval must be >= 1, got {self.outer_steps_interval}")
        if self.outer_lr is not None and not self.outer_lr > 0:
            raise ValueError(f"--outer-lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0.0 <= self.sparseloco_error_decay <= 1.0:
            raise ValueError(f"--sparseloco-error-decay must be in [0, 1], got {self.sparseloco_error_decay}")
        if self.sparseloco_chunk < 1:
            raise ValueError(f"--sparseloco-chunk must be >= 1, got {self.sparseloco_chunk}")
        if not 1 <= self.sparseloco_topk <= self.sparseloco_chunk ** 2:
            raise ValueError(f"--sparseloco-topk must be in [1, --sparseloco-chunk**2 = {self.sparseloco_chunk ** 2}], "
                             f"got {self.sparseloco_topk}")
        if not 1 <= self.sparseloco_quant_bits <= 8:
            raise ValueError(f"--sparseloco-quant-bits must be in [1, 8], got {self.sparseloco_quant_bits}")
        return self


# ---- bytes ---------------------------------------------------------------------------------


def ring_wire_bytes(collective: str, payload: int, n: int) -> int:
    """Bytes one replica sends for ``collective`` of ``payload`` bytes over ``n`` replicas (ring algorithm)."""
    if n <= 1:
        return 0
    if collective == "all_gather":
        return (n - 1) * payload
    if collective == "all_reduce":
        return (2 * (n - 1) * payload) // n
    raise ValueError(collective)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers ``< 2**bits`` (1-D) -> uint8 bytes, ``ceil(n * bits / 8)`` of them, LSB first."""
    shifts = torch.arange(bits, device=values.device)
    stream = ((values.reshape(-1, 1).to(torch.int64) >> shifts) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros((-stream.numel()) % 8)]).view(-1, 8)
    return (stream << torch.arange(8, device=values.device)).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` integers (int64)."""
    stream = ((packed.to(torch.int64).reshape(-1, 1) >> torch.arange(8, device=packed.device)) & 1).reshape(-1)
    return (stream[: n * bits].view(n, bits) << torch.arange(bits, device=packed.device)).sum(1)


# ---- chunks --------------------------------------------------------------------------------


class ChunkLayout:
    """Cuts a list of tensors into rows of ``chunk**2`` elements and back.

    A 2-D tensor ``[R, C]`` is padded to multiples of ``chunk`` and cut into ``chunk x chunk``
    tiles (row-major over the tile grid); any other tensor is flattened and cut into runs of
    ``chunk**2``. ``valid`` marks the real (not padding) elements of every row.
    """

    def __init__(self, shapes: Sequence[torch.Size], chunk: int, device=None):
        self.chunk, self.width = chunk, chunk * chunk
        self.shapes = [torch.Size(s) for s in shapes]
        self.rows = [self._rows(s) for s in self.shapes]
        self.num_rows = sum(self.rows)
        self.valid = self.to_rows([torch.ones(s, dtype=torch.bool, device=device) for s in self.shapes])

    def _rows(self, shape) -> int:
        if len(shape) == 2:
            return math.ceil(shape[0] / self.chunk) * math.ceil(shape[1] / self.chunk)
        return math.ceil(shape.numel() / self.width)

    def to_rows(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[num_rows, chunk**2]``, padding zero (False)."""
        c, out = self.chunk, []
        for t in tensors:
            if t.dim() == 2:
                nr, nc = math.ceil(t.shape[0] / c), math.ceil(t.shape[1] / c)
                padded = torch.nn.functional.pad(t, (0, nc * c - t.shape[1], 0, nr * c - t.shape[0]))
                out.append(padded.view(nr, c, nc, c).permute(0, 2, 1, 3).reshape(nr * nc, c * c))
            else:
                flat = t.reshape(-1)
                out.append(torch.nn.functional.pad(flat, (0, (-flat.numel()) % self.width)).view(-1, self.width))
        return torch.cat(out)

    def from_rows(self, rows: torch.Tensor) -> list:
        """The tensors back from ``[num_rows, chunk**2]`` (padding dropped)."""
        c, out, start = self.chunk, [], 0
        for shape, n in zip(self.shapes, self.rows):
            part = rows[start:start + n]
            start += n
            if len(shape) == 2:
                nr, nc = math.ceil(shape[0] / c), math.ceil(shape[1] / c)
                full = part.view(nr, nc, c, c).permute(0, 2, 1, 3).reshape(nr * c, nc * c)
                out.append(full[: shape[0], : shape[1]])
            else:
                out.append(part.reshape(-1)[: shape.numel()].view(shape))
        return out


# ---- compression ---------------------------------------------------------------------------


def quantize(values: torch.Tensor, mask: torch.Tensor, bits: int):
    """Sign-magnitude codes of ``values [rows, k]`` (kept where ``mask``), per-row ``lo``/``hi`` (fp32).

    See the module docstring for the scheme and its error bound.
    """
    mag = values.abs().float()
    lo = mag.masked_fill(~mask, math.inf).amin(1)
    hi = mag.masked_fill(~mask, -math.inf).amax(1)
    levels = 1 << (bits - 1)
    if levels == 1:
        level = torch.zeros_like(mag, dtype=torch.int64)
    else:
        step = ((hi - lo) / (levels - 1)).unsqueeze(1)
        ratio = torch.where(step > 0, (mag - lo.unsqueeze(1)) / step.clamp_min(torch.finfo(torch.float32).tiny),
                            torch.zeros_like(mag))
        level = ratio.round().clamp(0, levels - 1).to(torch.int64)
    sign = (values < 0).to(torch.int64)
    codes = (sign << (bits - 1)) | level
    return codes.masked_fill(~mask, 0), lo.masked_fill(~torch.isfinite(lo), 0), hi.masked_fill(~torch.isfinite(hi), 0)


def dequantize(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    levels = 1 << (bits - 1)
    level = codes & (levels - 1)
    negative = (codes >> (bits - 1)) & 1
    if levels == 1:
        mag = ((lo + hi) / 2).unsqueeze(1).expand(codes.shape)
    else:
        mag = lo.unsqueeze(1) + level.float() * ((hi - lo) / (levels - 1)).unsqueeze(1)
    return torch.where(negative.bool(), -mag, mag)


def quantization_error_bound(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Largest ``|v - deq(q(v))|`` per row, in exact arithmetic."""
    levels = 1 << (bits - 1)
    return (hi - lo) / (2 * max(1, levels - 1))


class SparseLoCoCompressor:
    """Chunk-wise top-k + quantization of a ``[rows, chunk**2]`` tensor into one uint8 message.

    Which slots of the ``k`` selected per row carry a real element depends only on the layout
    (padding scores below every real element, so it is selected last, and only in rows with fewer
    than ``k`` real elements): every replica's message has the same size and sections.
    """

    def __init__(self, layout: ChunkLayout, topk: int, bits: int):
        self.layout, self.bits = layout, bits
        self.k = min(topk, layout.width)
        self.index_bits = max(1, math.ceil(math.log2(layout.width)))
        real = layout.valid.sum(1, keepdim=True)
        self.slot_mask = torch.arange(self.k, device=real.device).unsqueeze(0) < real.clamp(max=self.k)
        self.kept = int(self.slot_mask.sum())
        self.index_bytes = math.ceil(self.kept * self.index_bits / 8)
        self.code_bytes = math.ceil(self.kept * bits / 8)
        self.scale_bytes = layout.num_rows * 2 * 4
        self.message_bytes = self.index_bytes + self.code_bytes + self.scale_bytes

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        """Indices ``[rows, k]`` of the largest magnitudes per row, largest first."""
        score = rows.abs().float().masked_fill(~self.layout.valid, -1.0)
        return score.topk(self.k, dim=1, sorted=True).indices

    def compress(self, rows: torch.Tensor):
        """-> (message uint8 [message_bytes], indices [rows, k], dequantized values [rows, k])."""
        idx = self.select(rows)
        codes, lo, hi = quantize(rows.gather(1, idx), self.slot_mask, self.bits)
        sent = dequantize(codes, lo, hi, self.bits).masked_fill(~self.slot_mask, 0).to(rows.dtype)
        message = torch.cat([
            pack_bits(idx[self.slot_mask], self.index_bits),
            pack_bits(codes[self.slot_mask], self.bits),
            torch.stack([lo, hi], 1).contiguous().view(torch.uint8).reshape(-1),
        ])
        assert message.numel() == self.message_bytes
        return message, idx, sent

    def feedback(self, error: torch.Tensor, rows: torch.Tensor, decay: float):
        """One replica's error-feedback step, in place on ``error [rows, chunk**2]``.

        ``error <- decay * error + rows``; that is compressed; what was not sent stays in
        ``error`` (the unsent entries, and the quantization error of the sent ones).
        Returns ``compress``'s (message, indices, dequantized values).
        """
        acc = error.mul_(decay).add_(rows)
        message, idx, sent = self.compress(acc)
        acc.scatter_(1, idx, acc.gather(1, idx) - sent)
        return message, idx, sent

    def decompress(self, message: torch.Tensor):
        """-> (indices [rows, k], dequantized values [rows, k]) of one replica's message."""
        a, b = self.index_bytes, self.index_bytes + self.code_bytes
        idx = torch.zeros(self.slot_mask.shape, dtype=torch.int64, device=message.device)
        codes = torch.zeros_like(idx)
        idx[self.slot_mask] = unpack_bits(message[:a], self.index_bits, self.kept)
        codes[self.slot_mask] = unpack_bits(message[a:b], self.bits, self.kept)
        scales = message[b:].clone().view(torch.float32).view(-1, 2)
        values = dequantize(codes, scales[:, 0], scales[:, 1], self.bits).masked_fill(~self.slot_mask, 0)
        return idx, values


# ---- the outer loop --------------------------------------------------------------------------


def main_params(optimizer) -> list:
    """The weights the inner optimizer updates: fp32 masters under --bf16, the model's otherwise."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def push_main_params_to_model(optimizer) -> None:
    """Copy fp32 masters into the bf16 model weights (a no-op for fp32 training)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        copy = getattr(opt, "_copy_main_params_to_model_params", None)
        if copy is not None:
            copy()


class OuterSync:
    """DiLoCo / SparseLoCo for one pipeline stage of one replica, over the stage's DP group."""

    def __init__(self, cfg: DPCommConfig, optimizer, group=None):
        if not cfg.local_steps:
            raise ValueError("OuterSync is for --dp-comm diloco or sparseloco")
        self.cfg, self.optimizer, self.group = cfg, optimizer, group
        self.replicas = dist.get_world_size(group)
        self.outer_lr = cfg.resolved_outer_lr()
        self.params = main_params(optimizer)
        self.numel = sum(p.numel() for p in self.params)
        self.inner_steps = self.outer_steps = 0
        self.bytes_sent_total = 0
        self.layout = self.compressor = None
        self.snapshot()
        if cfg.dp_comm == "diloco":
            self.momentum = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        else:
            device = self.params[0].device
            self.layout = ChunkLayout([p.shape for p in self.params], cfg.sparseloco_chunk, device=device)
            self.compressor = SparseLoCoCompressor(self.layout, cfg.sparseloco_topk, cfg.sparseloco_quant_bits)
            self.error = torch.zeros(self.layout.num_rows, self.layout.width, dtype=torch.float32, device=device)

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def payload_bytes(self) -> int:
        """Bytes this stage hands to the collective per outer step."""
        return self.compressor.message_bytes if self.compressor is not None else self.numel * 4

    @property
    def wire_bytes(self) -> int:
        collective = "all_gather" if self.compressor is not None else "all_reduce"
        return ring_wire_bytes(collective, self.payload_bytes, self.replicas)

    def dense_wire_bytes(self, bytes_per_element: int) -> int:
        """What a dense all-reduce of this stage's parameters sends per replica (one sync)."""
        return ring_wire_bytes("all_reduce", self.numel * bytes_per_element, self.replicas)

    # -- the loop -------------------------------------------------------------------------------

    def snapshot(self) -> None:
        """Take the current weights as the global ones (start, or after loading weights)."""
        self.global_params = [p.detach().float().clone() for p in self.params]

    def after_inner_step(self) -> Optional[dict]:
        """Count an inner step (taken or skipped); every H-th runs the outer step and returns its stats."""
        self.inner_steps += 1
        if self.inner_steps % self.cfg.outer_steps_interval:
            return None
        return self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> dict:
        pseudo = [g - p.detach().float() for g, p in zip(self.global_params, self.params)]
        if self.compressor is None:
            update = self._diloco(pseudo)
        else:
            update = self._sparseloco(pseudo)
        for g, u in zip(self.global_params, update):
            g.sub_(u, alpha=self.outer_lr)
        for p, g in zip(self.params, self.global_params):
            p.copy_(g)
        push_main_params_to_model(self.optimizer)
        self.outer_steps += 1
        self.bytes_sent_total += self.wire_bytes
        return {"bytes_sent": self.wire_bytes, "payload_bytes": self.payload_bytes}

    def _diloco(self, pseudo: list) -> list:
        """Dense average of the pseudo-gradients, then Nesterov momentum (torch SGD's form)."""
        flat = torch.cat([d.reshape(-1) for d in pseudo])
        dist.all_reduce(flat, group=self.group)
        flat /= self.replicas
        update, start, mu = [], 0, self.cfg.outer_momentum
        for d, m in zip(pseudo, self.momentum):
            avg = flat[start:start + d.numel()].view_as(d)
            start += d.numel()
            m.mul_(mu).add_(avg)
            update.append(avg + mu * m)
        return update

    def _sparseloco(self, pseudo: list) -> list:
        """Error feedback, compression, all-gather, average of every replica's decompressed message."""
        message, _, _ = self.compressor.feedback(self.error, self.layout.to_rows(pseudo), self.cfg.sparseloco_error_decay)
        gathered = [torch.empty_like(message) for _ in range(self.replicas)]
        dist.all_gather(gathered, message, group=self.group)
        # Every replica decodes the same messages in the same (rank) order: identical sums everywhere.
        total = torch.zeros_like(self.error)
        for m in gathered:
            r_idx, r_values = self.compressor.decompress(m)
            total.scatter_add_(1, r_idx, r_values)
        return self.layout.from_rows(total / self.replicas)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Per-rank state: outer state plus the replica's own local weights and inner optimizer state
        (megatron-core's sharded checkpoint keeps only DP rank 0's copy of those)."""
        state = {"mode": self.cfg.dp_comm, "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
                 "bytes_sent_total": self.bytes_sent_total, "global_params": self.global_params,
                 "local_params": [p.detach().clone() for p in self.params],
                 "inner_optimizer": self.optimizer.state_dict()}
        if self.compressor is None:
            state["momentum"] = self.momentum
        else:
            state["error"] = self.error
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state["mode"] != self.cfg.dp_comm:
            raise ValueError(f"checkpoint was written with --dp-comm {state['mode']}, this run uses {self.cfg.dp_comm}")
        self.optimizer.load_state_dict(state["inner_optimizer"])
        for p, saved in zip(self.params, state["local_params"]):
            p.copy_(saved)
        push_main_params_to_model(self.optimizer)
        self.inner_steps, self.outer_steps = state["inner_steps"], state["outer_steps"]
        self.bytes_sent_total = state["bytes_sent_total"]
        self.global_params = [t.clone() for t in state["global_params"]]
        if self.compressor is None:
            self.momentum = [t.clone() for t in state["momentum"]]
        else:
            self.error = state["error"].clone()


def replica_local_ddp_groups():
    """A ``ProcessGroupCollection`` for megatron-core DDP whose data-parallel groups hold this rank only.

    With it, DDP's ``finish_grad_sync`` (called by ``finalize_model_grads``) reduces over a group
    of one: the gradients stay the replica's own, scaled by 1/1, while ``finalize_model_grads``
    still all-reduces tied embeddings across pipeline stages over the real embedding group.
    """
    from megatron_sparsebalance.compat import replica_local_process_groups

    own, _ = dist.new_subgroups(group_size=1)  # collective: every rank builds every singleton
    return replica_local_process_groups(own)
