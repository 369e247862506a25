"""Attribution patching and integrated gradients, and their comparison with exact patching."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from arithinterp import sites as site_lib
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.patching.core import (
    ATTRIBUTE_SITES,
    DIRECTIONS,
    METHODS,
    UNIT_SITES,
    Cells,
    PatchResult,
    check_choice,
    check_pairs,
    metric_context,
    metric_fn,
    patch_result,
    resolve_positions,
    resolve_units,
)
from arithinterp.patching.exact import sweep
from arithinterp.results import Result, build_meta

def _grad_hook_name(site: str, layer: int) -> str:
    # d metric / d resid_mid equals d metric / d attn_out (resid_mid = resid_pre + attn_out); the
    # bridge's resid_mid alias only feeds ln2, so its gradient would miss the skip connection
    return site_lib.hook_name("attn_out" if site == "resid_mid" else site, layer)


def _cell_scores(site: str, contribution: torch.Tensor, pos: Optional[torch.Tensor], units: list) -> torch.Tensor:
    """Sum ``grad · delta`` over each cell: ``[B, T, ...]`` (patterns ``[B, H, T, T]``) -> ``[B, n_pos?, n_units?]``."""
    if site == "pattern":
        per = contribution.sum(-1).transpose(1, 2)  # [B, T_query, H]
    elif site == "attn_z":
        per = contribution.sum(-1)  # [B, T, H]
    elif site in UNIT_SITES:
        per = contribution  # [B, T, d_mlp]
    else:
        per = contribution.sum(-1)  # [B, T]
    if units:
        per = per[..., units]
    if pos is None:
        return per.sum(1)
    rows = torch.arange(per.shape[0])[:, None]
    return per[rows, pos.T]  # [B, n_pos, ...]


def attribute(
    model: Any,
    pairs: Any,
    sites: Union[str, Sequence[str]] = ("resid_pre",),
    method: str = "attribution",
    steps: int = 10,
    metric: Union[str, Callable] = "logit_diff",
    layers: Optional[Sequence[int]] = None,
    positions=None,
    heads: Optional[Sequence[int]] = None,
    neurons: Optional[Sequence[int]] = None,
    direction: str = "denoise",
    normalize: bool = False,
    *,
    per_position: bool = True,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = True,
):
    """Attribution patching: a first-order estimate of every cell of :func:`sweep` at once.

    ``method="attribution"``: the estimated effect of a cell is ``Σ grad · (source − base)`` over
    the cell's activation, with the gradient of the metric taken on the base run (one forward for
    the source activations, one forward and one backward for the base run, per batch — two forwards
    and one backward for every cell of every site; Nanda 2023,
    "Attribution patching"; RECIPES §1 and §4 rank neurons this way). ``"integrated_gradients"``:
    the gradient is averaged over ``steps`` runs whose token embeddings are interpolated from the
    base to the source prompt (midpoint rule; the EAP-IG variant of Hanna et al. 2024).

    The values are ``base metric + estimated effect`` so they sit on the same scale as the exact
    sweep's; returns one :class:`PatchResult` for a single site name, else ``{site: PatchResult}``.
    """
    check_pairs(pairs)
    site_list = [sites] if isinstance(sites, str) else list(sites)
    if not site_list:
        raise SiteError(f"sites is empty; accepted sites: {accepted(ATTRIBUTE_SITES)}")
    for site in site_list:
        site_lib.check_site(site)
        if site not in ATTRIBUTE_SITES:
            raise SiteError(f"site {site!r} cannot be attributed; accepted: {accepted(ATTRIBUTE_SITES)}")
    check_choice("method", method, METHODS)
    check_choice("direction", direction, DIRECTIONS)
    if method == "integrated_gradients" and (not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"steps must be a positive integer, got {steps!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    fn = metric_fn(metric)
    plans = {}
    for site in site_list:
        layer_list = site_lib.check_layers(model, site, layers)
        unit_kind, units = resolve_units(model, site, heads if site in ("attn_z", "pattern") else None, neurons if site in ("mlp_pre", "mlp_post") else None)
        labels, pos_index = resolve_positions(pairs, positions) if per_position else ([], None)
        plans[site] = (layer_list, unit_kind, units, labels, pos_index)
    n = len(pairs)
    scores = {site: torch.empty(n, len(plan[0]), *((len(plan[3]),) if plan[3] else ()), *((len(plan[2]),) if plan[2] else ())) for site, plan in plans.items()}
    clean_base, corrupt_base = torch.empty(n), torch.empty(n)
    base_set, source_set = (pairs.corrupt, pairs.clean) if direction == "denoise" else (pairs.clean, pairs.corrupt)
    read = {(site, layer): site_lib.hook_name(site, layer) for site, plan in plans.items() for layer in plan[0]}
    grad_at = {(site, layer): _grad_hook_name(site, layer) for site, layer in read}
    read_names, grad_names = set(read.values()), set(grad_at.values())
    batches = [b for group in pairs.clean.length_groups() for b in group.split(batch_size)]
    alphas = [0.0] if method == "attribution" else [(k + 0.5) / steps for k in range(steps)]
    keep_names = read_names | grad_names | {"hook_embed"}
    for idx in tqdm(batches, desc="attribute", disable=not progress):
        base_tokens, source_tokens = base_set.unpadded(idx), source_set.unpadded(idx)
        offset = base_set.offset(idx)
        with torch.inference_mode():
            src_logits, src_cache = model.run_with_cache(source_tokens, names_filter=lambda name: name in keep_names)
            src_acts = {k: src_cache[k].clone() for k in keep_names}
            src_logits = src_logits[:, -1].clone()
            if method == "integrated_gradients":  # the interpolated runs are not the base run: run it too
                base_logits, base_cache = model.run_with_cache(base_tokens, names_filter=lambda name: name in keep_names)
                base_acts = {k: base_cache[k].clone() for k in keep_names}
                base_logits = base_logits[:, -1].clone()
        grads: dict[str, torch.Tensor] = {}
        ctx = None
        for alpha in alphas:
            stored: dict[str, torch.Tensor] = {}

            def keep(name):
                def hook(activation, hook):
                    stored[name] = activation
                    return activation

                return hook

            def interpolate(activation, hook):
                return base_acts["hook_embed"] + alpha * (src_acts["hook_embed"] - base_acts["hook_embed"])

            hooks = [(name, keep(name)) for name in sorted(keep_names - {"hook_embed"} if alpha else keep_names)]
            if alpha:
                hooks.append(("hook_embed", interpolate))
            with torch.enable_grad():
                logits = model.run_with_hooks(base_tokens, fwd_hooks=hooks, return_type="logits")[:, -1]
                if method == "attribution":  # this run is the base run: its activations are the base ones
                    base_logits = logits.detach().clone()
                    base_acts = {k: stored[k].detach().clone() for k in keep_names}
                if ctx is None:
                    ctx = metric_context(pairs[idx], direction, base_logits, src_logits)
                total = fn(logits[None], ctx)[0].sum()
                names = sorted(grad_names)
                for name, grad in zip(names, torch.autograd.grad(total, [stored[k] for k in names], allow_unused=True)):
                    if grad is not None:
                        grad = grad.detach() / len(alphas)
                        grads[name] = grads[name] + grad if name in grads else grad
        base_metric, src_metric = fn(base_logits, ctx), fn(src_logits, ctx)
        clean_base[idx], corrupt_base[idx] = (src_metric, base_metric) if direction == "denoise" else (base_metric, src_metric)
        for site, (layer_list, _, units, labels, pos_index) in plans.items():
            pos = None if pos_index is None else pos_index[:, idx] - offset
            for i, layer in enumerate(layer_list):
                name, gname = read[(site, layer)], grad_at[(site, layer)]
                delta = src_acts[name] - base_acts[name]
                grad = grads.get(gname, torch.zeros_like(delta))  # no gradient: nothing downstream reads it
                contribution = grad.reshape(delta.shape) * delta
                scores[site][idx, i] = _cell_scores(site, contribution, pos, units) + base_metric.reshape(-1, *([1] * (scores[site].ndim - 2)))
    results = {}
    for site, (layer_list, unit_kind, units, labels, pos_index) in plans.items():
        cells = Cells(layer_list, len(labels), units)
        results[site] = patch_result(
            model, pairs, scores[site], clean_base, corrupt_base, cells, labels, pos_index, site, metric, direction,
            method, normalize, seed, dict(unit=unit_kind, steps=steps if method != "attribution" else None),
        )
    return results[site_list[0]] if isinstance(sites, str) else results


@dataclass(frozen=True)
class Comparison(Result):
    """How well an approximation (attribution) tracks exact patching, per site.

    ``correlation[i]`` is the Pearson correlation of the cell means of site ``sites[i]``;
    ``pair_correlation[i]`` that of every (pair, cell) value. ``exact`` / ``approx`` hold the
    cell means (flattened) and ``cells`` their labels, for the scatter plot.
    """

    sites: list
    correlation: list
    pair_correlation: list
    exact: list
    approx: list
    cells: list
    method: str
    meta: dict

    def to_frame(self):
        import pandas as pd

        rows = []
        for site, exact, approx, labels in zip(self.sites, self.exact, self.approx, self.cells):
            rows += [dict(site=site, cell=label, exact=e, approx=a) for label, e, a in zip(labels, exact, approx)]
        return pd.DataFrame(rows)

    def plot(self, **kwargs):
        from arithinterp.viz.patching import plot_comparison

        return plot_comparison(self, **kwargs)


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    denominator = float(x.norm() * y.norm())
    return float((x * y).sum()) / denominator if denominator > 0 else float("nan")


def _cell_labels(result: PatchResult) -> list[str]:
    import itertools

    names = {"layer": "L", "position": "pos ", "head": "H", "neuron": "N"}
    return [" ".join(f"{names[a]}{v}" for a, v in zip(result.axes, combo)) for combo in itertools.product(*(result.axis_labels(a) for a in result.axes))]


def compare(exact, approx) -> Comparison:
    """Correlation of an approximation with exact patching, per site.

    ``exact`` and ``approx`` are :class:`PatchResult` objects of the same cells (or dicts of them
    keyed by site, as :func:`attribute` returns). The correlation is also written into each
    approximate result's ``meta["correlation_with_exact"]``.
    """
    exact = exact if isinstance(exact, dict) else {exact.site: exact}
    approx = approx if isinstance(approx, dict) else {approx.site: approx}
    if set(exact) != set(approx):
        raise AnalysisError(f"exact and approximate results cover different sites: {sorted(exact)} vs {sorted(approx)}")
    sites, corr, pair_corr, ex, ap, cells = [], [], [], [], [], []
    for site in exact:
        e, a = exact[site], approx[site]
        if e.values.shape != a.values.shape:
            raise AnalysisError(f"site {site!r}: exact values {tuple(e.values.shape)} and approximate {tuple(a.values.shape)} differ in shape")
        r = _pearson(e.mean, a.mean)
        a.meta["correlation_with_exact"] = r
        sites.append(site)
        corr.append(r)
        pair_corr.append(_pearson(e.values, a.values))
        ex.append(e.mean.flatten().tolist())
        ap.append(a.mean.flatten().tolist())
        cells.append(_cell_labels(e))
    method = next(iter(approx.values())).method
    return Comparison(sites, corr, pair_corr, ex, ap, cells, method, build_meta(n_pairs=next(iter(exact.values())).n_pairs))


def attribution_vs_exact(model, pairs, sites=("resid_pre",), method: str = "attribution", **kwargs) -> Comparison:
    """Run :func:`attribute` and :func:`sweep` on the same cells and :func:`compare` them."""
    site_list = [sites] if isinstance(sites, str) else list(sites)
    approx = attribute(model, pairs, site_list, method=method, **kwargs)
    sweep_kwargs = {k: v for k, v in kwargs.items() if k not in ("batch_size", "steps")}
    exact = {}
    for site in site_list:
        site_kwargs = dict(sweep_kwargs)
        if site not in ("attn_z", "pattern"):
            site_kwargs.pop("heads", None)
        if site not in ("mlp_pre", "mlp_post"):
            site_kwargs.pop("neurons", None)
        exact[site] = sweep(model, pairs, site, **site_kwargs)
    return compare(exact, approx)


