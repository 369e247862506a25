"""Spectra read from a model over a number axis, returned as :class:`SpectrumResult`.

Number-token embeddings, residual activations over a number axis, component outputs through the
logit lens (Zhou et al. 2024) and neuron activations over the ``(a, b)`` grid (Nanda et al. 2023);
:func:`spectrum` is the one entry point. The number axis comes from :func:`number_tokens` (one
token per number) and :func:`group_by_value` / :func:`grid_of` (per-prompt activations gathered
per number or onto the grid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from arithinterp.checks import check_belongs, integer
from arithinterp.errors import AnalysisError, ConfigError, SiteError, TokenizationError, accepted
from arithinterp.fourier.basis import (
    KEY_RULES,
    number_axis_size,
    pair_power_per_grid,
    block_power,
    fourier_basis,
    frequency_periods,
    key_fraction,
    key_frequencies,
    period_label,
    spectrum_of,
    spectrum_of_2d,
)
from arithinterp.results import DISTINCT, NON_NEGATIVE, PROBABILITY, Result, build_meta
from arithinterp.types import HookedModel, IntList, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

COMPONENT_SITES = ("attn_out", "mlp_out")


# --- SpectrumResult ------------------------------------------------------------------------------


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
        return int(self.numbers[1] - self.numbers[0])

    @property
    def frequencies(self) -> list[int]:
        return list(range(self.power.shape[1]))

    @property
    def periods(self) -> list[float]:
        return frequency_periods(self.n)

    @property
    def period_labels(self) -> list[str]:
        return [period_label(self.n, k) for k in self.frequencies]

    @property
    def is_2d(self) -> bool:
        return self.power.ndim == 3

    def series_power(self, series: Union[int, str] = 0) -> torch.Tensor:
        """1-D power [n_freq] of one series (block power for 2-D spectra)."""
        i = self._series_index(series)
        return block_power(self.power[i]) if self.is_2d else self.power[i]

    def _series_index(self, series: Union[int, str]) -> int:
        if isinstance(series, str):
            if series not in self.series:
                raise AnalysisError(f"unknown series {series!r}; accepted: {accepted(self.series)}")
            return self.series.index(series)
        if not -len(self.series) <= series < len(self.series):
            raise AnalysisError(f"series index {series} out of range; there are {len(self.series)} series")
        return series % len(self.series)

    def to_frame(self):
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
        from arithinterp.viz.fourier import plot_spectrum

        return plot_spectrum(self, **kwargs)


def _spectrum_result(power: torch.Tensor, series: list[str], start: int, n: int, source: str, rule: str,
                     factor: float, fraction: float, meta: dict, null_power: Optional[torch.Tensor] = None,
                     alpha: float = 0.05) -> SpectrumResult:
    """Key frequencies per series of ``power`` [S, F] or [S, F, F] and the result around them.

    With ``null_power`` [R, S, F] (the 1-D power of R value-shuffled copies of each series), a
    key frequency of the rule is kept only when its permutation p-value against the largest
    null frequency is ≤ ``alpha``, and ``meta["control"]`` states the null and what it found.
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


def null_control_p_values(observed: torch.Tensor, null: torch.Tensor) -> torch.Tensor:
    """Permutation p-values [S, F] of ``observed`` power [S, F] against ``null`` [R, S, F]: the
    share of shuffles (plus one) whose *largest* non-constant frequency reaches the observed
    power, so the test holds over all frequencies of a series at once (max statistic)."""
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


def _gram(values: torch.Tensor) -> torch.Tensor:
    """``X Xᵀ`` [n, n] of values [n, ...] (number axis first)."""
    flat = values.reshape(values.shape[0], -1).double()
    return flat @ flat.T


def _check_null(n_shuffles: int, alpha: float) -> None:
    integer("n_shuffles", n_shuffles, minimum=0, hint=" (0: no shuffled-values control)")
    if n_shuffles and not (1 / (n_shuffles + 1) <= alpha < 1):
        raise ConfigError(
            f"alpha must be in [1 / (n_shuffles + 1), 1) = [{1 / (n_shuffles + 1):.3g}, 1) so a frequency can pass "
            f"the shuffled-values test; got alpha={alpha!r} with n_shuffles={n_shuffles}"
        )


