"""The round-to-round summary of benchmarks/host_overhead.py (how steady one pack's time is)."""
from __future__ import annotations

import pytest

from benchmarks.host_overhead import is_host_bound, relative_spread, summarize_rounds


def test_relative_spread_is_every_ordered_pair():
    assert sorted(relative_spread([1.0, 2.0, 4.0])) == pytest.approx(sorted([1.0, 3.0, 0.5, 1.0, 0.75, 0.5]))


def test_packs_are_split_by_where_the_step_waits():
    host_bound = {"wall_ms": 40.0, "host_ms": 39.5, "round_wall_ms": [30.0, 40.0, 36.0]}
    gpu_bound = {"wall_ms": 86.0, "host_ms": 44.0, "round_wall_ms": [86.0, 86.0, 86.86]}
    assert is_host_bound(host_bound) and not is_host_bound(gpu_bound)
    summary = summarize_rounds([host_bound, gpu_bound])
    assert summary["host_bound"]["packs"] == 1 and summary["gpu_bound"]["packs"] == 1
    # 30 vs 40 ms in two rounds of one pack: a third apart one way, a quarter the other
    assert summary["host_bound"]["p90_rel_diff"] == pytest.approx(1 / 3)
    assert summary["gpu_bound"]["median_rel_diff"] < 0.01
    # a stricter host fraction moves the first pack to the GPU-bound side
    assert "host_bound" not in summarize_rounds([host_bound, gpu_bound], host_fraction=0.999)
