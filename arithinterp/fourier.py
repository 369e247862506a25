"""Fourier features of numbers: DFT bases, spectra, key frequencies, restricted / excluded loss,
frequency filters.

Everything here reads a representation *along a number axis* (rows for the numbers 0..n-1 of a
range) in an orthonormal real Fourier basis and asks how its power splits over frequencies
``k`` (period ``n / k``).

* :func:`fourier_basis` — the orthonormal real DFT basis (RECIPES §2 choice, §3): a constant row,
  then ``cos``/``sin`` pairs per frequency ``k`` (and a lone ``cos n/2`` row when ``n`` is even).
  :func:`fourier_2d` applies it on both axes of an ``(a, b)`` grid (the outer-product basis of
  Nanda et al. 2023).
* :func:`spectrum_of` / :func:`spectrum_of_2d` — pure tensor spectra; :func:`spectrum` and the
  named wrappers read them from a model: number-token embeddings, residual activations over a
  number axis, component outputs through the logit lens (Zhou et al. 2024) and neuron
  activations over the ``(a, b)`` grid (Nanda et al. 2023). All return :class:`SpectrumResult`.
* :func:`key_frequencies` — the stated rule that picks the frequencies that matter.
* :func:`neuron_frequencies` — per neuron, the share of its non-constant variance in one
  frequency block ``{const, cos k, sin k}²`` (Nanda et al. 2023).
* :func:`restricted_loss` / :func:`excluded_loss` / :func:`progress` — Nanda's progress measures
  for modular addition over training snapshots.
* :func:`frequency_filter` — Zhou's filter ablation: remove a band of frequencies from a
  component's output during the forward pass and measure accuracy and the error distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from arithinterp.errors import AnalysisError, ConfigError, SiteError, TokenizationError, accepted
from arithinterp.results import Result, build_meta

KEY_RULES = ("median", "fraction")
COMPONENT_SITES = ("attn_out", "mlp_out")
BANDS = ("low", "high")


# --- the basis ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FourierBasis:
    """The orthonormal real DFT basis over ``n`` consecutive numbers.

    ``matrix`` [n, n] has one basis vector per row (``matrix @ matrix.T == I``); row ``j`` is
    ``labels[j]`` (``"const"``, ``"cos 3"``, ``"sin 3"``) of frequency ``freqs[j]`` (0 for the
    constant). Coefficients of a signal ``x`` [n, ...] are ``matrix @ x``.
    """

    matrix: torch.Tensor
    labels: list[str]
    freqs: torch.Tensor

    @property
    def n(self) -> int:
        return self.matrix.shape[0]

    @property
    def n_freq(self) -> int:
        return self.n // 2 + 1


def _check_n(n: Union[int, range, Sequence[int]]) -> int:
    """The size of a number axis: an int, or a range / list of consecutive numbers."""
    if isinstance(n, (int,)) and not isinstance(n, bool):
        size = int(n)
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


def fourier_basis(n: Union[int, range, Sequence[int]], *, dtype: torch.dtype = torch.float64) -> FourierBasis:
    """The orthonormal real DFT basis over ``n`` numbers (an int or a range of consecutive ints).

    Rows: constant ``1/√n``; for ``k = 1 .. ⌈n/2⌉-1`` the pair ``√(2/n)·cos(2πkx/n)``,
    ``√(2/n)·sin(2πkx/n)``; for even ``n`` one last row ``cos(πx)/√n`` (its sine is zero).
    ``x`` counts from the start of the range (a shift changes phases, never powers).
    RECIPES §2 *(choice)* and §3 (Nanda et al. 2023).
    """
    size = _check_n(n)
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


def fourier_basis_2d(n: Union[int, range, Sequence[int]], *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The 2-D basis over an ``n × n`` grid as the outer product: [n, n, n, n] where
    ``out[i, j]`` is the grid ``basis[i] ⊗ basis[j]`` (Nanda et al. 2023). Memory grows as n⁴;
    use :func:`fourier_2d` to transform grids without building it."""
    basis = fourier_basis(n, dtype=dtype).matrix
    return torch.einsum("ia,jb->ijab", basis, basis)


