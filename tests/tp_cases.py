"""Bodies of the multi-process tensor-parallel tests (importable by spawned workers).

The model is pipeline_cases' tiny GPT (4 query heads, 2 KV groups): TP=2 gives each rank one
whole group, TP=4 replicates each group on two ranks (megatron-core's ``num_query_groups < TP``
path). DST runs with the coverage bound (``--dst-p``), so every layer chooses its budget from
the coverage curve that the TP ranks must agree on.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_sparsebalance.attention import budget as budget_module
from megatron_sparsebalance.balance.dst import DSTConfig
from megatron_sparsebalance.balance.latency import AnalyticLatencyModel
from megatron_sparsebalance.pipeline import schedule
from megatron_sparsebalance.pipeline.schedule import PipelinePlan, forward_backward_sparsebalance
from megatron_sparsebalance.training import checkpointing
from megatron_sparsebalance.training.model import build_gpt_model, transformer_config
from megatron_sparsebalance.training.step import gpt_forward_step, mean_loss, pipeline_plans
from tests.pipeline_cases import NUM_LAYERS, SHAPE, SPARSE, micro_batches

# Unequal packs with odd token counts (sequence parallelism pads them to a multiple of TP).
LENGTHS = [[259, 64], [131], [192, 100, 9], [400]]
DST = DSTConfig(anchor="mean", p=0.1, k_base=4)
PLAN_STAGES = 2  # DST's plan is made for a 2-stage pipeline in every layout, so all runs share it


def _latency_model():
    return AnalyticLatencyModel(SHAPE, NUM_LAYERS // PLAN_STAGES, block_size=SPARSE.moba_block_size, hardware="h200",
                                dtype_bytes=4, candidates=(1, 2, 3, 4, 6, 8))


def dst_plan() -> PipelinePlan:
    plan = pipeline_plans([LENGTHS], SHAPE.hidden_size, DST, _latency_model(), PLAN_STAGES, dp_rank=0)[0]
    assert any(mb.budget < DST.k_base for mb in plan.micro_batches), "the test needs DST to shrink a micro-batch"
    return plan


def _layer_offset(pp_rank: int, pp: int) -> int:
    return pp_rank * NUM_LAYERS // pp


def full_key(key: str, pp_rank: int, pp: int) -> str:
    """Name of a stage model's parameter in the unpipelined model (layers are numbered per stage)."""
    key = key.removeprefix("module.")
    if key.startswith("decoder.layers."):
        _, _, idx, rest = key.split(".", 3)
        return f"decoder.layers.{int(idx) + _layer_offset(pp_rank, pp)}.{rest}"
    return key


def _gather_tp(name: str, x: torch.Tensor, param) -> torch.Tensor:
    """The unsharded tensor of a TP-sharded parameter's ``x`` (its value or gradient)."""
    if not getattr(param, "tensor_model_parallel", False):
        return x
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    dim = param.partition_dim
    if name.endswith("mlp.linear_fc1.weight"):  # swiglu: each rank holds [its gate rows; its up rows]
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return torch.cat(parts, dim)


class BudgetSpy:
    """Every layer's (micro-batch, layer, k_used, coverage) of one schedule run, read after it."""

    def __init__(self):
        self.reports = []
        self._real = schedule.budget_scope

    def __enter__(self):
        def scope(*args, **kwargs):
            cm = self._real(*args, **kwargs)
            spy = self

            class Recording:
                def __enter__(self):
                    report = cm.__enter__()
                    spy.reports.append(report)
                    return report

                def __exit__(self, *exc):
                    return cm.__exit__(*exc)

            return Recording()

        schedule.budget_scope = scope
        return self

    def __exit__(self, *exc):
        schedule.budget_scope = self._real

    def used(self) -> list:
        """``(layer, k_used, C(k_used))`` of every forward and recomputed forward, in order."""
        return [(layer.layer_number, float(layer.stats.unread()[0]), float(layer.stats.unread()[1]))
                for report in self.reports for layer in report.layers]


def reference(root: str, seed: int) -> None:
    """TP=1, no pipeline: the initial weights (a checkpoint every layout loads), loss, gradients, budgets."""
    torch.manual_seed(seed)
    model = build_gpt_model(SHAPE, SPARSE, transformer_config(SHAPE), max_sequence_length=4096)
    checkpointing.save_checkpoint(os.path.join(root, "init"), 0, model)
    plan = dst_plan()
    with BudgetSpy() as spy:
        losses = forward_backward_sparsebalance(forward_step_func=gpt_forward_step,
                                                data_iterator=iter(micro_batches(LENGTHS, seed)), model=[model],
                                                num_microbatches=len(LENGTHS), plan=plan)
    torch.save({"loss": mean_loss(losses), "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
                "budgets": plan.measured.budgets, "layers": spy.used()}, os.path.join(root, "ref.pt"))


