"""SparseBalance inside Megatron-LM's own training loop (``megatron.training``).

Launch like Megatron-LM's ``pretrain_gpt.py``, with its flags plus ours::

    torchrun --nproc_per_node 2 -m megatron_sparsebalance.megatron_lm \\
        --num-layers 24 --hidden-size 896 ... --pipeline-model-parallel-size 2 --transformer-impl local \\
        --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \\
        --dst-anchor mean --dst-p 0.1 --batching sab

(or ``examples/pretrain_gpt_megatron_lm.py``). Megatron-LM parses and validates the arguments,
builds the optimizer and DDP, runs the loop, schedules the learning rate, saves and resumes, and
logs. Our parts go in at its seams, installed once by :func:`install`:

- flags: :func:`add_sparsebalance_args` is the ``extra_args_provider``; it adds the fields of our
  dataclasses that Megatron-LM does not already have (the same ones the standalone entry reads);
- layer spec: :func:`model_provider` builds megatron-core's ``GPTModel`` from Megatron-LM's
  ``TransformerConfig`` with our core attention in the ``core_attention`` slot;
- data: :func:`datasets_provider` returns a :class:`GlobalBatchStream` (``--dataloader-type
  external``): SAB's plan of each global batch, drawn by the schedule;
- schedule: Megatron-LM's loop takes its ``forward_backward_func`` from
  ``get_forward_backward_func``; :func:`install` points that name at :class:`SparseBalanceSchedule`,
  which plans DST's budgets, runs our 1F1B, and learns from the measured times;
- log line and TensorBoard: our figures go into the loss reports of the last stage, which
  Megatron-LM averages over the log interval, prints in its iteration line and writes to
  TensorBoard (``sb imbalance``, ``sb bubble``, ``sb predicted ms``, ``sb measured ms``,
  ``sb mean budget``, ``sb coverage``);
- checkpoints: Megatron-LM's own; the balancer's state (sample order, SAB's estimator, latency
  calibration, DST's coverage floor) is written beside them as ``sparsebalance.pt`` in the
  iteration directory before Megatron-LM writes the rest, and read back on ``--load``.

Needs ``megatron.training`` (megatron-core 0.19's wheel ships it). With megatron-core 0.16, use the
standalone entry ``python -m megatron_sparsebalance.pretrain`` (same flags, same meaning).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys
from functools import partial, wraps
from typing import Optional

import torch

from megatron_sparsebalance.attention.core_attention import refuse_unbuilt_attention
from megatron_sparsebalance.attention.spec import refuse_unbuilt_norm
from megatron_sparsebalance.balance.feedback import calibrate_latency, learn_coverage_floor
from megatron_sparsebalance.compat import HAVE_MEGATRON_TRAINING, MEGATRON_CORE, MEGATRON_CORE_VERSION
from megatron_sparsebalance.config import (
    GROUPS,
    SparseBalanceConfig,
    add_arguments,
    refuse_attention_backend,
    refuse_position_embedding,
)
from megatron_sparsebalance.data.datasets import MOCK_VOCAB_SIZE, TOKENIZER_TYPES

# Our groups Megatron-LM's parser lacks entirely; of "data" only the fields it lacks are added.
_OUR_GROUPS = ("sparse", "dst", "latency", "batching", "data", "split")
STATE_FILE = "sparsebalance.pt"
METRICS_FILE = "sparsebalance_metrics.jsonl"
_MARKER = "_sparsebalance_installed"


def add_sparsebalance_args(parser):
    """Megatron-LM's ``extra_args_provider``: our flags, from the dataclasses both entries read."""
    return add_arguments(parser, groups={name: GROUPS[name] for name in _OUR_GROUPS}, skip_existing=True,
                         flat_dest=True)


# ---- Megatron-LM's arguments -> our configuration ---------------------------------------------


def _from_args(cls, args, **override):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(override)
    for key, value in values.items():
        if isinstance(value, list):
            values[key] = tuple(value)
    return cls(**values)


def _single_path(args, name: str) -> Optional[str]:
    paths = getattr(args, name, None)
    if not paths:
        return None
    if len(paths) != 1:
        raise ValueError(f"--{name.replace('_', '-')}: SparseBalance packs samples from one dataset; blends of "
                         f"several ({len(paths)} given) are not supported")
    return paths[0]


