"""Model presets and the builder of a megatron-core ``GPTModel`` with sparse core attention.

:class:`ModelShape` holds every architecture choice of Megatron-LM's flags that the model takes
(``--num-layers`` ... ``--swiglu``, ``--normalization``, biases, dropout, init std, position
embedding); :func:`transformer_config` and :func:`build_gpt_model` turn it into megatron-core's
``TransformerConfig`` and ``GPTModel`` exactly as Megatron-LM's ``pretrain_gpt.py`` would.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
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


POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute", "none")


@dataclass(frozen=True)
class ModelShape:
    """The architecture flags of Megatron-LM (``--num-layers`` ...); the defaults after
    ``vocab_size`` are a Qwen2-style GPT's (our presets'), which is also what checkpoints and
    latency tables written before the later fields existed describe."""

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
    # Megatron-LM's remaining architecture flags. Their defaults here are the presets' (Qwen2),
    # not Megatron-LM's: config.ModelConfig applies Megatron-LM's when no --model is given.
    normalization: str = "RMSNorm"
    swiglu: bool = True
    add_bias_linear: bool = False
    position_embedding_type: str = "rope"
    rotary_percent: float = 1.0
    max_position_embeddings: Optional[int] = None
    """None: the run's --seq-length."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02

    def record(self) -> dict:
        """The shape as a dict without the later fields that hold their default, so that
        a record matches what was written before those fields existed (checkpoints, latency
        tables); ``ModelShape(**record)`` restores the shape."""
        out = asdict(self)
        for f in fields(self)[_FIRST_LATER_FIELD:]:
            if out[f.name] == f.default:
                del out[f.name]
        return out


_FIRST_LATER_FIELD = [f.name for f in fields(ModelShape)].index("normalization")


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
    pipeline_layout: Optional[str] = None,
    recompute: Optional[RecomputeSettings] = None,
    sequence_parallel: bool = False,
    calculate_per_token_loss: bool = False,
    cross_entropy_loss_fusion: bool = False,
    cross_entropy_fusion_impl: str = "native",
) -> TransformerConfig:
    """megatron-core's config of ``shape``; ``first/last_stage_layers`` make the pipeline uneven,
    ``pipeline_layout`` (``--pipeline-model-parallel-layout``) places every layer instead;
    ``cross_entropy_loss_fusion`` runs the loss in megatron-core's fused cross entropy."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    # Megatron's unfused THD RoPE costs ~110 launches per call (q and k of every layer) and our
    # machines have no Transformer Engine for its fused hook: on CUDA the hook runs our Triton
    # kernels (ops/triton_rope.py), which rotate the whole head (--rotary-percent 1). CPU runs,
    # and machines with TE, keep what megatron does.
    rope_fusion = (shape.position_embedding_type == "rope" and shape.rotary_percent == 1.0
                   and install_fused_rope is not None and install_fused_rope())
    return TransformerConfig(
        num_layers=num_layers or shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        normalization=shape.normalization,
        layernorm_epsilon=shape.norm_epsilon,
        # --swiglu: SiLU-gated MLP; without it Megatron-LM's GeLU MLP (exact GeLU: the bias-GeLU
        # fusion, whose tanh approximation Megatron-LM turns on by default, is not used here).
        gated_linear_unit=shape.swiglu,
        activation_func=F.silu if shape.swiglu else F.gelu,
        add_bias_linear=shape.add_bias_linear,
        add_qkv_bias=shape.add_qkv_bias or shape.add_bias_linear,
        attention_dropout=shape.attention_dropout,
        hidden_dropout=shape.hidden_dropout,
        calculate_per_token_loss=calculate_per_token_loss,
        cross_entropy_loss_fusion=cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=cross_entropy_fusion_impl,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        pipeline_model_parallel_size=pipeline_parallel_size,
        # Megatron-LM's core_transformer_config_from_args always sets it: a stage frees the values
        # of each output it has sent (pipeline/schedule.py).
        deallocate_pipeline_outputs=True,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        pipeline_model_parallel_layout=pipeline_layout,
        tensor_model_parallel_size=tensor_parallel_size,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available(),
        init_method_std=shape.init_method_std,
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
    use_transformer_engine: bool = False,
) -> GPTModel:
    """A megatron-core GPTModel (local spec, or TE's) whose core attention is :class:`SparseCoreAttention`.

    ``max_sequence_length`` is the run's ``--seq-length``; ``--max-position-embeddings``
    (``shape.max_position_embeddings``), when set, sizes the position embeddings instead, as in
    Megatron-LM.
    """
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_spec(
            config, get_gpt_layer_spec(sparse_config, normalization=shape.normalization,
                                       use_transformer_engine=use_transformer_engine,
                                       num_query_groups=shape.num_query_groups)),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings or max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not shape.untie_embeddings_and_output_weights,
        position_embedding_type=shape.position_embedding_type,
        rotary_percent=shape.rotary_percent,
        rotary_base=shape.rotary_base,
    )


def with_layers(shape: ModelShape, num_layers: int) -> ModelShape:
    return replace(shape, num_layers=num_layers)
