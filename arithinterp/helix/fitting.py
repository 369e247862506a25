"""Helix fits of activations: :func:`fit` → :class:`HelixFit`, and fit quality per layer,
:func:`fit_layers` → :class:`FitLayersResult` (Kantamneni & Tegmark 2025).

PCA of the training activations, least squares from the basis to the PCA coordinates, mapped
back; held-out R² over *values* not prompts. Activations come as a tensor or an
``Activations``; values as numbers or as label names of the activations' prompts.

One module past 500 lines on purpose: the fit and its per-layer sweep share the PCA, the basis and
the held-out split over values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.helix.design import (
    DEFAULT_PERIODS,
    BASIS_KINDS,
    as_2d,
    check_periods,
    least_squares,
    variable_names,
    pca_basis,
    r2_scores,
    basis,
    split_by_value,
)
from arithinterp.results import NON_NEGATIVE, POSITIVE, Result, build_meta, made_from
from arithinterp.types import NonNegativeInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

Values = Union[torch.Tensor, Sequence[int], str, Sequence[str]]


@dataclass(frozen=True)
class HelixFit(Result):
    """A fitted map from a number basis to activations (Kantamneni & Tegmark 2025).

    Activations ≈ ``basis(values) @ coef @ components + mean``; quality is held out over unseen
    *values*.

    Attributes:
        kind: The basis kind (:func:`basis`).
        periods: The periods ``T``.
        degree: The ``"poly"`` degree, or ``None``.
        max_value: The scale of each variable.
        names: The variables' names.
        mean (Float[Tensor, "d"]): The training activations' mean.
        components (Float[Tensor, "k d"]): Their top PCA components.
        explained_variance (Float[Tensor, "k"]): The components' variances.
        coef (Float[Tensor, "column k"]): The least-squares map from the basis to PCA coordinates.
        r2 (Float[Tensor, "k"]): Held-out R² per PCA component.
        r2_overall: Held-out R² of all PCA coordinates, variance weighted.
        r2_full: Held-out R² in the full activation space.
        pca_r2: The full-space R² of the held-out activations' own reconstruction from the top
            ``n_params`` components: the best any ``n_params``-dim subspace of this PCA does.
        train_values: The training values of the first variable.
        test_values: The held-out values.
        unique_values (Float[Tensor, "value variable"]): The distinct values.
        value_coords (Float[Tensor, "value component"]): The mean top (≤ 10) PCA coordinates per
            distinct value, for plots.
        site: The site read, when fitted on Activations.
        layer: The layer read.
        position: The position read.
        meta: Provenance, the validation scheme, folds and the shuffled-values control.
    """

    kind: str
    periods: list
    degree: Optional[int]
    max_value: list
    names: list
    mean: torch.Tensor
    components: torch.Tensor
    explained_variance: torch.Tensor
    coef: torch.Tensor
    r2: torch.Tensor
    r2_overall: float
    r2_full: float
    pca_r2: float
    train_values: list
    test_values: list
    unique_values: torch.Tensor
    value_coords: torch.Tensor
    site: Optional[str]
    layer: Optional[int]
    position: Optional[str]
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"mean": "d", "components": "component d", "explained_variance": "component", "coef": "term component",
               "r2": "component", "value_coords": "value component", "unique_values": "value variable",
               "names": "variable", "max_value": "variable"}
    _legal = {"kind": BASIS_KINDS, "periods": POSITIVE, "explained_variance": NON_NEGATIVE, "layer": NON_NEGATIVE}

    @property
    def labels(self) -> list[str]:
        """The basis columns' labels."""
        return basis(torch.zeros(1, len(self.names)), **self._basis_kw())[1]

    @property
    def n_params(self) -> int:
        """Non-constant basis columns: the helix "dimension" (9 for periods 2, 5, 10, 100)."""
        return len(self.labels) - 1

    def _basis_kw(self) -> dict:
        return dict(kind=self.kind, periods=self.periods, max_value=self.max_value, degree=self.degree,
                    names=self.names)

    def basis(self, values: Any) -> torch.Tensor:
        """The fit's basis at some values.

        Args:
            values: The numbers, ``[n]`` or ``[n, n_variables]``.

        Returns:
            Float[Tensor, "n column"]: The basis columns (float64).
        """
        return basis(values, **self._basis_kw())[0]

    def predict(self, values: Any) -> torch.Tensor:
        """The activations the fit gives for some values.

        Args:
            values: The numbers, ``[n]`` or ``[n, n_variables]``.

        Returns:
            Float[Tensor, "n d"]: The predicted activations.

        Raises:
            AnalysisError: The number of variables differs from the fit's.
        """
        x = as_2d(values)
        if x.shape[1] != len(self.names):
            raise AnalysisError(f"this fit takes {len(self.names)} variables ({self.names}), got {x.shape[1]}")
        coords = self.basis(x) @ self.coef.double()
        return (coords @ self.components.double() + self.mean.double()).float()

    def pca_reconstruct(self, acts: torch.Tensor, k: Optional[int] = None) -> torch.Tensor:
        """Activations projected onto the fit's top PCA components.

        Args:
            acts (Float[Tensor, "n d"]): Activations.
            k: The number of components (default :attr:`n_params`).

        Returns:
            Float[Tensor, "n d"]: The reconstruction.
        """
        k = self.n_params if k is None else int(k)
        top = self.components[:k].double()
        centred = acts.double() - self.mean.double()
        return (centred @ top.T @ top + self.mean.double()).float()

    def to_frame(self):
        import pandas as pd

        total = float(self.explained_variance.sum())
        return pd.DataFrame(
            dict(component=range(len(self.r2)), explained_variance=self.explained_variance.tolist(),
                 variance_share=[float(v) / total for v in self.explained_variance.tolist()],
                 held_out_r2=self.r2.tolist())
        )

    def plot(self, view: str = "3d", **kwargs):
        """``view="3d"``: the top three PCA coordinates per value with the fitted curve;
        ``"pairs"``: pairwise 2-D projections of the top PCA coordinates; ``"periods"``: each
        period's (cos, sin) plane, one panel per period. Points are coloured by the number.

        Args:
            view: ``"3d"``, ``"pairs"`` or ``"periods"``.
            **kwargs: Options of the figure builder.

        Returns:
            The plotly figure.

        Raises:
            ConfigError: An unknown view.
        """
        return draw(self, view=view, **kwargs)


