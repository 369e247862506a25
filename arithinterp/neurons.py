"""Heuristic neurons: which MLP neurons implement which simple rule, and what ablating them does.

Follows Nikankin et al. 2025, "Arithmetic Without Algorithms" (RECIPES §4):

1. :func:`importance` ranks the neurons of each layer by attribution patching on ``mlp_post`` at
   the final position (gradient of the logit difference × (corrupt − clean) activation; score =
   mean + std over prompts), or by exact activation patching, and keeps the top-k per layer.
2. :func:`maps` reads each neuron's **K map** (activation at the final position over the operand
   grid) and **KV map** (activation × the neuron's logit-lens value for the true answer token).
3. :func:`classify_maps` scores every registered heuristic for every neuron: the fraction of the
   neuron's top-k grid cells that satisfy the heuristic, with k the number of legal cells that
   satisfy it. Operand heuristics are scored on K maps, result heuristics on KV maps. A neuron
   implements a heuristic when the score reaches the threshold (0.6); several labels are allowed.
   :func:`classify` runs 1–3 on a model.
4. :func:`ablate_heuristic` and :func:`ablate_for_prompt` ablate heuristic neurons and compare
   accuracy on associated prompts against non-associated prompts / a same-size random control.

The heuristics are data (:class:`Heuristic`: a name, a family, a map kind and a vectorised
predicate over the operand grid), produced per grid by the registered families
(:data:`FAMILIES`) plus any single heuristics a user adds with :func:`register_heuristic`.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from functools import partial
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from arithinterp import sites as site_lib
from arithinterp.errors import AnalysisError, ConfigError, SiteError, TaskError, accepted
from arithinterp.results import Result, build_meta

__all__ = [
    "OPS",
    "MAP_KINDS",
    "Heuristic",
    "Family",
    "FAMILIES",
    "register_heuristic",
    "unregister_heuristic",
    "register_family",
    "registered_heuristics",
    "apply_op",
    "build_heuristics",
    "HeuristicSet",
    "score_maps",
    "classify_maps",
    "classify",
    "importance",
    "maps",
    "ablate_heuristic",
    "ablate_for_prompt",
    "HeuristicTable",
    "NeuronImportance",
    "NeuronMaps",
    "HeuristicAblation",
    "PromptAblation",
]

OPS = ("+", "-", "*", "//", "mod")
MAP_KINDS = ("K", "KV")
ABLATION_MODES = ("mean", "zero")
IMPORTANCE_METHODS = ("attribution", "ablation")


# --- operators -----------------------------------------------------------------------------------


def _check_op(op: str, modulus: Optional[int] = None) -> None:
    if op not in OPS:
        raise TaskError(f"unknown operator {op!r}; accepted: {accepted(OPS)}")
    if modulus is not None and (not isinstance(modulus, int) or isinstance(modulus, bool) or modulus < 2):
        raise TaskError(f"modulus must be an integer >= 2 or None, got {modulus!r}")


def apply_op(a: torch.Tensor, b: torch.Tensor, op: str, modulus: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The task's result ``a op b`` (mod ``modulus``) and where it is defined, elementwise.

    ``op`` is one of :data:`OPS` (``"//"`` is integer division, ``"mod"`` is ``a mod b``).
    Returns ``(result, defined)``, both shaped like the broadcast of ``a`` and ``b``; division by
    zero is undefined (its result is set to 0).
    """
    _check_op(op, modulus)
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


# --- the heuristic registry ----------------------------------------------------------------------


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
    dividends share the pair *(choice: RECIPES §4 names the family, not its members)*."""
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


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in [
        Family("operand mod", "K", _mod_family),
        Family("operand range", "K", _operand_range_family),
        Family("identical operands", "K", _identical_family),
        Family("result range", "KV", _result_range_family),
        Family("result mod", "KV", _result_mod_family),
        Family("value", "KV", _value_family),
        Family("digit pattern", "KV", _pattern_family),
        Family("multi-result", "KV", _multi_result_family, ops=("//",)),
    ]
}
"""The built-in families (RECIPES §4), in the order their heuristics are listed."""

_CUSTOM: dict[str, Heuristic] = {}


def _check_kind(map_kind: str) -> None:
    if map_kind not in MAP_KINDS:
        raise ConfigError(f"unknown map kind {map_kind!r}; accepted: {accepted(MAP_KINDS)}")


def register_heuristic(
    name: str, family: str, predicate: Callable[..., torch.Tensor], map_kind: str, *, overwrite: bool = False
) -> Heuristic:
    """Add a heuristic to every later classification.

    Args:
        name: unique label, e.g. ``"a + b = 99"``.
        family: the heuristic type it is counted under in histograms.
        predicate: ``predicate(a, b)`` or ``predicate(a, b, result)`` → bool mask, vectorised.
        map_kind: ``"K"`` (scored on activation maps) or ``"KV"`` (on activation × logit maps).
        overwrite: replace a registered heuristic of the same name.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"heuristic name must be a non-empty string, got {name!r}")
    if not isinstance(family, str) or not family:
        raise ConfigError(f"heuristic family must be a non-empty string, got {family!r}")
    if not callable(predicate):
        raise ConfigError(f"predicate must be callable (a, b[, result]) -> bool mask, got {type(predicate).__name__}")
    _check_kind(map_kind)
    if name in _CUSTOM and not overwrite:
        raise ConfigError(f"a heuristic named {name!r} is already registered; pass overwrite=True to replace it")
    heuristic = Heuristic(name, family, map_kind, predicate)
    probe = torch.arange(4)
    heuristic.mask(probe, probe, probe)  # fails early if the predicate is not vectorised
    _CUSTOM[name] = heuristic
    return heuristic


def unregister_heuristic(name: str) -> None:
    """Remove a heuristic added with :func:`register_heuristic`."""
    if name not in _CUSTOM:
        raise ConfigError(f"no registered heuristic named {name!r}; registered: {accepted(_CUSTOM) or 'none'}")
    del _CUSTOM[name]


def registered_heuristics() -> list[Heuristic]:
    """The heuristics added with :func:`register_heuristic`."""
    return list(_CUSTOM.values())


def register_family(name: str, map_kind: str, generate: Callable[[Grid], list], ops: Optional[Sequence[str]] = None, *, overwrite: bool = False) -> Family:
    """Add a family: ``generate(grid)`` returns the family's heuristics for a :class:`Grid`."""
    _check_kind(map_kind)
    if name in FAMILIES and not overwrite:
        raise ConfigError(f"a family named {name!r} exists; pass overwrite=True to replace it")
    if ops is not None:
        for op in ops:
            _check_op(op)
    FAMILIES[name] = Family(name, map_kind, generate, tuple(ops) if ops is not None else None)
    return FAMILIES[name]


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


def _values_tensor(name: str, values) -> torch.Tensor:
    try:
        out = torch.as_tensor(list(values) if not isinstance(values, torch.Tensor) else values).long().flatten()
    except (TypeError, ValueError) as error:
        raise AnalysisError(f"{name} must be a sequence of integers, got {values!r}") from error
    if out.numel() == 0:
        raise AnalysisError(f"{name} is empty; give the operand values of the grid axis")
    if torch.unique(out).numel() != out.numel():
        raise AnalysisError(f"{name} has repeated values; each grid row/column needs its own operand value")
    return out


