"""Attribution patching and integrated gradients, and their comparison with exact patching."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from arithinterp.checks import check_belongs, check_choice, check_pairs
from arithinterp import sites as site_lib
from arithinterp.drawing import draw
from arithinterp.engine import Read, Write
from arithinterp.engine.patches import per_unit
from arithinterp.engine import run as engine_run
from arithinterp.engine.budget import (
    backward_bytes_per_prompt,
    chunk_for,
    forward_logits_bytes_per_prompt,
    memory_budget,
)
from arithinterp.errors import AnalysisError, ConfigError, ModelMismatchError, SiteError, accepted
from arithinterp.metrics import DIRECTIONS, metric_context, metric_fn
from arithinterp.patching.core import (
    ATTRIBUTE_SITES,
    ATTRIBUTION_METHODS,
    UNIT_SITES,
    Cells,
    PatchResult,
    patch_result,
    resolve_units,
    warn_first_token_only,
)
from arithinterp.patching.attribution_result import AttributionResult
from arithinterp.patching.exact import activation_patching
from arithinterp.progress import progress_bar
from arithinterp.results import CORRELATION, Result, build_meta, made_from
from arithinterp.tasks import resolve_positions
from arithinterp.types import ByteSize, HookedModel, IntegrationSteps, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs


def _grad_site(site: str, layer: int) -> tuple[str, int]:
    # d metric / d resid_mid equals d metric / d attn_out (resid_mid = resid_pre + attn_out); the
    # bridge's resid_mid alias only feeds ln2, so its gradient would miss the skip connection
    return ("attn_out" if site == "resid_mid" else site, layer)


def _cell_scores(site: str, contribution: torch.Tensor, pos: Optional[torch.Tensor], units: list) -> torch.Tensor:
    """Sum ``grad · delta`` over each cell: ``[B, T, ...]`` (patterns ``[B, H, T, T]``) -> ``[B, n_pos?, n_units?]``."""
    per = per_unit(site, contribution, torch.sum)  # [B, T, units]
    if site not in UNIT_SITES:
        per = per[..., 0]  # [B, T]
    if units:
        per = per[..., units]
    if pos is None:
        return per.sum(1)
    rows = torch.arange(per.shape[0], device=per.device)[:, None]
    return per[rows, pos.T.to(per.device)]  # [B, n_pos, ...]


def _pairs_per_batch(model: HookedModel, sites: list[str], n_reads: int, pairs: PromptPairs, budget: int) -> int:
    """Pairs whose forward kept for the backward, the source run and the reads fit ``budget`` bytes:
    each of ``n_reads`` site-layers holds four float32 activations (the source's, the base's, and
    the gradient run's zero probe and gradient)."""
    seq_len = max(int(pairs.clean.lengths.max()), int(pairs.corrupt.lengths.max()))
    widest = max(seq_len * model.cfg.n_heads if site == "pattern" else math.prod(site_lib.site_shape(model, site))
                 for site in sites)
    per_pair = (backward_bytes_per_prompt(model, seq_len) + forward_logits_bytes_per_prompt(model, seq_len)
                + 4 * 4 * n_reads * seq_len * widest)
    return chunk_for(budget, per_pair, "pair's forward and backward", high=1024)


@checked
def attribute(
    model: HookedModel,
    pairs: PromptPairs,
    site: str = "resid_pre",
    *,
    method: str = "attribution",
    ig_steps: IntegrationSteps = 10,
    metric: Union[str, Callable] = "logit_diff",
    layers: Optional[Sequence[int]] = None,
    positions=None,
    heads: Optional[Sequence[int]] = None,
    neurons: Optional[Sequence[int]] = None,
    direction: str = "denoise",
    normalize: bool = False,
    per_position: bool = True,
    batch_size: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    seed: int = 0,
    progress: bool = True,
) -> PatchResult:
    """Attribution patching: a first-order estimate of every cell of :func:`activation_patching` at once.

    ``method="attribution"``: the estimated effect of a cell is ``Σ grad · (source − base)`` over
    the cell's activation, with the gradient of the metric taken on the base run (one forward for
    the source activations, one forward and one backward for the base run, per batch — two forwards
    and one backward for every cell; Nanda 2023, "Attribution patching"; Nikankin et al. 2025 rank
    neurons this way). ``"integrated-gradients"``: the gradient is averaged over ``ig_steps`` runs
    whose token embeddings are interpolated from the base to the source prompt (midpoint rule; the
    EAP-IG variant of Hanna et al. 2024). :func:`attribute_sites` estimates several sites from the
    same passes.

    The values are ``base metric + estimated effect`` so they sit on the same scale as the exact
    sweep's. Gradients are taken at the engine's reads (:func:`arithinterp.engine.run` with
    ``metric``), so frozen models (``requires_grad=False``) work at every layer, layer 0 included,
    and the model's flags are left as they are; half-precision models run in their dtype with the
    metric, the gradients and the scores in float32.

    Args:
        model: The hooked model.
        pairs: Clean / corrupt prompt pairs.
        site: The site (any of :data:`ATTRIBUTE_SITES`).
        method: ``"attribution"`` or ``"integrated-gradients"``.
        ig_steps: Interpolation steps of ``"integrated-gradients"``.
        metric: As for :func:`activation_patching`.
        layers: Layers to score (default: all).
        positions: As for :func:`activation_patching`.
        heads: Heads to score at ``attn_z`` / ``pattern`` (default: all).
        neurons: Neurons to score at ``mlp_pre`` / ``mlp_post`` (default: all).
        direction: ``"denoise"`` or ``"noise"``.
        normalize: Normalize as :func:`activation_patching` does.
        per_position: False scores every position at once (no position axis).
        batch_size: Pairs per batch, or None: as many as fit ``max_memory`` with a forward kept for
            the backward and the site's reads four times over.
        max_memory: Bytes one batch may use (:func:`arithinterp.engine.budget.memory_budget`; default
            from the model's size and the machine's available memory).
        seed: Seeds the bootstrap interval.
        progress: Show a progress bar.

    Returns:
        The estimate as a :class:`PatchResult` (``values [pair, layer, position?, head_or_neuron?]``).

    Raises:
        SiteError: An unknown site, or a layer, position, head or neuron out of range.
        ConfigError: An unknown method, direction or metric, or a batch too large for ``max_memory``.
        AnalysisError: Pairs that cannot be patched.
        ModelMismatchError: The pairs were built for another model.
    """
    check_belongs(model, "patching.attribute", pairs=pairs)
    return _attribute(model, pairs, [site], method, ig_steps, metric, layers, positions, heads, neurons, direction,
                      normalize, per_position, batch_size, max_memory, seed, progress)[site]


@checked
def attribute_sites(
    model: HookedModel,
    pairs: PromptPairs,
    sites: Sequence[str] = ("resid_pre",),
    *,
    method: str = "attribution",
    ig_steps: IntegrationSteps = 10,
    metric: Union[str, Callable] = "logit_diff",
    layers: Optional[Sequence[int]] = None,
    positions=None,
    heads: Optional[Sequence[int]] = None,
    neurons: Optional[Sequence[int]] = None,
    direction: str = "denoise",
    normalize: bool = False,
    per_position: bool = True,
    batch_size: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    seed: int = 0,
    progress: bool = True,
) -> AttributionResult:
    """:func:`attribute` at several sites from one set of passes (one forward for the source
    activations, one forward and backward per batch, whatever the number of sites).

    Args:
        model: The hooked model.
        pairs: Clean / corrupt prompt pairs.
        sites: Site names (any of :data:`ATTRIBUTE_SITES`), each once. ``heads`` apply to
            ``attn_z`` / ``pattern``, ``neurons`` to ``mlp_pre`` / ``mlp_post``.
        method: As for :func:`attribute`.
        ig_steps: As for :func:`attribute`.
        metric: As for :func:`attribute`.
        layers: As for :func:`attribute`.
        positions: As for :func:`attribute`.
        heads: As for :func:`attribute`.
        neurons: As for :func:`attribute`.
        direction: As for :func:`attribute`.
        normalize: As for :func:`attribute`.
        per_position: As for :func:`attribute`.
        batch_size: As for :func:`attribute`.
        max_memory: As for :func:`attribute`.
        seed: As for :func:`attribute`.
        progress: As for :func:`attribute`.

    Returns:
        The estimates per site as an :class:`AttributionResult` (``result[site]`` is that site's
        :class:`PatchResult`).

    Raises:
        SiteError: An empty or unknown site list, or a layer, position, head or neuron out of range.
        ConfigError: An unknown method, direction or metric, a site named twice, or a batch too
            large for ``max_memory``.
        AnalysisError: Pairs that cannot be patched.
        ModelMismatchError: The pairs were built for another model.
    """
    check_belongs(model, "patching.attribute_sites", pairs=pairs)
    site_list = list(sites)
    if len(set(site_list)) < len(site_list):
        raise ConfigError(f"sites={site_list!r} names a site twice; name each once")
    results = _attribute(model, pairs, site_list, method, ig_steps, metric, layers, positions, heads, neurons,
                         direction, normalize, per_position, batch_size, max_memory, seed, progress)
    return AttributionResult.of([results[site] for site in site_list])


def _attribute(model: HookedModel, pairs: PromptPairs, site_list: list[str], method: str, ig_steps: int, metric,
               layers, positions, heads, neurons, direction: str, normalize: bool, per_position: bool,
               batch_size: Optional[int], max_memory, seed: int, progress: bool) -> dict[str, PatchResult]:
    """The estimates of :func:`attribute` at every site of ``site_list``: ``{site: PatchResult}``."""
    check_pairs(pairs)
    warn_first_token_only(pairs, "attribute")
    if not site_list:
        raise SiteError(f"sites is empty; accepted sites: {accepted(ATTRIBUTE_SITES)}")
    for site in site_list:
        site_lib.check_site(site)
        if site not in ATTRIBUTE_SITES:
            raise SiteError(f"site {site!r} cannot be attributed; accepted: {accepted(ATTRIBUTE_SITES)}")
    check_choice("method", method, ATTRIBUTION_METHODS)
    check_choice("direction", direction, DIRECTIONS)
    budget = memory_budget(model, max_memory)
    fn = metric_fn(metric)
    plans = {}
    for site in site_list:
        layer_list = site_lib.check_layers(model, site, layers)
        unit_kind, units = resolve_units(model, site, heads if site in ("attn_z", "pattern") else None,
                                         neurons if site in ("mlp_pre", "mlp_post") else None)
        labels, pos_index = resolve_positions(pairs, positions) if per_position else ([], None)
        plans[site] = (layer_list, unit_kind, units, labels, pos_index)
    n = len(pairs)
    scores = {
        site: torch.empty(n, len(plan[0]), *((len(plan[3]),) if plan[3] else ()), *((len(plan[2]),) if plan[2] else ()))
        for site, plan in plans.items()
    }
    clean_base, corrupt_base = torch.empty(n), torch.empty(n)
    base_set, source_set = (pairs.corrupt, pairs.clean) if direction == "denoise" else (pairs.clean, pairs.corrupt)
    # the activations to difference, and the points to differentiate at (one read per hook)
    acts = [(site, layer) for site, plan in plans.items() for layer in plan[0]]
    grad_at = {cell: _grad_site(*cell) for cell in acts}
    grad_points = list(dict.fromkeys(grad_at.values()))
    if batch_size is None:
        batch_size = _pairs_per_batch(model, site_list, len(acts), pairs, budget)
    batches = [b for group in pairs.clean.length_groups() for b in group.split(batch_size)]
    alphas = [0.0] if method == "attribution" else [(k + 0.5) / ig_steps for k in range(ig_steps)]
    for idx in progress_bar(batches, desc="attribute", disable=not progress):
        # the last batch's reads and gradients go before this batch's are taken, not onto its peak
        source = source_acts = run = base_acts = None
        grads: dict = {}
        base_tokens, source_tokens = base_set.unpadded(idx), source_set.unpadded(idx)
        offset = base_set.offset(idx)
        interpolating = method == "integrated-gradients"
        embed = [Read("embed")] if interpolating else []
        source = engine_run(model, source_tokens, reads=[Read(*cell) for cell in acts] + embed)
        source_logits = source.logits
        assert source_logits is not None  # engine runs keep the final logits by default
        source_acts = dict(zip(acts, source.reads))
        base_acts, ctx, base_logits = {}, None, None
        base_embed = source_embed = None
        if interpolating:  # the interpolated runs are not the base run: run it too
            base = engine_run(model, base_tokens, reads=[Read(*cell) for cell in acts] + embed)
            base_acts, base_logits = dict(zip(acts, base.reads)), base.logits
            assert base_logits is not None  # engine runs keep the final logits by default
            ctx = metric_context(pairs[idx], direction, base_logits, source_logits, device=base_logits.device)
            base_embed, source_embed = base.reads[-1], source.reads[-1]
        for alpha in alphas:
            interventions = []
            if alpha:  # token embeddings on the straight line from the base to the source prompt
                assert base_embed is not None and source_embed is not None  # alpha > 0 only when interpolating
                interventions = [Write("embed", 0, value=base_embed + alpha * (source_embed - base_embed))]
            # in plain attribution the gradient run is the base run: its reads are the base activations
            reads = grad_points + ([] if interpolating else [cell for cell in acts if cell not in grad_points])
            box = {}

            # final-position logits [B, V] (float32) -> the metric [B]
            def objective(final, box=box, source_logits=source_logits):
                if "ctx" not in box:
                    box["ctx"] = ctx if ctx is not None else metric_context(
                        pairs[idx], direction, final.detach(), source_logits, device=final.device
                    )
                box["logits"] = final.detach()
                return fn(final, box["ctx"])

            run = engine_run(model, base_tokens, interventions, [Read(*cell) for cell in reads], metric=objective)
            assert run.grads is not None  # a run with a metric returns the reads' gradients
            for point, grad in zip(grad_points, run.grads):
                if grad is not None:
                    grads[point] = grads.get(point, 0) + grad / len(alphas)
            if not interpolating:
                base_acts, base_logits, ctx = dict(zip(reads, run.reads)), box["logits"], box["ctx"]
        # the base logits and context come from the base run, or from the gradient run when it is the base run
        assert base_logits is not None and ctx is not None
        base_metric, source_metric = fn(base_logits, ctx).float(), fn(source_logits, ctx).float()
        if direction == "denoise":
            clean_base[idx], corrupt_base[idx] = source_metric.cpu(), base_metric.cpu()
        else:
            clean_base[idx], corrupt_base[idx] = base_metric.cpu(), source_metric.cpu()
        for site, (layer_list, _, units, _labels, pos_index) in plans.items():
            pos = None if pos_index is None else pos_index[:, idx] - offset
            for i, layer in enumerate(layer_list):
                delta = source_acts[site, layer].float() - base_acts[site, layer].float()
                grad = grads.get(grad_at[site, layer])  # None: nothing downstream reads it
                contribution = torch.zeros_like(delta) if grad is None else grad.reshape(delta.shape) * delta
                if site == "attn_z":  # per head, whether the model fired it flat or split
                    contribution = contribution.reshape(*contribution.shape[:2], model.cfg.n_heads, -1)
                value = _cell_scores(site, contribution, pos, units) + base_metric.reshape(
                    -1, *([1] * (scores[site].ndim - 2))
                )
                scores[site][idx, i] = value.cpu()
    results = {}
    for site, (layer_list, unit_kind, units, labels, pos_index) in plans.items():
        cells = Cells(layer_list, len(labels), units)
        results[site] = patch_result(
            model, pairs, scores[site], clean_base, corrupt_base, cells, labels, pos_index, site, metric, direction,
            method, normalize, seed, dict(unit=unit_kind, ig_steps=ig_steps if method != "attribution" else None),
        )
    return results


@dataclass(frozen=True)
class ComparisonResult(Result):
    """How well an approximation (attribution) tracks exact patching, per site.

    Attributes:
        sites: The compared sites.
        correlation: Per site, the Pearson correlation of the cell means.
        pair_correlation: Per site, the Pearson correlation of every (pair, cell) value.
        exact: Per site, the exact cell means, flattened.
        approx: Per site, the approximate cell means, flattened.
        cells: Per site, the cells' labels (``"L3 pos a"``), for the scatter plot.
        method: The approximation's method.
        meta: Provenance and the number of pairs.
    """

    sites: list
    correlation: list
    pair_correlation: list
    exact: list
    approx: list
    cells: list
    method: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"sites": "site", "correlation": "site", "pair_correlation": "site", "exact": "site", "approx": "site",
               "cells": "site"}
    _legal = {"correlation": CORRELATION, "pair_correlation": CORRELATION}

    def to_frame(self):
        import pandas as pd

        rows = []
        for site, exact, approx, labels in zip(self.sites, self.exact, self.approx, self.cells):
            rows += [dict(site=site, cell=label, exact=e, approx=a) for label, e, a in zip(labels, exact, approx)]
        return pd.DataFrame(rows)

    def plot(self, **kwargs):
        return draw(self, **kwargs)


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    denominator = float(x.norm() * y.norm())
    return float((x * y).sum()) / denominator if denominator > 0 else float("nan")