def build_stage(sequence_parallel: bool):
    """This rank's stage at the current TP x PP, wrapped in megatron-core's DDP (which all-reduces the
    sequence-parallel norms' gradients over TP in ``finalize_model_grads``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    cfg = transformer_config(SHAPE, pipeline_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
                             tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                             sequence_parallel=sequence_parallel)
    model = build_gpt_model(SHAPE, SPARSE, cfg, max_sequence_length=4096,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    cfg.no_sync_func = model.no_sync
    cfg.finalize_model_grads_func = finalize_model_grads
    return model


def equals_reference(root: str, seed: int, sequence_parallel: bool) -> None:
    """Loss, every gradient and every layer's budget at this TP x PP equal the TP=1 run's."""
    pp, pp_rank = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
    model = build_stage(sequence_parallel)
    checkpointing.load_checkpoint(checkpointing.iteration_dir(os.path.join(root, "init"), 0), model)
    model.zero_grad_buffer()
    plan = dst_plan()
    with BudgetSpy() as spy:
        losses = forward_backward_sparsebalance(forward_step_func=gpt_forward_step,
                                                data_iterator=iter(micro_batches(LENGTHS, seed)), model=[model],
                                                num_microbatches=len(LENGTHS), plan=plan)
    ref = torch.load(os.path.join(root, "ref.pt"))
    if parallel_state.is_pipeline_last_stage():
        got = mean_loss(losses)
        assert abs(got - ref["loss"]) < 1e-5 * max(1.0, abs(ref["loss"])), (got, ref["loss"])
    for name, p in model.named_parameters():
        key = full_key(name, pp_rank, pp)
        grad = _gather_tp(key, p.main_grad, p)
        expect = ref["grads"][key]
        assert grad.shape == expect.shape, (key, grad.shape, expect.shape)
        assert torch.allclose(grad, expect, atol=2e-5, rtol=1e-4), (key, (grad - expect).abs().max())
    # The budgets every TP rank used, layer by layer, are identical (not merely close) ...
    used = spy.used()
    peers = [None] * parallel_state.get_tensor_model_parallel_world_size()
    dist.all_gather_object(peers, used, group=parallel_state.get_tensor_model_parallel_group())
    assert all(p == used for p in peers), "TP ranks of one stage used different budgets"
    # ... and those of the TP=1 run: this stage's layers (megatron numbers them globally), per micro-batch.
    offset, per_stage = _layer_offset(pp_rank, pp), NUM_LAYERS // pp
    mine = [(layer, k) for layer, k, _ in ref["layers"] if offset < layer <= offset + per_stage]
    assert [(layer, k) for layer, k, _ in used] == mine, (used, mine)
    assert plan.measured.budgets == ref["budgets"], (plan.measured.budgets, ref["budgets"])


def equality_cases(root: str, seed: int, table_path: str, pretrain_argv: list) -> None:
    """With and without sequence parallelism, the latency profiler on this TP group, then the
    standalone entry's ``pretrain`` with ``pretrain_argv``, in one launch."""
    for sp in (True, False):
        try:
            equals_reference(root, seed, sp)
        except Exception as e:
            raise AssertionError(f"sequence_parallel={sp} failed") from e
    from tools.profile_latency import main as profile_main

    profile_main(["--model", "tiny", "--layers-per-stage", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--moba-block-size", "64", "--sparse-attn-impl", "torch", "--fp32", "--lengths", "128", "256",
                  "--budgets", "1", "2", "--warmup", "0", "--iters", "1", "--min-time-s", "0", "--out", table_path])
    from megatron_sparsebalance.config import parse_config
    from megatron_sparsebalance.pretrain import pretrain

    pretrain(parse_config(pretrain_argv))


# --- training at TP=2 x PP=2: stop + resume bitwise, and checkpoints resharded to TP=1 x PP=4 and back ---

STEPS = 3
SAVE_AT = 2


def relayout(tp: int, pp: int) -> None:
    """Rebuild megatron's model-parallel groups at another TP x PP in the same processes (one
    launch serves several layouts: starting processes costs more than a tiny case)."""
    from megatron_sparsebalance.training.dist import init_distributed

    parallel_state.destroy_model_parallel()
    init_distributed(tensor_parallel_size=tp, pipeline_parallel_size=pp, backend="gloo")


def make_trainer(sequence_parallel: bool):
    from megatron_sparsebalance.training.trainer import OptimSettings, Trainer

    torch.manual_seed(11)  # the initial weights; every test loads or resumes over them anyway
    return Trainer(SHAPE, SPARSE, DST, OptimSettings(lr=3e-3, min_lr=3e-4, lr_decay_iters=STEPS),
                   max_sequence_length=4096, latency_model=_latency_model(), sequence_parallel=sequence_parallel)


def step_batches(step: int, seed: int):
    return micro_batches(LENGTHS, seed * 1000 + step)


def train(trainer, steps, seed) -> list:
    return [(r.loss, r.grad_norm, tuple(r.metrics.budgets))
            for r in (trainer.train_step([LENGTHS], step_batches(s, seed)) for s in steps)]


def save(trainer, root: str, iteration: int) -> None:
    checkpointing.save_checkpoint(root, iteration, trainer.model, trainer.optimizer, common={
        "scheduler": trainer.scheduler.state_dict(), "latency": trainer.latency_model.calibration_state(),
        "dst_floor": trainer.coverage_floor.state_dict()})


