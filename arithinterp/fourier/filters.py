"""Frequency filters (Zhou et al. 2024).

:func:`frequency_filter` removes a band of frequencies (:func:`band_frequencies`) from a
component's output during the forward pass, through the projector of :func:`filter_projector`,
and measures accuracy and the error distribution (:class:`FilterResult`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

import torch

from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.engine import Write
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.fourier.basis import fourier_basis
from arithinterp.fourier.number_axes import number_axis, number_tokens
from arithinterp.fourier.spectra import COMPONENT_SITES
from arithinterp.intervals import ratio_to_reference
from arithinterp.results import NON_NEGATIVE, PROBABILITY, Result, build_meta
from arithinterp.types import IntList, HookedModel, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

BANDS = ("low", "high")


# --- frequency filter (Zhou et al. 2024) --------------------------------------------------------


@checked
def band_frequencies(n: int, band: Union[str, IntList], split_period: float = 10.0) -> list[int]:
    """The frequencies of a band over ``n`` numbers. The constant (``k = 0``) is never in a band.

    Args:
        n: The number of numbers on the axis.
        band: ``"low"`` (period ``n / k`` above ``split_period``), ``"high"`` (period at most
            ``split_period``), or explicit frequencies ``1..n // 2``.
        split_period: The period that splits low from high.

    Returns:
        The band's frequencies ``k``, ascending.

    Raises:
        ConfigError: An unknown band name, or explicit frequencies that are empty or out of range.
    """
    if isinstance(band, str):
        if band not in BANDS:
            raise ConfigError(f"unknown band {band!r}; accepted: {accepted(BANDS)} or a list of frequencies")
        ks = range(1, n // 2 + 1)
        return [k for k in ks if (n / k > split_period) == (band == "low")]
    ks = sorted({int(k) for k in band})
    bad = [k for k in ks if not 1 <= k <= n // 2]
    if bad or not ks:
        raise ConfigError(f"band frequencies {bad or ks} are invalid; accepted: 1..{n // 2} (non-empty)")
    return ks


@checked
def filter_projector(unembed: torch.Tensor, freqs: Iterable[int]) -> torch.Tensor:
    """[d, d] projector onto the null space of ``M = B·F·unembedᵀ`` (Zhou et al. 2024).

    ``F`` is the Fourier basis over the numbers and ``B`` selects the rows of frequencies
    ``freqs``. For any ``h``, the logit lens of ``h @ P`` onto the numbers has no power at ``freqs``.

    Args:
        unembed (Float[Tensor, "d n"]): The unembedding columns of the numbers 0..n-1 of the axis.
        freqs: The frequencies to remove.

    Returns:
        Float[Tensor, "d d"]: The projector ``P`` (float64).

    Raises:
        AnalysisError: ``unembed`` is not 2-D.
    """
    if unembed.ndim != 2:
        raise AnalysisError(f"unembed must be [d, n], got shape {tuple(unembed.shape)}")
    basis = fourier_basis(unembed.shape[1])
    rows = torch.isin(basis.freqs, torch.tensor(list(freqs)))
    m = basis.matrix[rows].to(unembed.device) @ unembed.double().T  # [r, d]
    return torch.eye(unembed.shape[0], dtype=torch.float64, device=unembed.device) - torch.linalg.pinv(m) @ m


@dataclass(frozen=True)
class FilterResult(Result):
    """Accuracy with a frequency band removed from some component outputs (Zhou et al. 2024).

    Intervals are 95% percentile-bootstrap intervals over prompts, ``[low, high]``, the same
    resampled prompts for every quantity.

    Attributes:
        accuracy: The accuracy with the filter on.
        baseline_accuracy: The accuracy without it.
        errors: The values of ``model answer − true answer`` among the wrong parsable answers.
        counts: How often each of ``errors`` occurs.
        unparsable: Wrong answers that do not parse as a number.
        removed: The removed frequencies.
        site: ``"mlp_out"`` or ``"attn_out"``.
        layers: The filtered layers.
        numbers: ``[start, stop]`` of the number axis.
        meta: Provenance, the band, the split period, the prompt count, the seed.
        accuracy_ci: The interval of ``accuracy``.
        baseline_ci: The interval of ``baseline_accuracy``.
        drop: Baseline − filtered accuracy.
        drop_ci: Its interval.
        retained: Accuracy / baseline accuracy; NaN, with a ``note``, when the baseline accuracy is
            not distinguishable from zero.
        retained_ci: Its interval.
        note: Why a share is missing, or empty.
    """

    accuracy: float
    baseline_accuracy: float
    errors: list
    counts: list
    unparsable: int
    removed: list
    site: str
    layers: list
    numbers: list
    meta: dict
    accuracy_ci: Optional[list] = None
    baseline_ci: Optional[list] = None
    drop: float = float("nan")
    drop_ci: Optional[list] = None
    retained: float = float("nan")
    retained_ci: Optional[list] = None
    note: str = ""

    # what load checks: the axes fields share and the values they may take
    _shapes = {"errors": "error", "counts": "error", "accuracy_ci": "2", "baseline_ci": "2", "drop_ci": "2",
               "retained_ci": "2"}
    _legal = {"accuracy": PROBABILITY, "baseline_accuracy": PROBABILITY, "counts": NON_NEGATIVE,
              "unparsable": NON_NEGATIVE, "layers": NON_NEGATIVE, "accuracy_ci": PROBABILITY,
              "baseline_ci": PROBABILITY}

    def summary(self) -> dict:
        """Accuracy, baseline, drop and retained share, each with its interval, and the note."""
        return dict(accuracy=self.accuracy, accuracy_ci=self.accuracy_ci, baseline_accuracy=self.baseline_accuracy,
                    baseline_ci=self.baseline_ci, drop=self.drop, drop_ci=self.drop_ci, retained=self.retained,
                    retained_ci=self.retained_ci, note=self.note)

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(dict(error=self.errors, count=self.counts,
                                 share=[c / max(sum(self.counts), 1) for c in self.counts]))

    def plot(self, **kwargs):
        return draw(self, **kwargs)


@checked
def frequency_filter(
    model: HookedModel,
    prompts: PromptSet,
    band: Union[str, IntList] = "low",
    *,
    site: str = "mlp_out",
    layers: Optional[Sequence[int]] = None,
    numbers: Union[int, range, None] = None,
    split_period: float = 10.0,
    positions: str = "final",
    batch_size: PositiveInt = 512,
    seed: int = 0,
) -> FilterResult:
    """Remove a frequency band from component outputs during the forward pass and measure accuracy
    and the error distribution (Zhou et al. 2024).

    Each output ``h`` ``[d_model]`` at the last position of every forward (an
    :class:`~arithinterp.engine.Write` whose value is the projection) is replaced by
    ``h @ P`` with ``P`` from :func:`filter_projector` over the unembeddings of ``numbers``, so
    that the logit lens of the component output has no power in the band.

    Args:
        model: The hooked model.
        prompts: The prompts to evaluate.
        band: ``"low"`` / ``"high"`` (split at ``split_period``, see :func:`band_frequencies`) or a
            list of frequencies.
        site: ``"mlp_out"`` or ``"attn_out"``.
        layers: The filtered layers (default: all).
        numbers: The number axis (default ``0..max answer``).
        split_period: The period that splits low from high.
        positions: ``"final"``, the one position filtered.
        batch_size: Prompts per forward.
        seed: Seeds the bootstrap intervals.

    Returns:
        Accuracies with and without the filter, the drop and the retained share with their
        intervals, and the error distribution.

    Raises:
        SiteError: A site other than a component output, a layer out of range, or another position.
        ConfigError: An unknown band or invalid frequencies.
        ModelMismatchError: The prompts were built for another model.
    """
    check_belongs(model, "fourier.frequency_filter", prompts=prompts)
    from arithinterp import sites as site_lib

    if site not in COMPONENT_SITES:
        raise SiteError(f"frequency filters act on component outputs; accepted sites: {accepted(COMPONENT_SITES)}")
    layers = site_lib.check_layers(model, site, layers)
    numbers = number_axis(numbers, int(prompts.answer.max()) + 1)
    removed = band_frequencies(len(numbers), band, split_period)
    projector = filter_projector(model.W_U.detach()[:, number_tokens(model, numbers)], removed)
    if positions != "final":
        raise SiteError("frequency_filter filters the final position (where the answer is read); use positions='final'")
    baseline = prompts.evaluate(model, batch_size=batch_size)

    def remove_band(last: torch.Tensor) -> torch.Tensor:
        # the component's output at the last position [B, d] -> its projection, in float64
        return (last.double() @ projector).to(last.dtype)

    # only the scored position is filtered (the component's contribution to the answer); with
    # greedy generation of later answer tokens, the last position is the one being read
    filters = [Write(site, layer, positions=-1, value=remove_band) for layer in layers]
    filtered = prompts.evaluate(model, batch_size=batch_size, writes=filters)
    from arithinterp.tasks import UNPARSABLE

    wrong = ~filtered.correct
    parsable = wrong & (filtered.model_answer != UNPARSABLE)
    deltas = (filtered.model_answer[parsable] - prompts.answer[parsable]).tolist()
    values = sorted(set(deltas))
    # rows: filtered, baseline, their difference per prompt; shares of the baseline (row 1)
    after, before = filtered.correct.double(), baseline.correct.double()
    stats = ratio_to_reference(torch.stack([after, before, before - after]), 1, seed=seed)
    low, high = stats["mean_low"].tolist(), stats["mean_high"].tolist()
    note = "" if stats["reference_distinct"] else (
        f"the unfiltered accuracy {baseline.accuracy:.3g} (95% CI {low[1]:.3g} to {high[1]:.3g}) is not "
        "distinguishable from zero, so no retained share is reported")
    return FilterResult(
        accuracy_ci=[low[0], high[0]], baseline_ci=[low[1], high[1]], drop=float(stats["mean"][2]),
        drop_ci=[low[2], high[2]], retained=float(stats["fraction"][0]),
        retained_ci=[float(stats["fraction_low"][0]), float(stats["fraction_high"][0])], note=note,
        accuracy=filtered.accuracy,
        baseline_accuracy=baseline.accuracy,
        errors=values,
        counts=[deltas.count(v) for v in values],
        unparsable=int((wrong & ~parsable).sum()),
        removed=removed,
        site=site,
        layers=list(layers),
        numbers=[numbers.start, numbers.stop],
        meta=build_meta(model, band=band if isinstance(band, str) else "custom", split_period=split_period,
                        n_prompts=len(prompts), interval="95% percentile bootstrap over prompts", seed=seed, note=note),
    )
