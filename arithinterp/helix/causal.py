"""The causal helix test (Kantamneni & Tegmark 2025): patch the fitted helix at the
corrupted value into the clean run and compare with the layer patch, a PCA reconstruction of
equal dimension and a helix fitted to shuffled values, :func:`patch_test` →
:class:`HelixPatchResult`; with the forward passes it is made of (:func:`capture`,
:func:`patched_logit`) and the shuffled-value control (:func:`shuffled_control`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from arithinterp.checks import check_belongs
from arithinterp import engine
from arithinterp import sites as site_lib
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.helix.design import as_2d
from arithinterp.helix.fitting import HelixFit, fit, resolve_values, value_names
from arithinterp.intervals import ratio_to_reference
from arithinterp.results import DISTINCT, NON_NEGATIVE, POSITIVE, Result, build_meta
from arithinterp.types import HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs, PromptSet


# --- causal patch test ---------------------------------------------------------------------------


def _groups(prompts: PromptSet, batch_size: int):
    return [chunk for group in prompts.length_groups() for chunk in group.split(batch_size)]


def _where(hook: Union[str, tuple]) -> tuple[str, int]:
    """``(site, layer)`` of a hook name (``"blocks.3.hook_resid_post"``) or of a ``(site, layer)`` pair."""
    if isinstance(hook, tuple):
        site, layer = hook
        return site_lib.check_site(site), int(layer)
    for site, template in site_lib.HOOKS.items():
        match = re.fullmatch(re.escape(template).replace(re.escape("{layer}"), r"(\d+)"), str(hook))
        if match:
            return site, int(match.group(1)) if match.groups() else 0
    raise SiteError(f"unknown hook {hook!r}; accepted: a (site, layer) pair or a hook name such as "
                    f"'blocks.0.hook_resid_pre' for the sites {accepted(site_lib.HOOKS)}")


def _position_index(prompts: PromptSet, position: str) -> torch.Tensor:
    """Each prompt's index [N] of ``position`` in the left-padded frame (any spec
    :meth:`~arithinterp.tasks.PromptSet.locate` accepts: ``"a"``, ``"a[0]"``, ``"final-1"``, ``"3"``)."""
    return prompts.locate(position)[1][:, 0]


@checked
def capture(model: HookedModel, prompts: PromptSet, hook: Union[str, tuple], position: str,
            batch_size: int = 256) -> torch.Tensor:
    """Each prompt's activation at one site, layer and position, read by
    :func:`arithinterp.engine.run` (the forward stops after that layer).

    Args:
        model: The hooked model.
        prompts: The prompts.
        hook: A hook name or a ``(site, layer)`` pair.
        position: A position name of the prompts (``"a"``, ``"final"``).
        batch_size: Prompts per forward.

    Returns:
        Float[Tensor, "prompt d"]: The activations, flattened per prompt (float32).

    Raises:
        AnalysisError: No prompts.
        SiteError: An unknown hook or position.
        ModelMismatchError: The prompts were built for another model.
    """
    check_belongs(model, "helix.capture", prompts=prompts)
    site, layer = _where(hook)
    index = _position_index(prompts, position)
    out = None
    for idx in _groups(prompts, batch_size):
        columns = index[idx] - prompts.offset(idx)
        reads = [engine.Read(site, layer, columns)]
        read = engine.run(model, prompts.unpadded(idx), reads=reads, logits="none").reads[0]
        read = read.reshape(len(idx), -1).float()
        if out is None:
            out = torch.empty((len(prompts), read.shape[-1]))
        out[idx] = read
    if out is None:
        raise AnalysisError("no prompts to capture activations from")
    return out


@checked
def patched_logit(model: HookedModel, prompts: PromptSet, hook: Union[str, tuple], position: str,
                  replacement: Optional[torch.Tensor],
                  tokens: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """The logit of one token per prompt, or the summed logits of a teacher-forced answer, with an
    activation replaced, one :func:`arithinterp.engine.run` per batch.

    With ``tokens`` ``[N]`` the token's logit at the final position is read. With ``tokens``
    ``[N, K]`` (a multi-token answer, ``-1`` past its end) every token but the last is fed after
    the prompt and each token's logit is read at the position that predicts it, summed over the
    answer's tokens: the patched position lies inside the prompt, so the fed tokens see it.

    Args:
        model: The hooked model.
        prompts: The prompts.
        hook: A hook name or a ``(site, layer)`` pair.
        position: A position name of the prompts.
        replacement (Float[Tensor, "prompt d"] | None): The activation to write; ``None``: no patch.
        tokens (Int[Tensor, "prompt"] | Int[Tensor, "prompt answer"]): The token (or answer) whose
            logit is read.
        batch_size: Prompts per forward.

    Returns:
        Float[Tensor, "prompt"]: The logits (summed over the answer's tokens).

    Raises:
        SiteError: An unknown hook or position.
        AnalysisError: ``tokens`` has another number of rows than the prompts, or a row without a token.
        ModelMismatchError: The prompts were built for another model.
    """
    check_belongs(model, "helix.patched_logit", prompts=prompts)
    site, layer = _where(hook)
    index = _position_index(prompts, position)
    answer = tokens[:, None] if tokens.ndim == 1 else tokens
    if answer.ndim != 2 or answer.shape[0] != len(prompts) or bool((answer[:, 0] < 0).any()):
        raise AnalysisError(f"tokens must be [prompts] or [prompts, answer tokens] with a first token in every row "
                            f"for {len(prompts)} prompts, got shape {tuple(tokens.shape)}")
    n_answer = answer.shape[1]
    out = torch.empty(len(prompts))
    for idx in _groups(prompts, batch_size):
        columns = index[idx] - prompts.offset(idx)
        patches = []
        if replacement is not None:
            value = replacement[idx]
            patches = [engine.Write(site, layer, columns,
                                           value=lambda current, value=value: value.reshape(current.shape))]
        fed = torch.cat([prompts.unpadded(idx), answer[idx, :-1].clamp(min=0)], dim=1)
        logits = engine.run(model, fed, patches, logits=n_answer).logits  # [B, K, V] at the last K positions
        assert logits is not None  # asked for
        read = logits.gather(2, answer[idx].clamp(min=0)[:, :, None].to(logits.device))[:, :, 0].float().cpu()
        out[idx] = torch.where(answer[idx] >= 0, read, torch.zeros_like(read)).sum(1)
    return out


def scored_tokens(pairs: PromptPairs) -> torch.Tensor:
    """What :func:`patch_test` reads of the corrupt answer: its first token ``[N]``, or with the
    prompts' ``scoring == "full-answer"`` every one of its tokens ``[N, K]`` (``-1`` past the end)."""
    if pairs.clean.scoring == "full-answer" and pairs.corrupt.answer_tokens.shape[1] > 1:
        return pairs.corrupt.answer_tokens
    return pairs.corrupt_answer_token


def stacked_effects(model: HookedModel, pairs: PromptPairs, hook: Union[str, tuple], position: str, replacements: list,
                    batch_size: int) -> torch.Tensor:
    """Effect [M, N] (corrupt-answer logit after − before, :func:`scored_tokens`) of M replacement sets in one batch."""
    tokens = scored_tokens(pairs)
    before = patched_logit(model, pairs.clean, hook, position, None, tokens, batch_size)
    n, m = len(pairs), len(replacements)
    index = torch.arange(n).repeat(m)
    stacked = pairs.clean[index]
    after = patched_logit(model, stacked, hook, position, torch.cat(replacements), tokens[index], batch_size)
    return after.reshape(m, n) - before[None]


@dataclass(frozen=True)
class HelixPatchResult(Result):
    """The causal helix test (Kantamneni & Tegmark 2025).

    Attributes:
        methods: The replacements: ``"layer patch"``, ``"PCA-k"``, the fit's kind, ``"shuffled"``,
            ``"mean"`` and any extra fits.
        effect (Float[Tensor, "method"]): The mean over pairs of (logit of the corrupted answer
            after patching − before).
        per_pair (Float[Tensor, "method pair"]): The effect per pair.
        fraction (Float[Tensor, "method"]): ``effect`` / the layer patch's effect; NaN when the
            layer patch's own interval holds 0 (a share of an effect that may be nothing is not reported).
        k: The PCA baseline's dimension (the helix's parameter count).
        layer: The patched layer.
        position: The patched position.
        meta: Provenance, the fit's periods and kind, the variable, the bootstrap settings.
        site: The patched site.
        effect_ci (Float[Tensor, "2 method"] | None): The 95% percentile-bootstrap interval of
            ``effect`` over pairs.
        fraction_ci (Float[Tensor, "2 method"] | None): That of ``fraction`` (the same resampled
            pairs in numerator and denominator).
        layer_patch_distinct: Whether the layer patch's interval excludes 0.
        note: Why fractions are missing, or empty.
    """

    methods: list
    effect: torch.Tensor
    per_pair: torch.Tensor
    fraction: torch.Tensor
    k: int
    layer: int
    position: str
    meta: dict
    site: str = "resid_pre"
    effect_ci: Optional[torch.Tensor] = None
    fraction_ci: Optional[torch.Tensor] = None
    layer_patch_distinct: bool = True
    note: str = ""

    # what load checks: the axes fields share and the values they may take
    _shapes = {"methods": "method", "effect": "method", "per_pair": "method pair", "fraction": "method",
               "effect_ci": "2 method", "fraction_ci": "2 method"}
    _legal = {"methods": DISTINCT, "k": POSITIVE, "layer": NON_NEGATIVE}

    def fractions(self) -> dict:
        """Each method's fraction of the layer patch's effect.

        Returns:
            ``{method: fraction}``; empty when the layer patch's effect is not distinguishable
            from zero (then :attr:`note` says why).
        """
        if not self.layer_patch_distinct:
            return {}
        return dict(zip(self.methods, self.fraction.tolist()))

    def to_frame(self):
        import pandas as pd

        n = self.per_pair.shape[1]
        nan = [float("nan")] * len(self.methods)
        sem = (self.per_pair.std(1) / math.sqrt(max(n, 1))).tolist()
        effect_ci = self.effect_ci.tolist() if self.effect_ci is not None else [nan, nan]
        fraction_ci = self.fraction_ci.tolist() if self.fraction_ci is not None else [nan, nan]
        return pd.DataFrame(dict(method=self.methods, effect=self.effect.tolist(), sem=sem,
                                 effect_ci_low=effect_ci[0], effect_ci_high=effect_ci[1],
                                 fraction_of_layer_patch=self.fraction.tolist(),
                                 fraction_ci_low=fraction_ci[0], fraction_ci_high=fraction_ci[1],
                                 n_pairs=[n] * len(self.methods), note=[self.note] * len(self.methods)))

    def plot(self, **kwargs):
        return draw(self, **kwargs)


@checked
def shuffled_control(acts: torch.Tensor, values: torch.Tensor, like: HelixFit, *, seed: int = 0) -> HelixFit:
    """The control fit of Kantamneni & Tegmark 2025: a fit like another to values permuted at the
    value level (each distinct number is relabelled by another).

    Args:
        acts (Float[Tensor, "n d"]): Activations.
        values (Float[Tensor, "n"]): Their numbers (the first column is permuted when 2-D).
        like: The fit whose kind, periods and PCA size to copy.
        seed: Seeds the permutation.

    Returns:
        The control fit (scored on its training rows).
    """
    x = as_2d(values)
    unique, inverse = x[:, 0].unique(return_inverse=True)
    generator = torch.Generator().manual_seed(int(seed))
    shuffled = x.clone()
    shuffled[:, 0] = unique[torch.randperm(len(unique), generator=generator)][inverse]
    return fit(acts, shuffled, like.periods, like.components.shape[0], 0.0, like.kind, seed=seed,
               degree=like.degree, names=like.names)


def check_not_interpolating(fit: HelixFit, name: str) -> None:
    """Refuse a fit made on at most ``n_params + 1`` distinct values: its basis (with the
    constant, ``n_params + 1`` columns) then passes through every training point whatever the
    activations are, and a PCA of equal dimension reconstructs the per-value activations exactly,
    so both "restore" the layer patch by construction."""
    k = fit.n_params
    n_values = int(fit.unique_values.shape[0])
    if n_values <= k + 1:
        where = f" at position {fit.position!r}" if fit.position is not None else ""
        raise AnalysisError(
            f"the {name} fit ({fit.kind}, periods {fit.periods}, {k} parameters){where} was made on only {n_values} "
            f"distinct values; with at most k + 1 = {k + 1} distinct values any {k}-dimensional basis (the "
            f"{fit.kind} and PCA-{k} alike) interpolates them exactly, so the comparison cannot fail. Fit on more "
            f"than {k + 1} distinct values, or use fewer periods (e.g. periods=(10,)) or a smaller kind "
            "('circle', 'linear')"
        )


@checked
def patch_test(
    model: HookedModel,
    pairs: PromptPairs,
    fit: HelixFit,
    layer: Optional[int] = None,
    *,
    positions: Optional[str] = None,
    site: Optional[str] = None,
    value: Optional[str] = None,
    control: Optional[HelixFit] = None,
    extra: Optional[dict] = None,
    seed: int = 0,
    batch_size: int = 256,
    n_boot: int = 1000,
) -> HelixPatchResult:
    """Is the fitted helix causally sufficient? (Kantamneni & Tegmark 2025.)

    Where the fit was made — its ``site``, ``layer`` and position (``fit.site``,
    ``fit.layer``, ``fit.position``; each can be overridden, and a fit to a bare tensor, which
    records none, patches ``resid_pre`` at ``a`` unless told otherwise) — replace each clean
    prompt's activation ``[d]`` by (i) the corrupt prompt's activation (``"layer patch"``), (ii) its
    reconstruction from the fit's top-k PCA components, k = ``fit.n_params`` (``"PCA-k"``),
    (iii) the fit evaluated at the corrupt value (``fit.kind``), (iv) a fit of the same kind to
    shuffled values (``"shuffled"``: ``control``, by default :func:`shuffled_control` on the
    pairs' clean and corrupt activations), (v) the fit's mean activation (``"mean"``: what
    erasing the number does, the reference for the control) and any ``extra`` fits
    (name → ``HelixFit``). The patches run through :func:`arithinterp.engine.run`.
    Metric: logit of the corrupt answer after patching − before, averaged over pairs.
    ``value`` names the fitted variable (default: the fit's own, e.g. ``"a"``, else ``positions``).

    Each effect and each fraction of the layer patch carries a 95% percentile-bootstrap interval
    over the pairs; fractions are NaN, with a ``note``, when the layer patch's interval holds 0.

    Args:
        model: The hooked model.
        pairs: Clean / corrupt pairs.
        fit: A single-variable fit.
        layer: The layer to patch (default ``fit.layer``).
        positions: The one position to patch (default ``fit.position``, else ``"a"``).
        site: The site to patch (default ``fit.site``, else ``"resid_pre"``).
        value: The fitted variable's label (default: the fit's own, e.g. ``"a"``, else ``positions``).
        control: The shuffled-values fit (default :func:`shuffled_control` on the pairs' activations).
        extra: Further fits to test, by name.
        seed: Seeds the control and the bootstrap.
        batch_size: Prompts per forward.
        n_boot: Bootstrap resamples, at least 100.

    Returns:
        The effects, their fractions of the layer patch and their intervals.

    Raises:
        SiteError: No layer known, or an unknown site or position.
        ConfigError: ``n_boot`` below 100.
        AnalysisError: A multi-variable fit, fewer than 2 pairs, a fit (or an ``extra`` one) made on
            at most ``n_params + 1`` distinct values (its basis and PCA-k then interpolate by
            construction), or a fit of another width than the activations.
        ModelMismatchError: The pairs or fit belong to another model.
    """
    check_belongs(model, "helix.patch_test", pairs=pairs, fit=fit, control=control,
                  **{f"extra fit {name!r}": part for name, part in (extra or {}).items()})
    layer = fit.layer if layer is None else layer
    if layer is None:
        raise SiteError("pass layer= (the fit does not record one)")
    site = site or fit.site or "resid_pre"
    if site in site_lib.GLOBAL_SITES:
        layer = 0
    layer = site_lib.check_layers(model, site, [layer])[0]
    position = str(positions if positions is not None else (fit.position if fit.position is not None else "a"))
    _position_index(pairs.clean, position)  # refuses an unknown or out-of-range position before any work
    if len(fit.names) != 1:
        raise AnalysisError("patch_test patches one number; fit a single-variable helix (values='a')")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 100:
        raise ConfigError(f"n_boot must be an integer ≥ 100 (bootstrap resamples over pairs), got {n_boot!r}")
    if len(pairs) < 2:
        raise AnalysisError(f"patch_test needs at least 2 pairs for an interval over pairs, got {len(pairs)}")
    check_not_interpolating(fit, "main")
    for name, other in (extra or {}).items():
        check_not_interpolating(other, repr(name))
    if value is None:  # 'a[0]' and 'a-1' read the value of a
        value = fit.names[0] if fit.names[0] in value_names(pairs.clean) else re.sub(r"[^A-Za-z_].*$", "", position)
    clean_values = resolve_values(str(value), pairs.clean)[0][:, 0]
    corrupt_values = resolve_values(str(value), pairs.corrupt)[0][:, 0]
    where = (site, layer)
    clean_acts = capture(model, pairs.clean, where, position, batch_size)
    corrupt_acts = capture(model, pairs.corrupt, where, position, batch_size)
    if corrupt_acts.shape[1] != fit.mean.shape[0]:
        raise AnalysisError(
            f"the fit is {fit.mean.shape[0]}-dimensional but the activations at {site!r} are {corrupt_acts.shape[1]}"
        )
    if control is None:
        control = shuffled_control(torch.cat([clean_acts, corrupt_acts]), torch.cat([clean_values, corrupt_values]),
                                   fit, seed=seed)
    methods = {
        "layer patch": corrupt_acts,
        f"PCA-{fit.n_params}": fit.pca_reconstruct(corrupt_acts),
        fit.kind: fit.predict(corrupt_values),
        "shuffled": control.predict(corrupt_values),
        "mean": fit.mean.float().expand_as(corrupt_acts),
    }
    for name, other in (extra or {}).items():
        methods[str(name)] = other.predict(corrupt_values)
    per_pair = stacked_effects(model, pairs, where, position, list(methods.values()), batch_size)
    stats = ratio_to_reference(per_pair, 0, n_boot=n_boot, seed=seed)
    note = ""
    if not stats["reference_distinct"]:
        note = (f"the layer patch's effect {float(stats['mean'][0]):.3g} (95% CI {float(stats['mean_low'][0]):.3g} to "
                f"{float(stats['mean_high'][0]):.3g}, {len(pairs)} pairs) is not distinguishable from zero, so no "
                "fraction of it is reported")
    return HelixPatchResult(
        methods=list(methods), effect=per_pair.mean(1), per_pair=per_pair,
        fraction=stats["fraction"].float(), k=fit.n_params, layer=int(layer), position=position, site=site,
        effect_ci=torch.stack([stats["mean_low"], stats["mean_high"]]).float(),
        fraction_ci=torch.stack([stats["fraction_low"], stats["fraction_high"]]).float(),
        layer_patch_distinct=stats["reference_distinct"], note=note,
        meta=build_meta(model, n_pairs=len(pairs), periods=fit.periods, kind=fit.kind, value=value,
                        seed=seed, site=site, n_boot=n_boot, note=note,
                        interval="95% percentile bootstrap over pairs"),
    )
