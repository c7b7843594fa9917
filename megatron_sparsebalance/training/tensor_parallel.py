"""Which tensor-parallel layouts a run can take, checked before any process group starts.

Megatron-core splits every layer's query heads, KV groups, FFN columns and vocabulary over the
TP ranks; our sparse attention works on the heads of its rank (``attention/tensor_parallel.py``).
Every attention implementation (cuda, triton, torch, and dense with ``--no-sparse-attention``)
has a TP path: they all run per head, and under the coverage bound a TP run routes through the
Triton or torch router, which take the budget chosen from the TP group's reduced curve (the CUDA
router chooses inside its launch, from one rank's heads). What cannot work is refused here by name.
"""
from __future__ import annotations


def validate_tensor_parallel(shape, tp: int, sequence_parallel: bool, context_parallel: int = 1) -> None:
    """Raise ``ValueError`` naming the flag when ``shape`` cannot run at tensor parallel size ``tp``.

    Args:
        shape: a :class:`~megatron_sparsebalance.training.model.ModelShape` (after vocabulary padding).
    """
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if sequence_parallel and tp == 1:
        # Reached from the tools that price a layout (simulate_pipeline, profile_latency), where
        # the flag would price nothing. Pretraining passes the flag as it takes effect: off at
        # TP = 1 with Megatron-LM's warning (SparseBalanceConfig.sequence_parallel).
        raise ValueError("--sequence-parallel splits activations over tensor-parallel ranks: it needs "
                         "--tensor-model-parallel-size > 1 (got 1)")
    if context_parallel != 1:
        raise ValueError(f"--context-parallel-size must be 1 (sparse attention has no context-parallel path), "
                         f"got {context_parallel}")
    if tp == 1:
        return
    heads, groups = shape.num_attention_heads, shape.num_query_groups
    if heads % tp:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) must divide --num-attention-heads ({heads})")
    if groups >= tp and groups % tp:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) must divide --num-query-groups ({groups})")
    if groups < tp and tp % groups:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) larger than --num-query-groups ({groups}) must be a "
                         "multiple of it (megatron-core replicates each KV group on TP / groups ranks)")
    if shape.ffn_hidden_size % tp:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) must divide --ffn-hidden-size ({shape.ffn_hidden_size})")
    if shape.vocab_size % tp:
        raise ValueError(f"the vocabulary ({shape.vocab_size}) must be divisible by --tensor-model-parallel-size "
                         f"({tp}): a --vocab-size given is the embedding's rows as they are, so give a multiple of "
                         "TP; a tokenizer's vocabulary (and the converter's) is padded to a multiple of "
                         "--make-vocab-size-divisible-by x TP")