def value_names(prompts: PromptSet) -> list[str]:
    """The numbers a fit can be made to by name: the prompts' labels and ``"a+b"``."""
    return [*prompts.label_names(), "a+b"]


def resolve_values(values: Values, prompts: Optional[PromptSet]) -> tuple[torch.Tensor, list[str]]:
    """Numbers per prompt from a tensor / list, or from prompt labels by name (``"a"``,
    ``"a+b"``, ``["a", "b", "a+b"]``) → ([n, v] float64, names)."""
    is_names = isinstance(values, str) or (
        isinstance(values, (list, tuple)) and values and all(isinstance(v, str) for v in values)
    )
    if not is_names:
        x = as_2d(values)
        return x, variable_names(None, x.shape[1])
    if prompts is None:
        raise AnalysisError("values given by name need an Activations that carries its prompts")
    names = [values] if isinstance(values, str) else [str(v) for v in values]
    columns = []
    for name in names:
        if name == "a+b":
            columns.append(prompts.a + prompts.b)
        else:
            columns.append(prompts.label(name))
    return torch.stack(columns, 1).double(), names


def activation_matrix(source: Any, site: Optional[str], layer: Optional[int], position: Optional[str]):
    """[N, d] activations and the (site, layer, position, prompts) they came from."""
    if isinstance(source, torch.Tensor):
        if source.ndim != 2:
            raise AnalysisError(f"activations must be [n, d], got shape {tuple(source.shape)}")
        return source.double(), None, layer, position, None
    if not (hasattr(source, "get") and hasattr(source, "layers")):
        raise AnalysisError(f"expected a tensor [n, d] or an Activations, got {type(source).__name__}")
    site = site or ("resid_pre" if "resid_pre" in source.sites else source.sites[0])
    if layer is None:
        if len(source.layers) != 1:
            raise SiteError(f"these activations hold layers {source.layers}; pass layer=")
        layer = int(source.layers[0])
    position = str(position if position is not None else source.positions[0])
    acts = source.get(site, layer, position)
    return acts.reshape(acts.shape[0], -1).double(), site, int(layer), position, source.prompts


