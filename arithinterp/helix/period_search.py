"""Period search (RECIPES §1): the best subset of candidate periods of each size, scored by
held-out R² or by the causal effect of patching the fitted helix in, :func:`search_periods` →
:class:`PeriodSearchResult`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from tqdm.auto import tqdm

from arithinterp.errors import AnalysisError, ConfigError, SiteError
from arithinterp.helix.causal import _stacked_effects
from arithinterp.helix.design import DEFAULT_PERIODS, _check_periods, _pca, basis, split_by_value
from arithinterp.helix.fitting import Values, _activation_matrix, _fit_core, _resolve_values
from arithinterp.results import Result, build_meta


# --- period search -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeriodSearchResult(Result):
    """Score of every period subset tried (``subsets[i]``, ``scores[i]``) and the best subset of
    each size (``best[size]`` in ``sizes`` order). ``criterion`` is ``"held-out R²"`` or
    ``"causal effect"`` (mean corrupt-answer logit change when the fitted helix is patched in)."""

    subsets: list
    scores: torch.Tensor
    sizes: list
    best: list
    best_scores: torch.Tensor
    criterion: str
    meta: dict

    def to_frame(self):
        import pandas as pd

        best = {tuple(b) for b in self.best}
        return pd.DataFrame([dict(periods=", ".join(f"{T:g}" for T in s), size=len(s), score=float(self.scores[i]),
                                  best_of_size=tuple(s) in best) for i, s in enumerate(self.subsets)])

    def plot(self, **kwargs):
        from arithinterp.viz.fourier import period_search_figure

        return period_search_figure(self, **kwargs)


def search_periods(
    acts_or_tensor: Any,
    values: Values,
    candidates: Sequence[float] = DEFAULT_PERIODS,
    sizes: Optional[Sequence[int]] = None,
    *,
    model: Any = None,
    pairs: Any = None,
    layer: Optional[int] = None,
    position: str = "a",
    kind: str = "helix",
    n_pca: int = 100,
    holdout: float = 0.2,
    random_state: int = 0,
    site: Optional[str] = None,
    batch_size: int = 256,
    progress: bool = True,
) -> PeriodSearchResult:
    """The best subset of ``candidates`` of each size (default all sizes), RECIPES §1.

    Without a model, subsets are scored by held-out R² in PCA space (the PCA and split are
    shared, so the scores are comparable); with ``model`` and ``pairs``, by the causal effect of
    patching the fitted helix in at ``blocks.{layer}.hook_resid_pre`` / ``position``
    (the ``kind`` row of :func:`patch_test`, all subsets in one batched pass).
    """
    candidates = _check_periods(candidates)
    if len(set(candidates)) != len(candidates):
        raise ConfigError(f"candidate periods repeat: {candidates}")
    sizes = list(range(1, len(candidates) + 1)) if sizes is None else sorted({int(s) for s in sizes})
    if not sizes or any(not 1 <= s <= len(candidates) for s in sizes):
        raise ConfigError(f"sizes must be within 1..{len(candidates)}, got {sizes}")
    if (model is None) != (pairs is None):
        raise ConfigError("a causal search needs both model= and pairs=; pass neither to score by held-out R²")
    acts, site, layer_found, _, prompts = _activation_matrix(acts_or_tensor, site, layer, position)
    x, names = _resolve_values(values, prompts)
    if x.shape[0] != acts.shape[0]:
        raise AnalysisError(f"values has {x.shape[0]} rows but there are {acts.shape[0]} activations")
    subsets = [list(s) for size in sizes for s in itertools.combinations(candidates, size)]
    train = split_by_value(x, holdout, random_state)
    max_value = x.max(0).values.clamp_min(1.0).tolist()
    mean, comps, ev = _pca(acts[train], n_pca)
    if model is None:
        scores = []
        for subset in tqdm(subsets, desc="period subsets", disable=not progress):
            scores.append(_fit_core(acts, x, train, mean, comps, ev, kind, subset, None, names, max_value)[2])
        criterion = "held-out R²"
    else:
        from arithinterp import sites as site_lib

        layer = layer_found if layer is None else layer
        if layer is None:
            raise SiteError("a causal search needs layer=")
        hook = site_lib.hook_name("resid_pre", site_lib.check_layers(model, "resid_pre", [layer])[0])
        corrupt_values = pairs.corrupt.label(position).double()
        replacements = []
        for subset in subsets:
            coef = _fit_core(acts, x, train, mean, comps, ev, kind, subset, None, names, max_value)[0]
            design, _ = basis(corrupt_values, kind, subset, max_value=max_value, names=names)
            replacements.append((design @ coef @ comps + mean).float())
        scores = _stacked_effects(model, pairs, hook, position, replacements, batch_size).mean(1).tolist()
        criterion = "causal effect"
    scores = torch.tensor(scores)
    best, best_scores = [], []
    for size in sizes:
        idx = [i for i, s in enumerate(subsets) if len(s) == size]
        i = max(idx, key=lambda j: float(scores[j]))
        best.append(subsets[i])
        best_scores.append(float(scores[i]))
    return PeriodSearchResult(
        subsets=subsets, scores=scores, sizes=sizes, best=best, best_scores=torch.tensor(best_scores),
        criterion=criterion,
        meta=build_meta(model, candidates=candidates, kind=kind, n_pca=comps.shape[0], holdout=holdout,
                        random_state=random_state, layer=layer if model is not None else layer_found),
    )
