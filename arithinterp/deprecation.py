"""Old names that keep working for a while: each use warns with a ``DeprecationWarning`` that
names the new one (as scikit-learn's ``deprecated`` does), so code can move before they go.

* :func:`deprecated` — an old function name: a wrapper that warns, then calls the new function;
* :func:`renamed_keyword` — an old keyword argument: its value, taken with a warning.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional, TypeVar

from arithinterp.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def warn_renamed(old: str, new: str, stacklevel: int = 1) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``.

    Args:
        old: The deprecated name, as the user wrote it.
        new: The name to use instead.
        stacklevel: Which frame the warning points at, counted from the caller (1: the caller).
    """
    warnings.warn(f"{old} is deprecated; use {new} instead", DeprecationWarning, stacklevel=stacklevel + 1)


def deprecated(old: str, new: str) -> Callable[[F], F]:
    """Decorate the new function into its old name: ``sweep = deprecated("patching.sweep",
    "patching.activation_patching")(activation_patching)`` is a function that warns on each call
    and returns what the new one returns.

    Args:
        old: The deprecated dotted name; its last part names the alias.
        new: The dotted name of the function to use instead.

    Returns:
        A decorator that turns the new function into the warning alias.
    """

    def wrap(function: F) -> F:
        @functools.wraps(function)
        def alias(*args: Any, **kwargs: Any) -> Any:
            warn_renamed(old, new, stacklevel=2)
            return function(*args, **kwargs)

        alias.__name__ = alias.__qualname__ = old.rsplit(".", 1)[-1]
        alias.__doc__ = f"Deprecated: use :func:`{new}` (this old name warns and calls it)."
        return alias  # type: ignore[return-value]

    return wrap


def renamed_keyword(where: str, old: str, old_value: Optional[T], new: str, new_value: T, default: T) -> T:
    """The value of a renamed keyword argument, taking the deprecated name with a warning.

    Args:
        where: The function, for the messages.
        old: The deprecated keyword.
        old_value: The value given under ``old``; ``None`` when it was not given.
        new: The keyword to use instead.
        new_value: The value given under ``new``.
        default: ``new``'s default, to tell whether it was given.

    Returns:
        ``new_value`` when ``old`` was not given, else ``old_value``.

    Raises:
        ConfigError: Both keywords were given, with different values.
    """
    if old_value is None:
        return new_value
    warn_renamed(f"{where}({old}=...)", f"{where}({new}=...)", stacklevel=3)
    if new_value != default and new_value != old_value:
        raise ConfigError(f"{where}: {old}= is the old name of {new}=; give {new}= alone, got "
                          f"{new}={new_value!r} and {old}={old_value!r}")
    return old_value

