"""Helix fits of number representations and their causal test (Kantamneni & Tegmark 2025).

A number ``x`` is represented on a *generalised helix* when activations are (close to) a linear
map of

    ``[cos(2πx/T), sin(2πx/T) for T in periods] + [x / max_x] + [1]``

* :func:`basis` — that basis for any periods (integers or not, e.g. ``113/14``), with the
  baselines ``"circle"`` (no linear term), ``"poly"`` (``x, x², …``) and ``"linear"``; several
  variables (``a, b, a+b``) concatenate their bases around one constant.
* :func:`fit` — the recipe of RECIPES §1: PCA to ``n_pca`` components, least squares from the
  basis to PCA coordinates (no intercept: the basis has the constant), mapped back
  (``C = coef @ components + mean``); held-out R² over *values* not prompts → :class:`HelixFit`.
* :func:`patch_test` — the causal test: patch the fitted helix at the corrupted value into the
  clean run and compare with the layer patch, a PCA reconstruction of equal dimension and a helix
  fitted to shuffled values → :class:`HelixPatchResult`.
* :func:`search_periods` — the best period subset of each size, by causal effect or held-out R².
* :func:`fit_layers` — fit quality per layer (helix vs baselines) → :class:`FitLayersResult`.
* :func:`fit_neurons` — the neuron preactivation model of RECIPES §1 fitted by gradient descent
  on the MSE, quality as NRMSE → :class:`NeuronFitResult`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.results import Result, build_meta

KINDS = ("helix", "circle", "poly", "linear")
DEFAULT_PERIODS = (2, 5, 10, 100)
NEURON_METHODS = ("gd", "lstsq")

Values = Union[torch.Tensor, Sequence[int], str, Sequence[str]]


# --- the basis -----------------------------------------------------------------------------------


def _as_2d(values: Any) -> torch.Tensor:
    values = torch.as_tensor(values, dtype=torch.float64)
    if values.ndim == 1:
        values = values[:, None]
    if values.ndim != 2 or values.shape[0] == 0:
        raise AnalysisError(f"values must be [n] or [n, n_variables] with n > 0, got shape {tuple(values.shape)}")
    return values


def _check_periods(periods: Sequence[float]) -> list[float]:
    periods = [float(T) for T in periods]
    if any(not math.isfinite(T) or T <= 0 for T in periods):
        raise ConfigError(f"periods must be positive numbers (e.g. 2, 5, 10, 100 or 113/14), got {periods}")
    return periods


def _names(names: Optional[Sequence[str]], n_vars: int) -> list[str]:
    if names is None:
        return ["x"] if n_vars == 1 else [f"x{i}" for i in range(n_vars)]
    names = list(names)
    if len(names) != n_vars:
        raise AnalysisError(f"got {len(names)} variable names for {n_vars} variables")
    return names


def basis(
    values: Any,
    kind: str = "helix",
    periods: Sequence[float] = DEFAULT_PERIODS,
    *,
    max_value: Optional[Sequence[float]] = None,
    degree: Optional[int] = None,
    names: Optional[Sequence[str]] = None,
) -> tuple[torch.Tensor, list[str]]:
    """Basis columns for ``values`` [n] or [n, n_variables] → ([n, n_columns], column labels).

    ``kind``:

    * ``"helix"``: per variable ``cos / sin(2πx/T)`` for each period, then ``x / max_x``;
    * ``"circle"``: the periodic columns only;
    * ``"poly"``: ``(x / max_x)^j`` for ``j = 1..degree`` (default: the helix's column count
      ``2·len(periods) + 1``, so both have as many parameters);
    * ``"linear"``: ``x / max_x``;

    then one constant column. ``max_value`` per variable defaults to ``max(values)`` (at least 1).
    RECIPES §1 (Kantamneni & Tegmark 2025).
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown basis kind {kind!r}; accepted: {accepted(KINDS)}")
    x = _as_2d(values)
    periods = _check_periods(periods)
    names = _names(names, x.shape[1])
    if max_value is None:
        max_value = x.max(0).values.clamp_min(1.0).tolist()
    max_value = [float(m) for m in (max_value if isinstance(max_value, (list, tuple)) else [max_value])]
    if len(max_value) != x.shape[1] or any(m <= 0 for m in max_value):
        raise AnalysisError(f"max_value needs one positive number per variable ({x.shape[1]}), got {max_value}")
    if kind in ("helix", "circle") and not periods:
        raise ConfigError(f"a {kind} basis needs at least one period")
    degree = 2 * len(periods) + 1 if degree is None else int(degree)
    if kind == "poly" and degree < 1:
        raise ConfigError(f"poly degree must be ≥ 1, got {degree}")
    columns, labels = [], []
    for j, name in enumerate(names):
        v = x[:, j]
        if kind in ("helix", "circle"):
            for T in periods:
                angle = 2 * math.pi * v / T
                columns += [angle.cos(), angle.sin()]
                labels += [f"cos(2π{name}/{T:g})", f"sin(2π{name}/{T:g})"]
        if kind in ("helix", "linear"):
            columns.append(v / max_value[j])
            labels.append(f"{name}/{max_value[j]:g}")
        if kind == "poly":
            for power in range(1, degree + 1):
                columns.append((v / max_value[j]) ** power)
                labels.append(f"({name}/{max_value[j]:g})^{power}")
    columns.append(torch.ones(x.shape[0], dtype=torch.float64))
    labels.append("1")
    return torch.stack(columns, dim=1), labels