def build_heuristics(
    a_values: Iterable[int],
    b_values: Iterable[int],
    op: str,
    *,
    modulus: Optional[int] = None,
    legal: Optional[torch.Tensor] = None,
    families: Optional[Sequence[str]] = None,
    custom: bool = True,
    min_cells: int = 3,
    max_fraction: float = 0.5,
) -> HeuristicSet:
    """Every heuristic of the chosen families (plus registered ones) on the grid ``a × b``.

    Args:
        a_values, b_values: the operand values along the grid's axes (``A`` and ``B`` of them).
        op, modulus: the task's operator (one of :data:`OPS`), results reduced mod ``modulus``.
        legal: ``[A, B]`` bool of usable cells (default: where the operator is defined).
        families: family names (default all that apply to ``op``).
        custom: include heuristics added with :func:`register_heuristic`.
        min_cells: drop heuristics held by fewer legal cells (a top-k of 1 or 2 cells says
            nothing).
        max_fraction: drop heuristics held by more than this fraction of the legal cells: any
            map, noise included, scores about that fraction on them, so they cannot be told
            from chance at the 0.6 threshold (on small grids a result range can hold most cells).
            A heuristic whose cells equal an earlier one's is dropped too (``result ~ ..7`` is
            ``result mod 10 = 7``). ``dropped`` counts all three reasons.
    """
    _check_op(op, modulus)
    a_vals, b_vals = _values_tensor("a_values", a_values), _values_tensor("b_values", b_values)
    if families is None:
        chosen = [f for f in FAMILIES.values() if f.ops is None or op in f.ops]
    else:
        unknown = [f for f in families if f not in FAMILIES]
        if unknown:
            raise ConfigError(f"unknown heuristic families {unknown}; accepted: {accepted(FAMILIES)}")
        chosen = [FAMILIES[f] for f in families]
    if not isinstance(min_cells, int) or min_cells < 1:
        raise ConfigError(f"min_cells must be a positive integer, got {min_cells!r}")
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
        candidates += list(_CUSTOM.values())
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


# --- scoring (pure, vectorised) ------------------------------------------------------------------


def _keys(values: torch.Tensor, tiebreak: np.ndarray) -> np.ndarray:
    """Unique int64 sort keys [n, C]: the float's order in the high 32 bits, ``tiebreak`` (a
    permutation of 0..C-1) in the low bits, so equal activations (ReLU zeros) are ordered at
    random and every top-k holds exactly k cells."""
    bits = values.float().contiguous().numpy().view(np.int32).astype(np.int64)
    bits ^= (bits >> 63) & 0x7FFFFFFF  # negative floats: reverse their bit order
    return (bits << 32) | tiebreak[None]


@dataclass
class _AtomPlan:
    """Heuristics that are unions of atoms (grid rows, columns, result values): one histogram of
    (atom, rank band) per neuron counts every atom's cells above every threshold at once."""

    cols: np.ndarray  # [Z] heuristic columns (into the scored predicates)
    atom_of: np.ndarray  # [C] atom of each cell
    band: np.ndarray  # [C] band of each rank: how many of the plan's distinct k are <= rank
    slots: np.ndarray  # [S] flat (atom, band) bin of each (atom, heuristic) pair, grouped by heuristic
    starts: np.ndarray  # [Z] where each heuristic's pairs start in ``slots``
    n_atoms: int
    n_bands: int  # the plan's distinct k + 1


@dataclass
class _SegmentPlan:
    """Any other heuristics: gather each heuristic's cells, compare with its threshold, sum."""

    cols: np.ndarray  # [G] heuristic columns
    cells: np.ndarray  # [nnz] the cells of every heuristic, heuristic after heuristic
    which: np.ndarray  # [nnz] threshold index of each entry's heuristic
    starts: np.ndarray  # [G] where each heuristic's cells start


def _atom_plan(pred: torch.Tensor, counts: np.ndarray, atoms: torch.Tensor, cols: torch.Tensor) -> _AtomPlan:
    T, C = int(atoms.max()) + 1, atoms.numel()
    member = torch.zeros(T, len(cols)).index_add_(0, atoms, pred[:, cols].float()) > 0
    t_idx, h_idx = (x.numpy() for x in torch.nonzero(member.T, as_tuple=True)[::-1])  # grouped by heuristic
    ks, local = np.unique(counts[cols.numpy()], return_inverse=True)
    band = np.searchsorted(ks, np.arange(C), side="right")
    J = len(ks)
    sizes = np.bincount(h_idx, minlength=len(cols))
    return _AtomPlan(
        cols=cols.numpy(), atom_of=atoms.numpy().astype(np.int64), band=band.astype(np.int64),
        slots=t_idx * (J + 1) + local[h_idx], starts=np.cumsum(sizes) - sizes, n_atoms=T, n_bands=J + 1,
    )


def _segment_plan(pred: torch.Tensor, kindex: np.ndarray, cols: torch.Tensor) -> _SegmentPlan:
    """``kindex[h]``: which distinct k (threshold column) heuristic h uses."""
    sub = pred[:, cols].T.numpy()  # [G, C]
    h_idx, cells = np.nonzero(sub)
    sizes = sub.sum(1)
    return _SegmentPlan(cols.numpy(), cells, kindex[cols.numpy()][h_idx], np.concatenate([[0], np.cumsum(sizes)[:-1]]))


