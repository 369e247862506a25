"""Neuron frequency clusters (Nanda et al. 2023).

:func:`neuron_frequencies` gives, per neuron, the share of its non-constant variance over the
``(a, b)`` grid in one frequency block ``{const, cos k, sin k}²``; :func:`neuron_clusters` reads
the neurons of a model. Both return :class:`NeuronFrequencyResult`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from arithinterp.errors import ConfigError
from arithinterp.fourier.basis import _pair_power, block_power
from arithinterp.fourier.spectra import _grid_activations, _numbers
from arithinterp.results import Result, build_meta


# --- neuron frequency clusters -------------------------------------------------------------------


@dataclass(frozen=True)
class NeuronFrequencyResult(Result):
    """Per neuron, how much of its non-constant variance over the ``(a, b)`` grid lies in one
    frequency block ``{const, cos k, sin k}²`` (Nanda et al. 2023).

    ``shares`` [m, n_freq]: share of neuron ``i``'s non-constant variance in block ``k``
    (column 0 unused, 0); ``best_k`` [m] the block with the largest share, ``fraction`` [m]
    that share; a neuron is *clustered* when ``fraction > threshold``. ``dead`` [m] marks
    neurons with (near) zero variance, which are never clustered.
    """

    shares: torch.Tensor
    best_k: torch.Tensor
    fraction: torch.Tensor
    dead: torch.Tensor
    threshold: float
    numbers: list
    meta: dict

    @property
    def n(self) -> int:
        return int(self.numbers[1] - self.numbers[0])

    @property
    def clustered(self) -> torch.Tensor:
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
        from arithinterp.viz.fourier import neuron_frequency_figure

        return neuron_frequency_figure(self, **kwargs)


def neuron_frequencies(grids: torch.Tensor, threshold: float = 0.85, *, numbers: Optional[range] = None,
                       meta: Optional[dict] = None) -> NeuronFrequencyResult:
    """Frequency clusters of neuron activation grids [m, n, n] (axes: neuron, a, b).

    For each neuron, the share of its non-constant variance (total power minus the
    constant·constant coefficient) in each block ``{const, cos k, sin k}²`` (:func:`block_power`),
    the best ``k`` and its share (Nanda et al. 2023: 433 / 512 neurons above 0.85).
    """
    if not 0 < threshold < 1:
        raise ConfigError(f"threshold must be in (0, 1), got {threshold}")
    pair = _pair_power(grids.double())
    total = pair.flatten(1).sum(1) - pair[:, 0, 0]
    dead = total <= 1e-12 * pair.flatten(1).sum(1).clamp_min(1e-300)
    shares = block_power(pair) / total.clamp_min(1e-300)[:, None]
    shares[dead] = 0.0
    fraction, best_k = shares.max(1)
    numbers = numbers or range(grids.shape[-1])
    return NeuronFrequencyResult(
        shares=shares.float(), best_k=best_k, fraction=fraction.float(), dead=dead, threshold=float(threshold),
        numbers=[numbers.start, numbers.stop], meta=meta or build_meta(n_neurons=grids.shape[0]),
    )


def neuron_clusters(model: Any, prompts: Any, layer: int = 0, numbers: Union[int, range, None] = None, *,
                    site: str = "mlp_post", threshold: float = 0.85, batch_size: int = 1024,
                    progress: bool = True) -> NeuronFrequencyResult:
    """:func:`neuron_frequencies` of a model's MLP neurons at the final position over the
    ``(a, b)`` grid of ``prompts`` (which must cover ``numbers × numbers`` once)."""
    numbers = _numbers(numbers, int(prompts.a.max()) + 1)
    grids = _grid_activations(model, prompts, layer, site, numbers, batch_size, progress)
    return neuron_frequencies(grids, threshold, numbers=numbers,
                              meta=build_meta(model, layer=layer, site=site, n_neurons=grids.shape[0]))