def helix_basis(values: Any, periods: Sequence[float] = DEFAULT_PERIODS, *, linear: bool = True,
                constant: bool = True, max_value: Optional[Sequence[float]] = None) -> torch.Tensor:
    """The helix basis [n, 2·len(periods) (+1 linear) (+1 constant)] of values [n] (or [n, v])."""
    matrix, _ = basis(values, "helix" if linear else "circle", periods, max_value=max_value)
    return matrix if constant else matrix[:, :-1]


# --- fitting -------------------------------------------------------------------------------------


def _lstsq(design: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Minimum-norm least squares (tolerates all-zero columns such as ``sin(πx)``)."""
    return torch.linalg.pinv(design, rtol=1e-10) @ target


def _r2(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-column R² [c] and the variance-weighted overall R² of ``pred`` vs ``target`` [n, c]."""
    residual = (target - pred).pow(2).sum(0)
    total = (target - target.mean(0)).pow(2).sum(0)
    per = 1 - residual / total.clamp_min(1e-30)
    overall = 1 - float(residual.sum()) / max(float(total.sum()), 1e-30)
    return per, overall


def split_by_value(values: Any, holdout: float = 0.2, random_state: int = 0) -> torch.Tensor:
    """Bool [n] marking the training rows: a random ``holdout`` share of the distinct values of
    the first variable is held out with all their rows (the split is over values, not prompts)."""
    x = _as_2d(values)
    if not 0 <= holdout < 1:
        raise ConfigError(f"holdout must be in [0, 1), got {holdout}")
    unique = x[:, 0].unique()
    n_test = int(round(holdout * len(unique)))
    if holdout > 0 and not 1 <= n_test < len(unique):
        raise AnalysisError(f"holdout={holdout} of {len(unique)} distinct values leaves an empty train or test set")
    generator = torch.Generator().manual_seed(int(random_state))
    test_values = unique[torch.randperm(len(unique), generator=generator)[:n_test]]
    return ~torch.isin(x[:, 0], test_values)


def _pca(acts: torch.Tensor, n_pca: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean [d], top components [k, d] and their variances [k] of acts [n, d]."""
    mean = acts.mean(0)
    _, singular, vh = torch.linalg.svd(acts - mean, full_matrices=False)
    rank = int((singular > singular[0] * 1e-9).sum()) if singular.numel() and singular[0] > 0 else 0
    k = max(1, min(n_pca, rank))
    return mean, vh[:k], singular[:k].pow(2) / max(acts.shape[0] - 1, 1)


@dataclass(frozen=True)
class HelixFit(Result):
    """A fitted map from a number basis to activations (Kantamneni & Tegmark 2025).

    Activations ≈ ``basis(values) @ coef @ components + mean``. ``components`` [k, d] and
    ``mean`` [d] are the PCA of the training activations, ``coef`` [n_columns, k]. Held-out
    quality over unseen *values*: ``r2`` [k] per PCA component, ``r2_overall`` (all PCA
    coordinates, variance weighted), ``r2_full`` (in the full activation space) and
    ``pca_r2`` (the full-space R² of the held-out activations' own reconstruction from the top
    ``n_params`` components: the best any ``n_params``-dim subspace of this PCA does).
    ``unique_values`` [u, v] / ``value_coords`` [u, ≤10] are the mean top PCA coordinates per
    distinct value (for plots). ``train_values`` / ``test_values`` are the split values.
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

    @property
    def labels(self) -> list[str]:
        return basis(torch.zeros(1, len(self.names)), **self._basis_kw())[1]

    @property
    def n_params(self) -> int:
        """Non-constant basis columns: the helix "dimension" (9 for periods 2, 5, 10, 100)."""
        return len(self.labels) - 1

    def _basis_kw(self) -> dict:
        return dict(kind=self.kind, periods=self.periods, max_value=self.max_value, degree=self.degree,
                    names=self.names)

    def basis(self, values: Any) -> torch.Tensor:
        """The fit's basis at ``values`` [n] / [n, v] → [n, n_columns]."""
        return basis(values, **self._basis_kw())[0]

    def predict(self, values: Any) -> torch.Tensor:
        """Activations [n, d] the fit gives for ``values`` [n] (or [n, n_variables])."""
        x = _as_2d(values)
        if x.shape[1] != len(self.names):
            raise AnalysisError(f"this fit takes {len(self.names)} variables ({self.names}), got {x.shape[1]}")
        coords = self.basis(x) @ self.coef.double()
        return (coords @ self.components.double() + self.mean.double()).float()

    def pca_reconstruct(self, acts: torch.Tensor, k: Optional[int] = None) -> torch.Tensor:
        """``acts`` [n, d] projected onto the top ``k`` (default ``n_params``) PCA components."""
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
        period's (cos, sin) plane, one panel per period. Points are coloured by the number."""
        from arithinterp.viz import fourier as viz

        views = {"3d": viz.helix_3d_figure, "pairs": viz.helix_pairs_figure, "periods": viz.helix_periods_figure}
        if view not in views:
            raise ConfigError(f"unknown view {view!r}; accepted: {accepted(views)}")
        return views[view](self, **kwargs)


def _resolve_values(values: Values, prompts: Any) -> tuple[torch.Tensor, list[str]]:
    """Numbers per prompt from a tensor / list, or from prompt labels by name (``"a"``,
    ``"a+b"``, ``["a", "b", "a+b"]``) → ([n, v] float64, names)."""
    is_names = isinstance(values, str) or (
        isinstance(values, (list, tuple)) and values and all(isinstance(v, str) for v in values)
    )
    if not is_names:
        x = _as_2d(values)
        return x, _names(None, x.shape[1])
    if prompts is None:
        raise AnalysisError("values given by name need an Activations that carries its prompts")
    names = [values] if isinstance(values, str) else list(values)
    columns = []
    for name in names:
        if name == "a+b":
            columns.append(prompts.a + prompts.b)
        else:
            columns.append(prompts.label(name))
    return torch.stack(columns, 1).double(), names


def _activation_matrix(source: Any, site: Optional[str], layer: Optional[int], position: Optional[str]):
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
        layer = source.layers[0]
    position = str(position if position is not None else source.positions[0])
    acts = source.get(site, layer, position)
    return acts.reshape(acts.shape[0], -1).double(), site, int(layer), position, source.prompts


def _fit_core(acts, x, train, mean, comps, ev, kind, periods, degree, names, max_value, n_params_pca=None):
    """Least squares from the basis to PCA coordinates and the held-out scores."""
    design, _ = basis(x, kind, periods, max_value=max_value, degree=degree, names=names)
    coords = (acts - mean) @ comps.T
    coef = _lstsq(design[train], coords[train])
    test = ~train if (~train).any() else train
    pred = design[test] @ coef
    r2, r2_overall = _r2(pred, coords[test])
    _, r2_full = _r2(pred @ comps + mean, acts[test])
    k = (design.shape[1] - 1) if n_params_pca is None else n_params_pca
    top = comps[:k]
    _, pca_r2 = _r2((acts[test] - mean) @ top.T @ top + mean, acts[test])
    return coef, r2, r2_overall, r2_full, pca_r2


def fit(
    acts_or_tensor: Any,
    values: Values,
    periods: Sequence[float] = DEFAULT_PERIODS,
    n_pca: int = 100,
    holdout: float = 0.2,
    kind: str = "helix",
    random_state: int = 0,
    *,
    site: Optional[str] = None,
    layer: Optional[int] = None,
    position: Optional[str] = None,
    degree: Optional[int] = None,
    names: Optional[Sequence[str]] = None,
) -> HelixFit:
    """Fit a helix (or baseline) basis of ``values`` to activations (RECIPES §1).

    Args:
        acts_or_tensor: activations [N, d], or an ``Activations`` (read at ``site`` — default
            ``resid_pre`` when collected —, ``layer`` and ``position``).
        values: the number of each row [N], several variables [N, v] (e.g. a, b, a+b), or label
            names of the activations' prompts: ``"a"``, ``"a+b"``, ``["a", "b", "a+b"]``.
        periods: the helix periods (any positive numbers).
        n_pca: PCA components kept (capped by the training rank).
        holdout: share of distinct values of the first variable held out for R²
            (:func:`split_by_value`); 0 scores on the training rows.
        kind: ``"helix"``, ``"circle"``, ``"poly"`` or ``"linear"`` (see :func:`basis`).

    PCA of the training activations to ``n_pca`` components, least squares from the basis to the
    PCA coordinates (no intercept), mapped back with ``C = coef @ components + mean``.
    """
    acts, site, layer, position, prompts = _activation_matrix(acts_or_tensor, site, layer, position)
    x, default_names = _resolve_values(values, prompts)
    names = list(names) if names is not None else default_names
    if x.shape[0] != acts.shape[0]:
        raise AnalysisError(f"values has {x.shape[0]} rows but there are {acts.shape[0]} activations")
    if n_pca < 1:
        raise ConfigError(f"n_pca must be ≥ 1, got {n_pca}")
    if kind not in KINDS:
        raise ConfigError(f"unknown basis kind {kind!r}; accepted: {accepted(KINDS)}")
    train = split_by_value(x, holdout, random_state)
    max_value = x.max(0).values.clamp_min(1.0).tolist()
    mean, comps, ev = _pca(acts[train], n_pca)
    coef, r2, r2_overall, r2_full, pca_r2 = _fit_core(acts, x, train, mean, comps, ev, kind, periods, degree,
                                                      _names(names, x.shape[1]), max_value)
    unique, inverse = x.unique(dim=0, return_inverse=True)
    top = ((acts - mean) @ comps[: min(10, comps.shape[0])].T)
    sums = torch.zeros((len(unique), top.shape[1]), dtype=top.dtype).index_add_(0, inverse, top)
    coords = sums / torch.bincount(inverse, minlength=len(unique))[:, None]
    split_col = x[:, 0]
    return HelixFit(
        kind=kind, periods=_check_periods(periods), degree=degree, max_value=max_value, names=list(names),
        mean=mean.float(), components=comps.float(), explained_variance=ev.float(), coef=coef.float(),
        r2=r2.float(), r2_overall=r2_overall, r2_full=r2_full, pca_r2=pca_r2,
        train_values=sorted(set(split_col[train].tolist())), test_values=sorted(set(split_col[~train].tolist())),
        unique_values=unique.float(), value_coords=coords.float(),
        site=site, layer=layer, position=position,
        meta=build_meta(n_rows=acts.shape[0], n_pca=comps.shape[0], holdout=holdout, random_state=random_state),
    )


# --- fit quality per layer -----------------------------------------------------------------------


@dataclass(frozen=True)
class FitLayersResult(Result):
    """Held-out R² (full activation space) per layer: ``r2[i, j]`` for ``fits[i]`` at
    ``layers[j]``; the last row ``"PCA-k"`` is the top-k PCA reconstruction with k the helix's
    parameter count."""

    r2: torch.Tensor
    fits: list
    layers: list
    periods: list
    meta: dict

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([dict(fit=f, layer=layer, held_out_r2=float(self.r2[i, j]))
                             for i, f in enumerate(self.fits) for j, layer in enumerate(self.layers)])

    def plot(self, **kwargs):
        from arithinterp.viz.fourier import fit_layers_figure

        return fit_layers_figure(self, **kwargs)


def fit_layers(
    acts: Any,
    values: Values,
    periods: Sequence[float] = DEFAULT_PERIODS,
    *,
    kinds: Sequence[str] = ("helix", "circle", "poly"),
    layers: Optional[Sequence[int]] = None,
    site: Optional[str] = None,
    position: Optional[str] = None,
    n_pca: int = 100,
    holdout: float = 0.2,
    random_state: int = 0,
) -> FitLayersResult:
    """:func:`fit` of each ``kind`` at each layer of an ``Activations``; held-out full-space R²."""
    layers = list(acts.layers) if layers is None else list(layers)
    rows = {k: [] for k in kinds}
    pca = []
    for layer in layers:
        for k in kinds:
            result = fit(acts, values, periods, n_pca, holdout, k, random_state, site=site, layer=layer,
                         position=position)
            rows[k].append(result.r2_full)
            if k == "helix" or (k == kinds[0] and "helix" not in kinds):
                pca.append(result.pca_r2)
    return FitLayersResult(
        r2=torch.tensor([rows[k] for k in kinds] + [pca]), fits=list(kinds) + ["PCA-k"], layers=layers,
        periods=_check_periods(periods), meta=build_meta(site=site, position=position, holdout=holdout),
    )


# --- causal patch test ---------------------------------------------------------------------------


def _groups(prompts: Any, batch_size: int):
    return [chunk for group in prompts.length_groups() for chunk in group.split(batch_size)]


@torch.inference_mode()
def capture(model: Any, prompts: Any, hook: str, position: str, batch_size: int = 256,
            stop_at_layer: Optional[int] = None) -> torch.Tensor:
    """Activations [N, d] at hook ``hook`` and the named ``position`` of each prompt (the forward
    stops before block ``stop_at_layer`` when given)."""
    out = None
    for idx in _groups(prompts, batch_size):
        columns = prompts.positions[position][idx] - prompts.offset(idx)
        store = {}

        def keep(x, hook):
            store["x"] = x[torch.arange(len(idx)), columns].detach().float()

        model.run_with_hooks(prompts.unpadded(idx), fwd_hooks=[(hook, keep)], return_type=None,
                             stop_at_layer=stop_at_layer)
        if out is None:
            out = torch.empty((len(prompts), store["x"].shape[-1]))
        out[idx] = store["x"]
    return out


@torch.inference_mode()
def patched_logit(model: Any, prompts: Any, hook: str, position: str, replacement: Optional[torch.Tensor],
                  tokens: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Logit [N] of ``tokens`` at the final position when the activation at ``hook`` and
    ``position`` is replaced by ``replacement`` [N, d] (``None``: no patch)."""
    out = torch.empty(len(prompts))
    for idx in _groups(prompts, batch_size):
        columns = prompts.positions[position][idx] - prompts.offset(idx)

        def patch(x, hook):
            x = x.clone()
            x[torch.arange(len(idx)), columns] = replacement[idx].to(x.dtype).to(x.device)
            return x

        hooks = [] if replacement is None else [(hook, patch)]
        logits = model.run_with_hooks(prompts.unpadded(idx), fwd_hooks=hooks, return_type="logits")
        out[idx] = logits[torch.arange(len(idx)), -1, tokens[idx]].float()
    return out


def _stacked_effects(model, pairs, hook, position, replacements: list, batch_size: int) -> torch.Tensor:
    """Effect [M, N] (corrupt-answer logit after − before) of M replacement sets in one batch."""
    tokens = pairs.corrupt_answer_token
    before = patched_logit(model, pairs.clean, hook, position, None, tokens, batch_size)
    n, m = len(pairs), len(replacements)
    index = torch.arange(n).repeat(m)
    stacked = pairs.clean[index]
    after = patched_logit(model, stacked, hook, position, torch.cat(replacements), tokens[index], batch_size)
    return after.reshape(m, n) - before[None]


@dataclass(frozen=True)
class HelixPatchResult(Result):
    """The causal helix test (Kantamneni & Tegmark 2025, RECIPES §1).

    ``effect[i]`` = mean over pairs of (logit of the corrupted answer after patching − before)
    for ``methods[i]``; ``per_pair`` [M, n_pairs]; ``fraction[i]`` = ``effect[i]`` / the layer
    patch's effect. ``k`` is the PCA baseline's dimension (the helix's parameter count).
    """

    methods: list
    effect: torch.Tensor
    per_pair: torch.Tensor
    fraction: torch.Tensor
    k: int
    layer: int
    position: str
    meta: dict

    def to_frame(self):
        import pandas as pd

        n = self.per_pair.shape[1]
        sem = (self.per_pair.std(1) / math.sqrt(max(n, 1))).tolist()
        return pd.DataFrame(dict(method=self.methods, effect=self.effect.tolist(), sem=sem,
                                 fraction_of_layer_patch=self.fraction.tolist(), n_pairs=[n] * len(self.methods)))

    def plot(self, **kwargs):
        from arithinterp.viz.fourier import patch_test_figure

        return patch_test_figure(self, **kwargs)


def shuffled_control(acts: torch.Tensor, values: torch.Tensor, like: HelixFit, random_state: int = 0) -> HelixFit:
    """A fit like ``like`` (kind, periods, PCA size) to ``acts`` whose values are permuted at the
    value level (each distinct number is relabelled by another): the control of RECIPES §1."""
    x = _as_2d(values)
    unique, inverse = x[:, 0].unique(return_inverse=True)
    generator = torch.Generator().manual_seed(int(random_state))
    shuffled = x.clone()
    shuffled[:, 0] = unique[torch.randperm(len(unique), generator=generator)][inverse]
    return fit(acts, shuffled, like.periods, like.components.shape[0], 0.0, like.kind, random_state,
               degree=like.degree, names=like.names)


def patch_test(
    model: Any,
    pairs: Any,
    fit: HelixFit,
    layer: Optional[int] = None,
    position: str = "a",
    *,
    value: Optional[str] = None,
    control: Optional[HelixFit] = None,
    extra: Optional[dict] = None,
    random_state: int = 0,
    batch_size: int = 256,
) -> HelixPatchResult:
    """Is the fitted helix causally sufficient? (RECIPES §1.)

    At ``blocks.{layer}.hook_resid_pre`` and ``position`` of each clean prompt, replace the
    activation by (i) the corrupt prompt's activation (``"layer patch"``), (ii) its
    reconstruction from the fit's top-k PCA components, k = ``fit.n_params`` (``"PCA-k"``),
    (iii) the fit evaluated at the corrupt value (``fit.kind``), (iv) a fit of the same kind to
    shuffled values (``"shuffled"``: ``control``, by default :func:`shuffled_control` on the
    pairs' clean and corrupt activations), (v) the fit's mean activation (``"mean"``: what
    erasing the number does, the reference for the control) and any ``extra`` fits
    (name → ``HelixFit``).
    Metric: logit of the corrupt answer after patching − before, averaged over pairs.
    ``value`` names the fitted variable (default: ``position``, e.g. ``"a"``).
    """
    from arithinterp import sites as site_lib

    layer = fit.layer if layer is None else layer
    if layer is None:
        raise SiteError("pass layer= (the fit does not record one)")
    hook = site_lib.hook_name("resid_pre", site_lib.check_layers(model, "resid_pre", [layer])[0])
    if position not in pairs.clean.positions:
        raise SiteError(f"unknown position {position!r}; accepted: {accepted(pairs.clean.positions)}")
    if len(fit.names) != 1:
        raise AnalysisError("patch_test patches one number; fit a single-variable helix (values='a')")
    value = value or position
    clean_values = pairs.clean.label(value).double()
    corrupt_values = pairs.corrupt.label(value).double()
    stop = layer + 1 if layer + 1 < site_lib.n_layers(model) else None
    clean_acts = capture(model, pairs.clean, hook, position, batch_size, stop)
    corrupt_acts = capture(model, pairs.corrupt, hook, position, batch_size, stop)
    if corrupt_acts.shape[1] != fit.mean.shape[0]:
        raise AnalysisError(
            f"the fit is {fit.mean.shape[0]}-dimensional but the activations are {corrupt_acts.shape[1]}"
        )
    if control is None:
        control = shuffled_control(torch.cat([clean_acts, corrupt_acts]), torch.cat([clean_values, corrupt_values]),
                                   fit, random_state)
    methods = {
        "layer patch": corrupt_acts,
        f"PCA-{fit.n_params}": fit.pca_reconstruct(corrupt_acts),
        fit.kind: fit.predict(corrupt_values),
        "shuffled": control.predict(corrupt_values),
        "mean": fit.mean.float().expand_as(corrupt_acts),
    }
    for name, other in (extra or {}).items():
        methods[str(name)] = other.predict(corrupt_values)
    per_pair = _stacked_effects(model, pairs, hook, position, list(methods.values()), batch_size)
    effect = per_pair.mean(1)
    return HelixPatchResult(
        methods=list(methods), effect=effect, per_pair=per_pair,
        fraction=effect / effect[0] if float(effect[0]) != 0 else torch.full_like(effect, float("nan")),
        k=fit.n_params, layer=int(layer), position=position,
        meta=build_meta(model, n_pairs=len(pairs), periods=fit.periods, kind=fit.kind, value=value,
                        random_state=random_state),
    )


# --- period search -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeriodSearchResult(Result):
    """Score of every period subset tried (``subsets[i]``, ``scores[i]``) and the best subset of
    each size (``best[size]`` in ``sizes`` order). ``criterion`` is ``"held-out R²"`` or
    ``"causal effect"`` (mean corrupt-answer logit change when the fitted helix is patched in)."""

    subsets: list
    scores: torch.Tensor
    sizes: list
    best: list
    best_scores: torch.Tensor
    criterion: str
    meta: dict

    def to_frame(self):
        import pandas as pd

        best = {tuple(b) for b in self.best}
        return pd.DataFrame([dict(periods=", ".join(f"{T:g}" for T in s), size=len(s), score=float(self.scores[i]),
                                  best_of_size=tuple(s) in best) for i, s in enumerate(self.subsets)])

    def plot(self, **kwargs):
        from arithinterp.viz.fourier import period_search_figure

        return period_search_figure(self, **kwargs)


def search_periods(
    acts_or_tensor: Any,
    values: Values,
    candidates: Sequence[float] = DEFAULT_PERIODS,
    sizes: Optional[Sequence[int]] = None,
    *,
    model: Any = None,
    pairs: Any = None,
    layer: Optional[int] = None,
    position: str = "a",
    kind: str = "helix",
    n_pca: int = 100,
    holdout: float = 0.2,
    random_state: int = 0,
    site: Optional[str] = None,
    batch_size: int = 256,
    progress: bool = True,
) -> PeriodSearchResult:
    """The best subset of ``candidates`` of each size (default all sizes), RECIPES §1.

    Without a model, subsets are scored by held-out R² in PCA space (the PCA and split are
    shared, so the scores are comparable); with ``model`` and ``pairs``, by the causal effect of
    patching the fitted helix in at ``blocks.{layer}.hook_resid_pre`` / ``position``
    (the ``kind`` row of :func:`patch_test`, all subsets in one batched pass).
    """
    candidates = _check_periods(candidates)
    if len(set(candidates)) != len(candidates):
        raise ConfigError(f"candidate periods repeat: {candidates}")
    sizes = list(range(1, len(candidates) + 1)) if sizes is None else sorted({int(s) for s in sizes})
    if not sizes or any(not 1 <= s <= len(candidates) for s in sizes):
        raise ConfigError(f"sizes must be within 1..{len(candidates)}, got {sizes}")
    if (model is None) != (pairs is None):
        raise ConfigError("a causal search needs both model= and pairs=; pass neither to score by held-out R²")
    acts, site, layer_found, _, prompts = _activation_matrix(acts_or_tensor, site, layer, position)
    x, names = _resolve_values(values, prompts)
    if x.shape[0] != acts.shape[0]:
        raise AnalysisError(f"values has {x.shape[0]} rows but there are {acts.shape[0]} activations")
    subsets = [list(s) for size in sizes for s in itertools.combinations(candidates, size)]
    train = split_by_value(x, holdout, random_state)
    max_value = x.max(0).values.clamp_min(1.0).tolist()
    mean, comps, ev = _pca(acts[train], n_pca)
    if model is None:
        scores = []
        for subset in tqdm(subsets, desc="period subsets", disable=not progress):
            scores.append(_fit_core(acts, x, train, mean, comps, ev, kind, subset, None, names, max_value)[2])
        criterion = "held-out R²"
    else:
        from arithinterp import sites as site_lib

        layer = layer_found if layer is None else layer
        if layer is None:
            raise SiteError("a causal search needs layer=")
        hook = site_lib.hook_name("resid_pre", site_lib.check_layers(model, "resid_pre", [layer])[0])
        corrupt_values = pairs.corrupt.label(position).double()
        replacements = []
        for subset in subsets:
            coef = _fit_core(acts, x, train, mean, comps, ev, kind, subset, None, names, max_value)[0]
            design, _ = basis(corrupt_values, kind, subset, max_value=max_value, names=names)
            replacements.append((design @ coef @ comps + mean).float())
        scores = _stacked_effects(model, pairs, hook, position, replacements, batch_size).mean(1).tolist()
        criterion = "causal effect"
    scores = torch.tensor(scores)
    best, best_scores = [], []
    for size in sizes:
        idx = [i for i, s in enumerate(subsets) if len(s) == size]
        i = max(idx, key=lambda j: float(scores[j]))
        best.append(subsets[i])
        best_scores.append(float(scores[i]))
    return PeriodSearchResult(
        subsets=subsets, scores=scores, sizes=sizes, best=best, best_scores=torch.tensor(best_scores),
        criterion=criterion,
        meta=build_meta(model, candidates=candidates, kind=kind, n_pca=comps.shape[0], holdout=holdout,
                        random_state=random_state, layer=layer if model is not None else layer_found),
    )


# --- neuron preactivation fits -------------------------------------------------------------------


NEURON_VARIABLES = ("a", "b", "a+b")


def _neuron_design(a: torch.Tensor, b: torch.Tensor, periods: list[float]) -> tuple[torch.Tensor, list[float]]:
    """Columns ``t / scale_t`` (3), ``cos / sin(2πt/T)`` per period and t (2·3·nT), constant."""
    ts = torch.stack([a, b, a + b], 1).double()
    scale = ts.abs().max(0).values.clamp_min(1.0)
    angle = 2 * math.pi * ts[:, None, :] / torch.tensor(periods, dtype=torch.float64)[None, :, None]  # [N, nT, 3]
    periodic = torch.stack([angle.cos(), angle.sin()], -1).reshape(ts.shape[0], -1)
    return torch.cat([ts / scale, periodic, torch.ones(ts.shape[0], 1, dtype=torch.float64)], 1), scale.tolist()


@dataclass(frozen=True)
class NeuronFitResult(Result):
    """Neuron preactivation fits (RECIPES §1, Kantamneni & Tegmark 2025):

    ``N(a, b) ≈ bias + Σ_t c_t·t + Σ_T Σ_t c_{T,t}·cos(2π/T·(t − d_{T,t}))``, t ∈ {a, b, a+b}.

    ``linear`` [m, 3] = ``c_t`` (per unit of t), ``amplitude`` / ``phase`` [m, nT, 3] =
    ``c_{T,t}`` ≥ 0 / ``d_{T,t}`` in ``[0, T)``, ``bias`` [m]; ``nrmse`` [m] =
    RMSE / (max − min) of each neuron's preactivation over the prompts.
    """

    neurons: list
    nrmse: torch.Tensor
    linear: torch.Tensor
    amplitude: torch.Tensor
    phase: torch.Tensor
    bias: torch.Tensor
    periods: list
    method: str
    meta: dict

    def predict(self, a: Any, b: Any) -> torch.Tensor:
        """Preactivations [n, m] the fits give at operands ``a``, ``b`` [n]."""
        ts = torch.stack([torch.as_tensor(a), torch.as_tensor(b), torch.as_tensor(a) + torch.as_tensor(b)], 1).double()
        periods = torch.tensor(self.periods, dtype=torch.float64)
        angle = 2 * math.pi / periods[None, None, :, None] * (ts[:, None, None, :] - self.phase.double()[None])
        periodic = (self.amplitude.double()[None] * angle.cos()).sum((2, 3))
        return (ts @ self.linear.double().T + periodic + self.bias.double()).float()

    def to_frame(self):
        import pandas as pd

        strongest = self.amplitude.flatten(1).argmax(1).tolist()
        n_t = len(NEURON_VARIABLES)
        return pd.DataFrame(dict(
            neuron=self.neurons, nrmse=self.nrmse.tolist(),
            strongest_period=[self.periods[i // n_t] for i in strongest],
            strongest_variable=[NEURON_VARIABLES[i % n_t] for i in strongest],
            strongest_amplitude=self.amplitude.flatten(1).max(1).values.tolist(),
        ))

    def plot(self, **kwargs):
        from arithinterp.viz.fourier import neuron_fit_figure

        return neuron_fit_figure(self, **kwargs)


def fit_neurons(
    preacts: torch.Tensor,
    a: Any,
    b: Any,
    periods: Sequence[float] = DEFAULT_PERIODS,
    *,
    method: str = "gd",
    steps: int = 3000,
    lr: float = 0.05,
    neurons: Optional[Sequence[int]] = None,
    progress: bool = True,
) -> NeuronFitResult:
    """Fit the RECIPES §1 preactivation model to each column of ``preacts`` [N, m] over operands
    ``a``, ``b`` [N], minimising the MSE.

    Every term ``c·cos(2π/T·(t − d))`` equals ``α·cos(2πt/T) + β·sin(2πt/T)`` with
    ``c = √(α² + β²)``, ``d = T·atan2(β, α)/2π``, so the model is linear in (α, β, c_t, bias)
    and its MSE is convex. ``method="gd"`` runs full-batch Adam on that MSE (all neurons at
    once, through the Gram matrix, deterministic: it starts from zero); ``"lstsq"`` solves it
    exactly. Both report c and d in the paper's form.
    """
    if method not in NEURON_METHODS:
        raise ConfigError(f"unknown method {method!r}; accepted: {accepted(NEURON_METHODS)}")
    if preacts.ndim != 2:
        raise AnalysisError(f"preacts must be [n_prompts, n_neurons], got shape {tuple(preacts.shape)}")
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if a.shape != (preacts.shape[0],) or b.shape != a.shape:
        raise AnalysisError(f"a and b must be [{preacts.shape[0]}], got {tuple(a.shape)} and {tuple(b.shape)}")
    if steps < 1 or lr <= 0:
        raise ConfigError(f"steps must be ≥ 1 and lr > 0, got steps={steps}, lr={lr}")
    periods = _check_periods(periods)
    design, scale = _neuron_design(a, b, periods)
    y = preacts.double()
    centre, spread = y.mean(0), y.std(0).clamp_min(1e-12)
    target = (y - centre) / spread  # standardised so one learning rate suits every neuron
    if method == "lstsq":
        weights = _lstsq(design, target)
    else:
        gram = design.T @ design / design.shape[0]
        moment = design.T @ target / design.shape[0]
        weights = torch.zeros((design.shape[1], y.shape[1]), dtype=torch.float64, requires_grad=True)
        optimiser = torch.optim.Adam([weights], lr=lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, steps)
        for _ in tqdm(range(steps), desc="neuron fits", disable=not progress):
            optimiser.zero_grad()
            # MSE(w) = wᵀGw − 2wᵀm + const: the exact full-batch loss, without re-reading N rows
            loss = ((weights * (gram @ weights)).sum(0) - 2 * (weights * moment).sum(0)).sum()
            loss.backward()
            optimiser.step()
            schedule.step()
        weights = weights.detach()
    weights = weights * spread[None]
    pred = design @ weights + centre
    rmse = (pred - y).pow(2).mean(0).sqrt()
    nrmse = rmse / (y.max(0).values - y.min(0).values).clamp_min(1e-12)
    n_t, n_p, m = 3, len(periods), y.shape[1]
    linear = weights[:n_t].T / torch.tensor(scale, dtype=torch.float64)
    periodic = weights[n_t:n_t + 2 * n_t * n_p].T.reshape(m, n_p, n_t, 2)
    alpha, beta = periodic[..., 0], periodic[..., 1]
    tau = torch.tensor(periods, dtype=torch.float64)[None, :, None]
    amplitude = (alpha.pow(2) + beta.pow(2)).sqrt()
    phase = torch.remainder(torch.atan2(beta, alpha) * tau / (2 * math.pi), tau)
    bias = weights[-1] + centre
    return NeuronFitResult(
        neurons=list(range(m)) if neurons is None else [int(n) for n in neurons],
        nrmse=nrmse.float(), linear=linear.float(), amplitude=amplitude.float(), phase=phase.float(),
        bias=bias.float(), periods=periods, method=method,
        meta=build_meta(n_prompts=y.shape[0], **(dict(steps=steps, lr=lr) if method == "gd" else {})),
    )


def neuron_fits(
    model: Any,
    prompts: Any,
    layer: int,
    neurons: Optional[Sequence[int]] = None,
    periods: Sequence[float] = DEFAULT_PERIODS,
    *,
    site: str = "mlp_pre",
    position: str = "final",
    batch_size: int = 512,
    progress: bool = True,
    **kwargs: Any,
) -> NeuronFitResult:
    """:func:`fit_neurons` on a model's MLP preactivations at ``position`` (default the last
    token) for ``neurons`` of ``layer`` (default all)."""
    from arithinterp import sites as site_lib
    from arithinterp.activations import collect

    if site not in ("mlp_pre", "mlp_post"):
        raise SiteError(f"neuron fits read 'mlp_pre' or 'mlp_post', got {site!r}")
    acts = collect(model, prompts, sites=[site], layers=[layer], positions=position, batch_size=batch_size,
                   progress=progress)
    chosen = site_lib.check_index("neuron", neurons, int(model.cfg.d_mlp))
    result = fit_neurons(acts.get(site, layer, position)[:, chosen], prompts.a, prompts.b, periods,
                         neurons=chosen, progress=progress, **kwargs)
    meta = dict(result.meta, **build_meta(model, layer=layer, site=site, position=position))
    return dataclasses.replace(result, meta=meta)
