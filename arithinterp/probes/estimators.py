"""Probe estimators: scikit-learn-style linear, circular and MLP probes on pure tensors.

``fit(X, y)``, ``predict``, ``score``, ``get_params``; ``X`` is a torch tensor or numpy array
``[n_samples, n_features]``; features are standardised inside. Fitted linear probes expose
``directions_`` ``[k, n_features]`` (unit rows in the raw activation space) for patching and
steering. Here: :class:`RidgeProbe`, :class:`CircularProbe`, :class:`MLPProbe`,
:class:`MonotoneLogistic` (a logistic model with non-negative weights, the error detector's
calibrator), :func:`make_probe` and :func:`is_classifier_kind`; :class:`LogisticProbe` is in
:mod:`~arithinterp.probes.logistic`, the input validation the probes share in
:mod:`~arithinterp.probes.probe_base`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.base import BaseEstimator

from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.probes.logistic import LogisticProbe
from arithinterp.probes.probe_base import (
    ArrayLike, ClassifierProbe, ProbeBase, as_features, as_targets, check_fitted, sample_weights,
)
from arithinterp.types import checked

PROBE_KINDS = ("logistic", "ridge", "circular", "mlp")


class RidgeProbe(ProbeBase):
    """Ridge regression ``d → t`` in closed form on standardised features; ``score`` is R².

    ``y`` may be ``[n]`` or ``[n, t]``. ``directions_`` [t, d]: unit rows in raw activation space.

    Args:
        alpha: The L2 strength (non-negative).
    """

    def __init__(self, alpha: float = 1.0):
        self.alpha = alpha

    def _solve(self, Z: torch.Tensor, Y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.alpha >= 0:
            raise ConfigError(f"alpha must be non-negative, got {self.alpha!r}")
        Z = Z.double()
        y_mean = Y.mean(0)
        gram = Z.T @ Z + self.alpha * torch.eye(Z.shape[1], dtype=Z.dtype)
        weight = torch.linalg.lstsq(gram, Z.T @ (Y - y_mean)).solution.T  # [t, d]
        return weight.float(), y_mean.float()

    def fit(self, X: ArrayLike, y: ArrayLike) -> "RidgeProbe":
        """Fit on features ``X`` and values ``y``.

        Args:
            X: Features [n, d].
            y: Values [n] or [n, t].

        Returns:
            The probe, fitted.

        Raises:
            AnalysisError: ``X`` or ``y`` is refused, or there are fewer than 2 samples.
            ConfigError: ``alpha`` is negative.
        """
        X = as_features(X)
        y = as_targets(y, len(X), integer=False, allow_2d=True)
        if len(X) < 2:
            raise AnalysisError(f"ridge regression needs at least 2 samples, got {len(X)}")
        self.output_ndim_ = y.ndim
        Z = self._fit_scaler(X)
        weight, bias = self._solve(Z, y.reshape(len(y), -1))
        self._set_linear(weight, bias)
        return self

    def predict(self, X: ArrayLike) -> torch.Tensor:
        """The predicted values.

        Args:
            X: Features [n, d].

        Returns:
            [n] (or [n, t] for 2-d targets).

        Raises:
            NotFittedError: the probe is not fitted.
        """
        check_fitted(self)
        out = as_features(X, self.n_features_in_) @ self.coef_.T + self.intercept_
        return out[:, 0] if self.output_ndim_ == 1 else out

    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """R² (averaged uniformly over outputs).

        Args:
            X: Features [n, d].
            y: Values [n] or [n, t].

        Returns:
            The coefficient of determination.
        """
        X = as_features(X)
        y = as_targets(y, len(X), integer=False, allow_2d=True).reshape(len(X), -1)
        pred = self.predict(X).double().reshape(len(X), -1)
        residual = ((y - pred) ** 2).sum(0)
        total = ((y - y.mean(0)) ** 2).sum(0)
        return float((1 - residual / total.clamp_min(1e-12)).mean())


class CircularProbe(RidgeProbe):
    """A 2-d linear map whose angle encodes a value mod ``period`` (Sun, Stolfo & Sachan 2025).

    Fits ridge least squares from standardised features to ``(cos 2πy/m, sin 2πy/m)``; predicts
    ``round(angle · m / 2π) mod m``. ``score`` is the accuracy against ``y mod m``.
    ``directions_`` [2, d]: the cos and sin read-out directions.

    Args:
        period: The modulus ``m`` (an integer of at least 2).
        alpha: The L2 strength.
    """

    def __init__(self, period: int = 10, alpha: float = 1.0):
        self.period = period
        self.alpha = alpha

    def _angles(self, y: torch.Tensor) -> torch.Tensor:
        theta = 2 * math.pi * (y.double() % self.period) / self.period
        return torch.stack([theta.cos(), theta.sin()], dim=1)

    def fit(self, X: ArrayLike, y: ArrayLike) -> "CircularProbe":
        """Fit on features ``X`` and integer values ``y`` (read mod ``period``).

        Args:
            X: Features [n, d].
            y: Integer values [n].

        Returns:
            The probe, fitted.

        Raises:
            AnalysisError: ``X`` or ``y`` is refused, or there are fewer than 2 samples.
            ConfigError: ``period`` is not an integer of at least 2.
        """
        if not (isinstance(self.period, (int, np.integer)) and self.period >= 2):
            raise ConfigError(f"period must be an integer >= 2, got {self.period!r}")
        X = as_features(X)
        y = as_targets(y, len(X), integer=True)
        if len(X) < 2:
            raise AnalysisError(f"a circular probe needs at least 2 samples, got {len(X)}")
        self.output_ndim_ = 2
        Z = self._fit_scaler(X)
        weight, bias = self._solve(Z, self._angles(y))
        self._set_linear(weight, bias)
        return self

    def decision_function(self, X: ArrayLike) -> torch.Tensor:
        """The 2-d projection ``[n, 2]`` (cos, sin).

        Args:
            X: Features [n, d].

        Returns:
            [n, 2].
        """
        return super().predict(X)

    def predict_angle(self, X: ArrayLike) -> torch.Tensor:
        """Angle in ``[0, 2π)`` per sample ``[n]``.

        Args:
            X: Features [n, d].

        Returns:
            Angles [n].
        """
        xy = self.decision_function(X)
        return torch.atan2(xy[:, 1], xy[:, 0]) % (2 * math.pi)

    def predict(self, X: ArrayLike) -> torch.Tensor:
        """The rounded angle as a value mod ``period``.

        Args:
            X: Features [n, d].

        Returns:
            Values in ``0..period-1``, long [n].
        """
        return torch.round(self.predict_angle(X) * self.period / (2 * math.pi)).long() % self.period

    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """Accuracy of the rounded angle against ``y mod period``.

        Args:
            X: Features [n, d].
            y: Integer values [n].

        Returns:
            The fraction of samples predicted right.
        """
        X = as_features(X)
        y = as_targets(y, len(X), integer=True)
        return float((self.predict(X) == y % self.period).float().mean())


class MLPProbe(ClassifierProbe):
    """A non-linear comparison probe ``d → hidden (ReLU) → classes`` trained with Adam.

    Mini-batches of ``batch_size``, ``epochs`` passes, seeded by ``random_state``. No
    ``directions_`` (the map is not linear).

    Args:
        hidden: Hidden units.
        epochs: Passes over the data.
        lr: Adam's learning rate.
        weight_decay: Adam's weight decay.
        batch_size: Samples per step.
        class_weight: ``None`` or ``"balanced"``.
        random_state: The seed of the initialisation and the batches.
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
        """Fit on features ``X`` and class labels ``y``.

        Args:
            X: Features [n, d].
            y: Class labels [n].

        Returns:
            The probe, fitted.

        Raises:
            AnalysisError: ``X`` or ``y`` is refused, or ``y`` has one class.
            ConfigError: ``class_weight`` is unknown.
        """
        X = as_features(X)
        y = as_targets(y, len(X), integer=True)
        classes, y_index = torch.unique(y, return_inverse=True)
        if len(classes) < 2:
            raise AnalysisError(f"a classifier needs at least two classes in y; got only {classes.tolist()}")
        self.classes_ = classes
        generator = torch.Generator().manual_seed(int(self.random_state))
        with torch.inference_mode(False), torch.enable_grad():  # callers may be in inference mode
            y_index = y_index.clone()
            weights = sample_weights(y_index, len(classes), self.class_weight)
            Z = self._fit_scaler(X.clone())
            hidden, output = (
                torch.nn.Linear(Z.shape[1], int(self.hidden)),
                torch.nn.Linear(int(self.hidden), len(classes)),
            )
            net = torch.nn.Sequential(hidden, torch.nn.ReLU(), output)
            for layer in (hidden, output):  # seeded init, independent of the global RNG
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
        """Class probabilities ``[n, k]`` in the order of ``classes_``.

        Args:
            X: Features [n, d].

        Returns:
            The probabilities [n, k].
        """
        with torch.no_grad():
            return self.net_(self._standardised(X)).softmax(-1)

    def _class_scores(self, X: ArrayLike) -> torch.Tensor:
        return self.predict_proba(X)


