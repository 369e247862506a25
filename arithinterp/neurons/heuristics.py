"""Heuristics: the operators, the rules over an operand grid, their families, the registry object
that holds them (:class:`HeuristicRegistry`), and the set of heuristics evaluated on a grid
(Nikankin et al. 2025, "Arithmetic Without Algorithms")."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from arithinterp.checks import integer
from arithinterp.errors import AnalysisError, ConfigError, TaskError, accepted
from arithinterp.types import checked

OPS = ("+", "-", "*", "//", "mod")
MAP_KINDS = ("K", "KV")


# --- operators -----------------------------------------------------------------------------------


def check_op(op: str, modulus: Optional[int] = None) -> None:
    if op not in OPS:
        raise TaskError(f"unknown operator {op!r}; accepted: {accepted(OPS)}")
    if modulus is not None:
        integer("modulus", modulus, minimum=2, error=TaskError, hint=" or None")


@checked
def apply_op(
    a: torch.Tensor, b: torch.Tensor, op: str, modulus: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The task's result ``a op b`` (mod ``modulus``) and where it is defined, elementwise.

    ``op`` is one of :data:`OPS` (``"//"`` is integer division, ``"mod"`` is ``a mod b``).
    Returns ``(result, defined)``, both shaped like the broadcast of ``a`` and ``b``; division by
    zero is undefined (its result is set to 0).
    """
    check_op(op, modulus)
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
        """The predicate on operand / result tensors, as a bool tensor of their shape."""
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


def _check_kind(map_kind: str) -> None:
    if map_kind not in MAP_KINDS:
        raise ConfigError(f"unknown map kind {map_kind!r}; accepted: {accepted(MAP_KINDS)}")


