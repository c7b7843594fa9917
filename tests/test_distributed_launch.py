"""tests/distributed.py's launcher: what a rank takes from the test that launches it (environment,
working directory, output) and how a launch fails (a rank's error, a hang)."""
import os
import sys
import time

import pytest
import torch.distributed as dist

from tests.distributed import run_workers


def report_environment(var, path):
    rank = dist.get_rank()
    with open(f"{path}.rank{rank}", "w") as f:
        f.write(f"{os.environ.get(var)}\n{os.getcwd()}\n{dist.get_world_size()}")
    print(f"rank {rank} on stdout")
    print(f"rank {rank} on stderr", file=sys.stderr)


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one's own error")
    dist.barrier()  # rank 0 waits for a rank that is gone: the launch must still end


def sleep_forever():
    time.sleep(3600)


def test_ranks_take_the_environment_directory_and_output_of_the_test(tmp_path, monkeypatch, capfd):
    run_workers(report_environment, world=1, args=("MSB_LAUNCH_PROBE", str(tmp_path / "before")))  # the server runs
    monkeypatch.setenv("MSB_LAUNCH_PROBE", "set after the first launch")
    monkeypatch.chdir(tmp_path)
    run_workers(report_environment, world=2, args=("MSB_LAUNCH_PROBE", str(tmp_path / "seen")))
    for rank in range(2):
        var, cwd, world = open(tmp_path / f"seen.rank{rank}").read().split("\n")
        assert (var, cwd, world) == ("set after the first launch", str(tmp_path), "2")
    out, err = capfd.readouterr()
    assert "rank 0 on stdout" in out and "rank 1 on stdout" in out
    assert "rank 0 on stderr" in err and "rank 1 on stderr" in err


def test_a_rank_error_fails_the_launch_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1:(.|\n)*rank one's own error"):
        run_workers(fail_on_rank_one, world=2, timeout_s=60)


def test_a_hang_fails_the_launch_at_its_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] still running after 5 s: deadlock"):
        run_workers(sleep_forever, world=2, timeout_s=5)
    assert time.monotonic() - start < 60
