"""benchmarks/attention.py's markdown table, the one docs/BENCHMARKS.md shows: the ratios come
from the rows' ms, the dense rows sit beside every density of their shape and length, and a case
an implementation failed shows as '-'."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.attention import main, markdown_table


def _row(impl, density, ms, fwd_ms=None, mem=0.25, **extra):
    row = dict(impl=impl, shape="qwen2.5-3b", seq=32768, density=density, ms=ms, tflops=100.0, peak_mem_gib=mem)
    if fwd_ms is not None:
        row.update(fwd_ms=fwd_ms, bwd_ms=ms - fwd_ms)
    return dict(row, **extra)


RESULT = dict(rows=[
    _row("cudnn_dense", 1.0, 20.0, fwd_ms=5.0),
    _row("cuda", 0.25, 4.0, fwd_ms=1.0, kept_frac=0.248),
    _row("triton", 0.25, 2.0, fwd_ms=0.5, kept_frac=0.248),
    _row("flex", 0.25, 10.0, fwd_ms=3.0, mem=0.5, kept_frac=0.248),
    _row("cuda", 0.1, 1.0, fwd_ms=0.25, kept_frac=0.099),
    dict(impl="triton", shape="qwen2.5-3b", seq=32768, density=0.1, ms=None, tflops=None, peak_mem_gib=None,
         error="RuntimeError: no GPU"),
    _row("flex", 0.1, 1.5, fwd_ms=0.5, kept_frac=0.099),
])


def _line(table: str, density: str) -> list[str]:
    (line,) = [x for x in table.splitlines() if f"| {density} (" in x]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_ratios_are_recomputed_from_the_rows():
    cells = _line(markdown_table(RESULT), "0.25")
    assert cells[:3] == ["qwen2.5-3b", "32K", "0.25 (0.248)"]
    assert cells[8] == "2.50x"  # flex / cuda
    assert cells[9] == "5.00x"  # flex / the faster of ours (triton here)
    assert cells[10] == "1.00 / 3.00" and cells[12] == "3.00 / 7.00"  # fwd / bwd
    assert cells[13] == "0.2500 / 0.2500 / 0.5000"


def test_dense_rows_sit_beside_every_density_and_failures_show_as_dashes():
    table = markdown_table(RESULT)
    low, high = _line(table, "0.10"), _line(table, "0.25")
    assert low[6] == high[6] == "20.00 (100)" and low[7] == high[7] == "-"  # cuDNN measured, FA2 not
    assert low[4] == "-" and low[11] == "-"  # the failed Triton row
    assert low[8] == low[9] == "1.50x"
    assert len(table.splitlines()) == 2 + 2  # header, rule, one line per density


def test_markdown_flag_prints_the_table_of_a_file(tmp_path, capsys):
    path = tmp_path / "attention.json"
    path.write_text(json.dumps(RESULT))
    assert main(["--markdown", str(path)]) is None
    assert capsys.readouterr().out.strip() == markdown_table(RESULT)


def test_the_docs_table_is_the_committed_results_file():
    """docs/BENCHMARKS.md's attention table is what ``--markdown`` prints for the committed
    benchmarks/results/attention_h200.json: a rerun that replaces the file replaces the table."""
    root = Path(__file__).resolve().parents[1]
    with open(root / "benchmarks/results/attention_h200.json") as f:
        expected = markdown_table(json.load(f)).splitlines()
    docs = (root / "docs/BENCHMARKS.md").read_text().splitlines()
    start = docs.index(expected[0])
    assert docs[start:start + len(expected)] == expected


def test_fa4_columns_compare_fa4_direct_with_the_fastest_of_ours_fa4_backend_included():
    rows = RESULT["rows"] + [_row("flex_flash", 0.25, 3.0, fwd_ms=1.0), _row("fa4", 0.25, 2.5, fwd_ms=0.5),
                             _row("fa4_backend", 0.25, 1.25, fwd_ms=0.25)]
    table = markdown_table(dict(rows=rows))
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert len(header) == 20 and table.splitlines()[1] == "|" + "---|" * 20
    cells = _line(table, "0.25")
    assert cells[14:17] == ["3.00 (100)", "2.50 (100)", "1.25 (100)"]
    assert cells[17] == "0.62x"  # FA4 / cuda
    assert cells[18] == "2.00x"  # FA4 / fa4 through our backend, the fastest of ours here
    assert cells[9] == "8.00x"  # flex / best ours counts it too
    assert cells[19] == "0.50 / 2.00"


def test_auto_table_files_the_measured_order_under_the_gpu_and_keeps_the_others(tmp_path):
    from benchmarks.attention import update_measured_order
    from megatron_sparsebalance.ops.measured_order import MEASURED

    rows = [_row("cuda", 0.25, 4.0), _row("fa4_backend", 0.25, 2.0), _row("triton", 0.25, 3.0),
            _row("fa4", 0.25, 1.0), _row("cudnn_dense", 1.0, 20.0)]
    results = tmp_path / "attention_x.json"
    results.write_text(json.dumps(dict(gpu="NVIDIA X", rows=rows)))
    module = tmp_path / "measured_order.py"
    update_measured_order(str(results), str(module))
    scope = {}
    exec(module.read_text(), scope)
    assert scope["MEASURED"]["NVIDIA X"]["order"] == ["fa4", "triton", "cuda"]
    assert scope["MEASURED"]["NVIDIA X"]["source"].endswith("attention_x.json")
    for gpu, entry in MEASURED.items():  # the GPUs measured before are kept as they were
        assert scope["MEASURED"][gpu] == entry


def test_a_row_whose_gradients_differ_from_ours_is_flagged_before_it_is_timed():
    import torch

    from benchmarks.attention import check_failure, compare

    torch.manual_seed(0)
    ours = [torch.randn(256, 4, 32) for _ in range(4)]
    rounded = [x.to(torch.bfloat16) for x in ours]  # a correct bf16 kernel: rounding only
    assert check_failure(compare(rounded, ours), "cuda") is None
    wrong = [x.clone() for x in rounded]
    wrong[2][:128] = 0  # dk of a whole block missing (a block left out of the backward)
    message = check_failure(compare(wrong, ours), "cuda")
    assert message.startswith("differs from cuda: dk") and "dq" not in message
    nan = [x.clone() for x in rounded]
    nan[0][0, 0, 0] = float("nan")
    assert "out" in check_failure(compare(nan, ours), "cuda")


def test_implementations_take_turns_in_rotating_order_and_one_that_fails_drops_out():
    from benchmarks.attention import interleaved_rounds

    calls = []

    def timer(name, fail_in=None):
        def run(r):
            calls.append((name, r))
            if r == fail_in:
                raise RuntimeError("out of memory")
            return [10.0 * r, 10.0 * r + 1]
        return run

    samples, errors = interleaved_rounds({"cuda": timer("cuda"), "fa4": timer("fa4", fail_in=1),
                                          "flex": timer("flex")}, rounds=3)
    # each round starts one place later; fa4, failed in round 1, is left out of round 2
    assert calls == [("cuda", 0), ("fa4", 0), ("flex", 0), ("fa4", 1), ("flex", 1), ("cuda", 1),
                     ("flex", 2), ("cuda", 2)]
    assert samples == {"cuda": [0.0, 1.0, 10.0, 11.0, 20.0, 21.0], "fa4": [0.0, 1.0],
                       "flex": [0.0, 1.0, 10.0, 11.0, 20.0, 21.0]}
    assert errors == {"fa4": "RuntimeError: out of memory"}
    assert interleaved_rounds({}, rounds=3) == ({}, {})  # every implementation failed its check


def test_a_case_checks_every_implementation_before_timing_them_in_turns(monkeypatch):
    """measure_case on the CPU, with the GPU parts replaced: the reference is ours, an
    implementation that differs from it is never timed, one that fails while timed gets its error,
    and the others' figures are the medians of all their rounds."""
    import argparse

    import torch

    from benchmarks import attention as bench

    events = []
    outputs = {"cuda": 1.0, "fa4": 1.0, "flex": 5.0, "flex_flash": 1.0}  # flex computes another function

    def run_case(impl, *args):
        def forward():
            return impl
        return forward, (lambda: ("step", impl))

    def outputs_and_grads(forward):
        return [torch.full((4, 1, 2), outputs[forward()]) for _ in range(4)]

    step_ms = {"cuda": [3.0, 1.0], "fa4": [2.0, 4.0], "flex_flash": [9.0, 9.0]}

    def cuda_times(fn, iters, warmup):
        ran = fn()
        events.append(ran)
        if ran == ("step", "flex_flash"):
            raise RuntimeError("compile failed")
        return step_ms[ran[1]] if isinstance(ran, tuple) else [0.5]

    monkeypatch.setattr(bench, "run_case", run_case)
    monkeypatch.setattr(bench, "outputs_and_grads", outputs_and_grads)
    monkeypatch.setattr(bench, "cuda_times", cuda_times)
    monkeypatch.setattr(bench, "peak_extra_gib", lambda step: (0.25, 0.25))
    x = torch.zeros(256, 2, 8)
    case = bench.Case("qwen2.5-0.5b", 256, 0.5, x, x[:, :1], x[:, :1], x, None, kept_heads=4, kk=1)
    args = argparse.Namespace(iters=2, rounds=2)
    rows = bench.measure_case(["cuda", "flex", "fa4", "flex_flash"], case, args, None, "cuda", ["cuda"], {})
    assert [r["impl"] for r in rows] == ["cuda", "flex", "fa4", "flex_flash"]
    # in turns, steps before forwards, the second round starting at fa4; flex never (it failed its
    # check), flex_flash once (its step raised)
    def step(impl):
        return ("step", impl)

    assert events == [step("cuda"), "cuda", step("fa4"), "fa4", step("flex_flash"),
                      step("fa4"), "fa4", step("cuda"), "cuda"]
    cuda, flex, fa4, flash = rows
    assert cuda["ms"] == 2.0 and cuda["fwd_ms"] == 0.5 and cuda["bwd_ms"] == 1.5 and "check" not in cuda
    assert fa4["ms"] == 3.0 and fa4["check_vs"] == "cuda" and fa4["check"]["out"]["rel_l2"] == 0.0
    assert flex["ms"] is None and flex["error"].startswith("AssertionError: differs from cuda")
    assert flash["ms"] is None and flash["error"] == "RuntimeError: compile failed"
    assert cuda["tflops"] == 4 * 4 * 128 * 128 * 8 * 3.5 / 2.0 / 1e9


