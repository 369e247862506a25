"""What every probe shares: input validation, standardisation, the raw-space view of a linear map.

``X`` is a torch tensor or numpy array ``[n_samples, n_features]``; :func:`as_features` and
:func:`as_targets` refuse what a probe cannot fit (never converting silently), and
:class:`ProbeBase` standardises features inside and stores a fitted linear map in raw activation
space (``coef_``, ``intercept_``, unit ``directions_``).
"""

from __future__ import annotations

import abc
from typing import Any, Optional, Sequence, TypeVar, Union, cast

import numpy as np
import torch
from sklearn.base import BaseEstimator, clone
from sklearn.exceptions import NotFittedError as SklearnNotFittedError

from arithinterp.errors import AnalysisError, ConfigError

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]


def to_tensor(values: Any, name: str) -> torch.Tensor:
    """A tensor on the CPU from a tensor, an array or a nested sequence (detached, never copied needlessly).

    Args:
        values: A torch tensor, numpy array or sequence.
        name: The argument's name, for the error message.

    Returns:
        The values as a CPU tensor.

    Raises:
        AnalysisError: ``values`` cannot be read as an array.
    """
    if isinstance(values, torch.Tensor):
        return values.detach().cpu()
    try:
        return torch.as_tensor(np.asarray(values))
    except (TypeError, ValueError) as error:
        raise AnalysisError(f"{name} must be a torch tensor or numpy array, got {type(values).__name__}") from error


def as_features(X: ArrayLike, n_features: Optional[int] = None) -> torch.Tensor:
    """``X`` as a finite float32 tensor ``[n_samples, n_features]``.

    Args:
        X: Features [n, d] (a tensor or an array).
        n_features: The number of features a fitted probe expects, or ``None``.

    Returns:
        float32 [n, d].

    Raises:
        AnalysisError: ``X`` is not 2-d, is empty, has the wrong number of features, is complex, or
            holds NaN or infinite values.
    """
    X = to_tensor(X, "X")
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


def as_targets(y: ArrayLike, n: int, *, integer: bool, allow_2d: bool = False) -> torch.Tensor:
    """``y`` as a tensor of ``n`` labels (long when ``integer``; else float, ``[n]`` or ``[n, t]``).

    Args:
        y: The labels.
        n: How many samples there are.
        integer: Class labels (long) rather than values (float64).
        allow_2d: Accept several targets per sample ``[n, t]`` (values only).

    Returns:
        long [n], or float64 [n] / [n, t].

    Raises:
        AnalysisError: the labels do not match the samples, have too many dimensions, are not
            finite, or (``integer``) are not whole numbers.
    """
    y = to_tensor(y, "y")
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


class NotFittedError(AnalysisError, SklearnNotFittedError):
    """A probe or detector used before ``fit``: scikit-learn's ``NotFittedError`` (so
    ``sklearn.utils.validation.check_is_fitted`` callers catch it) and an ``ArithInterpError``."""


def check_fitted(probe: Any) -> None:
    """Refuse a probe that is not fitted yet.

    Args:
        probe: The probe.

    Raises:
        NotFittedError: ``fit`` has not run.
    """
    if not hasattr(probe, "mean_"):
        raise NotFittedError(f"this {type(probe).__name__} is not fitted yet; call fit(X, y) first")


