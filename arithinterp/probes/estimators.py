"""Probe estimators: scikit-learn-style linear, circular and MLP probes on pure tensors.

``fit(X, y)``, ``predict``, ``score``, ``get_params``; ``X`` is a torch tensor or numpy array
``[n_samples, n_features]``; features are standardised inside. Fitted linear probes expose
``directions_`` ``[k, n_features]`` (unit rows in the raw activation space) for patching and
steering. Also :class:`MonotoneLogistic` (a logistic model with non-negative weights, the error
detector's calibrator), the input validation the probes share, :func:`make_probe` and
:func:`is_classifier_kind`.
"""

from __future__ import annotations

import abc

import math
from typing import Any, Optional, Sequence, TypeVar, Union, cast

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.base import BaseEstimator, clone
from sklearn.exceptions import NotFittedError as SklearnNotFittedError

from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.types import checked

PROBE_KINDS = ("logistic", "ridge", "circular", "mlp")

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]


# --- input validation -----------------------------------------------------------------------------


def to_tensor(values: Any, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu()
    try:
        return torch.as_tensor(np.asarray(values))
    except (TypeError, ValueError) as error:
        raise AnalysisError(f"{name} must be a torch tensor or numpy array, got {type(values).__name__}") from error


def _features(X: ArrayLike, n_features: Optional[int] = None) -> torch.Tensor:
    """``X`` as a finite float32 tensor ``[n_samples, n_features]``."""
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
    """``y`` as a tensor of ``n`` labels (long when ``integer``; else float, ``[n]`` or ``[n, t]``)."""
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


def _check_fitted(probe: Any) -> None:
    if not hasattr(probe, "mean_"):
        raise NotFittedError(f"this {type(probe).__name__} is not fitted yet; call fit(X, y) first")


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


# --- one L-BFGS per row, evaluated together ------------------------------------------------------

LOGISTIC_SOLVERS = ("joint", "rows")


def lbfgs_rows(fun: Any, x0: torch.Tensor, max_iter: int = 100, tol: float = 1e-5, history: int = 20,
               ftol: float = 1e-9, skip: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise B independent problems at once: ``fun(x [A, m], rows [A]) -> (f [A], grad [A, m],
    size [A])`` evaluates the problems ``rows`` (indices into the B) at ``x``; ``size`` is the
    gradient's size that the stopping test compares with ``tol``.

    Every row runs its own L-BFGS (Nocedal & Wright 2006, Alg. 7.4/7.5: the two-loop recursion
    over the row's last ``history`` steps and a backtracking Armijo line search), so a row's
    path does not depend on the others; only the evaluations are shared, one call of ``fun``
    for the rows still running per trial step (one matrix product for many probes; a row that
    has stopped, or has already accepted its step, is not evaluated again). A row stops after
    ``max_iter`` iterations, when its gradient's ``size`` is at most ``tol`` or when its
    objective changes by at most ``ftol`` (relative); rows marked in ``skip`` [B] do not move.
    Returns the solutions [B, m] and each row's iterations [B].
    """
    x = x0.detach().clone()
    B = x.shape[0]
    f, g, size = fun(x, torch.arange(B))
    steps: list = []  # (s, y, rho) per past iteration, [B, m], [B, m], [B]; rho = 0 where a row skipped it
    active = size > tol
    if skip is not None:
        active &= ~skip
    iters = torch.zeros(B, dtype=torch.long)
    for _ in range(int(max_iter)):
        if not bool(active.any()):
            break
        q, alphas = g.clone(), []
        for s, y, rho in reversed(steps):
            a = rho * (s * q).sum(1)
            alphas.append(a)
            q -= a[:, None] * y
        # initial Hessian scale: s'y / y'y of the row's last kept step, else a unit-length first step
        gamma = 1.0 / g.norm(dim=1).clamp_min(1.0)
        for s, y, rho in reversed(steps):
            gamma = torch.where(rho > 0, (s * y).sum(1) / (y * y).sum(1).clamp_min(1e-30), gamma)
            break
        q *= gamma[:, None]
        for (s, y, rho), a in zip(steps, reversed(alphas)):
            q += s * (a - rho * (y * q).sum(1))[:, None]
        d = -q
        slope = (g * d).sum(1)
        uphill = slope >= 0  # a stale history: restart that row along the gradient
        if bool(uphill.any()):
            d[uphill] = -g[uphill] / g[uphill].norm(dim=1, keepdim=True).clamp_min(1.0)
            slope = (g * d).sum(1)
        d[~active] = 0.0
        t = torch.ones(B)
        x_new, f_new, g_new, size_new = x.clone(), f.clone(), g.clone(), size.clone()
        trying = active.clone()
        for _ in range(41):  # halve each row's step until it decreases its objective enough
            rows = trying.nonzero()[:, 0]
            x_new[rows] = x[rows] + t[rows, None] * d[rows]
            f_new[rows], g_new[rows], size_new[rows] = fun(x_new[rows], rows)
            trying[rows] = f_new[rows] > f[rows] + 1e-4 * t[rows] * slope[rows]
            if not bool(trying.any()):
                break
            t = torch.where(trying, 0.5 * t, t)
        s, y = x_new - x, g_new - g
        sy = (s * y).sum(1)
        rho = torch.where(active & (sy > 1e-10), 1.0 / sy.clamp_min(1e-30), 0.0)
        steps.append((torch.where(rho[:, None] > 0, s, 0.0), torch.where(rho[:, None] > 0, y, 0.0), rho))
        if len(steps) > history:
            steps.pop(0)
        change = (f - f_new).abs() / f_new.abs().clamp_min(1e-12)
        x, f, g, size = x_new, f_new, g_new, size_new
        iters += active.long()
        active = active & (size > tol) & (change > ftol)
    return x, iters


PLAIN_ITERATIONS = 10  # "rows": iterations in the probe's own weights before the curvature is estimated


def feature_eigenbasis(X: ArrayLike) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues [d] and eigenvectors [d, d] of the covariance of ``X`` [n, d] standardised:
    what ``LogisticProbe.fit_many(solver="rows")`` scales its steps by (pass it as
    ``eigenbasis=`` to reuse it for several calls on the same features)."""
    Z = _features(X)
    Z = (Z - Z.mean(0)) / Z.std(0, unbiased=False).clamp_min(1e-8)
    eigenvalues, vectors = torch.linalg.eigh(Z.T @ Z / len(Z))
    return eigenvalues, vectors


class _CurvatureBasis:
    """A change of variables ``weight = Q (theta / curvature) Vᵀ`` for B logistic probes with K
    classes on d standardised features that makes each objective roughly isotropic (the optimum
    is the same; the steps are better scaled).

    ``V`` [d, d]: the eigenbasis of the features' covariance (eigenvalues λ); ``Q`` [K, K]: an
    orthonormal basis of the classes whose first column is their mean. Problem b's mean
    cross-entropy has a Hessian of about ``c_b · λ`` along each feature direction of the K − 1
    class contrasts, with ``c_b`` [B] its samples' mean ``Σ_k p_k (1 − p_k)`` at the current
    fit, and none along the classes' mean (adding one vector to every class changes no
    probability); the L2 term adds ``1 / (C · n_b)`` everywhere.
    """

    def __init__(self, eigen: tuple[torch.Tensor, torch.Tensor], spread: torch.Tensor, ridge: torch.Tensor, K: int):
        eigenvalues, self.V = eigen
        first = torch.eye(K, dtype=torch.float64)
        first[:, 0] = 1.0
        self.Q = torch.linalg.qr(first)[0].float()  # column 0 is ±1/sqrt(K)
        contrast = torch.ones(K, 1, dtype=torch.float64)
        contrast[0] = 0.0
        curvature = spread.double()[:, None, None] * contrast[None] * eigenvalues.double().clamp_min(0)[None, None]
        self.curvature = (curvature + ridge.double()[:, None, None]).sqrt().float()  # [B, K, d]

    def weight(self, theta: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``theta`` [A, K, d] of problems ``rows`` (default all B) -> weight [A, K, d]."""
        curvature = self.curvature if rows is None else self.curvature[rows]
        return self.Q @ (theta / curvature) @ self.V.T

    def theta(self, weight: torch.Tensor) -> torch.Tensor:
        return (self.Q.T @ weight @ self.V) * self.curvature

    def theta_gradient(self, grad_weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The gradient in ``theta`` [A, K, d] from the gradient in ``weight`` of problems ``rows``."""
        return (self.Q.T @ grad_weight @ self.V) / self.curvature[rows]


# --- probes ---------------------------------------------------------------------------------------


# Below this many feature values a probe's optimisation runs on one thread: its matrices are small, so a
# thread pool's synchronisation costs more than it saves, and on a busy machine its threads wait for cores
# (a layer of four probes on Gemma 3 270M's activations: 4 s on one thread, 36-106 s on two at load 4).
ONE_THREAD_BELOW = 1 << 22


class _OneThread:
    """Context: torch on one thread while inside (for small problems; see :data:`ONE_THREAD_BELOW`)."""

    def __init__(self, small: bool):
        self.small, self.threads = small, torch.get_num_threads()

    def __enter__(self) -> None:
        if self.small:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.small:
            torch.set_num_threads(self.threads)


class _Probe(BaseEstimator, abc.ABC):
    """Shared plumbing: standardisation and the raw-space view of a linear map."""

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
    def fit(self, X: ArrayLike, y: ArrayLike) -> "_Probe": ...

    @abc.abstractmethod
    def score(self, X: ArrayLike, y: ArrayLike) -> float: ...

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
    classes inversely to their frequency (the class-balanced training of Sun, Stolfo & Sachan 2025).
    """

    def __init__(self, C: float = 1.0, max_iter: int = 100, tol: float = 1e-5, class_weight: Optional[str] = None):
        self.C = C
        self.max_iter = max_iter
        self.tol = tol
        self.class_weight = class_weight

    def fit(self, X: ArrayLike, y: ArrayLike) -> "LogisticProbe":
        X = _features(X)
        y = as_targets(y, len(X), integer=True)
        fitted = self.fit_many(X, y[None], torch.ones(1, len(X), dtype=torch.bool))[0]
        vars(self).update({k: v for k, v in fitted.__dict__.items() if k.endswith("_")})
        return self

    def fit_many(self, X: ArrayLike, targets: torch.Tensor, masks: torch.Tensor, *, solver: str = "joint",
                 init: Optional[Sequence[Optional["LogisticProbe"]]] = None,
                 eigenbasis: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> list["LogisticProbe"]:
        """Fit one probe (with these parameters) per row of ``targets`` [B, n] on the samples
        where ``masks`` [B, n] is True, all sharing the features ``X`` [n, d].

        The B problems are independent (each has its own standardisation, classes and weights).
        ``solver="joint"`` solves them as one block-separable L-BFGS run (cross-validation folds
        and controls of a probe sweep cost one optimisation instead of B). ``solver="rows"``
        gives every problem its own L-BFGS (its own history, line search and stopping, each
        after at most ``max_iter`` iterations), all evaluated together in one matrix product per
        step: :func:`lbfgs_rows`. ``init`` (one fitted probe or None per row) starts a row from
        that probe's raw-space solution (a warm start). After :data:`PLAIN_ITERATIONS` steps a
        row still running continues in a basis scaled to its curvature (``_CurvatureBasis``),
        built from ``eigenbasis`` (:func:`feature_eigenbasis` of ``X``; computed when None).
        Returns B fitted probes.
        """
        X = _features(X)
        with _OneThread(X.numel() < ONE_THREAD_BELOW):
            return self._fit_many(X, targets, masks, solver=solver, init=init, eigenbasis=eigenbasis)

    def _fit_many(self, X: torch.Tensor, targets: torch.Tensor, masks: torch.Tensor, *, solver: str,
                  init: Optional[Sequence[Optional["LogisticProbe"]]],
                  eigenbasis: Optional[tuple[torch.Tensor, torch.Tensor]]) -> list["LogisticProbe"]:
        if not self.C > 0:
            raise ConfigError(f"C must be positive (inverse L2 strength), got {self.C!r}")
        if solver not in LOGISTIC_SOLVERS:
            raise ConfigError(f"unknown solver {solver!r}; accepted: {accepted(LOGISTIC_SOLVERS)}")
        targets, masks = to_tensor(targets, "targets").long(), to_tensor(masks, "masks").bool()
        if targets.ndim != 2 or targets.shape != masks.shape or targets.shape[1] != len(X):
            raise AnalysisError(
                f"targets and masks must both be [B, {len(X)}], got {tuple(targets.shape)} and {tuple(masks.shape)}"
            )
        if eigenbasis is not None and (len(eigenbasis) != 2 or tuple(eigenbasis[1].shape) != (X.shape[1],) * 2):
            raise AnalysisError(f"eigenbasis must be (eigenvalues, vectors) of features with {X.shape[1]} columns "
                                "(estimators.feature_eigenbasis(X))")
        if init is not None and len(init) != len(targets):
            raise AnalysisError(f"init must hold one fitted probe (or None) per row of targets ({len(targets)}), "
                                f"got {len(init)}")
        classes = torch.unique(targets[masks])
        index = torch.searchsorted(classes, targets.clamp(classes[0], classes[-1]))
        present = torch.zeros(len(targets), len(classes), dtype=torch.bool)
        present[torch.nonzero(masks)[:, 0], index[masks]] = True
        counts = present.sum(1)
        if (counts < 2).any():
            bad = int(torch.nonzero(counts < 2)[0, 0])
            raise AnalysisError(
                f"a classifier needs at least two classes in y; got only {classes[present[bad]].tolist()}"
            )
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
        start_w, start_b = self._initial(init, classes, mean, scale, X.shape[1])
        with torch.inference_mode(False), torch.enable_grad():  # callers may be in inference mode
            X, index, weights, mean, scale, absent = (t.clone() for t in (X, index, weights, mean, scale, absent))
            total = weights.sum(1)
            B, K, d = len(targets), len(classes), X.shape[1]

            def objective(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                """Each problem's mean weighted cross-entropy and its L2 penalty ([B] each)."""
                raw = weight / scale[:, None, :]  # logits of standardised features, from raw X
                if solver == "joint":
                    logits = torch.einsum("nd,bkd->bnk", X, raw)
                else:  # every problem's classes in one product [n, d] @ [d, B·K]
                    logits = (X @ raw.reshape(B * K, d).T).reshape(-1, B, K).transpose(0, 1)
                logits = logits + (bias - (raw * mean[:, None, :]).sum(-1))[:, None, :]
                loss = F.cross_entropy((logits + absent).transpose(1, 2), index, reduction="none")
                return (loss * weights).sum(1) / total, (weight**2).sum((1, 2)) / (2.0 * self.C * total)

            if solver == "joint":
                weight = start_w.clone().requires_grad_(True)
                bias = start_b.clone().requires_grad_(True)
                optimizer = torch.optim.LBFGS(
                    [weight, bias], lr=1.0, max_iter=int(self.max_iter), tolerance_grad=self.tol,
                    tolerance_change=1e-9, history_size=20, line_search_fn="strong_wolfe",
                )

                def closure():
                    optimizer.zero_grad()
                    data, penalty = objective(weight, bias)
                    loss = data.sum() + penalty.sum()
                    loss.backward()
                    return loss

                optimizer.step(closure)
                n_iter = [int(optimizer.state[optimizer._params[0]].get("n_iter", 0))] * B
                weight, bias = weight.detach(), bias.detach()
            else:
                # one layout for every problem's classes: logits [n, K, B] from one product [n, d] @ [d, K·B]
                # (classes in the middle: a softmax over a short inner axis is several times slower)
                per_row = (weights / total[:, None]).T.contiguous()[:, None, :]  # [n, 1, B]
                target = index.T.contiguous()[:, None, :]  # [n, 1, B]
                shut = absent[:, 0, :].T  # [K, B]
                ridge = 1.0 / (self.C * total)

                def value_grad(weight: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor):
                    """Problems ``rows``' objectives [A] and gradients in ``weight`` [A, K, d] and ``bias``
                    [A, K] (the softmax cross-entropy's gradient in closed form: one product each way)."""
                    A = len(rows)
                    raw = (weight / scale[rows, None, :]).transpose(0, 1)  # [K, A, d] on raw X
                    offset = (bias - (weight * (mean / scale)[rows, None, :]).sum(-1)).T + shut[:, rows]  # [K, A]
                    logp = ((X @ raw.reshape(K * A, d).T).view(-1, K, A) + offset).log_softmax(1)
                    at, w = target[:, :, rows], per_row[:, :, rows]
                    value = -(logp.gather(1, at)[:, 0] * w[:, 0]).sum(0) + (weight**2).sum((1, 2)) * ridge[rows] / 2
                    grad = logp.exp_().scatter_add_(1, at, torch.full_like(at, -1.0, dtype=logp.dtype))
                    grad *= w  # d(mean loss) / d(logits) [n, K, A]
                    grad_offset = grad.sum(0).T  # [A, K]
                    grad_raw = (grad.view(-1, K * A).T @ X).view(K, A, d).transpose(0, 1)
                    grad_raw = grad_raw - grad_offset[:, :, None] * mean[rows, None, :]
                    return value, grad_raw / scale[rows, None, :] + weight * ridge[rows, None, None], grad_offset

                def plain(flat: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                    value, grad_w, grad_b = value_grad(flat[:, : K * d].reshape(-1, K, d), flat[:, K * d:], rows)
                    grad = torch.cat([grad_w.flatten(1), grad_b], 1)
                    return value, grad, grad.abs().amax(1)

                # a few steps in the probe's own weights, then the rest in a basis scaled to the
                # curvature there (each row stops by the same test on its own weights' gradient)
                first = min(PLAIN_ITERATIONS, int(self.max_iter))
                flat, iters = lbfgs_rows(plain, torch.cat([start_w.reshape(B, -1), start_b], 1), max_iter=first,
                                         tol=self.tol)
                weight, bias = flat[:, : K * d].reshape(B, K, d), flat[:, K * d:]
                todo = iters == first
                if int(self.max_iter) > first and bool(todo.any()):
                    raw = weight / scale[:, None, :]
                    logits = torch.einsum("nd,bkd->bnk", X, raw) + (bias - (raw * mean[:, None, :]).sum(-1))[:, None, :]
                    probs = (logits + absent).softmax(-1)
                    spread = ((probs * (1 - probs)).sum(-1) * weights).sum(1) / total
                    if eigenbasis is None:
                        eigenbasis = feature_eigenbasis(X)
                    basis = _CurvatureBasis(eigenbasis, spread, 1.0 / (self.C * total), K)

                    def scaled(theta_flat: torch.Tensor, rows: torch.Tensor):
                        weight = basis.weight(theta_flat[:, : K * d].reshape(-1, K, d), rows)
                        value, grad_w, grad_b = value_grad(weight, theta_flat[:, K * d:], rows)
                        grad = torch.cat([basis.theta_gradient(grad_w, rows).flatten(1), grad_b], 1)
                        return value, grad, torch.maximum(grad_w.abs().amax((1, 2)), grad_b.abs().amax(1))

                    start = torch.cat([basis.theta(weight).reshape(B, -1), bias], 1)
                    theta_flat, more = lbfgs_rows(scaled, start, max_iter=int(self.max_iter) - first, tol=self.tol,
                                                  skip=~todo)
                    weight = torch.where(todo[:, None, None], basis.weight(theta_flat[:, : K * d].reshape(B, K, d)),
                                         weight)
                    bias = torch.where(todo[:, None], theta_flat[:, K * d:], bias)
                    iters = iters + more
                n_iter = iters.tolist()
                weight, bias = weight.detach(), bias.detach()
        probes = []
        for b in range(len(targets)):
            probe = type(self)(**self.get_params())
            probe.classes_ = classes[present[b]]
            probe.mean_, probe.scale_, probe.n_features_in_, probe.n_iter_ = mean[b], scale[b], X.shape[1], n_iter[b]
            probe._set_linear(weight[b, present[b]], bias[b, present[b]])
            probes.append(probe)
        return probes

    @staticmethod
    def _initial(init: Optional[Sequence[Optional["LogisticProbe"]]], classes: torch.Tensor, mean: torch.Tensor,
                 scale: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Starting weights [B, K, d] and biases [B, K] on each problem's standardised features:
        zero, or a fitted probe's raw-space map ``X @ coef_.T + intercept_`` re-expressed there."""
        weight, bias = torch.zeros(len(mean), len(classes), d), torch.zeros(len(mean), len(classes))
        for b, probe in enumerate(init or []):
            if probe is None:
                continue
            if not isinstance(probe, LogisticProbe) or getattr(probe, "n_features_in_", None) != d:
                raise AnalysisError(f"init[{b}] must be a LogisticProbe fitted on {d} features, got {probe!r}")
            at = torch.searchsorted(classes, probe.classes_.clamp(classes[0], classes[-1]))
            keep = classes[at] == probe.classes_  # classes this problem also has
            weight[b, at[keep]] = probe.coef_[keep] * scale[b]
            bias[b, at[keep]] = probe.intercept_[keep] + probe.coef_[keep] @ mean[b]
        return weight, bias

    def decision_function(self, X: ArrayLike) -> torch.Tensor:
        """Logits ``[n, k]``."""
        _check_fitted(self)
        return _features(X, self.n_features_in_) @ self.coef_.T + self.intercept_

    def predict_proba(self, X: ArrayLike) -> torch.Tensor:
        """Class probabilities ``[n, k]`` in the order of ``classes_``."""
        return self.decision_function(X).softmax(-1)

    def predict(self, X: ArrayLike) -> torch.Tensor:
        _check_fitted(self)
        return self.classes_[self.decision_function(X).argmax(-1)]

    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """Accuracy."""
        X = _features(X)
        return float((self.predict(X) == as_targets(y, len(X), integer=True)).float().mean())


class RidgeProbe(_Probe):
    """Ridge regression ``d → t`` in closed form on standardised features; ``score`` is R².

    ``y`` may be ``[n]`` or ``[n, t]``. ``directions_`` [t, d]: unit rows in raw activation space.
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
        X = _features(X)
        y = as_targets(y, len(X), integer=False, allow_2d=True)
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
    """

    def __init__(self, period: int = 10, alpha: float = 1.0):
        self.period = period
        self.alpha = alpha

    def _angles(self, y: torch.Tensor) -> torch.Tensor:
        theta = 2 * math.pi * (y.double() % self.period) / self.period
        return torch.stack([theta.cos(), theta.sin()], dim=1)

    def fit(self, X: ArrayLike, y: ArrayLike) -> "CircularProbe":
        if not (isinstance(self.period, (int, np.integer)) and self.period >= 2):
            raise ConfigError(f"period must be an integer >= 2, got {self.period!r}")
        X = _features(X)
        y = as_targets(y, len(X), integer=True)
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
        y = as_targets(y, len(X), integer=True)
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
        y = as_targets(y, len(X), integer=True)
        classes, y_index = torch.unique(y, return_inverse=True)
        if len(classes) < 2:
            raise AnalysisError(f"a classifier needs at least two classes in y; got only {classes.tolist()}")
        self.classes_ = classes
        generator = torch.Generator().manual_seed(int(self.random_state))
        with torch.inference_mode(False), torch.enable_grad():  # callers may be in inference mode
            y_index = y_index.clone()
            weights = _sample_weights(y_index, len(classes), self.class_weight)
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
        """Class probabilities ``[n, k]`` in the order of ``classes_``."""
        with torch.no_grad():
            return self.net_(self._standardised(X)).softmax(-1)

    def predict(self, X: ArrayLike) -> torch.Tensor:
        _check_fitted(self)
        return self.classes_[self.predict_proba(X).argmax(-1)]

    def score(self, X: ArrayLike, y: ArrayLike) -> float:
        """Accuracy."""
        X = _features(X)
        return float((self.predict(X) == as_targets(y, len(X), integer=True)).float().mean())


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
        """Fit on features ``X`` [n, d] and binary labels ``y`` [n]."""
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
        """``[n, 2]``: P(class 0), P(class 1)."""
        Z = (np.asarray(X, dtype=np.float64) - self.mean_) / self.scale_
        p = 1.0 / (1.0 + np.exp(-(Z @ self.coef_ + self.intercept_)))
        return np.stack([1 - p, p], 1)

    def predict(self, X: Any) -> np.ndarray:
        """``[n]``: 1 where P(class 1) is at least one half."""
        return (self.predict_proba(X)[:, 1] >= 0.5).astype(np.int64)


@checked
def make_probe(kind: str, random_state: Optional[int] = None, **kwargs: Any) -> _Probe:
    """A probe of ``kind`` (``"logistic"``, ``"ridge"``, ``"circular"``, ``"mlp"``) with ``kwargs``.

    ``random_state`` seeds the probes that draw random numbers (``"mlp"``); the linear and circular
    probes are deterministic (full-batch L-BFGS from zero, closed-form ridge) and take no seed.
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
    """Whether ``kind`` predicts discrete labels (scored by accuracy) rather than values (R²)."""
    return kind != "ridge"


Estimator = TypeVar("Estimator")


def clone_estimator(estimator: Estimator) -> Estimator:
    """``sklearn.base.clone``: an unfitted copy of ``estimator`` with the same parameters."""
    # clone is unannotated; its inferred return type is a union of the containers it also copies
    return cast(Estimator, clone(estimator))
