"""The orthonormal real Fourier basis over a number axis and the power spectra of plain tensors.

A representation *along a number axis* (rows for the numbers 0..n-1 of a range) is read in the
basis and its power split over frequencies ``k`` (period ``n / k``); no model is involved.

* :func:`fourier_basis` — the orthonormal real DFT basis (the choice of Zhou et al. 2024, as in Nanda et al.
  2023): a constant row, then ``cos``/``sin`` pairs per frequency ``k`` (and a lone ``cos n/2`` row when ``n`` is even).
  :func:`fourier_2d` applies it on both axes of an ``(a, b)`` grid (the outer-product basis of
  Nanda et al. 2023).
* :func:`spectrum_of` / :func:`spectrum_of_2d` / :func:`block_power` — power per frequency,
  frequency pair and frequency block of tensors.
* :func:`key_frequencies` — the stated rule that picks the frequencies that matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.types import checked

KEY_RULES = ("median", "fraction")


# --- the basis ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FourierBasis:
    """The orthonormal real DFT basis over ``n`` consecutive numbers.

    Coefficients of a signal ``x`` ``[n, ...]`` are ``matrix @ x``.

    Attributes:
        matrix (Float[Tensor, "n n"]): One basis vector per row (``matrix @ matrix.T == I``).
        labels: The name of each row: ``"const"``, ``"cos 3"``, ``"sin 3"``.
        freqs (Int[Tensor, "n"]): The frequency of each row (0 for the constant).
    """

    matrix: torch.Tensor
    labels: list[str]
    freqs: torch.Tensor

    @property
    def n(self) -> int:
        """The number of numbers on the axis."""
        return self.matrix.shape[0]

    @property
    def n_freq(self) -> int:
        """The number of frequencies, ``n // 2 + 1`` (the constant included)."""
        return self.n // 2 + 1


def number_axis_size(n: Union[int, range, Sequence[int]]) -> int:
    """The size of a number axis: an int, or a range / list of consecutive numbers."""
    if isinstance(n, bool):
        raise AnalysisError(f"n must be an int, a range or a list of consecutive numbers, got {n!r}")
    if isinstance(n, int):
        size = int(n)
    elif isinstance(n, range) and n.step == 1:
        size = len(n)  # consecutive by construction, and never listed (it may be huge)
    else:
        values = list(n)
        if values and any(b - a != 1 for a, b in zip(values, values[1:])):
            raise AnalysisError(
                "a Fourier basis needs consecutive numbers (a range with step 1); "
                f"got {values[:5]}{'...' if len(values) > 5 else ''}"
            )
        size = len(values)
    if size < 2:
        raise AnalysisError(f"a Fourier basis needs at least 2 numbers, got {size}")
    return size


