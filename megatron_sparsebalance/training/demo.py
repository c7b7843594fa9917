"""``make demo``: a short real training run of a megatron-core GPT with sparse attention.

A tiny Qwen2-style GPT (GQA) learns the copy task on packed micro-batches of mixed lengths;
every layer routes with the MoBA router at budget ``--moba-topk`` and attends with the
implementation ``--sparse-attn-impl`` picks (the torch reference on a CPU). Prints loss, the
mean budget and coverage per step.
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_sparsebalance.attention import SparseAttentionConfig, budget_scope
from megatron_sparsebalance.data.synthetic import copy_task_batch
from megatron_sparsebalance.ops.implementations import IMPLEMENTATIONS, resolve_impl
from megatron_sparsebalance.training.cpu_compat import enable_cpu_megatron
from megatron_sparsebalance.training.dist import destroy_distributed, init_distributed
from megatron_sparsebalance.training.model import MODEL_PRESETS, build_gpt_model, transformer_config


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--moba-block-size", type=int, default=64)
    p.add_argument("--moba-topk", type=int, default=3)
    p.add_argument("--sparse-attn-impl", choices=IMPLEMENTATIONS, default="auto")
    p.add_argument("--task-vocab", type=int, default=32, help="distinct tokens of the copy task")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 384, 130],
                   help="sequence lengths packed in each micro-batch")
    return p.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    enable_cpu_megatron()
    init_distributed()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = MODEL_PRESETS["tiny"]
    sparse = SparseAttentionConfig(
        moba_block_size=args.moba_block_size, moba_topk=args.moba_topk, sparse_attn_impl=args.sparse_attn_impl
    ).validate()
    model = build_gpt_model(shape, sparse, transformer_config(shape), max_sequence_length=max(args.lengths)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"tiny GPT: {sum(p.numel() for p in model.parameters())} parameters, device {device}, "
          f"attention {resolve_impl(args.sparse_attn_impl, device)}, block {args.moba_block_size}, "
          f"budget {args.moba_topk}, packs of {args.lengths}")
    loss_value = float("nan")
    for it in range(1, args.train_iters + 1):
        batch = copy_task_batch(args.lengths, args.task_vocab, gen).to(device)
        t0 = time.perf_counter()
        with budget_scope() as report:
            per_token = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                              packed_seq_params=batch.packed_seq_params())
        loss = (per_token * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        print(f" iteration {it:4d}/{args.train_iters} | loss {loss_value:.4f} | mean budget "
              f"{report.mean_budget():.1f} | coverage {report.mean_coverage():.3f} | "
              f"{(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)
    destroy_distributed()
    return loss_value


if __name__ == "__main__":
    main()
