"""A Megatron-LM launch script's flags, and the bodies of their multi-process tests (importable by
spawned workers)."""
from __future__ import annotations

import json

import numpy as np

# The flags of a typical Megatron-LM Llama/Qwen launch (issue 40's list), at a tiny shape. The
# flags that cannot run on a CPU (--bf16, --use-distributed-optimizer) and the refused ones
# (--num-layers-per-virtual-pipeline-stage) are tested apart, in tests/test_megatron_flags.py.
ARCHITECTURE = [
    "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "1024",
    "--max-position-embeddings", "1024", "--position-embedding-type", "rope", "--rotary-base", "10000",
    "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.1", "--swiglu",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--init-method-std", "0.02",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--add-qkv-bias",
    "--vocab-size", "256",
]
VOCAB = 256


def flag_list(data_prefix: str, save: str, tensorboard: str) -> list:
    return ARCHITECTURE + [
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--weight-decay", "0.01",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--tensor-model-parallel-size", "1",
        "--context-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--overlap-grad-reduce",
        "--calculate-per-token-loss",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "3", "--save-interval", "2", "--save", save,
        "--load", save, "--tokenizer-type", "NullTokenizer", "--split", "90,9,1", "--seed", "1234",
        "--manual-gc", "--distributed-timeout-minutes", "5", "--log-throughput", "--use-mcore-models",
        "--transformer-impl", "local", "--attention-backend", "auto", "--no-masked-softmax-fusion",
        "--attention-softmax-in-fp32", "--sequence-parallel", "--reset-position-ids", "--reset-attention-mask",
        "--eod-mask-loss", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
        "--tensorboard-dir", tensorboard, "--data-path", data_prefix, "--ckpt-format", "torch_dist",
        # SparseBalance's own
        "--dst-anchor", "mean", "--dst-p", "0.1", "--batching", "sab",
        "--moba-block-size", "64", "--moba-topk", "4", "--sparse-attn-impl", "torch",
    ]


def write_documents(prefix: str, count: int = 100, seed: int = 0) -> None:
    """``count`` pre-tokenized documents (Megatron's .bin/.idx) of 64..1024 ids below VOCAB, each
    ending with the NullTokenizer's EOD (VOCAB - 1) and some with one inside."""
    from megatron_sparsebalance.data.datasets import write_indexed_dataset

    rng = np.random.default_rng(seed)
    docs = []
    for i in range(count):
        doc = rng.integers(1, VOCAB - 1, int(rng.integers(64, 1025)))
        if i % 3 == 0:
            doc[len(doc) // 2] = VOCAB - 1
        docs.append(np.append(doc, VOCAB - 1))
    write_indexed_dataset(prefix, docs, vocab_size=VOCAB)


def run_flag_list(argv, out_path):
    """One rank of ``pretrain`` with ``argv``; records the seed --seed set and the logged rows.
    Then, in the same processes (spawning costs more than the check), the two ranks as DP=2:
    :func:`overlap_grad_reduce_results`."""
    import random

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sparsebalance import pretrain as entry
    from megatron_sparsebalance.config import parse_config
    from megatron_sparsebalance.training import dist as msb_dist

    seeded = []
    real_seed = msb_dist.seed_everything

    def recording_seed(seed):
        real_seed(seed)
        seeded.append([seed, random.random(), float(np.random.random())])
        real_seed(seed)  # the draws above must not change the run

    msb_dist.seed_everything = recording_seed
    try:
        rows = entry.pretrain(parse_config(argv))
    finally:
        msb_dist.seed_everything = real_seed
    last_stage = dist.get_rank() == dist.get_world_size() - 1
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    overlap = overlap_grad_reduce_results()
    if last_stage:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "seeded": seeded, "overlap": overlap}, f)


def overlap_grad_reduce_results():
    """Two steps of each DP rank without and with --overlap-grad-reduce: ``[[(loss, grad norm)] x 2] x 2``."""
    import torch
    import torch.distributed as dist

    from megatron_sparsebalance.attention import SparseAttentionConfig
    from megatron_sparsebalance.balance.dst import DSTConfig
    from megatron_sparsebalance.data.synthetic import pack_sequences
    from megatron_sparsebalance.training.model import MODEL_PRESETS
    from megatron_sparsebalance.training.trainer import OptimSettings, Trainer

    results = []
    for overlap in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(MODEL_PRESETS["tiny"], SparseAttentionConfig(moba_block_size=64, sparse_attn_impl="torch",
                                                                       moba_topk=2),
                          DSTConfig(anchor="none", k_base=2), OptimSettings(lr=1e-3, min_lr=1e-4, overlap_grad_reduce=overlap),
                          256)
        assert trainer.model.ddp_config.overlap_grad_reduce == overlap
        g = torch.Generator().manual_seed(dist.get_rank())
        batches = [pack_sequences([torch.randint(1, 500, (n,), generator=g)], [torch.ones(n)]) for n in (100, 150)]
        steps = [trainer.train_step([[[100], [150]]] * 2, batches) for _ in range(2)]
        results.append([(s.loss, float(s.grad_norm)) for s in steps])
    return results
