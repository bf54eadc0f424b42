"""``--plot``: benchmark charts as PNG files (skipped without matplotlib, an optional extra)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # benchmarks/ is not an installed package: import it from the repository
    sys.path.insert(0, ROOT)

from benchmarks.results import Row  # noqa: E402


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_rows_with_series_become_line_charts(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plots import plot_distributions, plot_rows

    series = {"title": "TTFT per turn", "x": [1, 2, 3], "xlabel": "turn", "ylabel": "seconds", "log_y": True,
              "lines": {"baseline": [0.5, 0.7, 0.9], "continuum": [0.05, 0.05, None]}}
    rows = [Row(id="B3a", title="t", baseline="b", figure=1.0, op=">=", threshold=1.0, unit="x", series=series),
            Row(id="B1", title="no series", baseline="b", figure=1.0, op="<=", threshold=1.0, unit="x"),
            Row(id="B13/calls", title="t", baseline="b", figure=1.0, op=">=", threshold=1.0, unit="x",
                series={**series, "log_y": False})]
    paths = plot_rows(rows, tmp_path / "charts", subtitle="test")
    assert [p.name for p in paths] == ["B3a.png", "B13_calls.png"]
    for p in paths:
        w, h = png_size(p)
        assert 400 <= w <= 1000 and 200 <= h <= 800 and p.stat().st_size < 200_000
    out = plot_distributions({"llguidance x1": [60.0, 70.0, 900.0], "outlines x1": [20.0, 25.0, 30.0]},
                             tmp_path / "mask.png", title="mask", xlabel="us")
    assert png_size(out)[0] > 0


def test_missing_matplotlib_says_how_to_install(monkeypatch):
    from benchmarks import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[plot\]'"):
        plots.require_matplotlib()
