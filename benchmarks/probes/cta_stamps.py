"""Probe: where a Hopper forward CTA's time goes, from clock64 stamps in the kernel (docs/FA4.md,
"Where a forward CTA's time goes", has the figures).

`benchmarks/probes/cta_stamps.patch` makes every forward CTA that runs on SM 0 or 1 print its
stamps once it is done, in cycles from the kernel's entry: the producer's after it issued the query
tile's copies (pq) and the first three chunks' (pc0-pc2); the first consumer's when its queries
had landed (q), when the first chunk had (first), after the last step (loop), after the closing
P V (fin) and after the epilogue's stores (end); and the global timer at entry and end. This runs
the forward of one case three times in a child process (the kernel prints to the process's own
stdout) and summarises the lines: the median of each stamp, the cycles per step of the walk, and
the gaps between consecutive CTAs of one SM (those include the printing, tens of microseconds).

    git apply benchmarks/probes/cta_stamps.patch && MSB_CUDA=1 python3 setup.py -q build_ext --inplace
    python3 -m benchmarks.probes.cta_stamps [SHAPE S DENSITY] ...   (default: 3B at 32K, 10% and 25%)
    git apply -R benchmarks/probes/cta_stamps.patch                 (and build again)
"""
from __future__ import annotations

import statistics
import subprocess
import sys

STAMPS = ("pq", "pc0", "pc1", "pc2", "q", "first", "loop", "fin", "end")
DEFAULT_CASES = [("qwen2.5-3b", 32768, 0.1), ("qwen2.5-3b", 32768, 0.25)]
CALLS = 3  # forwards of a case, each stamped


def run(shape: str, S: int, density: float) -> None:
    """The child: CALLS forwards of the case, each between synchronisations."""
    import torch

    from benchmarks.attention import SHAPES, routed_case
    from megatron_sparsebalance.ops import cuda_attention as ca

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, _, args = routed_case(S, *SHAPES[shape], density, gen)
    for _ in range(CALLS):
        torch.cuda.synchronize()
        ca._forward(q, k, v, *args)
        torch.cuda.synchronize()


def parse(lines) -> list[dict]:
    """The PROBE lines' fields as ints: ``sm cta n g0 g1`` and the stamps."""
    rows = []
    for line in lines:
        if line.startswith("PROBE"):
            t = line.split()
            rows.append({t[i]: int(t[i + 1]) for i in range(1, len(t) - 1, 2)})
    return rows


def summarise(rows: list[dict]) -> None:
    for name in STAMPS:
        # pc1 and pc2 exist only where the walk has that many chunks (else shared memory's leftovers).
        vals = [r[name] for r in rows if not name.startswith("pc") or r["n"] > int(name[2:])]
        print(f"  {name:6s} median {statistics.median(vals):8.0f} cycles (min {min(vals)}, max {max(vals)})")
    steps = [(r["loop"] - r["first"]) / r["n"] for r in rows]
    print(f"  walk of {statistics.median(r['n'] for r in rows):.0f} chunks (median), "
          f"{statistics.median(steps):.0f} cycles a step")
    for sm in sorted({r["sm"] for r in rows}):
        mine = sorted((r for r in rows if r["sm"] == sm), key=lambda r: r["g0"])
        gaps = [b["g0"] - a["g1"] for a, b in zip(mine, mine[1:])]
        if gaps:
            print(f"  SM {sm}: {len(mine)} CTAs, {statistics.median(r['g1'] - r['g0'] for r in mine) / 1e3:.1f} us "
                  f"each, {statistics.median(gaps) / 1e3:.1f} us between them (median, printing included)")


def main() -> None:
    if sys.argv[1:2] == ["--run"]:
        run(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        return
    rest = sys.argv[1:]
    cases = [(rest[i], int(rest[i + 1]), float(rest[i + 2])) for i in range(0, len(rest), 3)] or DEFAULT_CASES
    for shape, S, density in cases:
        child = subprocess.run([sys.executable, "-m", "benchmarks.probes.cta_stamps", "--run", shape, str(S),
                                str(density)], capture_output=True, text=True, check=True)
        rows = parse(child.stdout.splitlines())
        print(f"== {shape} S={S} density={density}: {len(rows)} CTAs stamped over {CALLS} calls")
        if not rows:
            sys.exit("no PROBE lines: build with benchmarks/probes/cta_stamps.patch applied")
        summarise(rows)


if __name__ == "__main__":
    main()