def check_basis_fits(size: int, dims: int = 2, dtype: torch.dtype = torch.float64) -> None:
    """Refuse, before it is built, a basis over ``size`` numbers whose ``size ** dims`` values would not fit
    in half the memory the machine has available now (8 GiB where that cannot be read).

    Args:
        size: The numbers on the axis.
        dims: 2 for :func:`fourier_basis` (``[n, n]``, and the ``[n, n]`` Gram matrix of a spectrum's
            control), 4 for :func:`fourier_basis_2d`.
        dtype: The basis's dtype.

    Raises:
        ConfigError: The basis would not fit.
    """
    from arithinterp.engine.budget import available_bytes

    need = size**dims * torch.empty(0, dtype=dtype).element_size()
    free = available_bytes()
    budget = free // 2 if free is not None else 8 * 2**30
    if need > budget:
        fits = math.isqrt(budget // torch.empty(0, dtype=dtype).element_size()) if dims == 2 else None
        raise ConfigError(f"a Fourier basis over {size:,} numbers takes {need / 2**30:,.3g} GiB ({size:,}^{dims} "
                          f"values), more than the {budget / 2**30:,.3g} GiB half of this machine's available memory "
                          f"allows" + (f"; use at most {fits:,} numbers" if fits else "; use fewer numbers"))


@checked
def fourier_basis(n: Union[int, range, Sequence[int]], *, dtype: torch.dtype = torch.float64) -> FourierBasis:
    """The orthonormal real DFT basis over ``n`` numbers (an int or a range of consecutive ints).

    Rows: constant ``1/√n``; for ``k = 1 .. ⌈n/2⌉-1`` the pair ``√(2/n)·cos(2πkx/n)``,
    ``√(2/n)·sin(2πkx/n)``; for even ``n`` one last row ``cos(πx)/√n`` (its sine is zero).
    ``x`` counts from the start of the range (a shift changes phases, never powers).
    Zhou et al. 2024 *(choice)* and Nanda et al. 2023.

    Args:
        n: The number of numbers, or a range / list of consecutive ints.
        dtype: The basis's dtype.

    Returns:
        The basis, ``matrix`` ``[n, n]``.

    Raises:
        AnalysisError: Fewer than 2 numbers, or numbers that are not consecutive.
        ConfigError: A basis that does not fit in memory (:func:`check_basis_fits`).
    """
    size = number_axis_size(n)
    check_basis_fits(size, 2, dtype)
    x = torch.arange(size, dtype=dtype)
    ks = torch.arange(1, (size - 1) // 2 + 1, dtype=dtype)
    angle = 2 * math.pi * ks[:, None] * x[None, :] / size
    pairs = torch.stack([angle.cos(), angle.sin()], dim=1).reshape(-1, size) * math.sqrt(2 / size)
    rows = [torch.full((1, size), 1 / math.sqrt(size), dtype=dtype), pairs]
    labels = ["const"] + [f"{t} {k}" for k in range(1, len(ks) + 1) for t in ("cos", "sin")]
    freqs = [0] + [k for k in range(1, len(ks) + 1) for _ in range(2)]
    if size % 2 == 0:
        rows.append((math.pi * x).cos()[None, :] / math.sqrt(size))
        labels.append(f"cos {size // 2}")
        freqs.append(size // 2)
    return FourierBasis(torch.cat(rows), labels, torch.tensor(freqs))


@checked
def fourier_basis_2d(n: Union[int, range, Sequence[int]], *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The 2-D basis over an ``n × n`` grid as the outer product (Nanda et al. 2023). Memory grows
    as n⁴; use :func:`fourier_2d` to transform grids without building it.

    Args:
        n: The number of numbers per axis, or a range / list of consecutive ints.
        dtype: The basis's dtype.

    Returns:
        Float[Tensor, "n n n n"]: ``out[i, j]`` is the grid ``basis[i] ⊗ basis[j]``.

    Raises:
        AnalysisError: Fewer than 2 numbers, or numbers that are not consecutive.
        ConfigError: A basis that does not fit in memory (:func:`check_basis_fits`).
    """
    check_basis_fits(number_axis_size(n), 4, dtype)
    basis = fourier_basis(n, dtype=dtype).matrix
    return torch.einsum("ia,jb->ijab", basis, basis)


@checked
def fourier_2d(grid: Float[Tensor, "*batch n n"], basis: Optional[FourierBasis] = None) -> Float[Tensor, "*batch n n"]:
    """2-D Fourier coefficients ``F · grid · Fᵀ`` of grids.

    Args:
        grid: Grids, the last two axes ``a`` and ``b``.
        basis: The basis over ``n`` (default: :func:`fourier_basis` of ``n``).

    Returns:
        The coefficients, in the basis's dtype.

    Raises:
        AnalysisError: The last two axes are not square.
    """
    if grid.ndim < 2 or grid.shape[-1] != grid.shape[-2]:
        raise AnalysisError(f"a 2-D Fourier transform needs square grids [..., n, n], got shape {tuple(grid.shape)}")
    basis = basis or fourier_basis(grid.shape[-1])
    matrix = basis.matrix.to(grid.device)
    return matrix @ grid.to(matrix.dtype) @ matrix.T


@checked
def frequency_periods(n: int) -> list[float]:
    """The period of each frequency.

    Args:
        n: The number of numbers on the axis.

    Returns:
        ``n / k`` for ``k = 0 .. n // 2`` (``inf`` for the constant).
    """
    return [math.inf] + [n / k for k in range(1, n // 2 + 1)]


@checked
def period_label(n: int, k: int) -> str:
    """A readable period of a frequency.

    Args:
        n: The number of numbers on the axis.
        k: The frequency.

    Returns:
        ``"const"`` for 0, ``"10"`` for a whole period, ``"113/14 ≈ 8.07"`` otherwise.
    """
    if k == 0:
        return "const"
    if n % k == 0:
        return str(n // k)
    return f"{n}/{k} ≈ {n / k:.3g}"


def _freq_power(coefficients: torch.Tensor, freqs: torch.Tensor, n_freq: int) -> torch.Tensor:
    """Sum squared coefficients [n, ...] (axis 0 = basis rows) into frequencies [n_freq, ...]."""
    squared = coefficients.pow(2)
    out = torch.zeros((n_freq, *squared.shape[1:]), dtype=squared.dtype, device=squared.device)
    return out.index_add_(0, freqs.to(squared.device), squared)


# --- pure spectra -------------------------------------------------------------------------------


@checked
def spectrum_of(values: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Power per frequency of ``values`` along its number axis ``dim``.

    Args:
        values (Float[Tensor, "... n ..."]): The numbers 0..n-1 (of a range) along ``dim``; every
            other axis (features, prompts) is summed over.
        dim: The number axis.

    Returns:
        Float[Tensor, "freq"]: ``n // 2 + 1`` powers (float64), index ``k`` = frequency ``k``
        (0 = the constant, i.e. ``n · |mean|²``); they sum to ``‖values‖²`` (Parseval).

    Raises:
        AnalysisError: ``values`` is not a tensor, ``dim`` is out of range, or the axis has fewer
            than 2 numbers.
    """
    if not isinstance(values, torch.Tensor) or values.ndim < 1:
        raise AnalysisError(f"values must be a tensor with a number axis, got {type(values).__name__}")
    if not -values.ndim <= dim < values.ndim:
        raise AnalysisError(f"dim {dim} is out of range for a tensor of shape {tuple(values.shape)}")
    moved = values.movedim(dim, 0)
    basis = fourier_basis(moved.shape[0])
    coefficients = basis.matrix.to(values.device) @ moved.reshape(moved.shape[0], -1).to(torch.float64)
    return _freq_power(coefficients, basis.freqs, basis.n_freq).sum(-1)


@checked
def spectrum_of_2d(grids: Float[Tensor, "*batch n n"]) -> Float[Tensor, "freq freq"]:
    """Power per frequency pair of grids [..., n, n] (axes a, b), summed over leading axes.

    Args:
        grids: Grids, the last two axes ``a`` and ``b``.

    Returns:
        Entry ``[ka, kb]`` is the power in the basis grids of frequency ``ka`` along a and ``kb``
        along b (Nanda et al. 2023, 2-D outer-product basis); ``freq = n // 2 + 1``.

    Raises:
        AnalysisError: The last two axes are not square.
    """
    return pair_power_per_grid(grids.reshape(-1, *grids.shape[-2:])).sum(0)


def pair_power_per_grid(grids: Float[Tensor, "m n n"]) -> Float[Tensor, "m freq freq"]:
    """[m, n, n] grids → [m, F, F] power per frequency pair."""
    if grids.ndim != 3 or grids.shape[-1] != grids.shape[-2]:
        raise AnalysisError(f"grids must be [m, n, n], got shape {tuple(grids.shape)}")
    basis = fourier_basis(grids.shape[-1])
    squared = fourier_2d(grids, basis).pow(2)
    n_freq, freqs = basis.n_freq, basis.freqs.to(grids.device)
    rows = torch.zeros((grids.shape[0], n_freq, grids.shape[-1]), dtype=squared.dtype, device=grids.device)
    rows.index_add_(1, freqs, squared)
    out = torch.zeros((grids.shape[0], n_freq, n_freq), dtype=squared.dtype, device=grids.device)
    return out.index_add_(2, freqs, rows)


@checked
def block_power(pair_power: Float[Tensor, "*batch freq freq"]) -> Float[Tensor, "*batch freq"]:
    """Power of each frequency block ``{const, cos k, sin k}²`` minus the constant·constant cell.

    Args:
        pair_power: Power per frequency pair (from :func:`spectrum_of_2d`).

    Returns:
        Entry 0 is 0 and entry ``k ≥ 1`` is ``P[0, k] + P[k, 0] + P[k, k]`` (Nanda et al. 2023's
        3×3 neuron block).
    """
    diagonal = pair_power.diagonal(dim1=-2, dim2=-1).clone()
    blocks = diagonal + pair_power[..., 0, :] + pair_power[..., :, 0]
    blocks[..., 0] = 0.0
    return blocks


@checked
def key_frequencies(
    power: torch.Tensor,
    rule: str = "median",
    *,
    factor: float = 10.0,
    fraction: float = 0.9,
) -> list[int]:
    """The key frequencies of a power spectrum [n_freq] (index ``k``; the constant is ignored).

    Rules:

    * ``"median"`` (default): every ``k ≥ 1`` whose power exceeds ``factor`` × the median power
      of the non-constant frequencies (the median floored at 1e-8 of the non-constant power, so
      rounding error in an exactly periodic signal does not count). Pure noise almost never has
      such outliers (for a single Gaussian noise vector the chance per frequency is about
      ``exp(-0.69·factor)``), so noise yields none; a few planted or learned frequencies stand
      far above the median.
    * ``"fraction"``: the smallest set of the strongest frequencies whose power reaches
      ``fraction`` of the non-constant power (always non-empty; near-uniform noise needs most
      frequencies to reach it).

    Args:
        power (Float[Tensor, "freq"]): A power spectrum (:func:`spectrum_of`).
        rule: ``"median"`` or ``"fraction"``.
        factor: The ``"median"`` rule's multiple of the median.
        fraction: The ``"fraction"`` rule's share of the non-constant power, in (0, 1].

    Returns:
        The chosen ``k``, sorted by decreasing power (empty when there is no non-constant power).

    Raises:
        ConfigError: An unknown rule, ``factor <= 0`` or ``fraction`` outside (0, 1].
        AnalysisError: ``power`` is not 1-D with at least 2 entries.
    """
    if rule not in KEY_RULES:
        raise ConfigError(f"unknown key-frequency rule {rule!r}; accepted: {accepted(KEY_RULES)}")
    if not isinstance(power, torch.Tensor) or power.ndim != 1 or power.shape[0] < 2:
        raise AnalysisError(f"power must be a 1-D tensor [n_freq ≥ 2], got {getattr(power, 'shape', power)}")
    if factor <= 0 or not 0 < fraction <= 1:
        raise ConfigError(f"factor must be > 0 and fraction in (0, 1]; got factor={factor}, fraction={fraction}")
    tail = power[1:].double()
    order = tail.argsort(descending=True)
    if tail.sum() <= 0:
        return []
    if rule == "median":
        # the floor keeps float rounding in an exactly periodic signal from counting as power
        floor = max(float(tail.median()), 1e-8 * float(tail.sum()))
        chosen = order[tail[order] > factor * floor]
    else:
        cumulative = tail[order].cumsum(0) / tail.sum()
        count = int((cumulative < fraction - 1e-12).sum()) + 1
        chosen = order[:count]
    return [int(k) + 1 for k in chosen]


@checked
def key_fraction(power: Float[Tensor, " freq"], key: Iterable[int]) -> float:
    """The share of the non-constant power in some frequencies.

    Args:
        power: A power spectrum.
        key: The frequencies (``k ≥ 1``).

    Returns:
        Their share, in [0, 1]; 0 when ``key`` is empty or there is no non-constant power.
    """
    key = list(key)  # once: ``key`` may be a generator
    total = float(power[1:].sum())
    return float(power[key].sum()) / total if total > 0 and key else 0.0