def fourier_2d(grid: torch.Tensor, basis: Optional[FourierBasis] = None) -> torch.Tensor:
    """2-D coefficients ``F · grid · Fᵀ`` of grids [..., n, n] (last two axes: a, b)."""
    if grid.ndim < 2 or grid.shape[-1] != grid.shape[-2]:
        raise AnalysisError(f"a 2-D Fourier transform needs square grids [..., n, n], got shape {tuple(grid.shape)}")
    basis = basis or fourier_basis(grid.shape[-1])
    matrix = basis.matrix.to(grid.device)
    return matrix @ grid.to(matrix.dtype) @ matrix.T


def frequency_periods(n: int) -> list[float]:
    """Period ``n / k`` of each frequency ``k = 0 .. n//2`` (``inf`` for the constant)."""
    return [math.inf] + [n / k for k in range(1, n // 2 + 1)]


def period_label(n: int, k: int) -> str:
    """Readable period of frequency ``k``: ``"const"``, ``"10"``, ``"113/14 ≈ 8.07"``."""
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


def spectrum_of(values: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Power per frequency of ``values`` along its number axis ``dim``.

    ``values`` has the numbers 0..n-1 (of a range) along ``dim``; every other axis (features,
    prompts) is summed over. Returns [n // 2 + 1] with index ``k`` = frequency ``k`` (0 = the
    constant, i.e. ``n · |mean|²``); the entries sum to ``‖values‖²`` (Parseval).
    """
    if not isinstance(values, torch.Tensor) or values.ndim < 1:
        raise AnalysisError(f"values must be a tensor with a number axis, got {type(values).__name__}")
    if not -values.ndim <= dim < values.ndim:
        raise AnalysisError(f"dim {dim} is out of range for a tensor of shape {tuple(values.shape)}")
    moved = values.movedim(dim, 0)
    basis = fourier_basis(moved.shape[0])
    coefficients = basis.matrix.to(values.device) @ moved.reshape(moved.shape[0], -1).to(torch.float64)
    return _freq_power(coefficients, basis.freqs, basis.n_freq).sum(-1)


def spectrum_of_2d(grids: torch.Tensor) -> torch.Tensor:
    """Power per frequency pair of grids [..., n, n] (axes a, b), summed over leading axes.

    Returns [n//2 + 1, n//2 + 1]: entry ``[ka, kb]`` is the power in the basis grids of
    frequency ``ka`` along a and ``kb`` along b (Nanda et al. 2023, 2-D outer-product basis).
    """
    return _pair_power(grids.reshape(-1, *grids.shape[-2:])).sum(0)


def _pair_power(grids: torch.Tensor) -> torch.Tensor:
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


def block_power(pair_power: torch.Tensor) -> torch.Tensor:
    """Power of each frequency block ``{const, cos k, sin k}²`` minus the constant·constant cell.

    ``pair_power`` [..., F, F] (from :func:`spectrum_of_2d`) → [..., F]; entry 0 is 0 and entry
    ``k ≥ 1`` is ``P[0, k] + P[k, 0] + P[k, k]`` (Nanda et al. 2023's 3×3 neuron block).
    """
    diagonal = pair_power.diagonal(dim1=-2, dim2=-1).clone()
    blocks = diagonal + pair_power[..., 0, :] + pair_power[..., :, 0]
    blocks[..., 0] = 0.0
    return blocks


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

    Returns the chosen ``k`` sorted by decreasing power.
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


def key_fraction(power: torch.Tensor, key: Iterable[int]) -> float:
    """Share of the non-constant power of ``power`` [n_freq] in the frequencies ``key``."""
    total = float(power[1:].sum())
    return float(power[list(key)].sum()) / total if total > 0 and list(key) else 0.0


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
    """

    power: torch.Tensor
    series: list
    numbers: list
    key: list
    key_fraction: torch.Tensor
    rule: dict
    source: str
    meta: dict

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
                             key=k in key)
                    )
        return pd.DataFrame(rows)

    def plot(self, **kwargs):
        from arithinterp.viz.fourier import spectrum_figure

        return spectrum_figure(self, **kwargs)


def _spectrum_result(power: torch.Tensor, series: list[str], start: int, n: int, source: str, rule: str,
                     factor: float, fraction: float, meta: dict) -> SpectrumResult:
    """Key frequencies per series of ``power`` [S, F] or [S, F, F] and the result around them."""
    one_d = [block_power(p) if power.ndim == 3 else p for p in power]
    keys = [key_frequencies(p, rule, factor=factor, fraction=fraction) for p in one_d]
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


# --- model helpers -------------------------------------------------------------------------------


def number_tokens(model: Any, numbers: Iterable[int]) -> torch.Tensor:
    """Token ids [n] of ``numbers`` written without a space; each must be a single token."""
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


def _numbers(numbers: Union[int, range, Sequence[int], None], default: Optional[int] = None) -> range:
    if numbers is None:
        if default is None:
            raise AnalysisError("pass numbers=range(n) for the number axis")
        numbers = default
    if isinstance(numbers, int):
        numbers = range(numbers)
    values = list(numbers)
    _check_n(values)
    return range(values[0], values[-1] + 1)


def _rule_kw(rule: str, factor: float, fraction: float) -> dict:
    if rule not in KEY_RULES:
        raise ConfigError(f"unknown key-frequency rule {rule!r}; accepted: {accepted(KEY_RULES)}")
    return dict(rule=rule, factor=factor, fraction=fraction)


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


def grid_of(prompts: Any, acts: torch.Tensor, numbers: range) -> torch.Tensor:
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


def embedding_spectrum(model: Any, numbers: Union[int, range] = 100, *, rule: str = "median",
                       factor: float = 10.0, fraction: float = 0.9) -> SpectrumResult:
    """Spectrum of the number-token embeddings ``W_E[token(x)]`` for x in ``numbers``.

    [n, d_model] rows → power per frequency (Zhou et al. 2024 §2; Nanda et al. 2023 §3)."""
    numbers = _numbers(numbers)
    kw = _rule_kw(rule, factor, fraction)
    embeddings = model.W_E.detach()[number_tokens(model, numbers)]
    power = spectrum_of(embeddings)[None]
    return _spectrum_result(power, ["embed"], numbers.start, len(numbers), "embed", **kw,
                            meta=build_meta(model, numbers=numbers))


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
) -> SpectrumResult:
    """Spectrum of activations over a number axis.

    ``source`` is either a tensor [n_numbers, d] whose row ``i`` belongs to number ``i`` of
    ``numbers`` (default ``range(n_numbers)``), or an :class:`~arithinterp.activations.Activations`
    at ``site`` / ``position``: prompts are grouped by ``values`` [N] (default: the prompts'
    label named like ``position``, e.g. ``"a"``) and averaged per number, one series per layer.
    """
    kw = _rule_kw(rule, factor, fraction)
    if isinstance(source, torch.Tensor):
        if source.ndim != 2:
            raise AnalysisError(f"an activation tensor must be [n_numbers, d], got shape {tuple(source.shape)}")
        numbers = _numbers(numbers, source.shape[0])
        if len(numbers) != source.shape[0]:
            raise AnalysisError(f"numbers has {len(numbers)} entries but the tensor has {source.shape[0]} rows")
        return _spectrum_result(spectrum_of(source)[None], ["activations"], numbers.start, len(numbers),
                                "activations", **kw, meta=build_meta(numbers=numbers))
    if not hasattr(source, "get") or not hasattr(source, "positions"):
        raise AnalysisError(f"source must be a tensor [n, d] or an Activations, got {type(source).__name__}")
    position = position if position is not None else source.positions[0]
    if values is None:
        if source.prompts is None or str(position) not in ("a", "b"):
            raise AnalysisError("pass values= (the number of each prompt), e.g. prompts.a for position 'a'")
        values = source.prompts.label(str(position))
    values = torch.as_tensor(values).long()
    numbers = _numbers(numbers, range(int(values.min()), int(values.max()) + 1))
    layers = list(source.layers) if layers is None else list(layers)
    power = torch.stack([spectrum_of(group_by_value(values, source.get(site, layer, position), numbers))
                         for layer in layers])
    outside = int(((values < numbers.start) | (values >= numbers.stop)).sum())
    return _spectrum_result(power, [f"L{layer} {site}" for layer in layers], numbers.start, len(numbers),
                            f"{site} at {position}", **kw,
                            meta=build_meta(site=site, position=str(position), layers=layers,
                                            excluded_prompts=dict(count=outside, reason=f"value outside {numbers}")))


def logit_lens_spectrum(
    model: Any,
    prompts: Any,
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
) -> SpectrumResult:
    """Zhou et al. 2024 (RECIPES §2): each component's output at ``position`` read through the
    logit lens onto number tokens, ``L = W_U[:, tokens(numbers)]ᵀ · output`` [N, n], then a DFT
    along the number axis; power is averaged over prompts. One series per (layer, component).

    ``numbers`` defaults to 0..max answer of ``prompts``.
    """
    from arithinterp.activations import collect

    kw = _rule_kw(rule, factor, fraction)
    bad = [c for c in components if c not in COMPONENT_SITES]
    if bad or not components:
        raise SiteError(f"unknown components {bad}; accepted: {accepted(COMPONENT_SITES)}")
    numbers = _numbers(numbers, int(prompts.answer.max()) + 1)
    unembed = model.W_U.detach()[:, number_tokens(model, numbers)].double()
    acts = collect(model, prompts, sites=list(components), layers=layers, positions=position,
                   batch_size=batch_size, progress=progress)
    series, power = [], []
    for layer in acts.layers:
        for component in components:
            lens = acts.get(component, layer, position).double() @ unembed  # [N, n]
            power.append(spectrum_of(lens, dim=1) / lens.shape[0])
            series.append(f"L{layer} {component}")
    return _spectrum_result(torch.stack(power), series, numbers.start, len(numbers), f"logit lens at {position}",
                            **kw, meta=build_meta(model, n_prompts=len(prompts), position=position))


def _grid_activations(model: Any, prompts: Any, layer: int, site: str, numbers: range, batch_size: int,
                      progress: bool) -> torch.Tensor:
    """Neuron activations at the final position on the (a, b) grid → [d_mlp, n, n]."""
    from arithinterp.activations import collect

    if site not in ("mlp_pre", "mlp_post"):
        raise SiteError(f"neuron spectra read 'mlp_pre' or 'mlp_post', got {site!r}")
    acts = collect(model, prompts, sites=[site], layers=[layer], positions="final", batch_size=batch_size,
                   progress=progress)
    return grid_of(prompts, acts.get(site, layer, "final"), numbers).permute(2, 0, 1)


def neuron_spectrum(
    model: Any,
    prompts: Any,
    layer: int = 0,
    numbers: Union[int, range, None] = None,
    *,
    site: str = "mlp_post",
    batch_size: int = 1024,
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    progress: bool = True,
) -> SpectrumResult:
    """2-D spectrum of every neuron's activation grid over ``(a, b)`` at the final position,
    summed over neurons: power per frequency pair (Nanda et al. 2023, RECIPES §3).

    ``prompts`` must cover the grid ``numbers × numbers`` (default 0..max a) exactly once.
    """
    kw = _rule_kw(rule, factor, fraction)
    numbers = _numbers(numbers, int(prompts.a.max()) + 1)
    grids = _grid_activations(model, prompts, layer, site, numbers, batch_size, progress)
    power = spectrum_of_2d(grids.double())[None]
    return _spectrum_result(power, [f"L{layer} {site}"], numbers.start, len(numbers), f"{site} over (a, b)", **kw,
                            meta=build_meta(model, layer=layer, site=site, n_neurons=grids.shape[0],
                                            excluded_prompts=len(prompts) - len(numbers) ** 2))


def spectrum(source: Any, numbers: Union[int, range, None] = None, *, site: str = "embed", **kwargs) -> SpectrumResult:
    """One entry point for every spectrum:

    * a model with ``site="embed"`` → :func:`embedding_spectrum`;
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
    if site == "embed":
        return embedding_spectrum(source, 100 if numbers is None else numbers, **kwargs)
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


# --- restricted / excluded loss (Nanda et al. 2023) ---------------------------------------------


def _check_logits(logits: torch.Tensor) -> int:
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or logits.shape[0] != logits.shape[1]:
        raise AnalysisError(
            f"logits must be [p, p, n_classes] over all (a, b) pairs, got {getattr(logits, 'shape', logits)}"
        )
    return logits.shape[0]


def sum_directions(p: int, freqs: Iterable[int], *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal directions ``cos / sin(2πk(a+b)/p)`` over the p² pairs for each ``k``: [p², 2K].

    Directions that vanish (``sin`` at ``k = p/2``) are dropped.
    """
    freqs = [int(k) for k in freqs]
    bad = [k for k in freqs if not 1 <= k <= p // 2]
    if bad:
        raise AnalysisError(f"frequencies {bad} are out of range for p={p}; accepted: 1..{p // 2}")
    s = (torch.arange(p)[:, None] + torch.arange(p)[None, :]).flatten().to(dtype)
    ks = torch.tensor(sorted(set(freqs)), dtype=dtype)
    angle = 2 * math.pi * s[:, None] * ks[None, :] / p
    directions = torch.cat([angle.cos(), angle.sin()], dim=1)
    norms = directions.norm(dim=0)
    keep = norms > 1e-8 * p
    return directions[:, keep] / norms[keep]


def _key_part(logits: torch.Tensor, freqs: Iterable[int]) -> torch.Tensor:
    """Projection of logits [p, p, C] onto the key ``cos / sin(w_k(a+b))`` directions."""
    p = logits.shape[0]
    flat = logits.reshape(p * p, -1).double()
    directions = sum_directions(p, freqs).to(flat.device)
    return (directions @ (directions.T @ flat)).reshape(logits.shape)


def restricted_logits(logits: torch.Tensor, freqs: Iterable[int]) -> torch.Tensor:
    """Logits [p, p, C] kept only in the key directions ``cos / sin(w_k(a+b))`` plus the
    per-class mean over pairs (Nanda et al. 2023 restricted logits)."""
    _check_logits(logits)
    return logits.double().mean(dim=(0, 1), keepdim=True) + _key_part(logits, freqs)


def excluded_logits(logits: torch.Tensor, freqs: Iterable[int]) -> torch.Tensor:
    """Logits [p, p, C] with the key directions ``cos / sin(w_k(a+b))`` removed (Nanda et al. 2023)."""
    _check_logits(logits)
    return logits.double() - _key_part(logits, freqs)


def _loss(logits: torch.Tensor, labels: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> float:
    p = _check_logits(logits)
    if labels is None:
        if logits.shape[2] < p:
            raise AnalysisError(f"default labels (a + b) mod p need ≥ p={p} classes, got {logits.shape[2]}")
        labels = (torch.arange(p)[:, None] + torch.arange(p)[None, :]) % p
    labels = torch.as_tensor(labels).long().to(logits.device)
    if labels.shape != (p, p):
        raise AnalysisError(f"labels must be [p, p] = [{p}, {p}], got {tuple(labels.shape)}")
    mask = torch.ones((p, p), dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    if mask.shape != (p, p) or not mask.any():
        raise AnalysisError(
            f"mask must be a non-empty bool [p, p] = [{p}, {p}] selecting pairs, got {tuple(mask.shape)}"
        )
    mask = mask.to(logits.device)
    return float(F.cross_entropy(logits.double()[mask], labels[mask]))


def full_loss(logits: torch.Tensor, labels: Optional[torch.Tensor] = None,
              mask: Optional[torch.Tensor] = None) -> float:
    """Cross-entropy of logits [p, p, C] against ``labels`` [p, p] (default ``(a + b) mod p``)
    over the pairs in ``mask`` [p, p] (default all)."""
    return _loss(logits, labels, mask)


def restricted_loss(logits: torch.Tensor, freqs: Iterable[int], labels: Optional[torch.Tensor] = None,
                    mask: Optional[torch.Tensor] = None) -> float:
    """Loss of :func:`restricted_logits` (RECIPES §3). Falls below the full loss once the
    model's answer is carried by the key frequencies and the rest is noise."""
    return _loss(restricted_logits(logits, freqs), labels, mask)


def excluded_loss(logits: torch.Tensor, freqs: Iterable[int], labels: Optional[torch.Tensor] = None,
                  mask: Optional[torch.Tensor] = None) -> float:
    """Loss of :func:`excluded_logits` (RECIPES §3; Nanda measure it on the training pairs).
    Rises far above the full loss as the Fourier circuit forms."""
    return _loss(excluded_logits(logits, freqs), labels, mask)


def sum_frequency_power(logits: torch.Tensor) -> torch.Tensor:
    """Power of logits [p, p, C] in each ``cos / sin(w_k(a+b))`` pair of directions: [p//2 + 1]
    (index ``k``; index 0 = the per-class mean). Its key frequencies (:func:`key_frequencies`)
    are the frequencies the logits are built from."""
    p = _check_logits(logits)
    flat = logits.reshape(p * p, -1).double()
    power = [flat.mean(0).pow(2).sum() * p * p]
    for k in range(1, p // 2 + 1):
        power.append((sum_directions(p, [k]).T @ flat).pow(2).sum())
    return torch.stack(power)


@torch.inference_mode()
def modular_logits(model: Any, p: Optional[int] = None, *, template: str = "{a} {b} =",
                   batch_size: int = 4096) -> torch.Tensor:
    """Logits [p, p, p] of ``model`` over every pair ``(a, b)`` of 0..p-1, read at the final
    prompt token and restricted to the number tokens 0..p-1 (so class ``c`` = number ``c``)."""
    from arithinterp.tasks import arithmetic

    if p is None:
        p = _zoo_modulus(model)
    prompts = arithmetic(model, "+", a=range(p), b=range(p), template=template, modulus=p)
    tokens = number_tokens(model, range(p))
    out = torch.empty((len(prompts), p))
    for group in prompts.length_groups():
        for idx in group.split(batch_size):
            logits = model(prompts.unpadded(idx), return_type="logits")[:, -1]
            out[idx] = logits[:, tokens].float()
    return grid_of(prompts, out, range(p))


def _zoo_modulus(model: Any) -> int:
    from arithinterp.models.zoo import get_entry

    try:
        modulus = get_entry(str(getattr(model, "arithinterp_spec", ""))).task.modulus
    except Exception:  # not a zoo model: the caller must say p
        modulus = None
    if not modulus:
        raise AnalysisError("pass p= (the modulus); it is only known for zoo modular-addition models")
    return int(modulus)


def train_mask(name: str = "modadd-113") -> torch.Tensor:
    """Bool [p, p]: the (a, b) pairs zoo model ``name`` was trained on (its seeded split)."""
    from arithinterp.models.train import split
    from arithinterp.models.zoo import get_entry

    entry = get_entry(name)
    if not entry.task.modulus or entry.task.a_range != (0, entry.task.modulus):
        raise AnalysisError(f"zoo model {name!r} is not a modular-addition model over 0..p-1")
    p = entry.task.modulus
    mask = torch.zeros(p * p, dtype=torch.bool)
    mask[split(entry)[0]] = True  # the operand grid is a-major: problem index = a * p + b
    return mask.reshape(p, p)


def modular_losses(logits: torch.Tensor, freqs: Sequence[int], mask: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Full, restricted and excluded loss of logits [p, p, p] on the train pairs (``mask``) and
    the rest. Restricted loss is reported on all pairs and held-out pairs, excluded loss on the
    training pairs (Nanda et al. 2023)."""
    p = _check_logits(logits)
    mask = torch.ones((p, p), dtype=torch.bool) if mask is None else mask
    held_out = ~mask if (~mask).any() else mask
    return dict(
        train_loss=full_loss(logits, mask=mask),
        test_loss=full_loss(logits, mask=held_out),
        restricted_loss=restricted_loss(logits, freqs),
        restricted_test_loss=restricted_loss(logits, freqs, mask=held_out),
        excluded_loss=excluded_loss(logits, freqs, mask=mask),
        excluded_test_loss=excluded_loss(logits, freqs, mask=held_out),
    )


@dataclass(frozen=True)
class ProgressResult(Result):
    """Nanda et al. 2023 progress measures over training snapshots.

    Each measure is [n_steps], in the order of ``steps``; key frequencies ``key`` are fixed
    (from the final model unless given). See :func:`modular_losses` for the definitions.
    """

    steps: list
    train_loss: torch.Tensor
    test_loss: torch.Tensor
    restricted_loss: torch.Tensor
    restricted_test_loss: torch.Tensor
    excluded_loss: torch.Tensor
    excluded_test_loss: torch.Tensor
    key: list
    meta: dict

    MEASURES = ("train_loss", "test_loss", "restricted_loss", "restricted_test_loss", "excluded_loss",
                "excluded_test_loss")

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(
            [dict(step=s, measure=m, loss=float(getattr(self, m)[i]))
             for i, s in enumerate(self.steps) for m in self.MEASURES]
        )

    def plot(self, **kwargs):
        from arithinterp.viz.fourier import progress_figure

        return progress_figure(self, **kwargs)


def progress(
    snapshots: Optional[Sequence[int]] = None,
    name: str = "modadd-113",
    *,
    key: Optional[Sequence[int]] = None,
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    include_final: bool = True,
    progress: bool = True,
) -> ProgressResult:
    """Train / test / restricted / excluded loss of zoo model ``name`` at its training snapshots
    (default: all shipped, ``get_entry(name).snapshot_steps()``) and, with ``include_final``,
    the final model. Key frequencies are fixed from the final model's logits
    (:func:`sum_frequency_power` + :func:`key_frequencies`) unless ``key`` is given.
    RECIPES §3 (Nanda et al. 2023)."""
    from arithinterp.models import load_model
    from arithinterp.models.zoo import get_entry

    entry = get_entry(name)
    p = entry.task.modulus
    if not p:
        raise AnalysisError(f"zoo model {name!r} is not a modular-addition model")
    shipped = entry.snapshot_steps()
    steps = list(shipped if snapshots is None else snapshots)
    missing = [s for s in steps if s not in shipped]
    if missing:
        raise ConfigError(f"snapshots {missing} are not shipped for {name!r}; accepted: {shipped}")
    template = entry.task.template
    final_logits = modular_logits(load_model(f"zoo:{name}"), p, template=template)
    if key is None:
        key = key_frequencies(sum_frequency_power(final_logits), rule, factor=factor, fraction=fraction)
    key = [int(k) for k in key]
    mask = train_mask(name)
    rows, labels = [], []
    for step in tqdm(steps, desc="snapshots", disable=not progress):
        snapshot = load_model(f"zoo:{name}@step={step}")
        rows.append(modular_losses(modular_logits(snapshot, p, template=template), key, mask))
        labels.append(int(step))
    if include_final:
        final_step = int(entry.card().get("steps_run", (labels[-1] + 1) if labels else 0))
        if final_step not in labels:
            rows.append(modular_losses(final_logits, key, mask))
            labels.append(final_step)
    if not rows:
        raise ConfigError("no snapshot to measure: pass snapshots= or include_final=True")
    columns = {m: torch.tensor([r[m] for r in rows]) for m in ProgressResult.MEASURES}
    return ProgressResult(steps=labels, **columns, key=key,
                          meta=build_meta(model=None, zoo=name, p=p, n_train_pairs=int(mask.sum())))


# --- frequency filter (Zhou et al. 2024) --------------------------------------------------------


def band_frequencies(n: int, band: Union[str, Iterable[int]], split_period: float = 10.0) -> list[int]:
    """Frequencies ``k`` of a band over ``n`` numbers: ``"low"`` = period ``n/k`` above
    ``split_period``, ``"high"`` = period at most ``split_period``, or explicit ``k``s.
    The constant (``k = 0``) is never in a band."""
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


def filter_projector(unembed: torch.Tensor, freqs: Iterable[int]) -> torch.Tensor:
    """[d, d] projector onto the null space of ``M = B·F·unembedᵀ`` (Zhou et al. 2024).

    ``unembed`` [d, n] are the unembedding columns of the numbers 0..n-1 of the axis, ``F``
    the Fourier basis over them and ``B`` selects the rows of frequencies ``freqs``. For any
    ``h``, the logit lens of ``h @ P`` onto the numbers has no power at ``freqs``.
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

    ``errors`` / ``counts`` give the distribution of ``model answer − true answer`` over the
    wrong answers with the filter on (unparsable answers are counted under ``unparsable``).
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

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(dict(error=self.errors, count=self.counts,
                                 share=[c / max(sum(self.counts), 1) for c in self.counts]))

    def plot(self, **kwargs):
        from arithinterp.viz.fourier import filter_figure

        return filter_figure(self, **kwargs)


def frequency_filter(
    model: Any,
    prompts: Any,
    band: Union[str, Iterable[int]] = "low",
    *,
    site: str = "mlp_out",
    layers: Optional[Sequence[int]] = None,
    numbers: Union[int, range, None] = None,
    split_period: float = 10.0,
    position: str = "final",
    batch_size: int = 512,
) -> FilterResult:
    """Remove a frequency band from ``site`` (``"mlp_out"`` or ``"attn_out"``) at ``position``
    in ``layers`` (default all) during the forward pass and measure accuracy on ``prompts``
    and the error distribution (Zhou et al. 2024, RECIPES §2).

    Each output ``h`` is replaced by ``h @ P`` with ``P`` from :func:`filter_projector` over
    the unembeddings of ``numbers`` (default 0..max answer), so that the logit lens of the
    component output has no power in the band; ``band`` is ``"low"`` / ``"high"`` (split at
    ``split_period``, see :func:`band_frequencies`) or a list of frequencies.
    """
    from arithinterp import sites as site_lib

    if site not in COMPONENT_SITES:
        raise SiteError(f"frequency filters act on component outputs; accepted sites: {accepted(COMPONENT_SITES)}")
    layers = site_lib.check_layers(model, site, layers)
    numbers = _numbers(numbers, int(prompts.answer.max()) + 1)
    removed = band_frequencies(len(numbers), band, split_period)
    projector = filter_projector(model.W_U.detach()[:, number_tokens(model, numbers)], removed)
    if position != "final":
        raise SiteError("frequency_filter filters the final position (where the answer is read); use position='final'")
    baseline = prompts.evaluate(model, batch_size=batch_size)

    def hook(output, hook):
        # only the scored position is filtered (the component's contribution to the answer); with
        # greedy generation of later answer tokens, the last position is the one being read
        last = output[:, -1]
        output[:, -1] = (last.double() @ projector.to(output.device)).to(output.dtype)
        return output

    with torch.inference_mode(), model.hooks(fwd_hooks=[(site_lib.hook_name(site, layer), hook) for layer in layers]):
        filtered = prompts.evaluate(model, batch_size=batch_size)
    from arithinterp.tasks import UNPARSABLE

    wrong = ~filtered.correct
    parsable = wrong & (filtered.model_answer != UNPARSABLE)
    deltas = (filtered.model_answer[parsable] - prompts.answer[parsable]).tolist()
    values = sorted(set(deltas))
    return FilterResult(
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
                        n_prompts=len(prompts)),
    )
