"""The rules of a heuristic classification: the operators, one rule over the operand grid
(:class:`Heuristic`), the grid it is evaluated on (:class:`Grid`) and a family of rules (:class:`Family`)
(Nikankin et al. 2025, "Arithmetic Without Algorithms")."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from arithinterp.errors import ConfigError, accepted
from arithinterp.types import Modulus, checked

OPS = ("+", "-", "*", "//", "mod")
MAP_KINDS = ("K", "KV")


# --- operators -----------------------------------------------------------------------------------


def check_op(op: str) -> None:
    """Refuse an unknown operator (a modulus is a declared :data:`~arithinterp.types.Modulus` of the
    public functions that take one).

    Args:
        op: One of :data:`OPS`.

    Raises:
        ConfigError: ``op`` is unknown.
    """
    if op not in OPS:
        raise ConfigError(f"unknown operator {op!r}; accepted: {accepted(OPS)}")


@checked
def apply_op(
    a: torch.Tensor, b: torch.Tensor, op: str, modulus: Optional[Modulus] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The task's result ``a op b`` (mod ``modulus``) and where it is defined, elementwise.

    Division by zero is undefined (its result is set to 0).

    Args:
        a: First operands (any shape; broadcast with ``b``).
        b: Second operands.
        op: One of :data:`OPS` (``"//"`` is integer division, ``"mod"`` is ``a mod b``).
        modulus: Reduce the result mod this (``None``: not reduced).

    Returns:
        ``(result, defined)``, both shaped like the broadcast of ``a`` and ``b``.

    Raises:
        ConfigError: ``op`` is unknown, or ``modulus`` is not an int >= 2 or None.
    """
    check_op(op)
    a, b = torch.broadcast_tensors(torch.as_tensor(a).long(), torch.as_tensor(b).long())
    defined = torch.ones_like(a, dtype=torch.bool)
    if op == "+":
        result = a + b
    elif op == "-":
        result = a - b
    elif op == "*":
        result = a * b
    else:
        defined = b != 0
        safe = torch.where(defined, b, torch.ones_like(b))
        result = torch.div(a, safe, rounding_mode="floor") if op == "//" else torch.remainder(a, safe)
        result = torch.where(defined, result, torch.zeros_like(result))
    if modulus:
        result = torch.remainder(result, modulus)
    return result, defined


# --- heuristics and families ----------------------------------------------------------------------


@dataclass(frozen=True)
class Heuristic:
    """One rule over the operand grid.

    ``predicate(a, b)`` or ``predicate(a, b, result)`` takes LongTensors of operands (and the
    task's result) of any shape and returns a bool mask of the same shape. ``map_kind`` is
    ``"K"`` for operand heuristics (scored on K maps) or ``"KV"`` for result heuristics (scored
    on KV maps).
    """

    name: str
    family: str
    map_kind: str
    predicate: Callable[..., torch.Tensor]

    def mask(self, a: torch.Tensor, b: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """The predicate on operand / result tensors, as a bool tensor of their shape.

        Args:
            a: First operands, long (any shape).
            b: Second operands, the shape of ``a``.
            result: The task's results, the shape of ``a``.

        Returns:
            A bool mask, the shape of ``a``.

        Raises:
            ConfigError: the predicate is not vectorised (returns another shape).
        """
        if _arity(self.predicate) >= 3:
            out = self.predicate(a, b, result)
        else:
            out = self.predicate(a, b)
        out = torch.as_tensor(out)
        if out.shape != a.shape:
            raise ConfigError(
                f"heuristic {self.name!r}: predicate returned shape {tuple(out.shape)}, expected the "
                f"operand shape {tuple(a.shape)} (it must be vectorised over the grid)"
            )
        return out.bool()


def _arity(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 3
    # parameters with defaults are bound constants (``lambda a, b, n=5: ...``), not inputs
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 3
    return len(positional)


@dataclass(frozen=True)
class Grid:
    """The legal cells of an operand grid, flattened: operands, result, and the value lists."""

    a: torch.Tensor  # [C] long
    b: torch.Tensor  # [C] long
    result: torch.Tensor  # [C] long
    a_values: tuple[int, ...]
    b_values: tuple[int, ...]
    op: str
    modulus: Optional[int]


@dataclass(frozen=True)
class Family:
    """A family of heuristics generated for a grid: ``generate(grid) -> list[Heuristic]``.

    ``ops`` limits the family to some operators (``None``: every operator).
    """

    name: str
    map_kind: str
    generate: Callable[[Grid], list]
    ops: Optional[tuple[str, ...]] = None