def fit_core(
    acts, x, train, mean, comps, ev, kind, periods, degree, names, max_value, n_params_pca=None
) -> tuple[torch.Tensor, torch.Tensor, float, float, float]:
    """Least squares from the basis to PCA coordinates and the held-out scores: (coef, per-component
    R², overall R², full-space R², top-k PCA R²)."""
    design, _ = basis(x, kind, periods, max_value=max_value, degree=degree, names=names)
    coords = (acts - mean) @ comps.T
    coef = least_squares(design[train], coords[train])
    test = ~train if (~train).any() else train
    pred = design[test] @ coef
    r2, r2_overall = r2_scores(pred, coords[test])
    _, r2_full = r2_scores(pred @ comps + mean, acts[test])
    k = (design.shape[1] - 1) if n_params_pca is None else n_params_pca
    top = comps[:k]
    _, pca_r2 = r2_scores((acts[test] - mean) @ top.T @ top + mean, acts[test])
    return coef, r2, r2_overall, r2_full, pca_r2


LEAVE_ONE_OUT = "leave-one-value-out"


def value_folds(
    x: torch.Tensor, holdout: Union[float, str], seed: int, min_test_values: int
) -> tuple[list, str]:
    """Training masks [n] of the validation folds and the scheme's name.

    A share ``holdout`` of the distinct values of the first variable is held out (one fold) unless
    that leaves fewer than ``min_test_values`` held-out values: then, as for ``holdout="loo"``,
    each distinct value is held out in turn (one fold per value).
    """
    unique = x[:, 0].unique()
    if isinstance(holdout, str):
        if holdout != "loo":
            raise ConfigError(f"holdout must be a share in [0, 1) or 'loo' (leave one value out), got {holdout!r}")
    elif isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0 <= holdout < 1:
        raise ConfigError(f"holdout must be a share in [0, 1) or 'loo' (leave one value out), got {holdout!r}")
    elif holdout == 0:
        return [torch.ones(x.shape[0], dtype=torch.bool)], "none (scored on the training rows)"
    elif int(round(holdout * len(unique))) >= min_test_values:
        return [split_by_value(x, holdout, seed)], f"{holdout:g} of the values held out"
    if len(unique) < 3:
        raise AnalysisError(f"only {len(unique)} distinct values: a held-out score needs at least 3")
    return [x[:, 0] != v for v in unique], LEAVE_ONE_OUT


def check_identifiable(x: torch.Tensor, folds: list, basis_kw: dict) -> None:
    """Refuse when a fold's training values can be fitted exactly by any function: the basis then
    interpolates whatever the activations are, and a held-out score measures nothing."""
    for train in folds:
        if train.all():
            continue
        values = x[train].unique(dim=0)
        rank = int(torch.linalg.matrix_rank(basis(values, **basis_kw)[0]))
        if rank >= len(values):
            raise AnalysisError(
                f"a validation fold trains on {len(values)} distinct values and the {basis_kw['kind']} basis "
                f"(periods {basis_kw['periods']}) has rank {rank} on them, so it fits any function of these values "
                "exactly and the held-out R² says nothing; use fewer periods (e.g. periods=(10,)), a smaller "
                "kind ('circle', 'linear'), or more distinct values"
            )


def fold_pcas(acts: torch.Tensor, folds: list, n_pca: int) -> list:
    """(mean, components) of each fold's training rows."""
    return [pca_basis(acts[train], n_pca)[:2] for train in folds]


