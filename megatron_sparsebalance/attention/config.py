"""Settings of the sparse attention backend (the ``--sparse-*`` and ``--moba-*`` flags)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sparsebalance.ops.implementations import check_ds_buffer_request, check_request
from megatron_sparsebalance.ops.layout import validate_block_size


@dataclass
class SparseAttentionConfig:
    sparse_attention: bool = True
    """Use MoBA block-sparse attention; off gives dense causal attention (torch SDPA), the
    reference row of every benchmark."""

    sparse_attn_impl: str = "auto"
    """Kernel: auto (fastest measured on the device), cuda, triton, fa4 (flash-attn-4's block-sparse backward,
    non-deterministic, after our forward kernel on Hopper; FA4's forward elsewhere) or torch (the reference)."""

    sparse_attn_ds_buffer_gib: float = 0.0
    """GiB the cuda kernels' backward may take, per layer while it runs, to store dS and form dQ with one
    product a tile instead of three (Hopper, --moba-block-size 128, head dim 128, --sparse-attn-impl cuda or
    auto, else an error; a call whose buffer does not fit runs the two-pass backward). 1-7% faster at 3B
    (S = 32K/64K) for up to G * NB * k * R * 32 KiB (17.25 GiB for Qwen2.5-3B at 64K, k = 69). 0 keeps the
    two-pass backward; both are deterministic."""

    moba_block_size: int = 128
    """Tokens per attention block (64, 128 or 256)."""

    moba_topk: int = 32
    """Base budget k_base: KV blocks each query block attends to, the diagonal included."""

    track_coverage: bool = True
    """Compute the coverage C(k) of every layer's selection for metrics and SAB's estimator."""

    deterministic_mode: bool = False
    """Megatron-LM's --deterministic-mode as the attention reads it: auto never picks a non-deterministic
    kernel, and --sparse-attn-impl fa4 (atomic dQ) is refused. TransformerConfig.deterministic_mode, set by
    Megatron-LM's own flag, has the same effect."""

    def validate(self) -> "SparseAttentionConfig":
        validate_block_size(self.moba_block_size)
        check_request(self.sparse_attn_impl, self.deterministic_mode, self.moba_block_size)
        check_ds_buffer_request(self.sparse_attn_ds_buffer_gib, self.sparse_attn_impl, self.moba_block_size)
        if self.moba_topk < 1:
            raise ValueError(f"--moba-topk must be >= 1, got {self.moba_topk}")
        return self
