"""Benchmark figures as PNG charts (``python -m benchmarks ... --plot DIR``).

* :func:`plot_rows`: one line chart per result row whose ``Row.series`` is filled (per-turn or
  per-call figures: B3's time to first token per turn, B12's chat turns, B13's calls with and
  without the prefix cache...). Any scenario gets a chart by filling ``series``; nothing here
  names a scenario.
* :func:`plot_distributions`: box plots of timing samples per label (mask time per engine, from
  ``python -m benchmarks.guide_mask --plot DIR``).

matplotlib is an optional extra (``pip install -e .[plot]``), imported only when plotting.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = ["require_matplotlib", "plot_rows", "line_chart", "plot_distributions"]

MISSING = ("--plot needs matplotlib, which is an optional extra: pip install -e '.[plot]' "
           "(or pip install matplotlib), or run without --plot")


def require_matplotlib():
    """``matplotlib.pyplot`` on the file-only Agg backend; ``SystemExit`` with how to install it if missing."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(MISSING) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _log_axis(axis, set_scale) -> None:
    """A log scale labelled with plain numbers (0.2, 0.5, 1, 2...: not powers of ten), fewer over a wide range."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    set_scale("log")
    axis.axes.autoscale_view()
    lo, hi = sorted(axis.get_view_interval())
    decades = math.log10(hi / lo) if lo > 0 else 9.0
    subs = (1.0, 2.0, 3.0, 5.0) if decades <= 1.5 else (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0,)  # no overlaps
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _filename(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "chart"


def line_chart(series: Mapping, path: Path, *, subtitle: str = "") -> Path:
    """Draw ``series`` (the ``Row.series`` layout: title, x, xlabel, ylabel, lines, log_y) to ``path``."""
    plt = require_matplotlib()
    x = list(series["x"])
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    markers = "os^Dvx*"
    for i, (label, ys) in enumerate(series["lines"].items()):
        pts = [(a, b) for a, b in zip(x, ys) if b is not None]
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker=markers[i % len(markers)], markersize=4,
                linewidth=1.6, label=str(label))
    if series.get("log_y"):
        _log_axis(ax.yaxis, ax.set_yscale)
    if all(isinstance(v, int) for v in x) and len(x) <= 20:
        ax.set_xticks(x)
    ax.set_xlabel(series.get("xlabel", ""))
    ax.set_ylabel(series.get("ylabel", ""))
    ax.set_title(series.get("title", ""), fontsize=11)
    if subtitle:
        fig.text(0.01, 0.01, subtitle[:120], ha="left", va="bottom", fontsize=6.5, color="#666")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_rows(rows: Iterable, out_dir, *, subtitle: str = "") -> list[Path]:
    """One PNG per row with a ``series`` (``<row id>.png`` in ``out_dir``); returns the paths written."""
    out = Path(out_dir)
    return [line_chart(r.series, out / f"{_filename(r.id)}.png", subtitle=subtitle) for r in rows if r.series]


def plot_distributions(samples: Mapping[str, Sequence[float]], path, *, title: str, xlabel: str,
                       subtitle: str = "", log_x: bool = True) -> Path:
    """Horizontal box plots, one per label (whiskers at the 1st and 99th percentiles, outliers dotted)."""
    plt = require_matplotlib()
    labels = list(samples)
    fig, ax = plt.subplots(figsize=(6.4, 0.5 + 0.42 * len(labels) + 0.8), dpi=100)
    import matplotlib

    version = tuple(int(v) for v in re.findall(r"\d+", matplotlib.__version__)[:2])
    horizontal = {"orientation": "horizontal"} if version >= (3, 10) else {"vert": False}  # `vert` is deprecated in 3.10
    ax.boxplot([list(samples[k]) for k in labels], whis=(1, 99), widths=0.6,
               flierprops={"marker": ".", "markersize": 2, "alpha": 0.4}, **horizontal)
    ax.set_yticks(range(1, len(labels) + 1), labels, fontsize=8)
    ax.invert_yaxis()
    if log_x:
        _log_axis(ax.xaxis, ax.set_xscale)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=11)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    if subtitle:
        fig.text(0.01, 0.01, subtitle[:120], ha="left", va="bottom", fontsize=6.5, color="#666")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
