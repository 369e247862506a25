"""The built-in heuristic families of Nikankin et al. 2025: operand and result ranges, residues,
digit patterns, values and division's multi-result pairs, each generated for a :class:`Grid`."""

from __future__ import annotations

import itertools
from types import MappingProxyType
from typing import Mapping

import torch

from arithinterp.neurons.rules import Family, Grid, Heuristic


def _mod_family(grid: Grid) -> list[Heuristic]:
    out = []
    for who in ("a", "b", "a,b"):
        for n in range(2, 11):
            for r in range(n):
                if who == "a":
                    fn = lambda a, b, n=n, r=r: a % n == r  # noqa: E731
                elif who == "b":
                    fn = lambda a, b, n=n, r=r: b % n == r  # noqa: E731
                else:
                    fn = lambda a, b, n=n, r=r: (a % n == r) & (b % n == r)  # noqa: E731
                out.append(Heuristic(f"{who} mod {n} = {r}", "operand mod", "K", fn))
    return out


def _operand_range_family(grid: Grid) -> list[Heuristic]:
    out = []
    low = min(min(grid.a_values), min(grid.b_values))
    high = max(max(grid.a_values), max(grid.b_values))
    for width in (10, 30, 50, 100):
        for start in range(low, high + 1, width):
            stop = start + width
            for who in ("a", "b", "a,b"):
                if who == "a":
                    fn = lambda a, b, s=start, e=stop: (a >= s) & (a < e)  # noqa: E731
                elif who == "b":
                    fn = lambda a, b, s=start, e=stop: (b >= s) & (b < e)  # noqa: E731
                else:
                    fn = lambda a, b, s=start, e=stop: (a >= s) & (a < e) & (b >= s) & (b < e)  # noqa: E731
                out.append(Heuristic(f"{who} in [{start}, {stop})", "operand range", "K", fn))
    return out


def _identical_family(grid: Grid) -> list[Heuristic]:
    return [Heuristic("a = b", "identical operands", "K", lambda a, b: a == b)]


def _result_range_family(grid: Grid) -> list[Heuristic]:
    out = []
    low, high = int(grid.result.min()), int(grid.result.max())
    for width in (10, 30, 50):
        step = max(width // 3, 10)
        start = low
        while True:
            stop = start + width
            fn = lambda a, b, r, s=start, e=stop: (r >= s) & (r < e)  # noqa: E731
            out.append(Heuristic(f"result in [{start}, {stop})", "result range", "KV", fn))
            if stop > high:
                break
            start += step
    return out


def _result_mod_family(grid: Grid) -> list[Heuristic]:
    return [
        Heuristic(f"result mod {n} = {r}", "result mod", "KV", lambda a, b, res, n=n, r=r: res % n == r)
        for n in range(2, 11)
        for r in range(n)
    ]


def _digit(values: torch.Tensor, position: int) -> torch.Tensor:
    return (values // 10**position) % 10


def _pattern_family(grid: Grid) -> list[Heuristic]:
    """Zero-padded wildcard patterns on the result (``..7``, ``1.5``) that some legal result matches.

    Fully fixed patterns are value heuristics and belong to the value family.
    """
    results = torch.unique(grid.result[grid.result >= 0])
    if results.numel() == 0:
        return []
    width = len(str(int(results.max())))
    out = []
    for n_fixed in range(1, width):
        for fixed in itertools.combinations(range(width), n_fixed):  # string positions, 0 = leftmost
            powers = [width - 1 - i for i in fixed]
            digits = torch.stack([_digit(results, p) for p in powers], dim=1)
            for combo in torch.unique(digits, dim=0).tolist():
                chars = ["."] * width
                for i, d in zip(fixed, combo):
                    chars[i] = str(d)

                def fn(a, b, r, powers=tuple(powers), combo=tuple(combo)):
                    hit = r >= 0
                    for p, d in zip(powers, combo):
                        hit = hit & (_digit(r, p) == d)
                    return hit

                out.append(Heuristic(f"result ~ {''.join(chars)}", "digit pattern", "KV", fn))
    return out


def _value_family(grid: Grid) -> list[Heuristic]:
    return [
        Heuristic(f"result = {v}", "value", "KV", lambda a, b, r, v=v: r == v)
        for v in torch.unique(grid.result).tolist()
    ]


def _multi_result_family(grid: Grid) -> list[Heuristic]:
    """Division's multi-result heuristics: ``result in {v, w}`` for the two results one dividend
    gives with neighbouring divisors (``a // b`` and ``a // (b + 1)``), kept when at least two
    dividends share the pair *(choice: Nikankin et al. 2025 name the family, not its members)*."""
    a, b, r = grid.a, grid.b, grid.result
    # pair each cell's result with the result one divisor further: cells (a, b) and (a, b + 1)
    key = {}
    cells = {(int(x), int(y)): int(v) for x, y, v in zip(a.tolist(), b.tolist(), r.tolist())}
    for (x, y), v in cells.items():
        w = cells.get((x, y + 1))
        if w is not None and w != v:
            key.setdefault((min(v, w), max(v, w)), set()).add(x)
    pairs = sorted(p for p, dividends in key.items() if len(dividends) >= 2)
    return [
        Heuristic(f"result in {{{v}, {w}}}", "multi-result", "KV", lambda a, b, r, v=v, w=w: (r == v) | (r == w))
        for v, w in pairs
    ]


BUILTIN_FAMILIES: tuple[Family, ...] = (
    Family("operand mod", "K", _mod_family),
    Family("operand range", "K", _operand_range_family),
    Family("identical operands", "K", _identical_family),
    Family("result range", "KV", _result_range_family),
    Family("result mod", "KV", _result_mod_family),
    Family("value", "KV", _value_family),
    Family("digit pattern", "KV", _pattern_family),
    Family("multi-result", "KV", _multi_result_family, ops=("//",)),
)
"""The built-in families of Nikankin et al. 2025, in the order their heuristics are listed."""

FAMILIES: Mapping[str, Family] = MappingProxyType({family.name: family for family in BUILTIN_FAMILIES})
"""The built-in families by name (read-only: add families to a :class:`HeuristicRegistry`)."""
