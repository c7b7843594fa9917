"""The claim, measured on CPU: with a budget-sensitive attention path and a latency table profiled
on this machine, DST with the mean anchor lowers the imbalance of a long-tailed global batch over
PP=4 real processes, against the fixed budget (--dst-anchor none)."""
import json

import pytest

from tests import pipeline_cases
from tests.distributed import run_workers


@pytest.mark.alone  # the table and the imbalance are timings of this machine: no other test beside them
def test_dst_mean_lowers_measured_imbalance(tmp_path):
    table, out = str(tmp_path / "table.json"), str(tmp_path / "claim.json")
    run_workers(pipeline_cases.profile_cpu_stage, world=1, args=(table,))
    run_workers(pipeline_cases.dst_claim, world=4, pp=4, args=(table, out), timeout_s=300)
    res = json.load(open(out))
    assert res["none"][0]["budgets"] == [pipeline_cases.CLAIM_K_BASE] * 4
    straggler_budget = res["mean"][0]["budgets"][0]
    assert straggler_budget < pipeline_cases.CLAIM_K_BASE  # the straggler shrinks
    assert max(res["mean"][0]["budgets"][1:]) >= pipeline_cases.CLAIM_K_BASE  # others do not
    none = min(r["imbalance"] for r in res["none"])
    mean = max(r["imbalance"] for r in res["mean"])
    print(f"imbalance: fixed budget {none:.2f}, DST mean {mean:.2f}; budgets {res['mean'][0]['budgets']}")
    assert mean < 0.85 * none, res
