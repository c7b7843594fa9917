"""Layer specs with :class:`SparseCoreAttention` in megatron-core's ``core_attention`` slot."""
from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.attention.core_attention import SparseCoreAttention

try:  # Transformer Engine is an optional accelerator for the dense parts of the layer.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:
    HAVE_TE = False


def sparse_core_attention_spec(sparse_config: SparseAttentionConfig, num_query_groups: Optional[int] = None) -> ModuleSpec:
    """``num_query_groups``: the model's (``--num-query-groups``). Under tensor parallelism with fewer
    groups than TP ranks megatron-core hands the core attention a config that says TP groups; the
    router needs the real count to pool each group's queries over the ranks sharing it."""
    return ModuleSpec(module=SparseCoreAttention,
                      params={"sparse_config": sparse_config.validate(), "model_query_groups": num_query_groups})


NORMALIZATIONS = ("RMSNorm", "LayerNorm")


def refuse_unknown_normalization(normalization: str) -> None:
    """The norms our layer specs build (the standalone entry's parser and the layers check alike)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"--normalization must be RMSNorm or LayerNorm, got {normalization!r}")


def refuse_unbuilt_norm(config) -> None:
    """Norm settings that megatron-core's ``WrappedTorchNorm`` refuses (by assertion, while building
    the model) and that our torch norms, which replace it in the local spec, would drop: refused by
    flag name. ``config``: a ``TransformerConfig``, or Megatron-LM's arguments (same field names)."""
    if getattr(config, "memory_efficient_layer_norm", False):
        raise ValueError("memory_efficient_layer_norm is apex's layer norm; the local layer spec builds torch's")
    refuse_unknown_normalization(getattr(config, "normalization", "LayerNorm"))


class _ZeroCenteredGamma:
    """``--apply-layernorm-1p`` (megatron-core's ``layernorm_zero_centered_gamma``) on a torch norm:
    the weight holds gamma - 1 and starts at zeros, the norm scales by 1 + weight, so weight decay
    pulls gamma towards 1. megatron-core has this only in apex's and Transformer Engine's norms (its
    torch norm asserts against it), and neither installs on our machines: written here."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)


class ZeroCenteredLayerNorm(_ZeroCenteredGamma, torch.nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(_ZeroCenteredGamma, torch.nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def _torch_norm(config: TransformerConfig, hidden_size: int, eps: float) -> torch.nn.Module:
    refuse_unbuilt_norm(config)
    rms = config.normalization == "RMSNorm"
    if config.layernorm_zero_centered_gamma:
        norm_cls = ZeroCenteredRMSNorm if rms else ZeroCenteredLayerNorm
    else:
        norm_cls = torch.nn.RMSNorm if rms else torch.nn.LayerNorm
    return norm_cls(normalized_shape=hidden_size, eps=eps)


class SequenceParallelTorchNorm:
    """megatron-core's ``WrappedTorchNorm`` (torch's RMSNorm / LayerNorm) that also runs under
    ``--sequence-parallel``, which megatron-core's local spec refuses (it has a sequence-parallel
    norm only through Transformer Engine or Apex, neither of which a CPU has).

    Under sequence parallelism each TP rank normalizes its own slice of the tokens, so its weight
    gradient is a partial sum: the weights are marked ``sequence_parallel`` and megatron-core's
    ``finalize_model_grads`` all-reduces them over the TP group, as it does for TE's norms.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        norm = _torch_norm(config, hidden_size, eps)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm


class HeadTorchNorm:
    """The norm of ``--qk-layernorm`` (over each head's channels of the queries and keys) where
    megatron-core's ``WrappedTorchNorm`` would refuse ``--sequence-parallel``. The queries and keys
    it sees hold the whole sequence on every TP rank, so its weights are not marked
    ``sequence_parallel``: megatron-core's ``finalize_model_grads`` sums the q/k norms' gradients
    over the TP group by name, as each rank holds other heads."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        return _torch_norm(config, hidden_size, eps)


def _sequence_parallel_norms(layer) -> None:
    """The local spec's torch norms of a layer (around attention and MLP, and the q/k norms) made
    sequence-parallel capable."""
    for slot in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(layer.submodules, slot, None) is WrappedTorchNorm:
            setattr(layer.submodules, slot, SequenceParallelTorchNorm)
    attention = layer.submodules.self_attention.submodules
    for slot in ("q_layernorm", "k_layernorm"):
        if getattr(attention, slot, None) is WrappedTorchNorm:
            setattr(attention, slot, HeadTorchNorm)


def patch_layer_spec(spec, sparse_config: SparseAttentionConfig, num_query_groups: Optional[int] = None):
    """A copy of a layer spec (or of a block spec's every layer) with our core attention."""
    spec = copy.deepcopy(spec)
    layers = spec.layer_specs if isinstance(spec, TransformerBlockSubmodules) else [spec]
    for layer in layers:
        attn = layer.submodules.self_attention
        if attn is None or not hasattr(attn.submodules, "core_attention"):
            raise ValueError(f"layer spec {layer.module} has no self_attention.core_attention slot")
        attn.submodules.core_attention = sparse_core_attention_spec(sparse_config, num_query_groups)
        _sequence_parallel_norms(layer)
    if isinstance(spec, TransformerBlockSubmodules) and spec.layer_norm is WrappedTorchNorm:
        spec.layer_norm = SequenceParallelTorchNorm
    return spec


def get_gpt_decoder_spec(config: TransformerConfig, layer_spec: ModuleSpec):
    """What ``GPTModel(transformer_layer_spec=...)`` takes for this pipeline stage: for the local
    spec, the decoder block with ``layer_spec`` for each of its layers and its norm as the final
    norm (megatron-core picks its own for a bare layer spec, and its local one refuses
    ``--sequence-parallel``); any other spec as it is."""
    if layer_spec.submodules.input_layernorm is not SequenceParallelTorchNorm:
        return layer_spec
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)


def get_gpt_layer_spec(
    sparse_config: Optional[SparseAttentionConfig] = None,
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    qk_l2_norm: bool = False,
    use_transformer_engine: bool = False,
    num_query_groups: Optional[int] = None,
) -> ModuleSpec:
    """GPT layer spec whose core attention is ours; the rest from megatron-core (local or TE).

    ``num_query_groups`` (the model's) is needed under tensor parallelism when it equals TP or is
    smaller (see :func:`sparse_core_attention_spec`)."""
    if use_transformer_engine and not HAVE_TE:
        raise ValueError("use_transformer_engine=True but Transformer Engine is not installed")
    if use_transformer_engine:
        base = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, qk_l2_norm=qk_l2_norm)
    else:
        base = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization, qk_l2_norm=qk_l2_norm)
    return patch_layer_spec(base, sparse_config or SparseAttentionConfig(), num_query_groups)
