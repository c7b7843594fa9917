#!/usr/bin/env bash
# Qwen2.5-0.5B architecture, PP=4 on 4 GPUs, 64K long-tailed data, the paper's MoBA settings
# (block 128 here; the paper used 256 with top-k 32). Start from converted weights with
# --pretrained-checkpoint (tools/convert_checkpoint.py hf-to-mcore), or from random init as here.
set -euo pipefail
torchrun --standalone --nproc_per_node 4 -m megatron_sparsebalance.pretrain \
    --model qwen2.5-0.5b --bf16 \
    --pipeline-model-parallel-size 4 --micro-batch-size 2 --global-batch-size 16 \
    --seq-length 65536 --mock-data --mock-length-distribution longtail \
    --moba-block-size 128 --moba-topk 32 --sparse-attn-impl auto \
    --dst-anchor mean --dst-p 0.1 --batching sab \
    --train-iters 200 --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 \
    --save checkpoints/qwen0.5b --save-interval 100 --tensorboard-dir tb/qwen0.5b --log-throughput "$@"
