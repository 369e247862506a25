"""The logistic probe: multinomial logistic regression on standardised features, fitted by L-BFGS in torch.

:meth:`LogisticProbe.fit_many` fits many problems on shared features at once, jointly (one
block-separable run) or each with its own L-BFGS (:func:`~arithinterp.probes.lbfgs.lbfgs_rows`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.probes.lbfgs import CurvatureBasis, feature_eigenbasis, lbfgs_rows
from arithinterp.probes.probe_base import (
    ONE_THREAD_BELOW, ArrayLike, ClassifierProbe, OneThread, as_features, as_targets, check_fitted,
    to_tensor,
)

LOGISTIC_SOLVERS = ("joint", "rows")
PLAIN_ITERATIONS = 10  # "rows": iterations in the probe's own weights before the curvature is estimated


class LogisticProbe(ClassifierProbe):
    """Multinomial logistic regression ``d → classes`` (softmax, L2), fitted full batch by L-BFGS.

    Same objective as scikit-learn's ``LogisticRegression(C=C)`` on standardised features, solved
    in torch (seconds for thousands of samples × hundreds of features). ``directions_`` [k, d]:
    one unit row per class (``classes_``), in raw activation space; ``coef_`` / ``intercept_``
    give the raw-space logits ``X @ coef_.T + intercept_``. ``class_weight="balanced"`` reweights
    classes inversely to their frequency (the class-balanced training of Sun, Stolfo & Sachan 2025).

    Args:
        C: Inverse L2 strength (positive).
        max_iter: L-BFGS iterations at most.
        tol: Stop when the gradient is this small.
        class_weight: ``None`` or ``"balanced"``.
    """

    def __init__(self, C: float = 1.0, max_iter: int = 100, tol: float = 1e-5, class_weight: Optional[str] = None):
        self.C = C
        self.max_iter = max_iter
        self.tol = tol
        self.class_weight = class_weight

    def fit(self, X: ArrayLike, y: ArrayLike) -> "LogisticProbe":
        """Fit on features ``X`` [n, d] and labels ``y`` [n].

        Args:
            X: Features [n, d].
            y: Class labels (integers) [n].

        Returns:
            The probe, fitted.

        Raises:
            AnalysisError: ``X`` or ``y`` is refused, or ``y`` has one class.
            ConfigError: ``C`` is not positive or ``class_weight`` is unknown.
        """
        X = as_features(X)
        y = as_targets(y, len(X), integer=True)
        fitted = self.fit_many(X, y[None], torch.ones(1, len(X), dtype=torch.bool))[0]
        vars(self).update({k: v for k, v in fitted.__dict__.items() if k.endswith("_")})
        return self

    def fit_many(self, X: ArrayLike, targets: torch.Tensor, masks: torch.Tensor, *, solver: str = "joint",
                 init: Optional[Sequence[Optional["LogisticProbe"]]] = None,
                 eigenbasis: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> list["LogisticProbe"]:
        """Fit one probe (with these parameters) per row of ``targets`` on the samples its mask
        keeps, all sharing the features ``X``.

        The B problems are independent (each has its own standardisation, classes and weights).
        ``solver="joint"`` solves them as one block-separable L-BFGS run (cross-validation folds
        and controls of a probe sweep cost one optimisation instead of B). ``solver="rows"``
        gives every problem its own L-BFGS (its own history, line search and stopping, each
        after at most ``max_iter`` iterations), all evaluated together in one matrix product per
        step: :func:`~arithinterp.probes.lbfgs.lbfgs_rows`. After :data:`PLAIN_ITERATIONS` steps a
        row still running continues in a basis scaled to its curvature (``CurvatureBasis``).

        Args:
            X: Features [n, d].
            targets: Class labels per problem, long [B, n].
            masks: BoolTensor [B, n], the samples each problem is fitted on.
            solver: ``"joint"`` or ``"rows"``.
            init: One fitted probe or None per row: start that row from the probe's raw-space
                solution (a warm start).
            eigenbasis: :func:`~arithinterp.probes.lbfgs.feature_eigenbasis` of ``X`` (computed when
                None).

        Returns:
            B fitted probes.

        Raises:
            AnalysisError: ``X``, ``targets``, ``masks``, ``init`` or ``eigenbasis`` are refused.
            ConfigError: ``C``, ``solver`` or ``class_weight`` are refused.
        """
        X = as_features(X)
        with OneThread(X.numel() < ONE_THREAD_BELOW):
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
                                "(lbfgs.feature_eigenbasis(X))")
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
                    basis = CurvatureBasis(eigenbasis, spread, 1.0 / (self.C * total), K)

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
        """Logits ``[n, k]``.

        Args:
            X: Features [n, d].

        Returns:
            The raw-space logits [n, k], in the order of ``classes_``.

        Raises:
            NotFittedError: the probe is not fitted.
        """
        check_fitted(self)
        return as_features(X, self.n_features_in_) @ self.coef_.T + self.intercept_

    def predict_proba(self, X: ArrayLike) -> torch.Tensor:
        """Class probabilities ``[n, k]`` in the order of ``classes_``.

        Args:
            X: Features [n, d].

        Returns:
            The probabilities [n, k].
        """
        return self.decision_function(X).softmax(-1)

    def _class_scores(self, X: ArrayLike) -> torch.Tensor:
        return self.decision_function(X)