def config_from_megatron_args(args) -> SparseBalanceConfig:
    """Our configuration read from Megatron-LM's parsed and validated arguments.

    Megatron-LM's own fields (shape, parallel layout, batch sizes, optimizer) keep their
    Megatron-LM names and values; ours come from :func:`add_sparsebalance_args`.
    """
    cfg = SparseBalanceConfig()
    for name, cls in GROUPS.items():
        if name == "model":
            continue
        setattr(cfg, name, _from_args(cls, args))
    # Megatron-LM takes the training data from --data-path (split by --split) or, per split, from
    # --train-data-path, all of it for training (validation then from --valid-data-path); it asserts
    # one of the two.
    paths = dict(data_path=_single_path(args, "data_path"), valid_data_path=_single_path(args, "valid_data_path"))
    train_data_path = _single_path(args, "train_data_path")
    if train_data_path:
        paths.update(data_path=train_data_path, split=None)
    cfg.data = _from_args(GROUPS["data"], args, **paths, **_token_source(args),
                          mock_vocab_size=min(args.mock_vocab_size or MOCK_VOCAB_SIZE, args.padded_vocab_size))
    # Megatron-LM has already loaded --use-checkpoint-args into args: the shape is args'. Two of
    # its flags store under another name than the flag's (--norm-epsilon, --disable-bias-linear).
    cfg.model = _from_args(GROUPS["model"], args, model=None, vocab_size=args.padded_vocab_size,
                           use_checkpoint_args=False, norm_epsilon=args.layernorm_epsilon,
                           disable_bias_linear=not args.add_bias_linear)
    cfg.checkpoint = _from_args(GROUPS["checkpoint"], args, load_optim=not args.no_load_optim)
    return cfg


def _token_source(args) -> dict:
    """Our data's tokenizer fields from Megatron-LM's arguments.

    Megatron-LM builds a tokenizer of any of its --tokenizer-type values. Our datasets read token
    ids (Megatron-LM's .bin/.idx, or mock data) and take from a tokenizer only the end-of-document
    id of --eod-mask-loss, which this entry hands them from Megatron-LM's tokenizer
    (``datasets_provider``): so every type works with token files. Text (.jsonl) is tokenized by
    our Hugging Face path alone, so there the other types are refused by name.
    """
    if args.tokenizer_type is None or args.tokenizer_type in TOKENIZER_TYPES:
        return {}
    paths = [p for name in ("data_path", "train_data_path", "valid_data_path") for p in (getattr(args, name, None) or [])]
    if not getattr(args, "mock_data", False) and any(str(p).endswith(".jsonl") for p in paths):
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} with .jsonl text: SparseBalance tokenizes text "
                         "with a Hugging Face tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR); "
                         "or pre-tokenize it with Megatron-LM's tools/preprocess_data.py and pass the .bin/.idx prefix")
    return dict(tokenizer_type=None, tokenizer_model=None)


def checked_config(args) -> SparseBalanceConfig:
    """:func:`config_from_megatron_args`, validated: called once before any process group starts
    (:func:`parse_megatron_args`), so that bad settings of ours stop the run there, and again by
    the datasets provider, which keeps it."""
    cfg = config_from_megatron_args(args)
    cfg.sparse.validate()
    cfg.batching.validate(cfg.data.seq_length)
    cfg.dst_config().validate()
    cfg.data.validate()
    return cfg


def end_of_document(cfg: SparseBalanceConfig) -> Optional[int]:
    """The EOD id --eod-mask-loss masks in token files: Megatron-LM's tokenizer's, by its type's
    rule (NullTokenizer: --vocab-size - 1, or --null-tokenizer-eod-id); None without the flag or
    with mock data, whose samples carry our own EOD."""
    if not cfg.data.eod_mask_loss or cfg.data.mock_data:
        return None
    from megatron.training import get_tokenizer

    return int(get_tokenizer().eod)


