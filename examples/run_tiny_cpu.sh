#!/usr/bin/env bash
# A tiny model with 2 pipeline stages over gloo on a CPU: SparseBalance (DST mean anchor + SAB)
# on long-tailed mock data. Takes about half a minute on two cores.
set -euo pipefail
OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m megatron_sparsebalance.pretrain \
    --model tiny --num-layers 4 --untie-embeddings-and-output-weights \
    --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 \
    --seq-length 4096 --mock-data --mock-length-distribution longtail --mock-vocab-size 512 \
    --moba-block-size 64 --moba-topk 8 --sparse-attn-impl torch \
    --dst-anchor mean --dst-p 0.1 --batching sab \
    --train-iters 10 --lr 1e-3 --min-lr 1e-4 --log-interval 1 --log-throughput "$@"
