"""Evaluation on held-out data (``--eval-interval``, ``--eval-iters``): loss and answer accuracy.

Owns the validation pass of a run, what it measures and how it is logged. Decisions:

- **Fixed budget.** Every micro-batch runs at ``--moba-topk``, DST off: evaluation measures the
  model a run trained, not its load balancer (DST's budgets are a speed knob of training). Dense
  runs (``--no-sparse-attention``) evaluate dense.
- **Validation data.** Mock runs draw a held-out split (:func:`build_validation_dataset`): the
  training distribution, content and ``--mock-retrieval-depth``, from random streams of its own
  and a fixed seed, so it holds no training sample and runs that differ only in ``--seed`` are
  scored on the same samples. Other runs read ``--valid-data-path``. Every evaluation scores the
  same ``--eval-iters`` global batches, so the points of a curve differ only by the weights.
- **The training path, forward only.** The global batches are planned by a copy of the run's
  batcher (SAB, LBB or arrival order), packed into the same THD micro-batches and run by our 1F1B
  schedule with ``forward_only=True``, under any PP x DP.
- **Metrics**, from each target token's loss and argmax on the last stage, over every sample of
  every DP rank: per-token loss (sum over target tokens / their count, as Megatron's
  ``evaluate``), per-token accuracy (argmax = label) and exact match (``acc``: every target token
  of a unit right), also by sequence length. The unit of exact match is the sample, except for
  ``--mock-content retrieval``, where it is the question (its answer tokens; a sample holds many,
  each at its own distance from its record): ``acc`` is then the retrieval accuracy, and it is
  also bucketed by the distance from the planted record to the question.

Rows go to ``eval.jsonl`` in the log directory, to TensorBoard (``eval/...``) and to the log as
Megatron's ``validation loss at iteration N`` line.
"""
from __future__ import annotations

import copy
import json
import math
import os
import time
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron_sparsebalance.balance.dst import DSTConfig
from megatron_sparsebalance.balance.sab import SparsityEstimator
from megatron_sparsebalance.data.datasets import build_validation_dataset
from megatron_sparsebalance.data.sampler import GlobalBatchSampler
from megatron_sparsebalance.data.synthetic import PackedBatch, retrieval_questions
from megatron_sparsebalance.pipeline.schedule import forward_backward_sparsebalance
from megatron_sparsebalance.training.step import pad_for_sequence_parallel, pipeline_plans


class Score(NamedTuple):
    """The outcome of one scored unit, a validation sample or one retrieval question (host numbers:
    gathered across ranks as objects)."""

    length: int
    """Tokens of the sample (the question's sample)."""
    distance: Optional[int]
    """A question's distance from its planted record to it, in tokens; None for a sample."""
    loss_sum: float
    """Summed cross entropy over the unit's target tokens."""
    targets: int
    correct: int
    """Target tokens whose argmax prediction is the label."""


# ---- the last stage: loss and argmax per sample ---------------------------------------------


def eval_forward_step(data_iterator, model):
    """``forward_step_func`` of evaluation: the training loss plus, per sample, what the argmax got right.

    The loss is megatron-core's own per-token cross entropy (labels given, as in training); the
    predictions come from a forward hook on the output layer, which sees the logits ``[s, b, V]``
    that loss is computed from. Asking the model for logits instead (no labels) would make a
    second, transposed copy of them and need a cross entropy of our own. The report's
    ``per_token`` is ``[2, T]``: each position's loss and whether its argmax is the label (1/0),
    both 0 off the loss mask; the host cuts it into samples and questions (:func:`pack_scores`).
    Under tensor parallelism each rank's logits are its slice of the vocabulary: the argmax is
    agreed over the TP group (:func:`vocab_parallel_argmax`). Under sequence parallelism the pack
    is padded as in training and ``per_token`` cut back to the pack's own tokens.
    """
    batch: PackedBatch = next(data_iterator)
    tokens = batch.tokens.shape[-1]
    config = get_model_config(model)
    if config.sequence_parallel:
        batch = pad_for_sequence_parallel(batch, config.tensor_model_parallel_size)
    captured = {}

    def keep_prediction(_module, _inputs, out) -> None:  # None: the output goes on unchanged
        captured.setdefault("prediction", vocab_parallel_argmax(out[0]))

    hook = None
    if parallel_state.is_pipeline_last_stage():
        hook = get_attr_wrapped_model(model, "output_layer").register_forward_hook(keep_prediction)
    try:
        output = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                       packed_seq_params=batch.packed_seq_params())
    finally:
        if hook is not None:
            hook.remove()

    def loss_func(per_token_loss):
        mask = batch.loss_mask[0].to(per_token_loss.device)
        loss = per_token_loss[0].float() * mask
        prediction = captured["prediction"][:, 0]  # [s, b=1]: THD packs are one row
        right = (prediction == batch.labels[0]).float() * mask
        total, loss_tokens = loss.sum(), mask.sum().to(torch.int)
        return total, loss_tokens, {"loss_sum": total.detach(), "tokens": loss_tokens.detach(),
                                    "per_token": torch.stack([loss, right])[:, :tokens]}

    return output, loss_func


