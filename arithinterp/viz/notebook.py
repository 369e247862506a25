"""Figures in a notebook as static images, so that a stored notebook shows them wherever it is read.

A code host and a rendered documentation page draw a notebook's PNG outputs but not plotly's
interactive ones. The image is exported by plotly through kaleido, which drives a Chromium (the
``notebooks`` extra: ``pip install 'arithinterp[notebooks]'``); where that export is not available,
the interactive figure is shown instead, so a notebook runs the same everywhere.

Each export on its own starts a browser (2–6 s on 2 cores); the first one here starts kaleido's
long-lived export server instead, which every later figure in the process reuses (about 0.15 s each),
and which stops when the process ends.
"""

from __future__ import annotations

import atexit
import warnings
from typing import Optional

import plotly.graph_objects as go

from arithinterp.errors import ConfigError


def show_static(fig: go.Figure, *, width: int = 900, height: Optional[int] = None) -> None:
    """Display a figure in the running notebook as a PNG image, or as the interactive figure where
    PNG export is not available (no kaleido, or no browser for it to drive).

    ``fig.show()`` draws the interactive figure at any time.

    Args:
        fig: The figure to show, e.g. a result's ``.plot()``.
        width: The image's width in pixels (a notebook's or a documentation page's column).
        height: The image's height in pixels; ``None`` takes the figure's own height (plotly's
            default of 500 where the figure sets none).

    Raises:
        ConfigError: ``fig`` is not a plotly ``Figure`` (a list of them, say).
    """
    if not isinstance(fig, go.Figure):
        raise ConfigError(
            f"show_static: fig={type(fig).__name__} is not accepted; fig accepts one plotly Figure "
            "(a result's .plot()): show a list of them one at a time"
        )
    from IPython.display import Image, display

    if _server == "failed":  # it could not start earlier in this process: do not retry per figure
        display(fig)
        return
    try:
        _start_export_server()
        with warnings.catch_warnings():  # the server ignores per-call browser options, which plotly always passes
            warnings.filterwarnings("ignore", message="The kopts argument is ignored")
            image = fig.to_image(format="png", width=width, height=height)
    except Exception:  # kaleido missing, no Chromium, or the browser failed: any of them
        display(fig)
        return
    display(Image(image))


#: kaleido's export server in this process: "not started", "running" or "failed" (to start).
_server = "not started"


def _start_export_server() -> None:
    """Start kaleido's export server once per process (stopped at exit), so that figures after the
    first do not each start a browser. A failure to start is remembered, so that a machine without
    kaleido or a browser pays for the attempt once."""
    global _server
    if _server == "running":
        return
    try:
        import kaleido

        kaleido.start_sync_server(silence_warnings=True)
    except Exception:
        _server = "failed"
        raise
    _server = "running"
    atexit.register(kaleido.stop_sync_server, silence_warnings=True)


__all__ = ["show_static"]
