"""Linear probes, probe sweeps over layers and positions, and a probe-based error detector.

What is linearly readable where — operands, answer digits, carries, the model's *own* answer —
and can a probe tell, before an answer digit is emitted, that the model is about to get it wrong?
The probes, the circular digit probe, the output-digit / true-digit disagreement detector and the
"re-ask only what is flagged" use follow Sun, Stolfo & Sachan 2025 (RECIPES §5); the held-out,
control-backed probing practice follows RECIPES §1, §4 and §8.

* Probes (scikit-learn estimators: ``fit(X, y)``, ``predict``, ``score``, ``get_params``; ``X`` is
  a torch tensor or numpy array ``[n_samples, n_features]``; features are standardised inside):
  :class:`LogisticProbe`, :class:`RidgeProbe`, :class:`CircularProbe`, :class:`MLPProbe`, and
  :func:`make_probe`. Fitted linear probes expose ``directions_`` ``[k, n_features]`` (unit rows
  in the raw activation space) for patching and steering.
* :func:`sweep` — k-fold held-out score per layer x position with 95% CIs, directions fitted on all
  data, and controls (shuffled labels; a random-init model's activations) → :class:`ProbeResult`.
* :func:`answer_activations` — activations at the position before each answer token, with the
  model's own answer teacher-forced.
* :class:`ErrorDetector` — flags prompts the model will answer wrongly → :class:`DetectorResult`;
  :func:`repair` re-asks only flagged prompts → :class:`RepairResult`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.base import BaseEstimator
from tqdm.auto import tqdm

from arithinterp import sites as site_lib
from arithinterp.errors import AnalysisError, ConfigError, SiteError, TaskError, accepted
from arithinterp.results import Result, build_meta
from arithinterp.tasks import UNPARSABLE as _UNPARSABLE  # a generated answer that is not a number

KINDS = ("logistic", "ridge", "circular", "mlp")
CONTROLS = ("shuffled", "random_init")
DETECTOR_METHODS = ("disagreement", "direct")
DETECTOR_POSITIONS = ("final", "final_only")
_MODEL_TARGETS = ("model_answer", "model_correct", "model_answer_digit_{i}")

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]


# --- input validation -----------------------------------------------------------------------------


def _tensor(values: Any, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu()
    try:
        return torch.as_tensor(np.asarray(values))
    except (TypeError, ValueError) as error:
        raise AnalysisError(f"{name} must be a torch tensor or numpy array, got {type(values).__name__}") from error


def _features(X: ArrayLike, n_features: Optional[int] = None) -> torch.Tensor:
    """``X`` as a finite float32 tensor ``[n_samples, n_features]``."""
    X = _tensor(X, "X")
    if X.ndim != 2:
        raise AnalysisError(
            f"X must be 2-d [n_samples, n_features], got shape {tuple(X.shape)}; "
            "flatten per-head or per-position activations first (X.flatten(1))"
        )
    if X.shape[0] == 0 or X.shape[1] == 0:
        raise AnalysisError(f"X is empty (shape {tuple(X.shape)}); probes need samples and features")
    if n_features is not None and X.shape[1] != n_features:
        raise AnalysisError(f"X has {X.shape[1]} features but the probe was fitted on {n_features}")
    if X.dtype.is_complex:
        raise AnalysisError(f"X must be real-valued, got dtype {X.dtype}")
    X = X.float()
    if not torch.isfinite(X).all():
        raise AnalysisError("X contains NaN or infinite values; probes need finite activations")
    return X


def _targets(y: ArrayLike, n: int, *, integer: bool, allow_2d: bool = False) -> torch.Tensor:
    """``y`` as a tensor of ``n`` labels (long when ``integer``; else float, ``[n]`` or ``[n, t]``)."""
    y = _tensor(y, "y")
    if y.ndim == 0 or y.shape[0] != n:
        raise AnalysisError(f"y must have one label per sample ({n}), got shape {tuple(y.shape)}")
    if y.ndim > (2 if allow_2d else 1):
        raise AnalysisError(f"y must be 1-d [n_samples]{' or 2-d' if allow_2d else ''}, got shape {tuple(y.shape)}")
    if not integer:
        y = y.double()
        if not torch.isfinite(y).all():
            raise AnalysisError("y contains NaN or infinite values")
        return y
    if y.is_floating_point():
        if not torch.isfinite(y).all() or (y != y.round()).any():
            raise AnalysisError("class labels must be integers; use kind='ridge' to regress real values")
    return y.long()


def _check_fitted(probe: Any) -> None:
    if not hasattr(probe, "mean_"):
        raise AnalysisError(f"this {type(probe).__name__} is not fitted yet; call fit(X, y) first")


def _standardise(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and scale; constant features get scale 1 (they carry no signal)."""
    mean = X.mean(0)
    std = X.std(0, unbiased=False)
    return mean, torch.where(std > 1e-8 * (std.max() + 1e-30), std, torch.ones_like(std))


def _sample_weights(y_index: torch.Tensor, n_classes: int, class_weight: Optional[str]) -> torch.Tensor:
    if class_weight is None:
        return torch.ones(len(y_index))
    if class_weight != "balanced":
        raise ConfigError(f"unknown class_weight {class_weight!r}; accepted: None, 'balanced'")
    counts = torch.bincount(y_index, minlength=n_classes).float()
    return (len(y_index) / (n_classes * counts))[y_index]


def _unit_rows(coef: torch.Tensor) -> torch.Tensor:
    return coef / coef.norm(dim=1, keepdim=True).clamp_min(1e-12)


# --- probes ---------------------------------------------------------------------------------------