def vocab_parallel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the whole vocabulary of logits ``[..., V / TP]`` split by vocabulary over the
    TP group (rank r holds ids ``r V/TP .. (r+1) V/TP - 1``); ties go to the lowest id, as
    ``argmax`` over the whole vocabulary does. One all-gather of ``[..., 2]`` per call."""
    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group) if dist.is_initialized() else 1
    best, index = logits.max(dim=-1)
    if tp == 1:
        return index
    best = best.float()
    index = index + parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    mine = torch.stack([best, index.float()], dim=-1)
    parts = [torch.empty_like(mine) for _ in range(tp)]
    dist.all_gather(parts, mine.contiguous(), group=group)
    return combine_vocab_parallel_argmax(torch.stack([p[..., 0] for p in parts]), torch.stack([p[..., 1] for p in parts]))


def combine_vocab_parallel_argmax(best: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[TP, ...]`` each rank's largest logit and its (global) id -> the id of the largest; the lowest
    rank wins a tie (``argmax`` returns the first maximum), which holds the lowest id."""
    winner = best.argmax(dim=0, keepdim=True)
    return index.gather(0, winner)[0].to(torch.long)


# ---- reductions ------------------------------------------------------------------------------


def pack_scores(batch: PackedBatch, per_token: torch.Tensor, retrieval: bool) -> tuple[list, list]:
    """The :class:`Score` of each sample of a pack and (``retrieval``) of each of its questions.

    ``per_token``: the last stage's ``[2, T]`` (loss, right) of the pack (:func:`eval_forward_step`);
    ``batch``: the pack on the host, whose tokens say where the questions are.
    """
    loss, right = per_token.double()
    mask = batch.loss_mask[0]
    cu = batch.cu_seqlens.tolist()
    samples, questions = [], []
    for lo, hi in zip(cu[:-1], cu[1:]):
        samples.append(Score(hi - lo, None, float(loss[lo:hi].sum()), round(float(mask[lo:hi].sum())),
                             round(float(right[lo:hi].sum()))))
        if retrieval:
            for question in retrieval_questions(batch.tokens[0, lo:hi]):
                # Labels are the next tokens: the answer token at a is predicted at a - 1.
                at = torch.tensor(question.answers) + (lo - 1)
                questions.append(Score(hi - lo, question.distance, float(loss[at].sum()), len(at),
                                       round(float(right[at].sum()))))
    return samples, questions


def bucket_of(value: int) -> str:
    """Power-of-two bucket ``"lo-hi"`` holding ``lo < value <= hi`` (e.g. 12000 -> ``"8192-16384"``)."""
    hi = 1 << max(0, int(value) - 1).bit_length()
    return f"{hi // 2}-{hi}"


def _bucket_key(label: str) -> int:
    return int(label.split("-")[1])


def score_table(scores: Sequence[Score]) -> dict:
    """Units (``n``), exact match, token accuracy and per-token loss of a set of scored units."""
    targets = sum(s.targets for s in scores)
    return {
        "n": len(scores),
        "acc": sum(s.correct == s.targets for s in scores) / len(scores) if scores else float("nan"),
        "token_acc": sum(s.correct for s in scores) / targets if targets else float("nan"),
        "loss": sum(s.loss_sum for s in scores) / targets if targets else float("nan"),
    }


def bucketed(scores: Sequence[Score], key) -> dict:
    """:func:`score_table` per power-of-two bucket of ``key(score)``, buckets in ascending order."""
    groups: dict = {}
    for s in scores:
        groups.setdefault(bucket_of(key(s)), []).append(s)
    return {label: score_table(groups[label]) for label in sorted(groups, key=_bucket_key)}


