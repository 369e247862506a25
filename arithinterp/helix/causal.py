"""The causal helix test (RECIPES §1, Kantamneni & Tegmark 2025): patch the fitted helix at the
corrupted value into the clean run and compare with the layer patch, a PCA reconstruction of
equal dimension and a helix fitted to shuffled values, :func:`patch_test` →
:class:`HelixPatchResult`; with the forward passes it is made of (:func:`capture`,
:func:`patched_logit`) and the shuffled-value control (:func:`shuffled_control`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from arithinterp.errors import AnalysisError, SiteError, accepted
from arithinterp.helix.design import _as_2d
from arithinterp.helix.fitting import HelixFit, fit
from arithinterp.results import Result, build_meta


# --- causal patch test ---------------------------------------------------------------------------


def _groups(prompts: Any, batch_size: int):
    return [chunk for group in prompts.length_groups() for chunk in group.split(batch_size)]


@torch.inference_mode()
def capture(model: Any, prompts: Any, hook: str, position: str, batch_size: int = 256,
            stop_at_layer: Optional[int] = None) -> torch.Tensor:
    """Activations [N, d] at hook ``hook`` and the named ``position`` of each prompt (the forward
    stops before block ``stop_at_layer`` when given)."""
    out = None
    for idx in _groups(prompts, batch_size):
        columns = prompts.positions[position][idx] - prompts.offset(idx)
        store = {}

        def keep(x, hook):
            store["x"] = x[torch.arange(len(idx)), columns].detach().float()

        model.run_with_hooks(prompts.unpadded(idx), fwd_hooks=[(hook, keep)], return_type=None,
                             stop_at_layer=stop_at_layer)
        if out is None:
            out = torch.empty((len(prompts), store["x"].shape[-1]))
        out[idx] = store["x"]
    return out


@torch.inference_mode()
def patched_logit(model: Any, prompts: Any, hook: str, position: str, replacement: Optional[torch.Tensor],
                  tokens: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Logit [N] of ``tokens`` at the final position when the activation at ``hook`` and
    ``position`` is replaced by ``replacement`` [N, d] (``None``: no patch)."""
    out = torch.empty(len(prompts))
    for idx in _groups(prompts, batch_size):
        columns = prompts.positions[position][idx] - prompts.offset(idx)

        def patch(x, hook):
            x = x.clone()
            x[torch.arange(len(idx)), columns] = replacement[idx].to(x.dtype).to(x.device)
            return x

        hooks = [] if replacement is None else [(hook, patch)]
        logits = model.run_with_hooks(prompts.unpadded(idx), fwd_hooks=hooks, return_type="logits")
        out[idx] = logits[torch.arange(len(idx)), -1, tokens[idx]].float()
    return out


def _stacked_effects(model, pairs, hook, position, replacements: list, batch_size: int) -> torch.Tensor:
    """Effect [M, N] (corrupt-answer logit after − before) of M replacement sets in one batch."""
    tokens = pairs.corrupt_answer_token
    before = patched_logit(model, pairs.clean, hook, position, None, tokens, batch_size)
    n, m = len(pairs), len(replacements)
    index = torch.arange(n).repeat(m)
    stacked = pairs.clean[index]
    after = patched_logit(model, stacked, hook, position, torch.cat(replacements), tokens[index], batch_size)
    return after.reshape(m, n) - before[None]


@dataclass(frozen=True)
class HelixPatchResult(Result):
    """The causal helix test (Kantamneni & Tegmark 2025, RECIPES §1).

    ``effect[i]`` = mean over pairs of (logit of the corrupted answer after patching − before)
    for ``methods[i]``; ``per_pair`` [M, n_pairs]; ``fraction[i]`` = ``effect[i]`` / the layer
    patch's effect. ``k`` is the PCA baseline's dimension (the helix's parameter count).
    """

    methods: list
    effect: torch.Tensor
    per_pair: torch.Tensor
    fraction: torch.Tensor
    k: int
    layer: int
    position: str
    meta: dict

    def to_frame(self):
        import pandas as pd

        n = self.per_pair.shape[1]
        sem = (self.per_pair.std(1) / math.sqrt(max(n, 1))).tolist()
        return pd.DataFrame(dict(method=self.methods, effect=self.effect.tolist(), sem=sem,
                                 fraction_of_layer_patch=self.fraction.tolist(), n_pairs=[n] * len(self.methods)))

    def plot(self, **kwargs):
        from arithinterp.viz.fourier import patch_test_figure

        return patch_test_figure(self, **kwargs)


