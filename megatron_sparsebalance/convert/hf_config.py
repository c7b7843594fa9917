"""A Hugging Face ``config.json`` as our :class:`ModelShape`, and the checks that come with it.

Only what megatron-core's GPT model (local spec: RMSNorm, SwiGLU, RoPE, no linear bias except
optionally on QKV) can represent exactly is accepted; everything else fails here, by name,
before a single tensor is read, rather than converting into a model that runs and is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_sparsebalance.training.model import ModelShape

# architecture class -> (model_type, family name used in messages, QKV bias)
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": ("qwen2", "Qwen2 / Qwen2.5", True),
    "LlamaForCausalLM": ("llama", "Llama (1, 2, 3 without rope scaling)", False),
}
_BY_MODEL_TYPE = {model_type: arch for arch, (model_type, _, _) in SUPPORTED_ARCHITECTURES.items()}


def supported_list() -> str:
    return ", ".join(f"{arch} ({family})" for arch, (_, family, _) in SUPPORTED_ARCHITECTURES.items())


@dataclass(frozen=True)
class HFModelInfo:
    """What the weight mapping needs beyond the Megatron shape."""

    architecture: str
    hf_vocab_size: int  # rows of the HF embedding; the Megatron one may be padded beyond it
    tie_word_embeddings: bool
    shape: ModelShape
    make_vocab_size_divisible_by: int
    tensor_model_parallel_size: int = 1
    """The TP the vocabulary was padded for (Megatron-LM pads to a multiple of divisible-by x TP)."""


def architecture_of(config) -> str:
    """The supported architecture class a config describes, else a ValueError naming what is supported."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if archs:
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs} (model_type {model_type!r}); supported: {supported_list()}")
        return archs[0]
    # Configs built in code (not loaded from a hub directory) often have architectures=None.
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(f"unsupported architecture: model_type {model_type!r} with no 'architectures'; supported: {supported_list()}")


def rope_theta_of(config) -> float:
    """RoPE base; refuses scaled RoPE variants, which our model builds without (it would run and be wrong
    beyond the short contexts where the scaling is inactive)."""
    # transformers >= 5 keeps RoPE settings in ``rope_parameters``; older ones in rope_theta/rope_scaling.
    params = getattr(config, "rope_parameters", None)
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(params, dict) and "rope_theta" in params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params["rope_theta"]
    else:
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        theta = getattr(config, "rope_theta", 10000.0)
    if rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported by the converter (only rope_type 'default')")
    return float(theta)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Megatron-LM's ``--make-vocab-size-divisible-by``: the embedding rows are padded up to a
    multiple of ``divisible_by x TP`` (as Megatron-LM's tokenizer set-up does), so that every
    tensor-parallel shard holds a whole number of rows, and a Megatron-LM run at that TP computes
    the same padded size from the HF vocabulary."""
    if divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got {divisible_by}")
    if tensor_parallel_size < 1:
        raise ValueError(f"--target-tensor-model-parallel-size must be >= 1, got {tensor_parallel_size}")
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def hf_model_info(config, make_vocab_size_divisible_by: int = 128, tensor_parallel_size: int = 1) -> HFModelInfo:
    """Check an HF config and turn it into a :class:`ModelShape` (vocab padded as Megatron-LM does)."""
    arch = architecture_of(config)
    qkv_bias = SUPPORTED_ARCHITECTURES[arch][2]
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported: megatron's SwiGLU MLP is silu-gated")
    if arch == "LlamaForCausalLM":
        if getattr(config, "attention_bias", False):
            # Llama's attention_bias also puts a bias on o_proj; megatron has QKV bias alone only.
            raise ValueError("LlamaForCausalLM with attention_bias=True is not supported (bias on o_proj)")
        if getattr(config, "mlp_bias", False):
            raise ValueError("LlamaForCausalLM with mlp_bias=True is not supported")
    if arch == "Qwen2ForCausalLM":
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
            raise ValueError("Qwen2 with sliding-window layers is not supported: our attention is full causal")
    heads = config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % groups:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({groups})")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    shape = ModelShape(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        vocab_size=padded_vocab_size(config.vocab_size, make_vocab_size_divisible_by, tensor_parallel_size),
        rotary_base=rope_theta_of(config),
        norm_epsilon=float(config.rms_norm_eps),
        add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not tied,
    )
    return HFModelInfo(arch, config.vocab_size, tied, shape, make_vocab_size_divisible_by, tensor_parallel_size)


def check_pipeline_layout(num_layers: int, pipeline_parallel_size: int, what: Optional[str] = None,
                          flag: str = "--pipeline-model-parallel-size") -> None:
    """Our pipeline gives every stage the same number of layers; say which sizes would work."""
    if pipeline_parallel_size < 1 or num_layers % pipeline_parallel_size:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ValueError(
            f"{flag} {pipeline_parallel_size} does not divide the {num_layers} layers"
            f"{' of ' + what if what else ''}; sizes that do: {divisors}"
        )


def megatron_flags(shape: ModelShape) -> str:
    """The Megatron-LM model flags of a shape (printed for the user and written to the checkpoint).

    Complete without ``--model``: ``pretrain`` given these flags alone builds exactly ``shape``
    (Megatron-LM's defaults, which then apply, are overridden wherever the shape differs: dropout,
    position embedding, norm, MLP, biases).
    """
    base = int(shape.rotary_base) if float(shape.rotary_base).is_integer() else shape.rotary_base  # Megatron-LM: int
    flags = [
        f"--num-layers {shape.num_layers}", f"--hidden-size {shape.hidden_size}",
        f"--ffn-hidden-size {shape.ffn_hidden_size}", f"--num-attention-heads {shape.num_attention_heads}",
        f"--group-query-attention --num-query-groups {shape.num_query_groups}", f"--kv-channels {shape.kv_channels}",
        f"--vocab-size {shape.vocab_size}", f"--position-embedding-type {shape.position_embedding_type}",
        f"--rotary-base {base}", f"--normalization {shape.normalization}", f"--norm-epsilon {shape.norm_epsilon:g}",
        f"--attention-dropout {shape.attention_dropout:g}", f"--hidden-dropout {shape.hidden_dropout:g}",
        f"--init-method-std {shape.init_method_std:g}",
    ]
    if shape.rotary_percent != 1.0:
        flags.append(f"--rotary-percent {shape.rotary_percent:g}")
    if shape.swiglu:
        flags.append("--swiglu")
    if not shape.add_bias_linear:
        flags.append("--disable-bias-linear")
    if shape.add_qkv_bias:
        flags.append("--add-qkv-bias")
    if shape.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    return " ".join(flags)