def summarize(samples: Sequence[Score], questions: Optional[Sequence[Score]] = None) -> dict:
    """Everything one evaluation reports: loss and token accuracy over the samples' target tokens;
    exact match (``acc``) and its buckets over ``questions`` when given (retrieval: then also by
    distance), else over the samples. Samples without a target token count in nothing."""
    scored = [s for s in samples if s.targets > 0]
    units = scored if questions is None else questions
    table = score_table(scored)
    out = {
        "loss": table["loss"],
        "ppl": math.exp(min(20.0, table["loss"])) if math.isfinite(table["loss"]) else float("nan"),
        "acc": score_table(units)["acc"],
        "token_acc": table["token_acc"],
        "samples": len(scored),
        "target_tokens": sum(s.targets for s in scored),
        "tokens": sum(s.length for s in samples),
        "acc_by_length": bucketed(units, lambda s: s.length),
    }
    if questions is not None:
        out["questions"] = len(questions)
        out["acc_by_distance"] = bucketed(questions, lambda s: s.distance)
    return out


def validation_lines(row: dict, retrieval: bool) -> str:
    """Megatron-LM's validation block for an evaluation row, with the accuracy figures."""
    acc_name = "retrieval acc" if retrieval else "exact-match acc"
    text = (f" validation loss at iteration {row['iteration']} | lm loss value: {row['loss']:.6E} |"
            f" lm loss PPL: {row['ppl']:.6E} | {acc_name}: {row['acc']:.4f} | token acc: {row['token_acc']:.4f} |"
            f" samples: {row['samples']} |" + (f" questions: {row['questions']} |" if "questions" in row else "")
            + (f" coverage at k={row['budget']}: {row['mean_coverage']:.3f} |" if row["mean_coverage"] is not None
               else ""))
    rule = "-" * (len(text) + 1)
    parts = [rule, text]
    for group, name in (("acc_by_length", "by length"), ("acc_by_distance", "by distance")):
        if group in row:
            cells = " | ".join(f"{label}: {c['acc']:.3f} (n={c['n']})" for label, c in row[group].items())
            parts.append(f" {acc_name} {name}: {cells}")
    parts.append(rule)
    return "\n".join(parts)


# ---- the pass --------------------------------------------------------------------------------