def _cell_labels(result: PatchResult) -> list[str]:
    import itertools

    names = {"layer": "L", "position": "pos ", "head": "H", "neuron": "N"}
    return [
        " ".join(f"{names[a]}{v}" for a, v in zip(result.axes, combo))
        for combo in itertools.product(*(result.axis_labels(a) for a in result.axes))
    ]


@checked
def compare(exact: Union[PatchResult, AttributionResult, dict],
            approx: Union[PatchResult, AttributionResult, dict]) -> ComparisonResult:
    """Correlation of an approximation with exact patching, per site.

    Args:
        exact: A :class:`PatchResult` of exact patching, several sites' (an
            :class:`AttributionResult`), or a dict of PatchResults keyed by site.
        approx: The approximation's results of the same cells (:func:`attribute` or
            :func:`attribute_sites`).

    Returns:
        The correlations; the inputs are left as they are.

    Raises:
        AnalysisError: An input is not a PatchResult (or a non-empty dict of them), or the two
            cover different sites or cells.
        ModelMismatchError: The two were made on different models (their weights' fingerprints differ).
    """
    def by_site(name: str, given) -> dict:
        if isinstance(given, AttributionResult):
            return {site: given[site] for site in given.sites}
        parts = given.values() if isinstance(given, dict) else [given]
        if not parts or not all(isinstance(part, PatchResult) for part in parts):
            raise ConfigError(f"{name} must be a PatchResult, an AttributionResult or a non-empty dict of "
                              f"PatchResults keyed by site, got {type(given).__name__}")
        return given if isinstance(given, dict) else {given.site: given}

    exact, approx = by_site("exact", exact), by_site("approx", approx)
    if set(exact) != set(approx):
        raise AnalysisError(f"exact and approximate results cover different sites: {sorted(exact)} vs {sorted(approx)}")
    made = {made_from(part).get("fingerprint") for part in [*exact.values(), *approx.values()]} - {None}
    if len(made) > 1:
        raise ModelMismatchError(f"compare: the results were made on different models (weight fingerprints "
                                 f"{sorted(map(str, made))}); compare an approximation with exact patching of one "
                                 "model")
    sites, corr, pair_corr, ex, ap, cells = [], [], [], [], [], []
    for site in exact:
        e, a = exact[site], approx[site]
        if e.values.shape != a.values.shape:
            raise AnalysisError(f"site {site!r}: exact values {tuple(e.values.shape)} and approximate "
                                f"{tuple(a.values.shape)} differ in shape")
        r = _pearson(e.mean, a.mean)
        sites.append(site)
        corr.append(r)
        pair_corr.append(_pearson(e.values, a.values))
        ex.append(e.mean.flatten().tolist())
        ap.append(a.mean.flatten().tolist())
        cells.append(_cell_labels(e))
    method = next(iter(approx.values())).method
    first = next(iter(exact.values()))
    return ComparisonResult(sites, corr, pair_corr, ex, ap, cells, method,
                            build_meta(**made_from(first), n_pairs=first.n_pairs))


