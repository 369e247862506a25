"""Probe sweeps over layers and positions: k-fold held-out scores with controls.

Targets (:func:`resolve_target`: a prompt label, the model's own answer, or an array), the
cross-validation folds (grouped by operand pair whenever a pair repeats, so that no pair is on
both sides of a fold), :func:`confidence_interval`, and :func:`probe_layers`, which probes every
layer x position with 95% CIs (clipped to the metric's range), directions fitted on all data, and
controls (shuffled labels; a random-init model's activations) → :class:`ProbeResult`, whose
:meth:`~ProbeResult.finding` calls something readable only when it beats chance and every
control. :func:`probe_model` collects the model's and a random-init copy's activations and
probes both (readable vs computed).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError, SiteError, TaskError, accepted
from arithinterp.intervals import clip_interval, t_interval
from arithinterp.probes.estimators import PROBE_KINDS, CircularProbe, MLPProbe, RidgeProbe, make_probe
from arithinterp.probes.logistic import LogisticProbe
from arithinterp.probes.probe_base import as_targets, clone_estimator, to_tensor
from arithinterp.results import NON_NEGATIVE, PROBABILITY, Result, build_meta
from arithinterp.tasks import UNPARSABLE as _UNPARSABLE  # a generated answer that is not a number
from arithinterp.types import checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet
    from arithinterp.types import HookedModel

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
    values = to_tensor(values, "model_answer").long()
    if values.shape != (n,):
        raise AnalysisError(f"model_answer must have one answer per prompt ({n}), got shape {tuple(values.shape)}")
    return values


@checked
def resolve_target(
    prompts: Optional[PromptSet], target: Any, n: int, model_answer: Any = None
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Labels for ``target``: ``(y [n_kept], keep BoolTensor [n], name)``.

    ``target`` is a label name of ``prompts.label`` (``"a"``, ``"answer_digit_0"``,
    ``"carry_1"``, ...), ``"model_answer"``, ``"model_correct"``, ``"model_answer_digit_{i}"``
    (needs ``model_answer``: the model, which evaluates ``prompts``, an ``Evaluation`` or a
    tensor ``[n]``), or an array of ``n`` values.
    Prompts whose generated answer is not a number are left out of model-answer targets (``keep``).
    """
    keep = torch.ones(n, dtype=torch.bool)
    if not isinstance(target, str):
        y = to_tensor(target, "target")
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
        raise AnalysisError(
            f"{error}; or a model target {accepted(_MODEL_TARGETS)}; or an array of {n} values") from error


# --- cross-validation -----------------------------------------------------------------------------


@checked
def resolve_groups(prompts: Optional[PromptSet], groups: Any, n: int) -> tuple[Optional[np.ndarray], Optional[str]]:
    """Cross-validation groups ``[n]`` (or ``None``: no grouping) and their name.

    ``groups`` is ``"auto"`` (group by operand pair when some ``(a, b)`` occurs more than once,
    e.g. prompt sets with several few-shot prefixes pooled; else none), ``"pair"``, a label name
    of ``prompts.label`` (``"a"`` holds out whole a values), an array of ``n`` group ids, or
    ``None`` (plain folds).
    """
    if groups is None:
        return None, None
    if isinstance(groups, str):
        if prompts is None:
            if groups == "auto":
                return None, None
            raise AnalysisError(
                f"groups={groups!r} needs activations that carry their prompts; pass an array of {n} group ids")
        if groups in ("auto", "pair"):
            pairs = torch.stack([prompts.a, prompts.b], 1)
            ids = torch.unique(pairs, dim=0, return_inverse=True)[1].numpy()
            if groups == "auto" and len(np.unique(ids)) == n:
                return None, None
            return ids, "pair"
        try:
            return prompts.label(groups).numpy(), groups
        except ArithInterpError as error:
            raise AnalysisError(f"groups: {error}; or 'auto', 'pair', None, or an array of {n} group ids") from error
    ids = np.asarray(to_tensor(groups, "groups"))
    if ids.ndim != 1 or len(ids) != n:
        raise AnalysisError(f"groups must have one group per prompt ({n}), got shape {ids.shape}")
    return ids, "custom"


