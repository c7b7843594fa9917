"""benchmarks/sustained.py end to end on a short run: its kernels add up to its steps."""
import json
import shutil

import pytest
import torch

from megatron_sparsebalance.ops import native

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
                    reason="needs a CUDA device and nvidia-smi")
def test_short_sustained_run_accounts_for_its_steps(tmp_path):
    from benchmarks.sustained import main

    if not native.cuda_kernels_run_on(torch.device("cuda")):
        pytest.skip("the CUDA extension is not built for this GPU")
    out = tmp_path / "sustained.json"
    main(["--impls", "cuda", "--shape", "qwen2.5-0.5b", "--seq", "16384", "--density", "0.25", "--steps", "200",
          "--burst", "5", "--pause-s", "0.5", "--sample-ms", "10", "--out", str(out)])
    row = json.loads(out.read_text())["impls"]["cuda"]
    assert len(row["window_ms"]) == 20
    for phase, step_ms in (("burst", row["burst_step_ms"]), ("sustained", row["sustained_step_ms"])):
        kernels = row["kernels_ms"][phase]
        assert any("fwd_kernel" in name for name in kernels) and any("dkdv_kernel" in name for name in kernels)
        # the kernels of a step run one after another between its two events
        assert 0.3 * step_ms < sum(kernels.values()) <= 1.02 * step_ms
    assert 100 < row["smi"]["sm_clock_mhz"] < 5000 and row["smi"]["samples"] >= 1
