"""Is ``x mod T`` linearly readable where the spectrum spikes at period ``T``? (Fu et al. 2026.)

A spike at period ``T`` in a spectrum over the number axis does not show that the representation
encodes ``x mod T``: Fu et al. 2026 ("convergent evolution") find such spikes even where they come
from token statistics, so next to each key period this module measures the *mod-T linear
separability*: the cross-validated accuracy of a logistic probe of ``x mod T`` from the
representation, with folds that hold out whole numbers (a probe that recognises a number it was
trained on scores nothing), chance (the largest residue class's share, about ``1/T``), a
shuffled-numbers control, and — the control every real-model spectrum needs — the same numbers for
a random-init model of the same architecture (:func:`number_separability`).

:func:`separability` works on any representation ``[N, d]`` with one number per row →
:class:`SeparabilityResult`; :func:`number_separability` reads the representation of each number
from a model and from ``random_like(model)`` (:func:`number_representations`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.fourier.number_axes import group_by_value, number_axis, number_tokens
from arithinterp.fourier.spectra import CONTEXT_SITES
from arithinterp.intervals import clip_interval, t_interval
from arithinterp.results import POSITIVE, PROBABILITY, Result, build_meta
from arithinterp.checks import check_belongs
from arithinterp.types import HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet


@dataclass(frozen=True)
class SeparabilityResult(Result):
    """Cross-validated accuracy of ``x mod T`` from a representation, per series and period.

    Periods with fewer than two numbers per residue class in training are NaN (``meta["skipped"]``).

    Attributes:
        accuracy (Float[Tensor, "series period"]): The mean over ``cv`` folds that hold out whole numbers.
        ci (Float[Tensor, "2 series period"]): Its 95% Student-t interval over folds, clipped to [0, 1].
        chance (Float[Tensor, "period"]): The largest residue class's share of the rows (about ``1/T``).
        shuffled (Float[Tensor, "series period"]): The same probe with the numbers permuted over the
            rows (every row of a number moves together).
        periods: The periods ``T``.
        series: The series' names (``"embed"``, ``"L3 resid_post"``).
        meta: Provenance, the folds, the probe, the controls and the skipped periods.
        random_init (Float[Tensor, "series period"] | None): The accuracy on a random-init model of
            the same architecture; ``None`` when no control representation was given.
        random_init_ci (Float[Tensor, "2 series period"] | None): Its interval.
    """

    accuracy: torch.Tensor
    ci: torch.Tensor
    chance: torch.Tensor
    shuffled: torch.Tensor
    periods: list
    series: list
    meta: dict
    random_init: Optional[torch.Tensor] = None
    random_init_ci: Optional[torch.Tensor] = None

    # what load checks: the axes fields share and the values they may take
    _shapes = {"accuracy": "series period", "ci": "2 series period", "chance": "period", "shuffled": "series period",
               "periods": "period", "series": "series", "random_init": "series period",
               "random_init_ci": "2 series period"}
    _legal = {"accuracy": PROBABILITY, "ci": PROBABILITY, "chance": PROBABILITY, "shuffled": PROBABILITY,
              "random_init": PROBABILITY, "random_init_ci": PROBABILITY, "periods": POSITIVE}

    def beats_controls(self) -> torch.Tensor:
        """Where the representation beats every control.

        Returns:
            Bool[Tensor, "series period"]: The interval's low end is above chance, the shuffled
            control and (when run) the random-init model's interval.
        """
        beats = (self.ci[0] > self.chance[None]) & (self.ci[0] > self.shuffled)
        if self.random_init_ci is not None:
            beats &= self.ci[0] > self.random_init_ci[1]
        return beats

    def to_frame(self):
        import pandas as pd

        beats = self.beats_controls()
        rows = []
        for s, name in enumerate(self.series):
            for p, period in enumerate(self.periods):
                row = dict(series=name, period=period, accuracy=float(self.accuracy[s, p]),
                           ci_low=float(self.ci[0, s, p]), ci_high=float(self.ci[1, s, p]),
                           chance=float(self.chance[p]), shuffled=float(self.shuffled[s, p]),
                           beats_controls=bool(beats[s, p]))
                if self.random_init is not None and self.random_init_ci is not None:
                    row.update(random_init=float(self.random_init[s, p]),
                               random_init_ci_low=float(self.random_init_ci[0, s, p]),
                               random_init_ci_high=float(self.random_init_ci[1, s, p]))
                rows.append(row)
        return pd.DataFrame(rows)

    def plot(self, **kwargs):
        return draw(self, **kwargs)


def _value_folds(values: torch.Tensor, cv: int, seed: int) -> list[torch.Tensor]:
    """Test masks [N] of ``cv`` folds, each holding out a seeded share of the distinct numbers."""
    unique = values.unique()
    order = unique[torch.randperm(len(unique), generator=torch.Generator().manual_seed(int(seed)))]
    return [torch.isin(values, chunk) for chunk in order.tensor_split(cv)]


def _fold_accuracies(X: torch.Tensor, labels: torch.Tensor, folds: list, C: float, seed: int) -> torch.Tensor:
    """Held-out accuracy [folds] of a standardised multinomial logistic probe of ``labels`` from ``X``."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X_np, y_np = X.double().numpy(), labels.numpy()
    out = []
    for test in folds:
        train = ~test
        probe = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000, random_state=seed))
        probe.fit(X_np[train.numpy()], y_np[train.numpy()])
        out.append(float(probe.score(X_np[test.numpy()], y_np[test.numpy()])))
    return torch.tensor(out, dtype=torch.float64)