_PROBES = {"logistic": LogisticProbe, "ridge": RidgeProbe, "circular": CircularProbe, "mlp": MLPProbe}


class MonotoneLogistic(BaseEstimator):
    """Logistic regression whose coefficients may not be negative: P(class 1) can only rise with
    each feature. The error detector calibrates with it (its features — log agreements, the direct
    probe's logit — all say "more likely correct" as they grow).

    A plain logistic calibrator fitted on out-of-fold scores can learn a negative slope where a
    probe without signal over-fits (its out-of-fold scores then run slightly *against* the
    labels), and so turns an AUROC below 0.5 into one above it on the same rows; on new prompts
    the flip buys nothing. Bounding the slopes at zero leaves such a feature out instead.
    Features are standardised; the L2 penalty is scikit-learn's (``C`` times the summed log
    loss plus half the squared weights; the intercept is not penalised).

    Args:
        C: inverse regularisation strength.
    """

    def __init__(self, C: float = 1.0):
        self.C = C

    def fit(self, X: Any, y: Any) -> "MonotoneLogistic":
        """Fit on features ``X`` [n, d] and binary labels ``y`` [n].

        Args:
            X: Features [n, d].
            y: Labels 0 / 1 [n].

        Returns:
            The model, fitted.
        """
        from scipy.optimize import minimize

        X, y = np.asarray(X, dtype=np.float64), np.asarray(y).astype(np.float64)
        self.classes_ = np.array([0, 1])
        self.mean_, self.scale_ = X.mean(0), X.std(0)
        self.scale_[self.scale_ < 1e-12] = 1.0
        Z = (X - self.mean_) / self.scale_
        d = Z.shape[1]

        def objective(w: np.ndarray) -> tuple[float, np.ndarray]:
            z = Z @ w[:d] + w[d]
            p = 1.0 / (1.0 + np.exp(-z))
            loss = self.C * float(np.sum(np.logaddexp(0.0, z) - y * z)) + 0.5 * float(w[:d] @ w[:d])
            grad = np.concatenate([self.C * (Z.T @ (p - y)) + w[:d], [self.C * float(np.sum(p - y))]])
            return loss, grad

        rate = float(np.clip(y.mean(), 1e-6, 1 - 1e-6))
        start = np.concatenate([np.zeros(d), [np.log(rate / (1 - rate))]])
        bounds = [(0.0, None)] * d + [(None, None)]
        solution = minimize(objective, start, jac=True, method="L-BFGS-B", bounds=bounds,
                            options=dict(maxiter=1000))
        self.coef_, self.intercept_ = solution.x[:d], float(solution.x[d])
        return self

    def predict_proba(self, X: Any) -> np.ndarray:
        """``[n, 2]``: P(class 0), P(class 1).

        Args:
            X: Features [n, d].

        Returns:
            The probabilities [n, 2].
        """
        Z = (np.asarray(X, dtype=np.float64) - self.mean_) / self.scale_
        p = 1.0 / (1.0 + np.exp(-(Z @ self.coef_ + self.intercept_)))
        return np.stack([1 - p, p], 1)

    def predict(self, X: Any) -> np.ndarray:
        """``[n]``: 1 where P(class 1) is at least one half.

        Args:
            X: Features [n, d].

        Returns:
            Labels 0 / 1, int64 [n].
        """
        return (self.predict_proba(X)[:, 1] >= 0.5).astype(np.int64)


