"""Figures of a sweep: each analysis's plot of its combined table, written as HTML pages that share
one copy of plotly's JavaScript."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from arithinterp.outputs import write_file, writes
from arithinterp.sweep.registry import ANALYSES
from arithinterp.sweep.storage import load_results


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


@writes
def plot_sweep(out: Union[str, Path], to: Union[str, Path, None] = None, *, overwrite: bool = False) -> list[Path]:
    """Write each analysis's figures into one HTML page ``<to>/<analysis>.html``, and plotly's
    JavaScript once beside them (``plotly.min.js``, which every page loads: a page holds only its
    figures, kilobytes instead of the 4.8 MB of a library inlined in each). Keep the folder together
    to open the pages offline.

    Args:
        out: The sweep's results directory.
        to: The folder for the pages (default ``OUT/figures``).
        overwrite: Replace figure files that exist (the sweep command redraws its own with it).

    Returns:
        The pages written (``plotly.min.js`` not among them).

    Raises:
        ConfigError: A figure file exists and ``overwrite`` is false (checked for all before any is written).
        OutputError: A file could not be written.
    """
    from plotly.offline import get_plotlyjs

    from arithinterp.outputs import check_target

    out = Path(out)
    to = Path(to) if to is not None else out / "figures"
    drawn = figures(out)
    for name in drawn:
        check_target(to / f"{name}.html", overwrite=overwrite, what="to")
    written = []
    for name, figs in drawn.items():
        parts = [fig.to_html(full_html=False, include_plotlyjs=False) for fig in figs]
        html = (f"<!doctype html><html><head><meta charset='utf-8'><title>{name}</title>"
                f"<script src='{PLOTLY_JS}'></script></head><body>{''.join(parts)}</body></html>")
        written.append(write_file(to / f"{name}.html", html, overwrite=overwrite, what="to"))
    library = get_plotlyjs()  # the library beside the pages: rewritten only when it differs (another plotly)
    if written and not ((to / PLOTLY_JS).exists() and (to / PLOTLY_JS).read_text() == library):
        write_file(to / PLOTLY_JS, library, overwrite=True, what="to")
    return written
