"""How the package's objects print: a ``repr`` of a few hundred characters and an HTML table.

A prompt set of 10,000 prompts or a result holding tensors of millions of numbers prints as what it
is, its sizes and its headline numbers, never as its contents: :func:`short_repr` writes the one line
``repr`` returns (at most :data:`MAX_REPR` characters), :func:`html_table` the table Jupyter shows
(``_repr_html_``), which adds the first rows of the object's tidy frame.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    import pandas as pd

MAX_REPR = 400  # characters of a repr: one or two lines of a notebook's output
FIRST_ROWS = 5  # rows of the frame the HTML table shows
_SHORT = 60  # characters a value may take in a repr before it is summarised


def describe(value: Any) -> str:
    """A value in a few characters: a tensor or array as its dtype and shape, a long list or dict as
    its length, a number to four significant digits, a long string cut short.

    Args:
        value: Any value.

    Returns:
        The description.
    """
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"{str(value.dtype).removeprefix('torch.')} [{', '.join(map(str, shape))}]"
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (int, str)) or hasattr(value, "__index__"):
        text = repr(value)
        return text if len(text) <= _SHORT else f"{text[:_SHORT - 4]}…{text[-1]}"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        text = repr(value) if all(isinstance(v, (int, str)) for v in value) else ""
        return text if text and len(text) <= _SHORT else f"{len(value)} items"
    return type(value).__name__


def short_repr(name: str, parts: Mapping[str, Any], limit: int = MAX_REPR) -> str:
    """``name(key=value, ...)`` in at most ``limit`` characters: the parts in order, as many as fit,
    then ``…``.

    Args:
        name: The type's name.
        parts: What to show, in order (each value as :func:`describe` writes it).
        limit: The most characters.

    Returns:
        The repr.
    """
    shown: list[str] = []
    used = len(name) + 2
    for key, value in parts.items():
        text = f"{key}={describe(value)}"
        if used + len(text) + 2 > limit - 3:
            shown.append("…")
            break
        shown.append(text)
        used += len(text) + 2
    return f"{name}({', '.join(shown)})"


def html_table(name: str, rows: Mapping[str, Mapping[str, Any]], frame: Optional[pd.DataFrame] = None,
               frame_label: str = "frame", total: Optional[int] = None) -> str:
    """An HTML table for a notebook: the type's name as the caption, one row per group of facts,
    then the first rows of ``frame`` and its size.

    Args:
        name: The type's name.
        rows: ``{group title: {key: value}}`` (``"what"``, ``"sizes"``, ``"headline"``); empty groups
            are left out; values are written as :func:`describe` writes them.
        frame: The object's tidy table, or ``None``.
        frame_label: What the frame is, for its row's title.
        total: How many rows the whole table has, when ``frame`` holds only its first rows.

    Returns:
        The HTML (escaped, well-formed).
    """
    cells = []
    for title, facts in rows.items():
        if not facts:
            continue
        text = " · ".join(f"{html.escape(str(k))} = {html.escape(describe(v))}"
                          for k, v in facts.items())
        cells.append(f"<tr><th style='text-align:left'>{html.escape(title)}</th><td style='text-align:left'>"
                     f"{text}</td></tr>")
    if frame is not None:
        size = f"{len(frame) if total is None else total} rows × {len(frame.columns)} columns"
        head = frame.head(FIRST_ROWS).to_html(max_cols=12, border=0, float_format=lambda x: f"{x:.4g}")
        cells.append(f"<tr><th style='text-align:left'>{html.escape(frame_label)}<br>({size}, first "
                     f"{min(FIRST_ROWS, len(frame))})</th><td>{head}</td></tr>")
    return (f"<table class='arithinterp-summary'><caption style='text-align:left'><b>{html.escape(name)}</b>"
            f"</caption>{''.join(cells)}</table>")
