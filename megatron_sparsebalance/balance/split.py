"""The pipeline split: how many transformer layers each pipeline stage holds, chosen from stage costs.

Owns ``--decoder-pipeline-split`` (``even``, ``auto``). Megatron-LM balances an uneven pipeline
with two numbers, ``--decoder-first-pipeline-num-layers`` and ``--decoder-last-pipeline-num-layers``;
the stages between share the rest evenly (``training/step.py: pipeline_layer_split`` is that
rule). The first stage also runs the embedding, the last the output layer and the loss (with a
152K vocabulary ~12 Qwen2.5-0.5B layers' worth at 64K on an H200, by its measured stage shares):
under an even split the last stage is the slowest, every micro-batch waits for it, and no DST
budget shortens it (its cost is per token).

:func:`choose_split` tries every ``(first, last)`` the rule accepts and keeps the one with the
smallest predicted largest stage time (the steady state of 1F1B runs at the pace of its slowest
stage). The costs come from :func:`stage_costs_from_model`: a latency model (profiled table or
analytic) for the layers, the analytic model's embedding and output-layer terms, or a per-token
output cost fitted on a measured run (``StageCostModel.per_token_last``). The split is fixed
for a run, so the costs are those of an expected workload (the micro-batches of a few global
batches of the run's length distribution), never of one iteration's wall clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

SPLIT_MODES = ("even", "auto")


@dataclass(frozen=True)
class LayerCosts:
    """Forward+backward ms of a workload (e.g. one global batch) for each part of the model.

    ``layer_ms``: one transformer layer; ``embedding_ms``: the embedding (first stage);
    ``output_ms``: the output layer and the loss (last stage). A stage costs
    ``layers x layer_ms`` plus what its position adds.
    """

    layer_ms: float
    embedding_ms: float = 0.0
    output_ms: float = 0.0

    def stage_ms(self, split: Sequence[int]) -> list[float]:
        """Predicted ms of each stage of ``split`` (layers per stage)."""
        times = [n * self.layer_ms for n in split]
        times[0] += self.embedding_ms
        times[-1] += self.output_ms
        return times

    def to_dict(self) -> dict:
        return {"layer_ms": self.layer_ms, "embedding_ms": self.embedding_ms, "output_ms": self.output_ms}


@dataclass(frozen=True)
class SplitChoice:
    """The chosen ``--decoder-first/last-pipeline-num-layers`` (None: that end is not fixed; a
    ``last`` of 0: the last stage holds the output layer and loss alone, a
    ``--pipeline-model-parallel-layout``)."""

    first: Optional[int]
    last: Optional[int]
    split: list
    stage_ms: list
    even_stage_ms: list

    @property
    def max_ms(self) -> float:
        return max(self.stage_ms)

    @property
    def even_max_ms(self) -> float:
        return max(self.even_stage_ms)

    @property
    def layout(self) -> Optional[str]:
        """The ``--pipeline-model-parallel-layout`` of a last stage holding the output layer and
        loss alone, which only a layout says; None for a split the two end-stage flags say."""
        if self.last != 0:
            return None
        from megatron_sparsebalance.training.step import layout_of_split

        return layout_of_split(self.split)

    def flags(self) -> list[str]:
        if self.layout is not None:
            return ["--pipeline-model-parallel-layout", self.layout]
        out = []
        if self.first is not None:
            out += ["--decoder-first-pipeline-num-layers", str(self.first)]
        if self.last is not None:
            out += ["--decoder-last-pipeline-num-layers", str(self.last)]
        return out

    def to_dict(self) -> dict:
        return {"first": self.first, "last": self.last, "split": self.split, "stage_ms": self.stage_ms,
                "max_ms": self.max_ms, "even_stage_ms": self.even_stage_ms, "even_max_ms": self.even_max_ms}


def candidate_splits(num_layers: int, pp: int) -> list[tuple]:
    """Every ``(first, last, split)`` Megatron-LM's rule accepts for ``num_layers`` over ``pp``
    stages, the even split (None, None) first when it exists; then those whose last stage holds
    the output layer and loss alone (``last`` 0; the other stages as the rule splits the layers
    over ``pp - 1`` stages), which a ``--pipeline-model-parallel-layout`` expresses."""
    from megatron_sparsebalance.training.step import pipeline_layer_split

    out = []
    ends = [None] + list(range(1, num_layers + 1)) if pp >= 2 else [None]
    for first in ends:
        for last in ends:
            try:
                out.append((first, last, pipeline_layer_split(num_layers, pp, first, last)))
            except ValueError:
                continue
    if pp >= 2:
        for first in ends if pp >= 3 else [None]:  # one stage before the last has no "first" to fix
            try:
                head = pipeline_layer_split(num_layers, pp - 1, first)
            except ValueError:
                continue
            out.append((first, 0, head + [0]))
    return out


def choose_split(num_layers: int, pp: int, costs: LayerCosts) -> SplitChoice:
    """The ``(first, last)`` whose largest predicted stage time is smallest.

    Ties (within 1e-9 relative) go to the split that fixes fewer ends, then to the smaller
    change from the even share, so an even split is kept when nothing beats it. Raises a
    ValueError when no split exists (``num_layers < pp``).
    """
    cands = candidate_splits(num_layers, pp)
    if not cands:
        raise ValueError(f"--num-layers {num_layers} cannot be split over --pipeline-model-parallel-size {pp}")
    even = next((c for c in cands if c[0] is None and c[1] is None), None)
    mean = num_layers / pp

    def key(c):
        first, last, split = c
        fixed = (first is not None) + (last is not None)
        return (max(costs.stage_ms(split)), fixed, sum(abs(n - mean) for n in split))

    best = min(cands, key=key)
    best_max = key(best)[0]
    # Fewer fixed ends among the near-ties (a float tie must not pick a needless flag).
    best = min((c for c in cands if key(c)[0] <= best_max * (1 + 1e-9)), key=lambda c: key(c)[1:])
    even_ms = costs.stage_ms(even[2]) if even is not None else [float("nan")] * pp
    return SplitChoice(best[0], best[1], list(best[2]), costs.stage_ms(best[2]), even_ms)


def stage_costs_from_model(shape, micro_batches: Sequence[Sequence[int]], k: int, latency=None,
                           layers_of_table: Optional[int] = None, output_ms_per_token: Optional[float] = None,
                           block_size: int = 128, hardware="h200", tensor_parallel_size: int = 1,
                           fused_cross_entropy: bool = False) -> LayerCosts:
    """The :class:`LayerCosts` of running ``micro_batches`` (their packed lengths) at budget ``k``.

    ``latency``: a latency model of one stage of ``layers_of_table`` transformer layers (a
    profiled table's ``layers_per_stage``); its prediction per layer is the layer cost. Without
    it, the analytic model of one layer. The embedding and the output layer (+ loss) are the
    analytic model's terms (difference between a stage with and without ``pre_process`` /
    ``post_process``) on the latency model's hardware (:func:`hardware_of_table`; ``hardware``
    where it names none), in ms as the table's; ``output_ms_per_token`` (fitted on a measured run, in the
    table's units) replaces the analytic output term; ``fused_cross_entropy``: the run's loss is
    megatron-core's fused cross entropy (``--cross-entropy-loss-fusion``), a cheaper output term.
    Priced uncalibrated: the split must not depend on how fast the last steps ran.
    """
    from megatron_sparsebalance.balance.latency import AnalyticLatencyModel

    hardware = hardware_of_table(latency, hardware)

    def analytic(pre=False, post=False):
        return AnalyticLatencyModel(shape, 1, block_size=block_size, hardware=hardware, pre_process=pre,
                                    post_process=post, tensor_parallel_size=tensor_parallel_size,
                                    fused_cross_entropy=fused_cross_entropy)

    one, first, last = analytic(), analytic(pre=True), analytic(post=True)
    a_layer = sum(one.predict(mb, k) for mb in micro_batches)
    a_embed = sum(first.predict(mb, k) - one.predict(mb, k) for mb in micro_batches)
    a_output = sum(last.predict(mb, k) - one.predict(mb, k) for mb in micro_batches)
    if latency is None:
        layer = a_layer
    else:
        model = latency.uncalibrated() if hasattr(latency, "uncalibrated") else latency
        per = layers_of_table or getattr(latency, "layers_per_stage", None) or (latency.metadata or {}).get("layers_per_stage")
        if not per:
            raise ValueError("the latency table records no layers_per_stage: give layers_of_table")
        layer = sum(model.predict(mb, k) for mb in micro_batches) / per
    # The embedding and output terms stay the analytic model's own, not scaled by the table's layer
    # cost over the analytic one: that ratio is the attention kernels' speed (0.85 for the CUDA
    # kernels' 4xH200 table), which the output GEMM and the memory-bound cross entropy do not share.
    # Measured on 4xH200 (0.5B, 64K, PP=4): the output layer and loss cost 3.75-3.80 us per token
    # (the runs' fitted stage costs), the analytic term 3.9; scaled, 3.3 put the output-only stage
    # at 9.6 layers' worth against the 11-12 its busy time measured.
    output = a_output if output_ms_per_token is None else output_ms_per_token * sum(map(sum, micro_batches))
    return LayerCosts(layer, a_embed, output)


def hardware_of_table(latency, default="h200"):
    """The analytic model's hardware for terms priced beside ``latency``: a table's device (from its
    metadata) where that is an H100, an H200 or a CPU, else an analytic model's own hardware, else
    ``default``."""
    device = str(((getattr(latency, "metadata", None) or {}).get("gpu")) or "").lower()
    if device == "cpu":
        return "cpu"
    return next((key for key in ("h100", "h200") if key in device), None) or getattr(latency, "hardware", None) or default


@dataclass
class SplitConfig:
    """The pipeline-split flag (its own group: it decides the two Megatron-LM flags above)."""

    decoder_pipeline_split: str = "even"
    """even: --decoder-first/last-pipeline-num-layers (or --pipeline-model-parallel-layout) as given
    (none: an even split); auto: chosen at start-up from the latency model's per-layer cost and the
    analytic embedding and output-layer costs over the run's first global batches, the split with
    the smallest predicted largest stage time, a last stage of the output layer alone among them
    (balance/split.py; tools/plan_pipeline_split.py prints the same choice)."""

    def validate(self, first: Optional[int] = None, last: Optional[int] = None,
                 layout: Optional[str] = None) -> "SplitConfig":
        if self.decoder_pipeline_split not in SPLIT_MODES:
            raise ValueError(f"--decoder-pipeline-split must be one of {SPLIT_MODES}, got {self.decoder_pipeline_split!r}")
        if self.decoder_pipeline_split == "auto" and (first is not None or last is not None or layout is not None):
            raise ValueError("--decoder-pipeline-split auto chooses --decoder-first/last-pipeline-num-layers itself "
                             "(or a --pipeline-model-parallel-layout): give one or the other")
        return self


def run_split(shape, pp: int, micro_batch_size: int, global_batch_size: int, lengths: Sequence[int], k: int,
              latency, block_size: int, global_batches: int = 8, fused_cross_entropy: bool = False) -> SplitChoice:
    """The ``auto`` split of a run: its first ``global_batches`` global batches of ``lengths`` (the
    data set's, in order; deterministic, so every rank chooses the same) cut into micro-batches
    of ``micro_batch_size`` samples, priced by :func:`stage_costs_from_model`."""
    sample = [int(n) for n in list(lengths)[:global_batches * global_batch_size]]
    mbs = [sample[i:i + micro_batch_size] for i in range(0, len(sample), micro_batch_size)]
    return choose_split(shape.num_layers, pp, stage_costs_from_model(shape, mbs, k, latency, block_size=block_size,
                                                                     fused_cross_entropy=fused_cross_entropy))


def stage_cost_model(shape, split: Sequence[int], k: int, latency, block_size: int, probe_tokens: int,
                     fused_cross_entropy: bool = False):
    """Per-stage costs of ``split`` for DST's ``critical-path`` growth and the simulator: each
    stage its layers' share of the latency model's one-stage prediction (the model is of
    ``num_layers // pp`` layers) plus, on the last stage, the output layer and loss per token (the
    analytic term at a ``probe_tokens`` micro-batch, in the latency model's units)."""
    from megatron_sparsebalance.pipeline.simulate import StageCostModel, layer_fractions

    costs = stage_costs_from_model(shape, [[int(probe_tokens)]], k, latency,
                                   layers_of_table=shape.num_layers // len(split), block_size=block_size,
                                   fused_cross_entropy=fused_cross_entropy)
    return StageCostModel(layer_fractions(list(split), len(split)), 1.0, costs.output_ms / probe_tokens)
