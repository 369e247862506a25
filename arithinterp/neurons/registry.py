"""The heuristic registry: the families and single heuristics a classification scores, held in a
plain object passed to the classification (nothing is registered process-wide)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

from arithinterp.errors import ConfigError, accepted
from arithinterp.neurons.families import BUILTIN_FAMILIES
from arithinterp.neurons.rules import MAP_KINDS, Family, Grid, Heuristic, check_op


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
        """An independent registry with the same families and heuristics.

        Returns:
            The copy.
        """
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

        Returns:
            The heuristic added.

        Raises:
            ConfigError: a name, family, predicate or map kind is refused, or the name is taken.
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
        """Remove a heuristic added with :meth:`add`.

        Args:
            name: The heuristic's name.

        Raises:
            ConfigError: no such heuristic.
        """
        if name not in self._heuristics:
            raise ConfigError(
                f"no heuristic named {name!r} in this registry; it holds: {accepted(self._heuristics) or 'none'}")
        del self._heuristics[name]

    def add_family(self, name: str, map_kind: str, generate: Callable[[Grid], list],
                   ops: Optional[Sequence[str]] = None, *, overwrite: bool = False) -> Family:
        """Add a family of heuristics generated for each grid.

        Args:
            name: The family's name.
            map_kind: ``"K"`` or ``"KV"``.
            generate: ``generate(grid)`` returns the family's heuristics for a :class:`Grid`.
            ops: Limits the family to some operators (``None``: every operator).
            overwrite: Replace a family of the same name.

        Returns:
            The family added.

        Raises:
            ConfigError: a name, map kind or generator is refused, or the name is taken.
            TaskError: an operator in ``ops`` is unknown.
        """
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
        """Remove a family from this registry.

        Args:
            name: The family's name.

        Raises:
            ConfigError: no such family.
        """
        if name not in self._families:
            raise ConfigError(
                f"no family named {name!r} in this registry; it holds: {accepted(self._families) or 'none'}")
        del self._families[name]
        self._cache.clear()

    def find(self, name: str, family: str, grid: Grid) -> Optional[Heuristic]:
        """The heuristic called ``name`` of ``family`` on ``grid``.

        Args:
            name: The heuristic's name.
            family: Its family.
            grid: The grid the family generates it for.

        Returns:
            The heuristic, or ``None`` if this registry does not produce it.
        """
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
    """The registry to use: ``registry``, or the built-in families when ``None``.

    Args:
        registry: A registry, or ``None``.

    Returns:
        A registry.

    Raises:
        ConfigError: ``registry`` is not a :class:`HeuristicRegistry`.
    """
    if registry is None:
        return HeuristicRegistry()
    if not isinstance(registry, HeuristicRegistry):
        raise ConfigError(f"registry must be a HeuristicRegistry, got {type(registry).__name__}")
    return registry