def cross_validated(acts, x, folds, pcas, basis_kw, mean, comps, n_top) -> tuple[torch.Tensor, float, float, float]:
    """Held-out scores pooled over leave-one-value-out ``folds`` (each fold: its own PCA, from
    ``pcas``, and least squares; predictions of the held-out rows in the full space), compared in
    the final PCA (``mean``, ``comps``): per-component R², overall, full-space R², top-``n_top``
    PCA R²."""
    design, _ = basis(x, **basis_kw)
    pred = torch.zeros_like(acts)
    recon = torch.zeros_like(acts)
    for train, (m, c) in zip(folds, pcas):
        coef = least_squares(design[train], ((acts - m) @ c.T)[train])
        test = ~train
        pred[test] = design[test] @ coef @ c + m
        top = c[:n_top]
        recon[test] = (acts[test] - m) @ top.T @ top + m
    r2, r2_overall = r2_scores((pred - mean) @ comps.T, (acts - mean) @ comps.T)
    _, r2_full = r2_scores(pred, acts)
    _, pca_r2 = r2_scores(recon, acts)
    return r2, r2_overall, r2_full, pca_r2


def shuffled_values(x: torch.Tensor, n_shuffles: int, seed: int) -> list:
    """``n_shuffles`` copies of ``x`` [n, v] whose distinct first-variable values are permuted
    (every row of a value moves together, so a split over values stays one)."""
    unique, inverse = x[:, 0].unique(return_inverse=True)
    generator = torch.Generator().manual_seed(int(seed) + 1)
    out = []
    for _ in range(n_shuffles):
        shuffled = x.clone()
        shuffled[:, 0] = unique[torch.randperm(len(unique), generator=generator)][inverse]
        out.append(shuffled)
    return out


