"""What a scenario reports and how the runner writes it: :class:`Row` (one checked figure), :class:`Skip`,
the console table, the Markdown table, the JSON file, and the progress log on stderr."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field

from .measurement import Call, median


class Skip(Exception):
    """Raised by a scenario that cannot run here (a fixture or an optional package is missing): the
    runner prints ``<id>: skipped (<reason>)`` and goes on with the next scenario."""


@dataclass
class Row:
    """One checked figure."""

    id: str
    title: str
    baseline: str  # what the baseline is
    figure: float  # the checked value
    op: str  # "<=" or ">="
    threshold: float
    unit: str  # "x time" (continuum / baseline) or "x faster" (baseline / continuum) or "x memory"...
    base_s: float | None = None
    cont_s: float | None = None
    base_tps: float | None = None
    cont_tps: float | None = None
    base_rss_mb: float | None = None
    cont_rss_mb: float | None = None
    base_computed: int | None = None
    cont_computed: int | None = None
    reps: int = 0
    notes: list = field(default_factory=list)
    achievable: str | None = None  # when the target cannot be met on this machine: why, and the best achievable
    # For ``--plot``: {"title": str, "x": [...], "xlabel": str, "ylabel": str, "lines": {label: [y, ...]},
    # "log_y": bool (optional)}; a scenario that has per-turn / per-call figures fills it.
    series: dict | None = None
    checked: bool = True  # False in a --smoke run: the figure is shown, the target is not checked

    @property
    def passed(self) -> bool:
        if self.figure is None or math.isnan(self.figure):
            return False
        return self.figure <= self.threshold if self.op == "<=" else self.figure >= self.threshold

    @property
    def target(self) -> str:
        return f"{self.op} {self.threshold:g}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["passed"], d["target"] = self.passed, self.target
        return d


def row_from_calls(id: str, title: str, baseline: str, base: list[Call], cont: list[Call], *, op: str, threshold: float,
                   speedup: bool, unit: str | None = None, notes=None) -> Row:
    """A row whose figure is the median paired time ratio (continuum/baseline), or its inverse when ``speedup``."""
    ratios = [c.seconds / b.seconds for b, c in zip(base, cont)]
    fig = median([1.0 / r for r in ratios]) if speedup else median(ratios)
    cpu = median([b.cpu_seconds / c.cpu_seconds if speedup else c.cpu_seconds / b.cpu_seconds for b, c in zip(base, cont)])
    notes = list(notes or []) + [f"per-rep wall ratios {' '.join(f'{r:.3f}' for r in ratios)} (continuum/baseline); "
                                 f"CPU-time figure {cpu:.3f}"]
    b_s, c_s = median([b.seconds for b in base]), median([c.seconds for c in cont])
    b_gen, c_gen = median([b.generated for b in base]), median([c.generated for c in cont])
    return Row(id=id, title=title, baseline=baseline, figure=fig, op=op, threshold=threshold,
               unit=unit or ("x faster" if speedup else "x time"), base_s=b_s, cont_s=c_s,
               base_tps=b_gen / b_s if b_s and b_gen else None, cont_tps=c_gen / c_s if c_s and c_gen else None,
               base_rss_mb=max(b.peak_rss_mb for b in base) if base else None,
               cont_rss_mb=max(c.peak_rss_mb for c in cont) if cont else None,
               base_computed=int(median([b.computed for b in base])) if base else None,
               cont_computed=int(median([c.computed for c in cont])) if cont else None,
               reps=len(cont), notes=notes)


def _fmt(x, spec: str, none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


COLUMNS = ["id", "scenario", "baseline s", "continuum s", "figure", "target", "check", "tok/s base|cont",
           "peak RSS MB base|cont", "tokens computed base|cont"]


def table_cells(r: Row) -> list[str]:
    return [
        r.id, r.title, _fmt(r.base_s, ".3f"), _fmt(r.cont_s, ".3f"),
        _fmt(r.figure, ".3f") + " " + r.unit, r.target, ("PASS" if r.passed else "FAIL") if r.checked else "-",
        f"{_fmt(r.base_tps, '.1f')} | {_fmt(r.cont_tps, '.1f')}",
        f"{_fmt(r.base_rss_mb, '.0f')} | {_fmt(r.cont_rss_mb, '.0f')}",
        f"{_fmt(r.base_computed, 'd')} | {_fmt(r.cont_computed, 'd')}",
    ]


def format_table(rows: list[Row]) -> str:
    cells = [COLUMNS] + [table_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    line = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths))  # noqa: E731
    out = [line(COLUMNS), "  ".join("-" * w for w in widths)] + [line(c) for c in cells[1:]]
    return "\n".join(out)


def format_markdown(rows: list[Row]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in table_cells(r)) + " |")
    return "\n".join(out)


def write_json(path: str, meta: dict, rows: list[Row]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, f, indent=2, default=str)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
