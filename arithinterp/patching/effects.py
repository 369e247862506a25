"""Direct vs total effect of components (:func:`direct_effect` → :class:`EffectResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from arithinterp.checks import check_belongs, check_choice, check_pairs
from arithinterp.drawing import draw
from arithinterp.engine import Read, Stepper
from arithinterp.engine import run as engine_run
from arithinterp.errors import ConfigError
from arithinterp.metrics import DIRECTIONS, metric_context, metric_fn, metric_name
from arithinterp.patching.components import default_components, parse_components
from arithinterp.patching.core import warn_first_token_only
from arithinterp.patching.exact import activation_patching
from arithinterp.progress import progress_bar
from arithinterp.results import Result, build_meta
from arithinterp.types import HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs

@dataclass(frozen=True)
class EffectResult(Result):
    """Direct and total effect of components on the metric (Kantamneni & Tegmark 2025).

    ``direct`` and ``total`` are ``[n_pairs, n_components]`` changes of the metric relative to the
    unpatched base run; ``total_change [n_pairs]`` is the change when the whole prompt is
    swapped (source metric − base metric) and ``remainder = total_change − Σ direct``, so that
    the direct effects plus the remainder reproduce the total change exactly. The remainder is what
    flows through other components and the final normalisation.
    """

    components: list
    direct: torch.Tensor
    total: torch.Tensor
    total_change: torch.Tensor
    remainder: torch.Tensor
    metric: str
    direction: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"components": "component", "direct": "pair component", "total": "pair component", "total_change": "pair",
               "remainder": "pair"}
    _legal = {"direction": DIRECTIONS}

    def to_frame(self):
        """One row per component: its direct and total effect.

        Returns:
            A pandas DataFrame.
        """
        import pandas as pd

        n = self.direct.shape[0]
        sem = lambda t: (t.std(0) / math.sqrt(n)).tolist() if n > 1 else [0.0] * t.shape[1]  # noqa: E731
        frame = pd.DataFrame(
            dict(
                component=self.components,
                direct=self.direct.mean(0).tolist(),
                direct_sem=sem(self.direct),
                total=self.total.mean(0).tolist(),
                total_sem=sem(self.total),
            )
        )
        frame["metric"], frame["n_pairs"] = self.metric, n
        return frame

    def plot(self, **kwargs):
        """Direct vs total effect per component (see ``viz.patching``).

        Args:
            **kwargs: Passed to :func:`arithinterp.viz.patching.plot_effects`.

        Returns:
            A plotly Figure.
        """
        return draw(self, **kwargs)


@checked
def direct_effect(
    model: HookedModel,
    pairs: PromptPairs,
    components: Optional[Sequence[str]] = None,
    metric: Union[str, Callable] = "logit_diff",
    direction: str = "noise",
    *,
    progress: bool = True,
) -> EffectResult:
    """Direct effect versus total effect of model components (Kantamneni & Tegmark 2025, "Language Models Use
    Trigonometry to Do Addition").

    Direct effect: add the component's ``source − base`` output at the final position straight into
    the base run's final residual stream (before ``ln_final``) and read the metric. Total effect:
    activation patching of the component's output at every position (:func:`activation_patching` with
    ``per_position=False``). Both are reported as the change from the base run's metric.

    Args:
        model: The hooked model.
        pairs: Clean and corrupt prompts.
        components: names such as ``"embed"`` (token + positional embedding), ``"attn3"``, ``"mlp3"``,
            ``"L3H1"`` (one head's output); default :func:`default_components`, whose outputs sum
            to the final residual stream.
        metric: a metric name (:data:`arithinterp.metrics.METRICS`) or a callable.
        direction: ``"noise"`` (the paper's: run clean, bring in the corrupt output) or ``"denoise"``.
        progress: show a progress bar.

    Returns:
        The direct and total effect of each component.

    Raises:
        ConfigError: an unknown direction or metric, or a component that is not allowed.
    """
    check_belongs(model, "patching.direct_effect", pairs=pairs)
    check_pairs(pairs)
    warn_first_token_only(pairs, "direct_effect")
    check_choice("direction", direction, DIRECTIONS)
    fn = metric_fn(metric)
    parsed = parse_components(model, default_components(model) if components is None else components,
                              ("embed", "attn", "mlp", "head"))
    for c in parsed:
        if c.position is not None:
            raise ConfigError(f"component {c.name!r}: direct effects are taken over every position; "
                              f"drop the '@{c.position}'")
    last = model.cfg.n_layers - 1
    n = len(pairs)
    direct, total_change = torch.empty(n, len(parsed)), torch.empty(n)
    base_set, source_set = (pairs.corrupt, pairs.clean) if direction == "denoise" else (pairs.clean, pairs.corrupt)
    stepper = Stepper(model)  # the model's final norm and unembedding (and final soft-capping, if any)

    def outputs(run) -> torch.Tensor:  # what each component adds to the final residual stream, [C, B, d]
        shares = []
        for c, act in zip(parsed, run.reads[1:]):  # "embed" is the first residual stream itself
            act = act.float()
            if c.kind == "head":  # one head's share of attn_out (the bias belongs to no head)
                act = act.reshape(act.shape[0], model.cfg.n_heads, -1)[:, c.unit] @ model.W_O[c.layer, c.unit].float()
            shares.append(act)
        return torch.stack(shares)

    with torch.inference_mode():
        for idx in progress_bar(pairs.clean.length_groups(), desc="direct effect", disable=not progress):
            base_tokens, source_tokens = base_set.unpadded(idx), source_set.unpadded(idx)
            final_pos = torch.full((len(idx),), base_tokens.shape[1] - 1)
            reads = [Read("resid_post", last, final_pos)] + [Read(c.site, c.layer, final_pos) for c in parsed]
            base, source = engine_run(model, base_tokens, reads=reads), engine_run(model, source_tokens, reads=reads)
            base_logits, source_logits = base.logits, source.logits
            assert base_logits is not None and source_logits is not None  # kept by default
            ctx = metric_context(pairs[idx], direction, base_logits, source_logits, device=base_logits.device)
            base_metric = fn(base_logits, ctx)
            total_change[idx] = (fn(source_logits, ctx) - base_metric).float().cpu()
            final = base.reads[0]  # [B, d]
            shifted = final.float() + outputs(source) - outputs(base)  # [C, B, d]
            logits = stepper.unembed(shifted.to(final.dtype)).float()  # metrics in float32
            direct[idx] = (fn(logits, ctx) - base_metric).T.float().cpu()
    total = torch.empty(n, len(parsed))
    # one sweep per site (heads: per layer) rather than per component: the base and source runs are shared
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(parsed):
        groups.setdefault((c.site, c.layer if c.kind == "head" else None), []).append(i)
    for (site, head_layer), members in groups.items():
        kwargs: dict[str, Any] = dict(layers=sorted({parsed[i].layer for i in members}), per_position=False,
                                      direction=direction, progress=False)
        if head_layer is not None:
            kwargs["heads"] = sorted({int(parsed[i].unit or 0) for i in members})
        result = activation_patching(model, pairs, site, metric, **kwargs)
        unpatched = result.corrupt_baseline if direction == "denoise" else result.clean_baseline
        for i in members:
            cell = result.values[:, result.layers.index(parsed[i].layer)]
            if head_layer is not None:
                cell = cell[:, result.heads.index(parsed[i].unit)]
            total[:, i] = cell - unpatched
    return EffectResult(
        components=[c.name for c in parsed],
        direct=direct,
        total=total,
        total_change=total_change,
        remainder=total_change - direct.sum(1),
        metric=metric_name(metric),
        direction=direction,
        meta=build_meta(model, n_pairs=n),
    )