def _constant_on(pred: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    """Which predicate columns are constant on every atom: [H] bool."""
    T = int(atoms.max()) + 1
    sizes = torch.bincount(atoms, minlength=T).float()
    inside = torch.zeros(T, pred.shape[1]).index_add_(0, atoms, pred.float())
    return ((inside == 0) | (inside == sizes[:, None])).all(0)


def _plans(pred: torch.Tensor, counts: np.ndarray, kindex: np.ndarray, atom_labelings: Sequence[torch.Tensor]) -> list:
    """Atom plans for the heuristics that are unions of few atoms, a segment plan for the rest."""
    remaining = torch.arange(pred.shape[1])
    plans: list = []
    C = pred.shape[0]
    for atoms in atom_labelings:
        if remaining.numel() == 0:
            break
        if int(atoms.max()) + 1 > C // 4:  # many atoms: no cheaper than gathering the cells
            continue
        fits = _constant_on(pred[:, remaining], atoms)
        if fits.any():
            plans.append(_atom_plan(pred, counts, atoms, remaining[fits]))
            remaining = remaining[~fits]
    if remaining.numel():
        plans.append(_segment_plan(pred, kindex, remaining))
    return plans


def _hits(cells: np.ndarray, keys: np.ndarray, thresholds: np.ndarray, plans, n_heuristics: int, top: bool) -> np.ndarray:
    """Cells of each heuristic inside its top-k (``top``) or bottom-k, per row: [n, H].

    ``cells[:, i]`` is the cell at descending rank i; ``thresholds[:, j]`` the key of the k_j-th
    largest (or smallest) cell. Keys are unique, so a cell is in the top-k exactly when its key is
    >= that threshold (<= for the bottom-k), and exactly when its rank is < k.
    """
    n, C = keys.shape
    out = np.zeros((n, n_heuristics), np.float32)
    for plan in plans:
        if isinstance(plan, _AtomPlan):
            band = plan.band if top else plan.band[::-1]  # bottom-k: ranks counted from the end
            bins = plan.n_atoms * plan.n_bands
            code = plan.atom_of[cells] * plan.n_bands + band[None]
            code += (np.arange(n, dtype=np.int64) * bins)[:, None]
            hist = np.bincount(code.ravel(), minlength=n * bins).reshape(n, plan.n_atoms, plan.n_bands)
            below = np.cumsum(hist, axis=2).reshape(n, bins)  # [n, atom x band]: cells ranked < k
            out[:, plan.cols] = np.add.reduceat(below[:, plan.slots], plan.starts, axis=1)
        else:
            values = keys[:, plan.cells]
            limits = thresholds[:, plan.which]
            hit = (values >= limits) if top else (values <= limits)
            out[:, plan.cols] = np.add.reduceat(hit, plan.starts, axis=1, dtype=np.int32)
    return out


def score_maps(
    maps: torch.Tensor,
    predicates: torch.Tensor,
    *,
    atoms: Sequence[torch.Tensor] = (),
    bottom: bool = False,
    seed: int = 0,
    chunk_size: int = 128,
    progress: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Heuristic scores of every neuron map (RECIPES §4).

    The score of heuristic h for a neuron is the fraction of the neuron's top-k cells that satisfy
    h, with k = the number of cells satisfying h. Ties between equal activations (ReLU zeros) are
    broken by one seeded random permutation of the cells, so no region of the grid is favoured.

    How: each row is sorted once (keys made unique by the tie-breaker), which gives the threshold
    of every distinct k; a cell is in a top-k exactly when its key reaches that threshold. The
    heuristics that are unions of ``atoms`` (grid rows, columns or result values) are then
    counted with one histogram per neuron over (atom, rank band) whose cumulative sums give each
    atom's cells inside each top-k; the rest by gathering each heuristic's cells and comparing
    with its threshold — never a pass per heuristic over the grid.

    Args:
        maps: ``[N, C]`` activations of N neurons over the C legal cells.
        predicates: ``[C, H]`` bool, which cells satisfy each heuristic.
        atoms: optional labelings ``[C]`` of the cells (e.g. the a, b or result index of each).
        bottom: also score the bottom-k (gated MLPs, whose neurons act through negative values).
        seed: the tie-breaking permutation.

    Returns:
        ``(top, bottom)`` scores, ``[N, H]`` float each (``bottom`` is ``None`` unless asked).
    """
    if maps.ndim != 2 or predicates.ndim != 2 or maps.shape[1] != predicates.shape[0]:
        raise AnalysisError(
            f"maps must be [N, C] and predicates [C, H] with the same C; got {tuple(maps.shape)} and {tuple(predicates.shape)}"
        )
    N, C = maps.shape
    predicates = predicates.bool()
    counts = predicates.sum(0)
    if (counts == 0).any():
        raise AnalysisError("every heuristic needs at least one cell; drop empty predicate columns")
    distinct, kindex = np.unique(counts.numpy(), return_inverse=True)
    tiebreak = torch.randperm(C, generator=torch.Generator().manual_seed(seed)).numpy().astype(np.int64)
    cell_of = np.argsort(tiebreak)  # tie-breaker value -> cell
    plans = _plans(predicates, counts.numpy(), kindex, [a.long() for a in atoms])
    H = predicates.shape[1]
    scale = counts.numpy().astype(np.float32)
    top = torch.empty(N, H)
    low = torch.empty(N, H) if bottom else None
    starts = range(0, N, chunk_size)
    for start in tqdm(starts, desc="score heuristics", disable=not progress or len(starts) < 2):
        keys = _keys(maps[start : start + chunk_size], tiebreak)
        ordered = np.sort(keys, axis=1)
        cells = cell_of[ordered[:, ::-1] & 0xFFFFFFFF]  # cells by descending rank
        top[start : start + chunk_size] = torch.from_numpy(_hits(cells, keys, ordered[:, C - distinct], plans, H, True) / scale)
        if bottom:
            low[start : start + chunk_size] = torch.from_numpy(_hits(cells, keys, ordered[:, distinct - 1], plans, H, False) / scale)
    return top, low


def _check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ConfigError(f"threshold must be a number in (0, 1], got {threshold!r}")
    return float(threshold)


def classify_maps(
    k_maps: Optional[torch.Tensor],
    kv_maps: Optional[torch.Tensor],
    a_values: Iterable[int],
    b_values: Iterable[int],
    op: str,
    threshold: float = 0.6,
    *,
    modulus: Optional[int] = None,
    families: Optional[Sequence[str]] = None,
    bottom: bool = False,
    min_cells: int = 3,
    max_fraction: float = 0.5,
    layers: Optional[torch.Tensor] = None,
    neurons: Optional[torch.Tensor] = None,
    importance: Optional[torch.Tensor] = None,
    seed: int = 0,
    chunk_size: int = 128,
    progress: bool = False,
    meta: Optional[dict] = None,
) -> "HeuristicTable":
    """Label neurons with the heuristics their maps implement (pure; RECIPES §4).

    Args:
        k_maps: ``[N, A, B]`` activations over the grid (operand heuristics), or ``None``.
        kv_maps: ``[N, A, B]`` activation × logit-lens value (result heuristics), or ``None``.
            NaN marks a missing cell (a prompt left out); a cell missing for any neuron, or where
            the operator is undefined, is illegal for all.
        a_values, b_values: the operand values along axes 1 and 2.
        op, modulus: the task's operator (:data:`OPS`); result heuristics use its results.
        threshold: a neuron implements a heuristic when its score reaches this, in (0, 1].
        families: heuristic families to score (default all that apply to ``op``).
        bottom: also score the bottom-k and keep the better side (gated MLPs).
        min_cells, max_fraction: see :func:`build_heuristics`.
        layers, neurons: ``[N]`` model layer and neuron index of each map (default 0 and 0..N-1).
        importance: ``[N]`` importance scores kept in the table.
        seed: tie-breaking permutation.
    """
    threshold = _check_threshold(threshold)
    _check_op(op, modulus)
    given = {name: m for name, m in (("k_maps", k_maps), ("kv_maps", kv_maps)) if m is not None}
    if not given:
        raise AnalysisError("give k_maps, kv_maps or both")
    a_vals, b_vals = _values_tensor("a_values", a_values), _values_tensor("b_values", b_values)
    shape = None
    for name, m in given.items():
        if not isinstance(m, torch.Tensor) or m.ndim != 3 or m.shape[1:] != (len(a_vals), len(b_vals)):
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise AnalysisError(
                f"{name} must be a tensor [neurons, len(a_values), len(b_values)] = [N, {len(a_vals)}, {len(b_vals)}], got {got}"
            )
        if shape is not None and m.shape != shape:
            raise AnalysisError(f"k_maps and kv_maps must have the same shape, got {tuple(shape)} and {tuple(m.shape)}")
        shape = m.shape
    N = shape[0]
    if N == 0:
        raise AnalysisError("no neuron maps given (N = 0)")
    finite = torch.ones(shape[1:], dtype=torch.bool)
    for m in given.values():
        finite &= torch.isfinite(m).all(0)
    heuristics = build_heuristics(a_vals, b_vals, op, modulus=modulus, legal=finite, families=families,
                                  min_cells=min_cells, max_fraction=max_fraction)
    flat = heuristics.legal.flatten()
    grid = heuristics.grid
    atoms = {
        "K": [_dense_ids(grid.a), _dense_ids(grid.b)],
        "KV": [_dense_ids(grid.result)],
    }
    H = len(heuristics.heuristics)
    scores = torch.full((N, H), float("nan"))
    bottom_scores = torch.full((N, H), float("nan")) if bottom else torch.empty(0)
    for kind, m in (("K", k_maps), ("KV", kv_maps)):
        cols = heuristics.kind(kind)
        if m is None or cols.numel() == 0:
            continue
        top, low = score_maps(
            m.reshape(N, -1)[:, flat].float(), heuristics.predicates[:, cols],
            atoms=atoms[kind], bottom=bottom, seed=seed, chunk_size=chunk_size, progress=progress,
        )
        scores[:, cols] = top
        if bottom:
            bottom_scores[:, cols] = low
    scored = ~torch.isnan(scores[0])
    layer_t = torch.zeros(N, dtype=torch.long) if layers is None else torch.as_tensor(layers).long()
    neuron_t = torch.arange(N) if neurons is None else torch.as_tensor(neurons).long()
    imp = torch.full((N,), float("nan")) if importance is None else torch.as_tensor(importance).float()
    for name, t in (("layers", layer_t), ("neurons", neuron_t), ("importance", imp)):
        if t.shape != (N,):
            raise AnalysisError(f"{name} must have one entry per map ([{N}]), got shape {tuple(t.shape)}")
    keep = torch.nonzero(scored).flatten()
    extra = dict(meta or {})
    extra.update(n_legal_cells=int(flat.sum()), n_cells=int(flat.numel()), dropped_heuristics=heuristics.dropped, seed=seed)
    return HeuristicTable(
        layer=layer_t,
        neuron=neuron_t,
        names=[heuristics.names[i] for i in keep.tolist()],
        families=[heuristics.families[i] for i in keep.tolist()],
        map_kinds=[heuristics.map_kinds[i] for i in keep.tolist()],
        scores=scores[:, keep],
        bottom_scores=bottom_scores[:, keep] if bottom else bottom_scores,
        importance=imp,
        threshold=threshold,
        op=op,
        modulus=modulus,
        a_values=a_vals.tolist(),
        b_values=b_vals.tolist(),
        legal=heuristics.legal,
        meta={**build_meta(), **extra},
    )


def _dense_ids(values: torch.Tensor) -> torch.Tensor:
    return torch.unique(values, return_inverse=True)[1]


# --- results -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeuristicTable(Result):
    """Which heuristics each neuron implements (RECIPES §4).

    ``scores[i, h]`` (``[N, H]``) is neuron i's score for heuristic h (``names[h]``, of
    ``families[h]``, scored on ``map_kinds[h]`` maps); with ``bottom_scores`` ([N, H], gated MLPs)
    the better side counts. ``layer`` / ``neuron`` ([N]) name the neurons, ``importance`` ([N])
    their attribution scores (NaN if not computed), ``legal`` ([A, B]) the cells used.
    """

    layer: torch.Tensor
    neuron: torch.Tensor
    names: list
    families: list
    map_kinds: list
    scores: torch.Tensor
    bottom_scores: torch.Tensor
    importance: torch.Tensor
    threshold: float
    op: str
    modulus: Optional[int]
    a_values: list
    b_values: list
    legal: torch.Tensor
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def best_scores(self) -> torch.Tensor:
        """``[N, H]``: the score that decides the label (top-k, or the better of top/bottom)."""
        if self.bottom_scores.numel():
            return torch.maximum(self.scores, self.bottom_scores)
        return self.scores

    @property
    def labels(self) -> torch.Tensor:
        """``[N, H]`` bool: neuron implements heuristic (score ≥ threshold)."""
        return self.best_scores >= self.threshold

    @property
    def classified(self) -> torch.Tensor:
        """``[N]`` bool: neuron implements at least one heuristic."""
        return self.labels.any(1)

    def neuron_labels(self, index: int) -> list[str]:
        """The heuristic names of neuron ``index`` (a row of the table), best score first."""
        if not 0 <= index < len(self.layer):
            raise SiteError(f"row {index} is out of range; the table has {len(self.layer)} neurons (0..{len(self.layer) - 1})")
        row = self.best_scores[index]
        hits = torch.nonzero(row >= self.threshold).flatten()
        return [self.names[i] for i in hits[torch.argsort(row[hits], descending=True)].tolist()]

    def neurons_of(self, heuristic: str) -> torch.Tensor:
        """Rows of the neurons labelled with ``heuristic``: LongTensor."""
        return torch.nonzero(self.labels[:, self.index(heuristic)]).flatten()

    def index(self, heuristic: str) -> int:
        if heuristic not in self.names:
            close = [n for n in self.names if heuristic.split(" ")[0] in n][:8]
            raise ConfigError(
                f"unknown heuristic {heuristic!r}; this table scores {len(self.names)} heuristics"
                + (f", e.g. {accepted(close)}" if close else f", e.g. {accepted(self.names[:8])}")
            )
        return self.names.index(heuristic)

    def coverage(self) -> dict[int, float]:
        """Fraction of the table's (important) neurons with at least one label, per layer."""
        return {
            int(layer): float(self.classified[self.layer == layer].float().mean())
            for layer in torch.unique(self.layer).tolist()
        }

    def histogram(self) -> pd.DataFrame:
        """Heuristic types per layer: neurons with at least one label of each family.

        Columns ``layer, family, neurons, labels`` (a neuron with several labels of one family
        counts once in ``neurons``, once per label in ``labels``).
        """
        labels = self.labels
        families = sorted(set(self.families), key=self.families.index)
        rows = []
        for layer in torch.unique(self.layer).tolist():
            in_layer = labels[self.layer == layer]
            for family in families:
                cols = [i for i, f in enumerate(self.families) if f == family]
                sub = in_layer[:, cols]
                rows.append(dict(layer=int(layer), family=family, neurons=int(sub.any(1).sum()), labels=int(sub.sum())))
        return pd.DataFrame(rows, columns=["layer", "family", "neurons", "labels"])

    def heuristic(self, name: str) -> Heuristic:
        """The :class:`Heuristic` object behind a column (rebuilt from the registry)."""
        self.index(name)
        found = _find_heuristic(name, self)
        if found is None:
            raise ConfigError(f"heuristic {name!r} is no longer registered; register it again to use it")
        return found

    def to_frame(self, labelled_only: bool = False) -> pd.DataFrame:
        """One row per (neuron, heuristic): layer, neuron, heuristic, family, map_kind, score, label."""
        best = self.best_scores
        N, H = best.shape
        frame = pd.DataFrame(
            dict(
                layer=self.layer.repeat_interleave(H).numpy(),
                neuron=self.neuron.repeat_interleave(H).numpy(),
                heuristic=np.tile(np.array(self.names, dtype=object), N),
                family=np.tile(np.array(self.families, dtype=object), N),
                map_kind=np.tile(np.array(self.map_kinds, dtype=object), N),
                score=best.flatten().numpy(),
                top_score=self.scores.flatten().numpy(),
                label=self.labels.flatten().numpy(),
                importance=self.importance.repeat_interleave(H).numpy(),
            )
        )
        return frame[frame.label].reset_index(drop=True) if labelled_only else frame

    def plot(self, kind: str = "counts", **kwargs):
        """``kind``: ``"counts"`` (heuristic types per layer), ``"coverage"`` or ``"scores"`` (heatmap)."""
        from arithinterp.viz import neurons as viz

        return viz.table_figure(self, kind=kind, **kwargs)


_FAMILY_CACHE: dict[tuple, dict[str, Heuristic]] = {}


def _find_heuristic(name: str, table: HeuristicTable) -> Optional[Heuristic]:
    if name in _CUSTOM:
        return _CUSTOM[name]
    family = FAMILIES.get(table.families[table.names.index(name)])
    if family is None:
        return None
    legal = table.legal.bool()
    key = (family.name, id(family.generate), table.op, table.modulus, tuple(table.a_values), tuple(table.b_values),
           np.packbits(legal.numpy()).tobytes())
    if key not in _FAMILY_CACHE:
        A, B = torch.meshgrid(torch.tensor(table.a_values), torch.tensor(table.b_values), indexing="ij")
        result, _ = apply_op(A, B, table.op, table.modulus)
        grid = Grid(A[legal], B[legal], result[legal], tuple(table.a_values), tuple(table.b_values), table.op, table.modulus)
        if len(_FAMILY_CACHE) > 64:
            _FAMILY_CACHE.clear()
        _FAMILY_CACHE[key] = {h.name: h for h in family.generate(grid)}
    return _FAMILY_CACHE[key].get(name)


@dataclasses.dataclass(frozen=True)
class NeuronImportance(Result):
    """Per-neuron importance for the answer, per layer (RECIPES §4).

    ``scores`` is ``[len(layers), d_mlp]``: mean + std over prompts of the per-prompt effect
    magnitude. ``top`` is ``[len(layers), top_k]``: the top-k neurons of each layer, best first.
    """

    layers: list
    scores: torch.Tensor
    top: torch.Tensor
    method: str
    meta: dict = dataclasses.field(default_factory=dict)

    def neurons(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layer, neuron)`` LongTensors of every selected neuron, layer by layer."""
        k = self.top.shape[1]
        return torch.tensor(self.layers).repeat_interleave(k), self.top.flatten()

    def top_scores(self) -> torch.Tensor:
        return self.scores.gather(1, self.top)

    def to_frame(self) -> pd.DataFrame:
        L, D = self.scores.shape
        rank = torch.empty_like(self.scores, dtype=torch.long)
        rank.scatter_(1, torch.argsort(self.scores, dim=1, descending=True), torch.arange(D).expand(L, D))
        return pd.DataFrame(
            dict(
                layer=np.repeat(self.layers, D),
                neuron=np.tile(np.arange(D), L),
                score=self.scores.flatten().numpy(),
                rank=rank.flatten().numpy(),
                selected=(rank < self.top.shape[1]).flatten().numpy(),
            )
        )

    def plot(self, **kwargs):
        from arithinterp.viz import neurons as viz

        return viz.importance_figure(self, **kwargs)


@dataclasses.dataclass(frozen=True)
class NeuronMaps(Result):
    """K and KV maps of neurons over an operand grid (RECIPES §4).

    ``k_maps`` / ``kv_maps`` are ``[N, A, B]`` (NaN where the grid has no prompt); rows follow
    ``a_values``, columns ``b_values``; ``layer`` / ``neuron`` ([N]) name the neurons.
    """

    layer: torch.Tensor
    neuron: torch.Tensor
    a_values: list
    b_values: list
    k_maps: torch.Tensor
    kv_maps: torch.Tensor
    op: str
    modulus: Optional[int]
    meta: dict = dataclasses.field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        N, A, B = self.k_maps.shape
        return pd.DataFrame(
            dict(
                layer=self.layer.repeat_interleave(A * B).numpy(),
                neuron=self.neuron.repeat_interleave(A * B).numpy(),
                a=np.tile(np.repeat(self.a_values, B), N),
                b=np.tile(np.tile(self.b_values, A), N),
                k=self.k_maps.flatten().numpy(),
                kv=self.kv_maps.flatten().numpy(),
            )
        )

    def plot(self, index: int = 0, kind: str = "both", **kwargs):
        """Heatmaps of row ``index``'s maps over (a, b); ``kind``: ``"K"``, ``"KV"`` or ``"both"``."""
        from arithinterp.viz import neurons as viz

        return viz.maps_figure(self, index=index, kind=kind, **kwargs)

    def classify(self, threshold: float = 0.6, **kwargs) -> HeuristicTable:
        """:func:`classify_maps` on these maps."""
        return classify_maps(
            self.k_maps, self.kv_maps, self.a_values, self.b_values, self.op, threshold,
            modulus=self.modulus, layers=self.layer, neurons=self.neuron, meta=dict(self.meta), **kwargs,
        )


@dataclasses.dataclass(frozen=True)
class HeuristicAblation(Result):
    """Accuracy after ablating each heuristic's neurons, on associated vs other prompts.

    One entry per heuristic in ``heuristics``: ``n_neurons``, ``n_associated`` / ``n_other``
    prompts, and accuracy before (``*_before``) and after (``*_after``) the ablation.
    """

    heuristics: list
    families: list
    n_neurons: torch.Tensor
    n_associated: torch.Tensor
    n_other: torch.Tensor
    associated_before: torch.Tensor
    associated_after: torch.Tensor
    other_before: torch.Tensor
    other_after: torch.Tensor
    mode: str
    meta: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """Mean accuracy (over heuristics) remaining on associated and other prompts, and drops."""
        ok = self.n_associated > 0
        return dict(
            heuristics=int(ok.sum()),
            associated_before=float(self.associated_before[ok].mean()),
            associated_after=float(self.associated_after[ok].mean()),
            other_before=float(self.other_before[ok].mean()),
            other_after=float(self.other_after[ok].mean()),
            associated_drop=float((self.associated_before - self.associated_after)[ok].mean()),
            other_drop=float((self.other_before - self.other_after)[ok].mean()),
        )

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            dict(
                heuristic=self.heuristics,
                family=self.families,
                n_neurons=self.n_neurons.numpy(),
                n_associated=self.n_associated.numpy(),
                n_other=self.n_other.numpy(),
                associated_before=self.associated_before.numpy(),
                associated_after=self.associated_after.numpy(),
                other_before=self.other_before.numpy(),
                other_after=self.other_after.numpy(),
            )
        )

    def plot(self, **kwargs):
        from arithinterp.viz import neurons as viz

        return viz.heuristic_ablation_figure(self, **kwargs)


