"""Heuristics evaluated on a grid: :func:`build_heuristics` → :class:`HeuristicSet`, every heuristic of
the chosen families (and a registry's single ones) as a predicate over the legal cells
(Nikankin et al. 2025, "Arithmetic Without Algorithms").

The rules themselves are in :mod:`~arithinterp.neurons.rules`, the built-in families in
:mod:`~arithinterp.neurons.families`, the registry in :mod:`~arithinterp.neurons.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch

from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.neurons.registry import HeuristicRegistry, check_registry
from arithinterp.neurons.rules import Grid, Heuristic, apply_op, check_op
from arithinterp.types import Modulus, PositiveInt, checked


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
        """The heuristics' names, in column order.
        """
        return [h.name for h in self.heuristics]

    @property
    def families(self) -> list[str]:
        """The heuristics' families, in column order.
        """
        return [h.family for h in self.heuristics]

    @property
    def map_kinds(self) -> list[str]:
        """The heuristics' map kinds (``"K"`` / ``"KV"``), in column order.
        """
        return [h.map_kind for h in self.heuristics]

    def kind(self, map_kind: str) -> torch.Tensor:
        """Indices of the heuristics of one map kind.

        Args:
            map_kind: ``"K"`` or ``"KV"``.

        Returns:
            Column indices, long.
        """
        return torch.tensor([i for i, h in enumerate(self.heuristics) if h.map_kind == map_kind], dtype=torch.long)


def values_tensor(name: str, values) -> torch.Tensor:
    """A grid axis's operand values as a long tensor, refused when empty or repeated.

    Args:
        name: The argument's name, for the message.
        values: The values (a sequence or a tensor).

    Returns:
        long [n].

    Raises:
        AnalysisError: the values are not integers, are empty, or repeat.
    """
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
    modulus: Optional[Modulus] = None,
    legal: Optional[torch.Tensor] = None,
    families: Optional[Sequence[str]] = None,
    custom: bool = True,
    min_cells: PositiveInt = 3,
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

    Returns:
        The kept heuristics with their ``[cells, H]`` predicates over the legal cells.

    Raises:
        ConfigError: an unknown family, a ``modulus`` below 2, or ``min_cells`` / ``max_fraction`` out of range.
        TaskError: an unknown operator.
        AnalysisError: no legal cell, or no heuristic left.
    """
    check_op(op)
    registry = check_registry(registry)
    a_vals, b_vals = values_tensor("a_values", a_values), values_tensor("b_values", b_values)
    if families is None:
        chosen = [f for f in registry.families.values() if f.ops is None or op in f.ops]
    else:
        unknown = [f for f in families if f not in registry.families]
        if unknown:
            raise ConfigError(f"unknown heuristic families {unknown}; accepted: {accepted(registry.families)}")
        chosen = [registry.families[f] for f in families]
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
