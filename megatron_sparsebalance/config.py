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

from megatron_sparsebalance.attention.config import SparseAttentionConfig
from megatron_sparsebalance.balance.dst import ANCHORS, DSTConfig
from megatron_sparsebalance.balance.sab import BatchingConfig
from megatron_sparsebalance.data.datasets import DataConfig
from megatron_sparsebalance.training.model import MODEL_PRESETS, ModelShape, RecomputeSettings
from megatron_sparsebalance.training.outer_sync import DPCommConfig
from megatron_sparsebalance.training.step import pipeline_layer_split
from megatron_sparsebalance.training.tensor_parallel import validate_tensor_parallel
from megatron_sparsebalance.training.trainer import OptimSettings


@dataclass
class ModelConfig:
    model: str = "tiny"
    """Architecture preset: tiny (CPU demos), fidelity-small (benchmarks/fidelity.py), qwen2.5-0.5b or
    qwen2.5-3b; the flags below override it."""
    num_layers: Optional[int] = None
    """Transformer layers (default: the preset's)."""
    hidden_size: Optional[int] = None
    """Hidden size (default: the preset's)."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (default: the preset's)."""
    num_attention_heads: Optional[int] = None
    """Query heads (default: the preset's)."""
    num_query_groups: Optional[int] = None
    """KV heads for GQA (default: the preset's)."""
    kv_channels: Optional[int] = None
    """Head dimension (default: the preset's)."""
    vocab_size: Optional[int] = None
    """Vocabulary size (default: the preset's)."""
    rotary_base: Optional[float] = None
    """RoPE theta (default: the preset's)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer (the 3B preset is untied already)."""
    use_checkpoint_args: bool = False
    """Take the architecture from the checkpoint of --load or --pretrained-checkpoint (recorded by
    tools/convert_checkpoint.py or a previous run) instead of --model and the shape flags."""

    def shape(self) -> ModelShape:
        base = MODEL_PRESETS[self.model]
        overrides = {f: getattr(self, f) for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                                  "num_query_groups", "kv_channels", "vocab_size", "rotary_base")
                     if getattr(self, f) is not None}
        if self.untie_embeddings_and_output_weights:
            overrides["untie_embeddings_and_output_weights"] = True
        return dataclasses.replace(base, **overrides)

    def validate(self) -> "ModelConfig":
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"--model must be one of {sorted(MODEL_PRESETS)}, got {self.model!r}")
        s = self.shape()
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                     "vocab_size"):
            if getattr(s, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
        if s.num_attention_heads % s.num_query_groups:
            raise ValueError(f"--num-attention-heads ({s.num_attention_heads}) must be a multiple of "
                             f"--num-query-groups ({s.num_query_groups})")
        return self


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor parallel size (TP): heads, KV groups, FFN columns and vocabulary split over this many ranks."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs TP > 1): norms and activations between layers and stages
    split by tokens over the TP ranks; packs are padded to a multiple of TP."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (PP); the schedule is SparseBalance's 1F1B."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Transformer layers on the first pipeline stage (default: an even split); the stages
    without a fixed count share the rest evenly."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Transformer layers on the last pipeline stage, which also runs the output layer and the
    loss (with a 152K vocabulary six to nine Qwen2.5-0.5B layers' worth): give it fewer."""
    distributed_backend: str = "auto"
    """auto (NCCL with GPUs, gloo without), nccl or gloo."""


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
    pipeline would idle) or anchor (up to the anchor, the paper's rule)."""


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


GROUPS = {
    "model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig, "optim": OptimSettings,
    "data": DataConfig, "batching": BatchingConfig, "sparse": SparseAttentionConfig, "dst": DSTFlags,
    "latency": LatencyFlags, "checkpoint": CheckpointFlags, "logging": LoggingFlags, "dp_comm": DPCommConfig,
    "eval": EvalFlags, "recompute": RecomputeSettings,
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

    # ---- derived ---------------------------------------------------------------------------

    def model_shape(self) -> ModelShape:
        """The architecture of the run: the flags', or the checkpoint's with --use-checkpoint-args."""
        if not self.model.use_checkpoint_args:
            return self.model.shape()
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
        return ModelShape(**recorded)

    def pipeline_layer_split(self, shape: Optional[ModelShape] = None) -> list:
        """Transformer layers per pipeline stage (checks the --decoder-*-pipeline-num-layers flags)."""
        par = self.parallel
        return pipeline_layer_split((shape or self.model_shape()).num_layers, par.pipeline_model_parallel_size,
                                    par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers)

    def dst_config(self) -> DSTConfig:
        return DSTConfig(anchor=self.dst.dst_anchor, p=self.dst.dst_p, k_base=self.sparse.moba_topk,
                         growth=self.dst.dst_growth)

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.parallel.tensor_model_parallel_size * self.parallel.pipeline_model_parallel_size)

    def micro_batches_per_rank(self, world_size: int) -> int:
        return self.training.global_batch_size // (self.training.micro_batch_size * self.data_parallel_size(world_size))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def write_json(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, default=str)
            f.write("\n")

    # ---- validation ------------------------------------------------------------------------

    def validate(self, world_size: int) -> "SparseBalanceConfig":
        """Every check a run needs before process groups and models exist."""
        if not self.model.use_checkpoint_args:
            self.model.validate()
        self.optim.validate()
        self.data.validate()
        self.batching.validate(self.data.seq_length)
        self.sparse.validate()
        self.dst_config().validate()
        self.dp_comm.validate(self.optim.use_distributed_optimizer)
        self.recompute.validate()
        par, tr = self.parallel, self.training
        validate_tensor_parallel(self.model_shape(), par.tensor_model_parallel_size, par.sequence_parallel)
        if par.pipeline_model_parallel_size < 1:
            raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {par.pipeline_model_parallel_size}")
        if par.distributed_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"--distributed-backend must be auto, nccl or gloo, got {par.distributed_backend!r}")
        model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
        if world_size % model_parallel:
            raise ValueError(f"the world size {world_size} is not divisible by --tensor-model-parallel-size x "
                             f"--pipeline-model-parallel-size = {model_parallel}")
        shape = self.model_shape()
        self.pipeline_layer_split(shape)
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
        if ck.save_interval is not None and ck.save is None:
            raise ValueError("--save-interval needs --save")
        if ck.load is not None and not os.path.isdir(ck.load):
            raise ValueError(f"--load {ck.load}: no such directory")
        if ck.pretrained_checkpoint is not None and not os.path.isdir(ck.pretrained_checkpoint):
            raise ValueError(f"--pretrained-checkpoint {ck.pretrained_checkpoint}: no such directory")
        if self.training.manual_gc_interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0, got {self.training.manual_gc_interval}")
        if self.training.manual_gc_interval and not self.training.manual_gc:
            raise ValueError("--manual-gc-interval needs --manual-gc")
        if lg.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {lg.log_interval}")
        if not self.data.mock_data and self.data.data_path and not (
                os.path.isfile(self.data.data_path) or os.path.isfile(self.data.data_path + ".idx")):
            raise ValueError(f"--data-path {self.data.data_path}: neither a .jsonl file nor the prefix of a .bin/.idx pair")
        if self.data.tokenizer_model is not None and not os.path.isdir(self.data.tokenizer_model):
            raise ValueError(f"--tokenizer-model {self.data.tokenizer_model}: not a directory")
        self._validate_eval()
        return self

    def _validate_eval(self) -> None:
        ev, valid = self.eval.validate(), self.data.valid_data_path
        if valid is not None:
            if not (os.path.isfile(valid) or os.path.isfile(valid + ".idx")):
                raise ValueError(f"--valid-data-path {valid}: neither a .jsonl file nor the prefix of a .bin/.idx pair")
            if valid.endswith(".jsonl") and not self.data.tokenizer_model:
                raise ValueError("--tokenizer-model is required for a .jsonl --valid-data-path")
            if not ev.enabled:
                raise ValueError("--valid-data-path is read only by evaluation: add --eval-interval N")
        if ev.enabled and valid is None and not self.data.mock_data:
            raise ValueError("--eval-interval needs validation data: --valid-data-path, or --mock-data (a held-out "
                             "mock split)")
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every field of every group as a flag (usable as Megatron-LM's ``extra_args_provider``)."""
    seen = {}
    for group_name, cls in GROUPS.items():
        group = parser.add_argument_group(group_name)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen:
                raise ValueError(f"flag {_flag(f.name)} is defined by both {seen[f.name]} and {group_name}")
            seen[f.name] = group_name
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = docs.get(f.name, "")
            typ = _base_type(hints[f.name])
            dest = f"{group_name}.{f.name}"
            if typ is bool:
                if f.name == "sparse_attention":  # users type both spellings
                    group.add_argument(_flag(f.name), dest=dest, action=argparse.BooleanOptionalAction, default=default,
                                       help=help_text)
                elif default:
                    group.add_argument("--no-" + f.name.replace("_", "-"), dest=dest, action="store_false", help=help_text)
                else:
                    group.add_argument(_flag(f.name), dest=dest, action="store_true", help=help_text)
            elif typ is tuple or typing.get_origin(typ) is tuple:
                item = (typing.get_args(typ) or (int,))[0]  # bare ``tuple`` fields hold ints
                group.add_argument(_flag(f.name), dest=dest, type=item, nargs="+", default=default, help=help_text,
                                   metavar="N" if item is int else item.__name__.upper())
            else:
                group.add_argument(_flag(f.name), dest=dest, type=typ, default=default, help=help_text,
                                   metavar=typ.__name__.upper())
    return parser


def build_parser(prog: str = "megatron_sparsebalance.pretrain") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="SparseBalance pretraining on megatron-core "
                                     "(launch with torchrun; Megatron-LM's flag names).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return add_arguments(parser)


def config_from_args(args: argparse.Namespace) -> SparseBalanceConfig:
    groups = {}
    for group_name, cls in GROUPS.items():
        values = {f.name: getattr(args, f"{group_name}.{f.name}") for f in dataclasses.fields(cls)}
        for k, v in values.items():
            if isinstance(v, list):
                values[k] = tuple(v)
        groups[group_name] = cls(**values)
    return SparseBalanceConfig(**groups)


def parse_config(argv=None) -> SparseBalanceConfig:
    return config_from_args(build_parser().parse_args(argv))


__all__ = ["ANCHORS", "SparseBalanceConfig", "add_arguments", "build_parser", "parse_config", "field_docs"]
