"""megatron-core's own 1F1B schedule as the oracle of ours.

Runs the same micro-batches through ``forward_backward_pipelining_without_interleaving`` and
through :func:`forward_backward_sparsebalance` on the same stage model, and returns the
largest differences of the losses and of every parameter's gradient. Used by the tests (CPU,
gloo) and by ``benchmarks/pipeline_dst.py --check-megatron`` (GPU, NCCL).
"""
from __future__ import annotations

from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

from megatron_sparsebalance.pipeline.schedule import MicroBatchPlan, PipelinePlan, forward_backward_sparsebalance
from megatron_sparsebalance.training.step import gpt_forward_step, mean_loss


def compare_with_megatron(model, config, batches, hidden_size: int, budget: int) -> dict:
    """Loss and gradient differences between megatron-core's 1F1B and ours (fixed budget).

    ``config`` is the model's ``TransformerConfig``; megatron-core needs
    ``variable_seq_lengths=True`` for packs of different lengths, which is set here.
    """
    device = next(model.parameters()).device
    batches = [b.to(device) for b in batches]
    results = {}
    for name in ("megatron", "ours"):
        model.zero_grad(set_to_none=True)
        if name == "megatron":
            config.variable_seq_lengths = True
            losses = forward_backward_pipelining_without_interleaving(
                forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=max(b.tokens.shape[1] for b in batches), micro_batch_size=1,
            )
        else:
            plan = PipelinePlan([MicroBatchPlan(b.lengths, budget=budget) for b in batches], hidden_size=hidden_size,
                                measure=False)
            losses = forward_backward_sparsebalance(
                forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), plan=plan,
            )
        results[name] = (mean_loss(losses) if losses else None,
                         {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None})
    (loss_m, grads_m), (loss_o, grads_o) = results["megatron"], results["ours"]
    if grads_m.keys() != grads_o.keys():
        raise AssertionError(f"gradients of different parameters: {sorted(grads_m.keys() ^ grads_o.keys())}")
    return {
        "loss_megatron": loss_m,
        "loss_ours": loss_o,
        "max_loss_diff": abs(loss_m - loss_o) if loss_m is not None else 0.0,
        "max_grad_diff": max((grads_m[n] - grads_o[n]).abs().max().item() for n in grads_m),
        "max_grad": max(g.abs().max().item() for g in grads_m.values()),
    }
