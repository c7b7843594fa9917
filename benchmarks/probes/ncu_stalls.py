"""Where a warp-specialised kernel's consumer warps spend a step, from Nsight Compute's source page
(SASS with warp samples, as CSV: ``ncu -i REPORT --page source --csv --print-source sass``).

The consumers' per-step code is the SASS executed at least MIN_EXEC times (their warps run it once a
step; the producer's warps and the per-part code run it fewer times). Its samples, split by stall
reason and scaled to CYCLES (the kernel's cycles per step), give each reason's cycles per step; a
reason is then split by opcode.

    python3 -m benchmarks.probes.ncu_stalls SOURCE.csv CYCLES MIN_EXEC [REASON ...]"""
import collections
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def consumer_rows(path: str, min_exec: float) -> tuple[list, list]:
    rows = list(csv.reader(open(path)))
    header = rows[1]  # row 0 names the kernel
    data = [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    return [r for r in data if number(r["Instructions Executed"]) >= min_exec], reasons


def opcode(sass: str) -> str:
    words = sass.split()
    return words[1] if words and words[0].startswith("@") else (words[0] if words else "")


def main():
    path, cycles, min_exec = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    rows, reasons = consumer_rows(path, min_exec)
    samples = sum(number(r["Warp Stall Sampling (All Samples)"]) for r in rows)
    by_reason = collections.Counter({h[6:]: sum(number(r[h]) for r in rows) for h in reasons})
    print(f"cycles per step by stall reason ({cycles:.0f} in all):")
    print("  " + ", ".join(f"{k} {cycles * v / samples:.0f}" for k, v in by_reason.most_common(10)))
    for reason in sys.argv[4:]:
        by_op = collections.Counter()
        for r in rows:
            by_op[opcode(r["Source"])] += number(r["stall_" + reason])
        print(f"{reason} by opcode: " + ", ".join(f"{k} {cycles * v / samples:.0f}" for k, v in by_op.most_common(8)))


if __name__ == "__main__":
    main()
