"""Probe sweeps over layers and positions: k-fold held-out scores with controls.

Targets (:func:`resolve_target`: a prompt label, the model's own answer, or an array), the
cross-validation folds, :func:`confidence_interval`, and :func:`sweep`, which probes every
layer x position with 95% CIs, directions fitted on all data, and controls (shuffled labels; a
random-init model's activations) → :class:`ProbeResult`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from arithinterp.errors import AnalysisError, ConfigError, SiteError, TaskError, accepted
from arithinterp.probes.estimators import KINDS, _targets, _tensor, is_classifier_kind, make_probe
from arithinterp.results import Result, build_meta
from arithinterp.tasks import UNPARSABLE as _UNPARSABLE  # a generated answer that is not a number

CONTROLS = ("shuffled", "random_init")
_MODEL_TARGETS = ("model_answer", "model_correct", "model_answer_digit_{i}")


# --- targets --------------------------------------------------------------------------------------


def _model_answer_values(model_answer: Any, n: int, prompts: Any = None) -> torch.Tensor:
    if model_answer is None:
        raise AnalysisError(
            "targets about the model's own answer need model_answer=: pass the model, "
            "prompts.evaluate(model) (an Evaluation) or its .model_answer tensor"
        )
    if hasattr(model_answer, "cfg") and callable(model_answer):  # a model: evaluate the prompts with it
        if prompts is None:
            raise AnalysisError("model_answer=model needs activations that carry their prompts")
        model_answer = prompts.evaluate(model_answer)
    values = getattr(model_answer, "model_answer", model_answer)
    values = _tensor(values, "model_answer").long()
    if values.shape != (n,):
        raise AnalysisError(f"model_answer must have one answer per prompt ({n}), got shape {tuple(values.shape)}")
    return values


def resolve_target(prompts: Any, target: Any, n: int, model_answer: Any = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Labels for ``target``: ``(y [n_kept], keep BoolTensor [n], name)``.

    ``target`` is a label name of ``prompts.label`` (``"a"``, ``"answer_digit_0"``,
    ``"carry_1"``, ...), ``"model_answer"``, ``"model_correct"``, ``"model_answer_digit_{i}"``
    (needs ``model_answer``: the model, which evaluates ``prompts``, an ``Evaluation`` or a
    tensor ``[n]``), or an array of ``n`` values.
    Prompts whose generated answer is not a number are left out of model-answer targets (``keep``).
    """
    keep = torch.ones(n, dtype=torch.bool)
    if not isinstance(target, str):
        y = _tensor(target, "target")
        if y.ndim != 1 or len(y) != n:
            raise AnalysisError(f"a target array must have one value per prompt ({n}), got shape {tuple(y.shape)}")
        return y, keep, "custom"
    name = re.sub(r"^sum_digit_", "answer_digit_", target)
    if name.startswith("model_"):
        match = re.fullmatch(r"model_answer_digit_(\d+)", name)
        if name not in ("model_answer", "model_correct") and not match:
            raise AnalysisError(f"unknown target {target!r}; model targets: {accepted(_MODEL_TARGETS)}")
        values = _model_answer_values(model_answer, n, prompts)
        if name == "model_correct":
            if prompts is None:
                raise AnalysisError("target 'model_correct' needs the prompts (acts.prompts) for the true answers")
            return (values == prompts.answer).long(), keep, name
        keep = values != _UNPARSABLE
        values = values[keep]
        if match:
            values = (values.abs() // 10 ** int(match.group(1))) % 10
        return values, keep, name
    if prompts is None:
        raise AnalysisError(f"target {target!r} names a label but these activations carry no prompts; pass an array")
    try:
        return prompts.label(name), keep, name
    except TaskError as error:
        raise AnalysisError(f"{error}; or a model target {accepted(_MODEL_TARGETS)}; or an array of {n} values") from error


# --- cross-validation -----------------------------------------------------------------------------


def _folds(y: torch.Tensor, cv: int, stratify: bool, random_state: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from sklearn.model_selection import KFold, StratifiedKFold

    if not isinstance(cv, (int, np.integer)) or cv < 2:
        raise ConfigError(f"cv must be an integer number of folds >= 2, got {cv!r}")
    n = len(y)
    if n < 2 * cv:
        raise AnalysisError(f"too few samples for {cv}-fold cross-validation: {n}; need at least {2 * cv}")
    labels = y.numpy()
    if stratify and np.unique(labels, return_counts=True)[1].min() >= cv:
        splitter = StratifiedKFold(cv, shuffle=True, random_state=random_state)
    else:
        splitter = KFold(cv, shuffle=True, random_state=random_state)
    return list(splitter.split(np.zeros(n), labels))


def _probe_cell(kind: str, X: torch.Tensor, label_sets: list, folds, probe_kw: dict, random_state: int, full: bool):
    """Held-out scores ``[len(label_sets), n_folds]`` for each label set on the same folds, and
    (when ``full``) the probe fitted on every sample of the first label set."""
    make = lambda: make_probe(kind, random_state=random_state, **probe_kw)  # noqa: E731
    if kind == "logistic":  # every fold of every label set (and the full fit) in one L-BFGS run
        masks = torch.zeros(len(folds), len(X), dtype=torch.bool)
        for f, (train, _) in enumerate(folds):
            masks[f, train] = True
        targets = torch.cat([y.expand(len(folds), -1) for y in label_sets] + ([label_sets[0][None]] if full else []))
        masks = torch.cat([masks] * len(label_sets) + ([torch.ones(1, len(X), dtype=torch.bool)] if full else []))
        fitted = make().fit_many(X, targets, masks)
        scores = [[fitted[s * len(folds) + f].score(X[test], y[test]) for f, (_, test) in enumerate(folds)]
                  for s, y in enumerate(label_sets)]
        return torch.tensor(scores), (fitted[-1] if full else None)
    scores = [[make().fit(X[train], y[train]).score(X[test], y[test]) for train, test in folds] for y in label_sets]
    return torch.tensor(scores), (make().fit(X, label_sets[0]) if full and kind != "mlp" else None)


def confidence_interval(scores: torch.Tensor, level: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Student-t interval of the mean over the last axis (folds): ``(low, high)``."""
    from scipy.stats import t as student_t

    k = scores.shape[-1]
    mean = scores.mean(-1)
    if k < 2:
        return mean.clone(), mean.clone()
    half = float(student_t.ppf(0.5 + level / 2, k - 1)) * scores.std(-1, unbiased=True) / math.sqrt(k)
    return mean - half, mean + half


# --- sweeps ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult(Result):
    """Held-out probe scores over layers × positions, with controls and fitted directions.

    ``fold_scores`` [L, P, folds] (accuracy, or R² for ridge), ``control_scores``
    [C, L, P, folds] for each name in ``controls`` (same folds), ``directions`` [L, P, k, d] of
    probes fitted on all prompts (``None`` for MLP probes), ``classes`` the label of each
    direction row. ``chance`` is the majority-class accuracy (0 for R²).
    """

    fold_scores: torch.Tensor
    control_scores: torch.Tensor
    directions: Optional[torch.Tensor]
    layers: list
    positions: list
    controls: list
    classes: list
    site: str
    target: str
    kind: str
    metric: str
    chance: float
    meta: dict

    @property
    def mean(self) -> torch.Tensor:
        """Mean held-out score [L, P]."""
        return self.fold_scores.mean(-1)

    @property
    def ci(self) -> tuple[torch.Tensor, torch.Tensor]:
        """95% CI of the mean score across folds, ``(low, high)`` each [L, P]."""
        return confidence_interval(self.fold_scores)

    @property
    def control_mean(self) -> torch.Tensor:
        """[C, L, P]."""
        return self.control_scores.mean(-1)

    @property
    def control_ci(self) -> tuple[torch.Tensor, torch.Tensor]:
        return confidence_interval(self.control_scores)

    @property
    def selectivity(self) -> torch.Tensor:
        """Real minus control mean score [C, L, P]."""
        return self.mean[None] - self.control_mean

    def control(self, name: str = "shuffled") -> torch.Tensor:
        """Mean score of control ``name`` [L, P]."""
        if name not in self.controls:
            raise AnalysisError(f"control {name!r} was not run; run controls: {accepted(self.controls)}")
        return self.control_mean[self.controls.index(name)]

    def best(self) -> dict:
        """The layer and position with the highest mean held-out score, with its CI and selectivity."""
        mean = self.mean
        flat = int(mean.flatten().argmax())
        li, pi = divmod(flat, mean.shape[1])
        low, high = self.ci
        out = dict(layer=self.layers[li], position=self.positions[pi], score=float(mean[li, pi]),
                   ci_low=float(low[li, pi]), ci_high=float(high[li, pi]), metric=self.metric)
        for c, name in enumerate(self.controls):
            out[f"{name}_score"] = float(self.control_mean[c, li, pi])
            out[f"selectivity_{name}"] = float(self.selectivity[c, li, pi])
        return out

    def to_frame(self):
        """One row per layer × position × probe (``"probe"`` or a control)."""
        import pandas as pd

        rows = []
        sources = [("probe", self.fold_scores)] + [(c, self.control_scores[i]) for i, c in enumerate(self.controls)]
        for source, scores in sources:
            mean, (low, high) = scores.mean(-1), confidence_interval(scores)
            for li, layer in enumerate(self.layers):
                for pi, position in enumerate(self.positions):
                    row = dict(site=self.site, target=self.target, kind=self.kind, source=source, layer=layer,
                               position=position, metric=self.metric, score=float(mean[li, pi]),
                               ci_low=float(low[li, pi]), ci_high=float(high[li, pi]),
                               n_folds=scores.shape[-1], chance=self.chance)
                    if source == "probe":
                        for c, name in enumerate(self.controls):
                            row[f"selectivity_{name}"] = float(self.selectivity[c, li, pi])
                    rows.append(row)
        return pd.DataFrame(rows)

    def plot(self, position: Optional[str] = None, **kwargs):
        """Score over layers with 95% CI bands, the controls and chance (see ``viz.probes``)."""
        from arithinterp.viz.probes import probe_layers

        return probe_layers(self, position=position, **kwargs)


def _check_acts(acts: Any, name: str = "acts") -> None:
    if not all(hasattr(acts, attr) for attr in ("data", "layers", "positions")):
        raise AnalysisError(f"{name} must be an Activations (from arithinterp.activations.collect), got {type(acts).__name__}")


def _pick_site(acts: Any, site: Optional[str]) -> str:
    if site is None:
        if len(acts.data) == 1:
            return next(iter(acts.data))
        if "resid_post" in acts.data:
            return "resid_post"
        raise SiteError(f"these activations hold several sites; choose one with site=: {accepted(acts.data)}")
    if site not in acts.data:
        raise SiteError(f"site {site!r} was not collected; collected sites: {accepted(acts.data)}")
    return site


def _pick(values: Any, available: list, what: str) -> list:
    if values is None:
        return list(available)
    values = [values] if isinstance(values, (int, str)) else list(values)
    if not values:
        raise SiteError(f"{what} is empty; pass None for all collected {what} or a list of them")
    keys = [str(v) for v in available]
    for v in values:
        if str(v) not in keys:
            raise SiteError(f"{what[:-1]} {v!r} was not collected; collected {what}: {accepted(available)}")
    return [available[keys.index(str(v))] for v in values]


def sweep(
    acts: Any,
    target: Any,
    kind: str = "logistic",
    site: Optional[str] = None,
    layers: Optional[Sequence[int]] = None,
    positions: Optional[Sequence[Union[str, int]]] = None,
    cv: int = 5,
    controls: Sequence[str] = ("shuffled",),
    control_acts: Any = None,
    model_answer: Any = None,
    random_state: int = 0,
    progress: bool = True,
    **probe_kw: Any,
) -> ProbeResult:
    """Probe ``target`` at every layer × position of ``acts`` with k-fold held-out scores.

    Args:
        acts: an ``Activations``; its ``data[site]`` is ``[N, n_layers, n_positions, *site_shape]``
            (per-head / per-neuron shapes are flattened into features).
        target: a label name (see :func:`resolve_target`) or an array of N labels.
        kind: ``"logistic"``, ``"ridge"``, ``"circular"`` or ``"mlp"``; ``probe_kw`` go to the probe.
        controls: ``"shuffled"`` (the same probe on permuted labels) and/or ``"random_init"``
            (the same probe on ``control_acts``, the activations of a random-init copy of the model
            on the same prompts — ``arithinterp.models.random_like``); giving ``control_acts``
            adds ``"random_init"``.
        cv: folds (stratified by label for classifiers when every class has ``cv`` members).

    Returns a :class:`ProbeResult`: per-fold held-out scores, their 95% CI, control scores,
    selectivity = probe − control, and the probe directions fitted on all prompts.
    """
    _check_acts(acts)
    if kind not in KINDS:
        raise ConfigError(f"unknown probe kind {kind!r}; accepted: {accepted(KINDS)}")
    make_probe(kind, **probe_kw)  # validates probe options before any work
    site = _pick_site(acts, site)
    layers = _pick(layers, list(acts.layers), "layers")
    positions = _pick(positions, list(acts.positions), "positions")
    controls = list(dict.fromkeys(list(controls) + (["random_init"] if control_acts is not None else [])))
    for name in controls:
        if name not in CONTROLS:
            raise ConfigError(f"unknown control {name!r}; accepted: {accepted(CONTROLS)}")
    if "random_init" in controls:
        if control_acts is None:
            raise AnalysisError("control 'random_init' needs control_acts: collect(random_like(model, seed), prompts, ...)")
        _check_acts(control_acts, "control_acts")
        if site not in control_acts.data or tuple(control_acts.data[site].shape) != tuple(acts.data[site].shape):
            raise AnalysisError(
                f"control_acts must hold site {site!r} with the same shape as acts "
                f"{tuple(acts.data[site].shape)}; collect them on the same prompts, layers and positions"
            )
    n = acts.data[site].shape[0]
    y, keep, target_name = resolve_target(getattr(acts, "prompts", None), target, n, model_answer)
    classifier = is_classifier_kind(kind)
    y = _targets(y, len(y), integer=classifier)
    if classifier and len(torch.unique(y)) < 2:
        raise AnalysisError(f"target {target_name!r} has a single class {torch.unique(y).tolist()}; nothing to probe")
    folds = _folds(y, cv, classifier, random_state)
    shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(random_state))]

    def features(source, layer, position):
        return source.data[site][keep, source.layers.index(layer), source.positions.index(position)].flatten(1)

    fold_scores = torch.zeros(len(layers), len(positions), cv)
    control_scores = torch.zeros(len(controls), len(layers), len(positions), cv)
    directions, classes = [], []
    cells = [(li, pi) for li in range(len(layers)) for pi in range(len(positions))]
    with torch.inference_mode():
        for li, pi in tqdm(cells, desc=f"probe {target_name}", disable=not progress):
            X = features(acts, layers[li], positions[pi])
            label_sets = [y] + ([shuffled] if "shuffled" in controls else [])
            scores, probe = _probe_cell(kind, X, label_sets, folds, probe_kw, random_state, full=True)
            fold_scores[li, pi] = scores[0]
            if "shuffled" in controls:
                control_scores[controls.index("shuffled"), li, pi] = scores[1]
            if "random_init" in controls:
                X_control = features(control_acts, layers[li], positions[pi])
                control_scores[controls.index("random_init"), li, pi] = _probe_cell(
                    kind, X_control, [y], folds, probe_kw, random_state, full=False)[0][0]
            if probe is not None:
                directions.append(probe.directions_)
                classes = probe.classes_.tolist() if hasattr(probe, "classes_") else (["cos", "sin"] if kind == "circular" else ["value"])
    if directions:
        directions = torch.stack(directions).reshape(len(layers), len(positions), *directions[0].shape)
    else:
        directions = None
    chance = float(torch.unique(y, return_counts=True)[1].max()) / len(y) if classifier else 0.0
    if kind == "circular":
        chance = float(torch.bincount(y % probe_kw.get("period", 10)).max()) / len(y)
    meta = build_meta(
        target=target_name, n_prompts=n, n_used=int(keep.sum()), cv=cv, random_state=random_state,
        probe=dict(kind=kind, **probe_kw), activations=dict(getattr(acts, "meta", None) or {}),
    )
    if not keep.all():
        meta["dropped"] = dict(count=int((~keep).sum()), reason="the model's generated answer is not a number")
    return ProbeResult(
        fold_scores=fold_scores, control_scores=control_scores, directions=directions, layers=list(layers),
        positions=[str(p) for p in positions], controls=controls, classes=classes, site=site, target=target_name,
        kind=kind, metric="accuracy" if classifier else "r2", chance=chance, meta=meta,
    )
