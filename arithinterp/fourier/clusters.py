"""Neuron frequency clusters (Nanda et al. 2023).

:func:`neuron_frequencies` gives, per neuron, the share of its non-constant variance over the
``(a, b)`` grid in one frequency block ``{const, cos k, sin k}²``; :func:`neuron_clusters` reads
the neurons of a model. Both return :class:`NeuronFrequencyResult`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.errors import ConfigError
from arithinterp.fourier.basis import pair_power_per_grid, block_power
from arithinterp.fourier.number_axes import grid_activations, number_axis
from arithinterp.results import NON_NEGATIVE, PROBABILITY, Result, build_meta
from arithinterp.types import HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet


# --- neuron frequency clusters -------------------------------------------------------------------


@dataclass(frozen=True)
class NeuronFrequencyResult(Result):
    """Per neuron, how much of its non-constant variance over the ``(a, b)`` grid lies in one
    frequency block ``{const, cos k, sin k}²`` (Nanda et al. 2023).

    A neuron is *clustered* when ``fraction > threshold`` and it is not dead.

    Attributes:
        shares (Float[Tensor, "neuron freq"]): The share of each neuron's non-constant variance in
            block ``k`` (column 0 unused, 0).
        best_k (Int[Tensor, "neuron"]): The block with the largest share.
        fraction (Float[Tensor, "neuron"]): That share.
        dead (Bool[Tensor, "neuron"]): Neurons with (near) zero variance, never clustered.
        threshold: The share a clustered neuron exceeds.
        numbers: ``[start, stop]`` of the number axis.
        meta: Provenance and, with the shuffle control, ``meta["control"]``.
    """

    shares: torch.Tensor
    best_k: torch.Tensor
    fraction: torch.Tensor
    dead: torch.Tensor
    threshold: float
    numbers: list
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"shares": "neuron frequency", "best_k": "neuron", "fraction": "neuron", "dead": "neuron"}
    _legal = {"shares": PROBABILITY, "fraction": PROBABILITY, "best_k": NON_NEGATIVE, "threshold": PROBABILITY}

    @property
    def n(self) -> int:
        """The number of numbers on each grid axis."""
        return int(self.numbers[1] - self.numbers[0])

    @property
    def clustered(self) -> torch.Tensor:
        """Bool[Tensor, "neuron"]: ``fraction > threshold`` and not dead."""
        return (self.fraction > self.threshold) & ~self.dead

    @property
    def clustered_fraction(self) -> float:
        """Share of all neurons that are clustered (dead neurons count as not clustered)."""
        return float(self.clustered.float().mean())

    def cluster_sizes(self) -> dict[int, int]:
        """Number of clustered neurons per frequency ``k``."""
        ks = self.best_k[self.clustered].tolist()
        return {k: ks.count(k) for k in sorted(set(ks))}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(
            dict(neuron=range(len(self.best_k)), best_k=self.best_k.tolist(),
                 period=[self.n / k if k else math.inf for k in self.best_k.tolist()],
                 fraction=self.fraction.tolist(), clustered=self.clustered.tolist(), dead=self.dead.tolist())
        )

    def plot(self, **kwargs):
        return draw(self, **kwargs)


def _block_shares(grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Share of each neuron's non-constant power in each block [m, n_freq], and dead [m]."""
    pair = pair_power_per_grid(grids)
    total = pair.flatten(1).sum(1) - pair[:, 0, 0]
    dead = total <= 1e-12 * pair.flatten(1).sum(1).clamp_min(1e-300)
    shares = block_power(pair) / total.clamp_min(1e-300)[:, None]
    shares[dead] = 0.0
    return shares, dead


@checked
def neuron_frequencies(
    grids: torch.Tensor,
    threshold: float = 0.85,
    *,
    numbers: Optional[range] = None,
    meta: Optional[dict] = None,
    shuffle_control: bool = True,
    seed: int = 0,
) -> NeuronFrequencyResult:
    """Frequency clusters of neuron activation grids.

    For each neuron, the share of its non-constant variance (total power minus the
    constant·constant coefficient) in each block ``{const, cos k, sin k}²`` (:func:`block_power`),
    the best ``k`` and its share (Nanda et al. 2023: 433 / 512 neurons above 0.85).

    Args:
        grids (Float[Tensor, "neuron n n"]): Each neuron's activation over the ``(a, b)`` grid.
        threshold: The share a clustered neuron exceeds, in (0, 1).
        numbers: The number axis (default ``range(n)``).
        meta: The result's meta (default: provenance and the neuron count).
        shuffle_control: Add ``meta["control"]``: what the same rule finds on cell-shuffled grids
            (each neuron's cells permuted by its own seeded permutation), the fraction of neurons
            clustered and the 95th percentile of their best share.
        seed: Seeds the shuffle.

    Returns:
        The shares, best frequency and clustering of each neuron.

    Raises:
        ConfigError: ``threshold`` is outside (0, 1).
    """
    if not 0 < threshold < 1:
        raise ConfigError(f"threshold must be in (0, 1), got {threshold}")
    grids = grids.double()
    shares, dead = _block_shares(grids)
    fraction, best_k = shares.max(1)
    numbers = numbers or range(grids.shape[-1])
    meta = dict(meta or build_meta(n_neurons=grids.shape[0]))
    if shuffle_control:
        m, n = grids.shape[0], grids.shape[-1]
        order = torch.rand(m, n * n, generator=torch.Generator().manual_seed(int(seed))).argsort(1)
        null_shares, null_dead = _block_shares(grids.reshape(m, -1).gather(1, order).reshape(m, n, n))
        null_best = null_shares.max(1).values
        meta["control"] = dict(
            null="cell-shuffled grids: each neuron's cells permuted", threshold=float(threshold),
            clustered_fraction=float(((null_best > threshold) & ~null_dead).float().mean()),
            best_share_q95=float(torch.quantile(null_best[~null_dead], 0.95)) if (~null_dead).any() else None,
        )
    return NeuronFrequencyResult(
        shares=shares.float(), best_k=best_k, fraction=fraction.float(), dead=dead, threshold=float(threshold),
        numbers=[numbers.start, numbers.stop], meta=meta,
    )


@checked
def neuron_clusters(model: HookedModel, prompts: PromptSet, layer: int = 0, numbers: Union[int, range, None] = None, *,
                    site: str = "mlp_post", threshold: float = 0.85, batch_size: int = 1024,
                    progress: bool = True) -> NeuronFrequencyResult:
    """:func:`neuron_frequencies` of a model's MLP neurons at the final position over the
    ``(a, b)`` grid of the prompts.

    Args:
        model: The hooked model.
        prompts: Prompts that cover ``numbers × numbers`` once.
        layer: The MLP's layer.
        numbers: The number axis (default ``range(max(a) + 1)``).
        site: ``"mlp_post"`` or ``"mlp_pre"``.
        threshold: The share a clustered neuron exceeds.
        batch_size: Prompts per forward.
        progress: Show a progress bar.

    Returns:
        The neurons' frequency clusters.

    Raises:
        AnalysisError: The prompts do not cover the grid once.
        ModelMismatchError: The prompts were built for another model.
    """
    check_belongs(model, "fourier.neuron_clusters", prompts=prompts)
    numbers = number_axis(numbers, int(prompts.a.max()) + 1)
    grids = grid_activations(model, prompts, layer, site, numbers, batch_size, progress)
    return neuron_frequencies(grids, threshold, numbers=numbers,
                              meta=build_meta(model, layer=layer, site=site, n_neurons=grids.shape[0]))