class _Probe(BaseEstimator):
    """Shared plumbing: standardisation and the raw-space view of a linear map."""

    def _standardised(self, X: ArrayLike) -> torch.Tensor:
        _check_fitted(self)
        X = _features(X, self.n_features_in_)
        return (X - self.mean_) / self.scale_

    def _fit_scaler(self, X: torch.Tensor) -> torch.Tensor:
        self.mean_, self.scale_ = _standardise(X)
        self.n_features_in_ = X.shape[1]
        return (X - self.mean_) / self.scale_

    def _set_linear(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Store ``weight`` [k, d] / ``bias`` [k] learned on standardised features in raw space."""
        self.coef_ = (weight / self.scale_).float()
        self.intercept_ = (bias - self.coef_ @ self.mean_).float()
        self.directions_ = _unit_rows(self.coef_)


class LogisticProbe(_Probe):
    """Multinomial logistic regression ``d → classes`` (softmax, L2), fitted full batch by L-BFGS.

    Same objective as scikit-learn's ``LogisticRegression(C=C)`` on standardised features, solved
    in torch (seconds for thousands of samples × hundreds of features). ``directions_`` [k, d]:
    one unit row per class (``classes_``), in raw activation space; ``coef_`` / ``intercept_``
    give the raw-space logits ``X @ coef_.T + intercept_``. ``class_weight="balanced"`` reweights
    classes inversely to their frequency (the class-balanced training of RECIPES §5).
    """

    def __init__(self, C: float = 1.0, max_iter: int = 100, tol: float = 1e-5,
                 class_weight: Optional[str] = None, random_state: int = 0):
        self.C = C
        self.max_iter = max_iter
        self.tol = tol
        self.class_weight = class_weight
        self.random_state = random_state

    def fit(self, X: ArrayLike, y: ArrayLike) -> "LogisticProbe":
        X = _features(X)
        y = _targets(y, len(X), integer=True)
        fitted = self.fit_many(X, y[None], torch.ones(1, len(X), dtype=torch.bool))[0]
        self.__dict__.update({k: v for k, v in fitted.__dict__.items() if k.endswith("_")})
        return self

    def fit_many(self, X: ArrayLike, targets: torch.Tensor, masks: torch.Tensor) -> list["LogisticProbe"]:
        """Fit one probe (with these parameters) per row of ``targets`` [B, n] on the samples
        where ``masks`` [B, n] is True, all sharing the features ``X`` [n, d].

        The B problems are independent (each has its own standardisation, classes and weights)
        but are solved as one block-separable L-BFGS run: cross-validation folds and controls
        of a probe sweep cost one optimisation instead of B. Returns B fitted probes.
        """
        X = _features(X)
        if not self.C > 0:
            raise ConfigError(f"C must be positive (inverse L2 strength), got {self.C!r}")
        targets, masks = _tensor(targets, "targets").long(), _tensor(masks, "masks").bool()
        if targets.ndim != 2 or targets.shape != masks.shape or targets.shape[1] != len(X):
            raise AnalysisError(f"targets and masks must both be [B, {len(X)}], got {tuple(targets.shape)} and {tuple(masks.shape)}")
        classes = torch.unique(targets[masks])
        index = torch.searchsorted(classes, targets.clamp(classes[0], classes[-1]))
        present = torch.zeros(len(targets), len(classes), dtype=torch.bool)
        present[torch.nonzero(masks)[:, 0], index[masks]] = True
        counts = present.sum(1)
        if (counts < 2).any():
            bad = int(torch.nonzero(counts < 2)[0, 0])
            raise AnalysisError(f"a classifier needs at least two classes in y; got only {classes[present[bad]].tolist()}")
        rows = masks.float()
        n_rows = rows.sum(1, keepdim=True)
        mean = rows @ X / n_rows  # per-problem standardisation from its own training rows
        var = (rows @ X**2 / n_rows - mean**2).clamp_min(0)
        std = var.sqrt()
        scale = torch.where(std > 1e-8 * (std.amax(1, keepdim=True) + 1e-30), std, torch.ones_like(std))
        weights = rows
        if self.class_weight is not None:
            if self.class_weight != "balanced":
                raise ConfigError(f"unknown class_weight {self.class_weight!r}; accepted: None, 'balanced'")
            per_class = torch.zeros(len(targets), len(classes)).scatter_add_(1, index, rows)
            balance = n_rows / (counts[:, None] * per_class.clamp_min(1))
            weights = rows * balance.gather(1, index)
        absent = torch.where(present, 0.0, -1e9)[:, None, :]  # classes a problem never sees
        with torch.inference_mode(False), torch.enable_grad():  # callers may be in inference mode
            X, index, weights, mean, scale, absent = (t.clone() for t in (X, index, weights, mean, scale, absent))
            total = weights.sum(1)
            weight = torch.zeros(len(targets), len(classes), X.shape[1], requires_grad=True)
            bias = torch.zeros(len(targets), len(classes), requires_grad=True)
            optimizer = torch.optim.LBFGS(
                [weight, bias], lr=1.0, max_iter=int(self.max_iter), tolerance_grad=self.tol,
                tolerance_change=1e-9, history_size=20, line_search_fn="strong_wolfe",
            )

            def closure():
                optimizer.zero_grad()
                raw = weight / scale[:, None, :]  # logits of standardised features, from raw X
                logits = torch.einsum("nd,bkd->bnk", X, raw) + (bias - (raw * mean[:, None, :]).sum(-1))[:, None, :]
                loss = F.cross_entropy((logits + absent).transpose(1, 2), index, reduction="none")
                loss = ((loss * weights).sum(1) / total).sum()
                loss = loss + ((weight**2).sum((1, 2)) / (2.0 * self.C * total)).sum()
                loss.backward()
                return loss

            optimizer.step(closure)
            n_iter = int(optimizer.state[optimizer._params[0]].get("n_iter", 0))
        probes = []
        for b in range(len(targets)):
            probe = type(self)(**self.get_params())
            probe.classes_ = classes[present[b]]
            probe.mean_, probe.scale_, probe.n_features_in_, probe.n_iter_ = mean[b], scale[b], X.shape[1], n_iter
            probe._set_linear(weight[b, present[b]].detach(), bias[b, present[b]].detach())
            probes.append(probe)
        return probes

    def decision_function(self, X: ArrayLike) -> torch.Tensor:
        """Logits ``[n, k]``."""
        _check_fitted(self)
        return _features(X, self.n_features_in_) @ self.coef_.T + self.intercept_

    def predict_proba(self, X: ArrayLike) -> torch.Tensor:
        """Class probabilities ``[n, k]`` in the order of ``classes_``."""
        return self.decision_function(X).softmax(-1)

    def predict(self, X: ArrayLike) -> torch.Tensor:
        return self.classes_[self.decision_function(X).argmax(-1)]

    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """Accuracy."""
        X = _features(X)
        return float((self.predict(X) == _targets(y, len(X), integer=True)).float().mean())


class RidgeProbe(_Probe):
    """Ridge regression ``d → t`` in closed form on standardised features; ``score`` is R².

    ``y`` may be ``[n]`` or ``[n, t]``. ``directions_`` [t, d]: unit rows in raw activation space.
    """

    def __init__(self, alpha: float = 1.0, random_state: int = 0):
        self.alpha = alpha
        self.random_state = random_state

    def _solve(self, Z: torch.Tensor, Y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.alpha >= 0:
            raise ConfigError(f"alpha must be non-negative, got {self.alpha!r}")
        Z = Z.double()
        y_mean = Y.mean(0)
        gram = Z.T @ Z + self.alpha * torch.eye(Z.shape[1], dtype=Z.dtype)
        weight = torch.linalg.lstsq(gram, Z.T @ (Y - y_mean)).solution.T  # [t, d]
        return weight.float(), y_mean.float()

    def fit(self, X: ArrayLike, y: ArrayLike) -> "RidgeProbe":
        X = _features(X)
        y = _targets(y, len(X), integer=False, allow_2d=True)
        if len(X) < 2:
            raise AnalysisError(f"ridge regression needs at least 2 samples, got {len(X)}")
        self.output_ndim_ = y.ndim
        Z = self._fit_scaler(X)
        weight, bias = self._solve(Z, y.reshape(len(y), -1))
        self._set_linear(weight, bias)
        return self

    def predict(self, X: ArrayLike) -> torch.Tensor:
        _check_fitted(self)
        out = _features(X, self.n_features_in_) @ self.coef_.T + self.intercept_
        return out[:, 0] if self.output_ndim_ == 1 else out

    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """R² (averaged uniformly over outputs)."""
        X = _features(X)
        y = _targets(y, len(X), integer=False, allow_2d=True).reshape(len(X), -1)
        pred = self.predict(X).double().reshape(len(X), -1)
        residual = ((y - pred) ** 2).sum(0)
        total = ((y - y.mean(0)) ** 2).sum(0)
        return float((1 - residual / total.clamp_min(1e-12)).mean())


class CircularProbe(RidgeProbe):
    """A 2-d linear map whose angle encodes a value mod ``period`` (RECIPES §5).

    Fits ridge least squares from standardised features to ``(cos 2πy/m, sin 2πy/m)``; predicts
    ``round(angle · m / 2π) mod m``. ``score`` is the accuracy against ``y mod m``.
    ``directions_`` [2, d]: the cos and sin read-out directions.
    """

    def __init__(self, period: int = 10, alpha: float = 1.0, random_state: int = 0):
        self.period = period
        self.alpha = alpha
        self.random_state = random_state

    def _angles(self, y: torch.Tensor) -> torch.Tensor:
        theta = 2 * math.pi * (y.double() % self.period) / self.period
        return torch.stack([theta.cos(), theta.sin()], dim=1)

    def fit(self, X: ArrayLike, y: ArrayLike) -> "CircularProbe":
        if not (isinstance(self.period, (int, np.integer)) and self.period >= 2):
            raise ConfigError(f"period must be an integer >= 2, got {self.period!r}")
        X = _features(X)
        y = _targets(y, len(X), integer=True)
        if len(X) < 2:
            raise AnalysisError(f"a circular probe needs at least 2 samples, got {len(X)}")
        self.output_ndim_ = 2
        Z = self._fit_scaler(X)
        weight, bias = self._solve(Z, self._angles(y))
        self._set_linear(weight, bias)
        return self

    def decision_function(self, X: ArrayLike) -> torch.Tensor:
        """The 2-d projection ``[n, 2]`` (cos, sin)."""
        return super().predict(X)

    def predict_angle(self, X: ArrayLike) -> torch.Tensor:
        """Angle in ``[0, 2π)`` per sample ``[n]``."""
        xy = self.decision_function(X)
        return torch.atan2(xy[:, 1], xy[:, 0]) % (2 * math.pi)

    def predict(self, X: ArrayLike) -> torch.Tensor:
        return torch.round(self.predict_angle(X) * self.period / (2 * math.pi)).long() % self.period

    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """Accuracy of the rounded angle against ``y mod period``."""
        X = _features(X)
        y = _targets(y, len(X), integer=True)
        return float((self.predict(X) == y % self.period).float().mean())


class MLPProbe(_Probe):
    """A non-linear comparison probe ``d → hidden (ReLU) → classes`` trained with Adam.

    Mini-batches of ``batch_size``, ``epochs`` passes, seeded by ``random_state``. No
    ``directions_`` (the map is not linear).
    """

    def __init__(self, hidden: int = 512, epochs: int = 30, lr: float = 1e-3, weight_decay: float = 1e-4,
                 batch_size: int = 256, class_weight: Optional[str] = None, random_state: int = 0):
        self.hidden = hidden
        self.epochs = epochs
        self.lr = lr
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.class_weight = class_weight
        self.random_state = random_state

    def fit(self, X: ArrayLike, y: ArrayLike) -> "MLPProbe":
        X = _features(X)
        y = _targets(y, len(X), integer=True)
        classes, y_index = torch.unique(y, return_inverse=True)
        if len(classes) < 2:
            raise AnalysisError(f"a classifier needs at least two classes in y; got only {classes.tolist()}")
        self.classes_ = classes
        generator = torch.Generator().manual_seed(int(self.random_state))
        with torch.inference_mode(False), torch.enable_grad():  # callers may be in inference mode
            y_index = y_index.clone()
            weights = _sample_weights(y_index, len(classes), self.class_weight)
            Z = self._fit_scaler(X.clone())
            net = torch.nn.Sequential(
                torch.nn.Linear(Z.shape[1], int(self.hidden)), torch.nn.ReLU(), torch.nn.Linear(int(self.hidden), len(classes))
            )
            for layer in (net[0], net[2]):  # seeded init, independent of the global RNG
                bound = 1 / math.sqrt(layer.in_features)
                with torch.no_grad():
                    layer.weight.uniform_(-bound, bound, generator=generator)
                    layer.bias.uniform_(-bound, bound, generator=generator)
            optimizer = torch.optim.Adam(net.parameters(), lr=self.lr, weight_decay=self.weight_decay)
            for _ in range(int(self.epochs)):
                for batch in torch.randperm(len(Z), generator=generator).split(int(self.batch_size)):
                    loss = F.cross_entropy(net(Z[batch]), y_index[batch], reduction="none")
                    loss = (loss * weights[batch]).sum() / weights[batch].sum()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
        self.net_ = net.eval().requires_grad_(False)
        return self

    def predict_proba(self, X: ArrayLike) -> torch.Tensor:
        """Class probabilities ``[n, k]`` in the order of ``classes_``."""
        with torch.no_grad():
            return self.net_(self._standardised(X)).softmax(-1)

    def predict(self, X: ArrayLike) -> torch.Tensor:
        return self.classes_[self.predict_proba(X).argmax(-1)]

    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """Accuracy."""
        X = _features(X)
        return float((self.predict(X) == _targets(y, len(X), integer=True)).float().mean())


_PROBES = {"logistic": LogisticProbe, "ridge": RidgeProbe, "circular": CircularProbe, "mlp": MLPProbe}


def make_probe(kind: str, **kwargs: Any) -> _Probe:
    """A probe of ``kind`` (``"logistic"``, ``"ridge"``, ``"circular"``, ``"mlp"``) with ``kwargs``."""
    if kind not in _PROBES:
        raise ConfigError(f"unknown probe kind {kind!r}; accepted: {accepted(KINDS)}")
    cls = _PROBES[kind]
    allowed = cls._get_param_names()
    unknown = [k for k in kwargs if k not in allowed]
    if unknown:
        raise ConfigError(f"{kind} probe has no option(s) {accepted(unknown)}; accepted: {accepted(allowed)}")
    return cls(**kwargs)


def is_classifier_kind(kind: str) -> bool:
    """Whether ``kind`` predicts discrete labels (scored by accuracy) rather than values (R²)."""
    return kind != "ridge"


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


# --- activations before each answer token ---------------------------------------------------------


def _check_evaluation(prompts: Any, evaluation: Any) -> None:
    n, k = prompts.answer_tokens.shape
    generated = getattr(evaluation, "generated_tokens", None)
    if generated is None or tuple(generated.shape) != (n, k) or tuple(evaluation.correct.shape) != (n,):
        raise AnalysisError(
            f"evaluation must be prompts.evaluate(model) for these {n} prompts "
            f"(generated_tokens [{n}, {k}], correct [{n}])"
        )
    if (generated < 0).any():
        raise AnalysisError("evaluation.generated_tokens holds negative token ids; pass prompts.evaluate(model)")


def _slot_offsets(prompts: Any, position: str) -> torch.Tensor:
    """Offset from the final prompt token of the position read for each answer slot [S]."""
    if position not in DETECTOR_POSITIONS:
        raise ConfigError(f"unknown position {position!r}; accepted: {accepted(DETECTOR_POSITIONS)}")
    k = prompts.answer_tokens.shape[1]
    if k == 1:  # a single answer token: every digit of it is read where it is predicted
        return torch.zeros(_n_digits(prompts), dtype=torch.long)
    return torch.arange(k) if position == "final" else torch.zeros(k, dtype=torch.long)


def _n_digits(prompts: Any) -> int:
    return len(str(int(prompts.answer.abs().max()))) if len(prompts) else 1


def answer_activations(
    model: Any,
    prompts: Any,
    evaluation: Any = None,
    site: str = "resid_post",
    layers: Optional[Sequence[int]] = None,
    batch_size: int = 256,
    progress: bool = False,
):
    """Activations at the position before each answer token, the model's own answer fed back.

    Position ``"answer_j"`` is the final prompt token + j with the model's first j generated
    answer tokens appended (teacher forcing its *own* answer, so the activation is the one it
    had when it emitted token j). Returns an ``Activations`` (via ``collect``) with
    ``data[site]`` ``[N, n_layers, K, *site_shape]`` whose ``prompts`` are ``prompts``;
    ``evaluation`` defaults to ``prompts.evaluate(model)``.
    """
    from arithinterp.activations import collect

    evaluation = evaluation if evaluation is not None else prompts.evaluate(model, batch_size=batch_size)
    _check_evaluation(prompts, evaluation)
    k = prompts.answer_tokens.shape[1]
    names = [f"answer_{j}" for j in range(k)]
    # prompts are left-padded, so appending the generated tokens on the right keeps them aligned
    forced = replace(
        prompts,
        tokens=torch.cat([prompts.tokens, evaluation.generated_tokens[:, : k - 1]], dim=1),
        lengths=prompts.lengths + (k - 1),
        positions={**prompts.positions, **{name: prompts.positions["final"] + j for j, name in enumerate(names)}},
    )
    acts = collect(model, forced, sites=[site], layers=layers, positions=names, batch_size=batch_size, progress=progress)
    acts.prompts = prompts
    acts.meta.update(teacher_forced="the model's own generated answer tokens")
    return acts


# --- answer slots: what each answer digit should be and what the model wrote ---------------------


def _token_values(tokenizer: Any, ids: torch.Tensor) -> torch.Tensor:
    """The number each token id spells (``"7"`` → 7); other tokens map to ``-(id + 2)``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    values = []
    for token in unique.tolist():
        text = tokenizer.decode([token]).strip() if token >= 0 else ""
        values.append(int(text) if text.isdigit() else -(token + 2))
    return torch.tensor(values, dtype=torch.long)[inverse]


def _slot_valid(prompts: Any, n_slots: int) -> torch.Tensor:
    """Which answer slots exist per prompt [N, S] (answer tokens past a short answer do not)."""
    if prompts.answer_tokens.shape[1] == 1:
        return torch.ones(len(prompts), n_slots, dtype=torch.bool)
    return torch.arange(n_slots)[None, :] < prompts.n_answer_tokens[:, None]


def answer_slots(prompts: Any, evaluation: Any) -> dict[str, torch.Tensor]:
    """Per answer slot: the true value, the model's value, and whether the slot exists.

    Single-token answers: one slot per decimal digit of the answer (units first), read from
    the answer value. Multi-token answers: one slot per answer token, valued as the number the
    token spells (one digit for digit tokenizers). Returns ``true``, ``output`` [N, S] (long),
    ``valid`` [N, S] (bool) and ``correct`` [N].
    """
    _check_evaluation(prompts, evaluation)
    n, k = prompts.answer_tokens.shape
    if k == 1:
        powers = 10 ** torch.arange(_n_digits(prompts))
        true = (prompts.answer.abs()[:, None] // powers) % 10
        answer = evaluation.model_answer
        output = torch.where((answer != _UNPARSABLE)[:, None], (answer.abs()[:, None] // powers) % 10, -1)
        valid = torch.ones_like(true, dtype=torch.bool)
    else:
        valid = _slot_valid(prompts, k)
        true = torch.where(valid, _token_values(prompts.tokenizer, prompts.answer_tokens.clamp_min(0)), -1)
        output = torch.where(valid, _token_values(prompts.tokenizer, evaluation.generated_tokens), -1)
    return dict(true=true.long(), output=output.long(), valid=valid, correct=evaluation.correct.bool())


# --- error detection (pure tensor part) -----------------------------------------------------------


def detection_metrics(correct: torch.Tensor, predicted_correct: torch.Tensor, score: torch.Tensor) -> dict:
    """Accuracy, balanced accuracy, AUROC, precision / recall / F1 with *correct* as the positive
    class, the error rate and the trivial always-correct baseline accuracy."""
    from sklearn import metrics as skm

    truth, pred = correct.bool().numpy(), predicted_correct.bool().numpy()
    both = len(np.unique(truth)) == 2
    return dict(
        accuracy=float((truth == pred).mean()),
        balanced_accuracy=float(skm.balanced_accuracy_score(truth, pred)) if both else float("nan"),
        auroc=float(skm.roc_auc_score(truth, score.double().numpy())) if both else float("nan"),
        precision=float(skm.precision_score(truth, pred, zero_division=0)),
        recall=float(skm.recall_score(truth, pred, zero_division=0)),
        f1=float(skm.f1_score(truth, pred, zero_division=0)),
        error_rate=float(1 - truth.mean()),
        baseline_accuracy=float(truth.mean()),
        flagged_fraction=float(1 - pred.mean()),
        n=int(len(truth)),
        n_errors=int((~truth).sum()),
    )


def best_threshold(correct: torch.Tensor, score: torch.Tensor) -> float:
    """The score threshold (predict correct when ``score >= threshold``) with the highest accuracy."""
    order = score.argsort()
    s, c = score[order].double(), correct[order].double()
    zero = torch.zeros(1, dtype=torch.float64)
    wrong_below = torch.cat([zero, (1 - c).cumsum(0)])  # flagged and wrong, splitting before i
    correct_above = c.sum() - torch.cat([zero, c.cumsum(0)])
    accuracy = wrong_below + correct_above
    splittable = torch.ones(len(s) + 1, dtype=torch.bool)
    splittable[1:-1] = s[1:] > s[:-1]  # tied scores cannot be separated
    i = int(torch.where(splittable, accuracy, -1.0).argmax())
    if i == 0:
        return float("-inf")
    return float("inf") if i == len(s) else float((s[i - 1] + s[i]) / 2)


class _Constant:
    """A slot whose training labels have a single value: predicts it with certainty."""

    def __init__(self, value: int):
        self.classes_ = torch.tensor([value])

    def predict(self, X):
        return self.classes_.expand(len(X))

    def predict_proba(self, X):
        return torch.ones(len(X), 1)


def _class_probs(probe: Any, X: torch.Tensor, period: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [n, k], classes [k])`` for a slot probe (a circular probe gives a soft one-hot)."""
    if isinstance(probe, CircularProbe):
        classes = torch.arange(probe.period)
        gap = probe.predict_angle(X)[:, None] - 2 * math.pi * classes[None] / probe.period
        return (probe.period * gap.cos()).softmax(-1), classes
    return probe.predict_proba(X), probe.classes_


def _agreement(true_probe: Any, output_probe: Any, X: torch.Tensor) -> torch.Tensor:
    """Probability that the true-digit and output-digit probes name the same value [n]."""
    p_true, c_true = _class_probs(true_probe, X)
    p_out, c_out = _class_probs(output_probe, X)
    match = (c_true[:, None] == c_out[None, :]).float()  # [k_true, k_out]
    return ((p_true @ match) * p_out).sum(-1)


class ErrorDetector:
    """Flags prompts the model will answer wrongly, from its activations (RECIPES §5).

    Two methods, both fitted: ``"disagreement"`` — per answer slot, a probe for the model's
    output digit and one for the true digit; any slot where they disagree flags the prompt
    (score: probability that every slot's probes agree); ``"direct"`` — a binary probe on the
    slots' activations, concatenated, for correct vs wrong (class-balanced). With ``layer=None``
    and/or ``method="auto"`` the layer and method with the best validation balanced accuracy are
    chosen on a held-out ``val_frac`` of the fit prompts, then refitted on all of them.

    ``position="final"`` reads slot j at the final prompt token + j with the model's own answer
    fed back (the position before answer token j); ``"final_only"`` reads every slot at the final
    prompt token, flagging before anything is emitted. Single-token answers are read at the final
    token, one slot per decimal digit. ``kind`` is the slot-probe kind (``"logistic"``,
    ``"mlp"``, ``"circular"``); the direct probe is an MLP for ``"mlp"`` and logistic otherwise.
    ``threshold`` is the direct probe's P(correct) cut-off, or ``"auto"``: each method's score
    threshold with the best validation accuracy (``thresholds_``).
    """

    def __init__(self, layer: Optional[int] = None, position: str = "final", kind: str = "logistic",
                 method: str = "auto", site: str = "resid_post", val_frac: float = 0.3,
                 threshold: Union[float, str] = 0.5,
                 random_state: int = 0, batch_size: int = 256, progress: bool = False, **probe_kw: Any):
        if kind not in ("logistic", "mlp", "circular"):
            raise ConfigError(f"ErrorDetector kind must be a classifier probe; accepted: {accepted(('logistic', 'mlp', 'circular'))}")
        if method not in DETECTOR_METHODS + ("auto",):
            raise ConfigError(f"unknown method {method!r}; accepted: {accepted(DETECTOR_METHODS + ('auto',))}")
        if position not in DETECTOR_POSITIONS:
            raise ConfigError(f"unknown position {position!r}; accepted: {accepted(DETECTOR_POSITIONS)}")
        if not 0 < val_frac < 1:
            raise ConfigError(f"val_frac must be in (0, 1), got {val_frac!r}")
        if threshold != "auto" and not (isinstance(threshold, (int, float)) and 0 <= threshold <= 1):
            raise ConfigError(f"threshold must be a probability in [0, 1] or 'auto', got {threshold!r}")
        make_probe(kind, **probe_kw)
        site_lib.check_site(site)
        self.layer, self.position, self.kind, self.method, self.site = layer, position, kind, method, site
        self.val_frac, self.threshold, self.random_state = val_frac, threshold, random_state
        self.batch_size, self.progress, self.probe_kw = batch_size, progress, probe_kw

    # -- model-facing ----------------------------------------------------------------------------

    def _read(self, model: Any, prompts: Any, evaluation: Any, layers) -> tuple[torch.Tensor, Any]:
        """Slot activations ``[N, L, S, d]`` and the evaluation they were read under."""
        evaluation = evaluation if evaluation is not None else prompts.evaluate(model, batch_size=self.batch_size)
        acts = answer_activations(model, prompts, evaluation, self.site, layers, self.batch_size, self.progress)
        offsets = _slot_offsets(prompts, self.position)
        return acts.data[self.site].flatten(3)[:, :, offsets], evaluation

    def fit(self, model: Any, prompts: Any, evaluation: Any = None) -> "ErrorDetector":
        """Evaluate the model on ``prompts`` (or use ``evaluation``), read its activations, fit."""
        layers = None if self.layer is None else [self.layer]
        X, evaluation = self._read(model, prompts, evaluation, layers)
        chosen = site_lib.check_layers(model, self.site, layers)
        self.meta_ = build_meta(model, site=self.site, position=self.position, n_fit_prompts=len(prompts))
        return self.fit_activations(X, answer_slots(prompts, evaluation), layers=chosen)

    def evaluate(self, model: Any, prompts: Any, evaluation: Any = None) -> "DetectorResult":
        """Detection metrics on (held-out) ``prompts`` for both methods → :class:`DetectorResult`."""
        self._check_fitted()
        X, evaluation = self._read(model, prompts, evaluation, [self.layer_])
        result = self.evaluate_activations(X[:, 0], answer_slots(prompts, evaluation))
        return replace(result, meta={**result.meta, **build_meta(model, n_prompts=len(prompts))})

    def flag(self, model: Any, prompts: Any, evaluation: Any = None) -> torch.Tensor:
        """BoolTensor [N]: prompts predicted wrong (to re-check), by the selected method."""
        self._check_fitted()
        X, _ = self._read(model, prompts, evaluation, [self.layer_])
        return self.flag_activations(X[:, 0], _slot_valid(prompts, X.shape[2]))

    # -- tensor-facing ---------------------------------------------------------------------------

    def fit_activations(self, X: torch.Tensor, slots: dict, layers: Optional[Sequence[int]] = None) -> "ErrorDetector":
        """Fit from slot activations ``X`` [N, L, S, d] and :func:`answer_slots` labels.

        ``layers`` names axis 1 (default ``0..L-1``). Picks the layer and method on a validation
        split when ``layer`` is None or ``method="auto"``, then refits on every prompt.
        """
        X = self._check_X(X, slots)
        layers = list(range(X.shape[1])) if layers is None else list(layers)
        if len(layers) != X.shape[1]:
            raise AnalysisError(f"layers names {len(layers)} layers but X has {X.shape[1]} on axis 1")
        correct = slots["correct"]
        n_wrong, n_right = int((~correct).sum()), int(correct.sum())
        if min(n_wrong, n_right) < 2:
            raise AnalysisError(
                f"error detection needs at least 2 correct and 2 wrong answers to learn from; got {n_right} "
                f"correct and {n_wrong} wrong (use more prompts or a model that still makes errors)"
            )
        # slots read at the same position (single-token answers, "final_only") share one activation:
        # the direct probe sees each distinct position once
        self.direct_slots_ = [s for s in range(X.shape[2]) if not any(torch.equal(X[:, :, s], X[:, :, t]) for t in range(s))]
        self.validation_ = []
        auto = self.threshold == "auto"
        self.thresholds_ = {"disagreement": None, "direct": None if auto else float(self.threshold)}
        if len(layers) > 1 or self.method == "auto" or auto:
            from sklearn.model_selection import train_test_split

            train, val = train_test_split(np.arange(len(correct)), test_size=self.val_frac,
                                          random_state=self.random_state, stratify=correct.numpy())
            train, val = torch.as_tensor(train), torch.as_tensor(val)
            sub = {key: value[train] for key, value in slots.items()}
            for li, layer in enumerate(layers):
                models = self._fit_layer(X[train, li], sub)
                scores, agree_all, *_ = self._score_layer(models, X[val, li], slots["valid"][val])
                for m, method in enumerate(DETECTOR_METHODS):
                    threshold = best_threshold(correct[val], scores[:, m]) if auto else self.thresholds_[method]
                    predicted = agree_all if threshold is None else scores[:, m] >= threshold
                    row = detection_metrics(correct[val], predicted, scores[:, m])
                    self.validation_.append(dict(layer=layer, method=method, threshold=threshold, **row))
            candidates = [r for r in self.validation_ if self.method in ("auto", r["method"])]
            best = max(candidates, key=lambda r: (np.nan_to_num(r["balanced_accuracy"]), np.nan_to_num(r["auroc"])))
            self.layer_, self.method_ = best["layer"], best["method"]
            if auto:  # each method keeps the threshold it validated best with at the chosen layer
                self.thresholds_ = {r["method"]: r["threshold"] for r in self.validation_ if r["layer"] == self.layer_}
        else:
            self.layer_, self.method_ = layers[0], self.method
        self.models_ = self._fit_layer(X[:, layers.index(self.layer_)], slots)
        self.n_slots_ = X.shape[2]
        return self

    def evaluate_activations(self, X: torch.Tensor, slots: dict) -> "DetectorResult":
        """Metrics from slot activations ``X`` [N, S, d] at the chosen layer."""
        self._check_fitted()
        X = self._check_X(X[:, None], slots)[:, 0]
        scores, predicted, pred_true, pred_output = self._predict(self.models_, X, slots["valid"])
        return DetectorResult(
            correct=slots["correct"], scores=scores, predicted_correct=predicted, methods=list(DETECTOR_METHODS),
            method=self.method_, layer=int(self.layer_), position=self.position, true_slots=slots["true"],
            output_slots=slots["output"], slot_valid=slots["valid"], pred_true_slots=pred_true,
            pred_output_slots=pred_output, validation=list(self.validation_),
            meta=build_meta(kind=self.kind, site=self.site, thresholds=self.thresholds_, random_state=self.random_state),
        )

    def flag_activations(self, X: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Flags from slot activations ``X`` [N, S, d]; ``valid`` [N, S] marks existing slots."""
        self._check_fitted()
        X = _tensor(X, "X").float()
        if X.ndim != 3 or X.shape[1] != self.n_slots_:
            raise AnalysisError(f"X must be [n_prompts, {self.n_slots_} slots, d], got shape {tuple(X.shape)}")
        valid = torch.ones(X.shape[:2], dtype=torch.bool) if valid is None else valid.bool()
        _, predicted, *_ = self._predict(self.models_, X, valid)
        return ~predicted[:, DETECTOR_METHODS.index(self.method_)]

    # -- internals -------------------------------------------------------------------------------

    def _check_fitted(self) -> None:
        if not hasattr(self, "models_"):
            raise AnalysisError("this ErrorDetector is not fitted yet; call fit(model, prompts) first")

    @staticmethod
    def _check_X(X: torch.Tensor, slots: dict) -> torch.Tensor:
        X = _tensor(X, "X").float()
        if X.ndim != 4:
            raise AnalysisError(f"X must be [n_prompts, n_layers, n_slots, d], got shape {tuple(X.shape)}")
        expected = tuple(slots["true"].shape)
        for key in ("output", "valid"):
            if tuple(slots[key].shape) != expected:
                raise AnalysisError(f"slots[{key!r}] has shape {tuple(slots[key].shape)}, expected {expected}")
        if (X.shape[0], X.shape[2]) != expected or slots["correct"].shape != (X.shape[0],):
            raise AnalysisError(
                f"X has {X.shape[0]} prompts x {X.shape[2]} slots but the labels are {expected}; "
                "build them together with answer_slots(prompts, evaluation)"
            )
        return X

    def _slot_probe(self, X: torch.Tensor, y: torch.Tensor):
        if len(torch.unique(y)) < 2:
            return _Constant(int(y[0])) if len(y) else _Constant(-1)
        return make_probe(self.kind, random_state=self.random_state, **self.probe_kw).fit(X, y)

    def _fit_layer(self, X: torch.Tensor, slots: dict) -> dict:
        """Per-slot true / output probes and the direct probe on one layer's ``X`` [N, S, d]."""
        true_probes, output_probes = [], []
        for s in range(X.shape[1]):
            rows = slots["valid"][:, s]
            true_probes.append(self._slot_probe(X[rows, s], slots["true"][rows, s]))
            output_probes.append(self._slot_probe(X[rows, s], slots["output"][rows, s]))
        direct_kind = "mlp" if self.kind == "mlp" else "logistic"
        direct_kw = {**(self.probe_kw if direct_kind == self.kind else {}), "class_weight": "balanced"}
        direct = make_probe(direct_kind, random_state=self.random_state, **direct_kw)
        direct.fit(X[:, self.direct_slots_].flatten(1), slots["correct"].long())
        return dict(true=true_probes, output=output_probes, direct=direct)

    def _predict(self, models: dict, X: torch.Tensor, valid: torch.Tensor):
        """``(scores [N, 2], predicted_correct [N, 2], pred_true [N, S], pred_output [N, S])``."""
        scores, agree_all, pred_true, pred_output = self._score_layer(models, X, valid)
        predicted = torch.stack([
            agree_all if self.thresholds_[method] is None else scores[:, m] >= self.thresholds_[method]
            for m, method in enumerate(DETECTOR_METHODS)
        ], dim=1)
        return scores, predicted, pred_true, pred_output

    def _score_layer(self, models: dict, X: torch.Tensor, valid: torch.Tensor):
        """``(scores [N, 2], every slot's probes agree [N], pred_true [N, S], pred_output [N, S])``."""
        agree = torch.ones(X.shape[:2])
        pred_true = torch.full(X.shape[:2], -1, dtype=torch.long)
        pred_output = pred_true.clone()
        for s, (true_probe, output_probe) in enumerate(zip(models["true"], models["output"])):
            agree[:, s] = _agreement(true_probe, output_probe, X[:, s])
            pred_true[:, s] = true_probe.predict(X[:, s])
            pred_output[:, s] = output_probe.predict(X[:, s])
        agree = torch.where(valid, agree, 1.0)
        disagreement_ok = ((pred_true == pred_output) | ~valid).all(-1)
        direct = models["direct"].predict_proba(X[:, self.direct_slots_].flatten(1))[:, 1]  # classes_ [0, 1]: P(correct)
        return torch.stack([agree.prod(-1), direct], dim=1), disagreement_ok, pred_true, pred_output


@dataclass(frozen=True)
class DetectorResult(Result):
    """An :class:`ErrorDetector` on a prompt set: per-prompt scores and metrics for each method.

    ``correct`` [N] (the truth), ``scores`` [N, M] (probability of a correct answer per method in
    ``methods``), ``predicted_correct`` [N, M]; per answer slot [N, S]: ``true_slots``,
    ``output_slots``, ``slot_valid`` and the slot probes' predictions ``pred_true_slots`` /
    ``pred_output_slots``. ``method`` is the one ``flag`` uses; ``validation`` the selection rows.
    """

    correct: torch.Tensor
    scores: torch.Tensor
    predicted_correct: torch.Tensor
    methods: list
    method: str
    layer: int
    position: str
    true_slots: torch.Tensor
    output_slots: torch.Tensor
    slot_valid: torch.Tensor
    pred_true_slots: torch.Tensor
    pred_output_slots: torch.Tensor
    validation: list
    meta: dict

    def metrics(self, method: Optional[str] = None) -> dict:
        """:func:`detection_metrics` for ``method`` (default: the selected one)."""
        method = self.method if method is None else method
        if method not in self.methods:
            raise AnalysisError(f"unknown method {method!r}; accepted: {accepted(self.methods)}")
        m = self.methods.index(method)
        return detection_metrics(self.correct, self.predicted_correct[:, m], self.scores[:, m])

    def __getitem__(self, key: str) -> float:
        """A metric of the selected method, e.g. ``result["auroc"]``."""
        values = self.metrics()
        if key not in values:
            raise AnalysisError(f"unknown metric {key!r}; accepted: {accepted(values)}")
        return values[key]

    def slot_accuracy(self) -> dict:
        """Held-out accuracy of the true-digit and output-digit probes per slot."""
        valid = self.slot_valid.float()
        hit_true = ((self.pred_true_slots == self.true_slots).float() * valid).sum(0) / valid.sum(0).clamp_min(1)
        hit_out = ((self.pred_output_slots == self.output_slots).float() * valid).sum(0) / valid.sum(0).clamp_min(1)
        return dict(true=hit_true.tolist(), output=hit_out.tolist())

    def to_frame(self):
        """One row per method with its metrics (and the layer, position, selection flag)."""
        import pandas as pd

        return pd.DataFrame([
            dict(method=m, selected=m == self.method, layer=self.layer, position=self.position, **self.metrics(m))
            for m in self.methods
        ])

    def plot(self, kind: str = "roc", slot: int = 0, probe: str = "true", **kwargs):
        """``kind="roc"``: ROC curve per method; ``"confusion"``: predicted vs actual values of
        the ``probe`` (``"true"`` or ``"output"``) digit probe at ``slot``."""
        from arithinterp.viz import probes as viz

        if kind == "roc":
            return viz.roc_curve(self, **kwargs)
        if kind == "confusion":
            return viz.digit_confusion(self, slot=slot, probe=probe, **kwargs)
        raise ConfigError(f"unknown plot kind {kind!r}; accepted: {accepted(('roc', 'confusion'))}")


# --- re-asking flagged prompts --------------------------------------------------------------------


def _parse_answers(tokenizer: Any, generated: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    """Generated answer tokens → integers (``tasks.UNPARSABLE`` when not a number), as ``evaluate`` does."""
    values = []
    for row, k in zip(generated.tolist(), n_tokens.tolist()):
        text = tokenizer.decode(row[:k]).replace(" ", "")
        values.append(int(text) if re.fullmatch(r"-?\d+", text) else _UNPARSABLE)
    return torch.tensor(values, dtype=torch.long)


def _reprefixed(prompts: Any, prefix: str, n_ctx: Optional[int]) -> Any:
    """The same prompts with ``prefix`` in place of their own prefix (positions shifted)."""
    tokenizer = prompts.tokenizer
    bodies = [text[len(prompts.prefix):] for text in prompts.texts]
    ids = tokenizer([prefix + body for body in bodies], add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if prompts.prepend_bos else []
    rows = [bos + row for row in ids]
    if tokenizer.unk_token_id is not None and any(tokenizer.unk_token_id in row for row in rows):
        raise TaskError(f"the few-shot prefix {prefix[:40]!r}... has text this tokenizer does not know")
    length = max(len(row) for row in rows)
    if n_ctx is not None and length + prompts.answer_tokens.shape[1] > n_ctx:
        raise TaskError(f"a {length}-token prompt with a few-shot prefix does not fit the model's context of {n_ctx}")
    old_length = prompts.tokens.shape[1]
    tail = int((old_length - torch.stack(list(prompts.positions.values())).min()))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens = torch.full((len(rows), length), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, length - len(row):] = torch.tensor(row)
    if not torch.equal(tokens[:, -tail:], prompts.tokens[:, -tail:]):
        raise TaskError("the few-shot prefix changes how the prompts themselves tokenize; end it with a separator")
    return replace(
        prompts, texts=tuple(prefix + body for body in bodies), tokens=tokens,
        lengths=torch.tensor([len(row) for row in rows]), prefix=prefix,
        positions={name: pos + (length - old_length) for name, pos in prompts.positions.items()},
    )


def few_shot_policy(n_shots: int = 3, seed: int = 1) -> Callable[[Any, Any], torch.Tensor]:
    """Re-ask with ``n_shots`` solved examples (drawn with ``seed`` from the prompts' operands)
    as a new prefix, greedy; raises ``TaskError`` when the prefix does not fit the model."""
    import random

    from arithinterp.tasks import answer_text, compute

    def few_shot(model: Any, prompts: Any) -> torch.Tensor:
        rng = random.Random(seed)
        a_pool, b_pool = prompts.a.tolist(), prompts.b.tolist()
        digits = prompts.meta.get("answer_digits", 0)
        lines = []
        for _ in range(n_shots):
            a, b = rng.choice(a_pool), rng.choice(b_pool)
            value = compute(prompts.op, a, b, prompts.modulus)
            lines.append(prompts.template.format(a=a, b=b) + answer_text(value, digits) + "\n")
        shifted = _reprefixed(prompts, "".join(lines), getattr(model.cfg, "n_ctx", None))
        return shifted.evaluate(model).model_answer

    few_shot.__name__ = f"few_shot(n_shots={n_shots}, seed={seed})"
    return few_shot


def vote_policy(n_samples: int = 8, temperature: float = 1.0, seed: int = 0, batch_size: int = 256) -> Callable[[Any, Any], torch.Tensor]:
    """Re-ask by sampling ``n_samples`` answers at ``temperature`` and keeping the most frequent
    number (self-consistency); seeded. A deterministic greedy re-run could not change an answer."""
    if not (n_samples >= 1 and temperature > 0):
        raise ConfigError(f"vote_policy needs n_samples >= 1 and temperature > 0, got {n_samples}, {temperature}")

    @torch.inference_mode()
    def vote(model: Any, prompts: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        k = prompts.answer_tokens.shape[1]
        values = torch.empty(len(prompts), n_samples, dtype=torch.long)
        for idx in [g for group in prompts.length_groups() for g in group.split(max(1, batch_size // n_samples))]:
            tokens = prompts.unpadded(idx).repeat_interleave(n_samples, 0)
            for _ in range(k):
                logits = model(tokens, return_type="logits")[:, -1].float()
                probs = (logits / temperature).softmax(-1).cpu()  # the seeded generator lives on the CPU
                nxt = torch.multinomial(probs, 1, generator=generator).to(tokens.device)
                tokens = torch.cat([tokens, nxt], dim=1)
            generated = tokens[:, -k:].cpu()
            parsed = _parse_answers(prompts.tokenizer, generated, prompts.n_answer_tokens[idx].repeat_interleave(n_samples))
            values[idx] = parsed.view(len(idx), n_samples)
        # most frequent parsable value per prompt (ties: the earliest sample)
        counts = (values[:, :, None] == values[:, None, :]).sum(-1) - 0.5 * (values == _UNPARSABLE)
        return values.gather(1, counts.argmax(1, keepdim=True))[:, 0]

    vote.__name__ = f"vote(n_samples={n_samples}, temperature={temperature}, seed={seed})"
    return vote


@dataclass(frozen=True)
class RepairResult(Result):
    """Re-asking the flagged prompts: answers before / after and what changed, per prompt [N]."""

    a: torch.Tensor
    b: torch.Tensor
    answer: torch.Tensor
    flagged: torch.Tensor
    answer_before: torch.Tensor
    answer_after: torch.Tensor
    correct_before: torch.Tensor
    correct_after: torch.Tensor
    policy: str
    meta: dict

    @property
    def fixed(self) -> int:
        """Wrong answers the re-ask made right."""
        return int((self.flagged & ~self.correct_before & self.correct_after).sum())

    @property
    def broken(self) -> int:
        """Right answers the re-ask made wrong."""
        return int((self.flagged & self.correct_before & ~self.correct_after).sum())

    def summary(self) -> dict:
        before, after = self.correct_before.float().mean(), self.correct_after.float().mean()
        return dict(
            n=len(self.flagged), flagged=int(self.flagged.sum()), errors_before=int((~self.correct_before).sum()),
            errors_flagged=int((self.flagged & ~self.correct_before).sum()), fixed=self.fixed, broken=self.broken,
            accuracy_before=float(before), accuracy_after=float(after), policy=self.policy,
        )

    def to_frame(self):
        """One row per prompt."""
        import pandas as pd

        return pd.DataFrame(dict(
            a=self.a.numpy(), b=self.b.numpy(), answer=self.answer.numpy(), flagged=self.flagged.numpy(),
            answer_before=self.answer_before.numpy(), answer_after=self.answer_after.numpy(),
            correct_before=self.correct_before.numpy(), correct_after=self.correct_after.numpy(),
        ))

    def plot(self, **kwargs):
        from arithinterp.viz.probes import repair_outcomes

        return repair_outcomes(self, **kwargs)


def repair(model: Any, prompts: Any, detector: ErrorDetector, policy: Optional[Callable] = None,
           evaluation: Any = None) -> RepairResult:
    """Re-ask only the prompts ``detector`` flags and count errors fixed vs correct answers broken.

    ``policy(model, flagged_prompts)`` returns the new answers (a LongTensor, or an
    ``Evaluation``). Default: :func:`few_shot_policy` when a few-shot prefix fits the model and
    its tokenizer, else :func:`vote_policy` (the reason is kept in ``meta``). RECIPES §5.
    """
    if not isinstance(detector, ErrorDetector):
        raise AnalysisError(f"detector must be a fitted ErrorDetector, got {type(detector).__name__}")
    evaluation = evaluation if evaluation is not None else prompts.evaluate(model)
    flagged = detector.flag(model, prompts, evaluation)
    after = evaluation.model_answer.clone()
    meta = build_meta(model, n_prompts=len(prompts), detector_layer=detector.layer_, detector_method=detector.method_)
    name = getattr(policy, "__name__", type(policy).__name__)
    if flagged.any():
        sub = prompts[flagged]
        if policy is None:
            try:
                policy = few_shot_policy()
                new = policy(model, sub)
            except TaskError as error:
                meta["few_shot_unavailable"] = str(error)
                policy = vote_policy()
                new = policy(model, sub)
            name = policy.__name__
        else:
            new = policy(model, sub)
        new = _tensor(getattr(new, "model_answer", new), "policy answers").long()
        if new.shape != (len(sub),):
            raise AnalysisError(f"the policy must return one answer per flagged prompt ({len(sub)}), got {tuple(new.shape)}")
        after[flagged] = new
    correct_after = torch.where(flagged, after == prompts.answer, evaluation.correct)
    return RepairResult(
        a=prompts.a, b=prompts.b, answer=prompts.answer, flagged=flagged, answer_before=evaluation.model_answer,
        answer_after=after, correct_before=evaluation.correct.bool(), correct_after=correct_after,
        policy=str(name if policy is not None else "none (nothing flagged)"), meta=meta,
    )