@dataclasses.dataclass(frozen=True)
class PromptAblation(Result):
    """Per-prompt ablation of each prompt's own heuristic neurons vs a random control.

    For each ``k`` in ``ks`` (neurons per layer): ``heuristic_correct`` / ``control_correct``
    ([len(ks)]) are the fractions of prompts still answered correctly; ``n_ablated`` ([len(ks)])
    the mean number of neurons ablated per prompt (the same for both arms); ``baseline`` the
    accuracy with nothing ablated.
    """

    ks: list
    heuristic_correct: torch.Tensor
    control_correct: torch.Tensor
    n_ablated: torch.Tensor
    baseline: float
    n_prompts: int
    mode: str
    meta: dict = dataclasses.field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for i, k in enumerate(self.ks):
            for arm, values in (("heuristic", self.heuristic_correct), ("control", self.control_correct)):
                rows.append(dict(k=k, arm=arm, correct=float(values[i]), n_ablated=float(self.n_ablated[i])))
        return pd.DataFrame(rows)

    def plot(self, **kwargs):
        from arithinterp.viz import neurons as viz

        return viz.prompt_ablation_figure(self, **kwargs)


# --- running the model ---------------------------------------------------------------------------


def _check_model_layers(model: Any, layers) -> list[int]:
    return site_lib.check_layers(model, "mlp_post", layers)