def _refuse_what_we_cannot_run(args) -> None:
    """Megatron-LM features our schedule, model or data path does not implement, refused by name.
    The model's refusals are the standalone entry's (``config.py``), the layer kinds our dense GPT
    layer spec does not build (megatron-core would take the flag and build a model without it),
    and the core attention's and the local spec's norms' own refusals, made here for every layer
    before any process group starts (the layers make them again as they are built)."""
    backend = getattr(args, "attention_backend", None)
    refuse_attention_backend(getattr(backend, "name", backend))  # Megatron-LM's AttnBackend enum
    refuse_position_embedding(getattr(args, "position_embedding_type", None))
    low_precision = next((f"--{name}-format {getattr(args, name)}" for name in ("fp8", "fp4")
                          if getattr(args, name, None)), None)
    checks = (
        (bool(getattr(args, "num_experts", None)),
         "--num-experts: mixture-of-experts layers are not built with the sparse core attention (its layer spec "
         "is megatron-core's dense GPT layer)"),
        (getattr(args, "multi_latent_attention", False),
         "--multi-latent-attention: the sparse core attention is grouped-query attention; MLA's compressed keys "
         "and values are not built"),
        (bool(getattr(args, "mtp_num_layers", None)),
         "--mtp-num-layers: multi-token prediction is not built (our schedule computes the next-token loss)"),
        (getattr(args, "heterogeneous_layers_config_path", None) is not None,
         "--heterogeneous-layers-config-path: layers of differing shapes are not built (one GPT layer spec)"),
        (getattr(args, "experimental_attention_variant", None) is not None,
         f"--experimental-attention-variant {getattr(args, 'experimental_attention_variant', None)}: its layers "
         "(gated delta net, DeepSeek sparse attention) are not built; every layer is megatron-core's GPT layer "
         "with the sparse core attention"),
        (bool(getattr(args, "test_data_path", None)),
         "--test-data-path: SparseBalance builds training and validation streams; there is no test split"),
        (getattr(args, "data_args_path", None) is not None or getattr(args, "per_split_data_args_path", None) is not None,
         "--data-args-path / --per-split-data-args-path: give the data as --data-path (or --train-data-path and "
         "--valid-data-path), one dataset each"),
        (getattr(args, "sft", False), "--sft: SparseBalance's data is pretraining data (every token a target); "
                                     "Megatron-LM's SFT dataset and its prompt masking are not built"),
        (getattr(args, "fim_data", False), "--fim-data: Megatron-LM's fill-in-the-middle dataset is not built; "
                                           "SparseBalance reads the documents as they are"),
        (getattr(args, "phase_transition_iterations", None),
         "--phase-transition-iterations: Megatron-LM exits at each phase so that the next one starts on other "
         "data; SparseBalance's data order resumes from its own state of this stream (sparsebalance.pt), which "
         "another phase's data does not match: run each phase as its own run (--finetune to start from the "
         "weights)"),
        (getattr(args, "full_validation", False) or getattr(args, "multiple_validation_sets", False),
         "--full-validation / --multiple-validation-sets: SparseBalance validates on one stream of --eval-iters "
         "global batches"),
        (getattr(args, "cuda_graph_impl", "none") not in (None, "none") or getattr(args, "enable_cuda_graph", False)
         or getattr(args, "external_cuda_graph", False),
         f"--cuda-graph-impl {getattr(args, 'cuda_graph_impl', None)} (or --enable-cuda-graph / "
         "--external-cuda-graph): a CUDA graph replays one capture of a layer, while the sparse core attention "
         "decides on the host for each micro-batch (its packing, DST's budget); use --cuda-graph-impl none"),
        (getattr(args, "defer_embedding_wgrad_compute", False),
         "--defer-embedding-wgrad-compute: megatron-core's 1F1B computes the deferred weight gradient of the "
         "output layer after its cool-down; SparseBalance's 1F1B does not, and the output layer would not learn"),
        (getattr(args, "transformer_impl", "local") == "inference_optimized",
         "--transformer-impl inference_optimized: megatron-core's inference layers are not built for training; "
         "use local or transformer_engine"),
        (low_precision is not None and getattr(args, "transformer_impl", "local") != "transformer_engine",
         f"{low_precision}: FP8 and FP4 run in Transformer Engine's layers (megatron-core's FP8 context does "
         "nothing without them), so the local layer spec would train in bf16; use --transformer-impl "
         "transformer_engine where Transformer Engine is installed, or drop the flag"),
        (getattr(args, "non_persistent_ckpt_type", None) == "local",
         "--non-persistent-ckpt-type local: Megatron-LM's local checkpoints are kept by nvidia-resiliency-ext's "
         "checkpoint manager, which does not hold SparseBalance's state (sparsebalance.pt: the data order and "
         "the balancer); use --non-persistent-ckpt-type global"),
        (getattr(args, "inprocess_restart", False),
         "--inprocess-restart: Megatron-LM's in-process restart is a wrapper that its pretrain_gpt.py puts around "
         "pretrain() (with nvidia-resiliency-ext); this entry has none: restart the job and resume from its "
         "checkpoint (--load)"),
        (getattr(args, "spec", None) is not None,
         "--spec: the layer spec is ours (megatron-core's GPT layer with the sparse core attention in its "
         "core_attention slot); a spec of your own would not be built: drop --spec"),
        (getattr(args, "virtual_pipeline_model_parallel_size", None) not in (None, 1),
         "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank: the interleaved "
         "schedule is not implemented by SparseBalance's 1F1B"),
        (getattr(args, "context_parallel_size", 1) != 1,
         "--context-parallel-size > 1: context parallelism runs inside Transformer Engine's attention, which our "
         "sparse core attention replaces"),
        (getattr(args, "use_legacy_models", False), "--use-legacy-models: our core attention needs megatron-core models"),
        (args.dataloader_type not in (None, "external"),
         f"--dataloader-type {args.dataloader_type}: SAB draws each global batch itself (external)"),
        (getattr(args, "decoder_pipeline_split", "even") == "auto",
         "--decoder-pipeline-split auto: Megatron-LM builds the model before any data is read; print the split "
         "with tools/plan_pipeline_split.py and pass --decoder-first/last-pipeline-num-layers"),
        (getattr(args, "attention_dropout", 0.0) > 0,
         f"--attention-dropout {getattr(args, 'attention_dropout', 0.0)}: the sparse attention kernels have no "
         "dropout (Megatron-LM's default is 0.1): pass --attention-dropout 0"),
        (getattr(args, "rampup_batch_size", None) is not None or getattr(args, "step_batch_size_schedule", None)
         or getattr(args, "decrease_batch_size_if_needed", False),
         "--rampup-batch-size / --step-batch-size-schedule / --decrease-batch-size-if-needed: SAB plans every "
         "global batch at --global-batch-size, and Megatron-LM's loop would expect another micro-batch count "
         "(a global batch size that changes during training is not built)"),
        (getattr(args, "eval_global_batch_size", None) not in (None, args.global_batch_size)
         or getattr(args, "eval_micro_batch_size", None) not in (None, args.micro_batch_size),
         "--eval-global-batch-size / --eval-micro-batch-size other than the training sizes: SparseBalance plans "
         "the validation stream's global batches as the training ones (SAB at --global-batch-size and "
         "--micro-batch-size); drop the flags"),
        (getattr(args, "variable_micro_batches", False) and not args.calculate_per_token_loss,
         "--variable-micro-batches needs --calculate-per-token-loss: a micro-batch count that changes between "
         "iterations is exact only with per-token normalization"),
    )
    for bad, why in checks:
        if bad:
            raise ValueError(why)  # main() prints it after its own prefix
    for layer_number in range(1, args.num_layers + 1):
        refuse_unbuilt_attention(args, layer_number)
    if getattr(args, "transformer_impl", "local") == "local":  # Transformer Engine's norms take what torch's lack
        refuse_unbuilt_norm(args)


