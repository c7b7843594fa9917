"""A variable number of micro-batches per replica and iteration (--variable-micro-batches) trains
with exactly the loss and weights of a fixed number, under per-token normalization."""
from tests import balance_cases
from tests.distributed import run_workers


def test_variable_count_trains_like_a_fixed_count_dp2_pp2():
    run_workers(balance_cases.variable_equals_fixed, world=4, pp=2)