# --- model helpers -------------------------------------------------------------------------------


@checked
def number_tokens(model: HookedModel, numbers: IntList) -> torch.Tensor:
    """Token ids [n] of ``numbers`` written without a space; each must be a single token."""
    check_belongs(model, "fourier.number_tokens")
    tokenizer = getattr(model, "tokenizer", model)
    numbers = list(numbers)
    if not numbers:
        raise AnalysisError("numbers is empty; pass e.g. range(100)")
    ids = tokenizer([str(x) for x in numbers], add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    multi = [x for x, row in zip(numbers, ids) if len(row) != 1 or row[0] == unk]
    if multi:
        raise TokenizationError(
            f"{len(multi)} of these numbers are not single tokens for this tokenizer (e.g. {multi[:5]}); "
            "Fourier analyses over a number axis need one token per number: restrict `numbers` to "
            "single-token numbers (see arithinterp.tasks.number_check)"
        )
    return torch.tensor([row[0] for row in ids])


def number_axis(numbers: Union[int, range, Sequence[int], None], default: Union[int, range, None] = None) -> range:
    if numbers is None:
        if default is None:
            raise AnalysisError("pass numbers=range(n) for the number axis")
        numbers = default
    if isinstance(numbers, int):
        numbers = range(numbers)
    values = numbers if isinstance(numbers, range) else list(numbers)  # a range is never listed: it may be huge
    number_axis_size(values)
    return range(values[0], values[-1] + 1)


def _check_fits(model: HookedModel, numbers: range) -> None:
    """Refuse, before any prompt is built, a number axis whose vectors (one row of ``d_model`` floats
    per number) alone would not fit in the memory an analysis step may use."""
    from arithinterp.engine.budget import memory_budget

    need, budget = 4 * len(numbers) * int(model.cfg.d_model), memory_budget(model)
    if need > budget:
        raise ConfigError(f"{len(numbers)} numbers need {need / 2**30:.3g} GiB for their vectors alone, more than the "
                          f"{budget / 2**30:.3g} GiB an analysis step may use; pass fewer numbers")


def _rule_kw(rule: str, factor: float, fraction: float) -> dict:
    if rule not in KEY_RULES:
        raise ConfigError(f"unknown key-frequency rule {rule!r}; accepted: {accepted(KEY_RULES)}")
    return dict(rule=rule, factor=factor, fraction=fraction)


@checked
def group_by_value(values: torch.Tensor, acts: torch.Tensor, numbers: range) -> torch.Tensor:
    """Mean of ``acts`` [N, ...] over the prompts of each number of ``numbers`` → [n, ...].

    Every number of the range must occur in ``values`` [N] (a spectrum needs the full axis);
    prompts whose value lies outside the range are not used.
    """
    values = torch.as_tensor(values).long()
    if values.shape[0] != acts.shape[0]:
        raise AnalysisError(f"values has {values.shape[0]} entries but there are {acts.shape[0]} activations")
    index = values - numbers.start
    inside = (index >= 0) & (index < len(numbers))
    index, acts = index[inside], acts[inside]
    counts = torch.bincount(index, minlength=len(numbers))
    missing = [numbers.start + i for i in torch.nonzero(counts == 0).flatten().tolist()]
    if missing:
        raise AnalysisError(
            f"{len(missing)} numbers of {numbers} have no prompt (e.g. {missing[:5]}); a spectrum needs "
            "every number on the axis: build prompts over the whole range"
        )
    flat = acts.reshape(acts.shape[0], -1).double()
    sums = torch.zeros((len(numbers), flat.shape[1]), dtype=flat.dtype).index_add_(0, index, flat)
    return (sums / counts[:, None]).reshape(len(numbers), *acts.shape[1:])


@checked
def grid_of(prompts: PromptSet, acts: torch.Tensor, numbers: range) -> torch.Tensor:
    """Arrange per-prompt ``acts`` [N, ...] on the ``(a, b)`` grid → [n, n, ...] (each cell once;
    prompts with an operand outside ``numbers`` are not used)."""
    n = len(numbers)
    ia, ib = prompts.a.long() - numbers.start, prompts.b.long() - numbers.start
    inside = (ia >= 0) & (ia < n) & (ib >= 0) & (ib < n)
    cells = ia[inside] * n + ib[inside]
    counts = torch.bincount(cells, minlength=n * n)
    if (counts != 1).any():
        raise AnalysisError(
            f"the prompts must cover the {n}×{n} grid of (a, b) in {numbers} exactly once; "
            f"{int((counts == 0).sum())} cells are missing and {int((counts > 1).sum())} repeated"
        )
    grid = torch.empty((n * n, *acts.shape[1:]), dtype=acts.dtype)
    grid[cells] = acts[inside]
    return grid.reshape(n, n, *acts.shape[1:])


# --- model wrappers ------------------------------------------------------------------------------


@checked
def embedding_spectrum(model: HookedModel, numbers: Union[int, range] = 100, *, rule: str = "median",
                       factor: float = 10.0, fraction: float = 0.9, n_shuffles: int = 100, alpha: float = 0.05,
                       seed: int = 0) -> SpectrumResult:
    """Spectrum of the number-token embeddings ``W_E[token(x)]`` for x in ``numbers``.

    [n, d_model] rows → power per frequency (Zhou et al. 2024 §2; Nanda et al. 2023 §3). Key
    frequencies must also beat ``n_shuffles`` copies with the numbers shuffled at level
    ``alpha`` (``meta["control"]``; ``n_shuffles=0``: the rule alone)."""
    check_belongs(model, "fourier.embedding_spectrum")
    numbers = number_axis(numbers)
    kw = _rule_kw(rule, factor, fraction)
    _check_null(n_shuffles, alpha)
    embeddings = model.W_E.detach()[number_tokens(model, numbers)]
    power = spectrum_of(embeddings)[None]
    null = shuffled_power(_gram(embeddings), n_shuffles, seed)[:, None]
    return _spectrum_result(power, ["embed"], numbers.start, len(numbers), "embed", **kw,
                            meta=build_meta(model, numbers=numbers), null_power=null, alpha=alpha)


@checked
def activation_spectrum(
    source: Any,
    values: Optional[torch.Tensor] = None,
    numbers: Union[int, range, None] = None,
    *,
    site: str = "resid_post",
    layers: Optional[Sequence[int]] = None,
    position: Optional[str] = None,
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    n_shuffles: int = 100,
    alpha: float = 0.05,
    seed: int = 0,
) -> SpectrumResult:
    """Spectrum of activations over a number axis.

    ``source`` is either a tensor [n_numbers, d] whose row ``i`` belongs to number ``i`` of
    ``numbers`` (default ``range(n_numbers)``), or an :class:`~arithinterp.activations.Activations`
    at ``site`` / ``position``: prompts are grouped by ``values`` [N] (default: the prompts'
    label named like ``position``, e.g. ``"a"``) and averaged per number, one series per layer.

    Control: a key frequency of ``rule`` must also beat ``n_shuffles`` copies with the numbers
    shuffled (the rows permuted over the number axis) at level ``alpha``; ``meta["control"]``
    gives the p-values, the frequencies dropped and how many key frequencies the rule finds on
    shuffled numbers (``n_shuffles=0``: the rule alone).
    """
    kw = _rule_kw(rule, factor, fraction)
    _check_null(n_shuffles, alpha)
    if isinstance(source, torch.Tensor):
        if source.ndim != 2:
            raise AnalysisError(f"an activation tensor must be [n_numbers, d], got shape {tuple(source.shape)}")
        numbers = number_axis(numbers, source.shape[0])
        if len(numbers) != source.shape[0]:
            raise AnalysisError(f"numbers has {len(numbers)} entries but the tensor has {source.shape[0]} rows")
        null = shuffled_power(_gram(source), n_shuffles, seed)[:, None]
        return _spectrum_result(spectrum_of(source)[None], ["activations"], numbers.start, len(numbers),
                                "activations", **kw, meta=build_meta(numbers=numbers), null_power=null, alpha=alpha)
    if not hasattr(source, "get") or not hasattr(source, "positions"):
        raise AnalysisError(f"source must be a tensor [n, d] or an Activations, got {type(source).__name__}")
    position = position if position is not None else source.positions[0]
    if values is None:
        if source.prompts is None or str(position) not in ("a", "b"):
            raise AnalysisError("pass values= (the number of each prompt), e.g. prompts.a for position 'a'")
        values = source.prompts.label(str(position))
    values = torch.as_tensor(values).long()
    numbers = number_axis(numbers, range(int(values.min()), int(values.max()) + 1))
    layers = list(source.layers) if layers is None else list(layers)
    per_layer = [source.get(site, layer, position) for layer in layers]
    grouped = [group_by_value(values, acts, numbers) for acts in per_layer]
    power = torch.stack([spectrum_of(g) for g in grouped])
    null = torch.stack([shuffled_power(_gram(g), n_shuffles, seed) for g in grouped], 1)
    outside = int(((values < numbers.start) | (values >= numbers.stop)).sum())
    shares = torch.stack([variance_shares(values, acts, numbers) for acts in per_layer])
    return _spectrum_result(power, [f"L{layer} {site}" for layer in layers], numbers.start, len(numbers),
                            f"{site} at {position}", **kw,
                            meta=build_meta(site=site, position=str(position), layers=layers,
                                            excluded_prompts=dict(count=outside, reason=f"value outside {numbers}"),
                                            variance_share=shares.tolist()),
                            null_power=null, alpha=alpha)


def variance_shares(values: torch.Tensor, acts: torch.Tensor, numbers: range) -> torch.Tensor:
    """Share [n_freq] of the variance of ``acts`` [N, ...] over *all* prompts that each frequency
    of ``numbers``' Fourier basis explains, the basis evaluated at each prompt's value (the R² of a
    least-squares fit on that frequency's cos / sin columns; NaN for the constant).

    Power shares of the per-number means are scale-free: a representation that barely depends on
    the value (a random-init model) can still put most of its tiny between-number power at one
    frequency. This share counts the variance the value does not explain too, so it is comparable
    across models. Prompts whose value lies outside ``numbers`` are not used.
    """
    values = torch.as_tensor(values).long()
    index = values - numbers.start
    inside = (index >= 0) & (index < len(numbers))
    flat = acts[inside].reshape(int(inside.sum()), -1).double()
    flat = flat - flat.mean(0)
    total = float((flat**2).sum())
    basis = fourier_basis(len(numbers))
    columns = basis.matrix[:, index[inside]].T  # [N, n]: every basis row at each prompt's value
    columns = columns - columns.mean(0)
    shares = torch.full((basis.n_freq,), float("nan"), dtype=torch.float64)
    for k in range(1, basis.n_freq):
        design = columns[:, basis.freqs == k]
        if total <= 0 or float((design**2).sum()) <= 0:
            shares[k] = 0.0
            continue
        fitted = design @ torch.linalg.lstsq(design, flat).solution
        shares[k] = float((fitted**2).sum()) / total
    return shares


@checked
def logit_lens_spectrum(
    model: HookedModel,
    prompts: PromptSet,
    numbers: Union[int, range, None] = None,
    *,
    layers: Optional[Sequence[int]] = None,
    components: Sequence[str] = COMPONENT_SITES,
    position: str = "final",
    batch_size: int = 256,
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    progress: bool = True,
    n_shuffles: int = 100,
    alpha: float = 0.05,
    seed: int = 0,
) -> SpectrumResult:
    """Zhou et al. 2024: each component's output at ``position`` read through the logit lens
    onto number tokens, ``L = W_U[:, tokens(numbers)]ᵀ · output`` [N, n], then a DFT along the
    number axis; power is averaged over prompts. One series per (layer, component).

    ``numbers`` defaults to 0..max answer of ``prompts``. Key frequencies must also beat the
    number-token axis shuffled ``n_shuffles`` times at level ``alpha`` (``meta["control"]``).
    """
    check_belongs(model, "fourier.logit_lens_spectrum", prompts=prompts)
    from arithinterp.activations import collect

    kw = _rule_kw(rule, factor, fraction)
    _check_null(n_shuffles, alpha)
    bad = [c for c in components if c not in COMPONENT_SITES]
    if bad or not components:
        raise SiteError(f"unknown components {bad}; accepted: {accepted(COMPONENT_SITES)}")
    numbers = number_axis(numbers, int(prompts.answer.max()) + 1)
    unembed = model.W_U.detach()[:, number_tokens(model, numbers)].double()
    acts = collect(model, prompts, sites=list(components), layers=layers, positions=position,
                   batch_size=batch_size, progress=progress)
    series, power, null = [], [], []
    for layer in acts.layers:
        for component in components:
            lens = acts.get(component, layer, position).double() @ unembed  # [N, n]
            power.append(spectrum_of(lens, dim=1) / lens.shape[0])
            null.append(shuffled_power(lens.T @ lens, n_shuffles, seed) / lens.shape[0])
            series.append(f"L{layer} {component}")
    return _spectrum_result(torch.stack(power), series, numbers.start, len(numbers), f"logit lens at {position}",
                            **kw, meta=build_meta(model, n_prompts=len(prompts), position=position),
                            null_power=torch.stack(null, 1), alpha=alpha)


def grid_activations(model: HookedModel, prompts: PromptSet, layer: int, site: str, numbers: range, batch_size: int,
                      progress: bool) -> torch.Tensor:
    """Neuron activations at the final position on the (a, b) grid → [d_mlp, n, n]."""
    from arithinterp.activations import collect

    if site not in ("mlp_pre", "mlp_post"):
        raise SiteError(f"neuron spectra read 'mlp_pre' or 'mlp_post', got {site!r}")
    acts = collect(model, prompts, sites=[site], layers=[layer], positions="final", batch_size=batch_size,
                   progress=progress)
    return grid_of(prompts, acts.get(site, layer, "final"), numbers).permute(2, 0, 1)


@checked
def neuron_spectrum(
    model: HookedModel,
    prompts: PromptSet,
    layer: int = 0,
    numbers: Union[int, range, None] = None,
    *,
    site: str = "mlp_post",
    batch_size: int = 1024,
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    progress: bool = True,
    n_shuffles: int = 20,
    alpha: float = 0.05,
    seed: int = 0,
) -> SpectrumResult:
    """2-D spectrum of every neuron's activation grid over ``(a, b)`` at the final position,
    summed over neurons: power per frequency pair (Nanda et al. 2023).

    ``prompts`` must cover the grid ``numbers × numbers`` (default 0..max a) exactly once. Key
    frequencies (of the block power) must also beat ``n_shuffles`` copies with the a values and
    the b values shuffled at level ``alpha`` (each shuffle is a full 2-D transform of every
    neuron, hence fewer than for 1-D spectra; ``meta["control"]``).
    """
    check_belongs(model, "fourier.neuron_spectrum", prompts=prompts)
    kw = _rule_kw(rule, factor, fraction)
    _check_null(n_shuffles, alpha)
    numbers = number_axis(numbers, int(prompts.a.max()) + 1)
    grids = grid_activations(model, prompts, layer, site, numbers, batch_size, progress)
    grids = grids.double()
    power = spectrum_of_2d(grids)[None]
    generator = torch.Generator().manual_seed(int(seed))
    n = grids.shape[-1]
    null = []
    for _ in range(n_shuffles):
        rows, cols = torch.randperm(n, generator=generator), torch.randperm(n, generator=generator)
        null.append(block_power(pair_power_per_grid(grids[:, rows][:, :, cols]).sum(0)))
    null = torch.stack(null)[:, None] if null else None
    return _spectrum_result(power, [f"L{layer} {site}"], numbers.start, len(numbers), f"{site} over (a, b)", **kw,
                            meta=build_meta(model, layer=layer, site=site, n_neurons=grids.shape[0],
                                            excluded_prompts=len(prompts) - len(numbers) ** 2),
                            null_power=null, alpha=alpha)


CONTEXT_SITES = ("embed", "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


@checked
def context_spectrum(
    model: HookedModel,
    numbers: Union[int, range] = 100,
    *,
    site: str = "resid_post",
    layers: Optional[Sequence[int]] = None,
    template: str = "{a}+{b}=",
    b: int = 0,
    position: str = "a",
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    progress: bool = False,
) -> SpectrumResult:
    """Spectrum of each number's representation read in a prompt: for every x in ``numbers`` the
    prompt ``template`` with a = x (and ``b``), the activation at ``site`` and ``position``
    (default ``"a"``: the number's last token, where a number split into several tokens has been
    read whole, as Kantamneni & Tegmark 2025 read it), one series per layer.

    This works for any tokenizer: one token per number, one per digit (Llama 2, Gemma, Qwen) or
    irregular BPE pieces. With ``site="embed"`` a multi-token number is seen only through the
    embedding of its last token (for digit-split numbers: the last digit, a pure period-10
    signal); later layers have mixed in the earlier tokens.
    """
    check_belongs(model, "fourier.context_spectrum")
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    if site not in CONTEXT_SITES:
        raise SiteError(f"a number spectrum reads one of {accepted(CONTEXT_SITES)}, got {site!r}")
    numbers = number_axis(numbers)
    prompts = arithmetic(model, "+", a=numbers, b=[b], template=template)
    acts = collect(model, prompts, sites=[site], layers=layers, positions=[position], progress=progress)
    result = activation_spectrum(acts, values=prompts.a, numbers=numbers, site=site, position=acts.positions[0],
                                 rule=rule, factor=factor, fraction=fraction)
    result.meta.update(template=template, b=b, operand_tokens=prompts.meta["operand_tokens"]["max"])
    return result


def _single_tokens(model: HookedModel, numbers: range) -> bool:
    try:
        number_tokens(model, numbers)
    except TokenizationError:
        return False
    return True


@checked
def spectrum(source: Any, numbers: Union[int, range, None] = None, *, site: str = "embed", **kwargs) -> SpectrumResult:
    """One entry point for every spectrum:

    * a model with ``site="embed"`` → :func:`embedding_spectrum` when every number is one
      token, else :func:`context_spectrum` (the embedding at each number's last token);
    * a model with a residual or output site (``"resid_post"``, ``"mlp_out"``, ...; ``layers=``)
      → :func:`context_spectrum`: each number read at its last token in a prompt, any tokenizer;
    * a tensor [n, d] or an ``Activations`` → :func:`activation_spectrum` (``site`` is the
      collected site to read, e.g. ``"resid_post"``);
    * a model with ``site="logit_lens"`` and ``prompts=`` → :func:`logit_lens_spectrum`;
    * a model with ``site="mlp_post"`` / ``"mlp_pre"`` and ``prompts=`` → :func:`neuron_spectrum`.
    """
    if isinstance(source, torch.Tensor) or (hasattr(source, "get") and hasattr(source, "positions")):
        if site == "embed":
            site = "resid_post"
        return activation_spectrum(source, numbers=numbers, site=site, **kwargs)
    if not hasattr(source, "cfg"):
        raise AnalysisError(f"source must be a model, a tensor or an Activations, got {type(source).__name__}")
    _check_fits(source, number_axis(100 if numbers is None else numbers))
    if site == "embed" and "prompts" not in kwargs:
        if _single_tokens(source, number_axis(100 if numbers is None else numbers)):
            return embedding_spectrum(source, 100 if numbers is None else numbers, **kwargs)
    if site in CONTEXT_SITES and "prompts" not in kwargs:
        return context_spectrum(source, 100 if numbers is None else numbers, site=site, **kwargs)
    prompts = kwargs.pop("prompts", None)
    if prompts is None:
        raise AnalysisError(f"site={site!r} needs prompts= (a PromptSet)")
    if site == "logit_lens":
        return logit_lens_spectrum(source, prompts, numbers, **kwargs)
    if site in ("mlp_pre", "mlp_post"):
        return neuron_spectrum(source, prompts, numbers=numbers, site=site, **kwargs)
    raise SiteError(
        f"unknown spectrum site {site!r}; accepted: {accepted(['embed', 'logit_lens', 'mlp_pre', 'mlp_post'])}"
    )
