"""``SparseBalanceConfig``: every flag of a run, from dataclasses, validated in one pass.

The run's configuration is a handful of dataclasses, each owned by the module it configures
(``SparseAttentionConfig`` by the attention, ``DataConfig`` by the data, ``BatchingConfig`` by
SAB, ``OptimSettings`` by the trainer, ``DPCommConfig`` by the outer sync) plus the groups below. Flags are generated from the
fields in kebab-case with Megatron-LM's names and conventions (a bool that defaults to False is
``--flag``, one that defaults to True is ``--no-flag``); each field's docstring is its help.
:meth:`SparseBalanceConfig.validate` checks everything before any process group or model exists,
and every message names the flag and what is allowed.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.attention.spec import HAVE_TE, refuse_unknown_normalization
from megatron_sparsebalance.balance.dst import ANCHORS, DSTConfig
from megatron_sparsebalance.balance.sab import BatchingConfig
from megatron_sparsebalance.balance.split import SplitConfig
from megatron_sparsebalance.convert.hf_config import padded_vocab_size
from megatron_sparsebalance.data.datasets import MOCK_VOCAB_SIZE, DataConfig
from megatron_sparsebalance.training.model import (
    MODEL_PRESETS,
    POSITION_EMBEDDING_TYPES,
    ModelShape,
    RecomputeSettings,
)
from megatron_sparsebalance.training.outer_sync import DPCommConfig
from megatron_sparsebalance.training.step import layout_layer_split, pipeline_layer_split
from megatron_sparsebalance.training.tensor_parallel import validate_tensor_parallel
from megatron_sparsebalance.training.trainer import OptimSettings


# Megatron-LM's required architecture flags (its parse_args asserts them); without --model they
# are required here too.
MEGATRON_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
# Any of these given without --model means a Megatron-LM command line: Megatron-LM's defaults apply.
ARCHITECTURE_FLAGS = MEGATRON_REQUIRED + ("ffn_hidden_size", "kv_channels", "num_query_groups")
# Megatron-LM's --position-embedding-type values that megatron-core's GPTModel builds but this
# entry does not, and why.
REFUSED_POSITION_EMBEDDINGS = {
    "relative": "T5-style relative attention bias needs Transformer Engine's attention, not our core attention",
    "yarn": "YaRN scaling is not wired into the sparse attention's RoPE (use rope)",
    "mrope": "multimodal RoPE needs --mrope-section and multimodal inputs, which this entry has no data for",
}


def refuse_position_embedding(position_embedding_type: Optional[str]) -> None:
    """A --position-embedding-type that megatron-core builds and our model does not, refused by
    name (both entries)."""
    if position_embedding_type in REFUSED_POSITION_EMBEDDINGS:
        raise ValueError(f"--position-embedding-type {position_embedding_type} is not supported: "
                         f"{REFUSED_POSITION_EMBEDDINGS[position_embedding_type]}; allowed: "
                         f"{', '.join(POSITION_EMBEDDING_TYPES)}")


@dataclass
class ModelConfig:
    model: Optional[str] = None
    """Architecture preset: tiny (CPU demos), fidelity-small (benchmarks/fidelity.py), qwen2.5-0.5b or
    qwen2.5-3b (Qwen2-style: RMSNorm, SwiGLU, no linear bias, RoPE, no dropout); the flags below
    override it. Without --model a command line is Megatron-LM's: its defaults apply to every flag
    not given (LayerNorm, GeLU MLP, biases, dropout 0.1, learned absolute positions, ...) and
    --num-layers, --hidden-size, --num-attention-heads are required, as in Megatron-LM. A command
    line with no architecture flag at all gets the tiny preset."""
    num_layers: Optional[int] = None
    """Transformer layers (default: the preset's)."""
    hidden_size: Optional[int] = None
    """Hidden size (default: the preset's)."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (default: the preset's; without --model Megatron-LM's: 4 x hidden, or with
    --swiglu 8/3 x hidden rounded down to a multiple of 64)."""
    num_attention_heads: Optional[int] = None
    """Query heads (default: the preset's)."""
    group_query_attention: bool = False
    """Grouped-query attention with --num-query-groups KV heads (Megatron-LM's flag: without it every
    head has its own KV head, unless the --model preset is grouped already)."""
    num_query_groups: Optional[int] = None
    """KV heads with --group-query-attention (default: the preset's; without --model one per head)."""
    kv_channels: Optional[int] = None
    """Head dimension (default: the preset's; without --model hidden / heads)."""
    vocab_size: Optional[int] = None
    """Vocabulary size: rows of the embedding and the output layer (default: the preset's; without
    --model required unless --tokenizer-model gives it)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron-LM's padding of a tokenizer's vocabulary (--tokenizer-model without --model and
    --vocab-size): up to a multiple of this times --tensor-model-parallel-size. A --vocab-size given
    is the embedding's rows as they are."""
    max_position_embeddings: Optional[int] = None
    """Positions the model is built for, at least --seq-length (default: --seq-length); sizes the
    learned position embeddings of --position-embedding-type learned_absolute."""
    position_embedding_type: Optional[str] = None
    """rope, learned_absolute or none (default: the preset's rope; without --model Megatron-LM's
    learned_absolute)."""
    rotary_base: Optional[float] = None
    """RoPE theta (default: the preset's; without --model Megatron-LM's 10000)."""
    rotary_percent: Optional[float] = None
    """Fraction of each head's dimensions RoPE rotates, in (0, 1] (default 1)."""
    hidden_dropout: Optional[float] = None
    """Dropout after the attention and MLP blocks (default: the preset's 0; without --model
    Megatron-LM's 0.1)."""
    attention_dropout: Optional[float] = None
    """Dropout on the attention probabilities: must be 0, the sparse attention kernels have none
    (Megatron-LM's default is 0.1, so a command line without --model must pass --attention-dropout 0)."""
    swiglu: Optional[bool] = None
    """SiLU-gated linear unit MLP; --no-swiglu (or, without --model, leaving --swiglu out) gives
    Megatron-LM's GeLU MLP (default: the preset's SwiGLU)."""
    normalization: Optional[str] = None
    """RMSNorm or LayerNorm (default: the preset's RMSNorm; without --model Megatron-LM's LayerNorm)."""
    norm_epsilon: Optional[float] = None
    """Epsilon of the norms (default: the preset's; without --model Megatron-LM's 1e-5)."""
    init_method_std: Optional[float] = None
    """Standard deviation of the weights' normal initialization (default 0.02)."""
    disable_bias_linear: bool = False
    """No bias in the linear layers (Megatron-LM's flag; the presets have none already). Without
    --model and without this flag every linear layer has a bias, QKV included."""
    add_qkv_bias: Optional[bool] = None
    """A bias on the QKV projection only (default: the preset's, on for Qwen2.5; without --model
    on exactly when the linear layers have biases); --no-add-qkv-bias turns it off."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer (the 3B preset is untied already)."""
    use_checkpoint_args: bool = False
    """Take the architecture from the checkpoint of --load or --pretrained-checkpoint (recorded by
    tools/convert_checkpoint.py or a previous run) instead of --model and the shape flags; an
    explicit --rotary-base still applies (context extension)."""

    @property
    def megatron_defaults(self) -> bool:
        """True when Megatron-LM's defaults apply (no --model, some architecture flag given)."""
        return self.model is None and any(getattr(self, f) is not None for f in ARCHITECTURE_FLAGS)

    def preset(self) -> Optional[str]:
        if self.model is not None:
            return self.model
        return None if self.megatron_defaults else "tiny"

    def shape(self, vocab_size: Optional[int] = None) -> ModelShape:
        """The architecture; ``vocab_size`` (the tokenizer's, padded) stands in for a missing --vocab-size."""
        if self.preset() is not None:
            return self._preset_shape()
        h, heads = self.hidden_size, self.num_attention_heads
        swiglu = bool(self.swiglu)
        bias = not self.disable_bias_linear
        ffn = self.ffn_hidden_size
        if ffn is None:
            ffn = int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h
        return ModelShape(
            num_layers=self.num_layers, hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=heads,
            num_query_groups=(self.num_query_groups or heads) if self.group_query_attention else heads,
            kv_channels=self.kv_channels or h // heads, vocab_size=self.vocab_size or vocab_size,
            rotary_base=_pick(self.rotary_base, 10000.0), norm_epsilon=_pick(self.norm_epsilon, 1e-5),
            add_qkv_bias=_pick(self.add_qkv_bias, bias), untie_embeddings_and_output_weights=self.untie_embeddings_and_output_weights,
            normalization=_pick(self.normalization, "LayerNorm"), swiglu=swiglu, add_bias_linear=bias,
            position_embedding_type=_pick(self.position_embedding_type, "learned_absolute"),
            rotary_percent=_pick(self.rotary_percent, 1.0), max_position_embeddings=self.max_position_embeddings,
            hidden_dropout=_pick(self.hidden_dropout, 0.1), attention_dropout=_pick(self.attention_dropout, 0.1),
            init_method_std=_pick(self.init_method_std, 0.02),
        )

    def _preset_shape(self) -> ModelShape:
        base = MODEL_PRESETS[self.preset()]
        overrides = {f: getattr(self, f) for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                                  "num_query_groups", "kv_channels", "vocab_size", "rotary_base",
                                                  "norm_epsilon", "add_qkv_bias", "normalization", "swiglu",
                                                  "position_embedding_type", "rotary_percent", "max_position_embeddings",
                                                  "hidden_dropout", "attention_dropout", "init_method_std")
                     if getattr(self, f) is not None}
        if self.untie_embeddings_and_output_weights:
            overrides["untie_embeddings_and_output_weights"] = True
        if self.disable_bias_linear:
            overrides["add_bias_linear"] = False
        return dataclasses.replace(base, **overrides)

    def validate(self, vocab_size: Optional[int] = None) -> "ModelConfig":
        if self.model is not None and self.model not in MODEL_PRESETS:
            raise ValueError(f"--model must be one of {sorted(MODEL_PRESETS)}, got {self.model!r}")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got {self.make_vocab_size_divisible_by}")
        if self.num_query_groups is not None and not self.group_query_attention:
            raise ValueError(f"--num-query-groups {self.num_query_groups} needs --group-query-attention (Megatron-LM "
                             "ignores --num-query-groups without it and gives every head its own KV head)")
        if self.megatron_defaults:
            missing = [_flag(f) for f in MEGATRON_REQUIRED if getattr(self, f) is None]
            if self.vocab_size is None and vocab_size is None:
                missing.append("--vocab-size (or --tokenizer-model)")
            if missing:
                raise ValueError(f"without --model, Megatron-LM's required flags must be given: {', '.join(missing)} "
                                 f"(or start from a preset: --model {{{','.join(sorted(MODEL_PRESETS))}}})")
            if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
                raise ValueError(f"--hidden-size ({self.hidden_size}) must be a multiple of --num-attention-heads "
                                 f"({self.num_attention_heads}) without --kv-channels (Megatron-LM's rule)")
        pet = self.position_embedding_type
        refuse_position_embedding(pet)
        if pet is not None and pet not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"--position-embedding-type must be one of {', '.join(POSITION_EMBEDDING_TYPES)}, got {pet!r}")
        if self.normalization is not None:
            refuse_unknown_normalization(self.normalization)
        s = self.shape(vocab_size)
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                     "vocab_size"):
            if getattr(s, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
        if s.num_attention_heads % s.num_query_groups:
            raise ValueError(f"--num-attention-heads ({s.num_attention_heads}) must be a multiple of "
                             f"--num-query-groups ({s.num_query_groups})")
        if s.attention_dropout != 0.0:
            raise ValueError(f"--attention-dropout must be 0, got {s.attention_dropout}: SparseBalance's sparse attention "
                             "kernels have no attention dropout (Megatron-LM's default is 0.1: pass --attention-dropout 0)")
        if not 0.0 <= s.hidden_dropout < 1.0:
            raise ValueError(f"--hidden-dropout must be in [0, 1), got {s.hidden_dropout}")
        if not 0.0 < s.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {s.rotary_percent}")
        if s.position_embedding_type == "rope" and int(s.kv_channels * s.rotary_percent) % 2:
            raise ValueError(f"--rotary-percent {s.rotary_percent} of --kv-channels {s.kv_channels} rotates "
                             f"{int(s.kv_channels * s.rotary_percent)} dimensions: RoPE rotates pairs, make it even")
        if s.norm_epsilon <= 0:
            raise ValueError(f"--norm-epsilon must be > 0, got {s.norm_epsilon}")
        if s.init_method_std <= 0:
            raise ValueError(f"--init-method-std must be > 0, got {s.init_method_std}")
        if s.max_position_embeddings is not None and s.max_position_embeddings < 1:
            raise ValueError(f"--max-position-embeddings must be >= 1, got {s.max_position_embeddings}")
        return self


def _pick(value, default):
    return default if value is None else value


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor parallel size (TP): heads, KV groups, FFN columns and vocabulary split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (PP); the schedule is SparseBalance's 1F1B."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Transformer layers on the first pipeline stage (default: an even split); the stages
    without a fixed count share the rest evenly."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Transformer layers on the last pipeline stage, which also runs the output layer and the
    loss (with a 152K vocabulary nine to twelve Qwen2.5-0.5B layers' worth at 64K): give it fewer."""
    pipeline_model_parallel_layout: Optional[str] = None
    """Megatron-LM's layer layout over the pipeline stages, e.g. "Et*8|t*8|t*8|L" (E embedding, t
    transformer layer, L output layer and loss, | between stages, x*n repeats): one stage per
    rank, and the last stage may hold the output layer and loss alone, which the two flags above
    cannot say. Not with them or --account-for-*-in-pipeline-split."""
    distributed_backend: str = "auto"
    """auto (NCCL with GPUs, gloo without), nccl or gloo."""
    distributed_timeout_minutes: int = 10
    """Timeout of the process groups' collectives (torch.distributed's init_process_group), as Megatron-LM."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism over the tensor-parallel group: norms and activations between
    layers and stages split by tokens over the TP ranks, packs padded to a multiple of TP. With
    --tensor-model-parallel-size 1 it is turned off with a warning, as Megatron-LM does."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the input embedding as one layer of the first pipeline stage when splitting the layers
    (Megatron-LM's rule: (--num-layers + 1) must divide over the stages; the first gets one
    transformer layer fewer)."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one layer of the last pipeline stage when splitting the
    layers (the last stage gets one transformer layer fewer)."""
    context_parallel_size: int = 1
    """Megatron-LM's context parallelism (a sequence's tokens over ranks): only 1, its default, which
    launch scripts often spell out; the sparse attention has no context-parallel path, so a larger
    size is refused by name."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Megatron-LM's interleaved (virtual pipeline) schedule: refused, SparseBalance's 1F1B schedule is
    not interleaved."""


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    """Samples per micro-batch on average: micro-batches per DP rank = global batch / (this x DP).
    Packs are THD, so a micro-batch's sample count may vary under --batching sab/lbb."""
    global_batch_size: int = 16
    """Samples per iteration over all DP ranks."""
    train_iters: int = 20
    """Iterations to train."""
    bf16: bool = False
    """bfloat16 parameters and activations (fp32 main weights in the optimizer)."""
    max_nonfinite_iters: int = 5
    """Stop when this many iterations in a row have a non-finite loss or gradient (each is skipped)."""
    manual_gc: bool = False
    """Turn Python's automatic garbage collector off during training (as Megatron-LM's flag): a
    collection lands in a random micro-batch of a random rank and makes it a straggler that no
    latency model predicts."""
    manual_gc_interval: int = 0
    """With --manual-gc, collect every this many iterations, between iterations (0: never)."""
    empty_unused_memory_level: int = 0
    """Release PyTorch's cached GPU memory each iteration (Megatron-LM's flag): 1 after the
    forward/backward, 2 also after the optimizer step. A stage whose peak fills the GPU (the
    output layer's fp32 logits at 64K tokens) leaves no room for the NCCL communicator that the
    gradient norm's all-reduce creates on its first use, unless the cache is released first."""
    calculate_per_token_loss: bool = False
    """Normalize the loss by the tokens of the whole global batch instead of per micro-batch
    (megatron-core's calculate_per_token_loss; the logged loss is then the token-weighted mean)."""


@dataclass
class DSTFlags:
    dst_anchor: str = "mean"
    """DST anchor: none (fixed --moba-topk, the baseline), min, mean, max or median."""
    dst_p: float = 0.1
    """Largest coverage a layer may lose against --moba-topk when DST shrinks its budget, in [0, 1]."""
    dst_budgets: Optional[tuple] = None
    """Budgets DST may choose (default: the latency model's candidate set)."""
    dst_k_min: int = 1
    """Smallest budget DST gives a straggler."""
    dst_growth: str = "bubble"
    """How far micro-batches below the anchor grow: bubble (only into time the simulated 1F1B
    pipeline would idle), anchor (up to the anchor, the paper's rule) or critical-path (each stage its
    own cost from the pipeline split, the last with the output layer: growth only into each stage's
    idle time, a shrink kept only where it shortens the simulated iteration)."""


@dataclass
class LatencyFlags:
    latency_table: Optional[str] = None
    """Profiled latency table (tools/profile_latency.py); default: the analytic model."""
    latency_table_force: bool = False
    """Use --latency-table even if its metadata (GPU, model, kernel, layout) differs from this run."""
    latency_hardware: str = "auto"
    """Hardware constants of the analytic model: auto (h200 on a GPU, cpu without), h200, h100 or cpu."""


@dataclass
class CheckpointFlags:
    save: Optional[str] = None
    """Directory for checkpoints (Megatron-LM layout: iter_XXXXXXX/, latest_checkpointed_iteration.txt)."""
    load: Optional[str] = None
    """Resume from the newest checkpoint in this directory: model, optimizer, scheduler, RNG, data position, balancer."""
    save_interval: Optional[int] = None
    """Save every this many iterations (and at the end, and on SIGTERM, when --save is given)."""
    load_optim: bool = True
    """With --load, also restore the optimizer state."""
    ckpt_format: str = "torch_dist"
    """Checkpoint format: torch_dist (megatron-core's dist_checkpointing, the only one written here)."""
    pretrained_checkpoint: Optional[str] = None
    """Initialize the weights from this checkpoint (e.g. tools/convert_checkpoint.py output), nothing else."""
    exit_interval: Optional[int] = None
    """Save (if --save) and exit when the iteration is a multiple of this."""


@dataclass
class LoggingFlags:
    log_interval: int = 1
    """Print the iteration line every this many iterations."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard scalars here."""
    timeline_iters: Optional[tuple] = None
    """Write a Chrome-trace timeline of these iterations (beside the config JSON)."""
    log_dir: Optional[str] = None
    """Where the resolved config and timelines go (default: --save, else --tensorboard-dir, else none)."""
    log_throughput: bool = False
    """Print the throughput per GPU (TFLOP/s/GPU) in the iteration line, as Megatron-LM does only with
    this flag (metrics.jsonl and TensorBoard always have it)."""


@dataclass
class EvalFlags:
    eval_interval: Optional[int] = None
    """Evaluate on held-out data every this many iterations and once at the end of training (0 or
    unset: never). Forward only, at the fixed budget --moba-topk (no DST); see training/evaluate.py."""
    eval_iters: int = 10
    """Validation global batches (of --global-batch-size samples) per evaluation; every evaluation
    scores the same ones."""

    def validate(self) -> "EvalFlags":
        if self.eval_interval is not None and self.eval_interval < 0:
            raise ValueError(f"--eval-interval must be >= 0 (0: never evaluate), got {self.eval_interval}")
        if self.enabled and self.eval_iters < 1:
            raise ValueError(f"--eval-iters must be >= 1 with --eval-interval, got {self.eval_iters}")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.eval_interval)


ATTENTION_BACKENDS = ("auto", "local")
REFUSED_ATTENTION_BACKENDS = ("flash", "fused", "unfused")


def refuse_attention_backend(backend: Optional[str]) -> None:
    """An --attention-backend that selects kernels our core attention replaces, refused by name
    (both entries)."""
    if backend in REFUSED_ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend} selects Transformer Engine's or Megatron's fused attention "
                         "kernels, which SparseBalance's core attention replaces: use auto or local")

