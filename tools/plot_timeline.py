"""Draw a pipeline timeline (a Chrome trace written by the schedule) as a PNG.

One row per pipeline stage (and DP rank), time along x; forward boxes light, backward boxes
dark, one colour per micro-batch, each box labelled with its micro-batch and the budget its
layers used. Idle time between boxes is the bubble: compare the timeline of ``--dst-anchor
none`` with that of ``mean`` to see it shrink.

    python tools/plot_timeline.py trace_none.json trace_mean.json --out timeline.png
"""
from __future__ import annotations

import argparse
import json
import os


def load_trace(path: str) -> list:
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def draw(ax, events, title):
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    rows = sorted({(e["pid"], e["tid"]) for e in events})
    y_of = {r: i for i, r in enumerate(rows)}
    for e in events:
        mb = e["args"]["micro_batch"]
        start, dur = e["ts"] / 1e3, e["dur"] / 1e3
        y = y_of[(e["pid"], e["tid"])]
        color = cmap((2 * mb + (1 if e["cat"] == "B" else 0)) % 20)
        ax.broken_barh([(start, dur)], (y - 0.4, 0.8), facecolors=color, edgecolor="black", linewidth=0.3)
        budget = e["args"].get("budget")
        label = f"{e['cat']}{mb}" + (f"\nk={budget:.0f}" if budget is not None and e["cat"] == "F" else "")
        ax.text(start + dur / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {p}" + (f" / dp {t}" if len({r[1] for r in rows}) > 1 else "") for p, t in rows])
    ax.invert_yaxis()
    end = max(e["ts"] + e["dur"] for e in events) / 1e3
    ax.set_title(f"{title}: {end:.1f} ms")
    return end
    ax.set_xlabel("ms since the iteration started")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="Chrome trace JSON files (one panel each, same time scale)")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [(os.path.basename(t).removesuffix(".json"), load_trace(t)) for t in args.traces]
    fig, axes = plt.subplots(len(traces), 1, figsize=(14, 1.2 + 0.9 * max(len({(e['pid'], e['tid']) for e in ev}) for _, ev in traces) * len(traces)),
                             sharex=True, squeeze=False)
    ends = [draw(ax, events, name) for ax, (name, events) in zip(axes[:, 0], traces)]
    axes[0, 0].set_xlim(0, max(ends) * 1.01)  # shared x: the longest trace sets the extent
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