def test_merge_joins_runs_of_disjoint_cases_and_refuses_runs_measured_unlike(tmp_path):
    meta = dict(gpu="NVIDIA X", torch="2.11", rounds=6)
    small = dict(meta, rows=[_row("cuda", 0.1, 1.0)], router=[dict(shape="qwen2.5-3b", seq=32768, density=0.1, k=13, router_ms=0.9, router_gpu_ms=0.05,
                                   router_in_step_ms=0.02)])
    large = dict(meta, rows=[_row("cuda", 0.25, 4.0), _row("fa4", 0.25, 3.0)], router=[])
    paths = []
    for i, part in enumerate((small, large)):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(part))
    out = tmp_path / "merged.json"
    main(["--merge", *map(str, paths), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert merged["gpu"] == "NVIDIA X" and merged["rounds"] == 6
    assert [(r["impl"], r["density"]) for r in merged["rows"]] == [("cuda", 0.1), ("cuda", 0.25), ("fa4", 0.25)]
    assert merged["router"] == small["router"]

    paths[1].write_text(json.dumps(dict(large, rounds=4)))
    with pytest.raises(ValueError, match="part1.json was measured unlike .*part0.json \\(rounds differ\\)"):
        main(["--merge", *map(str, paths), "--out", str(out)])
    paths[1].write_text(json.dumps(dict(large, rows=large["rows"] + small["rows"])))
    with pytest.raises(ValueError, match="is in both .*part0.json and .*part1.json"):
        main(["--merge", *map(str, paths), "--out", str(out)])
    with pytest.raises(SystemExit):  # argparse: --merge without --out
        main(["--merge", str(paths[0])])
