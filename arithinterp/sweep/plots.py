"""Figures of a sweep: each analysis's plot of its combined table, written as HTML pages that share
one copy of plotly's JavaScript."""

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


PLOTLY_JS = "plotly.min.js"  # written once beside the figure pages, which load it


def plot_sweep(out: Union[str, Path], to: Union[str, Path, None] = None) -> list[Path]:
    """Write each analysis's figures into one HTML page ``<to>/<analysis>.html``, and plotly's
    JavaScript once beside them (``plotly.min.js``, which every page loads: a page holds only its
    figures, kilobytes instead of the 4.8 MB of a library inlined in each). Keep the folder together
    to open the pages offline.

    Args:
        out: The sweep's results directory.
        to: The folder for the pages (default ``OUT/figures``).

    Returns:
        The pages written (``plotly.min.js`` not among them).

    Raises:
        OutputError: A file could not be written.
    """
    from plotly.offline import get_plotlyjs

    out = Path(out)
    to = Path(to) if to is not None else out / "figures"
    written = []
    for name, figs in figures(out).items():
        parts = [fig.to_html(full_html=False, include_plotlyjs=False) for fig in figs]
        html = (f"<!doctype html><html><head><meta charset='utf-8'><title>{name}</title>"
                f"<script src='{PLOTLY_JS}'></script></head><body>{''.join(parts)}</body></html>")
        path = to / f"{name}.html"
        atomic_write(path, lambda tmp: tmp.write_text(html))
        written.append(path)
    library = get_plotlyjs()
    if written and not ((to / PLOTLY_JS).exists() and (to / PLOTLY_JS).read_text() == library):
        atomic_write(to / PLOTLY_JS, lambda tmp: tmp.write_text(library))
    return written
