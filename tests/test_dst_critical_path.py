"""--dst-growth critical-path on cases worked by hand: per-stage costs, shrinks kept only where they
shorten the simulated iteration, growth only into each stage's idle time."""
import pytest

from megatron_sparsebalance.balance.dst import DSTConfig, PipelineShape, plan_budgets
from megatron_sparsebalance.pipeline.simulate import StageCostModel


class LinearModel:
    """ms = tokens x k / 32 on one stage: 100 tokens cost 100 ms at k = 32."""

    candidates = (8, 16, 20, 24, 32, 48, 64)
    k_min = 8

    def predict(self, lengths, k):
        return sum(lengths) * k / 32.0

    def align(self, lengths, target):
        fit = [c for c in self.candidates if self.predict(lengths, c) <= target]
        return max(fit) if fit else self.k_min


# PP=2: stage 0 runs the layers (the prediction), stage 1 only the output layer, 3 ms per token,
# which no budget changes: micro-batches of 100 / 100 / 300 tokens cost 300 / 300 / 900 ms there.
STAGES = StageCostModel([1.0, 0.0], 1.0, 3.0)


def plan(lengths, growth):
    return plan_budgets(lengths, LinearModel(), DSTConfig(anchor="mean", p=None, k_base=32, growth=growth),
                        PipelineShape(2, None, stage_costs=STAGES))


def test_a_shrink_the_critical_stage_hides_is_given_back():
    # 100 / 300 / 100 tokens, mean anchor 166.7 ms: DST asks 48 / 16 / 48. In 1F1B over these
    # costs (stage 0: F0 F1 B0 F2 B1 B2; stage 1: F0 B0 F1 B1 F2 B2) stage 1 runs 33.3 .. 1533.3
    # without a gap; the straggler's stage-0 forward (ends 33.3 + t/3) and backward (starts at
    # 1233.3, must end by 1533.3) hide in stage 0's idle time for any t <= 450 ms, so its shrink
    # shortens nothing: it keeps 32. The first micro-batch's forward starts the pipeline and the
    # last one's stage-0 backward ends it: neither can grow. Iteration 1600 ms at k = 32.
    cp = plan([[100], [300], [100]], "critical-path")
    assert cp.budgets == [32, 32, 32]
    assert cp.iteration_ms == pytest.approx(1600.0)
    # bubble prices every stage alike (stage 1 as cheap as stage 0) and keeps the shrink.
    assert plan([[100], [300], [100]], "bubble").budgets[1] == 16


def test_a_shrink_on_the_critical_path_stays_and_a_hidden_micro_batch_grows():
    # 100 / 100 / 300 tokens: the straggler is last, its stage-0 backward (2t/3) ends the
    # iteration, so its shrink to 16 (t = 150) is kept: 1533.3 + 100 = 1633.3 against 1733.3 at
    # k = 32. The middle micro-batch's stage-0 work hides (its backward runs 633.3 .. 633.3 + 2t/3,
    # idle until 1533.3), so it grows to the budget DST asked, 48; the first cannot.
    cp = plan([[100], [100], [300]], "critical-path")
    assert cp.budgets == [32, 48, 16]
    assert cp.iteration_ms == pytest.approx(1633.0 + 1 / 3)
    fixed = PipelineShape(2, None, stage_costs=STAGES).iteration_ms([100.0, 100.0, 300.0], [[100], [100], [300]])
    assert fixed == pytest.approx(1733.0 + 1 / 3)


def test_critical_path_is_a_growth_rule():
    with pytest.raises(ValueError, match="--dst-growth must be one of"):
        DSTConfig(growth="critical").validate()
    DSTConfig(growth="critical-path").validate()