def standardise(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and scale; constant features get scale 1 (they carry no signal).

    Args:
        X: Features [n, d].

    Returns:
        ``(mean [d], scale [d])``.
    """
    mean = X.mean(0)
    std = X.std(0, unbiased=False)
    return mean, torch.where(std > 1e-8 * (std.max() + 1e-30), std, torch.ones_like(std))


def sample_weights(y_index: torch.Tensor, n_classes: int, class_weight: Optional[str]) -> torch.Tensor:
    """Per-sample weights: all 1, or inversely proportional to the class's frequency (``"balanced"``).

    Args:
        y_index: Each sample's class index, long [n].
        n_classes: How many classes there are.
        class_weight: ``None`` or ``"balanced"``.

    Returns:
        The weights, float [n].

    Raises:
        ConfigError: ``class_weight`` is unknown.
    """
    if class_weight is None:
        return torch.ones(len(y_index))
    if class_weight != "balanced":
        raise ConfigError(f"unknown class_weight {class_weight!r}; accepted: None, 'balanced'")
    counts = torch.bincount(y_index, minlength=n_classes).float()
    return (len(y_index) / (n_classes * counts))[y_index]


def unit_rows(coef: torch.Tensor) -> torch.Tensor:
    """Each row of ``coef`` scaled to unit length (a zero row stays zero).

    Args:
        coef: A linear map [k, d].

    Returns:
        Unit rows [k, d].
    """
    return coef / coef.norm(dim=1, keepdim=True).clamp_min(1e-12)


# Below this many feature values a probe's optimisation runs on one thread: its matrices are small, so a
# thread pool's synchronisation costs more than it saves, and on a busy machine its threads wait for cores
# (a layer of four probes on Gemma 3 270M's activations: 4 s on one thread, 36-106 s on two at load 4).
ONE_THREAD_BELOW = 1 << 22


class OneThread:
    """Context: torch on one thread while inside (for small problems; see :data:`ONE_THREAD_BELOW`).

    Args:
        small: Whether the problem is small (otherwise the context changes nothing).
    """

    def __init__(self, small: bool):
        self.small, self.threads = small, torch.get_num_threads()

    def __enter__(self) -> None:
        if self.small:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.small:
            torch.set_num_threads(self.threads)


class ProbeBase(BaseEstimator, abc.ABC):
    """Shared plumbing: standardisation and the raw-space view of a linear map.

    Subclasses implement ``fit`` and ``score``; fitted attributes end in ``_`` (scikit-learn style).
    """

    # set by fit
    mean_: torch.Tensor
    scale_: torch.Tensor
    n_features_in_: int
    coef_: torch.Tensor
    intercept_: torch.Tensor
    directions_: torch.Tensor
    classes_: torch.Tensor
    n_iter_: int

    @abc.abstractmethod
    def fit(self, X: ArrayLike, y: ArrayLike) -> "ProbeBase":
        """Fit on features and labels.

        Args:
            X: Features [n, d].
            y: Labels or values [n].

        Returns:
            The probe, fitted.
        """

    @abc.abstractmethod
    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """The probe's score on held-out data (accuracy, or R² for regressions).

        Args:
            X: Features [n, d].
            y: Labels or values [n].

        Returns:
            The score.
        """

    def _standardised(self, X: ArrayLike) -> torch.Tensor:
        check_fitted(self)
        X = as_features(X, self.n_features_in_)
        return (X - self.mean_) / self.scale_

    def _fit_scaler(self, X: torch.Tensor) -> torch.Tensor:
        self.mean_, self.scale_ = standardise(X)
        self.n_features_in_ = X.shape[1]
        return (X - self.mean_) / self.scale_

    def _set_linear(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Store ``weight`` [k, d] / ``bias`` [k] learned on standardised features in raw space."""
        self.coef_ = (weight / self.scale_).float()
        self.intercept_ = (bias - self.coef_ @ self.mean_).float()
        self.directions_ = unit_rows(self.coef_)


Estimator = TypeVar("Estimator")


def clone_estimator(estimator: Estimator) -> Estimator:
    """``sklearn.base.clone``: an unfitted copy of ``estimator`` with the same parameters.

    Args:
        estimator: A scikit-learn-style estimator.

    Returns:
        The copy.
    """
    # clone is unannotated; its inferred return type is a union of the containers it also copies
    return cast(Estimator, clone(estimator))


class ClassifierProbe(ProbeBase):
    """A probe that predicts classes: ``predict`` and ``score`` (accuracy) from its per-class
    scores, ``_class_scores(X) -> [n, k]`` (logits or probabilities; the largest wins)."""

    @abc.abstractmethod
    def _class_scores(self, X: ArrayLike) -> torch.Tensor: ...

    def predict(self, X: ArrayLike) -> torch.Tensor:
        """The most probable class of each sample.

        Args:
            X: Features [n, d].

        Returns:
            Class labels, long [n].
        """
        check_fitted(self)
        return self.classes_[self._class_scores(X).argmax(-1)]

    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """Accuracy.

        Args:
            X: Features [n, d].
            y: Class labels [n].

        Returns:
            The fraction of samples predicted right.
        """
        X = as_features(X)
        return float((self.predict(X) == as_targets(y, len(X), integer=True)).float().mean())