def _folds(y: torch.Tensor, cv: int, stratify: bool, random_state: int,
           groups: Optional[np.ndarray] = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """``cv`` shuffled (train, test) index splits; every member of a group in the same fold."""
    from sklearn.model_selection import GroupKFold, KFold, StratifiedGroupKFold, StratifiedKFold

    if not isinstance(cv, (int, np.integer)) or cv < 2:
        raise ConfigError(f"cv must be an integer number of folds >= 2, got {cv!r}")
    n = len(y)
    if n < 2 * cv:
        raise AnalysisError(f"too few samples for {cv}-fold cross-validation: {n}; need at least {2 * cv}")
    labels = y.numpy()
    stratify = stratify and np.unique(labels, return_counts=True)[1].min() >= cv
    if groups is None:
        splitter = (StratifiedKFold if stratify else KFold)(cv, shuffle=True, random_state=random_state)
        return list(splitter.split(np.zeros(n), labels))
    n_groups = len(np.unique(groups))
    if n_groups < cv:
        raise AnalysisError(f"{cv}-fold cross-validation grouped by these groups needs at least {cv} groups, "
                            f"got {n_groups} groups; lower cv or choose other groups")
    splitter = (StratifiedGroupKFold if stratify else GroupKFold)(cv, shuffle=True, random_state=random_state)
    return list(splitter.split(np.zeros(n), labels, groups))


def _fold_scheme(
    cv: int, stratified: bool, groups: Optional[np.ndarray], group_name: Optional[str], asked: Any
) -> dict:
    """How the folds were made, in words (``text``) and numbers, for the result's meta."""
    info: dict[str, Any] = dict(cv=cv, stratified=stratified, groups=group_name)
    if groups is None:
        why = " (no pair repeats)" if asked == "auto" and group_name is None else ""
        info["text"] = f"{cv}-fold{', stratified by label' if stratified else ''}, ungrouped{why}"
        return info
    counts = np.unique(groups, return_counts=True)[1]
    info.update(n_groups=len(counts), largest_group=int(counts.max()))
    what = ("(a, b) pair" if group_name == "pair"
            else "the given groups" if group_name == "custom" else f"label {group_name!r}")
    info["text"] = (f"{cv}-fold grouped by {what} ({len(counts)} groups, up to {int(counts.max())} prompts each)"
                    f"{', stratified by label' if stratified else ''}")
    return info


def _is_classifier(estimator: Any) -> bool:
    """Whether ``estimator`` predicts discrete labels (scored by accuracy) rather than values (R²)."""
    from sklearn.base import is_classifier

    if isinstance(estimator, (LogisticProbe, CircularProbe, MLPProbe)):
        return True
    if isinstance(estimator, RidgeProbe):
        return False
    return is_classifier(estimator)


def _as_input(estimator: Any, X: torch.Tensor) -> Any:
    """Our probes take tensors; other scikit-learn estimators get numpy arrays."""
    ours = (LogisticProbe, RidgeProbe, MLPProbe)
    return X if isinstance(estimator, ours) else X.numpy()


def _directions(probe: Any) -> Optional[torch.Tensor]:
    """Unit read-out rows ``[k, d]`` of a fitted linear probe (``directions_`` or ``coef_``), else None."""
    if hasattr(probe, "directions_"):
        return probe.directions_
    coef = getattr(probe, "coef_", None)
    if coef is None:
        return None
    coef = torch.as_tensor(np.asarray(coef), dtype=torch.float32).reshape(-1, probe.n_features_in_)
    return coef / coef.norm(dim=1, keepdim=True).clamp_min(1e-12)


def _probe_cell(estimator: Any, X: torch.Tensor, label_sets: list, folds, full: bool):
    """Held-out scores ``[len(label_sets), n_folds]`` for each label set on the same folds (each
    fit on a fresh ``clone`` of ``estimator``), and (when ``full``) the probe fitted on every
    sample of the first label set."""
    if type(estimator) is LogisticProbe:  # every fold of every label set (and the full fit) in one L-BFGS run
        masks = torch.zeros(len(folds), len(X), dtype=torch.bool)
        for f, (train, _) in enumerate(folds):
            masks[f, train] = True
        targets = torch.cat([y.expand(len(folds), -1) for y in label_sets] + ([label_sets[0][None]] if full else []))
        masks = torch.cat([masks] * len(label_sets) + ([torch.ones(1, len(X), dtype=torch.bool)] if full else []))
        fitted = clone_estimator(estimator).fit_many(X, targets, masks)
        scores = [[fitted[s * len(folds) + f].score(X[test], y[test]) for f, (_, test) in enumerate(folds)]
                  for s, y in enumerate(label_sets)]
        return torch.tensor(scores), (fitted[-1] if full else None)
    X_in = _as_input(estimator, X)
    Y_in = [_as_input(estimator, y) for y in label_sets]
    scores = [[float(clone_estimator(estimator).fit(X_in[train], y[train]).score(X_in[test], y[test]))
               for train, test in folds]
              for y in Y_in]
    full_fit = full and not isinstance(estimator, MLPProbe)  # a non-linear probe has no directions to keep
    return torch.tensor(scores), (clone_estimator(estimator).fit(X_in, Y_in[0]) if full_fit else None)


@checked
def confidence_interval(scores: torch.Tensor, level: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Student-t interval of the mean over the last axis (folds): ``(low, high)``, unclipped
    (:attr:`ProbeResult.ci` clips it to the metric's range)."""
    return t_interval(scores, level)


# --- sweeps ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult(Result):
    """Held-out probe scores over layers × positions, with controls and fitted directions.

    ``fold_scores`` [L, P, folds] (accuracy, or R² for ridge), ``control_scores``
    [C, L, P, folds] for each name in ``controls`` (same folds), ``directions`` [L, P, k, d] of
    probes fitted on all prompts (``None`` for MLP probes), ``classes`` the label of each
    direction row. ``chance`` is the majority-class accuracy (0 for R²). ``fold_scheme`` says
    how the folds were made (``meta["folds"]`` has the numbers): grouped by operand pair when a
    pair repeats, so a probe cannot score by recognising a pair it was trained on.
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
    fold_scheme: str = ""

    # what load checks: the axes fields share and the values they may take
    _shapes = {"fold_scores": "layer position fold", "control_scores": "control layer position fold",
               "directions": "layer position ...", "layers": "layer", "positions": "position", "controls": "control"}
    _legal = {"kind": PROBE_KINDS, "controls": CONTROLS, "layers": NON_NEGATIVE, "chance": PROBABILITY}

    @property
    def mean(self) -> torch.Tensor:
        """Mean held-out score [L, P]."""
        return self.fold_scores.mean(-1)

    @property
    def ci(self) -> tuple[torch.Tensor, torch.Tensor]:
        """95% CI of the mean score across folds, ``(low, high)`` each [L, P], kept inside the
        metric's range (an accuracy interval never leaves [0, 1], an R² one never passes 1)."""
        return clip_interval(*confidence_interval(self.fold_scores), self.metric)

    @property
    def control_mean(self) -> torch.Tensor:
        """[C, L, P]."""
        return self.control_scores.mean(-1)

    @property
    def control_ci(self) -> tuple[torch.Tensor, torch.Tensor]:
        """95% CI of each control's mean score, ``(low, high)`` each [C, L, P], clipped like :attr:`ci`."""
        return clip_interval(*confidence_interval(self.control_scores), self.metric)

    def beats_controls(self) -> torch.Tensor:
        """[L, P] bool: the probe's CI lies above chance and above every control's CI (a
        finding; with the ``"random_init"`` control, one the training put there)."""
        low, _ = self.ci
        beats = low > self.chance
        if self.controls:
            beats &= (low[None] > self.control_ci[1]).all(0)
        return beats

    def finding(self) -> dict:
        """The probe's finding in words and numbers, with its controls.

        The cell reported is the one with the largest margin of the probe's lower CI bound over
        chance and every control's upper bound (the best-scoring cell when none beats them).
        ``verdict`` is ``"finding"`` (above chance, the shuffled labels and a random-init model
        of the same architecture on the same prompts: readable *because of training*),
        ``"no random-init control"`` (above chance and the controls that were run, but a
        random-init model may read it too: the input may already show it) or ``"no signal"``.
        ``text`` quotes the score, its interval, chance and each control's score and interval.
        """
        low, high = self.ci
        c_low, c_high = self.control_ci
        floor = torch.full_like(low, self.chance)
        if self.controls:
            floor = torch.maximum(floor, c_high.max(0).values)
        beats = self.beats_controls()
        margin = torch.where(beats, low - floor, torch.full_like(low, -math.inf))
        flat = int(margin.flatten().argmax()) if bool(beats.any()) else int(self.mean.flatten().argmax())
        li, pi = divmod(flat, self.mean.shape[1])
        name = "held-out accuracy" if self.metric == "accuracy" else "held-out R²"
        quoted = (f"{name} {float(self.mean[li, pi]):.2f} (95% CI {float(low[li, pi]):.2f} to "
                  f"{float(high[li, pi]):.2f}) at layer {self.layers[li]}, position '{self.positions[pi]}'")
        context = [f"chance {self.chance:.2f}" if self.metric == "accuracy" else "chance 0"]
        labels = {"shuffled": "shuffled labels", "random_init": "a random-init model of the same architecture"}
        out: dict[str, Any] = dict(layer=self.layers[li], position=self.positions[pi], score=float(self.mean[li, pi]),
                                   ci_low=float(low[li, pi]), ci_high=float(high[li, pi]), chance=self.chance,
                                   metric=self.metric)
        for c, control in enumerate(self.controls):
            score = float(self.control_mean[c, li, pi])
            context.append(f"{labels.get(control, control)} {score:.2f} (95% CI {float(c_low[c, li, pi]):.2f} to "
                           f"{float(c_high[c, li, pi]):.2f})")
            out[f"{control}_score"] = score
            out[f"{control}_ci_high"] = float(c_high[c, li, pi])
        if not bool(beats[li, pi]):
            verdict = "no signal"
            text = f"'{self.target}': no signal above chance and the controls ({quoted}; {'; '.join(context)})."
        elif "random_init" not in self.controls:
            verdict = "no random-init control"
            text = (f"'{self.target}' is readable above chance and the controls that were run, but with no random-init "
                    f"control it may be in the input rather than computed: {quoted}; {'; '.join(context)}.")
        else:
            verdict = "finding"
            text = (f"'{self.target}' is readable, above chance and a random-init model (so the training put it "
                    f"there): {quoted}; {'; '.join(context)}.")
        return dict(out, verdict=verdict, text=text)

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
        """The layer and position with the highest mean held-out score, with its CI (clipped), chance,
        the controls, selectivity and whether it beats them (:meth:`beats_controls`; the sentence
        a reader should see is :meth:`finding`)."""
        mean = self.mean
        flat = int(mean.flatten().argmax())
        li, pi = divmod(flat, mean.shape[1])
        low, high = self.ci
        out = dict(layer=self.layers[li], position=self.positions[pi], score=float(mean[li, pi]),
                   ci_low=float(low[li, pi]), ci_high=float(high[li, pi]), metric=self.metric, chance=self.chance,
                   beats_controls=bool(self.beats_controls()[li, pi]))
        for c, name in enumerate(self.controls):
            out[f"{name}_score"] = float(self.control_mean[c, li, pi])
            out[f"selectivity_{name}"] = float(self.selectivity[c, li, pi])
        return out

    def to_frame(self):
        """One row per layer × position × probe (``"probe"`` or a control); intervals clipped to the
        metric's range; ``beats_controls`` on probe rows (see :meth:`beats_controls`)."""
        import pandas as pd

        rows = []
        sources = [("probe", self.fold_scores)] + [(c, self.control_scores[i]) for i, c in enumerate(self.controls)]
        beats = self.beats_controls()
        for source, scores in sources:
            mean, (low, high) = scores.mean(-1), clip_interval(*confidence_interval(scores), self.metric)
            for li, layer in enumerate(self.layers):
                for pi, position in enumerate(self.positions):
                    row = dict(site=self.site, target=self.target, kind=self.kind, source=source, layer=layer,
                               position=position, metric=self.metric, score=float(mean[li, pi]),
                               ci_low=float(low[li, pi]), ci_high=float(high[li, pi]),
                               n_folds=scores.shape[-1], folds=self.fold_scheme, chance=self.chance)
                    if source == "probe":
                        for c, name in enumerate(self.controls):
                            row[f"selectivity_{name}"] = float(self.selectivity[c, li, pi])
                        row["beats_controls"] = bool(beats[li, pi])
                    rows.append(row)
        return pd.DataFrame(rows)

    def plot(self, position: Optional[str] = None, **kwargs):
        """Score over layers with 95% CI bands, the controls and chance (see ``viz.probes``)."""
        from arithinterp.viz.probes import plot_probe_layers

        return plot_probe_layers(self, position=position, **kwargs)


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
    return [available[keys.index(str(v))] for v in values]


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
    random_state: int = 0,
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
        controls: ``"shuffled"`` (the same probe on permuted labels) and/or ``"random_init"``
            (the same probe on ``control_acts``, the activations of a random-init copy of the model
            on the same prompts — ``arithinterp.models.random_like``); giving ``control_acts``
            adds ``"random_init"``.
        cv: folds (stratified by label for classifiers when every class has ``cv`` members).

    Returns a :class:`ProbeResult`: per-fold held-out scores, their 95% CI, control scores,
    selectivity = probe − control, and the probe directions fitted on all prompts.
    """
    _check_acts(acts)
    estimator, kind = _resolve_estimator(kind, estimator, probe_kw, random_state)
    site = _pick_site(acts, site)
    layers = _pick(layers, list(acts.layers), "layers")
    positions = _pick(positions, list(acts.positions), "positions")
    controls = list(dict.fromkeys(list(controls) + (["random_init"] if control_acts is not None else [])))
    for name in controls:
        if name not in CONTROLS:
            raise ConfigError(f"unknown control {name!r}; accepted: {accepted(CONTROLS)}")
    if "random_init" in controls:
        if control_acts is None:
            raise AnalysisError(
                "control 'random_init' needs control_acts: collect(random_like(model, seed), prompts, ...)")
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
    classifier = _is_classifier(estimator)
    y = as_targets(y, len(y), integer=classifier)
    if classifier and len(torch.unique(y)) < 2:
        raise AnalysisError(f"target {target_name!r} has a single class {torch.unique(y).tolist()}; nothing to probe")
    folds = _folds(y, cv, classifier, random_state, group_ids)
    stratified = classifier and bool(torch.unique(y, return_counts=True)[1].min() >= cv)
    scheme = _fold_scheme(cv, stratified, group_ids, group_name, groups)
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
            scores, probe = _probe_cell(estimator, X, label_sets, folds, full=True)
            fold_scores[li, pi] = scores[0]
            if "shuffled" in controls:
                control_scores[controls.index("shuffled"), li, pi] = scores[1]
            if "random_init" in controls:
                X_control = features(control_acts, layers[li], positions[pi])
                control_scores[controls.index("random_init"), li, pi] = _probe_cell(
                    estimator, X_control, [y], folds, full=False)[0][0]
            if probe is not None and (read_out := _directions(probe)) is not None:
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
        target=target_name, n_prompts=n, n_used=int(keep.sum()), cv=cv, random_state=random_state,
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
    random-init model reads it too). ``kwargs`` go to :func:`probe_layers` (``kind``, ``cv``,
    ``groups``, ``model_answer``, ...).
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
    return probe_layers(acts, target, site=site, controls=("shuffled", "random_init"), control_acts=control,
                        random_state=seed, progress=progress, **kwargs)