@checked
def attribution_vs_exact(model: HookedModel, pairs: PromptPairs, sites: Union[str, Sequence[str]] = ("resid_pre",),
                         method: str = "attribution",
                         **kwargs) -> ComparisonResult:
    """Run :func:`attribute` and :func:`activation_patching` on the same cells and :func:`compare` them.

    Args:
        model: The hooked model.
        pairs: Clean / corrupt prompt pairs.
        sites: One site name or several.
        method: ``"attribution"`` or ``"integrated-gradients"``.
        **kwargs: Options of :func:`attribute`; those :func:`activation_patching` shares go to it too.

    Returns:
        The comparison.

    Raises:
        ModelMismatchError: The pairs were built for another model.
    """
    check_belongs(model, "patching.attribution_vs_exact", pairs=pairs)
    site_list = [sites] if isinstance(sites, str) else list(sites)
    approx = attribute_sites(model, pairs, site_list, method=method, **kwargs)
    sweep_kwargs = {k: v for k, v in kwargs.items() if k not in ("batch_size", "max_memory", "ig_steps")}
    exact = {}
    for site in site_list:
        site_kwargs = dict(sweep_kwargs)
        if site not in ("attn_z", "pattern"):
            site_kwargs.pop("heads", None)
        if site not in ("mlp_pre", "mlp_post"):
            site_kwargs.pop("neurons", None)
        exact[site] = activation_patching(model, pairs, site, **site_kwargs)
    return compare(exact, approx)