def shuffled_control(acts: torch.Tensor, values: torch.Tensor, like: HelixFit, random_state: int = 0) -> HelixFit:
    """A fit like ``like`` (kind, periods, PCA size) to ``acts`` whose values are permuted at the
    value level (each distinct number is relabelled by another): the control of RECIPES §1."""
    x = _as_2d(values)
    unique, inverse = x[:, 0].unique(return_inverse=True)
    generator = torch.Generator().manual_seed(int(random_state))
    shuffled = x.clone()
    shuffled[:, 0] = unique[torch.randperm(len(unique), generator=generator)][inverse]
    return fit(acts, shuffled, like.periods, like.components.shape[0], 0.0, like.kind, random_state,
               degree=like.degree, names=like.names)


def patch_test(
    model: Any,
    pairs: Any,
    fit: HelixFit,
    layer: Optional[int] = None,
    position: str = "a",
    *,
    value: Optional[str] = None,
    control: Optional[HelixFit] = None,
    extra: Optional[dict] = None,
    random_state: int = 0,
    batch_size: int = 256,
) -> HelixPatchResult:
    """Is the fitted helix causally sufficient? (RECIPES §1.)

    At ``blocks.{layer}.hook_resid_pre`` and ``position`` of each clean prompt, replace the
    activation by (i) the corrupt prompt's activation (``"layer patch"``), (ii) its
    reconstruction from the fit's top-k PCA components, k = ``fit.n_params`` (``"PCA-k"``),
    (iii) the fit evaluated at the corrupt value (``fit.kind``), (iv) a fit of the same kind to
    shuffled values (``"shuffled"``: ``control``, by default :func:`shuffled_control` on the
    pairs' clean and corrupt activations), (v) the fit's mean activation (``"mean"``: what
    erasing the number does, the reference for the control) and any ``extra`` fits
    (name → ``HelixFit``).
    Metric: logit of the corrupt answer after patching − before, averaged over pairs.
    ``value`` names the fitted variable (default: ``position``, e.g. ``"a"``).
    """
    from arithinterp import sites as site_lib

    layer = fit.layer if layer is None else layer
    if layer is None:
        raise SiteError("pass layer= (the fit does not record one)")
    hook = site_lib.hook_name("resid_pre", site_lib.check_layers(model, "resid_pre", [layer])[0])
    if position not in pairs.clean.positions:
        raise SiteError(f"unknown position {position!r}; accepted: {accepted(pairs.clean.positions)}")
    if len(fit.names) != 1:
        raise AnalysisError("patch_test patches one number; fit a single-variable helix (values='a')")
    value = value or position
    clean_values = pairs.clean.label(value).double()
    corrupt_values = pairs.corrupt.label(value).double()
    stop = layer + 1 if layer + 1 < site_lib.n_layers(model) else None
    clean_acts = capture(model, pairs.clean, hook, position, batch_size, stop)
    corrupt_acts = capture(model, pairs.corrupt, hook, position, batch_size, stop)
    if corrupt_acts.shape[1] != fit.mean.shape[0]:
        raise AnalysisError(
            f"the fit is {fit.mean.shape[0]}-dimensional but the activations are {corrupt_acts.shape[1]}"
        )
    if control is None:
        control = shuffled_control(torch.cat([clean_acts, corrupt_acts]), torch.cat([clean_values, corrupt_values]),
                                   fit, random_state)
    methods = {
        "layer patch": corrupt_acts,
        f"PCA-{fit.n_params}": fit.pca_reconstruct(corrupt_acts),
        fit.kind: fit.predict(corrupt_values),
        "shuffled": control.predict(corrupt_values),
        "mean": fit.mean.float().expand_as(corrupt_acts),
    }
    for name, other in (extra or {}).items():
        methods[str(name)] = other.predict(corrupt_values)
    per_pair = _stacked_effects(model, pairs, hook, position, list(methods.values()), batch_size)
    effect = per_pair.mean(1)
    return HelixPatchResult(
        methods=list(methods), effect=effect, per_pair=per_pair,
        fraction=effect / effect[0] if float(effect[0]) != 0 else torch.full_like(effect, float("nan")),
        k=fit.n_params, layer=int(layer), position=position,
        meta=build_meta(model, n_pairs=len(pairs), periods=fit.periods, kind=fit.kind, value=value,
                        random_state=random_state),
    )
