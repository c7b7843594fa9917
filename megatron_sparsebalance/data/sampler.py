"""The global-batch sampler: which samples form each global batch, and how each is split.

Owns the data order of a run. Each epoch visits every sample once in an order drawn from
``(seed, epoch)``; consecutive runs of ``global_batch_size`` samples form the global batches
(the incomplete tail of an epoch is dropped, as Megatron does), and SAB only reorders samples
*inside* a global batch. Every rank builds the same sampler from the same lengths and seed and
so gets the same :class:`~megatron_sparsebalance.balance.sab.BatchPlan` without communication;
each rank then packs only its own micro-batches (:meth:`GlobalBatchSampler.micro_batches`).

State (saved with checkpoints): the position (epoch and samples consumed in it), the RNG (a
pure function of ``(seed, epoch)``, so the seed and epoch are all of it) and the batcher's
sparsity estimator.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import numpy as np

from megatron_sparsebalance.balance.sab import BatchPlan, SparsityAwareBatcher

if TYPE_CHECKING:  # planning needs lengths only; packing (and megatron-core) only when packing
    from megatron_sparsebalance.data.datasets import TokenDataset
    from megatron_sparsebalance.data.synthetic import PackedBatch


class GlobalBatchSampler:
    """Yields one :class:`BatchPlan` per global batch, forever (epoch after epoch).

    Args:
        lengths: every sample's (capped) length, e.g. ``dataset.lengths``.
        global_batch_size: samples per global batch (``--global-batch-size``).
        batcher: the planner of each global batch (``--batching``).
        seed: seed of the sample order (``--seed``).
        shuffle: False keeps dataset order (tests, ordered curricula).
    """

    def __init__(self, lengths: Sequence[int], global_batch_size: int, batcher: SparsityAwareBatcher,
                 seed: int = 1234, shuffle: bool = True):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be >= 1, got {global_batch_size}")
        if len(self.lengths) < global_batch_size:
            raise ValueError(
                f"the data set has {len(self.lengths)} samples, fewer than --global-batch-size {global_batch_size}")
        self.global_batch_size = int(global_batch_size)
        self.batcher = batcher
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0  # samples consumed in this epoch
        self._order: Optional[np.ndarray] = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.lengths) // self.global_batch_size

    @property
    def consumed_samples(self) -> int:
        """Samples consumed since the start of training (Megatron's ``consumed_samples``)."""
        return self.epoch * self.batches_per_epoch * self.global_batch_size + self.position

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.lengths))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))

    def next_indices(self) -> list[int]:
        """Dataset indices of the next global batch, in arrival order (advances the position)."""
        if self.position + self.global_batch_size > len(self.lengths):
            self.epoch += 1
            self.position = 0
            self._order = None
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        ids = self._order[self.position:self.position + self.global_batch_size].tolist()
        self.position += self.global_batch_size
        return ids

    def next_plan(self) -> BatchPlan:
        ids = self.next_indices()
        return self.batcher.plan(self.lengths[ids].tolist(), ids)

    def __iter__(self) -> Iterator[BatchPlan]:
        while True:
            yield self.next_plan()

    def micro_batches(self, dataset: "TokenDataset", plan: BatchPlan, dp_rank: int) -> list["PackedBatch"]:
        """This rank's packed micro-batches of ``plan``, in pipeline order."""
        from megatron_sparsebalance.data.datasets import pack_micro_batch

        if not 0 <= dp_rank < plan.dp_size:
            raise ValueError(f"dp_rank must be in [0, {plan.dp_size}), got {dp_rank}")
        return [pack_micro_batch(dataset, mb) for mb in plan.micro_batches[dp_rank]]

    def update(self, plan: BatchPlan, budgets: Sequence[Sequence[float]]) -> None:
        """DST's budgets of ``plan`` (``budgets[r][j]``), for the sparsity estimator."""
        self.batcher.update(plan, budgets)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "shuffle": self.shuffle, "global_batch_size": self.global_batch_size,
                "num_samples": len(self.lengths), "epoch": self.epoch, "position": self.position,
                "batcher": self.batcher.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        # A different seed, batch size or data set would silently change the data order of the
        # resumed run; refuse instead.
        for key, flag in (("seed", "--seed"), ("global_batch_size", "--global-batch-size"), ("num_samples", "--data-path"),
                          ("shuffle", "shuffle")):
            mine = getattr(self, key) if key != "num_samples" else len(self.lengths)
            if state[key] != mine:
                raise ValueError(f"{flag} differs from the checkpoint's ({key}: {state[key]!r} saved, {mine!r} now)")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None
        self.batcher.load_state_dict(state["batcher"])