def _check_periods(periods: Sequence[Any]) -> list[int]:
    out = []
    for T in periods:
        if isinstance(T, bool) or not isinstance(T, (int, float)) or T != int(T) or int(T) < 2:
            raise ConfigError(f"mod-T separability needs whole periods T ≥ 2 (x mod T is a class), got {T!r}; "
                              "a period such as 2.5 has no residue classes")
        out.append(int(T))
    if not out:
        raise ConfigError("periods is empty; pass e.g. (2, 5, 10)")
    return list(dict.fromkeys(out))


def _as_series(source: Any, what: str) -> tuple[list[torch.Tensor], list[str]]:
    if isinstance(source, torch.Tensor):
        if source.ndim != 2:
            raise AnalysisError(f"{what} must be [N, d] (one row per number), got shape {tuple(source.shape)}")
        return [source], ["representation"]
    if isinstance(source, dict) and source and all(isinstance(v, torch.Tensor) for v in source.values()):
        for name, x in source.items():
            if x.ndim != 2:
                raise AnalysisError(f"{what} series {name!r} must be [N, d], got shape {tuple(x.shape)}")
        return list(source.values()), [str(k) for k in source]
    raise AnalysisError(
        f"{what} must be a tensor [N, d] or a dict of them (name → [N, d]), got {type(source).__name__}")


