"""How a block-sparse attention implementation is exposed to PyTorch: traced ops and an eager path.

Every kernel implementation (Triton, CUDA) has the same two functions, ``forward(q, k, v, kv_idx,
kv_cnt, block_start, block_end, softmax_scale, block_size) -> (out, lse)`` and ``backward(do, q,
k, v, out, lse, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size) -> (dq, dk,
dv)``. :func:`register_attention` turns them into

* ``torch.library`` custom ops with fake implementations and an autograd rule, which
  ``torch.compile`` traces as opaque nodes, and
* an eager ``torch.autograd.Function`` calling the same two functions directly.

Why both: a custom op pays its dispatch on every call (schema handling, the autograd wrapper, an
aliasing check in Python), measured at about 0.6 ms of host time per call on an H200 host, twice
per layer. A short micro-batch's pipeline stage is host-bound, so outside tracing the attention
takes the plain autograd path; under ``torch.compile`` it takes the ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RegisteredAttention:
    forward_op: Callable  # sparsebalance::<name>_attn_fwd
    backward_op: Callable  # sparsebalance::<name>_attn_bwd
    eager: type  # torch.autograd.Function: apply(q, k, v, kv_idx, kv_cnt, block_start, block_end, scale, block) -> out

    def __call__(self, q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale: float, block_size: int):
        """``out [T, HQ, D]``, differentiable in q, k, v: the ops while tracing, else the eager path."""
        if torch.compiler.is_compiling():
            return self.forward_op(q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size)[0]
        return self.eager.apply(q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size)


def register_attention(name: str, forward: Callable, backward: Callable) -> RegisteredAttention:
    """Register ``sparsebalance::{name}_attn_fwd`` / ``_bwd`` and build the eager Function."""

    def forward_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor,
        block_start: torch.Tensor, block_end: torch.Tensor, softmax_scale: float, block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size)

    def backward_op(
        do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor, block_start: torch.Tensor,
        block_end: torch.Tensor, softmax_scale: float, block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward(do, q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size)

    fwd = torch.library.custom_op(f"sparsebalance::{name}_attn_fwd", forward_op, mutates_args=())
    bwd = torch.library.custom_op(f"sparsebalance::{name}_attn_bwd", backward_op, mutates_args=())

    @fwd.register_fake
    def _(q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size):
        return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)

    @bwd.register_fake
    def _(do, q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], kv_idx, kv_cnt, block_start, block_end)
        ctx.softmax_scale, ctx.block_size = softmax_scale, block_size

    def gradients(ctx, dout, backward_fn):
        q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end = ctx.saved_tensors
        dq, dk, dv = backward_fn(dout, q, k, v, out, lse, kv_idx, kv_cnt, block_start, block_end,
                                 ctx.softmax_scale, ctx.block_size)
        return dq, dk, dv, None, None, None, None, None, None

    torch.library.register_autograd(
        f"sparsebalance::{name}_attn_fwd", lambda ctx, dout, dlse: gradients(ctx, dout, bwd),
        setup_context=setup_context)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size):
            out, lse = forward(q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size)
            setup_context(ctx, (q, k, v, kv_idx, kv_cnt, block_start, block_end, softmax_scale, block_size),
                          (out, lse))
            return out

        @staticmethod
        def backward(ctx, dout):
            return gradients(ctx, dout, backward)

    Eager.__name__ = Eager.__qualname__ = f"{name.capitalize()}BlockSparseAttention"
    return RegisteredAttention(fwd, bwd, Eager)
