"""Layer specs with :class:`SparseCoreAttention` in megatron-core's ``core_attention`` slot."""
from __future__ import annotations

import copy
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.attention.core_attention import SparseCoreAttention

try:  # Transformer Engine is an optional accelerator for the dense parts of the layer.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:
    HAVE_TE = False


def sparse_core_attention_spec(sparse_config: SparseAttentionConfig) -> ModuleSpec:
    return ModuleSpec(module=SparseCoreAttention, params={"sparse_config": sparse_config.validate()})


def patch_layer_spec(spec, sparse_config: SparseAttentionConfig):
    """A copy of a layer spec (or of a block spec's every layer) with our core attention."""
    spec = copy.deepcopy(spec)
    layers = spec.layer_specs if isinstance(spec, TransformerBlockSubmodules) else [spec]
    for layer in layers:
        attn = layer.submodules.self_attention
        if attn is None or not hasattr(attn.submodules, "core_attention"):
            raise ValueError(f"layer spec {layer.module} has no self_attention.core_attention slot")
        attn.submodules.core_attention = sparse_core_attention_spec(sparse_config)
    return spec


def get_gpt_layer_spec(
    sparse_config: Optional[SparseAttentionConfig] = None,
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    use_transformer_engine: bool = False,
) -> ModuleSpec:
    """GPT layer spec whose core attention is ours; the rest from megatron-core (local or TE)."""
    if use_transformer_engine and not HAVE_TE:
        raise ValueError("use_transformer_engine=True but Transformer Engine is not installed")
    if use_transformer_engine:
        base = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        base = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization)
    return patch_layer_spec(base, sparse_config or SparseAttentionConfig())