@checked
def separability(
    source: Union[torch.Tensor, dict],
    values: Optional[Any] = None,
    periods: Sequence[int] = (2, 5, 10),
    *,
    control: Union[torch.Tensor, dict, None] = None,
    cv: int = 5,
    C: float = 1.0,
    seed: int = 0,
) -> SeparabilityResult:
    """Mod-T linear separability of a representation (Fu et al. 2026).

    Args:
        source: the representation [N, d] (one row per number; several prompts per number are
            fine), or a dict of series (name → [N, d], e.g. one per layer).
        values: the number of each row [N] (default ``0..N-1``).
        periods: whole periods T; the label of a row is ``value mod T``.
        control: the same rows read from a random-init model of the same architecture (same
            shape as ``source``), e.g. from :func:`number_representations` of
            ``random_like(model)``: its accuracies are ``random_init``.
        cv: folds over the distinct numbers (a number's rows are all on one side).
        C: inverse L2 strength of the logistic probe (features standardised).
        seed: folds, the shuffled control and the probe.

    Returns:
        The cross-validated accuracies and their controls, per series and period.

    Raises:
        AnalysisError: Series of different row counts, ``values`` of the wrong length, too few
            distinct numbers for the folds, a ``control`` of another shape, or non-finite values.
        ConfigError: ``cv`` is not an integer ≥ 2, or a period is not a whole number ≥ 2.
    """
    series, names = _as_series(source, "source")
    n = series[0].shape[0]
    if any(x.shape[0] != n for x in series):
        raise AnalysisError(f"every series needs the same rows; got {[x.shape[0] for x in series]}")
    values = torch.arange(n) if values is None else torch.as_tensor(values).long().flatten()
    if values.shape[0] != n:
        raise AnalysisError(f"values has {values.shape[0]} entries but the representation has {n} rows")
    periods = _check_periods(periods)
    if isinstance(cv, bool) or not isinstance(cv, int) or cv < 2:
        raise ConfigError(f"cv must be an integer number of folds ≥ 2, got {cv!r}")
    unique = values.unique()
    if len(unique) < 2 * cv:
        raise AnalysisError(f"{len(unique)} distinct numbers are too few for {cv} folds over numbers; "
                            f"need at least {2 * cv}")
    controls, _ = _as_series(control, "control") if control is not None else ([], [])
    if control is not None and [tuple(x.shape) for x in controls] != [tuple(x.shape) for x in series]:
        raise AnalysisError("control must have the shape of source (the same numbers read from a random-init "
                            f"model): {[tuple(x.shape) for x in series]}, got {[tuple(x.shape) for x in controls]}")
    for x in series + controls:
        if not torch.isfinite(x).all():
            raise AnalysisError("the representation holds NaN or infinite values; check the model's weights and dtype")
    folds = _value_folds(values, cv, seed)
    generator = torch.Generator().manual_seed(int(seed) + 1)
    relabel = unique[torch.randperm(len(unique), generator=generator)]
    shuffled_values = relabel[torch.searchsorted(unique, values)]  # each number's rows take another number
    nan = torch.full((len(series), len(periods)), float("nan"), dtype=torch.float64)
    accuracy, low, high, shuffled = nan.clone(), nan.clone(), nan.clone(), nan.clone()
    r_acc, r_low, r_high = nan.clone(), nan.clone(), nan.clone()
    chance = torch.full((len(periods),), float("nan"), dtype=torch.float64)
    skipped = []
    train_numbers = len(unique) - max(len(c) for c in unique.tensor_split(cv))
    for p, T in enumerate(periods):
        labels = values % T
        chance[p] = float(torch.bincount(labels, minlength=T).max()) / n
        if train_numbers < 2 * T:  # fewer than two training numbers per residue class
            skipped.append(dict(period=T, reason=f"{train_numbers} training numbers per fold: fewer than two per "
                                                 f"class of x mod {T}"))
            continue
        for s, X in enumerate(series):
            scores = _fold_accuracies(X, labels, folds, C, seed)
            accuracy[s, p] = scores.mean()
            low[s, p], high[s, p] = clip_interval(*t_interval(scores), "accuracy")
            shuffled[s, p] = _fold_accuracies(X, shuffled_values % T, folds, C, seed).mean()
            if controls:
                control_scores = _fold_accuracies(controls[s], labels, folds, C, seed)
                r_acc[s, p] = control_scores.mean()
                r_low[s, p], r_high[s, p] = clip_interval(*t_interval(control_scores), "accuracy")
    return SeparabilityResult(
        accuracy=accuracy.float(), ci=torch.stack([low, high]).float(), chance=chance.float(),
        shuffled=shuffled.float(), periods=periods, series=names,
        random_init=r_acc.float() if controls else None,
        random_init_ci=torch.stack([r_low, r_high]).float() if controls else None,
        meta=build_meta(n_rows=n, n_numbers=len(unique), cv=cv, C=C, seed=seed, skipped=skipped,
                        folds=f"{cv} folds over the distinct numbers (a number's rows never on both sides)",
                        probe="standardised multinomial logistic regression",
                        shuffled="numbers permuted over the rows (each number's rows take another number)",
                        random_init="the same rows from a random-init model" if controls else "not run"),
    )


