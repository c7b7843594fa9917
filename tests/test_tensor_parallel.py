"""Tensor and sequence parallelism over real gloo processes (bodies in tests/tp_cases.py).

One TP=1 unpipelined reference, then two launches: TP=2 (world 2, with and without sequence
parallelism) and world 4 (TP=2 x PP=2 with SP: equality, stop + resume bitwise, checkpoint to
TP=1 x PP=4 and back; then TP=4, where megatron-core replicates each KV group on two ranks).
Every TP run uses DST with the coverage bound and checks that all TP ranks of a stage used the
same budget in every layer, and the same as the TP=1 run.
"""
import json

import pytest

from megatron_sparsebalance.balance.latency import ProfiledLatencyModel

from tests import tp_cases
from tests.distributed import run_workers


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp"))
    run_workers(tp_cases.reference, world=1, args=(root, 7))
    return root


def test_tp2_with_and_without_sequence_parallel_equals_tp1_and_profiles_a_tp_stage(reference, tmp_path):
    table = str(tmp_path / "tp2_sp.json")
    run_workers(tp_cases.equality_cases, world=2, tp=2, args=(reference, 7, table))
    meta = json.load(open(table))["metadata"]
    assert meta["parallel_layout"] == {"tp": 2, "pp": 1, "cp": 1, "sequence_parallel": True}
    run = dict(meta, parallel_layout={"tp": 2, "pp": 1, "cp": 1, "sequence_parallel": True})
    ProfiledLatencyModel.load(table, expect=run)
    for other in ({"tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False},
                  {"tp": 2, "pp": 1, "cp": 1, "sequence_parallel": False}):
        with pytest.raises(ValueError, match="parallel_layout"):
            ProfiledLatencyModel.load(table, expect=dict(meta, parallel_layout=other))


def test_tp2_pp2_trains_resumes_bitwise_and_reshards_to_tp1_pp4_and_back_then_tp4(reference):
    run_workers(tp_cases.world4_cases, world=4, tp=2, pp=2, args=(reference, 7), timeout_s=400)
