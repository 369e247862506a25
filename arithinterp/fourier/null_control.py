"""The shuffled-numbers control of a spectrum: the power of data whose number axis is permuted, and
each frequency's permutation p-value against the largest frequency of every shuffle (Zhou et al.
2024 spectra, shuffled-values control)."""

from __future__ import annotations

import torch

from arithinterp.errors import ConfigError
from arithinterp.fourier.basis import fourier_basis


def null_control_p_values(observed: torch.Tensor, null: torch.Tensor) -> torch.Tensor:
    """Permutation p-values of ``observed`` power against ``null``: the share of shuffles (plus one)
    whose *largest* non-constant frequency reaches the observed power, so the test holds over all
    frequencies of a series at once (max statistic).

    Args:
        observed: Power [S, F].
        null: Power of R shuffled copies [R, S, F].

    Returns:
        float64 [S, F] (NaN for the constant).
    """
    largest = null[:, :, 1:].max(-1).values  # [R, S]
    exceed = (largest[:, :, None] >= observed[None]).sum(0)
    p = (1 + exceed).double() / (null.shape[0] + 1)
    p[:, 0] = float("nan")  # the constant is never a key frequency
    return p


def shuffled_power(gram: torch.Tensor, n_shuffles: int, seed: int = 0, chunk: int = 16) -> torch.Tensor:
    """Power per frequency [R, n_freq] of data whose number axis is permuted R times.

    ``gram`` [n, n] is ``X Xᵀ`` of the data ``X`` [n numbers, features] (any number of
    features): permuting the numbers permutes the Gram matrix, and the power of basis row j is
    ``b_j G b_jᵀ``, so no shuffle touches the features (Zhou et al. 2024 spectra, shuffled-values
    control).

    Args:
        gram: ``X Xᵀ`` [n, n].
        n_shuffles: R, the permutations.
        seed: Their seed.
        chunk: Permutations evaluated together.

    Returns:
        float64 [R, n_freq].
    """
    n = gram.shape[0]
    basis = fourier_basis(n)
    generator = torch.Generator().manual_seed(int(seed))
    # G = F Fᵀ with F [n, rank] from G's eigenvectors: b_j P G Pᵀ b_jᵀ = |b_j P F|², so each shuffle
    # costs n²·rank instead of n³ (the rank is at most the data's width). Eigenvalues at rounding level
    # carry no power and are dropped.
    values, vectors = torch.linalg.eigh(gram.double())
    keep = values > values.abs().max().clamp_min(1e-300) * n * torch.finfo(torch.float64).eps
    factor = vectors[:, keep] * values[keep].sqrt()
    out = []
    for start in range(0, n_shuffles, chunk):
        count = min(chunk, n_shuffles - start)
        perms = torch.stack([torch.randperm(n, generator=generator) for _ in range(count)])
        # row m of the shuffled data is number perm⁻¹[m]'s (as the permuted Gram's columns were)
        power = (basis.matrix @ factor[perms.argsort(dim=1)]).square().sum(-1)  # [count, n rows]: |b_j P F|²
        out.append(torch.zeros(count, basis.n_freq, dtype=power.dtype).index_add_(1, basis.freqs, power))
    return torch.cat(out) if out else torch.zeros(0, basis.n_freq, dtype=torch.float64)


def gram(values: torch.Tensor) -> torch.Tensor:
    """``X Xᵀ`` of values (number axis first).

    Args:
        values: [n, ...].

    Returns:
        float64 [n, n].
    """
    flat = values.reshape(values.shape[0], -1).double()
    return flat @ flat.T


def check_null(n_shuffles: int, alpha: float) -> None:
    """Refuse a control that cannot pass any frequency.

    Args:
        n_shuffles: Shuffled copies (0: no control).
        alpha: The test's level.

    Raises:
        ConfigError: ``alpha`` is outside ``[1 / (n_shuffles + 1), 1)`` (``n_shuffles`` is a
            declared :data:`~arithinterp.types.NonNegativeInt` of the public functions that call this).
    """
    if n_shuffles and not (1 / (n_shuffles + 1) <= alpha < 1):
        raise ConfigError(
            f"alpha must be in [1 / (n_shuffles + 1), 1) = [{1 / (n_shuffles + 1):.3g}, 1) so a frequency can pass "
            f"the shuffled-values test; got alpha={alpha!r} with n_shuffles={n_shuffles}"
        )