TRANSFORMER_IMPLS = ("local", "transformer_engine")
CROSS_ENTROPY_FUSION_IMPLS = ("native", "te")


@dataclass
class MegatronLMFlags:
    """Megatron-LM flags a launch script carries that choose kernels and implementations; here the
    core attention is always SparseBalance's (docs/MEGATRON_LM_FLAGS.md says what each does)."""

    use_mcore_models: bool = False
    """Accepted for Megatron-LM scripts: the models here are always megatron-core's."""
    transformer_impl: str = "local"
    """Layer spec around our core attention: local (megatron-core's local spec) or transformer_engine
    (where Transformer Engine imports). Megatron-LM's default is transformer_engine."""
    attention_backend: str = "auto"
    """auto or local: the core attention is SparseBalance's sparse attention either way; Megatron's
    flash, fused and unfused backends are Transformer Engine's / its fused kernels and are refused."""
    masked_softmax_fusion: bool = True
    """Accepted for Megatron-LM scripts: the sparse attention kernels compute the softmax unfused from
    the mask, in fp32, with or without this flag."""
    attention_softmax_in_fp32: bool = False
    """Accepted for Megatron-LM scripts: the sparse attention kernels always compute the softmax in fp32."""
    reset_position_ids: bool = False
    """Accepted for Megatron-LM scripts: every sample of a THD pack starts at position 0 already, with
    or without this flag."""
    reset_attention_mask: bool = False
    """Accepted for Megatron-LM scripts: attention never crosses the samples of a THD pack (per-sample
    cu_seqlens), with or without this flag."""
    cross_entropy_loss_fusion: bool = False
    """The loss in megatron-core's fused vocab-parallel cross entropy: fewer passes over the logits, a
    cheaper output layer (which the latency model, the automatic split and DST's stage costs price)."""
    cross_entropy_fusion_impl: str = "native"
    """With --cross-entropy-loss-fusion: native (megatron-core's, torch.compile'd) or te (Transformer
    Engine's, where it imports)."""

    def validate(self) -> "MegatronLMFlags":
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"--transformer-impl must be local or transformer_engine, got {self.transformer_impl!r}")
        if self.transformer_impl == "transformer_engine" and not HAVE_TE:
            raise ValueError("--transformer-impl transformer_engine needs Transformer Engine, which does not import "
                             "here: use --transformer-impl local (megatron-core's local spec)")
        refuse_attention_backend(self.attention_backend)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be auto or local, got {self.attention_backend!r}")
        if self.cross_entropy_fusion_impl not in CROSS_ENTROPY_FUSION_IMPLS:
            raise ValueError(f"--cross-entropy-fusion-impl must be native or te, got {self.cross_entropy_fusion_impl!r}")
        if self.cross_entropy_fusion_impl == "te":
            # The default (native) cannot be told from a given one; te can, and alone it would do nothing.
            if not self.cross_entropy_loss_fusion:
                raise ValueError("--cross-entropy-fusion-impl te chooses the fused loss's kernel: it needs "
                                 "--cross-entropy-loss-fusion")
            if not HAVE_TE:
                raise ValueError("--cross-entropy-fusion-impl te needs Transformer Engine, which does not import "
                                 "here: use --cross-entropy-fusion-impl native")
        return self