def _batches(prompts, batch_size: int):
    """(indices, unpadded tokens, final positions) per same-length batch."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    for group in prompts.length_groups():
        for idx in group.split(batch_size):
            tokens = prompts.unpadded(idx)
            final = prompts.positions["final"][idx] - prompts.offset(idx)
            yield idx, tokens, final


def _check_prompts(prompts, name: str = "prompts") -> None:
    if not all(hasattr(prompts, attr) for attr in ("tokens", "a", "b", "answer_tokens", "positions")):
        raise AnalysisError(f"{name} must be a PromptSet from arithinterp.tasks.arithmetic, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise AnalysisError(f"{name} is empty")


def importance(
    model: Any,
    pairs: Any,
    layers: Optional[Iterable[int]] = None,
    method: str = "attribution",
    top_k: Optional[int] = 200,
    *,
    batch_size: int = 256,
    progress: bool = False,
) -> NeuronImportance:
    """Rank MLP neurons by their effect on the answer (RECIPES §4).

    The metric is the logit difference clean answer − corrupt answer at the final position.

    * ``"attribution"``: attribution patching on ``mlp_post`` at the final position, effect =
      gradient of the metric (on the clean run) × (corrupt − clean) activation.
    * ``"ablation"``: exact activation patching of each neuron's final-position activation to
      its corrupt value, effect = metric after − before (neurons batched together).

    A neuron's score is mean + std over prompts of ``|effect|`` (the paper's mean + std; the
    magnitude *(choice)* so neurons that push either way count). Returns the top ``top_k`` per
    layer (``None``: all neurons).

    Args:
        pairs: ``PromptPairs`` (clean / corrupt prompts with aligned positions).
        layers: layers to score (default all).
    """
    if method not in IMPORTANCE_METHODS:
        raise ConfigError(f"unknown importance method {method!r}; accepted: {accepted(IMPORTANCE_METHODS)}")
    if not hasattr(pairs, "clean") or not hasattr(pairs, "corrupt"):
        raise AnalysisError(f"pairs must be PromptPairs (from prompts.counterfactual()), got {type(pairs).__name__}")
    _check_prompts(pairs.clean, "pairs.clean")
    chosen = _check_model_layers(model, layers)
    d_mlp = int(model.cfg.d_mlp)
    if top_k is None:
        top_k = d_mlp
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= d_mlp:
        raise ConfigError(f"top_k must be an integer in 1..{d_mlp} (d_mlp) or None, got {top_k!r}")
    effects = _attribution(model, pairs, chosen, batch_size, progress) if method == "attribution" else _patch_effects(model, pairs, chosen, batch_size, progress)
    magnitude = effects.abs()  # [P, L, d_mlp]
    scores = magnitude.mean(0) + (magnitude.std(0) if magnitude.shape[0] > 1 else 0)
    top = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :top_k]
    return NeuronImportance(
        layers=chosen, scores=scores, top=top, method=method,
        meta=build_meta(model, n_pairs=len(pairs), top_k=top_k, vary=getattr(pairs, "vary", None), metric="logit_diff"),
    )


def _final_metric(logits: torch.Tensor, final: torch.Tensor, good: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(len(final))
    at = logits[rows, final]
    return at[rows, good] - at[rows, bad]


def _attribution(model, pairs, layers, batch_size, progress) -> torch.Tensor:
    clean, corrupt = pairs.clean, pairs.corrupt
    out = torch.zeros(len(clean), len(layers), int(model.cfg.d_mlp))
    names = {site_lib.hook_name("mlp_post", l): i for i, l in enumerate(layers)}
    good, bad = clean.answer_tokens[:, 0], corrupt.answer_tokens[:, 0]
    for idx, tokens, final in tqdm(list(_batches(clean, batch_size)), desc="attribution", disable=not progress):
        rows = torch.arange(len(idx))
        corrupt_acts = {}

        def keep(act, hook, name):
            corrupt_acts[name] = act[rows, final].detach().clone()
            return act

        with torch.inference_mode():
            model.run_with_hooks(corrupt.unpadded(idx), fwd_hooks=[(n, partial(keep, name=n)) for n in names])
        clean_acts = {}

        def grab(act, hook, name):
            if not act.requires_grad:  # frozen weights: make the graph start here
                act = act.detach().requires_grad_(True)
            clean_acts[name] = act
            return act

        with torch.enable_grad():
            logits = model.run_with_hooks(tokens, fwd_hooks=[(n, partial(grab, name=n)) for n in names])
            metric = _final_metric(logits, final, good[idx], bad[idx]).sum()
            grads = torch.autograd.grad(metric, [clean_acts[n] for n in names], allow_unused=True)
        for n, grad in zip(names, grads):
            i = names[n]
            if grad is None:
                continue
            delta = corrupt_acts[n] - clean_acts[n].detach()[rows, final]
            out[idx, i] = (grad[rows, final] * delta).float()
    return out


@torch.inference_mode()
def _patch_effects(model, pairs, layers, batch_size, progress) -> torch.Tensor:
    clean, corrupt = pairs.clean, pairs.corrupt
    d_mlp = int(model.cfg.d_mlp)
    out = torch.zeros(len(clean), len(layers), d_mlp)
    good, bad = clean.answer_tokens[:, 0], corrupt.answer_tokens[:, 0]
    # every (prompt, neuron) patch is its own sequence: batch prompts x a block of neurons
    block = max(1, batch_size // 8)
    jobs = [(idx, tokens, final) for idx, tokens, final in _batches(clean, block)]
    bar = tqdm(total=len(jobs) * len(layers), desc="patch neurons", disable=not progress)
    for idx, tokens, final in jobs:
        rows = torch.arange(len(idx))
        corrupt_acts = {}

        def keep(act, hook, name):
            corrupt_acts[name] = act[rows, final].clone()
            return act

        names = [site_lib.hook_name("mlp_post", l) for l in layers]
        model.run_with_hooks(corrupt.unpadded(idx), fwd_hooks=[(n, partial(keep, name=n)) for n in names])
        base = _final_metric(model(tokens), final, good[idx], bad[idx])
        chunk = max(1, 4096 // len(idx))
        for i, name in enumerate(names):
            for start in range(0, d_mlp, chunk):
                neurons = torch.arange(start, min(start + chunk, d_mlp))
                reps = len(neurons)
                prow = rows.repeat(reps)
                pneuron = neurons.repeat_interleave(len(idx))
                pfinal = final.repeat(reps)
                value = corrupt_acts[name][prow, pneuron]

                def patch(act, hook):
                    act = act.clone()
                    act[torch.arange(len(prow)), pfinal, pneuron] = value.to(act.dtype)
                    return act

                logits = model.run_with_hooks(tokens.repeat(reps, 1), fwd_hooks=[(name, patch)])
                metric = _final_metric(logits, pfinal, good[idx].repeat(reps), bad[idx].repeat(reps))
                out[idx[:, None], i, neurons[None, :]] = (metric - base.repeat(reps)).view(reps, len(idx)).T.float()
            bar.update(1)
    bar.close()
    return out


def _grid_index(prompts) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    a_vals = torch.unique(prompts.a)
    b_vals = torch.unique(prompts.b)
    ai = torch.searchsorted(a_vals, prompts.a)
    bi = torch.searchsorted(b_vals, prompts.b)
    return a_vals.tolist(), b_vals.tolist(), ai, bi


def _neuron_index(model: Any, neurons) -> tuple[torch.Tensor, torch.Tensor]:
    """``neurons``: a NeuronImportance, a (layers, indices) pair, or ``[N, 2]`` (layer, neuron)."""
    if isinstance(neurons, NeuronImportance):
        layer, neuron = neurons.neurons()
    elif isinstance(neurons, tuple) and len(neurons) == 2:
        layer, neuron = (torch.as_tensor(x).long().flatten() for x in neurons)
    else:
        t = torch.as_tensor(neurons).long()
        if t.ndim != 2 or t.shape[1] != 2:
            raise SiteError(
                f"neurons must be a NeuronImportance, a (layers, indices) pair or an [N, 2] tensor of (layer, neuron); got shape {tuple(t.shape)}"
            )
        layer, neuron = t[:, 0], t[:, 1]
    if layer.shape != neuron.shape or layer.numel() == 0:
        raise SiteError("neurons must name at least one (layer, neuron) pair, with as many layers as indices")
    site_lib.check_layers(model, "mlp_post", sorted(set(layer.tolist())))
    d_mlp = int(model.cfg.d_mlp)
    if (neuron < 0).any() or (neuron >= d_mlp).any():
        raise SiteError(f"neuron indices must be in 0..{d_mlp - 1} (d_mlp = {d_mlp})")
    return layer, neuron


@torch.inference_mode()
def _final_activations(model, prompts, layers: list[int], batch_size: int, progress: bool = False) -> torch.Tensor:
    """``mlp_post`` at the final position: [P, len(layers), d_mlp]."""
    out = torch.zeros(len(prompts), len(layers), int(model.cfg.d_mlp))
    names = {site_lib.hook_name("mlp_post", l): i for i, l in enumerate(layers)}
    last = max(layers)
    for idx, tokens, final in tqdm(list(_batches(prompts, batch_size)), desc="activations", disable=not progress):
        rows = torch.arange(len(idx))

        def keep(act, hook, i):
            out[idx, i] = act[rows, final].float()
            return act

        model.run_with_hooks(tokens, fwd_hooks=[(n, partial(keep, i=i)) for n, i in names.items()], stop_at_layer=last + 1)
    return out


def maps(model: Any, prompts: Any, neurons: Any, *, batch_size: int = 512, progress: bool = False) -> NeuronMaps:
    """K and KV maps of neurons over the operand grid of ``prompts`` (RECIPES §4).

    K map: the neuron's ``mlp_post`` at the final position for each (a, b). KV map: K ×
    ``(W_out[neuron] @ W_U)[answer token]``, the neuron's direct logit-lens contribution to the
    true answer's (first) token. Grid cells with no prompt (e.g. dropped by ``correct_only``) are
    NaN. Works for any operator: the grid is the sorted unique ``prompts.a`` × ``prompts.b``.

    Args:
        prompts: a PromptSet from :func:`arithinterp.tasks.arithmetic` covering a grid.
        neurons: a :class:`NeuronImportance` (its top-k), a ``(layers, indices)`` pair or an
            ``[N, 2]`` tensor of (layer, neuron).
    """
    _check_prompts(prompts)
    layer, neuron = _neuron_index(model, neurons)
    layers = sorted(set(layer.tolist()))
    acts = _final_activations(model, prompts, layers, batch_size, progress)  # [P, L, d_mlp]
    li = torch.tensor([layers.index(l) for l in layer.tolist()])
    k_values = acts[:, li, neuron].T  # [N, P]
    with torch.inference_mode():
        W_out = model.W_out.detach().float()  # [n_layers, d_mlp, d_model]
        W_U = model.W_U.detach().float()  # [d_model, d_vocab]
        value = W_out[layer, neuron] @ W_U  # [N, d_vocab]
    answer = prompts.answer_tokens[:, 0]
    kv_values = k_values * value[:, answer]
    a_vals, b_vals, ai, bi = _grid_index(prompts)
    N = len(layer)
    k_maps = torch.full((N, len(a_vals), len(b_vals)), float("nan"))
    kv_maps = torch.full_like(k_maps, float("nan"))
    k_maps[:, ai, bi] = k_values
    kv_maps[:, ai, bi] = kv_values
    missing = int(torch.isnan(k_maps[0]).sum())
    return NeuronMaps(
        layer=layer, neuron=neuron, a_values=a_vals, b_values=b_vals, k_maps=k_maps, kv_maps=kv_maps,
        op=prompts.op, modulus=prompts.modulus,
        meta=build_meta(model, n_prompts=len(prompts), missing_cells=missing, op=prompts.op, template=prompts.template),
    )


def classify(
    model: Any,
    prompts: Any,
    layers: Optional[Iterable[int]] = None,
    top_k: Optional[int] = 200,
    threshold: float = 0.6,
    *,
    importance_scores: Optional[NeuronImportance] = None,
    pairs: Any = None,
    method: str = "attribution",
    vary: str = "a",
    bottom: Optional[bool] = None,
    families: Optional[Sequence[str]] = None,
    min_cells: int = 3,
    max_fraction: float = 0.5,
    seed: int = 0,
    batch_size: int = 512,
    progress: bool = False,
) -> HeuristicTable:
    """Classify a model's important MLP neurons into heuristics (RECIPES §4).

    Runs :func:`importance` (unless ``top_k`` is None — all neurons — or ``importance_scores``
    is given) on ``pairs`` (default ``prompts.counterfactual(vary, seed)``), :func:`maps` on
    ``prompts`` and :func:`classify_maps`. ``bottom`` defaults to ``model.cfg.gated_mlp``.
    """
    _check_prompts(prompts)
    threshold = _check_threshold(threshold)
    chosen = _check_model_layers(model, layers)
    if importance_scores is None and top_k is not None:
        pairs = pairs if pairs is not None else prompts.counterfactual(vary=vary, seed=seed)
        importance_scores = importance(model, pairs, chosen, method=method, top_k=top_k, batch_size=batch_size, progress=progress)
    if importance_scores is not None:
        missing = [l for l in chosen if l not in importance_scores.layers]
        if missing:
            raise ConfigError(f"importance_scores has no scores for layers {missing}; it covers {importance_scores.layers}")
        rows = [importance_scores.layers.index(l) for l in chosen]
        top = importance_scores.top[rows]
        layer = torch.tensor(chosen).repeat_interleave(top.shape[1])
        neuron = top.flatten()
        imp = importance_scores.scores[rows].gather(1, top).flatten()
    else:
        d_mlp = int(model.cfg.d_mlp)
        layer = torch.tensor(chosen).repeat_interleave(d_mlp)
        neuron = torch.arange(d_mlp).repeat(len(chosen))
        imp = None
    neuron_maps = maps(model, prompts, (layer, neuron), batch_size=batch_size, progress=progress)
    if bottom is None:
        bottom = bool(getattr(model.cfg, "gated_mlp", False))
    return classify_maps(
        neuron_maps.k_maps, neuron_maps.kv_maps, neuron_maps.a_values, neuron_maps.b_values, prompts.op, threshold,
        modulus=prompts.modulus, families=families, bottom=bottom, min_cells=min_cells, max_fraction=max_fraction,
        layers=layer, neurons=neuron, importance=imp, seed=seed, progress=progress,
        meta=build_meta(model, n_prompts=len(prompts), top_k=top_k, method=method if imp is not None else None,
                        missing_cells=neuron_maps.meta.get("missing_cells")),
    )


# --- ablations -----------------------------------------------------------------------------------


def _check_mode(mode: str) -> None:
    if mode not in ABLATION_MODES:
        raise ConfigError(f"unknown ablation mode {mode!r}; accepted: {accepted(ABLATION_MODES)}")


def _replacement(model, prompts, layers: list[int], mode: str, batch_size: int) -> torch.Tensor:
    """What an ablated neuron is set to: its mean final-position activation, or 0: [L, d_mlp]."""
    if mode == "zero":
        return torch.zeros(len(layers), int(model.cfg.d_mlp))
    return _final_activations(model, prompts, layers, batch_size).mean(0)


@torch.inference_mode()
def _correct(model, prompts, masks: dict[int, torch.Tensor], replacement: dict[int, torch.Tensor], batch_size: int) -> torch.Tensor:
    """Whether each prompt is answered right with neurons ablated at the final position.

    ``masks[layer]`` is ``[d_mlp]`` (same for every prompt) or ``[P, d_mlp]`` bool. With
    ``prompts.scoring == "full_answer"`` every answer token is checked teacher-forced (equal to
    greedy exact match); otherwise the first answer token.
    """
    correct = torch.zeros(len(prompts), dtype=torch.bool)
    full = getattr(prompts, "scoring", "first_token") == "full_answer" and prompts.answer_tokens.shape[1] > 1
    for idx, tokens, final in _batches(prompts, batch_size):
        rows = torch.arange(len(idx))
        answer = prompts.answer_tokens[idx]
        hooks = []
        for layer, mask in masks.items():
            m = mask[idx] if mask.ndim == 2 else mask[None].expand(len(idx), -1)
            value = replacement[layer]

            def ablate(act, hook, m=m, value=value):
                act = act.clone()
                here = act[rows, final]
                act[rows, final] = torch.where(m, value.to(act.dtype)[None], here)
                return act

            hooks.append((site_lib.hook_name("mlp_post", layer), ablate))
        if full:
            extra = answer[:, :-1].clamp(min=0)
            logits = model.run_with_hooks(torch.cat([tokens, extra], dim=1), fwd_hooks=hooks)
            steps = torch.arange(answer.shape[1])
            predicted = logits[rows[:, None], final[:, None] + steps[None]].argmax(-1)
            correct[idx] = ((predicted == answer) | (answer < 0)).all(1)
        else:
            logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
            correct[idx] = logits[rows, final].argmax(-1) == answer[:, 0]
    return correct


def _association(table: HeuristicTable, prompts, names: Sequence[str]) -> torch.Tensor:
    """``[P, len(names)]`` bool: prompt's (a, b, result) satisfies each heuristic."""
    result = prompts.answer  # the task's result, reduced mod the modulus when there is one
    return torch.stack([table.heuristic(n).mask(prompts.a, prompts.b, result) for n in names], dim=1)


