"""Period search (Kantamneni & Tegmark 2025): the best subset of candidate periods of each size, scored by
held-out R² or by the causal effect of patching the fitted helix in, :func:`search_periods` →
:class:`PeriodSearchResult`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError, SiteError
from arithinterp.helix.causal import stacked_effects
from arithinterp.helix.design import DEFAULT_PERIODS, check_periods, pca_basis, basis
from arithinterp.helix.fitting import (
    LEAVE_ONE_OUT,
    Values,
    activation_matrix,
    check_identifiable,
    cross_validated,
    fit_core,
    fold_pcas,
    value_folds,
    resolve_values,
    shuffled_values,
)
from arithinterp.checks import check_fingerprint
from arithinterp.progress import progress_bar
from arithinterp.results import POSITIVE, Result, build_meta, made_from
from arithinterp.types import HookedModel, NonNegativeInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs


# --- period search -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeriodSearchResult(Result):
    """The score of every period subset tried, and the best subset of each size.

    Attributes:
        subsets: The period subsets tried.
        scores (Float[Tensor, "subset"]): Their scores (NaN where the basis interpolates a fold).
        sizes: The subset sizes searched.
        best: The best subset of each size, in ``sizes`` order.
        best_scores (Float[Tensor, "size"]): Their scores.
        criterion: ``"held-out R²"`` or ``"causal effect"`` (mean corrupt-answer logit change when
            the fitted helix is patched in).
        meta: Provenance, the validation scheme and, for the R² criterion, the shuffled-values control.
    """

    subsets: list
    scores: torch.Tensor
    sizes: list
    best: list
    best_scores: torch.Tensor
    criterion: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"subsets": "subset", "scores": "subset", "sizes": "size", "best": "size", "best_scores": "size"}
    _legal = {"sizes": POSITIVE}

    def to_frame(self):
        import pandas as pd

        best = {tuple(b) for b in self.best}
        return pd.DataFrame([dict(periods=", ".join(f"{T:g}" for T in s), size=len(s), score=float(self.scores[i]),
                                  best_of_size=tuple(s) in best) for i, s in enumerate(self.subsets)])

    def plot(self, **kwargs):
        return draw(self, **kwargs)


@checked
def search_periods(
    acts: Any,
    values: Values,
    candidates: Sequence[float] = DEFAULT_PERIODS,
    sizes: Optional[Sequence[int]] = None,
    *,
    model: Optional[HookedModel] = None,
    pairs: Optional[PromptPairs] = None,
    layer: Optional[int] = None,
    positions: str = "a",
    kind: str = "helix",
    n_pca: int = 100,
    holdout: float = 0.2,
    seed: int = 0,
    site: Optional[str] = None,
    batch_size: int = 256,
    progress: bool = True,
    min_test_values: int = 5,
    n_shuffles: NonNegativeInt = 1,
) -> PeriodSearchResult:
    """The best subset of ``candidates`` of each size (default all sizes), as Kantamneni &
    Tegmark 2025 choose helix periods.

    Without a model, subsets are scored by held-out R² in PCA space (the PCA and split are
    shared, so the scores are comparable; few values — fewer than ``min_test_values`` held out —
    are validated leave-one-value-out, see :func:`fit`); with ``model`` and ``pairs``, by the
    causal effect of patching the fitted helix in at ``blocks.{layer}.hook_resid_pre`` /
    ``positions`` (the ``kind`` row of :func:`patch_test`, all subsets in one batched pass).

    A subset whose basis fits any function of a fold's training values exactly is not scored
    (NaN): its held-out R² would say nothing. For the R² criterion the search is repeated on
    ``n_shuffles`` copies of the values shuffled across rows (the null of the same shape), and
    ``meta["control"]`` gives the best score of each size there and whether the real best beats
    every null best of its size. (The causal criterion's null is :func:`patch_test`'s helix of
    shuffled values.)

    Args:
        acts: Activations ``[n, d]`` or an ``Activations``, as for :func:`fit`.
        values: As for :func:`fit`.
        candidates: The candidate periods, each once.
        sizes: The subset sizes to search (default: all).
        model: The hooked model, for the causal criterion (with ``pairs``).
        pairs: Clean / corrupt pairs, for the causal criterion (with ``model``).
        layer: The layer read and, causally, patched at ``resid_pre``.
        positions: The one position read and patched.
        kind: The basis kind.
        n_pca: PCA components kept.
        holdout: As for :func:`fit`.
        seed: Seeds the split and the controls.
        site: The site to read from an ``Activations``.
        batch_size: Prompts per forward of the causal criterion.
        progress: Show a progress bar.
        min_test_values: As for :func:`fit`.
        n_shuffles: Copies of shuffled values searched as the R² criterion's null.

    Returns:
        Every subset's score and the best subset of each size.

    Raises:
        ConfigError: Repeated candidates, sizes out of range, or only one of ``model`` / ``pairs``.
        AnalysisError: Rows of values and activations that differ in number.
        SiteError: A causal search without a layer.
    """
    candidates = check_periods(candidates)
    if len(set(candidates)) != len(candidates):
        raise ConfigError(f"candidate periods repeat: {candidates}")
    sizes = list(range(1, len(candidates) + 1)) if sizes is None else sorted({int(s) for s in sizes})
    if not sizes or any(not 1 <= s <= len(candidates) for s in sizes):
        raise ConfigError(f"sizes must be within 1..{len(candidates)}, got {sizes}")
    if (model is None) != (pairs is None):
        raise ConfigError("a causal search needs both model= and pairs=; pass neither to score by held-out R²")
    provenance = made_from(acts)  # the model the activations were collected on
    if model is not None:
        check_fingerprint(model, provenance.get("fingerprint"), "activations", "helix.search_periods",
                          provenance.get("model"))
    acts, site, layer_found, _, prompts = activation_matrix(acts, site, layer, positions)
    x, names = resolve_values(values, prompts)
    if x.shape[0] != acts.shape[0]:
        raise AnalysisError(f"values has {x.shape[0]} rows but there are {acts.shape[0]} activations")
    subsets = [list(s) for size in sizes for s in itertools.combinations(candidates, size)]
    folds, validation = value_folds(x, holdout, seed, min_test_values)
    train = torch.ones(x.shape[0], dtype=torch.bool) if validation == LEAVE_ONE_OUT else folds[0]
    max_value = x.max(0).values.clamp_min(1.0).tolist()
    mean, comps, ev = pca_basis(acts[train], n_pca)
    if model is None:
        pcas = fold_pcas(acts, folds, n_pca) if validation == LEAVE_ONE_OUT else []

        def held_out_r2(values, subset) -> float:
            basis_kw: dict[str, Any] = dict(kind=kind, periods=subset, max_value=max_value, degree=None, names=names)
            try:
                check_identifiable(values, folds, basis_kw)
            except AnalysisError:
                return float("nan")
            if validation == LEAVE_ONE_OUT:
                n_top = basis(values[:1], **basis_kw)[0].shape[1] - 1
                return cross_validated(acts, values, folds, pcas, basis_kw, mean, comps, n_top)[1]
            return fit_core(acts, values, train, mean, comps, ev, kind, subset, None, names, max_value)[2]

        scores = [held_out_r2(x, subset)
                  for subset in progress_bar(subsets, desc="period subsets", disable=not progress)]
        null = [[held_out_r2(shuffled, subset) for subset in subsets]
                for shuffled in shuffled_values(x, n_shuffles, seed)]
        criterion = "held-out R²"
    else:
        from arithinterp import sites as site_lib

        assert pairs is not None  # given together with model (checked above)
        layer = layer_found if layer is None else layer
        if layer is None:
            raise SiteError("a causal search needs layer=")
        hook = site_lib.hook_name("resid_pre", site_lib.check_layers(model, "resid_pre", [layer])[0])
        corrupt_values = pairs.corrupt.label(positions).double()
        replacements = []
        for subset in subsets:
            coef = fit_core(acts, x, train, mean, comps, ev, kind, subset, None, names, max_value)[0]
            design, _ = basis(corrupt_values, kind, subset, max_value=max_value, names=names)
            replacements.append((design @ coef @ comps + mean).float())
        scores = stacked_effects(model, pairs, hook, positions, replacements, batch_size).mean(1).tolist()
        null = []
        criterion = "causal effect"
    scores = torch.tensor(scores)

    def best_of(values: torch.Tensor, size: int) -> int:
        idx = [i for i, s in enumerate(subsets) if len(s) == size and not math.isnan(float(values[i]))]
        if not idx:
            raise AnalysisError(
                f"no subset of {size} periods can be validated on these {len(x[:, 0].unique())} values (each fits "
                "any function of a fold's training values exactly); ask for smaller sizes= or give more values"
            )
        return max(idx, key=lambda j: float(values[j]))

    best, best_scores = [], []
    for size in sizes:
        i = best_of(scores, size)
        best.append(subsets[i])
        best_scores.append(float(scores[i]))
    control: dict[str, Any] = dict(null="values shuffled across rows (distinct values permuted)", n_shuffles=len(null))
    if null:
        null_best = [[float(torch.tensor(n)[best_of(torch.tensor(n), size)]) for n in null] for size in sizes]
        control.update(best_scores=[sum(b) / len(b) for b in null_best],
                       beats_null=[best_scores[j] > max(b) for j, b in enumerate(null_best)])
    return PeriodSearchResult(
        subsets=subsets, scores=scores, sizes=sizes, best=best, best_scores=torch.tensor(best_scores),
        criterion=criterion,
        meta=build_meta(model, **({} if model is not None else provenance), candidates=candidates, kind=kind,
                        n_pca=comps.shape[0], holdout=holdout,
                        seed=seed, layer=layer if model is not None else layer_found,
                        validation=validation, control=control),
    )