def _without_missing_fusions(args) -> list:
    """Turn off the fused kernels whose packages are not installed, and say which.

    Megatron-LM defaults to Transformer Engine's fused RoPE and apex's gradient-accumulation
    fusion and persistent layer norm; without those packages its first step fails. These are
    defaults, not a user's choice, so they are switched off with a printed note (a flag the user
    gave is never changed: ``--rope-fusion``-style flags only turn things off).
    """
    import importlib.util

    have = {name: importlib.util.find_spec(name) is not None for name in ("transformer_engine", "apex")}
    notes = []
    if not have["transformer_engine"] and getattr(args, "apply_rope_fusion", False):
        args.apply_rope_fusion = False
        notes.append("--no-rope-fusion (fused RoPE needs Transformer Engine)")
    if not have["apex"] and getattr(args, "gradient_accumulation_fusion", False):
        args.gradient_accumulation_fusion = False
        notes.append("--no-gradient-accumulation-fusion (needs apex)")
    if not have["apex"] and not getattr(args, "no_persist_layer_norm", True):
        args.no_persist_layer_norm = True
        notes.append("--no-persist-layer-norm (needs apex)")
    if getattr(args, "masked_softmax_fusion", False):
        # Our core attention computes its own softmax; Megatron-LM's fused masked softmax
        # (scaled_masked_softmax_cuda, not in the wheel) is never used by it.
        args.masked_softmax_fusion = False
        notes.append("--no-masked-softmax-fusion (the sparse core attention has its own softmax)")
    if getattr(args, "transformer_impl", "local") == "transformer_engine" and not have["transformer_engine"]:
        raise ValueError("--transformer-impl transformer_engine: Transformer Engine is not installed; "
                         "use --transformer-impl local")
    return notes


# Flags that tune Megatron-LM's own GPT dataset and data loader, which this entry does not build
# (SparseBalance's streams read the documents and hand over whole global batches): taken, and named
# in a printed note when given, since they change nothing here.
DATA_LOADER_FLAGS = ("--num-workers", "--data-cache-path", "--no-mmap-bin-files", "--dataloader-fast-cache-load",
                     "--dataloader-defer-npy-index-mmap", "--num-dataset-builder-threads",
                     "--object-storage-cache-path", "--mid-level-dataset-surplus", "--per-dataset-sequences-path",
                     "--allow-ambiguous-pad-tokens")


# What Megatron-LM's pretrain_gpt.py passes to its loop as ``args_defaults`` (0.19.2): a launch
# script written for it may leave these out.
PRETRAIN_GPT_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def _given_flags(argv: list, flags: tuple) -> list:
    """Which of ``flags`` ``argv`` gives (Megatron-LM's parser takes no abbreviations)."""
    return [flag for flag in flags if any(a == flag or a.startswith(flag + "=") for a in argv)]