class Evaluator:
    """The run's validation pass: when it is due, running it on every rank, and logging it.

    Build it before a checkpoint is loaded: it copies the batcher as it is then (the latency
    model uncalibrated), so a resumed run packs its validation batches as a fresh one does.

    Args:
        cfg: the run's ``SparseBalanceConfig``.
        trainer: this stage's :class:`~megatron_sparsebalance.training.trainer.Trainer`.
        batcher: the run's ``SparsityAwareBatcher`` (copied, never changed).
    """

    def __init__(self, cfg, trainer, batcher):
        self.cfg, self.trainer = cfg, trainer
        self.interval, self.iters = cfg.eval.eval_interval, cfg.eval.eval_iters
        gbs = cfg.training.global_batch_size
        self.dataset = build_validation_dataset(cfg.data, self.iters * gbs, trainer.shape.vocab_size)
        if len(self.dataset) < self.iters * gbs:
            raise ValueError(f"--valid-data-path has {len(self.dataset)} samples, fewer than --eval-iters x "
                             f"--global-batch-size = {self.iters * gbs}")
        self.retrieval = cfg.data.mock_data and cfg.data.mock_content == "retrieval" and not cfg.data.valid_data_path
        # A copy: training keeps calibrating the latency model and feeding SAB's estimator, and a
        # validation plan must neither change between evaluations nor touch the training state.
        # The estimator restarts at --moba-topk for every length, the budget evaluation runs at.
        batcher = copy.deepcopy(batcher)
        if batcher.estimator is not None:
            batcher.estimator = SparsityEstimator(cfg.sparse.moba_topk)
        self.sampler = GlobalBatchSampler(self.dataset.lengths, gbs, batcher, seed=cfg.data.seed, shuffle=False)
        self.plans = [self.sampler.next_plan() for _ in range(self.iters)]
        self.dst = DSTConfig(anchor="none", k_base=cfg.sparse.moba_topk)
        self.log_path, self.writer, self.is_logger = None, None, False
        self.history: list = []
        self._reached: Optional[int] = None
        self._evaluated: Optional[int] = None

    def log_to(self, log_dir: Optional[str], writer=None, is_logger: bool = False) -> "Evaluator":
        """Where rows go: ``<log_dir>/eval.jsonl`` (rank 0), TensorBoard and the printed line (the logger)."""
        self.log_path = os.path.join(log_dir, "eval.jsonl") if log_dir else None
        self.writer, self.is_logger = writer, is_logger
        return self

    # ---- when ----

    def after_iteration(self, iteration: int, consumed_samples: int) -> Optional[dict]:
        """Evaluate when ``iteration`` is a multiple of ``--eval-interval`` (call on every rank)."""
        self._reached = iteration
        if iteration % self.interval == 0:
            return self.run(iteration, consumed_samples)
        return None

    def finish(self, start_iteration: int, consumed_samples: int) -> Optional[dict]:
        """The evaluation at the end of training: when ``--train-iters`` was reached (also by a run
        resumed there, or with ``--train-iters 0``) and its last iteration had none. A run stopped
        early (``--exit-interval``, SIGTERM) is not at its end: the resumed run evaluates."""
        reached = self._reached if self._reached is not None else start_iteration
        if reached >= self.cfg.training.train_iters and self._evaluated != reached:
            return self.run(reached, consumed_samples)
        return None

    # ---- what ----

    def run(self, iteration: int, consumed_samples: int) -> dict:
        """Evaluate, log, and return the row (the same on every rank)."""
        t0 = time.perf_counter()
        samples, questions, coverage = self.evaluate()
        row = {"iteration": iteration, "consumed_samples": consumed_samples, **summarize(samples, questions),
               "budget": self.cfg.sparse.moba_topk if self.cfg.sparse.sparse_attention else None,
               "mean_coverage": coverage, "eval_ms": (time.perf_counter() - t0) * 1e3}
        self._evaluated = iteration
        self.history.append(row)
        self._log(row)
        return row

    def evaluate(self) -> tuple[list, Optional[list], Optional[float]]:
        """The :class:`Score` of every validation sample and (retrieval, else None) of every question,
        gathered on every rank, and the mean coverage ``C(k)`` the sparse layers kept (None when dense)."""
        model, device = self.trainer.model, self.trainer.device
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        my_samples, my_questions, coverage = [], [], []
        model.eval()
        try:
            with torch.no_grad():
                for plan in self.plans:
                    lengths = plan.rank_micro_batch_lengths()
                    pipeline = pipeline_plans(lengths, self.trainer.shape.hidden_size, self.dst)[dp_rank]
                    batches = self.sampler.micro_batches(self.dataset, plan, dp_rank)
                    reports = forward_backward_sparsebalance(
                        forward_step_func=eval_forward_step, data_iterator=iter([b.to(device) for b in batches]),
                        model=[model], num_microbatches=len(batches), plan=pipeline, forward_only=True)
                    for batch, report in zip(batches, reports):  # reports: the last stage only
                        samples, questions = pack_scores(batch, report["per_token"].cpu(), self.retrieval)
                        my_samples += samples
                        my_questions += questions
                    coverage += pipeline.measured.coverage
        finally:
            model.train()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (my_samples, my_questions))
        samples = [s for rank_samples, _ in gathered for s in rank_samples]
        questions = [q for _, rank_questions in gathered for q in rank_questions] if self.retrieval else None
        sparse = self.cfg.sparse.sparse_attention and coverage
        return samples, questions, sum(coverage) / len(coverage) if sparse else None

    # ---- logging ----

    def _log(self, row: dict) -> None:
        if dist.get_rank() == 0 and self.log_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            it = row["iteration"]
            for key in ("loss", "ppl", "acc", "token_acc", "mean_coverage"):
                if row.get(key) is not None and math.isfinite(row[key]):
                    self.writer.add_scalar(f"eval/{key}", row[key], it)
            for group in ("acc_by_length", "acc_by_distance"):
                for label, cell in row.get(group, {}).items():
                    self.writer.add_scalar(f"eval/{group}/{label}", cell["acc"], it)
            self.writer.flush()
        if self.is_logger:
            print(validation_lines(row, self.retrieval), flush=True)
