"""Figures of a sweep: each analysis's plot of its combined table, written as HTML files."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from arithinterp.sweep.registry import ANALYSES
from arithinterp.sweep.storage import atomic_write, load_results


def figures(out: Union[str, Path]) -> dict:
    """The figures of a sweep's results, drawn by each analysis's ``plot`` (or one figure per column).

    Args:
        out: The sweep's results directory.

    Returns:
        ``{analysis: [Figure, ...]}`` for every analysis with finished cells.
    """
    from arithinterp.viz import sweep as viz

    drawn = {}
    for name, frame in load_results(out).items():
        entry = ANALYSES.get(name)
        plot = entry.plot if entry is not None and entry.plot is not None else viz.plot_sweep_columns
        drawn[name] = list(plot(frame))
    return drawn


def plot_sweep(out: Union[str, Path], to: Union[str, Path, None] = None) -> list[Path]:
    """Write each analysis's figures into one self-contained HTML file ``<to>/<analysis>.html``.

    Args:
        out: The sweep's results directory.
        to: The folder for the HTML files (default ``OUT/figures``).

    Returns:
        The files written.

    Raises:
        OutputError: A file could not be written.
    """
    out = Path(out)
    to = Path(to) if to is not None else out / "figures"
    written = []
    for name, figs in figures(out).items():
        parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs)]
        html = (f"<!doctype html><html><head><meta charset='utf-8'><title>{name}</title></head>"
                f"<body>{''.join(parts)}</body></html>")
        path = to / f"{name}.html"
        atomic_write(path, lambda tmp: tmp.write_text(html))
        written.append(path)
    return written
