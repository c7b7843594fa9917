"""README's "Current figures" table is the committed results files: every row names its file
(under benchmarks/results/) and how its figure is read from it, and the figure shown must be
that number with the rounding the README shows. A rerun that replaces a results file fails this
test until the README shows the new figure.

How a row's last column is read:
- ``a.b.c``: keys of nested objects;
- ``rows[k=v,k2=v2]``: the one element of the list ``rows`` whose fields equal those values
  (numbers compared as numbers; a list field as its items joined by ``+``);
- ``X / Y``: the ratio of two such paths.
A value ending in ``%`` is the number times 100; ``×``, ``ms`` and other units are labels.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HEADER = ["figure", "value", "file", "read as"]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def figure_rows(readme: str) -> list[list[str]]:
    """The rows of the table whose header is ``| figure | value | file | read as |``."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and _cells(line) == HEADER)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def _matches(value, wanted: str) -> bool:
    if isinstance(value, list):
        value = "+".join(str(v) for v in value)
    try:
        return float(value) == float(wanted)
    except (TypeError, ValueError):
        return str(value) == wanted


def _keys(path: str) -> list[str]:
    """``a.rows[x=0.25].b`` -> ``["a", "rows[x=0.25]", "b"]``: dots inside brackets are values."""
    keys, depth, current = [], 0, ""
    for ch in path:
        depth += (ch == "[") - (ch == "]")
        if ch == "." and depth == 0:
            keys.append(current)
            current = ""
        else:
            current += ch
    return keys + [current]


def read_path(data, path: str):
    for key in _keys(path):
        name, _, selector = key.partition("[")
        data = data[name]
        if selector:
            fields = dict(pair.split("=", 1) for pair in selector.rstrip("]").split(","))
            hits = [item for item in data if all(k in item and _matches(item[k], v) for k, v in fields.items())]
            assert len(hits) == 1, f"{key}: {len(hits)} elements match, not one"
            data = hits[0]
    return data


def evaluate(data, expression: str) -> float:
    paths = [p.strip() for p in expression.split(" / ")]
    assert 1 <= len(paths) <= 2, f"unsupported expression: {expression}"
    value = float(read_path(data, paths[0]))
    if len(paths) == 2:
        value /= float(read_path(data, paths[1]))
    return value


def shown(value: str, number: float) -> str:
    """``number`` written with the decimals and the percent scaling of README's ``value``."""
    text = value.replace("*", "")
    digits = re.search(r"-?\d+(?:\.(\d+))?", text)
    decimals = len(digits.group(1) or "")
    if text.rstrip().endswith("%"):
        number *= 100
    return f"{number:.{decimals}f}"


def _readme_rows():
    rows = figure_rows((ROOT / "README.md").read_text())
    return [pytest.param(*row, id=row[0][:60]) for row in rows]


def test_readme_has_a_figures_table_of_several_results_files():
    rows = figure_rows((ROOT / "README.md").read_text())
    assert len(rows) >= 10 and all(len(row) == 4 for row in rows)
    assert len({row[2] for row in rows}) >= 5


@pytest.mark.parametrize("figure,value,file,read_as", _readme_rows())
def test_figure_equals_its_results_file(figure, value, file, read_as):
    path = RESULTS / file.strip("`")
    assert path.is_file(), f"{figure}: {path} does not exist"
    number = evaluate(json.loads(path.read_text()), read_as.strip("`"))
    expected = re.search(r"-?\d+(?:\.\d+)?", value.replace("*", "")).group(0)
    assert shown(value, number) == expected, f"{figure}: README shows {value}, {file} gives {number}"


def test_reader_selects_one_row_and_takes_ratios_and_percentages():
    data = dict(rows=[dict(impl="cuda", seq=32768, density=0.25, ms=4.0, lengths=[16384, 16384]),
                      dict(impl="flex", seq=32768, density=0.25, ms=10.0, lengths=[32768])],
                models=dict(profiled=dict(median=0.0186)))
    assert evaluate(data, "rows[impl=flex,density=0.25].ms / rows[impl=cuda,seq=32768].ms") == 2.5
    assert read_path(data, "rows[lengths=16384+16384].impl") == "cuda"
    assert shown("1.9%", evaluate(data, "models.profiled.median")) == "1.9"
    assert shown("**2.50×**", 2.5) == "2.50" and shown("2.5×", 2.46) == "2.5"
    with pytest.raises(AssertionError, match="2 elements match"):
        read_path(data, "rows[seq=32768].ms")


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_results_top_level_holds_no_rechecks_or_probes():
    """A rerun replaces the canonical file; rechecks, probes and superseded rounds live in archive/."""
    names = [p.name for p in RESULTS.iterdir() if p.is_file()]
    assert "attention_h200.json" in names
    assert not [n for n in names if re.search(r"recheck|probe|rerun|firstpass", n)]
