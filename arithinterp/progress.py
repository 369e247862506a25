"""Progress of long loops: a tqdm bar on a terminal or in a notebook, log lines anywhere else.

A bar redraws one line with carriage returns, so a log file, a CI log or a batch job's output shows
nothing until the loop ends (or one endless line). When stderr is not a terminal and the code does
not run in a notebook, :func:`progress_bar` writes whole lines instead: the bar's description, count,
percentage, elapsed time and time left, once each tenth of the work is done or every
:data:`LOG_EVERY_SECONDS` while a tenth takes longer (never more often than every
:data:`LOG_AT_MOST_EVERY_SECONDS`), and a last line when the loop ends. A loop too short to log on
the way writes only its last line.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Iterable, Optional

from tqdm.std import tqdm as std_tqdm

LOG_EVERY_SECONDS = 30.0  # a line at least this often while a loop runs
LOG_AT_MOST_EVERY_SECONDS = 5.0  # and no more often than this (a loop of short steps logs its tenths, not each)
LOG_STEPS = 10  # a line per tenth of the work


class LogLines(std_tqdm):
    """A tqdm bar that writes whole lines (see the module docstring): same arguments, same counts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # every step reaches display(), which decides whether a line is due; a log's bar is ASCII
        kwargs.update(mininterval=0.0, miniters=1)
        kwargs.setdefault("ascii", True)
        self._logged_at = time.monotonic()
        self._logged_step, self._logged_n = 0, 0
        super().__init__(*args, **kwargs)

    def _step(self) -> int:
        """Which tenth of the work is done (0 without a total)."""
        return math.floor(LOG_STEPS * self.n / self.total) if self.total else 0

    def _write_line(self) -> None:
        self.fp.write(self.__str__() + "\n")
        self.fp.flush()
        self._logged_at, self._logged_step, self._logged_n = time.monotonic(), self._step(), self.n

    def display(self, msg: Optional[str] = None, pos: Optional[int] = None) -> None:
        """Write a line when one is due; clearing messages (``msg``) and cursor moves are not written.

        Args:
            msg: tqdm's message to show instead of the bar (a clearing ``""``): ignored.
            pos: tqdm's row for the bar: ignored (lines follow each other).
        """
        if msg is not None or self.n == self._logged_n:
            return
        waited = time.monotonic() - self._logged_at
        if waited < LOG_AT_MOST_EVERY_SECONDS or (self._step() <= self._logged_step and waited < LOG_EVERY_SECONDS):
            return
        self._write_line()

    def close(self) -> None:
        """Write the last line (what was done, in how long), then close without tqdm's clearing."""
        if self.disable:
            return
        if self.n != self._logged_n or self._logged_n == 0:
            self._write_line()
        self.leave = False  # tqdm's close then clears the display, which writes nothing here
        super().close()


def _in_notebook() -> bool:
    """Whether tqdm draws its bars as notebook widgets here (a Jupyter kernel with ipywidgets)."""
    notebook = sys.modules.get("tqdm.notebook")
    if notebook is None:
        return False
    from tqdm.auto import tqdm as auto

    return issubclass(auto, notebook.tqdm)


def progress_bar(iterable: Optional[Iterable] = None, *, desc: str = "", total: Optional[float] = None,
                 disable: Optional[bool] = False, **kwargs: Any) -> std_tqdm:
    """A progress bar for a long loop: tqdm's bar on a terminal or in a notebook, :class:`LogLines`
    when stderr is neither (a log file, a pipe, a job's output).

    Args:
        iterable: What the loop runs over (``None``: call ``update`` by hand).
        desc: What the loop does, the start of every line.
        total: How many steps (default: ``len(iterable)``).
        disable: ``True`` shows nothing (an analysis's ``progress=False``); ``None`` counts as ``False``
            (a log gets its lines where tqdm's own ``None`` would stay silent).
        **kwargs: Further tqdm arguments (``unit``, ``initial``, ``leave``).

    Returns:
        The bar, iterable as tqdm's.
    """
    if disable:
        return std_tqdm(iterable, desc=desc, total=total, disable=True, **kwargs)
    stream = kwargs.get("file") or sys.stderr
    if _in_notebook() or (hasattr(stream, "isatty") and stream.isatty()):
        from tqdm.auto import tqdm as auto

        return auto(iterable, desc=desc, total=total, **kwargs)
    return LogLines(iterable, desc=desc, total=total, **kwargs)