@checked
def make_probe(kind: str, random_state: Optional[int] = None, **kwargs: Any) -> ProbeBase:
    """A probe of ``kind`` (``"logistic"``, ``"ridge"``, ``"circular"``, ``"mlp"``) with ``kwargs``.

    Args:
        kind: One of :data:`PROBE_KINDS`.
        random_state: Seeds the probes that draw random numbers (``"mlp"``); the linear and
            circular probes are deterministic (full-batch L-BFGS from zero, closed-form ridge) and
            take no seed.
        **kwargs: The probe's parameters.

    Returns:
        An unfitted probe.

    Raises:
        ConfigError: ``kind`` is unknown, or the probe has no such parameter.
    """
    if kind not in _PROBES:
        raise ConfigError(f"unknown probe kind {kind!r}; accepted: {accepted(PROBE_KINDS)}")
    cls = _PROBES[kind]
    allowed = cls._get_param_names()
    if random_state is not None and "random_state" in allowed:
        kwargs.setdefault("random_state", random_state)
    unknown = [k for k in kwargs if k not in allowed]
    if unknown:
        raise ConfigError(f"{kind} probe has no option(s) {accepted(unknown)}; accepted: {accepted(allowed)}")
    return cls(**kwargs)


@checked
def is_classifier_kind(kind: str) -> bool:
    """Whether ``kind`` predicts discrete labels (scored by accuracy) rather than values (R²).

    Args:
        kind: One of :data:`PROBE_KINDS`.

    Returns:
        ``False`` for ``"ridge"`` only.
    """
    return kind != "ridge"
