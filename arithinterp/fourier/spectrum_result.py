"""What a spectrum finds: :class:`SpectrumResult`, power per frequency per series with its key
frequencies, and :func:`spectrum_result`, which picks the key frequencies (and, with a null, keeps
those that beat the shuffled numbers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.fourier.basis import block_power, frequency_periods, key_fraction, key_frequencies, period_label
from arithinterp.fourier.null_control import null_control_p_values
from arithinterp.results import DISTINCT, NON_NEGATIVE, PROBABILITY, Result


@dataclass(frozen=True)
class SpectrumResult(Result):
    """Power per frequency of one or more representations over a number axis.

    ``power`` is [n_series, n_freq] (1-D spectra) or [n_series, n_freq, n_freq] (2-D spectra of
    ``(a, b)`` grids, indexed by the frequency along a and along b). ``series`` names the rows
    (``"embed"``, ``"L0 mlp_out"``, a layer); ``numbers`` is ``[start, stop)`` of the number
    axis (``n = stop - start``, period of frequency ``k`` = ``n / k``). ``key[s]`` lists series
    ``s``'s key frequencies under ``rule`` (:func:`key_frequencies`; for 2-D spectra applied to
    :func:`block_power`) and ``key_fraction[s]`` the share of its non-constant power they hold.
    Spectra of per-prompt activations also give ``meta["variance_share"]`` ``[n_series][n_freq]``:
    the share of the activations' whole variance each frequency explains (:func:`variance_shares`;
    the ``variance_share`` column of :meth:`to_frame`).
    """

    power: torch.Tensor
    series: list
    numbers: list
    key: list
    key_fraction: torch.Tensor
    rule: dict
    source: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"power": "series frequency", "series": "series", "key": "series", "key_fraction": "series"}
    _legal = {"power": NON_NEGATIVE, "key_fraction": PROBABILITY, "series": DISTINCT}

    @property
    def n(self) -> int:
        """The length of the number axis.
        """
        return int(self.numbers[1] - self.numbers[0])

    @property
    def frequencies(self) -> list[int]:
        """The frequencies ``0..n_freq-1``.
        """
        return list(range(self.power.shape[1]))

    @property
    def periods(self) -> list[float]:
        """The period ``n / k`` of each frequency.
        """
        return frequency_periods(self.n)

    @property
    def period_labels(self) -> list[str]:
        """Each frequency's period as a label.
        """
        return [period_label(self.n, k) for k in self.frequencies]

    @property
    def is_2d(self) -> bool:
        """Whether the spectra are of ``(a, b)`` grids.
        """
        return self.power.ndim == 3

    def series_power(self, series: Union[int, str] = 0) -> torch.Tensor:
        """1-D power of one series (block power for 2-D spectra).

        Args:
            series: The series' index or name.

        Returns:
            [n_freq].

        Raises:
            ConfigError: no series of that name.
            AnalysisError: a series index out of range.
        """
        i = self._series_index(series)
        return block_power(self.power[i]) if self.is_2d else self.power[i]

    def _series_index(self, series: Union[int, str]) -> int:
        if isinstance(series, str):
            if series not in self.series:
                raise ConfigError(f"unknown series {series!r}; accepted: {accepted(self.series)}")
            return self.series.index(series)
        if not -len(self.series) <= series < len(self.series):
            raise AnalysisError(f"series index {series} out of range; there are {len(self.series)} series")
        return series % len(self.series)

    def to_frame(self):
        """One row per series × frequency (× frequency for 2-D spectra): power, share, key, and for 1-D
        spectra the variance share and the control's p-value.

        Returns:
            A pandas DataFrame.
        """
        import pandas as pd

        periods = self.periods
        p_values = self.meta.get("control", {}).get("p_values")
        variance = self.meta.get("variance_share")
        rows = []
        for s, name in enumerate(self.series):
            power = self.power[s].double()
            total = float(power.sum() - (power[0, 0] if self.is_2d else power[0]))
            key = set(self.key[s])
            if self.is_2d:
                for ka in self.frequencies:
                    for kb in self.frequencies:
                        rows.append(
                            dict(series=name, freq_a=ka, freq_b=kb, period_a=periods[ka], period_b=periods[kb],
                                 power=float(power[ka, kb]),
                                 share=float(power[ka, kb]) / total if total > 0 and (ka or kb) else float("nan"),
                                 key=bool({ka, kb} & key))
                        )
            else:
                for k in self.frequencies:
                    rows.append(
                        dict(series=name, frequency=k, period=periods[k], period_label=period_label(self.n, k),
                             power=float(power[k]), share=float(power[k]) / total if total > 0 and k else float("nan"),
                             variance_share=float(variance[s][k]) if variance else float("nan"),
                             p_value=float(p_values[s][k]) if p_values else float("nan"), key=k in key)
                    )
        return pd.DataFrame(rows)

    def plot(self, **kwargs):
        """The spectra as bars over frequency (see ``viz.fourier``).

        Args:
            **kwargs: Passed to :func:`arithinterp.viz.fourier.plot_spectrum`.

        Returns:
            A plotly Figure.
        """
        return draw(self, **kwargs)


def spectrum_result(power: torch.Tensor, series: list[str], start: int, n: int, source: str, rule: str,
                    factor: float, fraction: float, meta: dict, null_power: Optional[torch.Tensor] = None,
                    alpha: float = 0.05) -> SpectrumResult:
    """Key frequencies per series of ``power`` and the result around them.

    With ``null_power`` (the 1-D power of R value-shuffled copies of each series), a key frequency
    of the rule is kept only when its permutation p-value against the largest null frequency is
    ≤ ``alpha``, and ``meta["control"]`` states the null and what it found.

    Args:
        power: [S, F] or [S, F, F].
        series: The name of each series.
        start: The number axis's first number.
        n: The number axis's length.
        source: What was read, in words.
        rule: The key-frequency rule (:func:`~arithinterp.fourier.key_frequencies`).
        factor: The rule's factor.
        fraction: The rule's fraction.
        meta: The result's meta.
        null_power: [R, S, F], or ``None`` (the rule alone).
        alpha: The control's level.

    Returns:
        The spectra with their key frequencies.
    """
    one_d = [block_power(p) if power.ndim == 3 else p for p in power]
    rule_keys = [key_frequencies(p, rule, factor=factor, fraction=fraction) for p in one_d]
    keys = rule_keys
    if null_power is not None and null_power.shape[0]:
        observed = torch.stack(one_d).double()
        null = null_power.double()
        p_values = null_control_p_values(observed, null)
        keys = [[k for k in ks if float(p_values[s, k]) <= alpha] for s, ks in enumerate(rule_keys)]
        share = null[:, :, 1:] / null[:, :, 1:].sum(-1, keepdim=True).clamp_min(1e-300)
        meta = dict(meta, control=dict(
            null="number axis shuffled: the values permuted over the numbers (seeded)",
            n_shuffles=int(null.shape[0]), alpha=alpha,
            test="permutation p-value of each frequency's power against the largest frequency of each shuffle",
            rule_keys=rule_keys, dropped=[sorted(set(r) - set(k)) for r, k in zip(rule_keys, keys)],
            null_keys_mean=[float(sum(len(key_frequencies(null[r, s], rule, factor=factor, fraction=fraction))
                                      for r in range(null.shape[0])) / null.shape[0]) for s in range(null.shape[1])],
            null_max_share_q95=torch.quantile(share.max(-1).values, 0.95, dim=0).tolist(),
            p_values=p_values.tolist(),
        ))
    fractions = torch.tensor([key_fraction(p, k) for p, k in zip(one_d, keys)])
    return SpectrumResult(
        power=power.float(),
        series=list(series),
        numbers=[int(start), int(start + n)],
        key=keys,
        key_fraction=fractions,
        rule=dict(rule=rule, factor=factor, fraction=fraction),
        source=source,
        meta=meta,
    )
