"""Interchange interventions on a subspace: ``f(base, source)`` for the engine to apply.

Every intervention replaces the component of the base activation ``[B, d]`` that lies in a
subspace by the source's component there: ``base + (source - base) Q Qᵀ`` for an orthonormal
basis ``Q [d, k]``.

* :class:`RotatedSubspace` — DAS: ``Q`` is learned, kept orthonormal by an orthogonal
  parametrisation (the first ``k`` rows of a learned rotation; Geiger et al. 2024, as pyvene's
  ``RotatedSpaceIntervention``).
* :class:`BoundlessSubspace` — Boundless DAS (Wu et al. 2023): a full learned rotation and a
  learned soft boundary that selects how many rotated dimensions are interchanged.
* :class:`FixedSubspace` — a given basis: the full vector (``Q = I``), the span of a probe's
  directions, the top principal components, a random rotation of the same ``k``.
* :class:`PerPosition` — one of the above per position, for a variable the model computes at
  several tokens in different directions (each position swaps its own ``k`` dimensions).
"""

from __future__ import annotations

import abc
import math
from typing import Any, Optional

import torch
from torch import nn

from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.types import PositiveInt, checked


def _check_dims(d: int, k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d:
        raise ConfigError(f"k (dimensions interchanged) must be an int in 1..{d} (the site's width), got {k!r}")


@checked
def orthonormal(vectors: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """An orthonormal basis of the span of some vectors.

    Args:
        vectors (Float[Tensor, "m d"]): The vectors, one per row.
        tol: Singular values below ``tol`` × the largest count as zero.

    Returns:
        Float[Tensor, "d r"]: The basis, ``r`` the vectors' rank.

    Raises:
        AnalysisError: ``vectors`` is not 2-D with a row, holds NaN or infinity, or is all zero.
    """
    if vectors.ndim != 2 or vectors.shape[0] == 0:
        raise AnalysisError(f"vectors must be [m, d] with m >= 1, got shape {tuple(vectors.shape)}")
    if not bool(torch.isfinite(vectors).all()):  # the SVD would fail to converge on them
        raise AnalysisError("vectors hold NaN or infinite values; their span is undefined")
    u, s, _ = torch.linalg.svd(vectors.double().T, full_matrices=False)
    rank = int((s > tol * s.max().clamp_min(1e-30)).sum())
    if rank == 0:
        raise AnalysisError("the vectors are all zero; their span is empty")
    return u[:, :rank].float()


class Intervention(nn.Module, abc.ABC):
    """Base class: subclasses give ``basis() [d, k]`` (and may weight its columns by ``mask()``).

    ``meta``: where a subspace read from a file was made (``model``, ``fingerprint``,
    ``architecture``), for the model it is scored on to be checked against; absent otherwise.
    """

    d: int
    meta: dict[str, Any]

    @abc.abstractmethod
    def basis(self) -> torch.Tensor:
        """The interchanged subspace's orthonormal columns ``[d, k]``."""

    def mask(self) -> Optional[torch.Tensor]:
        """Weights of the basis's columns ``[k]`` in the swap, or ``None`` (every column fully)."""
        return None

    def forward(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Swap the subspace from the source into the base (computed in float32: a half-precision
        rotation would lose the small angles training moves).

        Args:
            base (Float[Tensor, "batch d"]): The base run's vectors.
            source (Float[Tensor, "batch d"]): The source run's vectors.

        Returns:
            Float[Tensor, "batch d"]: ``base`` with its component in the subspace replaced by
            ``source``'s, in ``base``'s dtype.
        """
        q = self.basis().float()
        delta = (source.float() - base.float()) @ q
        mask = self.mask()
        if mask is not None:
            delta = delta * mask.float()
        return (base.float() + delta @ q.T).to(base.dtype)

    @property
    def k(self) -> int:
        """The number of dimensions swapped."""
        return int(self.basis().shape[1])


class FixedSubspace(Intervention):
    """A fixed orthonormal basis (the baselines).

    Args:
        basis (Float[Tensor, "d k"]): Orthonormal columns, ``k >= 1``.

    Raises:
        AnalysisError: ``basis`` is not ``[d, k]`` or its columns are not orthonormal.
    """

    def __init__(self, basis: torch.Tensor):
        super().__init__()
        if basis.ndim != 2 or basis.shape[1] < 1:
            raise AnalysisError(f"a basis must be [d, k] with k >= 1, got shape {tuple(basis.shape)}")
        gram = basis.T.double() @ basis.double()
        if not torch.allclose(gram, torch.eye(basis.shape[1], dtype=torch.float64), atol=1e-4):
            raise AnalysisError("a basis must have orthonormal columns; pass it through orthonormal() first")
        self.d = int(basis.shape[0])
        self.register_buffer("q", basis.detach().float().clone())

    def basis(self) -> torch.Tensor:
        q = self.q
        assert isinstance(q, torch.Tensor)
        return q


@checked
def random_subspace(d: PositiveInt, k: PositiveInt, seed: int = 0) -> FixedSubspace:
    """A uniformly random subspace (QR of a seeded Gaussian matrix).

    Args:
        d: The site's width.
        k: The subspace's dimension, in ``1..d``.
        seed: Seeds the Gaussian matrix.

    Returns:
        The subspace, a basis ``[d, k]``.

    Raises:
        AnalysisError: ``k`` outside ``1..d``.
    """
    _check_dims(d, k)
    g = torch.randn(d, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, _ = torch.linalg.qr(g)
    return FixedSubspace(q.float())


@checked
def full_vector(d: PositiveInt) -> FixedSubspace:
    """The whole activation interchanged (``Q = I``): the ceiling of any subspace at this site.

    Args:
        d: The site's width.

    Returns:
        The identity basis ``[d, d]``.
    """
    return FixedSubspace(torch.eye(d))


class RotatedSubspace(Intervention):
    """DAS: a learned orthonormal ``Q [d, k]`` (orthogonal parametrisation).

    Args:
        d: The site's width.
        k: The subspace's dimension, in ``1..d``.
        seed: Seeds the initial rotation (:func:`random_subspace`).

    Raises:
        AnalysisError: ``k`` outside ``1..d``.
    """

    def __init__(self, d: int, k: int, seed: int = 0):
        super().__init__()
        _check_dims(d, k)
        self.d = d
        layer = nn.Linear(k, d, bias=False)
        with torch.no_grad():
            layer.weight.copy_(random_subspace(d, k, seed).basis())
        self.rotate = nn.utils.parametrizations.orthogonal(layer)

    def basis(self) -> torch.Tensor:
        weight = self.rotate.weight
        assert isinstance(weight, torch.Tensor)
        return weight


class BoundlessSubspace(Intervention):
    """Boundless DAS: a learned rotation ``[d, d]`` and a soft boundary over its dimensions.

    Dimension ``i`` of the rotated space is interchanged with weight
    ``sigmoid((boundary - i) / temperature)``; the temperature is annealed by the trainer towards
    a hard boundary, and a penalty on the boundary favours the smallest subspace that works.
    :attr:`k` is the hard boundary (dimensions with weight above one half).

    Args:
        d: The site's width.
        seed: Seeds the initial rotation.
        start: The boundary's initial value (default ``max(1, d / 4)``).
    """

    def __init__(self, d: int, seed: int = 0, start: Optional[float] = None):
        super().__init__()
        self.d = d
        layer = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            layer.weight.copy_(random_subspace(d, d, seed).basis())
        self.rotate = nn.utils.parametrizations.orthogonal(layer)
        self.boundary = nn.Parameter(torch.tensor(float(start if start is not None else max(1.0, d / 4))))
        self.temperature = 1.0

    def basis(self) -> torch.Tensor:
        weight = self.rotate.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def mask(self) -> torch.Tensor:
        """Float[Tensor, "d"]: Each rotated dimension's weight in the swap."""
        index = torch.arange(self.d, dtype=torch.float32, device=self.boundary.device)
        return torch.sigmoid((self.boundary - index) / self.temperature)

    @property
    def k(self) -> int:
        return max(1, int((self.mask() > 0.5).sum()))

    def hard(self) -> FixedSubspace:
        """The subspace the boundary selects, as a fixed basis."""
        return FixedSubspace(self.basis()[:, : self.k].detach())


class PerPosition(Intervention):
    """One interchange per position: ``base``, ``source`` ``[B, P, d]``, position ``p`` swapped
    through ``parts[p]`` (each its own ``k``-dimensional subspace). :meth:`basis` stacks theirs
    ``[P, d, k]``; :attr:`k` is the dimensions swapped at each position.

    Args:
        parts: One interchange per position, at least 2, all of one width.

    Raises:
        AnalysisError: Fewer than 2 parts, or parts of different widths.
    """

    def __init__(self, parts: list[Intervention]):
        super().__init__()
        if len(parts) < 2:
            raise AnalysisError(f"PerPosition needs an interchange for each of at least 2 positions, got {len(parts)}")
        widths = {part.d for part in parts}
        if len(widths) != 1:
            raise AnalysisError(f"the positions' interchanges act on different widths {sorted(widths)}; "
                                "they must share one site")
        self.d = widths.pop()
        self.parts = nn.ModuleList(parts)

    def basis(self) -> torch.Tensor:
        bases = [part.basis() for part in self.parts]  # type: ignore[operator]
        if len({b.shape[1] for b in bases}) != 1:
            raise AnalysisError("the positions' subspaces have different sizes; read each part's basis()")
        return torch.stack(bases)

    def forward(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        if base.ndim != 3 or base.shape[1] != len(self.parts):
            raise AnalysisError(f"a per-position interchange over {len(self.parts)} positions needs [B, "
                                f"{len(self.parts)}, d] activations, got {tuple(base.shape)}")
        return torch.stack([part(base[:, i], source[:, i]) for i, part in enumerate(self.parts)], dim=1)

    @property
    def k(self) -> int:
        return max(part.k for part in self.parts)  # type: ignore[attr-defined]


@checked
def principal_angle_cosines(q1: torch.Tensor, q2: torch.Tensor) -> torch.Tensor:
    """Cosines of the principal angles between two subspaces.

    Args:
        q1 (Float[Tensor, "d k1"]): A basis of the first (orthonormalised here).
        q2 (Float[Tensor, "d k2"]): A basis of the second.

    Returns:
        Float[Tensor, "min_k"]: The cosines, descending; 1 = the subspaces share that direction.

    Raises:
        AnalysisError: Bases that are not 2-D or of different ``d``.
    """
    if q1.ndim != 2 or q2.ndim != 2 or q1.shape[0] != q2.shape[0]:
        raise AnalysisError(f"bases must be [d, k] of the same d, got {tuple(q1.shape)} and {tuple(q2.shape)}")
    s = torch.linalg.svdvals(orthonormal(q1.T).T.double() @ orthonormal(q2.T).double())
    return s.clamp(max=1.0).float()


def anneal(step: int, steps: int, start: float = 1.0, end: float = 0.01) -> float:
    """Geometric temperature schedule from ``start`` to ``end`` over ``steps``."""
    frac = step / max(1, steps - 1)
    return float(math.exp(math.log(start) + frac * (math.log(end) - math.log(start))))
