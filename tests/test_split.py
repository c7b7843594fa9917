"""The automatic pipeline split (balance/split.py) on cases worked by hand."""
import pytest

from megatron_sparsebalance.balance.split import LayerCosts, SplitConfig, choose_split, stage_costs_from_model
from megatron_sparsebalance.training.model import MODEL_PRESETS
from megatron_sparsebalance.training.step import pipeline_layer_split


def test_output_layer_worth_five_layers_moves_three_layers_off_the_last_stage():
    # 24 layers of 1 ms, output layer 5 ms, PP=4. Even 6/6/6/6: the last stage 11 ms. Total 29 ms,
    # so no stage can be under 7.25; with the last stage at <= 2 layers (<= 7 ms) the other three
    # would need 22 layers in <= 7 each: impossible, so 8 ms is the optimum. --decoder-last 3
    # gives 7/7/7/3 = 7, 7, 7, 8 with one flag (6/8/8/2 also reaches 8, with two).
    choice = choose_split(24, 4, LayerCosts(layer_ms=1.0, output_ms=5.0))
    assert (choice.first, choice.last) == (None, 3)
    assert choice.split == [7, 7, 7, 3] == pipeline_layer_split(24, 4, None, 3)
    assert choice.stage_ms == [7.0, 7.0, 7.0, 8.0]
    assert choice.even_max_ms == 11.0 and choice.max_ms < choice.even_max_ms
    assert choice.flags() == ["--decoder-last-pipeline-num-layers", "3"]


def test_both_ends_when_one_flag_cannot_split_evenly():
    # 8 layers, output 3, PP=4. A last stage with a layer costs >= 1 + 3 = 4 (3/2/2/1 and 1/3/3/1
    # reach it). The output layer alone on the last stage leaves 8 layers for 3 stages, not even
    # without fixing the first: 2/3/3/0 reaches max(2, 3, 3, 3) = 3, the optimum, and only a
    # layout can say it.
    choice = choose_split(8, 4, LayerCosts(layer_ms=1.0, output_ms=3.0))
    assert (choice.first, choice.last, choice.split) == (2, 0, [2, 3, 3, 0])
    assert max(choice.stage_ms) == 3.0 and choice.even_max_ms == 5.0
    assert choice.flags() == ["--pipeline-model-parallel-layout", "Et*2|t*3|t*3|L"] == ["--pipeline-model-parallel-layout", choice.layout]


def test_an_output_layer_lighter_than_a_stage_keeps_a_layer_on_the_last_stage():
    # 8 layers, output 1.5, PP=4: even 2/2/2/2 costs 3.5 on the last stage. 3/2/2/1, 1/3/3/1 and
    # 2/3/3/0 (the output layer alone) all reach 3, each fixing two ends; the tie goes to the split
    # nearest the even share, 3/2/2/1 (1 + 0 + 0 + 1 = 2 layers off it, against 4 for the others).
    choice = choose_split(8, 4, LayerCosts(layer_ms=1.0, output_ms=1.5))
    assert (choice.first, choice.last, choice.split) == (3, 1, [3, 2, 2, 1])
    assert max(choice.stage_ms) == 3.0 and choice.even_max_ms == 3.5


def test_an_output_layer_alone_ties_broken_by_fewer_fixed_ends():
    # 9 layers, output 3, PP=4: 3/3/3/0 both as (None, 0) and as (3, 0); the flag-free first wins.
    choice = choose_split(9, 4, LayerCosts(layer_ms=1.0, output_ms=3.0))
    assert (choice.first, choice.last, choice.split) == (None, 0, [3, 3, 3, 0]) and choice.max_ms == 3.0


def test_balanced_costs_keep_the_even_split():
    choice = choose_split(24, 4, LayerCosts(layer_ms=1.0, embedding_ms=0.1, output_ms=0.1))
    assert (choice.first, choice.last, choice.split) == (None, None, [6, 6, 6, 6])
    assert choice.flags() == []


def test_costs_from_the_analytic_model_put_fewer_layers_on_the_last_stage():
    shape = MODEL_PRESETS["qwen2.5-0.5b"]
    costs = stage_costs_from_model(shape, [[16384, 2048], [65536]], 32)
    assert costs.output_ms > 2 * costs.layer_ms > 0 and costs.embedding_ms < costs.layer_ms
    choice = choose_split(24, 4, costs)
    assert choice.split[-1] < 6 and choice.max_ms < choice.even_max_ms


def test_a_table_prices_the_layers_and_leaves_the_output_term_its_own():
    """A table whose layers run at half the analytic model's cost (faster attention kernels) halves
    the layer cost and leaves the output layer's term as the analytic model prices it on the
    table's GPU: the kernels' speed is not the output GEMM's or the cross entropy's (measured on
    4xH200, balance/split.py). The output-only last stage then weighs more against the layers."""
    from megatron_sparsebalance.balance.latency import AnalyticLatencyModel

    shape = MODEL_PRESETS["qwen2.5-0.5b"]
    mbs = [[65536], [32768, 32768]]

    class HalfCostTable:
        metadata = {"layers_per_stage": 6, "gpu": "NVIDIA H100 80GB HBM3"}

        def predict(self, lengths, k):
            return 0.5 * 6 * AnalyticLatencyModel(shape, 1, hardware="h100").predict(lengths, k)

    analytic = stage_costs_from_model(shape, mbs, 32, hardware="h100")
    table = stage_costs_from_model(shape, mbs, 32, HalfCostTable())  # its GPU read from the metadata
    assert table.layer_ms == pytest.approx(0.5 * analytic.layer_ms)
    assert table.output_ms == pytest.approx(analytic.output_ms) and table.embedding_ms == pytest.approx(analytic.embedding_ms)
    assert table.output_ms != pytest.approx(stage_costs_from_model(shape, mbs, 32, hardware="h200").output_ms)
    choice = choose_split(24, 4, table)
    assert choice.split == [8, 8, 8, 0] and choice.stage_ms[-1] == pytest.approx(table.output_ms)
    # the balance figure: the chosen split's predicted imbalance (largest stage over the mean) is
    # below the even split's, where the output layer rides on six layers
    imbalance = lambda ms: max(ms) / (sum(ms) / len(ms))  # noqa: E731
    assert imbalance(choice.stage_ms) < imbalance(choice.even_stage_ms)


def test_auto_refuses_a_hand_split():
    with pytest.raises(ValueError, match="--decoder-pipeline-split auto"):
        SplitConfig("auto").validate(None, 2)
    with pytest.raises(ValueError, match="--decoder-pipeline-split auto"):
        SplitConfig("auto").validate(layout="Et*8|t*8|t*8|L")
    with pytest.raises(ValueError, match="--decoder-pipeline-split must be one of"):
        SplitConfig("uneven").validate()
    SplitConfig("even").validate(7, 1)  # even: the hand split stands
    choice = choose_split(24, 4, LayerCosts(1.0, output_ms=5.0))
    assert (choice.first, choice.last, choice.layout) == (None, 3, None)