def parse_megatron_args(argv=None):
    """Megatron-LM's arguments with ours added, checked for what SparseBalance needs, validated,
    and installed as Megatron-LM's global arguments."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    saved_argv = sys.argv
    if argv is not None:
        sys.argv = [saved_argv[0], *argv]
    unused_data_flags = _given_flags(sys.argv[1:], DATA_LOADER_FLAGS)
    try:
        if _given_flags(sys.argv[1:], ("--yaml-cfg",)):
            # Refused before parse_args, which would already have replaced the arguments by the file's.
            raise ValueError("--yaml-cfg: Megatron-LM's experimental YAML arguments replace the whole command line "
                             "(its own warning: argparse arguments are ignored), SparseBalance's flags with it, and "
                             "hold them in nested sections this entry does not read: give the flags on the command "
                             "line")
        args = parse_args(extra_args_provider=add_sparsebalance_args)
    finally:
        sys.argv = saved_argv
    _refuse_what_we_cannot_run(args)
    args.dataloader_type = "external"
    notes = _without_missing_fusions(args)
    if args.use_checkpoint_args:
        from megatron.training.checkpointing import load_args_from_checkpoint

        load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
        load_args_from_checkpoint(args)
    validate_args(args, PRETRAIN_GPT_DEFAULTS)
    if getattr(args, "iterations_to_skip", None):
        # Megatron-LM skips an iteration by drawing its micro-batches as dicts of its own batch format.
        raise ValueError(f"--iterations-to-skip {args.iterations_to_skip} (given, or read from "
                         "--result-rejected-tracker-filename): a skipped iteration is not built for SparseBalance's "
                         "global batches; drop the flag (or the tracker file's entries)")
    set_global_variables(args)  # builds Megatron-LM's tokenizer: the padded vocabulary our config reads
    checked_config(args)
    if args.rank == 0 and notes:
        print("megatron_sparsebalance: without the packages they need, turned off " + "; ".join(notes), flush=True)
    if args.rank == 0 and unused_data_flags:
        print("megatron_sparsebalance: Megatron-LM's dataset and data loader are not built here (SparseBalance's "
              "streams read the data), so these change nothing: " + ", ".join(unused_data_flags), flush=True)
    return args


# ---- the parts Megatron-LM calls --------------------------------------------------------------


def _record_memory_history(args) -> None:
    """--record-memory-history: torch's allocator history from the model's construction on, and a
    snapshot written on an out-of-memory error. Megatron-LM starts both in its own
    ``model_provider`` (which ours replaces); its loop then writes the snapshot to
    --memory-snapshot-path every --log-interval, which without the history holds no events."""
    if not getattr(args, "record_memory_history", False):
        return
    torch.cuda.memory._record_memory_history(max_entries=100_000)

    def snapshot_on_oom(device, alloc, device_alloc, device_free):
        torch.cuda.memory._dump_snapshot(f"oom_rank-{torch.distributed.get_rank()}_{args.memory_snapshot_path}")

    torch._C._cuda_attach_out_of_memory_observer(snapshot_on_oom)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """megatron-core's GPTModel with our core attention (Megatron-LM's ``model_provider`` seam)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron_sparsebalance.attention.spec import get_gpt_decoder_spec, get_gpt_layer_spec

    args = get_args()
    _record_memory_history(args)
    if config is None:
        config = core_transformer_config_from_args(args)
    layer = get_gpt_layer_spec(_state_config(args).sparse, normalization=args.normalization,
                               qk_layernorm=getattr(args, "qk_layernorm", False),
                               # Megatron-LM 0.19's own local spec drops --qk-l2-norm; here it is built.
                               qk_l2_norm=getattr(args, "qk_l2_norm", False),
                               use_transformer_engine=args.transformer_impl == "transformer_engine",
                               num_query_groups=args.num_query_groups)
    spec = get_gpt_decoder_spec(config, layer)  # the local spec's block: its norms take --sequence-parallel
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
        # Megatron-LM 0.19's own GPT builder drops --rope-scaling-factor (its GPTModelConfig keeps 8.0);
        # here the flag does what it says.
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor, pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


# Megatron-LM's pretrain_gpt.py calls a loss spiky at ten times the largest seen so far.
SPIKY_LOSS_FACTOR = 10


