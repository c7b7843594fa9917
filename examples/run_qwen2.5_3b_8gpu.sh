#!/usr/bin/env bash
# Qwen2.5-3B architecture on 8 GPUs, the paper's single-node layout: DP=2 x PP=4, micro-batch 2,
# global batch 16. Add --latency-table from tools/profile_latency.py for profiled predictions.
set -euo pipefail
torchrun --standalone --nproc_per_node 8 -m megatron_sparsebalance.pretrain \
    --model qwen2.5-3b --bf16 --use-distributed-optimizer \
    --pipeline-model-parallel-size 4 --micro-batch-size 2 --global-batch-size 16 \
    --seq-length 65536 --mock-data --mock-length-distribution bimodal \
    --moba-block-size 128 --moba-topk 32 --sparse-attn-impl auto \
    --dst-anchor mean --dst-p 0.1 --batching sab \
    --train-iters 200 --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 \
    --save checkpoints/qwen3b --save-interval 100 --tensorboard-dir tb/qwen3b "$@"