def _check_table(model, table) -> None:
    if not isinstance(table, HeuristicTable):
        raise AnalysisError(f"table must be a HeuristicTable (from classify / classify_maps), got {type(table).__name__}")
    site_lib.check_layers(model, "mlp_post", sorted(set(table.layer.tolist())))


def ablate_heuristic(
    model: Any,
    prompts: Any,
    table: HeuristicTable,
    heuristic: Union[str, Sequence[str], None] = None,
    *,
    mode: str = "mean",
    min_neurons: int = 1,
    batch_size: int = 512,
    progress: bool = False,
) -> HeuristicAblation:
    """Ablate the neurons of each heuristic; accuracy on associated vs other prompts (RECIPES §4).

    A prompt is associated with a heuristic when its (a, b, result) satisfies it. Neurons are
    ablated at the final position by setting ``mlp_post`` to its mean over ``prompts``
    (``mode="mean"``) or to zero.

    Args:
        heuristic: a name, a list of names, or ``None`` for every heuristic that labels at least
            ``min_neurons`` neurons.
    """
    _check_prompts(prompts)
    _check_table(model, table)
    _check_mode(mode)
    if heuristic is None:
        counts = table.labels.sum(0)
        names = [n for n, c in zip(table.names, counts.tolist()) if c >= min_neurons]
        if not names:
            raise AnalysisError(f"no heuristic labels {min_neurons} or more neurons in this table")
    else:
        names = [heuristic] if isinstance(heuristic, str) else list(heuristic)
        for n in names:
            table.index(n)
    layers = sorted(set(table.layer.tolist()))
    fill = _replacement(model, prompts, layers, mode, batch_size)
    replacement = {l: fill[i] for i, l in enumerate(layers)}
    before = _correct(model, prompts, {}, replacement, batch_size)
    associated = _association(table, prompts, names)
    d_mlp = int(model.cfg.d_mlp)
    rows = dict(n_neurons=[], n_associated=[], n_other=[], associated_before=[], associated_after=[], other_before=[], other_after=[])
    for j, name in enumerate(tqdm(names, desc="ablate heuristics", disable=not progress)):
        members = table.neurons_of(name)
        masks = {}
        for l in layers:
            chosen = table.neuron[members][table.layer[members] == l]
            if chosen.numel():
                masks[l] = torch.zeros(d_mlp, dtype=torch.bool).index_fill_(0, chosen, True)
        after = _correct(model, prompts, masks, replacement, batch_size) if masks else before
        assoc = associated[:, j]
        rows["n_neurons"].append(len(members))
        rows["n_associated"].append(int(assoc.sum()))
        rows["n_other"].append(int((~assoc).sum()))
        for arm, sel in (("associated", assoc), ("other", ~assoc)):
            rows[f"{arm}_before"].append(float(before[sel].float().mean()) if sel.any() else float("nan"))
            rows[f"{arm}_after"].append(float(after[sel].float().mean()) if sel.any() else float("nan"))
    return HeuristicAblation(
        heuristics=names,
        families=[table.families[table.index(n)] for n in names],
        **{k: torch.tensor(v, dtype=torch.long if k.startswith("n_") else torch.float32) for k, v in rows.items()},
        mode=mode,
        meta=build_meta(model, n_prompts=len(prompts), threshold=table.threshold),
    )