@checked
def number_representations(
    model: HookedModel,
    numbers: Union[int, range] = 100,
    *,
    site: str = "embed",
    layers: Optional[Sequence[int]] = None,
    template: str = "{a}+{b}=",
    b: int = 0,
    positions: str = "a",
    prompts: Optional[PromptSet] = None,
    per_number: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Each number's representation, per series.

    ``site="embed"`` with one token per number and no ``prompts``: the embedding rows
    ``W_E[token(x)]``. Otherwise (any tokenizer) the activation at ``site`` and ``positions`` (one position), one
    series per layer: in the prompt ``template`` with a = x and ``b`` (as
    :func:`~arithinterp.fourier.context_spectrum` reads them), or, with ``prompts``, averaged over
    up to ``per_number`` of those with a = x.

    Args:
        model: The hooked model.
        numbers: The number axis (an int ``n`` for ``range(n)``).
        site: The site to read (``"embed"``, a residual or component output site).
        layers: The layers to read (default: all).
        template: The prompt template when no ``prompts`` are given.
        b: The second operand in that template.
        positions: The one position read (default ``"a"``: the number's last token, where a number of
            several tokens has been read whole).
        prompts: Prompts to read instead (e.g. a task's own few-shot prompts); every number of
            ``numbers`` needs one with a = x.
        per_number: The most prompts averaged per number.
        seed: Seeds the choice of those prompts.
        progress: Show a progress bar.

    Returns:
        ``{series name: Float[Tensor, "number d"]}`` (float64 for the embedding), rows in the order
        of ``numbers``; names ``"embed"`` or ``"L{layer} {site}"``.

    Raises:
        SiteError: A site that holds no number representation.
        ConfigError: ``per_number`` is not a positive integer.
        AnalysisError: A number without a prompt.
    """
    from arithinterp.activations import collect
    from arithinterp.errors import TokenizationError
    from arithinterp.tasks import arithmetic

    if site not in CONTEXT_SITES:
        raise SiteError(f"a number representation reads one of {accepted(CONTEXT_SITES)}, got {site!r}")
    if isinstance(per_number, bool) or not isinstance(per_number, int) or per_number < 1:
        raise ConfigError(f"per_number must be a positive integer, got {per_number!r}")
    numbers = number_axis(numbers)
    if site == "embed" and prompts is None:
        try:
            return {"embed": model.W_E.detach()[number_tokens(model, numbers)].double()}
        except TokenizationError:
            pass  # several tokens per number: read each at its last token in a prompt
    if prompts is None:
        prompts = arithmetic(model, "+", a=numbers, b=[b], template=template)
    else:
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(int(seed)))
        a = prompts.a[order]
        rank = torch.zeros_like(a)
        for value in a.unique():  # the how-many-th prompt with this a each one is, in the seeded order
            same = a == value
            rank[same] = torch.arange(int(same.sum()))
        prompts = prompts[order[rank < per_number]]
    acts = collect(model, prompts, sites=[site], layers=layers, positions=[positions], progress=progress)
    positions = acts.positions[0]
    return {(f"L{layer} {site}" if site != "embed" else "embed"):
            group_by_value(prompts.a, acts.get(site, layer, positions), numbers).reshape(len(numbers), -1)
            for layer in acts.layers}


@checked
def number_separability(
    model: HookedModel,
    numbers: Union[int, range] = 100,
    periods: Sequence[int] = (2, 5, 10),
    *,
    site: str = "embed",
    layers: Optional[Sequence[int]] = None,
    template: str = "{a}+{b}=",
    b: int = 0,
    positions: str = "a",
    cv: int = 5,
    seed: int = 0,
    progress: bool = True,
) -> SeparabilityResult:
    """:func:`separability` of each number's representation in ``model``
    (:func:`number_representations`) against the same representation in
    ``random_like(model, seed)``: a spectrum's spike at period T is a finding about the trained
    model only when ``x mod T`` is readable there beyond chance, shuffled numbers and the random-init
    model.

    Args:
        model: The hooked model.
        numbers: The number axis.
        periods: Whole periods ``T``.
        site: As for :func:`number_representations`.
        layers: As for :func:`number_representations`.
        template: As for :func:`number_representations`.
        b: As for :func:`number_representations`.
        positions: As for :func:`number_representations`.
        cv: Folds over the distinct numbers.
        seed: Seeds the random-init model, the folds and the probe.
        progress: Show a progress bar.

    Returns:
        The separability result, ``random_init`` filled.
    """
    from arithinterp.models import random_like

    check_belongs(model, "fourier.number_separability")

    kw: dict[str, Any] = dict(site=site, layers=layers, template=template, b=b, positions=positions, progress=progress)
    trained = number_representations(model, numbers, **kw)
    control = number_representations(random_like(model, seed), numbers, **kw)
    axis = number_axis(numbers)
    result = separability(trained, torch.tensor(list(axis)), periods, control=control, cv=cv, seed=seed)
    result.meta.update(build_meta(model, numbers=axis, site=site, position=positions, template=template))
    return result


@checked
def integer_periods(periods: Sequence[float], n: int, tolerance: float = 1e-6) -> list[int]:
    """The whole periods that leave at least two numbers per residue class.

    Args:
        periods: Candidate periods (e.g. a spectrum's key periods ``n / k``).
        n: The number of numbers.
        tolerance: How far from a whole number a period may be.

    Returns:
        The whole periods in ``2..n // 2``, in order, each once.
    """
    out = []
    for T in periods:
        rounded = round(float(T))
        if math.isfinite(float(T)) and abs(float(T) - rounded) < tolerance and 2 <= rounded <= n // 2:
            out.append(int(rounded))
    return list(dict.fromkeys(out))
