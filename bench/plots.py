"""PNG figures of benchmark results (matplotlib figures without pyplot: no display, no global state).

A figure is a row of panels; a panel is a line chart (numeric x) or a grouped bar chart
(categorical x) of named series. A workload draws its figure next to its JSON and
Markdown results (`png_path`); the report draws the figure of a result that has none
(one written before its workload had a plot) from the JSON, into docs/img/
(`drawing_into`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from bench import common

Series = dict[str, Sequence[float]]
MAX_TICKS = 12  # more x values than this: matplotlib picks the ticks, no markers
_redirects: list[Path] = []  # set by `drawing_into`, innermost last


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    x: Sequence[object]
    series: Series
    kind: str = "line"  # "line" (numeric x) or "bar" (categorical x)
    logy: bool = False
    hlines: dict[str, float] = field(default_factory=dict)


def columns(records: dict[str, dict], keys: dict[str, str]) -> Series:
    """Bar series of named records (runs, modes): per label, `record[key]` of every record."""
    return {label: [record[key] for record in records.values()] for label, key in keys.items()}


def save_figure(path: Path, panels: Sequence[Panel], title: str) -> Path:
    fig = Figure(figsize=(6 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        _draw(ax, panel)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _draw(ax, panel: Panel) -> None:
    if panel.kind == "bar":
        _bars(ax, panel)
    else:
        for name, ys in panel.series.items():
            ax.plot(list(panel.x), list(ys), marker="o" if len(panel.x) <= MAX_TICKS else "", label=name)
        if len(panel.x) <= MAX_TICKS:
            ax.set_xticks(list(panel.x))
    for name, y in panel.hlines.items():
        ax.axhline(y, linestyle="--", color="grey", linewidth=1)
        ax.annotate(name, (0.01, y), xycoords=("axes fraction", "data"), fontsize=8, color="grey")
    if panel.logy:
        ax.set_yscale("log")
    ax.set_title(panel.title)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if len(panel.series) > 1:
        ax.legend(fontsize=8)


def _bars(ax, panel: Panel) -> None:
    count = max(len(panel.series), 1)
    width = 0.8 / count
    positions = range(len(panel.x))
    for i, (name, ys) in enumerate(panel.series.items()):
        ax.bar([p + (i - (count - 1) / 2) * width for p in positions], list(ys), width, label=name)
    ax.set_xticks(list(positions))
    ax.set_xticklabels([str(x) for x in panel.x])


def png_path(name: str) -> Path:
    """Where a workload's figure goes: next to its JSON and Markdown results."""
    return (_redirects[-1] if _redirects else common.results_dir()) / f"{name}.png"


@contextlib.contextmanager
def drawing_into(directory: Path) -> Iterator[None]:
    """Figures drawn inside go to `directory` instead of the results directory."""
    _redirects.append(directory)
    try:
        yield
    finally:
        _redirects.pop()