@checked
def fit(
    acts: Any,
    values: Values,
    periods: Sequence[float] = DEFAULT_PERIODS,
    n_pca: int = 100,
    holdout: float = 0.2,
    kind: str = "helix",
    *,
    seed: int = 0,
    site: Optional[str] = None,
    layer: Optional[int] = None,
    positions: Optional[str] = None,
    degree: Optional[int] = None,
    names: Optional[Sequence[str]] = None,
    min_test_values: int = 5,
    n_shuffles: NonNegativeInt = 5,
) -> HelixFit:
    """Fit a helix (or baseline) basis of ``values`` to activations (Kantamneni & Tegmark 2025).

    PCA of the training activations to ``n_pca`` components, least squares from the basis to the
    PCA coordinates (no intercept), mapped back with ``C = coef @ components + mean``.

    Args:
        acts: activations [N, d], or an ``Activations`` (read at ``site`` — default
            ``resid_pre`` when collected —, ``layer`` and ``positions``, one position).
        values: the number of each row [N], several variables [N, v] (e.g. a, b, a+b), or label
            names of the activations' prompts: ``"a"``, ``"a+b"``, ``["a", "b", "a+b"]``.
        periods: the helix periods (any positive numbers).
        n_pca: PCA components kept (capped by the training rank).
        holdout: share of distinct values of the first variable held out for R²
            (:func:`split_by_value`); 0 scores on the training rows; ``"loo"`` holds out each
            distinct value in turn (leave-one-value-out).
        kind: ``"helix"``, ``"circle"``, ``"poly"`` or ``"linear"`` (see :func:`basis`).
        seed: seeds the split and the shuffled-values control.
        site: the site to read from an ``Activations``.
        layer: the layer to read from an ``Activations``.
        positions: the one position to read from an ``Activations``.
        degree: the ``"poly"`` degree (see :func:`basis`).
        names: one name per variable, for the basis labels.
        min_test_values: when the share would hold out fewer distinct values than this (ten
            digits: 2), leave-one-value-out is used instead; ``meta["validation"]`` says which.
        n_shuffles: the control: the same fit and validation on values shuffled across the rows
            (distinct values permuted, seeded by ``seed``); ``meta["control"]`` holds its
            held-out R² (a helix of shuffled values should score about 0 or below).

    Returns:
        The fit, with its held-out R² and the control in ``meta``.

    Raises:
        AnalysisError: A validation fold's training values are so few that the basis fits any
            function of them exactly (the held-out R² would say nothing), e.g. the default helix on
            the ten digits (use fewer periods there: ``periods=(10,)``); rows of values and
            activations that differ in number; non-finite activations or values.
        ConfigError: ``n_pca < 1``, an unknown kind, or invalid periods.
    """
    provenance = made_from(acts)  # the model the activations were collected on
    acts, site, layer, positions, prompts = activation_matrix(acts, site, layer, positions)
    x, default_names = resolve_values(values, prompts)
    names = list(names) if names is not None else default_names
    if x.shape[0] != acts.shape[0]:
        raise AnalysisError(f"values has {x.shape[0]} rows but there are {acts.shape[0]} activations")
    bad_rows = int((~torch.isfinite(acts)).any(1).sum())
    if bad_rows:  # the SVD behind the PCA cannot converge on them
        raise AnalysisError(f"{bad_rows} of {acts.shape[0]} activation rows hold NaN or infinite values; a helix "
                            "needs finite activations (check the model's weights and dtype)")
    if not torch.isfinite(x).all():
        raise AnalysisError("values hold NaN or infinite numbers; give one finite number per row")
    if n_pca < 1:
        raise ConfigError(f"n_pca must be ≥ 1, got {n_pca}")
    if kind not in BASIS_KINDS:
        raise ConfigError(f"unknown basis kind {kind!r}; accepted: {accepted(BASIS_KINDS)}")
    names = variable_names(names, x.shape[1])
    max_value = x.max(0).values.clamp_min(1.0).tolist()
    basis_kw: dict[str, Any] = dict(kind=kind, periods=check_periods(periods), max_value=max_value, degree=degree,
                                    names=names)
    folds, validation = value_folds(x, holdout, seed, min_test_values)
    check_identifiable(x, folds, basis_kw)

    everything = torch.ones(x.shape[0], dtype=torch.bool)
    train = everything if validation == LEAVE_ONE_OUT else folds[0]
    mean, comps, ev = pca_basis(acts[train], n_pca)  # the fit's PCA (all rows when every value is held out in turn)
    pcas = fold_pcas(acts, folds, n_pca) if validation == LEAVE_ONE_OUT else []

    def scores(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float, float]:
        """(coef, r2, r2_overall, r2_full, pca_r2) of the fit to ``values`` and its validation."""
        coef, r2, r2_overall, r2_full, pca_r2 = fit_core(acts, values, train, mean, comps, ev, kind, periods, degree,
                                                         names, max_value)
        if validation == LEAVE_ONE_OUT:
            n_top = basis(values[:1], **basis_kw)[0].shape[1] - 1
            r2, r2_overall, r2_full, pca_r2 = cross_validated(acts, values, folds, pcas, basis_kw, mean, comps, n_top)
        return coef, r2, r2_overall, r2_full, pca_r2

    coef, r2, r2_overall, r2_full, pca_r2 = scores(x)
    null = [scores(shuffled)[3] for shuffled in shuffled_values(x, n_shuffles, seed)] if holdout != 0 else []
    control = dict(null="values shuffled across rows (distinct values permuted)", n_shuffles=len(null),
                   r2_full_mean=float(sum(null) / len(null)) if null else None,
                   r2_full_max=float(max(null)) if null else None)
    unique, inverse = x.unique(dim=0, return_inverse=True)
    n_params = basis(x[:1], **basis_kw)[0].shape[1] - 1
    note = ""
    if len(unique) <= n_params + 1:  # only reachable unvalidated (holdout=0): validated folds are refused above
        note = (f"{len(unique)} distinct values and {n_params} basis parameters: the basis interpolates any function "
                "of these values, so R² is 1 by construction and says nothing; helix.patch_test refuses this fit")
    top = ((acts - mean) @ comps[: min(10, comps.shape[0])].T)
    sums = torch.zeros((len(unique), top.shape[1]), dtype=top.dtype).index_add_(0, inverse, top)
    coords = sums / torch.bincount(inverse, minlength=len(unique))[:, None]
    split_col = x[:, 0]
    test_rows = ~train if validation != LEAVE_ONE_OUT else torch.ones_like(train)
    return HelixFit(
        kind=kind, periods=check_periods(periods), degree=degree, max_value=max_value, names=list(names),
        mean=mean.float(), components=comps.float(), explained_variance=ev.float(), coef=coef.float(),
        r2=r2.float(), r2_overall=r2_overall, r2_full=r2_full, pca_r2=pca_r2,
        train_values=sorted(set(split_col[train].tolist())), test_values=sorted(set(split_col[test_rows].tolist())),
        unique_values=unique.float(), value_coords=coords.float(),
        site=site, layer=layer, position=positions,
        meta=build_meta(**provenance, n_rows=acts.shape[0], n_pca=comps.shape[0], holdout=holdout, seed=seed,
                        validation=validation, n_folds=len(folds), control=control, note=note),
    )