GROUPS = {
    "model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig, "optim": OptimSettings,
    "data": DataConfig, "batching": BatchingConfig, "sparse": SparseAttentionConfig, "dst": DSTFlags,
    "latency": LatencyFlags, "checkpoint": CheckpointFlags, "logging": LoggingFlags, "dp_comm": DPCommConfig,
    "eval": EvalFlags, "recompute": RecomputeSettings, "split": SplitConfig, "megatron_lm": MegatronLMFlags,
}


@dataclass
class SparseBalanceConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimSettings = field(default_factory=OptimSettings)
    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    sparse: SparseAttentionConfig = field(default_factory=SparseAttentionConfig)
    dst: DSTFlags = field(default_factory=DSTFlags)
    latency: LatencyFlags = field(default_factory=LatencyFlags)
    checkpoint: CheckpointFlags = field(default_factory=CheckpointFlags)
    logging: LoggingFlags = field(default_factory=LoggingFlags)
    dp_comm: DPCommConfig = field(default_factory=DPCommConfig)
    eval: EvalFlags = field(default_factory=EvalFlags)
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)
    split: SplitConfig = field(default_factory=SplitConfig)
    megatron_lm: MegatronLMFlags = field(default_factory=MegatronLMFlags)
    _tokenizer_vocab: Optional[int] = field(default=None, init=False, repr=False, compare=False)

    # ---- derived ---------------------------------------------------------------------------

    def model_shape(self) -> ModelShape:
        """The architecture of the run: the flags', or the checkpoint's with --use-checkpoint-args."""
        if not self.model.use_checkpoint_args:
            return self.model.shape(self.tokenizer_vocab_size())
        from megatron.core import dist_checkpointing

        from megatron_sparsebalance.training.checkpointing import latest_checkpoint

        source = self.checkpoint.load or self.checkpoint.pretrained_checkpoint
        path = latest_checkpoint(source) if source else None
        if path is None:
            raise ValueError("--use-checkpoint-args needs --load or --pretrained-checkpoint with a complete checkpoint"
                             + (f" (none in {source})" if source else ""))
        recorded = dist_checkpointing.load_common_state_dict(path).get("common", {}).get("model_shape")
        if recorded is None:
            raise ValueError(f"--use-checkpoint-args: {path} records no model_shape")
        shape = ModelShape(**recorded)
        # RoPE's base holds no weights: raising it is how a pretrained model's context is extended.
        if self.model.rotary_base is not None:
            shape = dataclasses.replace(shape, rotary_base=self.model.rotary_base)
        return shape

    def tokenizer_vocab_size(self) -> Optional[int]:
        """Without --model and --vocab-size, Megatron-LM sizes the vocabulary from the tokenizer:
        ``--tokenizer-model``'s, padded to a multiple of --make-vocab-size-divisible-by x TP, so
        that both entries build the same embedding from the same flags."""
        if not self.model.megatron_defaults or self.model.vocab_size is not None or not self.data.tokenizer_model:
            return None
        if self._tokenizer_vocab is None:
            from megatron_sparsebalance.data.datasets import load_tokenizer

            # TP < 1 is refused later by name (validate_tensor_parallel); pad as at TP 1 until then.
            tp = max(1, self.parallel.tensor_model_parallel_size)
            self._tokenizer_vocab = padded_vocab_size(len(load_tokenizer(self.data.tokenizer_model)),
                                                      self.model.make_vocab_size_divisible_by, tp)
        return self._tokenizer_vocab

    def pipeline_layer_split(self, shape: Optional[ModelShape] = None) -> list:
        """Transformer layers per pipeline stage (checks the --decoder-*-pipeline-num-layers and
        --account-for-*-in-pipeline-split flags)."""
        par = self.parallel
        num_layers = (shape or self.model_shape()).num_layers
        if par.pipeline_model_parallel_layout is not None:
            return layout_layer_split(par.pipeline_model_parallel_layout, num_layers, par.pipeline_model_parallel_size)
        return pipeline_layer_split(num_layers, par.pipeline_model_parallel_size,
                                    par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers,
                                    par.account_for_embedding_in_pipeline_split, par.account_for_loss_in_pipeline_split)

    def end_stage_layers(self, shape: Optional[ModelShape] = None) -> tuple:
        """``(first, last)`` stage layer counts for megatron-core (None: an even split, or a layout)."""
        par = self.parallel
        if par.pipeline_model_parallel_layout is not None:
            return None, None
        if par.pipeline_model_parallel_size > 1 and (par.account_for_embedding_in_pipeline_split
                                                     or par.account_for_loss_in_pipeline_split):
            split = self.pipeline_layer_split(shape)
            return split[0], split[-1]
        return par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers

    @property
    def sequence_parallel(self) -> bool:
        """--sequence-parallel as it takes effect: off with TP = 1, as Megatron-LM turns it off."""
        return self.parallel.sequence_parallel and self.parallel.tensor_model_parallel_size > 1

    def warnings(self) -> list:
        """What Megatron-LM warns about for these flags (printed by rank 0 at start-up)."""
        out = []
        if self.parallel.sequence_parallel and not self.sequence_parallel:
            out.append("Disabling sequence parallelism because tensor model parallelism is disabled "
                       "(--sequence-parallel with --tensor-model-parallel-size 1)")
        if self.checkpoint.save_interval is not None and self.checkpoint.save is None:
            out.append(f"--save-interval {self.checkpoint.save_interval} without --save: no checkpoint will be saved")
        if self.data.data_path and self.data.mock_data:
            out.append(f"--data-path {self.data.data_path} is not read: --mock-data replaces it (as in Megatron-LM)")
        if self.data.split is not None and self.data.mock_data:
            out.append(f"--split {self.data.split} is not used with --mock-data: the mock validation samples come "
                       "from a held-out stream of their own (no --data-path to split)")
        return out

    def dst_config(self) -> DSTConfig:
        return DSTConfig(anchor=self.dst.dst_anchor, p=self.dst.dst_p, k_base=self.sparse.moba_topk,
                         growth=self.dst.dst_growth)

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.parallel.tensor_model_parallel_size * self.parallel.pipeline_model_parallel_size)

    def micro_batches_per_rank(self, world_size: int) -> int:
        return self.training.global_batch_size // (self.training.micro_batch_size * self.data_parallel_size(world_size))

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in GROUPS}

    def write_json(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, default=str)
            f.write("\n")

    # ---- validation ------------------------------------------------------------------------

    def validate(self, world_size: int) -> "SparseBalanceConfig":
        """Every check a run needs before process groups and models exist; resolves the defaults
        that depend on other flags (--lr-decay-iters: --train-iters, as Megatron-LM)."""
        if self.data.tokenizer_model is not None and not os.path.isdir(self.data.tokenizer_model):
            raise ValueError(f"--tokenizer-model {self.data.tokenizer_model}: not a directory")
        if not self.model.use_checkpoint_args:
            self.model.validate(self.tokenizer_vocab_size())
        self.megatron_lm.validate()
        if self.optim.lr_decay_iters is None:
            self.optim.lr_decay_iters = self.training.train_iters
        self.optim.validate()
        if self.data.mock_data and self.data.mock_vocab_size is None:
            self.data.mock_vocab_size = min(MOCK_VOCAB_SIZE, self.model_shape().vocab_size)
        self.data.validate()
        self.batching.validate(self.data.seq_length)
        self.sparse.validate()
        self.dst_config().validate()
        self.dp_comm.validate(self.optim.use_distributed_optimizer)
        self.recompute.validate()
        self._validate_device_flags()
        par, tr = self.parallel, self.training
        self.split.validate(par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers,
                            par.pipeline_model_parallel_layout)
        if par.pipeline_model_parallel_layout is not None:  # its own errors first: they do not depend on the world
            if (par.decoder_first_pipeline_num_layers is not None or par.decoder_last_pipeline_num_layers is not None
                    or par.account_for_embedding_in_pipeline_split or par.account_for_loss_in_pipeline_split):
                raise ValueError("--pipeline-model-parallel-layout places every layer itself: not with "
                                 "--decoder-first/last-pipeline-num-layers or --account-for-*-in-pipeline-split")
            layout_layer_split(par.pipeline_model_parallel_layout, self.model_shape().num_layers,
                               par.pipeline_model_parallel_size)
        validate_tensor_parallel(self.model_shape(), par.tensor_model_parallel_size, self.sequence_parallel,
                                 par.context_parallel_size)
        if par.pipeline_model_parallel_size < 1:
            raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {par.pipeline_model_parallel_size}")
        if par.num_layers_per_virtual_pipeline_stage is not None:
            raise ValueError("--num-layers-per-virtual-pipeline-stage is not supported: Megatron-LM's interleaved "
                             "(virtual pipeline) schedule is not built here; SparseBalance's schedule is "
                             "non-interleaved 1F1B (leave the flag out)")
        if par.distributed_timeout_minutes < 1:
            raise ValueError(f"--distributed-timeout-minutes must be >= 1, got {par.distributed_timeout_minutes}")
        if par.distributed_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"--distributed-backend must be auto, nccl or gloo, got {par.distributed_backend!r}")
        model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
        if world_size % model_parallel:
            raise ValueError(f"the world size {world_size} is not divisible by --tensor-model-parallel-size x "
                             f"--pipeline-model-parallel-size = {model_parallel}")
        shape = self.model_shape()
        if self.split.decoder_pipeline_split == "auto":  # chosen at start-up among the splits that exist
            if par.pipeline_model_parallel_size > shape.num_layers:
                raise ValueError(f"--decoder-pipeline-split auto: --num-layers {shape.num_layers} cannot fill "
                                 f"--pipeline-model-parallel-size {par.pipeline_model_parallel_size} stages")
        else:
            self.pipeline_layer_split(shape)
        if shape.max_position_embeddings is not None and shape.max_position_embeddings < self.data.seq_length:
            raise ValueError(f"--max-position-embeddings ({shape.max_position_embeddings}) must be >= --seq-length "
                             f"({self.data.seq_length})")
        if self.data.mock_data and self.data.mock_vocab_size is not None and self.data.mock_vocab_size > shape.vocab_size:
            raise ValueError(f"--mock-vocab-size ({self.data.mock_vocab_size}) must be <= the model's vocabulary "
                             f"({shape.vocab_size}, --vocab-size): mock token ids index the embedding")
        dp = self.data_parallel_size(world_size)
        if tr.micro_batch_size < 1 or tr.global_batch_size < 1:
            raise ValueError("--micro-batch-size and --global-batch-size must be >= 1")
        if tr.global_batch_size % (tr.micro_batch_size * dp):
            raise ValueError(f"--global-batch-size ({tr.global_batch_size}) must be divisible by --micro-batch-size "
                             f"({tr.micro_batch_size}) x data-parallel size ({dp})")
        if tr.train_iters < 0:
            raise ValueError(f"--train-iters must be >= 0, got {tr.train_iters}")
        if tr.max_nonfinite_iters < 1:
            raise ValueError(f"--max-nonfinite-iters must be >= 1, got {tr.max_nonfinite_iters}")
        blocks = -(-self.data.seq_length // self.sparse.moba_block_size)
        if self.sparse.sparse_attention and self.sparse.moba_topk > blocks:
            raise ValueError(f"--moba-topk ({self.sparse.moba_topk}) is larger than a sequence can use: --seq-length "
                             f"{self.data.seq_length} has {blocks} blocks of --moba-block-size {self.sparse.moba_block_size}")
        if self.dst.dst_k_min < 1 or self.dst.dst_k_min > self.sparse.moba_topk:
            raise ValueError(f"--dst-k-min must be in [1, --moba-topk={self.sparse.moba_topk}], got {self.dst.dst_k_min}")
        if self.dst.dst_budgets is not None and min(self.dst.dst_budgets) < 1:
            raise ValueError(f"--dst-budgets must be integers >= 1, got {list(self.dst.dst_budgets)}")
        if self.dst.dst_anchor != "none" and not self.sparse.sparse_attention:
            raise ValueError("--dst-anchor needs sparse attention: use --dst-anchor none with --no-sparse-attention")
        if self.batching.batching == "sab" and not self.sparse.sparse_attention:
            raise ValueError("--batching sab balances sparse-attention latency: use lbb or none with --no-sparse-attention")
        if self.latency.latency_hardware not in ("auto", "h200", "h100", "cpu"):
            raise ValueError(f"--latency-hardware must be auto, h200, h100 or cpu, got {self.latency.latency_hardware!r}")
        if self.latency.latency_table is not None and not os.path.isfile(self.latency.latency_table):
            raise ValueError(f"--latency-table {self.latency.latency_table}: no such file")
        ck, lg = self.checkpoint, self.logging
        for name in ("save_interval", "exit_interval"):
            v = getattr(ck, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if ck.ckpt_format != "torch_dist":
            raise ValueError(f"--ckpt-format {ck.ckpt_format} is not supported: checkpoints here are megatron-core's "
                             "dist_checkpointing (--ckpt-format torch_dist)")
        if ck.load is not None and not os.path.isdir(ck.load):
            raise ValueError(f"--load {ck.load}: no such directory")
        if ck.pretrained_checkpoint is not None and not os.path.isdir(ck.pretrained_checkpoint):
            raise ValueError(f"--pretrained-checkpoint {ck.pretrained_checkpoint}: no such directory")
        if self.training.manual_gc_interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0, got {self.training.manual_gc_interval}")
        if self.training.manual_gc_interval and not self.training.manual_gc:
            raise ValueError("--manual-gc-interval needs --manual-gc")
        if self.training.empty_unused_memory_level not in (0, 1, 2):
            raise ValueError(f"--empty-unused-memory-level must be 0, 1 or 2, got "
                             f"{self.training.empty_unused_memory_level}")
        if lg.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {lg.log_interval}")
        if not self.data.mock_data and self.data.data_path and not (
                os.path.isfile(self.data.data_path) or os.path.isfile(self.data.data_path + ".idx")):
            raise ValueError(f"--data-path {self.data.data_path}: neither a .jsonl file nor the prefix of a .bin/.idx pair")
        self._validate_eval()
        return self

    def _validate_device_flags(self) -> None:
        """Flags that megatron-core runs only on a GPU: refused by name on a CPU-only host."""
        if torch.cuda.is_available():
            return
        why = {
            "--bf16": "megatron-core's mixed-precision optimizer accepts only CUDA parameters "
                      "(torch.cuda.BFloat16Tensor); CPU runs train in fp32",
            "--use-distributed-optimizer": "megatron-core's distributed optimizer accepts only CUDA parameters "
                                           "(torch.cuda.FloatTensor)",
        }
        # --overlap-grad-reduce runs on the CPU: with one distributed-optimizer instance megatron-core's
        # DDP issues asynchronous all-reduces, which gloo has (tests/test_megatron_flags.py).
        given = {"--bf16": self.training.bf16, "--use-distributed-optimizer": self.optim.use_distributed_optimizer}
        for flag, on in given.items():
            if on:
                raise ValueError(f"{flag} needs a GPU: {why[flag]}")

    def _validate_eval(self) -> None:
        ev, valid = self.eval.validate(), self.data.valid_data_path
        if valid is not None:
            if not (os.path.isfile(valid) or os.path.isfile(valid + ".idx")):
                raise ValueError(f"--valid-data-path {valid}: neither a .jsonl file nor the prefix of a .bin/.idx pair")
            if valid.endswith(".jsonl") and not self.data.tokenizer_model:
                raise ValueError("--tokenizer-model is required for a .jsonl --valid-data-path")
            if not ev.enabled:
                raise ValueError("--valid-data-path is read only by evaluation: add --eval-interval N")
        if ev.enabled and valid is None and not self.data.mock_data and self.data.split is None:
            raise ValueError("--eval-interval needs validation data: --valid-data-path, --split with --data-path, or "
                             "--mock-data (a held-out mock split)")
        # DiLoCo/SparseLoCo replicas hold different weights between outer steps, and each scores
        # only its share of the validation batch: evaluate where they agree.
        interval = self.dp_comm.outer_steps_interval
        if ev.enabled and self.dp_comm.local_steps and ev.eval_interval % interval:
            raise ValueError(f"--eval-interval ({ev.eval_interval}) must be a multiple of --outer-steps-interval "
                             f"({interval}) with --dp-comm {self.dp_comm.dp_comm}: replicas agree only after an outer step")


# ---- flags ---------------------------------------------------------------------------------


def field_docs(cls) -> dict:
    """The docstring under each field of a dataclass (how Megatron documents its config fields)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


# Help of the ``--no-X`` flags generated from fields that default to True: the field docstring says
# what the field does when on, so the flag's help must say what turning it off does.
NEGATED_HELP = {
    "load_optim": "With --load, do not restore the optimizer state (nor the LR scheduler): the optimizer "
                  "starts fresh from the loaded weights (Megatron-LM's --no-load-optim).",
    "track_coverage": "Do not compute the coverage C(k) of the layers' selections unless DST's coverage bound "
                      "(--dst-p) needs it: the metrics and SAB's estimator then go without it.",
    "masked_softmax_fusion": "Accepted for Megatron-LM scripts (it turns off Megatron's fused scale-mask-softmax): "
                             "the sparse attention kernels never use that fusion.",
}


# Paths Megatron-LM takes as a list (a weighted blend of data sets).
BLENDABLE_PATHS = ("data_path", "valid_data_path")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def add_arguments(parser: argparse.ArgumentParser, groups: Optional[dict] = None, skip_existing: bool = False,
                  flat_dest: bool = False) -> argparse.ArgumentParser:
    """Add every field of ``groups`` (default: all) as a flag.

    ``skip_existing`` leaves out the flags ``parser`` already has, and ``flat_dest`` stores each
    value under its field's name: how Megatron-LM's ``extra_args_provider`` adds ours to its own
    parser (``megatron_lm.py``), which already owns the flags both entries share.
    """
    seen = {}
    existing = set(parser._option_string_actions) if skip_existing else set()
    for group_name, cls in (groups or GROUPS).items():
        group = parser.add_argument_group(group_name)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen:
                raise ValueError(f"flag {_flag(f.name)} is defined by both {seen[f.name]} and {group_name}")
            seen[f.name] = group_name
            if {_flag(f.name), "--no-" + f.name.replace("_", "-")} & existing:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = docs.get(f.name, "")
            typ = _base_type(hints[f.name])
            dest = f.name if flat_dest else f"{group_name}.{f.name}"
            if typ is bool:
                # Both spellings: --sparse-attention (users type both), and the architecture
                # switches whose default is the preset's (None), which a flag turns on or off.
                if f.name == "sparse_attention" or default is None:
                    group.add_argument(_flag(f.name), dest=dest, action=argparse.BooleanOptionalAction, default=default,
                                       help=help_text)
                elif default:
                    # The docstring describes the field (the positive); the flag is its negation.
                    if f.name not in NEGATED_HELP:
                        raise ValueError(f"--no-{f.name.replace('_', '-')} needs its help in NEGATED_HELP")
                    group.add_argument("--no-" + f.name.replace("_", "-"), dest=dest, action="store_false",
                                       help=NEGATED_HELP[f.name])
                else:
                    group.add_argument(_flag(f.name), dest=dest, action="store_true", help=help_text)
            elif typ is tuple or typing.get_origin(typ) is tuple:
                item = (typing.get_args(typ) or (int,))[0]  # bare ``tuple`` fields hold ints
                group.add_argument(_flag(f.name), dest=dest, type=item, nargs="+", default=default, help=help_text,
                                   metavar="N" if item is int else item.__name__.upper())
            elif f.name in BLENDABLE_PATHS:
                # Megatron-LM's nargs: a weighted blend (--data-path 0.3 a 0.7 b) parses, and is
                # refused by name in validation instead of as argparse's "unrecognized arguments".
                group.add_argument(_flag(f.name), dest=dest, type=typ, nargs="+", default=default, help=help_text,
                                   metavar="PATH")
            else:
                group.add_argument(_flag(f.name), dest=dest, type=typ, default=default, help=help_text,
                                   metavar=typ.__name__.upper())
    return parser


class _StandaloneParser(argparse.ArgumentParser):
    """The standalone entry's parser: a flag it does not know gets argparse's error plus where
    that flag can run. A user who brings a whole Megatron-LM script here (``--fp16``,
    ``--rampup-batch-size``, ...) needs the Megatron-LM entry, which parses with Megatron-LM's own
    parser; argparse alone would only say "unrecognized arguments"."""

    def error(self, message):
        if message.startswith("unrecognized arguments"):
            message += ("\n  this entry takes the flags listed in docs/MEGATRON_LM_FLAGS.md; a Megatron-LM launch "
                        "script as a whole goes to Megatron-LM's own training loop: python -m "
                        "megatron_sparsebalance.megatron_lm with the same flags (megatron-core 0.19, "
                        "docs/MEGATRON_LM.md)")
        super().error(message)


def build_parser(prog: str = "megatron_sparsebalance.pretrain") -> argparse.ArgumentParser:
    parser = _StandaloneParser(prog=prog, description="SparseBalance pretraining on megatron-core "
                               "(launch with torchrun; Megatron-LM's flag names).",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return add_arguments(parser)


def config_from_args(args: argparse.Namespace) -> SparseBalanceConfig:
    groups = {}
    for group_name, cls in GROUPS.items():
        values = {f.name: getattr(args, f"{group_name}.{f.name}") for f in dataclasses.fields(cls)}
        for k, v in values.items():
            if isinstance(v, list) and k in BLENDABLE_PATHS:
                if len(v) > 1:
                    raise ValueError(f"{_flag(k)} takes one path here (a .jsonl file or a .bin/.idx prefix); "
                                     f"Megatron-LM's weighted blend of several ({' '.join(v)}) is not supported")
                values[k] = v[0]
            elif isinstance(v, list):
                values[k] = tuple(v)
        groups[group_name] = cls(**values)
    return SparseBalanceConfig(**groups)


def parse_config(argv=None) -> SparseBalanceConfig:
    return config_from_args(build_parser().parse_args(argv))


__all__ = ["ANCHORS", "SparseBalanceConfig", "add_arguments", "build_parser", "parse_config", "field_docs"]
