"""Fourier features of numbers: DFT bases, spectra, key frequencies, restricted / excluded loss,
frequency filters.

Everything here reads a representation *along a number axis* (rows for the numbers 0..n-1 of a
range) in an orthonormal real Fourier basis and asks how its power splits over frequencies
``k`` (period ``n / k``). Papers followed: Nanda et al. 2023 (the outer-product basis over
``(a, b)``, neuron frequency clusters, restricted / excluded loss and progress measures for
modular addition) and Zhou et al. 2024 (spectra through the logit lens, frequency filters).

Submodules, one concept each (imports flow ``basis`` → ``null_control``, ``number_axes``,
``spectrum_result`` → ``spectra`` → the rest):

* :mod:`~arithinterp.fourier.basis` — :func:`fourier_basis`, the orthonormal real DFT basis
  (the choice of Zhou et al. 2024, as in Nanda et al. 2023): a constant row, then ``cos``/``sin``
  pairs per frequency ``k`` (and a lone ``cos n/2`` row when ``n`` is even); :func:`fourier_2d` on
  both axes of an ``(a, b)`` grid; pure tensor spectra :func:`spectrum_of` / :func:`spectrum_of_2d`;
  :func:`key_frequencies`, the stated rule that picks the frequencies that matter.
* :mod:`~arithinterp.fourier.spectra` — :func:`spectrum` and the named wrappers read spectra from
  a model: number-token embeddings, residual activations over a number axis, component outputs
  through the logit lens (Zhou et al. 2024) and neuron activations over the ``(a, b)`` grid
  (Nanda et al. 2023). All return :class:`SpectrumResult` (:mod:`~arithinterp.fourier.spectrum_result`,
  with the key frequencies); the number axis and per-number activations come from
  :mod:`~arithinterp.fourier.number_axes` (:func:`number_tokens`, :func:`group_by_value`,
  :func:`grid_of`), the shuffled-numbers control from :mod:`~arithinterp.fourier.null_control`.
* :mod:`~arithinterp.fourier.clusters` — :func:`neuron_frequencies`: per neuron, the share of its
  non-constant variance in one frequency block ``{const, cos k, sin k}²`` (Nanda et al. 2023).
* :mod:`~arithinterp.fourier.modular` — :func:`restricted_loss` / :func:`excluded_loss` /
  :func:`progress`: Nanda's progress measures for modular addition over training snapshots.
* :mod:`~arithinterp.fourier.separability` — :func:`separability` / :func:`number_separability`:
  the mod-T linear separability of a representation next to its key periods (Fu et al. 2026), with
  chance, shuffled numbers and a random-init model of the same architecture →
  :class:`SeparabilityResult`.
* :mod:`~arithinterp.fourier.filters` — :func:`frequency_filter`: Zhou's filter ablation, which
  removes a band of frequencies from a component's output during the forward pass and measures
  accuracy and the error distribution.

Every public name is available here, e.g. ``fourier.spectrum(...)``, ``fourier.progress()``.
"""

from arithinterp.fourier.basis import (
    KEY_RULES,
    FourierBasis,
    block_power,
    fourier_2d,
    fourier_basis,
    fourier_basis_2d,
    frequency_periods,
    key_fraction,
    key_frequencies,
    period_label,
    spectrum_of,
    spectrum_of_2d,
)
from arithinterp.fourier.clusters import NeuronFrequencyResult, neuron_clusters, neuron_frequencies
from arithinterp.fourier.filters import BANDS, FilterResult, band_frequencies, filter_projector, frequency_filter
from arithinterp.fourier.modular import (
    ProgressResult,
    excluded_logits,
    excluded_loss,
    full_loss,
    modular_logits,
    modular_losses,
    progress,
    restricted_logits,
    restricted_loss,
    sum_directions,
    sum_frequency_power,
    train_mask,
)
from arithinterp.fourier.separability import (
    SeparabilityResult,
    integer_periods,
    number_representations,
    number_separability,
    separability,
)
from arithinterp.fourier.number_axes import grid_of, group_by_value, number_tokens
from arithinterp.fourier.spectra import (
    COMPONENT_SITES,
    activation_spectrum,
    context_spectrum,
    embedding_spectrum,
    logit_lens_spectrum,
    neuron_spectrum,
    spectrum,
)
from arithinterp.fourier.spectrum_result import SpectrumResult

__all__ = [
    # basis
    "FourierBasis",
    "fourier_basis",
    "fourier_basis_2d",
    "fourier_2d",
    "frequency_periods",
    "period_label",
    "spectrum_of",
    "spectrum_of_2d",
    "block_power",
    "key_frequencies",
    "key_fraction",
    "KEY_RULES",
    # spectra
    "SpectrumResult",
    "number_tokens",
    "group_by_value",
    "grid_of",
    "embedding_spectrum",
    "activation_spectrum",
    "context_spectrum",
    "logit_lens_spectrum",
    "neuron_spectrum",
    "spectrum",
    "COMPONENT_SITES",
    # clusters
    "NeuronFrequencyResult",
    "neuron_frequencies",
    "neuron_clusters",
    # modular
    "sum_directions",
    "restricted_logits",
    "excluded_logits",
    "full_loss",
    "restricted_loss",
    "excluded_loss",
    "sum_frequency_power",
    "modular_logits",
    "train_mask",
    "modular_losses",
    "ProgressResult",
    "progress",
    # separability
    "SeparabilityResult",
    "separability",
    "number_representations",
    "number_separability",
    "integer_periods",
    # filters
    "band_frequencies",
    "filter_projector",
    "FilterResult",
    "frequency_filter",
    "BANDS",
]
