"""Figures of a sweep: each analysis's plot of its combined table, written as HTML pages that share
one copy of plotly's JavaScript."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from arithinterp.outputs import check_target, write_file, write_folder, writes
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
    figures, kilobytes instead of the 4.8 MB of a library inlined in each). The folder is written
    whole, so a redraw that fails part way leaves the previous pages as they were; keep it together
    to open the pages offline.

    Args:
        out: The sweep's results directory.
        to: The folder for the pages (default ``OUT/figures``), replaced whole.
        overwrite: Replace that folder where it holds files (the sweep command redraws its own with it).

    Returns:
        The pages written (``plotly.min.js`` not among them); none when no analysis has a figure.

    Raises:
        ConfigError: The folder holds files and ``overwrite`` is false (checked before anything is drawn).
        OutputError: A file could not be written; the folder is unchanged.
    """
    from plotly.offline import get_plotlyjs

    out = Path(out)
    to = Path(to) if to is not None else out / "figures"
    check_target(to, overwrite=overwrite, what="to", folder=True)
    drawn = figures(out)
    if not drawn:
        return []
    with write_folder(to, overwrite=overwrite, what="to") as folder:
        for name, figs in drawn.items():
            parts = [fig.to_html(full_html=False, include_plotlyjs=False) for fig in figs]
            html = (f"<!doctype html><html><head><meta charset='utf-8'><title>{name}</title>"
                    f"<script src='{PLOTLY_JS}'></script></head><body>{''.join(parts)}</body></html>")
            write_file(folder / f"{name}.html", html, overwrite=False)
        write_file(folder / PLOTLY_JS, get_plotlyjs(), overwrite=False)
    return [to / f"{name}.html" for name in drawn]