def resume(trainer, root: str, iteration: int, optimizer_state: bool = True) -> None:
    common = checkpointing.load_checkpoint(checkpointing.iteration_dir(root, iteration), trainer.model,
                                           trainer.optimizer, optimizer_state=optimizer_state)
    if optimizer_state:
        trainer.scheduler.load_state_dict(common["scheduler"])
        trainer.latency_model.load_calibration(common["latency"])
        trainer.coverage_floor.load_state_dict(common["dst_floor"])


def eval_loss(trainer, seed: int) -> float:
    """Forward-only loss of fixed micro-batches at the fixed budget, known on every rank."""
    plan = PipelinePlan([schedule.MicroBatchPlan(lengths) for lengths in LENGTHS], hidden_size=SHAPE.hidden_size)
    plan.measure = False
    reports = forward_backward_sparsebalance(forward_step_func=gpt_forward_step,
                                             data_iterator=iter(micro_batches(LENGTHS, seed)), model=[trainer.model],
                                             num_microbatches=len(LENGTHS), plan=plan, forward_only=True)
    return trainer._loss_on_every_rank(reports)[0]  # (micro-batch mean, token-weighted): the first


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def world4_cases(root: str, seed: int) -> None:
    """World 4 in one launch: TP=2 x PP=2 (equality, stop + resume bitwise, save), TP=1 x PP=4
    (load that, evaluate, train a step, save), TP=2 x PP=2 again (load that back), TP=4 (equality,
    KV groups replicated over two ranks each), TP=2 x DP=2 (the figures count TP groups once)."""
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    equals_reference(root, seed, sequence_parallel=True)

    ckpt = os.path.join(root, "tp2pp2")
    straight = make_trainer(sequence_parallel=True)
    resume(straight, os.path.join(root, "init"), 0, optimizer_state=False)
    first = train(straight, range(1, SAVE_AT + 1), seed)
    save(straight, ckpt, SAVE_AT)
    saved_loss = eval_loss(straight, seed)
    rest = train(straight, range(SAVE_AT + 1, STEPS + 1), seed)
    assert rest[-1][0] < first[0][0], ("the loss must fall", first, rest)
    resumed = make_trainer(sequence_parallel=True)
    resume(resumed, ckpt, SAVE_AT)
    again = train(resumed, range(SAVE_AT + 1, STEPS + 1), seed)
    assert again == rest, ("stop + resume is not bitwise", again, rest)  # losses, grad norms, budgets

    relayout(tp=1, pp=4)
    tp1 = make_trainer(sequence_parallel=False)
    resume(tp1, ckpt, SAVE_AT)  # weights, Adam's moments and the schedules, resharded
    assert close(eval_loss(tp1, seed), saved_loss), (eval_loss(tp1, seed), saved_loss)
    (loss3, _, _), = train(tp1, [SAVE_AT + 1], seed)
    assert close(loss3, rest[0][0]), ("the step after a resharded resume", loss3, rest[0][0])
    back = os.path.join(root, "tp1pp4")
    save(tp1, back, SAVE_AT + 1)
    tp1_loss = eval_loss(tp1, seed)

    relayout(tp=2, pp=2)
    tp2 = make_trainer(sequence_parallel=True)
    resume(tp2, back, SAVE_AT + 1)
    assert close(eval_loss(tp2, seed), tp1_loss), (eval_loss(tp2, seed), tp1_loss)

    relayout(tp=4, pp=1)
    equals_reference(root, seed, sequence_parallel=True)

    relayout(tp=2, pp=1)  # DP=2 replicas, each a TP group
    replicas_are_tp_groups(seed)


OTHER_REPLICA = [[64, 64, 64], [333], [200, 7], [128]]


def replicas_are_tp_groups(seed: int) -> None:
    """TP=2 x DP=2: DST plans both replicas' micro-batches; the iteration's figures count each
    (stage, replica) once, not once per TP rank."""
    assert parallel_state.get_data_parallel_world_size() == 2
    dp_rank = parallel_state.get_data_parallel_rank()
    trainer = make_trainer(sequence_parallel=True)
    lengths = [LENGTHS, OTHER_REPLICA]
    step = trainer.train_step(lengths, micro_batches(lengths[dp_rank], seed + dp_rank))
    m = step.metrics
    assert len(m.records) == 2 and sorted(r.dp_rank for r in m.records) == [0, 1]
    assert len(m.micro_batch_ms) == len(m.budgets) == 8 and len(m.bubble) == 1
    mine = m.budgets[4 * dp_rank: 4 * dp_rank + 4]
    expected = [mb.budget for mb in step.plan.micro_batches]
    # every layer took the request, or the coverage bound kept it between the request and k_base
    assert all(min(e, DST.k_base) <= b <= max(e, DST.k_base) for b, e in zip(mine, expected)), (mine, expected)
    assert m.imbalance == max(m.micro_batch_ms) / (sum(m.micro_batch_ms) / 8)
