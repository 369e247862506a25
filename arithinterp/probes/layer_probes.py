"""Probe sweeps over layers and positions: k-fold held-out scores with controls.

:func:`probe_layers` probes every layer x position with 95% CIs (clipped to the metric's range),
directions fitted on all data, and controls (shuffled labels; a random-init model's activations)
→ :class:`~arithinterp.probes.ProbeResult` (:mod:`~arithinterp.probes.probe_result`), whose
``finding()`` calls something readable only when it beats chance and every control.
:func:`probe_model` collects the model's and a random-init copy's activations and probes both
(readable vs computed). Targets come from :mod:`~arithinterp.probes.targets`, the folds (grouped
by operand pair whenever a pair repeats, so that no pair is on both sides of a fold) and each
cell's held-out scores from :mod:`~arithinterp.probes.cross_validation`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np
import torch

from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.probes.cross_validation import (
    fold_scheme, is_classifier, make_folds, probe_cell, read_out_directions, resolve_groups,
)
from arithinterp.probes.estimators import PROBE_KINDS, CircularProbe, MLPProbe, RidgeProbe, make_probe
from arithinterp.probes.logistic import LogisticProbe
from arithinterp.probes.probe_base import as_targets
from arithinterp.probes.probe_result import CONTROLS, ProbeResult
from arithinterp.probes.targets import resolve_target
from arithinterp.progress import progress_bar
from arithinterp.results import build_meta, made_from
from arithinterp.types import checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet
    from arithinterp.types import HookedModel


def _check_acts(acts: Any, name: str = "acts") -> None:
    if not all(hasattr(acts, attr) for attr in ("data", "layers", "positions")):
        raise AnalysisError(
            f"{name} must be an Activations (from arithinterp.activations.collect), got {type(acts).__name__}")


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
    picked = [available[keys.index(str(v))] for v in values]
    if len({str(v) for v in picked}) != len(picked):  # one layer or position probed twice, as two rows
        raise SiteError(f"{what}={values!r} names one of the {what} more than once; name each once")
    return picked


def _resolve_estimator(kind: Optional[str], estimator: Any, probe_kw: dict, random_state: int) -> tuple[Any, str]:
    """The estimator to clone per fold, and its name (the ``kind`` shortcut or the class name)."""
    if estimator is None:
        kind = "logistic" if kind is None else kind
        if kind not in PROBE_KINDS:
            raise ConfigError(f"unknown probe kind {kind!r}; accepted: {accepted(PROBE_KINDS)}, or pass estimator=")
        return make_probe(kind, **dict(dict(random_state=random_state), **probe_kw)), kind
    if kind is not None or probe_kw:
        given = ["kind"] * (kind is not None) + list(probe_kw)
        raise ConfigError("pass either estimator= or kind= with probe options, not both "
                          f"(got estimator and {accepted(given)}); set options on the estimator itself")
    if not all(callable(getattr(estimator, m, None)) for m in ("fit", "score", "get_params")):
        raise ConfigError(f"estimator must be a scikit-learn-style estimator with fit, score and get_params, "
                          f"got {type(estimator).__name__}; for a named probe use kind={accepted(PROBE_KINDS)}")
    names = {cls: kind for kind, cls in (("logistic", LogisticProbe), ("ridge", RidgeProbe),
                                         ("circular", CircularProbe), ("mlp", MLPProbe))}
    return estimator, names.get(type(estimator), type(estimator).__name__)


@checked
def probe_layers(
    acts: Any,
    target: Any,
    kind: Optional[str] = None,
    site: Optional[str] = None,
    layers: Optional[Sequence[int]] = None,
    positions: Optional[Sequence[Union[str, int]]] = None,
    cv: int = 5,
    controls: Sequence[str] = ("shuffled",),
    control_acts: Any = None,
    model_answer: Any = None,
    seed: int = 0,
    progress: bool = True,
    groups: Any = "auto",
    estimator: Any = None,
    **probe_kw: Any,
) -> ProbeResult:
    """Probe ``target`` at every layer × position of ``acts`` with k-fold held-out scores.

    Args:
        acts: an ``Activations``; its ``data[site]`` is ``[N, n_layers, n_positions, *site_shape]``
            (per-head / per-neuron shapes are flattened into features).
        target: a label name (see :func:`resolve_target`) or an array of N labels.
        kind: a shortcut for one of our probes, ``"logistic"`` (default), ``"ridge"``,
            ``"circular"`` or ``"mlp"``; ``probe_kw`` go to the probe.
        estimator: instead of ``kind``, any scikit-learn-style estimator (``fit`` / ``score`` /
            ``get_params``, e.g. ``LogisticRegression(C=0.1)`` or ``RidgeProbe(alpha=10)``); it
            is ``clone``-d for every fit and never fitted itself. Classifiers are scored by
            accuracy, regressors by R² (their ``score``).
        groups: which prompts must share a fold. ``"auto"`` (default) groups by operand pair
            ``(a, b)`` whenever a pair occurs more than once (pooled few-shot prefixes or
            templates): a probe that recognises a pair it was trained on then cannot score.
            ``"pair"``, a label name (``"a"`` holds out whole a values), an array of N group
            ids, or ``None`` (plain folds, even with repeated pairs). The scheme used is in
            ``result.fold_scheme`` and ``result.meta["folds"]``.
        controls: ``"shuffled"`` (the same probe on permuted labels) and/or ``"random-init"``
            (the same probe on ``control_acts``, the activations of a random-init copy of the model
            on the same prompts — ``arithinterp.models.random_like``); giving ``control_acts``
            adds ``"random-init"``.
        cv: folds (stratified by label for classifiers when every class has ``cv`` members).
        site: the site probed (default: the one collected, or ``"resid_post"``).
        layers: the layers probed (default: every one collected).
        positions: the positions probed (default: every one collected).
        control_acts: the random-init control's activations (adds ``"random-init"``).
        model_answer: for model-answer targets: the model, an ``Evaluation`` or a tensor [N].
        seed: the seed of the folds, the shuffled control and the MLP probe.
        progress: show a progress bar.
        **probe_kw: the ``kind`` probe's options.

    Returns:
        The sweep (a :class:`ProbeResult`): per-fold held-out scores, their 95% CI, control
        scores, selectivity = probe − control, and the probe directions fitted on all prompts.

    Raises:
        AnalysisError: the activations, target, controls or groups are refused, or the target
            has a single class.
        ConfigError: an unknown probe kind or control, or both ``estimator`` and ``kind``.
        SiteError: a site, layer or position that was not collected, or one named twice.
    """
    _check_acts(acts)
    estimator, kind = _resolve_estimator(kind, estimator, probe_kw, seed)
    site = _pick_site(acts, site)
    layers = _pick(layers, list(acts.layers), "layers")
    positions = _pick(positions, list(acts.positions), "positions")
    controls = list(dict.fromkeys(list(controls) + (["random-init"] if control_acts is not None else [])))
    for name in controls:
        if name not in CONTROLS:
            raise ConfigError(f"unknown control {name!r}; accepted: {accepted(CONTROLS)}")
    if "random-init" in controls:
        if control_acts is None:
            raise AnalysisError(
                "control 'random-init' needs control_acts: collect(random_like(model, seed), prompts, ...)")
        _check_acts(control_acts, "control_acts")
        if site not in control_acts.data or tuple(control_acts.data[site].shape) != tuple(acts.data[site].shape):
            raise AnalysisError(
                f"control_acts must hold site {site!r} with the same shape as acts "
                f"{tuple(acts.data[site].shape)}; collect them on the same prompts, layers and positions"
            )
    n = acts.data[site].shape[0]
    prompts = getattr(acts, "prompts", None)
    y, keep, target_name = resolve_target(prompts, target, n, model_answer)
    group_ids, group_name = resolve_groups(prompts, groups, n)
    if group_ids is not None:
        group_ids = group_ids[keep.numpy()]
    classifier = is_classifier(estimator)
    y = as_targets(y, len(y), integer=classifier)
    if classifier and len(torch.unique(y)) < 2:
        raise AnalysisError(f"target {target_name!r} has a single class {torch.unique(y).tolist()}; nothing to probe")
    folds = make_folds(y, cv, classifier, seed, group_ids)
    stratified = classifier and bool(torch.unique(y, return_counts=True)[1].min() >= cv)
    scheme = fold_scheme(cv, stratified, group_ids, group_name, groups)
    shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))]

    def features(source, layer, position):
        return source.data[site][keep, source.layers.index(layer), source.positions.index(position)].flatten(1)

    fold_scores = torch.zeros(len(layers), len(positions), cv)
    control_scores = torch.zeros(len(controls), len(layers), len(positions), cv)
    directions, classes = [], []
    cells = [(li, pi) for li in range(len(layers)) for pi in range(len(positions))]
    with torch.inference_mode():
        for li, pi in progress_bar(cells, desc=f"probe {target_name}", disable=not progress):
            X = features(acts, layers[li], positions[pi])
            label_sets = [y] + ([shuffled] if "shuffled" in controls else [])
            scores, probe = probe_cell(estimator, X, label_sets, folds, full=True)
            fold_scores[li, pi] = scores[0]
            if "shuffled" in controls:
                control_scores[controls.index("shuffled"), li, pi] = scores[1]
            if "random-init" in controls:
                X_control = features(control_acts, layers[li], positions[pi])
                control_scores[controls.index("random-init"), li, pi] = probe_cell(
                    estimator, X_control, [y], folds, full=False)[0][0]
            if probe is not None and (read_out := read_out_directions(probe)) is not None:
                directions.append(read_out)
                if hasattr(probe, "classes_"):  # a binary classifier has one row, towards its second class
                    classes = torch.as_tensor(np.asarray(probe.classes_)).tolist()[-len(read_out):]
                else:
                    classes = ["cos", "sin"] if kind == "circular" else ["value"] * len(read_out)
    if directions and len(directions) == len(cells):
        directions = torch.stack(directions).reshape(len(layers), len(positions), *directions[0].shape)
    else:
        directions = None
    chance = float(torch.unique(y, return_counts=True)[1].max()) / len(y) if classifier else 0.0
    if isinstance(estimator, CircularProbe):
        chance = float(torch.bincount(y % estimator.period).max()) / len(y)
    params = {k: v for k, v in estimator.get_params(deep=False).items()
              if isinstance(v, (int, float, str, bool, type(None)))}
    meta = build_meta(
        **made_from(acts), target=target_name, n_prompts=n, n_used=int(keep.sum()), cv=cv, seed=seed,
        probe=dict(kind=kind, **params), folds=scheme, activations=dict(getattr(acts, "meta", None) or {}),
    )
    if not keep.all():
        meta["dropped"] = dict(count=int((~keep).sum()), reason="the model's generated answer is not a number")
    return ProbeResult(
        fold_scores=fold_scores, control_scores=control_scores, directions=directions, layers=list(layers),
        positions=[str(p) for p in positions], controls=controls, classes=classes, site=site, target=target_name,
        kind=kind, metric="accuracy" if classifier else "r2", chance=chance, meta=meta, fold_scheme=scheme["text"],
    )


@checked
def probe_model(
    model: HookedModel,
    prompts: PromptSet,
    target: Any,
    *,
    site: str = "resid_post",
    layers: Optional[Sequence[int]] = None,
    positions: Union[str, Sequence[Union[str, int]]] = "final",
    seed: int = 0,
    batch_size: Optional[int] = None,
    progress: bool = True,
    **kwargs: Any,
) -> ProbeResult:
    """Readable vs computed: :func:`probe_layers` on ``model``'s activations with the controls
    a finding needs — shuffled labels and a random-init model of the same architecture
    (:func:`arithinterp.models.random_like` with ``seed``) on the same prompts, sites, layers
    and positions — so that :meth:`ProbeResult.finding` can tell a value the training computed
    from one the input already shows (the token at position ``a`` *is* its digit, and a
    random-init model reads it too).

    Args:
        model: The hooked model.
        prompts: The prompts read.
        target: A label name (see :func:`~arithinterp.probes.resolve_target`) or an array.
        site: The site read.
        layers: The layers read (default all).
        positions: The positions read.
        seed: The random-init copy's seed, and the probes' ``seed``.
        batch_size: Prompts per forward when collecting.
        progress: Show progress bars.
        **kwargs: Passed to :func:`probe_layers` (``kind``, ``cv``, ``groups``, ``model_answer``, ...).

    Returns:
        The sweep with the shuffled and random-init controls.

    Raises:
        ConfigError: ``kwargs`` name controls (this function runs them itself).
    """
    from arithinterp.activations import collect
    from arithinterp.models import random_like

    if "control_acts" in kwargs or "controls" in kwargs:
        raise ConfigError("probe_model runs the shuffled and random-init controls itself; "
                          "for other controls call probe_layers(acts, target, controls=..., control_acts=...)")
    options: dict[str, Any] = dict(sites=[site], layers=layers, positions=positions, batch_size=batch_size,
                                   progress=progress)
    acts = collect(model, prompts, **options)
    control = collect(random_like(model, seed), prompts, **options)
    return probe_layers(acts, target, site=site, controls=("shuffled", "random-init"), control_acts=control,
                        seed=seed, progress=progress, **kwargs)