# --- fit quality per layer -----------------------------------------------------------------------


@dataclass(frozen=True)
class FitLayersResult(Result):
    """Held-out R² (full activation space) per basis kind and layer.

    Attributes:
        r2 (Float[Tensor, "fit layer"]): ``r2[i, j]`` for ``fits[i]`` at ``layers[j]``.
        fits: The basis kinds, then ``"PCA-k"``: the top-k PCA reconstruction with k the helix's
            parameter count.
        layers: The layers.
        periods: The periods ``T``.
        meta: Provenance, the validation scheme and the shuffled-values control per layer and kind.
    """

    r2: torch.Tensor
    fits: list
    layers: list
    periods: list
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"r2": "fit layer", "fits": "fit", "layers": "layer"}
    _legal = {"layers": NON_NEGATIVE, "periods": POSITIVE}

    def headline(self) -> dict:
        """The best held-out R² of each fit over the layers, with its layer.

        Returns:
            ``{fit: "R² at layer L"}``.
        """
        best = self.r2.nan_to_num(-math.inf).max(1)
        return {fit: f"{float(best.values[i]):.3g} at layer {self.layers[int(best.indices[i])]}"
                for i, fit in enumerate(self.fits)}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([dict(fit=f, layer=layer, held_out_r2=float(self.r2[i, j]))
                             for i, f in enumerate(self.fits) for j, layer in enumerate(self.layers)])

    def plot(self, **kwargs):
        return draw(self, **kwargs)


@checked
def fit_layers(
    acts: Any,
    values: Values,
    periods: Sequence[float] = DEFAULT_PERIODS,
    *,
    kinds: Sequence[str] = ("helix", "circle", "poly"),
    layers: Optional[Sequence[int]] = None,
    site: Optional[str] = None,
    positions: Optional[str] = None,
    n_pca: int = 100,
    holdout: float = 0.2,
    seed: int = 0,
) -> FitLayersResult:
    """:func:`fit` of each ``kind`` at each layer of an ``Activations``; held-out full-space R².

    Args:
        acts: An ``Activations``.
        values: As for :func:`fit`.
        periods: The periods ``T``.
        kinds: The basis kinds to fit.
        layers: The layers (default: every collected layer).
        site: The site to read.
        positions: The one position to read.
        n_pca: PCA components kept.
        holdout: As for :func:`fit`.
        seed: Seeds the splits and the controls.

    Returns:
        The R² table; ``meta["control"]`` gives, per layer and kind, the mean held-out R² of the
        same fit to shuffled values (:func:`fit`'s control), and ``meta["validation"]`` the scheme used.
    """
    layers = list(acts.layers) if layers is None else list(layers)
    rows = {k: [] for k in kinds}
    null = {k: [] for k in kinds}
    pca = []
    validation = None
    for layer in layers:
        for k in kinds:
            result = fit(acts, values, periods, n_pca, holdout, k, seed=seed, site=site, layer=layer,
                         positions=positions)
            rows[k].append(result.r2_full)
            null[k].append(result.meta["control"]["r2_full_mean"])
            validation = result.meta["validation"]
            if k == "helix" or (k == kinds[0] and "helix" not in kinds):
                pca.append(result.pca_r2)
    control = dict(null="values shuffled across rows (distinct values permuted)", r2_full_mean=null)
    return FitLayersResult(
        r2=torch.tensor([rows[k] for k in kinds] + [pca]), fits=list(kinds) + ["PCA-k"], layers=layers,
        periods=check_periods(periods),
        meta=build_meta(**made_from(acts), site=site, position=positions, holdout=holdout, validation=validation,
                        control=control),
    )
