"""How the sparse attention of one tensor-parallel rank agrees with the other ranks of its group.

Under tensor parallelism a rank holds ``num_attention_heads / TP`` query heads of every layer and
``num_query_groups / TP`` KV groups, or, where ``num_query_groups < TP``, one KV group that
megatron-core replicates on ``TP / num_query_groups`` ranks, each holding a slice of its query
heads (megatron-core then hands the core attention a config whose ``num_query_groups`` is TP).

The router must not see the difference:

- **Selection per KV group.** A group's selection comes from the mean of all its query heads;
  a rank holding a slice of them pools its slice, and the ranks of the group sum their pooled
  queries (an all-reduce over the TP group, each rank writing its group's slot) so every replica
  selects the same blocks as TP=1 does.
- **One coverage-bounded budget per layer.** The coverage curve is a mean over (group, query
  block) rows; each rank computes it over its own groups and the curves are all-reduced (mean)
  over the TP group before the bound chooses. Every rank then chooses the same budget from the
  same curve, the one a TP=1 run computes (up to float summation order).

Why reduce the curve rather than choose on one rank and broadcast: a broadcast makes every rank
wait for the chosen rank's router and gives a budget from a subset of the heads (not the TP=1
budget); the reduce costs the same single collective of ``K`` floats, keeps the choice a function
of all heads, and, being a device-side collective (NCCL on GPUs), keeps the host free: nothing is
read back. Ranks of one TP group see the same micro-batch and the same DST request (the plan is a
function of inputs every rank holds), so only the layers' own choice needed agreeing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_sparsebalance.ops.sparse_attention import RouteSync


def tensor_parallel_route_sync(tp_group, local_config_groups: int, model_query_groups: Optional[int]) -> Optional[RouteSync]:
    """The router hooks of one rank of ``tp_group`` (None at TP=1).

    Args:
        local_config_groups: ``num_query_groups`` of the config the core attention was handed
            (megatron-core's replicated config says TP where the model has fewer groups).
        model_query_groups: the model's ``--num-query-groups``. Required when the handed config
            says exactly TP groups, the one case where it cannot tell replicated groups from real ones.
    """
    tp = tp_group.size() if tp_group is not None else 1
    if tp == 1:
        return None
    if model_query_groups is None:
        if local_config_groups == tp:
            raise ValueError(
                f"SparseCoreAttention at tensor parallel size {tp} with {local_config_groups} query groups cannot "
                "tell whether megatron-core replicated fewer groups: build the layer spec with "
                "get_gpt_layer_spec(..., num_query_groups=<the model's --num-query-groups>)")
        model_query_groups = local_config_groups
    if model_query_groups < tp and tp % model_query_groups:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) must be a multiple of --num-query-groups "
                         f"({model_query_groups}) when it is larger")
    rank = tp_group.rank()
    pooled = None
    if model_query_groups < tp:
        pooled = _ReplicatedGroupQueries(tp_group, model_query_groups, tp // model_query_groups, rank)
    return RouteSync(pooled_query=pooled, curve=_MeanOverGroup(tp_group, tp))


class _MeanOverGroup:
    """``x`` averaged over the ranks of the TP group (each holds the same number of groups)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        total = x.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total / self.size


class _ReplicatedGroupQueries:
    """Pooled queries of this rank's KV group over all its query heads, split over ``replicas`` ranks."""

    def __init__(self, group, num_groups: int, replicas: int, rank: int):
        self.group, self.num_groups, self.replicas = group, num_groups, replicas
        self.slot = rank // replicas  # megatron-core's rank -> KV group (attention.py, get_query_key_value_tensors)

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        # pooled: [NB, 1, D], the mean of this rank's (equally many) query heads of the group
        slots = pooled.new_zeros(pooled.shape[0], self.num_groups, pooled.shape[2])
        slots[:, self.slot] = pooled[:, 0]
        dist.all_reduce(slots, group=self.group)
        return slots[:, self.slot:self.slot + 1] / self.replicas
