#!/usr/bin/env bash
# Qwen2.5-3B architecture on 8 GPUs, the paper's single-node layout: DP=2 x PP=4, micro-batch 2,
# global batch 16. Without tensor parallelism a 3B stage cannot keep the activations of its
# in-flight 64K-token micro-batches (about 7 GB per layer each), so layers are recomputed in
# backward; the stages are split 10/10/10/6 because the last one also runs the 152K-vocabulary
# output layer. The latency table was profiled on an H200 with the Triton kernels and the same
# recomputation (docs/BENCHMARKS.md); on another GPU profile your own (tools/profile_latency.py).
set -euo pipefail
torchrun --standalone --nproc_per_node 8 -m megatron_sparsebalance.pretrain \
    --model qwen2.5-3b --bf16 --use-distributed-optimizer \
    --pipeline-model-parallel-size 4 --micro-batch-size 2 --global-batch-size 16 \
    --decoder-first-pipeline-num-layers 10 --decoder-last-pipeline-num-layers 6 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --latency-table benchmarks/results/e2e/latency_table_h200_3b.json --manual-gc \
    --seq-length 65536 --mock-data --mock-length-distribution bimodal \
    --moba-block-size 128 --moba-topk 32 --sparse-attn-impl triton \
    --dst-anchor mean --dst-p 0.1 --batching sab \
    --train-iters 200 --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 \
    --save checkpoints/qwen3b --save-interval 100 --tensorboard-dir tb/qwen3b --log-throughput "$@"