def ablate_for_prompt(
    model: Any,
    prompts: Any,
    table: HeuristicTable,
    k: Union[int, Sequence[int]] = (1, 2, 5, 10, 20),
    *,
    mode: str = "mean",
    rank_by: str = "score",
    seed: int = 0,
    batch_size: int = 512,
    progress: bool = False,
) -> PromptAblation:
    """For each prompt, ablate the neurons whose heuristics it satisfies, vs a random control.

    Per prompt and layer, up to ``k`` of the table's neurons with a heuristic the prompt
    satisfies are ablated (the best first by ``rank_by``: ``"score"`` — the neuron's mean score
    over its labels the prompt satisfies — or ``"importance"``). The control ablates, for the same prompt and
    layer, the same number of neurons drawn at random (seeded) from the table's other neurons of
    that layer (its top neurons not associated with the prompt). Follows RECIPES §4.

    Returns the fraction of prompts still answered correctly in both arms for each ``k``.
    """
    _check_prompts(prompts)
    _check_table(model, table)
    _check_mode(mode)
    if rank_by not in ("score", "importance"):
        raise ConfigError(f"unknown rank_by {rank_by!r}; accepted: 'score', 'importance'")
    ks = [k] if isinstance(k, int) else list(k)
    if not ks or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ks):
        raise ConfigError(f"k must be a positive integer or a list of them, got {k!r}")
    if rank_by == "importance" and torch.isnan(table.importance).all():
        raise ConfigError("rank_by='importance' needs a table with importance scores (classify with top_k)")
    labelled = table.labels
    used = torch.nonzero(labelled.any(0)).flatten()
    names = [table.names[i] for i in used.tolist()]
    if not names:
        raise AnalysisError("no neuron in this table has a heuristic label; nothing to ablate")
    sat = _association(table, prompts, names).float()  # [P, H']
    lab = labelled[:, used].float()  # [N, H']
    assoc = (sat @ lab.T) > 0  # [P, N]
    if rank_by == "score":
        # mean score of the neuron's labels that the prompt satisfies (a matmul, no [P, N, H] tensor)
        priority = (sat @ (lab * table.best_scores[:, used]).T) / (sat @ lab.T).clamp(min=1)
    else:
        priority = table.importance[None].expand(len(prompts), -1)
    generator = torch.Generator().manual_seed(seed)
    layers = sorted(set(table.layer.tolist()))
    fill = _replacement(model, prompts, layers, mode, batch_size)
    replacement = {l: fill[i] for i, l in enumerate(layers)}
    baseline = _correct(model, prompts, {}, replacement, batch_size)
    d_mlp = int(model.cfg.d_mlp)
    P = len(prompts)
    heur, ctrl, sizes = [], [], []
    for kk in tqdm(ks, desc="ablate per prompt", disable=not progress):
        masks_h, masks_c, total = {}, {}, torch.zeros(P)
        for l in layers:
            cols = torch.nonzero(table.layer == l).flatten()
            a = assoc[:, cols]
            pri = torch.where(a, priority[:, cols], torch.tensor(float("-inf")))
            count = a.sum(1).clamp(max=kk)
            pick = _first(pri, count) & a
            others = ~a
            noise = torch.where(others, torch.rand(P, len(cols), generator=generator), torch.tensor(-1.0))
            pick_c = _first(noise, torch.minimum(count, others.sum(1))) & others
            masks_h[l] = _scatter_mask(pick, table.neuron[cols], d_mlp)
            masks_c[l] = _scatter_mask(pick_c, table.neuron[cols], d_mlp)
            total += pick.sum(1)
        heur.append(float(_correct(model, prompts, masks_h, replacement, batch_size).float().mean()))
        ctrl.append(float(_correct(model, prompts, masks_c, replacement, batch_size).float().mean()))
        sizes.append(float(total.mean()))
    return PromptAblation(
        ks=ks,
        heuristic_correct=torch.tensor(heur),
        control_correct=torch.tensor(ctrl),
        n_ablated=torch.tensor(sizes),
        baseline=float(baseline.float().mean()),
        n_prompts=P,
        mode=mode,
        meta=build_meta(model, n_prompts=P, rank_by=rank_by, seed=seed, threshold=table.threshold),
    )


def _first(priority: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``[P, n]`` bool: the ``count[p]`` highest-priority entries of each row."""
    order = torch.argsort(priority, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(priority.shape[1]).expand_as(order))
    return rank < count[:, None]


def _scatter_mask(pick: torch.Tensor, neuron: torch.Tensor, d_mlp: int) -> torch.Tensor:
    """Per-prompt picks over a layer's table neurons → ``[P, d_mlp]`` bool."""
    out = torch.zeros(pick.shape[0], d_mlp, dtype=torch.bool)
    out[:, neuron] = pick
    return out
