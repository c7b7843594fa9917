#!/usr/bin/env bash
# A Megatron-LM launch script's flags as they are (no --model: Megatron-LM's defaults apply to
# everything not given), plus SparseBalance's, on 2 CPU processes (PP=2 over gloo). The flags a
# CPU cannot run (--bf16, --use-distributed-optimizer) are left out; docs/MEGATRON_LM_FLAGS.md
# says what each flag does here.
set -euo pipefail
OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m megatron_sparsebalance.pretrain \
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 \
    --group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 1024 \
    --max-position-embeddings 1024 --position-embedding-type rope --rotary-base 10000 --rotary-percent 1.0 \
    --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 \
    --init-method-std 0.02 --untie-embeddings-and-output-weights --disable-bias-linear --add-qkv-bias \
    --micro-batch-size 1 --global-batch-size 4 --train-iters 10 --lr 3e-3 --min-lr 1e-4 \
    --lr-decay-style cosine --lr-warmup-iters 1 --clip-grad 1.0 --weight-decay 0.01 \
    --adam-beta1 0.9 --adam-beta2 0.95 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
    --overlap-grad-reduce --calculate-per-token-loss --log-interval 1 --mock-data \
    --tokenizer-type NullTokenizer --vocab-size 256 --seed 1234 --manual-gc --distributed-timeout-minutes 10 \
    --log-throughput --use-mcore-models --transformer-impl local --attention-backend auto \
    --no-masked-softmax-fusion --attention-softmax-in-fp32 --reset-position-ids --reset-attention-mask \
    --eod-mask-loss --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split \
    --ckpt-format torch_dist \
    --dst-anchor mean --dst-p 0.1 --batching sab --moba-block-size 64 --moba-topk 4 --sparse-attn-impl torch "$@"
