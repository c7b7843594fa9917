"""Settings of the sparse attention backend (the ``--sparse-*`` and ``--moba-*`` flags)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sparsebalance.ops.implementations import IMPLEMENTATIONS
from megatron_sparsebalance.ops.layout import validate_block_size


@dataclass
class SparseAttentionConfig:
    sparse_attention: bool = True
    """Use MoBA block-sparse attention; off gives dense causal attention (torch SDPA), the
    reference row of every benchmark."""

    sparse_attn_impl: str = "auto"
    """Kernel: auto (fastest available on the device), cuda, triton or torch (the reference)."""

    moba_block_size: int = 128
    """Tokens per attention block (64, 128 or 256)."""

    moba_topk: int = 32
    """Base budget k_base: KV blocks each query block attends to, the diagonal included."""

    track_coverage: bool = True
    """Compute the coverage C(k) of every layer's selection for metrics and SAB's estimator."""

    def validate(self) -> "SparseAttentionConfig":
        validate_block_size(self.moba_block_size)
        if self.sparse_attn_impl not in IMPLEMENTATIONS:
            raise ValueError(f"--sparse-attn-impl must be one of {IMPLEMENTATIONS}, got {self.sparse_attn_impl!r}")
        if self.moba_topk < 1:
            raise ValueError(f"--moba-topk must be >= 1, got {self.moba_topk}")
        return self
