"""One L-BFGS per row, evaluated together: :func:`lbfgs_rows`, and the curvature-scaled basis it steps in.

Many small logistic problems (a probe per fold, control and target) are solved side by side, each
with its own history, line search and stopping, in one matrix product per step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from arithinterp.probes.probe_base import ArrayLike, as_features


def lbfgs_rows(fun: Any, x0: torch.Tensor, max_iter: int = 100, tol: float = 1e-5, history: int = 20,
               ftol: float = 1e-9, skip: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise B independent problems at once.

    Every row runs its own L-BFGS (Nocedal & Wright 2006, Alg. 7.4/7.5: the two-loop recursion
    over the row's last ``history`` steps and a backtracking Armijo line search), so a row's
    path does not depend on the others; only the evaluations are shared, one call of ``fun``
    for the rows still running per trial step (one matrix product for many probes; a row that
    has stopped, or has already accepted its step, is not evaluated again).

    Args:
        fun: ``fun(x [A, m], rows [A]) -> (f [A], grad [A, m], size [A])`` evaluates the problems
            ``rows`` (indices into the B) at ``x``; ``size`` is the gradient's size that the
            stopping test compares with ``tol``.
        x0: The starting points [B, m].
        max_iter: A row stops after this many iterations.
        tol: A row stops when its gradient's ``size`` is at most this.
        history: Past steps the two-loop recursion uses.
        ftol: A row stops when its objective changes by at most this (relative).
        skip: BoolTensor [B], rows that do not move.

    Returns:
        ``(solutions [B, m], iterations [B])``.
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


def feature_eigenbasis(X: ArrayLike) -> tuple[torch.Tensor, torch.Tensor]:
    """The eigenbasis of the covariance of standardised features: what
    ``LogisticProbe.fit_many(solver="rows")`` scales its steps by (pass it as ``eigenbasis=`` to
    reuse it for several calls on the same features).

    Args:
        X: Features [n, d].

    Returns:
        ``(eigenvalues [d], eigenvectors [d, d])``.

    Raises:
        AnalysisError: ``X`` is not finite 2-d features.
    """
    Z = as_features(X)
    Z = (Z - Z.mean(0)) / Z.std(0, unbiased=False).clamp_min(1e-8)
    eigenvalues, vectors = torch.linalg.eigh(Z.T @ Z / len(Z))
    return eigenvalues, vectors


class CurvatureBasis:
    """A change of variables ``weight = Q (theta / curvature) Vᵀ`` for B logistic probes with K
    classes on d standardised features that makes each objective roughly isotropic (the optimum
    is the same; the steps are better scaled).

    ``V`` [d, d]: the eigenbasis of the features' covariance (eigenvalues λ); ``Q`` [K, K]: an
    orthonormal basis of the classes whose first column is their mean. Problem b's mean
    cross-entropy has a Hessian of about ``c_b · λ`` along each feature direction of the K − 1
    class contrasts, with ``c_b`` [B] its samples' mean ``Σ_k p_k (1 − p_k)`` at the current
    fit, and none along the classes' mean (adding one vector to every class changes no
    probability); the L2 term adds ``1 / (C · n_b)`` everywhere.

    Args:
        eigen: :func:`feature_eigenbasis` of the features.
        spread: ``c_b`` per problem, [B].
        ridge: The L2 term per problem, [B].
        K: The number of classes.
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
        """The weights of ``theta``.

        Args:
            theta: [A, K, d] of problems ``rows``.
            rows: The problems, long [A] (default all B).

        Returns:
            weight [A, K, d].
        """
        curvature = self.curvature if rows is None else self.curvature[rows]
        return self.Q @ (theta / curvature) @ self.V.T

    def theta(self, weight: torch.Tensor) -> torch.Tensor:
        """The coordinates of ``weight`` in the scaled basis (every problem).

        Args:
            weight: [B, K, d].

        Returns:
            theta [B, K, d].
        """
        return (self.Q.T @ weight @ self.V) * self.curvature

    def theta_gradient(self, grad_weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The gradient in ``theta`` from the gradient in ``weight`` of problems ``rows``.

        Args:
            grad_weight: [A, K, d].
            rows: The problems, long [A].

        Returns:
            The gradient in theta [A, K, d].
        """
        return (self.Q.T @ grad_weight @ self.V) / self.curvature[rows]