def _validate_loss(loss: torch.Tensor) -> None:
    """The checks Megatron-LM's own GPT loss makes through its rerun state machine: NaN and Inf
    (fatal; on by default, off with --no-check-for-nan-in-loss-and-grad) and --check-for-spiky-loss
    (not fatal). The machine reruns a rejected iteration to tell a transient fault from a
    reproducible result (SparseBalanceSchedule replays the same batch for it)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args, machine = get_args(), get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for rejected, name in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=rejected, tolerance=0.0, fatal=True,
                                    message=f"found {name} in local forward loss calculation")
    if args.check_for_spiky_loss:
        machine.validate_result(result=loss, tolerance=0.0, fatal=False, message="Spiky loss",
                                rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                                       context="loss"))


def _straggler_detector():
    """Megatron-LM's straggler detector, which ``--log-straggler`` configures and reports from each
    ``--log-interval``: the loop's own instance, read rather than built (megatron-core's
    ``StragglerDetector`` is a singleton whose constructor resets it). It times what Megatron-LM's
    GPT forward step times, the model's forward and the fetch of the data; with nothing timed its
    report divides by a time of zero. Off (no flag), its timers do nothing."""
    from megatron.training import training

    return training.stimer


def forward_step(data_iterator, model):
    """Megatron-LM's ``forward_step_func`` for our packed (THD) micro-batches.

    The report is Megatron-LM's ``{"lm loss": [loss sum, tokens]}``, which its loop averages over
    the tokens of the global batch; the loss is checked as Megatron-LM's own GPT loss checks it.
    """
    from megatron_sparsebalance.compat import record_packed_lengths
    from megatron_sparsebalance.training.step import gpt_forward

    batch = next(data_iterator)
    if model.training:
        # Megatron-LM's FLOPs count (--log-throughput's TFLOP/s, the checkpoints' running total) reads
        # each pack's documents from here, as its own THD path records them; evaluation is not counted.
        record_packed_lengths(batch.cu_seqlens)
    with _straggler_detector():
        output, loss_func = gpt_forward(batch, model)

    def megatron_lm_loss(per_token_loss):
        loss, tokens, _ = loss_func(per_token_loss)
        _validate_loss(loss)
        return loss, tokens, {"lm loss": torch.stack([loss.detach().clone(), tokens.detach().to(loss.dtype)])}

    return output, megatron_lm_loss


class GlobalBatchStream:
    """Megatron-LM's data iterator (``--dataloader-type external``): SAB's plan per global batch.

    Megatron-LM wraps it in its ``RerunDataIterator`` and hands that to ``forward_backward_func``
    every iteration; :class:`SparseBalanceSchedule` draws one item per iteration, a whole global
    batch (every rank draws the same plan), and feeds its micro-batches to ``forward_step``. The
    wrapper keeps the item, so a rerun of the iteration by Megatron-LM's rerun state machine gets
    the same global batch.
    """

    def __init__(self, dataset, sampler, dp_rank: int):
        self.dataset, self.sampler, self.dp_rank = dataset, sampler, dp_rank

    def __iter__(self):
        return self

    def __next__(self):
        """SAB's plan of the next global batch, its micro-batch lengths per rank, this rank's micro-batches."""
        plan = self.sampler.next_plan()
        return plan, plan.rank_micro_batch_lengths(), self.sampler.micro_batches(self.dataset, plan, self.dp_rank)


class _RunState:
    """What the balancer carries across iterations in Megatron-LM's loop (one per process)."""

    def __init__(self, args):
        from megatron.core import parallel_state

        from megatron_sparsebalance.balance.dst import CoverageFloor
        from megatron_sparsebalance.data.datasets import build_dataset, build_validation_dataset, has_validation_data
        from megatron_sparsebalance.data.sampler import GlobalBatchSampler
        from megatron_sparsebalance.pretrain import build_batcher, build_latency_model, stage_costs_of

        self.cfg = cfg = checked_config(args)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.latency = build_latency_model(cfg, self.device)
        self.dst = cfg.dst_config()
        self.coverage_floor = CoverageFloor() if self.dst.anchor != "none" and self.dst.p is not None else None
        per_rank = args.global_batch_size // (args.micro_batch_size * self.dp)

        stage_costs = stage_costs_of(cfg, cfg.model_shape(), self.latency)
        self.stage_costs = stage_costs if cfg.dst.dst_growth == "critical-path" else None

        def stream(dataset, seed):
            batcher = build_batcher(cfg, self.latency, self.dp, per_rank)
            batcher.stage_costs = stage_costs if cfg.batching.prices_stages() else None
            sampler = GlobalBatchSampler(dataset.lengths, args.global_batch_size, batcher, seed=seed)
            return GlobalBatchStream(dataset, sampler, self.dp_rank)

        eod = end_of_document(cfg)
        self.train = stream(build_dataset(cfg.data, eod=eod), cfg.data.seed)
        self.valid = None
        # Megatron-LM evaluates on --valid-data-path, or on --split's validation share of
        # --data-path (its default split, 969,30,1, has one).
        if args.eval_iters and has_validation_data(cfg.data):
            self.valid = stream(build_validation_dataset(cfg.data, args.eval_iters * args.global_batch_size, eod=eod),
                                cfg.data.seed)
        self.iteration = args.iteration  # training global batches run so far (resumed: the checkpoint's)
        self.first_run_plan = None  # this rank's plan of the current iteration, for a rerun of it (SparseBalanceSchedule)
        # Our figures and the exact loss of every iteration, one JSON row each (the last pipeline
        # stage's first DP rank writes): beside the checkpoints, else the TensorBoard logs.
        log_dir = args.save or args.tensorboard_dir
        self.jsonl_path = os.path.join(log_dir, METRICS_FILE) if log_dir else None

    def state_dict(self) -> dict:
        return {"sampler": self.train.sampler.state_dict(), "latency": self.latency.calibration_state(),
                **({"dst_floor": self.coverage_floor.state_dict()} if self.coverage_floor is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.train.sampler.load_state_dict(state["sampler"])
        self.latency.load_calibration(state["latency"])
        if self.coverage_floor is not None and "dst_floor" in state:
            self.coverage_floor.load_state_dict(state["dst_floor"])


_STATE: Optional[_RunState] = None


def _state_config(args) -> SparseBalanceConfig:
    return _STATE.cfg if _STATE is not None else config_from_megatron_args(args)


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")  # Megatron-LM's layout


def _non_persistent_root(args, root: str) -> str:
    """Where Megatron-LM 0.19.2 keeps its non-persistent global checkpoints beside ``root`` (--save or
    --load): --non-persistent-global-ckpt-dir, else ``<root>/non_persistent``."""
    return getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(root, "non_persistent")


def _state_dir_to_save(args, iteration: int, non_persistent: bool) -> str:
    """The iteration directory Megatron-LM's ``save_checkpoint`` writes this checkpoint into, so that
    our state lies beside its files and goes when Megatron-LM removes them (it keeps only the newest
    non-persistent checkpoint)."""
    root = _non_persistent_root(args, args.save) if non_persistent else args.save
    return _iteration_dir(root, iteration)


def _state_path_to_load(args) -> str:
    """Our state of the checkpoint Megatron-LM's ``load_checkpoint`` just read ``args.iteration``
    from: its non-persistent global checkpoint where that one is at this iteration (Megatron-LM
    prefers it to a persistent one as new or older), else --load's."""
    if getattr(args, "non_persistent_ckpt_type", None) == "global":
        root = _non_persistent_root(args, args.load)
        tracker = os.path.join(root, "latest_checkpointed_iteration.txt")  # Megatron-LM's tracker file
        if os.path.isfile(tracker):
            with open(tracker) as f:
                if f.read().strip() == str(args.iteration):
                    return os.path.join(_iteration_dir(root, args.iteration), STATE_FILE)
    return os.path.join(_iteration_dir(args.load, args.iteration), STATE_FILE)


def datasets_provider(train_valid_test_num_samples):
    """Megatron-LM's dataset provider: our streams (train, validation; no test split)."""
    global _STATE
    from megatron.training import get_args

    args = get_args()
    _STATE = _RunState(args)
    if args.load and args.iteration > 0:
        path = _state_path_to_load(args)
        if not os.path.exists(path):
            raise ValueError(f"--load {args.load}: iteration {args.iteration} has no {STATE_FILE} (not saved by "
                             "megatron_sparsebalance.megatron_lm); the data order and balancer state cannot be resumed. "
                             "To start SparseBalance from its weights, add --finetune (Megatron-LM then loads the "
                             "weights alone and counts iterations from 0)")
        _STATE.load_state_dict(torch.load(path, weights_only=False))
    return _STATE.train, _STATE.valid, None


datasets_provider.is_distributed = True  # every rank builds the same streams itself (no broadcast)


# Megatron-LM's log line and TensorBoard name them (figure names of IterationMetrics.figures).
_LOG_NAMES = {"imbalance": "sb imbalance", "bubble": "sb bubble", "predicted_ms": "sb predicted ms",
              "measured_ms": "sb measured ms", "mean_budget": "sb mean budget", "mean_coverage": "sb coverage"}


class SparseBalanceSchedule:
    """Megatron-LM's ``forward_backward_func``: one global batch planned by SAB and DST, run by our 1F1B."""

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length=None,
                 micro_batch_size=None, decoder_seq_length=None, forward_only=False, force_all_reduce=False,
                 **unused):
        from megatron_sparsebalance.pipeline.schedule import forward_backward_sparsebalance
        from megatron_sparsebalance.training.step import pipeline_plans

        if _STATE is None:
            raise RuntimeError("SparseBalanceSchedule runs on the streams of megatron_lm.datasets_provider")
        if isinstance(data_iterator, list):
            if len(data_iterator) != 1:
                raise ValueError("the interleaved schedule is not supported: one model chunk per stage")
            data_iterator = data_iterator[0]
        stream = getattr(data_iterator, "iterable", data_iterator)  # Megatron-LM's RerunDataIterator
        if not isinstance(stream, GlobalBatchStream):
            raise TypeError(f"SparseBalanceSchedule needs megatron_lm.datasets_provider's stream, got {type(stream)}")
        state = _STATE
        # A rerun of this iteration (Megatron-LM's rerun state machine, after it rejected a loss or a
        # gradient) must compute what the first run computed: the wrapper replays the global batch,
        # the first run's plans are run again, and the balancer, which learned from the first run,
        # does not learn twice.
        rerun = _rerunning_in_place()
        with _straggler_detector()(bdata=True):  # the global batch's data, on the host
            sample_plan, lengths, batches = next(data_iterator)
        if not state.cfg.batching.variable_micro_batches and len(batches) != num_microbatches:
            raise ValueError(f"SAB planned {len(batches)} micro-batches on this rank, Megatron-LM's loop expects "
                             f"{num_microbatches}")
        if rerun and state.first_run_plan is not None:
            plans, plan = None, copy.deepcopy(state.first_run_plan)  # a rerun does not learn: this rank's plan will do
        else:
            # Evaluation runs every layer at --moba-topk, as the standalone entry's evaluator does.
            dst = dataclasses.replace(state.dst, anchor="none") if forward_only else state.dst
            plans = pipeline_plans(lengths, state.cfg.model_shape().hidden_size, dst,
                                   None if forward_only else state.latency, state.pp,
                                   None if forward_only else state.coverage_floor, state.dp_rank,
                                   None if forward_only else state.stage_costs)
            plan = plans[state.dp_rank]
            state.first_run_plan = copy.deepcopy(plan) if _reruns_enabled() else None
        plan.measure = not forward_only
        reports = forward_backward_sparsebalance(
            forward_step_func=forward_step_func, data_iterator=iter([b.to(state.device) for b in batches]),
            model=model, num_microbatches=len(batches), plan=plan, forward_only=forward_only,
            force_all_reduce=force_all_reduce)
        if forward_only or plan.measured is None:
            return reports
        metrics = plan.measured
        if not rerun:
            calibrate_latency(state.latency, lengths, metrics, state.pp)
            if state.coverage_floor is not None:
                learn_coverage_floor(state.coverage_floor, plans, metrics, state.dst.k_base)
            if state.cfg.sparse.sparse_attention:
                stream.sampler.update(sample_plan, sample_plan.split_by_rank(metrics.budgets))
            state.iteration += 1
        figures = {_LOG_NAMES[k]: v for k, v in metrics.figures(state.pp).items()}
        for report in reports:
            for key, value in figures.items():
                report[key] = torch.tensor([value], dtype=torch.float32, device=state.device)
        if reports and state.jsonl_path and not rerun:
            _log_row(state, reports, figures)
        return reports


def _rerunning_in_place() -> bool:
    """Whether Megatron-LM's rerun state machine is running the current iteration a second time."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    return get_rerun_state_machine().state == RerunState.RERUNNING_IN_PLACE


def _reruns_enabled() -> bool:
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    return get_rerun_state_machine().get_mode() != RerunMode.DISABLED


def _log_row(state: _RunState, reports, figures: dict) -> None:
    """The iteration's loss as Megatron-LM computes it (loss sum / tokens over the DP group) and our
    figures, to ``sparsebalance_metrics.jsonl``; ``lm_loss_hex`` is exact, for resume checks."""
    import json

    from megatron.core import parallel_state

    total = torch.stack([r["lm loss"].double() for r in reports]).sum(dim=0)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    loss = float(total[0] / total[1])
    if state.dp_rank == 0:
        os.makedirs(os.path.dirname(state.jsonl_path), exist_ok=True)
        with open(state.jsonl_path, "a") as f:
            f.write(json.dumps({"iteration": state.iteration, "lm_loss": loss, "lm_loss_hex": loss.hex(),
                                **{k.replace(" ", "_"): v for k, v in figures.items()}}) + "\n")


def _save_with_our_state(save_checkpoint):
    def save(iteration, *args, non_persistent_ckpt=False, **kwargs):
        from megatron.training import get_args

        megatron_args = get_args()
        if _STATE is not None and megatron_args.save and torch.distributed.get_rank() == 0:
            # Written before Megatron-LM's files: its tracker file, written last, is what makes
            # the checkpoint the latest, so a checkpoint it names always has our state.
            path = _state_dir_to_save(megatron_args, iteration, non_persistent_ckpt)
            os.makedirs(path, exist_ok=True)
            tmp = os.path.join(path, STATE_FILE + ".tmp")
            torch.save(_STATE.state_dict(), tmp)
            os.replace(tmp, os.path.join(path, STATE_FILE))
        return save_checkpoint(iteration, *args, non_persistent_ckpt=non_persistent_ckpt, **kwargs)

    return save


def install() -> None:
    """Put our schedule and checkpoint state into Megatron-LM's loop. Idempotent; call before ``pretrain``."""
    if not HAVE_MEGATRON_TRAINING:
        raise RuntimeError(f"megatron_sparsebalance.megatron_lm needs Megatron-LM's training package (megatron.training, "
                           f"in megatron-core 0.19's wheel); megatron-core {MEGATRON_CORE_VERSION} has none. Use "
                           "python -m megatron_sparsebalance.pretrain")
    from megatron.training import training

    from megatron_sparsebalance.compat import mend_optimizer_loading, use_prebuilt_dataset_helpers

    if getattr(training, _MARKER, False):
        return
    use_prebuilt_dataset_helpers()
    schedule = SparseBalanceSchedule()
    training.get_forward_backward_func = lambda *args, **kwargs: schedule
    training.save_checkpoint = _save_with_our_state(training.save_checkpoint)
    # --use-distributed-optimizer over torch's Adam (no Transformer Engine, no apex) cannot resume
    # through Megatron-LM's load_checkpoint as megatron-core ships it (compat.mend_optimizer_loading).
    get_megatron_optimizer = training.get_megatron_optimizer
    training.get_megatron_optimizer = wraps(get_megatron_optimizer)(
        lambda *args, **kwargs: mend_optimizer_loading(get_megatron_optimizer(*args, **kwargs)))
    setattr(training, _MARKER, True)


def main(argv=None) -> int:
    if not HAVE_MEGATRON_TRAINING or MEGATRON_CORE < (0, 19):
        print(f"megatron_sparsebalance.megatron_lm: needs megatron-core >= 0.19 with megatron.training; found "
              f"{MEGATRON_CORE_VERSION}. Use python -m megatron_sparsebalance.pretrain", file=sys.stderr)
        return 2
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    install()
    try:
        args = parse_megatron_args(argv)
    except ValueError as exc:
        print(f"megatron_sparsebalance.megatron_lm: error: {exc}", file=sys.stderr, flush=True)
        return 2
    pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)
    return 0


if __name__ == "__main__":
    sys.exit(main())
