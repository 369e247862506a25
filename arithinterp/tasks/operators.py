"""The arithmetic of the tasks: operators, true answers, and the operand values they take.

Operands and answers are stored as int64, so both must lie within ±(2**63 − 1); values are ints
(or integer numpy / torch scalars), never strings or floats converted on the way in.
"""

from __future__ import annotations

import collections.abc
import itertools
import operator
import re
from typing import Any, Callable, Iterable, Optional, Union

from arithinterp.errors import ConfigError, TaskError

OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
}
#: The largest operand or answer magnitude: operands and answers are stored as int64.
INT64_MAX = 2**63 - 1
#: The most operand values (and prompts) a prompt set is built from: ~16.8 million, refused beyond
#: rather than filling memory (``range(10**9)`` would need tens of GB before tokenizing anything).
MAX_PROMPTS = 2**24


def compute(op: str, a: int, b: int, modulus: Optional[int] = None) -> int:
    """The true answer of ``a op b`` (reduced mod ``modulus`` when given).

    Args:
        op: A key of :data:`OPERATORS` (``"+"``, ``"-"``, ``"*"``, ``"//"``, ``"mod"``).
        a: The first operand.
        b: The second operand.
        modulus: Reduce the answer mod this; ``None`` (or 0) leaves it as is.

    Returns:
        The answer as a Python int.

    Raises:
        ConfigError: ``op`` is not an operator.
        TaskError: an operand is not an integer, or ``b == 0`` for
            ``"//"`` or ``"mod"``.
    """
    # checked by hand rather than declared: this runs once per prompt, and these checks cost nanoseconds
    function = OPERATORS.get(op) if isinstance(op, str) else None
    if function is None:
        raise ConfigError(f"unknown operator {op!r}; accepted: {', '.join(map(repr, OPERATORS))}")
    try:
        a, b = operator.index(a), operator.index(b)  # ints and integer numpy / torch scalars, never "1" or 1.5
    except TypeError as error:
        raise TaskError(f"operands must be integers, got a={a!r} and b={b!r}") from error
    if not defined(op, b):
        raise TaskError(f"{a} {op} {b} is undefined: a division or remainder by zero")
    value = function(a, b)
    return value % modulus if modulus else value


def defined(op: str, b: int) -> bool:
    """Whether ``a op b`` is defined for every ``a``: ``//`` and ``mod`` need ``b != 0``.

    Args:
        op: A key of :data:`OPERATORS`.
        b: The second operand.

    Returns:
        ``False`` for a division or remainder by zero, else ``True``.
    """
    return not (op in ("//", "mod") and b == 0)


def operand_values(name: str, values: Union[int, Iterable[int]]) -> list[int]:
    """``values`` (an int or an iterable of ints) as a list of ints: strings and non-integers are
    refused, never converted.

    Args:
        name: The parameter's name, for the error message (``"a"``, ``"b"``, ``"numbers"``).
        values: One int, or an iterable of ints (integer numpy / torch scalars included).

    Returns:
        The values as Python ints, in order.

    Raises:
        TaskError: ``values`` is a string, holds a non-integer, is empty, holds a value beyond 64 bits,
            or holds more than :data:`MAX_PROMPTS` values.
    """
    if isinstance(values, (str, bytes)):
        raise TaskError(f"{name} must be an int or an iterable of ints, got the string {values!r}; "
                        f"write e.g. {name}=[123] or {name}=range(100)")
    if isinstance(values, bool):  # an int, but never an operand
        raise TaskError(f"{name} must be an int or an iterable of ints, got {values!r}")
    if isinstance(values, int):
        values = [values]
    # a sized collection is measured, anything else read at most one past the limit: a huge range or an
    # endless generator is refused, not listed
    items: list = []
    too_many = isinstance(values, collections.abc.Sized) and len(values) > MAX_PROMPTS
    if not too_many:
        try:
            items = list(itertools.islice(values, MAX_PROMPTS + 1))
        except TypeError as error:
            raise TaskError(f"{name} must be an int or an iterable of ints, got {values!r}") from error
        too_many = len(items) > MAX_PROMPTS
    if too_many:
        raise TaskError(f"{name} holds more than {MAX_PROMPTS:,} values; give at most {MAX_PROMPTS:,} (a prompt set "
                        "holds one prompt per value)")
    out = []
    for v in items:
        try:
            if isinstance(v, (bool, str, bytes)):
                raise TypeError
            value = operator.index(v)  # ints and integer numpy / torch scalars, never floats
        except TypeError as error:
            raise TaskError(f"{name} must hold integers, got {v!r} ({type(v).__name__}); "
                            "round or convert the values yourself") from error
        if abs(value) > INT64_MAX:
            raise TaskError(f"{name}={value} does not fit in 64 bits; operands must lie within ±(2**63 - 1)")
        out.append(value)
    if not out:
        raise TaskError(f"{name} is empty; give at least one operand value")
    return out


def parse_operands(operands: Any) -> list[int]:
    """Operand values from a range, a list, or ints.

    Args:
        operands: ``"LO-HI"`` (inclusive), ``"1,5,9"``, or an iterable of non-negative ints.

    Returns:
        The values.

    Raises:
        ConfigError: Another form, an empty or negative list, or a value past int64.
    """
    if isinstance(operands, str):
        text = operands.replace(" ", "")
        span = re.fullmatch(r"(\d+)-(\d+)", text)
        if span and int(span.group(1)) <= int(span.group(2)):
            values = list(range(int(span.group(1)), int(span.group(2)) + 1))
        elif re.fullmatch(r"\d+(,\d+)*", text):
            values = [int(v) for v in text.split(",")]
        else:
            raise ConfigError(
                f"operands must be a range 'LO-HI' (inclusive, e.g. '0-99') or a list '1,5,9', got {operands!r}")
    else:
        try:
            values = [int(v) for v in operands]
        except (TypeError, ValueError) as error:
            raise ConfigError(f"operands must be non-negative ints, 'LO-HI' or '1,5,9', got {operands!r}") from error
    if not values or min(values) < 0:
        raise ConfigError(f"operands must be a non-empty list of non-negative ints, got {operands!r}")
    if max(values) > INT64_MAX:  # operands are int64 tensors: a refusal here, not torch's overflow traceback
        raise ConfigError(f"operands must be at most 2**63 - 1 ({INT64_MAX:,}), what int64 holds; "
                          f"got {max(values):,}")
    return values