class HeuristicRegistry:
    """The heuristic families and single heuristics a classification scores.

    A registry is a plain object passed to :func:`build_heuristics` / ``classify_maps`` /
    ``classify`` (``registry=``); nothing is registered process-wide, so a classification
    depends only on the registry it is given. ``HeuristicRegistry()`` holds the built-in
    families (:data:`BUILTIN_FAMILIES`) and no single heuristic; ``HeuristicRegistry(families=())``
    starts empty. :meth:`copy` gives an independent registry to extend.

    >>> registry = HeuristicRegistry()
    >>> registry.add("a > b + 50", "custom", lambda a, b: a > b + 50, "K")  # doctest: +ELLIPSIS
    Heuristic(...)
    """

    def __init__(self, families: Optional[Iterable[Family]] = None, heuristics: Iterable[Heuristic] = ()):
        self._families: dict[str, Family] = {}
        self._heuristics: dict[str, Heuristic] = {}
        self._cache: dict[tuple, dict[str, Heuristic]] = {}
        for family in BUILTIN_FAMILIES if families is None else families:
            if not isinstance(family, Family):
                raise ConfigError(f"families must be Family objects, got {type(family).__name__}")
            self.add_family(family.name, family.map_kind, family.generate, family.ops)
        for h in heuristics:
            if not isinstance(h, Heuristic):
                raise ConfigError(f"heuristics must be Heuristic objects, got {type(h).__name__}")
            self.add(h.name, h.family, h.predicate, h.map_kind)

    def __repr__(self) -> str:
        return f"HeuristicRegistry(families={list(self._families)}, heuristics={list(self._heuristics)})"

    @property
    def families(self) -> Mapping[str, Family]:
        """The families by name (read-only view; change it with :meth:`add_family`)."""
        return MappingProxyType(self._families)

    @property
    def heuristics(self) -> list[Heuristic]:
        """The single heuristics added with :meth:`add`."""
        return list(self._heuristics.values())

    def copy(self) -> "HeuristicRegistry":
        """An independent registry with the same families and heuristics."""
        return HeuristicRegistry(self._families.values(), self._heuristics.values())

    def add(self, name: str, family: str, predicate: Callable[..., torch.Tensor], map_kind: str, *,
            overwrite: bool = False) -> Heuristic:
        """Add one heuristic to this registry.

        Args:
            name: unique label, e.g. ``"a > b + 50"``.
            family: the heuristic type it is counted under in histograms.
            predicate: ``predicate(a, b)`` or ``predicate(a, b, result)`` → bool mask, vectorised.
            map_kind: ``"K"`` (scored on activation maps) or ``"KV"`` (on activation × logit maps).
            overwrite: replace a heuristic of the same name.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"heuristic name must be a non-empty string, got {name!r}")
        if not isinstance(family, str) or not family:
            raise ConfigError(f"heuristic family must be a non-empty string, got {family!r}")
        if not callable(predicate):
            raise ConfigError(
                f"predicate must be callable (a, b[, result]) -> bool mask, got {type(predicate).__name__}")
        _check_kind(map_kind)
        if name in self._heuristics and not overwrite:
            raise ConfigError(
                f"a heuristic named {name!r} is already in this registry; pass overwrite=True to replace it")
        heuristic = Heuristic(name, family, map_kind, predicate)
        probe = torch.arange(4)
        heuristic.mask(probe, probe, probe)  # fails early if the predicate is not vectorised
        self._heuristics[name] = heuristic
        return heuristic

    def remove(self, name: str) -> None:
        """Remove a heuristic added with :meth:`add`."""
        if name not in self._heuristics:
            raise ConfigError(
                f"no heuristic named {name!r} in this registry; it holds: {accepted(self._heuristics) or 'none'}")
        del self._heuristics[name]

    def add_family(self, name: str, map_kind: str, generate: Callable[[Grid], list],
                   ops: Optional[Sequence[str]] = None, *, overwrite: bool = False) -> Family:
        """Add a family: ``generate(grid)`` returns the family's heuristics for a :class:`Grid`;
        ``ops`` limits it to some operators (``None``: every operator)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"family name must be a non-empty string, got {name!r}")
        _check_kind(map_kind)
        if not callable(generate):
            raise ConfigError(f"generate must be callable (grid) -> list of Heuristic, got {type(generate).__name__}")
        if name in self._families and not overwrite:
            raise ConfigError(f"a family named {name!r} is already in this registry; pass overwrite=True to replace it")
        if ops is not None:
            for op in ops:
                check_op(op)
        self._families[name] = Family(name, map_kind, generate, tuple(ops) if ops is not None else None)
        self._cache.clear()
        return self._families[name]

    def remove_family(self, name: str) -> None:
        """Remove a family from this registry."""
        if name not in self._families:
            raise ConfigError(
                f"no family named {name!r} in this registry; it holds: {accepted(self._families) or 'none'}")
        del self._families[name]
        self._cache.clear()

    def find(self, name: str, family: str, grid: Grid) -> Optional[Heuristic]:
        """The heuristic called ``name`` of ``family`` on ``grid`` (``None`` if this registry
        does not produce it)."""
        if name in self._heuristics:
            return self._heuristics[name]
        generator = self._families.get(family)
        if generator is None:
            return None
        key = (family, grid.op, grid.modulus, grid.a_values, grid.b_values, grid.a.numpy().tobytes(),
               grid.b.numpy().tobytes())
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = {h.name: h for h in generator.generate(grid)}
        return self._cache[key].get(name)


def check_registry(registry: Optional[HeuristicRegistry]) -> HeuristicRegistry:
    if registry is None:
        return HeuristicRegistry()
    if not isinstance(registry, HeuristicRegistry):
        raise ConfigError(f"registry must be a HeuristicRegistry, got {type(registry).__name__}")
    return registry


@dataclass(frozen=True)
class HeuristicSet:
    """Heuristics evaluated on the legal cells of a grid.

    ``predicates`` is ``[cells, H]`` bool over the legal cells (``legal`` is ``[A, B]`` bool over the
    full grid), ``counts`` the number of legal cells each heuristic holds (its k).
    """

    heuristics: tuple[Heuristic, ...]
    predicates: torch.Tensor
    counts: torch.Tensor
    legal: torch.Tensor
    grid: Grid
    dropped: dict

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.heuristics]

    @property
    def families(self) -> list[str]:
        return [h.family for h in self.heuristics]

    @property
    def map_kinds(self) -> list[str]:
        return [h.map_kind for h in self.heuristics]

    def kind(self, map_kind: str) -> torch.Tensor:
        """Indices of the heuristics of one map kind."""
        return torch.tensor([i for i, h in enumerate(self.heuristics) if h.map_kind == map_kind], dtype=torch.long)


def values_tensor(name: str, values) -> torch.Tensor:
    try:
        out = torch.as_tensor(list(values) if not isinstance(values, torch.Tensor) else values).long().flatten()
    except (TypeError, ValueError) as error:
        raise AnalysisError(f"{name} must be a sequence of integers, got {values!r}") from error
    if out.numel() == 0:
        raise AnalysisError(f"{name} is empty; give the operand values of the grid axis")
    if torch.unique(out).numel() != out.numel():
        raise AnalysisError(f"{name} has repeated values; each grid row/column needs its own operand value")
    return out


