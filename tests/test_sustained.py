"""The sample parsing and per-step kernel accounting of benchmarks/sustained.py."""
from __future__ import annotations

import pytest

from benchmarks.sustained import kernels_per_step, parse_smi_line, short_kernel_name, summarize_samples


def test_smi_lines_parse_and_reject():
    sample = parse_smi_line("1650, 693.39, Active, Not Active, Not Active\n")
    assert sample == dict(sm_clock_mhz=1650.0, power_w=693.39, power_capped=True, thermal=False)
    assert parse_smi_line("1980, 135.72, Not Active, Not Active, Active")["thermal"]
    assert parse_smi_line("1980, [N/A], Active, Not Active, Not Active") is None  # no reading
    assert parse_smi_line("clocks.sm [MHz], power.draw [W]") is None  # a header


def test_samples_summarize_to_medians_and_fractions():
    samples = [parse_smi_line(line) for line in ("1980, 200, Not Active, Not Active, Not Active",
                                                 "1650, 690, Active, Not Active, Not Active",
                                                 "1635, 695, Active, Not Active, Not Active")]
    summary = summarize_samples(samples)
    assert summary["sm_clock_mhz"] == 1650 and summary["power_w"] == 690
    assert summary["power_capped"] == pytest.approx(2 / 3) and summary["thermal"] == 0
    assert summarize_samples([]) == {}


def test_kernel_names_are_shortened():
    assert (short_kernel_name("void sparsebalance::kernels::sm90::dkdv_kernel<__nv_bfloat16, 128>(sparsebalance::P)")
            == "sm90::dkdv_kernel<__nv_bfloat16, 128>")
    assert short_kernel_name("sparsebalance::(anonymous namespace)::fill_kernel(int const*)") == "fill_kernel"
    assert short_kernel_name("triton_tem_fused_0") == "triton_tem_fused_0"


def test_kernels_are_split_into_steps_by_start_time():
    # two steps of (fwd, bwd); the profiler's order is not the launch order
    kernels = [(30.0, 4000.0, "void bwd(int)"), (0.0, 1000.0, "void fwd(int)"),
               (40.0, 1200.0, "void fwd(int)"), (50.0, 6000.0, "void bwd(int)")]
    assert kernels_per_step(kernels, 2, range(0, 1)) == {"bwd": 4.0, "fwd": 1.0}
    assert kernels_per_step(kernels, 2, range(1, 2)) == {"bwd": 6.0, "fwd": 1.2}
    assert kernels_per_step(kernels, 2, range(2)) == pytest.approx({"bwd": 5.0, "fwd": 1.1})
    with pytest.raises(ValueError, match="do not split into 3"):
        kernels_per_step(kernels, 3, range(1))


@pytest.mark.parametrize("argv, flag", [(["--impls", "cuda,sdpa"], "--impls"), (["--seq", "1000"], "--seq"),
                                        (["--density", "1.5"], "--density"), (["--burst", "200"], "--burst"),
                                        (["--gemm-rows", "1000"], "--gemm-rows")])
def test_bad_flags_are_refused_by_name_before_any_gpu_work(argv, flag, capsys):
    from benchmarks.sustained import main

    with pytest.raises(SystemExit):
        main(argv)
    assert flag in capsys.readouterr().err


def test_the_ceiling_gemm_does_the_attention_steps_matrix_work():
    from benchmarks.attention import BLOCK
    from benchmarks.sustained import GEMM_ROWS, executed_tflop, gemm_inner_dim

    # 3B at 64K, 25%: about 528 K kept (query head, KV block) tiles of head dim 128, ~19.9 TFLOP
    want = executed_tflop(528_000, 128)
    assert want == pytest.approx(528_000 * 9 * 2 * BLOCK * BLOCK * 128 / 1e12)
    k = gemm_inner_dim(want)
    assert k % 64 == 0
    got = 2 * GEMM_ROWS * GEMM_ROWS * k / 1e12
    assert abs(got - want) <= 2 * GEMM_ROWS * GEMM_ROWS * 32 / 1e12  # within half a K step
    assert gemm_inner_dim(1e-9) == 64  # never an empty GEMM
