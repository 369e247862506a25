"""The viewer's page: one self-contained HTML file (the description as JSON, the script and its
style inline; nothing fetched), and :class:`GraphView`, which shows it in a notebook, writes it,
and embeds it in the report."""

from __future__ import annotations

import html
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Union

from arithinterp.errors import ConfigError
from arithinterp.outputs import writes

PathLike = Union[str, Path]
HEIGHT = 720  # pixels of a notebook's or the report's inline frame


@lru_cache(maxsize=None)
def _asset(name: str) -> str:
    return resources.files("arithinterp.viz.graph_view").joinpath(name).read_text(encoding="utf-8")


def _script_json(data: dict) -> str:
    """``data`` as JSON that cannot end the ``<script>`` element it sits in (``<``, ``>`` and ``&``
    escaped the way JSON allows)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(data: dict) -> str:
    """The page that draws ``data``, a description from :func:`~arithinterp.viz.graph_view.graph_data`
    or :func:`~arithinterp.viz.graph_view.circuit_data`.

    Args:
        data: The description.

    Returns:
        The HTML document.

    Raises:
        ConfigError: ``data`` is not a description of this viewer's version.
    """
    from arithinterp.viz.graph_view.data import VERSION

    if not isinstance(data, dict) or data.get("format") != "arithinterp-graph-view" or data.get("version") != VERSION:
        raise ConfigError("data must be a graph-view description (viz.graph_view.graph_data or circuit_data) of "
                          f"version {VERSION}")
    return "".join([
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        "<link rel='icon' href='data:,'>",  # no favicon request
        f"<title>{html.escape(str(data.get('title', 'graph')))}</title>",
        f"<style>{_asset('view.css')}</style></head><body><div id='app'></div>",
        f"<script type='application/json' id='graph-data'>{_script_json(data)}</script>",
        f"<script>{_asset('view.js')}</script></body></html>",
    ])


class GraphView:
    """An interactive page of an attribution graph or a circuit: drawn inline in a notebook (an
    ``<iframe srcdoc>`` of the page, no server), written with :meth:`to_html`, embedded in the
    report with :meth:`iframe`.

    Args:
        data: The description the page draws (:func:`~arithinterp.viz.graph_view.graph_data`,
            :func:`~arithinterp.viz.graph_view.circuit_data`).
    """

    def __init__(self, data: dict):
        self.data = data
        self.html = render_page(data)

    def iframe(self, height: int = HEIGHT) -> str:
        """The page in an inline frame (its document in ``srcdoc``), for a notebook or another page.

        Args:
            height: The frame's height in pixels.

        Returns:
            The ``<iframe>`` element.
        """
        title = html.escape(str(self.data.get("title", "graph")), quote=True)
        return (f"<iframe class='graph-view' title=\"{title}\" sandbox='allow-scripts' "
                f"style='width:100%;height:{int(height)}px;border:1px solid #ddd' "
                f"srcdoc=\"{html.escape(self.html, quote=True)}\"></iframe>")

    def _repr_html_(self) -> str:
        return self.iframe()

    @writes
    def to_html(self, path: PathLike, *, overwrite: bool = False) -> Path:
        """Write the page (one file; opens offline from ``file://``).

        Args:
            path: The ``.html`` file.
            overwrite: Replace an existing file.

        Returns:
            The file's path.

        Raises:
            ConfigError: The path is a folder, cannot be written, or exists and ``overwrite`` is false.
        """
        from arithinterp.outputs import write_file

        return write_file(path, self.html, overwrite=overwrite, what="path")

    def __repr__(self) -> str:
        nodes, links = len(self.data["nodes"]["id"]), len(self.data["links"]["source"])
        size = len(self.html.encode()) / 1e6
        return f"GraphView({self.data['title']!r}: {nodes:,} nodes, {links:,} links, {size:.2f} MB page)"