@checked
def build_heuristics(
    a_values: Union[Iterable[int], torch.Tensor],
    b_values: Union[Iterable[int], torch.Tensor],
    op: str,
    *,
    modulus: Optional[int] = None,
    legal: Optional[torch.Tensor] = None,
    families: Optional[Sequence[str]] = None,
    custom: bool = True,
    min_cells: int = 3,
    max_fraction: float = 0.5,
    registry: Optional[HeuristicRegistry] = None,
) -> HeuristicSet:
    """Every heuristic of the chosen families (plus the registry's single ones) on the grid ``a × b``.

    Args:
        a_values: the first operand's values along the grid's first axis (``A`` of them).
        b_values: the second operand's values along its second axis (``B`` of them).
        op: the task's operator (one of :data:`OPS`).
        modulus: results are reduced mod ``modulus`` (``None``: not reduced).
        legal: ``[A, B]`` bool of usable cells (default: where the operator is defined).
        families: family names of ``registry`` (default all that apply to ``op``).
        custom: include the single heuristics of ``registry`` (added with
            :meth:`HeuristicRegistry.add`).
        registry: where the families and heuristics come from (default ``HeuristicRegistry()``:
            the built-in families only).
        min_cells: drop heuristics held by fewer legal cells (a top-k of 1 or 2 cells says
            nothing).
        max_fraction: drop heuristics held by more than this fraction of the legal cells: any
            map, noise included, scores about that fraction on them, so they cannot be told
            from chance at the 0.6 threshold (on small grids a result range can hold most cells).
            A heuristic whose cells equal an earlier one's is dropped too (``result ~ ..7`` is
            ``result mod 10 = 7``). ``dropped`` counts all three reasons.
    """
    check_op(op, modulus)
    registry = check_registry(registry)
    a_vals, b_vals = values_tensor("a_values", a_values), values_tensor("b_values", b_values)
    if families is None:
        chosen = [f for f in registry.families.values() if f.ops is None or op in f.ops]
    else:
        unknown = [f for f in families if f not in registry.families]
        if unknown:
            raise ConfigError(f"unknown heuristic families {unknown}; accepted: {accepted(registry.families)}")
        chosen = [registry.families[f] for f in families]
    min_cells = integer("min_cells", min_cells, minimum=1)
    if isinstance(max_fraction, bool) or not isinstance(max_fraction, (int, float)) or not 0 < max_fraction <= 1:
        raise ConfigError(f"max_fraction must be a number in (0, 1], got {max_fraction!r}")
    A, B = torch.meshgrid(a_vals, b_vals, indexing="ij")
    result, defined = apply_op(A, B, op, modulus)
    if legal is None:
        legal = defined
    else:
        legal = torch.as_tensor(legal).bool()
        if legal.shape != A.shape:
            raise AnalysisError(f"legal must be [A, B] = {tuple(A.shape)}, got {tuple(legal.shape)}")
        legal = legal & defined
    if not legal.any():
        raise AnalysisError("no legal cell in the grid: every cell is undefined or masked")
    flat = legal.flatten()
    grid = Grid(
        A.flatten()[flat], B.flatten()[flat], result.flatten()[flat],
        tuple(a_vals.tolist()), tuple(b_vals.tolist()), op, modulus,
    )
    candidates = [h for family in chosen for h in family.generate(grid)]
    if custom:
        candidates += registry.heuristics
    columns, kept = [], []
    seen: set[tuple[str, bytes]] = set()
    dropped = dict(too_few_cells=0, too_many_cells=0, duplicate=0)
    n_legal = int(flat.sum())
    for h in candidates:
        mask = h.mask(grid.a, grid.b, grid.result)
        count = int(mask.sum())
        if count < min_cells:
            dropped["too_few_cells"] += 1
            continue
        if count > max_fraction * n_legal or count == n_legal:
            dropped["too_many_cells"] += 1
            continue
        key = (h.map_kind, np.packbits(mask.numpy()).tobytes())
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        columns.append(mask)
        kept.append(h)
    if not kept:
        raise AnalysisError("no heuristic is left on this grid (all were too small, trivial or duplicates)")
    predicates = torch.stack(columns, dim=1)
    return HeuristicSet(tuple(kept), predicates, predicates.sum(0), legal, grid, dropped)

