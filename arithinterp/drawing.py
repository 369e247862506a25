"""The drawers of results: a registry that :mod:`arithinterp.viz` fills and every result's ``plot()`` reads.

A result never imports the plotting layer. Its ``plot()`` (and ``show()``, where it has an interactive
page) calls :func:`draw`, which looks up the function registered for the result's type and that name.
``arithinterp.viz`` registers its figure builders with :func:`draws` as its modules load; :func:`draw`
loads the module that draws the result by name (:data:`DRAWERS_PACKAGE`, :data:`DRAWER_MODULES`) the
first time a figure is asked for, as pandas loads its plotting backend, so importing an analysis
imports neither ``viz`` nor plotly and the imports point one way.

A user's own result type draws the same way: register a function taking the result first::

    from arithinterp.drawing import draws

    @draws(MyResult)
    def plot_my_result(result, *, title=None): ...

    MyResult(...).plot()   # when MyResult.plot returns draw(self, **kwargs)
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, TypeVar

from arithinterp.errors import ConfigError

#: The package whose import registers the package's drawers.
DRAWERS_PACKAGE = "arithinterp.viz"
#: Its module that draws an analysis's results where the name differs from the analysis's, and the
#: module of the interactive pages (``show``). Loading only the module a figure needs keeps the first
#: figure quick: every drawer module together loads every analysis (2.9 s on 2 CPU cores; one, 0.35 s).
DRAWER_MODULES = {"helix": "fourier", "show": "graph_view"}

_F = TypeVar("_F", bound=Callable[..., Any])
_DRAWERS: dict[tuple[type, str], Callable[..., Any]] = {}


def draws(result_type: type, name: str = "plot") -> Callable[[_F], _F]:
    """Register the decorated function as what ``result_type``'s ``name`` method draws.

    Args:
        result_type: The result class (its subclasses inherit the drawer unless they register one).
        name: The drawing method: ``"plot"`` (a plotly figure) or ``"show"`` (an interactive page).

    Returns:
        A decorator that registers a function ``f(result, **options)`` and returns it unchanged.
    """
    def register(function: _F) -> _F:
        _DRAWERS[result_type, name] = function
        return function

    return register


def _lookup(result_type: type, name: str) -> Callable[..., Any] | None:
    for cls in result_type.__mro__:
        if (cls, name) in _DRAWERS:
            return _DRAWERS[cls, name]
    return None


def _drawer_module(result_type: type, name: str) -> str:
    """The module of :data:`DRAWERS_PACKAGE` that draws ``result_type`` (the package itself for a
    type from elsewhere)."""
    parts = result_type.__module__.split(".")
    key = name if name in DRAWER_MODULES else (parts[1] if len(parts) > 1 and parts[0] == "arithinterp" else "")
    module = f"{DRAWERS_PACKAGE}.{DRAWER_MODULES.get(key, key)}"
    return module if key and importlib.util.find_spec(module) is not None else DRAWERS_PACKAGE


def draw(result: Any, name: str = "plot", /, **options: Any) -> Any:
    """Draw ``result`` with the function registered for its type and ``name``.

    Args:
        result: The result to draw.
        name: ``"plot"`` or ``"show"``.
        **options: Passed to the drawer (titles, which view, ...).

    Returns:
        What the drawer returns: a plotly ``Figure`` for ``"plot"``, a page for ``"show"``.

    Raises:
        ConfigError: no drawer is registered for this type and name, even after the drawers
            package has loaded.
    """
    drawer = _lookup(type(result), name)
    if drawer is None:
        importlib.import_module(_drawer_module(type(result), name))  # its import registers the drawers
        drawer = _lookup(type(result), name)
    if drawer is None:
        known = sorted({cls.__name__ for cls, kind in _DRAWERS if kind == name})
        raise ConfigError(f"no {name!r} drawer is registered for {type(result).__name__}; register one with "
                          f"arithinterp.drawing.draws({type(result).__name__}); registered: {', '.join(known)}")
    return drawer(result, **options)


__all__ = ["DRAWERS_PACKAGE", "DRAWER_MODULES", "draw", "draws"]
