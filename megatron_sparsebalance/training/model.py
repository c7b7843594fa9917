"""Model presets and the builder of a megatron-core ``GPTModel`` with sparse core attention."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.attention.spec import get_gpt_decoder_spec, get_gpt_layer_spec

try:
    from megatron_sparsebalance.ops.triton_rope import install_fused_rope
except ImportError:  # no Triton: megatron's unfused RoPE
    install_fused_rope = None


@dataclass(frozen=True)
class ModelShape:
    """The architecture flags of Megatron-LM (``--num-layers`` ...) for a Qwen2-style GPT."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    rotary_base: float = 1_000_000.0
    norm_epsilon: float = 1e-6
    add_qkv_bias: bool = True
    untie_embeddings_and_output_weights: bool = False


# Qwen2.5 shapes as published in their config.json files; "fidelity-small" is trained from scratch
# on mock retrieval data by benchmarks/fidelity.py (its 512-token vocabulary goes with --mock-vocab-size 512).
MODEL_PRESETS = {
    "tiny": ModelShape(2, 128, 256, 4, 2, 32, 512),
    "fidelity-small": ModelShape(8, 512, 1536, 8, 2, 64, 512),
    "qwen2.5-0.5b": ModelShape(24, 896, 4864, 14, 2, 64, 151936),
    "qwen2.5-3b": ModelShape(36, 2048, 11008, 16, 2, 128, 151936, untie_embeddings_and_output_weights=True),
}


@dataclass
class RecomputeSettings:
    """Activation recomputation, with Megatron-LM's flags (megatron-core's ``TransformerConfig`` does it).

    Recomputed attention runs again inside the backward pass, outside the forward's budget scope;
    the schedule re-opens the micro-batch's scope around its backward (``pipeline/schedule.py``),
    so a recomputed layer routes with the budget DST gave the micro-batch, not ``--moba-topk``.
    """

    recompute_granularity: Optional[str] = None
    """full (recompute whole transformer layers: the memory of a 3B stage at 64K tokens) or
    selective (recompute only --recompute-modules); default: none."""
    recompute_method: Optional[str] = None
    """With --recompute-granularity full: uniform (checkpoint every --recompute-num-layers layers)
    or block (checkpoint the first --recompute-num-layers layers of each stage)."""
    recompute_num_layers: Optional[int] = None
    """With --recompute-granularity full: layers per checkpoint (uniform) or layers checkpointed per
    stage (block)."""
    recompute_modules: Optional[tuple[str, ...]] = None
    """With --recompute-granularity selective: core_attn and/or mlp (default: core_attn). (megatron-core
    0.16's layernorm recompute needs Transformer Engine.)"""

    def validate(self) -> "RecomputeSettings":
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if g not in (None, "full", "selective"):
            raise ValueError(f"--recompute-granularity must be full or selective, got {g!r}")
        if g == "full":
            if m not in ("uniform", "block"):
                raise ValueError(f"--recompute-granularity full needs --recompute-method uniform or block, got {m!r}")
            if n is None or n < 1:
                raise ValueError(f"--recompute-granularity full needs --recompute-num-layers >= 1, got {n}")
        elif m is not None or n is not None:
            raise ValueError("--recompute-method and --recompute-num-layers go with --recompute-granularity full")
        if self.recompute_modules is not None:
            if g != "selective":
                raise ValueError("--recompute-modules goes with --recompute-granularity selective")
            unknown = set(self.recompute_modules) - {"core_attn", "mlp"}
            if unknown or not self.recompute_modules:
                raise ValueError(f"--recompute-modules must be core_attn and/or mlp, got {list(self.recompute_modules)}"
                                 + (" (megatron-core's layernorm recompute needs Transformer Engine)"
                                    if "layernorm" in unknown else ""))
        return self

    def transformer_config_kwargs(self) -> dict:
        if self.recompute_granularity is None:
            return {}
        kwargs = {"recompute_granularity": self.recompute_granularity, "recompute_method": self.recompute_method,
                  "recompute_num_layers": self.recompute_num_layers}
        if self.recompute_modules is not None:
            kwargs["recompute_modules"] = list(self.recompute_modules)
        return kwargs


def transformer_config(
    shape: ModelShape,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    bf16: bool = False,
    num_layers: Optional[int] = None,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    recompute: Optional[RecomputeSettings] = None,
    sequence_parallel: bool = False,
) -> TransformerConfig:
    """megatron-core's config of a Qwen2-style GPT; ``first/last_stage_layers`` make the pipeline uneven."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    # Megatron's unfused THD RoPE costs ~110 launches per call (q and k of every layer) and our
    # machines have no Transformer Engine for its fused hook: on CUDA the hook runs our Triton
    # kernels (ops/triton_rope.py). CPU runs, and machines with TE, keep what megatron does.
    rope_fusion = install_fused_rope is not None and install_fused_rope()
    return TransformerConfig(
        num_layers=num_layers or shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.add_qkv_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        pipeline_model_parallel_size=pipeline_parallel_size,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        tensor_model_parallel_size=tensor_parallel_size,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available(),
        init_method_std=0.02,
        apply_rope_fusion=rope_fusion,
        **(recompute.validate().transformer_config_kwargs() if recompute is not None else {}),
    )


def build_gpt_model(
    shape: ModelShape,
    sparse_config: SparseAttentionConfig,
    config: TransformerConfig,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
) -> GPTModel:
    """A megatron-core GPTModel (local spec) whose core attention is :class:`SparseCoreAttention`."""
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_spec(
            config, get_gpt_layer_spec(sparse_config, num_query_groups=shape.num_query_groups)),
        vocab_size=shape.vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not shape.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=shape.rotary_base,
    )


def with_layers(shape: ModelShape, num_layers: int) -> ModelShape:
    return replace(shape, num_layers=num_layers)
