"""A compact memory-over-time chart for the terminal, drawn with Unicode block characters.

Pure layout: :func:`chart` turns step curves into rows of ``(text, kind)`` runs; the caller
(:mod:`lmscli.report.terminal`) gives each kind a colour. Each column is the highest memory during its
slice of the step, so no peak falls between two columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmscli.units import format_size

EIGHTHS = " ▁▂▃▄▅▆▇█"
SHADE = "░"
BUDGET = "╌"
MIN_COLUMNS = 16


@dataclass(frozen=True)
class Series:
    """One step curve: ``(time in seconds, bytes)`` after each event, plus bytes always resident."""

    label: str
    curve: tuple[tuple[float, int], ...]
    resident: int = 0


def column_peaks(series: Series, end: float, columns: int) -> list[int]:
    """The highest level of ``series`` within each of ``columns`` equal slices of [0, end]."""
    peaks = [0] * columns
    level = 0
    i, n = 0, len(series.curve)
    for col in range(columns):
        upper = end * (col + 1) / columns
        high = level
        while i < n and (series.curve[i][0] < upper or col == columns - 1):
            level = series.curve[i][1]
            high = max(high, level)
            i += 1
        peaks[col] = high + series.resident
    return peaks


def _peak(series) -> int:
    return max(max((b for _, b in s.curve), default=0) + s.resident for s in series)


def budget_on_chart(series, budget: int | None) -> bool:
    """A budget far above the curves (e.g. none given) is named in the legend but not drawn."""
    return budget is not None and 0 < budget <= 1.25 * _peak(series)


def _merge(cells: list[tuple[str, str]]) -> list[tuple[str, str]]:
    runs: list[tuple[str, str]] = []
    for text, kind in cells:
        if runs and runs[-1][1] == kind:
            runs[-1] = (runs[-1][0] + text, kind)
        else:
            runs.append((text, kind))
    return runs


def chart(main: Series, width: int, height: int = 8, behind: Series | None = None,
          budget: int | None = None) -> list[list[tuple[str, str]]]:
    """Rows of ``(text, kind)`` runs, at most ``width`` characters wide; [] if it is too narrow.

    ``main`` is drawn in blocks (kind ``main``, or ``over`` above the budget); ``behind`` (e.g. the
    curve without the plan) in light shade where it is higher (kind ``behind``); the budget as a
    dashed row (kind ``budget``) when it is on the chart. Kinds ``axis`` and ``label`` are the frame.
    """
    series = [main] + ([behind] if behind is not None else [])
    end = max((s.curve[-1][0] for s in series if s.curve), default=0.0)
    peak = _peak(series)
    on_chart = budget_on_chart(series, budget)
    top = max(peak, budget if on_chart else 0)
    if top <= 0 or end <= 0:
        return []
    budget_row = min(height - 1, budget * height // top) if on_chart else None
    labels = {height - 1: format_size(top), 0: "0"}
    if budget_row is not None:
        labels[budget_row] = f"budget {format_size(budget)}"
    label_width = max(len(text) for text in labels.values())
    columns = width - label_width - 2
    if columns < MIN_COLUMNS:
        return []
    eighths = [[value * height * 8 // top for value in column_peaks(s, end, columns)] for s in series]
    budget_eighths = budget * height * 8 // top if on_chart else None
    rows = []
    for row in range(height - 1, -1, -1):
        cells = [(labels.get(row, "").rjust(label_width) + " ", "label"), ("┤" if row in labels else "│", "axis")]
        for col in range(columns):
            fill = min(8, max(0, eighths[0][col] - 8 * row))
            if fill:
                over = budget_eighths is not None and eighths[0][col] > budget_eighths and row >= budget_row
                cells.append((EIGHTHS[fill], "over" if over else "main"))
            elif behind is not None and eighths[1][col] - 8 * row >= 4:
                cells.append((SHADE, "behind"))
            elif row == budget_row:
                cells.append((BUDGET, "budget"))
            else:
                cells.append((" ", "main"))
        rows.append(_merge(cells))
    left, right = "0 ms", f"{end * 1e3:.2f} ms"
    pad = " " * (label_width + 1)
    rows.append([(pad + "└" + "─" * columns, "axis")])
    rows.append([(pad + " " + left + right.rjust(columns - len(left)), "label")])
    return rows


def legend(main: Series, behind: Series | None, budget: int | None) -> list[tuple[str, str]]:
    """The key under the chart, as ``(text, kind)`` runs."""
    runs = [("█", "main"), (f" {main.label}", "label")]
    if behind is not None:
        runs += [("   " + SHADE, "behind"), (f" {behind.label}", "label")]
    if budget is not None:
        series = [main] + ([behind] if behind is not None else [])
        where = "" if budget_on_chart(series, budget) else " (above the chart)"
        runs += [("   " + BUDGET * 2, "budget"), (f" budget {format_size(budget)}{where}", "label")]
    return runs
