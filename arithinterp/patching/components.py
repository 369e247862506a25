"""Component analyses: direct vs total effect, ablation and circuit faithfulness."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from arithinterp import metrics as metric_lib
from arithinterp.checks import check_belongs, check_choice, check_pairs
from arithinterp.engine import Intervention, Read, RunningMean, Stepper
from arithinterp.engine import run as engine_run
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.metrics import ANSWER_METRICS, DIRECTIONS, metric_context, metric_fn, metric_name
from arithinterp.patching.core import COMPONENT_ABLATIONS, SCORINGS, warn_first_token_only
from arithinterp.patching.exact import activation_patching
from arithinterp.results import PROBABILITY, Result, build_meta
from arithinterp.types import HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs, PromptSet

_COMPONENT = re.compile(r"^(?:(embed)|attn(\d+)|mlp(\d+)|L(\d+)H(\d+)|L(\d+)N(\d+))(?:@([\w\[\]+-]+))?$")
COMPONENT_FORMS = (
    "'embed', 'attn{layer}', 'mlp{layer}', 'L{layer}H{head}', 'L{layer}N{neuron}', each optionally '@position'"
)


@dataclass(frozen=True)
class _Component:
    name: str
    kind: str  # embed | attn | mlp | head | neuron
    layer: int
    unit: Optional[int]
    position: Optional[str]  # a named position or an int as a string; None = every position

    @property
    def site(self) -> str:
        return {"attn": "attn_out", "mlp": "mlp_out", "head": "attn_z", "neuron": "mlp_post",
                "embed": "resid_pre"}[self.kind]


def parse_components(model: HookedModel, components: Sequence[str], allowed: Sequence[str],
                     prompts: Optional[PromptSet] = None) -> list[_Component]:
    """Parse component names; with ``prompts``, an integer ``@position`` must lie inside them."""
    if isinstance(components, str):
        components = [components]
    components = list(components)
    if not components:
        raise ConfigError(f"components is empty; name components as {COMPONENT_FORMS}")
    cfg, parsed = model.cfg, []
    for name in components:
        match = _COMPONENT.match(str(name))
        if not match:
            raise ConfigError(f"cannot read component {name!r}; accepted forms: {COMPONENT_FORMS}")
        embed, attn, mlp, h_layer, head, n_layer, neuron, position = match.groups()
        if embed:
            kind, layer, unit = "embed", 0, None
        elif attn is not None:
            kind, layer, unit = "attn", int(attn), None
        elif mlp is not None:
            kind, layer, unit = "mlp", int(mlp), None
        elif head is not None:
            kind, layer, unit = "head", int(h_layer), int(head)
        else:
            kind, layer, unit = "neuron", int(n_layer), int(neuron)
        if kind not in allowed:
            raise ConfigError(f"component {name!r} is a {kind}; this analysis accepts {accepted(allowed)}")
        if not 0 <= layer < cfg.n_layers:
            raise SiteError(f"component {name!r}: layer {layer} is out of range; accepted: 0..{cfg.n_layers - 1}")
        if kind == "head" and unit is not None and not 0 <= unit < cfg.n_heads:
            raise SiteError(f"component {name!r}: head {unit} is out of range; accepted: 0..{cfg.n_heads - 1}")
        if kind == "neuron" and unit is not None and not 0 <= unit < cfg.d_mlp:
            raise SiteError(f"component {name!r}: neuron {unit} is out of range; accepted: 0..{cfg.d_mlp - 1}")
        if kind in ("mlp", "neuron") and getattr(cfg, "attn_only", False):
            raise SiteError(f"component {name!r} needs MLPs but this model is attention-only")
        if prompts is not None and position is not None and not re.fullmatch(r"answer\d+", position):
            try:  # refused before any forward: never wrapped around to another token
                prompts.locate(position, answers=_n_scored(prompts) - 1)
            except SiteError as error:
                raise SiteError(f"component {name!r}: {error}") from None
        parsed.append(_Component(str(name), kind, layer, unit, position))
    return parsed


@checked
def default_components(model: HookedModel) -> list[str]:
    """``embed`` plus every attention layer and MLP: their outputs sum to the final residual stream."""
    check_belongs(model, "patching.default_components")
    names = ["embed"]
    for layer in range(model.cfg.n_layers):
        names.append(f"attn{layer}")
        if not getattr(model.cfg, "attn_only", False):
            names.append(f"mlp{layer}")
    return names


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
        from arithinterp.viz.patching import plot_effects

        return plot_effects(self, **kwargs)


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

    components: names such as ``"embed"`` (token + positional embedding), ``"attn3"``, ``"mlp3"``,
        ``"L3H1"`` (one head's output); default :func:`default_components`, whose outputs sum to
        the final residual stream.
    direction: ``"noise"`` (the paper's: run clean, bring in the corrupt output) or ``"denoise"``.
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
        for idx in tqdm(pairs.clean.length_groups(), desc="direct effect", disable=not progress):
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


# --- ablation ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AblationResult(Result):
    """Accuracy and answer log-probability before and after ablating components.

    ``token_correct_before`` / ``token_correct_after`` are ``[n_prompts, n_scored]``: whether each
    scored answer token is the argmax — the first token only, or with ``scoring="full_answer"``
    prompts every answer token, teacher-forced (the earlier answer tokens are fed in). A prompt is
    correct (``correct_before`` / ``correct_after``, ``[n_prompts]``) when all its scored tokens
    are; ``logprob_before`` / ``logprob_after`` sum their log-probabilities.
    """

    components: list
    ablation: str
    scoring: str
    accuracy_before: float
    accuracy_after: float
    correct_before: torch.Tensor
    correct_after: torch.Tensor
    token_correct_before: torch.Tensor
    token_correct_after: torch.Tensor
    logprob_before: torch.Tensor
    logprob_after: torch.Tensor
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"correct_before": "prompt", "correct_after": "prompt", "token_correct_before": "prompt token",
               "token_correct_after": "prompt token", "logprob_before": "prompt", "logprob_after": "prompt"}
    _legal = {"ablation": COMPONENT_ABLATIONS, "scoring": SCORINGS, "accuracy_before": PROBABILITY,
              "accuracy_after": PROBABILITY}
    _field_names = {"mode": "ablation"}

    def to_frame(self):
        """One row per run (full model, ablated): accuracy, mean answer log-prob, per-token accuracy."""
        import pandas as pd

        frame = pd.DataFrame(
            dict(
                run=["full model", f"{self.ablation}-ablated"],
                accuracy=[self.accuracy_before, self.accuracy_after],
                answer_logprob=[float(self.logprob_before.mean()), float(self.logprob_after.mean())],
                n_prompts=[len(self.correct_before)] * 2,
            )
        )
        for k in range(self.token_correct_before.shape[1]):
            frame[f"token_{k}_accuracy"] = [
                float(t[:, k].float().mean()) for t in (self.token_correct_before, self.token_correct_after)
            ]
        return frame

    def plot(self, **kwargs):
        from arithinterp.viz.patching import plot_ablation

        return plot_ablation(self, **kwargs)


def position_rows(prompts, position: Optional[str], idx: torch.Tensor, offset: int,
                   length: int) -> Optional[torch.Tensor]:
    """Per-prompt unpadded position ``[B]`` of a component's ``@position`` (None: every position).

    ``answer{k}`` is the position whose output predicts answer token k: ``final`` for k = 0, then
    the teacher-forced answer tokens (``scoring="full_answer"``); every other spec is resolved by
    ``PromptSet.locate`` (``a``, ``a[0]``, ``final-1``, an int on same-length prompts).
    """
    if position is None:
        return None
    fed = length - (prompts.tokens.shape[1] - offset)
    answer = re.fullmatch(r"answer(\d+)", position)
    if answer and int(answer.group(1)) > fed:
        raise SiteError(f"position {position!r} is past the fed answer tokens ({length} tokens); "
                        "answer positions beyond answer0 need prompts.with_scoring('full_answer')")
    spec = f"final+{answer.group(1)}" if answer else (int(position) if re.fullmatch(r"-?\d+", position) else position)
    return prompts.locate(spec, answers=fed)[1][idx, 0] - offset


def _ablation_masks(model, prompts, parsed: list[_Component], idx, offset, length,
                    keep: bool) -> dict[tuple, torch.Tensor]:
    """Boolean masks ``{(site, layer): [B, T, ...]}`` of what to ablate (``attn_z`` ``[B, T, H, 1]``).

    ``keep=False``: ablate the listed components. ``keep=True``: ablate every head and MLP *except*
    the listed ones (the complement of a circuit).
    """
    cfg, B = model.cfg, len(idx)
    shapes = {"attn_z": (cfg.n_heads, 1), "mlp_out": (1,), "mlp_post": (cfg.d_mlp,), "attn_out": (1,)}
    masks: dict[tuple, torch.Tensor] = {}

    def mask_for(site, layer):
        if (site, layer) not in masks:
            masks[site, layer] = torch.zeros(B, length, *shapes[site], dtype=torch.bool)
        return masks[site, layer]

    if keep:  # start from everything: every head (through hook_z) and every MLP
        for layer in range(cfg.n_layers):
            mask_for("attn_z", layer)[:] = True
            if not getattr(cfg, "attn_only", False):
                mask_for("mlp_out", layer)[:] = True
    for c in parsed:
        site = {"attn": "attn_z", "head": "attn_z", "mlp": "mlp_out", "neuron": "mlp_post"}[c.kind]
        mask = mask_for(site, c.layer)
        pos = position_rows(prompts, c.position, idx, offset, length)
        where = (slice(None), slice(None)) if pos is None else (torch.arange(B), pos)
        mask[where + ((slice(None),) if c.unit is None else (c.unit,))] = not keep
    return masks


def _n_scored(prompts) -> int:
    return prompts.answer_tokens.shape[1] if prompts.scoring == "full_answer" else 1


def teacher_forced(prompts, n_scored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts with all but the last scored answer token appended, in the left-padded frame:
    tokens ``[N, T + n_scored - 1]`` and each prompt's fed length ``[N]`` (answer padding fed as 0)."""
    fed = torch.cat([prompts.tokens, prompts.answer_tokens[:, : n_scored - 1].clamp(min=0)], dim=1)
    return fed, prompts.lengths + n_scored - 1


def _reference_means(model, prompts, fed, lengths, keys, means: dict, batch_size: int) -> None:
    """Fill ``means[(site, layer)]`` (``[longest fed length, ...]``, right-aligned) with the mean-ablation value:
    :func:`arithinterp.engine.mean_activation` over these prompts, per position counted from the end
    (accumulated batch by batch with :class:`arithinterp.engine.RunningMean`)."""
    missing = [key for key in keys if key not in means]
    if not missing:
        return
    width, running = fed.shape[1], {key: RunningMean() for key in missing}
    for group in prompts.length_groups():
        length = int(lengths[group[0]])
        for chunk in group.split(batch_size):
            out = engine_run(model, fed[chunk, width - length :], reads=[Read(site, layer) for site, layer in missing],
                             logits="none")
            for key, act in zip(missing, out.reads):
                running[key].add(act)
    for key in missing:
        means[key] = running[key].value()  # [longest fed length, ...]


def _replace_where(mask: torch.Tensor, replacement: Optional[torch.Tensor],
                   per_prompt: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """An intervention value: ``current [B, T, ...]`` with ``replacement`` where ``mask`` is set.

    ``replacement``: None (zero), one value per position ``[T, ...]`` (a mean) or, with
    ``per_prompt``, one per prompt ``[B, T, ...]`` (resampled); ``attn_z`` may have come flat.
    """

    def value(current: torch.Tensor) -> torch.Tensor:
        if replacement is None:
            new = current.new_zeros(())
        else:
            new = replacement.to(current.device, current.dtype).reshape(
                current.shape if per_prompt else current.shape[1:]
            )
        return torch.where(mask.to(current.device), new, current)

    return value


def ablated_scores(model: HookedModel, prompts, parsed, ablation: str, seed: int, keep: bool, score: Callable,
                   batch_size: int = 512,
                   means: Optional[dict] = None) -> torch.Tensor:
    """``score(logits [B, n_scored, V], rows)`` for every prompt, with the components (or their
    complement, ``keep=True``) ablated; nothing is ablated when ``parsed`` is empty and ``keep=False``.

    With ``scoring="full_answer"`` the answer's tokens but the last are fed after the prompt, so the
    logits (float32) at the last ``n_scored`` positions predict each answer token (teacher forcing).
    ``ablation``: ``"zero"``; ``"mean"``, the engine's one definition
    (:func:`arithinterp.engine.mean_activation`: the mean over these prompts at each position
    counted from the prompt's end, over the prompts that have it); ``"resample"``, the activation
    of a random other prompt of the same token length (seeded). ``means``: a dict kept across calls
    on the same prompts, so mean ablation computes each activation's mean once.
    """
    n_scored, out = _n_scored(prompts), None
    generator = torch.Generator().manual_seed(seed)
    means = {} if means is None else means
    fed, fed_lengths = teacher_forced(prompts, n_scored)
    width = fed.shape[1]
    with torch.inference_mode():
        for group in prompts.length_groups():
            length = int(fed_lengths[group[0]])
            tokens, offset = fed[group, width - length :], prompts.offset(group)
            masks = _ablation_masks(model, prompts, parsed, group, offset, length, keep)
            if ablation == "mean":
                _reference_means(model, prompts, fed, fed_lengths, list(masks), means, batch_size)
                reference = {key: means[key][-length:] for key in masks}  # [length, ...], aligned from the end
            elif ablation == "resample" and masks:  # the group's own activations, each from another prompt
                reads = [Read(site, layer) for site, layer in masks]
                runs = [engine_run(model, tokens[chunk], reads=reads, logits="none").reads
                        for chunk in torch.arange(len(group)).split(batch_size)]
                reference = {}
                for i, key in enumerate(masks):
                    act = torch.cat([r[i] for r in runs])
                    reference[key] = act[torch.randperm(len(group), generator=generator).to(act.device)]
            else:
                reference = {key: None for key in masks}
            for chunk in torch.arange(len(group)).split(batch_size):
                interventions = []
                for (site, layer), mask in masks.items():
                    value = reference[site, layer]
                    if value is not None and ablation == "resample":
                        value = value[chunk.to(value.device)]
                    value_fn = _replace_where(mask[chunk], value, ablation == "resample")
                    interventions.append(Intervention(site, layer, value=value_fn))
                run = engine_run(model, tokens[chunk], interventions, logits="final" if n_scored == 1 else "all")
                assert run.logits is not None  # asked for "final" or "all"
                logits = run.logits[:, None] if n_scored == 1 else run.logits[:, -n_scored:]
                values = score(logits, group[chunk])
                if out is None:
                    out = torch.empty(len(prompts), *values.shape[1:], dtype=values.dtype)
                out[group[chunk]] = values.cpu()
    if out is None:
        raise AnalysisError("no prompts to score")
    return out


def token_scores(prompts) -> Callable:
    """A score for :func:`ablated_scores`: per answer token, argmax correct and log-probability,
    ``[B, n_scored, 2]`` (padding of shorter answers counts as correct with log-probability 0)."""
    n_scored = _n_scored(prompts)

    def score(logits, rows):
        return answer_scores(logits, prompts.answer_tokens[rows, :n_scored])

    return score


def answer_scores(logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Argmax correct and log-probability of ``answer [...]`` under ``logits [..., V]``, ``[..., 2]``
    (a padded answer token, −1, counts as correct with log-probability 0)."""
    answer = answer.to(logits.device)
    real = answer >= 0
    logprob = logits.float().log_softmax(-1).gather(-1, answer.clamp(min=0)[..., None])[..., 0]
    correct = (logits.argmax(-1) == answer) | ~real
    return torch.stack([correct.float(), logprob * real], dim=-1)


@checked
def ablate(model: HookedModel, prompts: PromptSet, components: Sequence[str], *, ablation: str = "mean",
           seed: int = 0) -> AblationResult:
    """Ablate components and measure accuracy and answer log-probability (Nikankin et al. 2025; Quirke & Barez 2024).

    components: ``"attn{l}"`` (every head of layer l), ``"mlp{l}"``, ``"L{l}H{h}"`` (one head,
        through its ``hook_z``), ``"L{l}N{n}"`` (one MLP neuron), each optionally restricted to one
        position with ``"@a"``, ``"@b"``, ``"@final"``, ``"@answer{k}"`` (the position that
        predicts answer token k) or ``"@{int}"``.
    ablation: ``"zero"``; ``"mean"`` (:func:`arithinterp.engine.mean_activation`: the mean over these
        prompts at each position counted from the prompt's end, over the prompts that have that
        position); ``"resample"`` (the activation of a random other prompt of the same length, seeded).

    Prompts with ``scoring="full_answer"`` (``prompts.with_scoring("full_answer")``) are scored on
    every answer token, teacher-forced, so a multi-digit answer is scored digit by digit (Quirke &
    Barez: mean-ablate a head at the position of one answer digit and see which digit breaks).
    """
    check_belongs(model, "patching.ablate", prompts=prompts)
    check_choice("ablation", ablation, COMPONENT_ABLATIONS)
    if len(prompts) == 0:
        raise AnalysisError("the prompt set is empty; nothing to ablate")
    parsed = parse_components(model, components, ("attn", "mlp", "head", "neuron"), prompts)
    score = token_scores(prompts)
    before = ablated_scores(model, prompts, [], ablation, seed, keep=False, score=score)
    after = ablated_scores(model, prompts, parsed, ablation, seed, keep=False, score=score)
    token_correct_before, token_correct_after = before[..., 0].bool(), after[..., 0].bool()
    correct_before, correct_after = token_correct_before.all(1), token_correct_after.all(1)
    return AblationResult(
        components=[c.name for c in parsed],
        ablation=ablation,
        scoring=prompts.scoring,
        accuracy_before=float(correct_before.float().mean()),
        accuracy_after=float(correct_after.float().mean()),
        correct_before=correct_before,
        correct_after=correct_after,
        token_correct_before=token_correct_before,
        token_correct_after=token_correct_after,
        logprob_before=before[..., 1].sum(1),
        logprob_after=after[..., 1].sum(1),
        meta=build_meta(model, n_prompts=len(prompts), seed=seed, scoring=prompts.scoring),
    )


@dataclass(frozen=True)
class ComponentFaithfulnessResult(Result):
    """Faithfulness of a circuit of components: ``(m(circuit) − m(empty)) / (m(full) − m(empty))``.

    ``m`` is the mean metric over prompts with everything outside the circuit mean-ablated
    (``circuit``), nothing ablated (``full``) or every head and MLP ablated (``empty``).
    """

    circuit: list
    faithfulness: float
    metric_full: float
    metric_circuit: float
    metric_empty: float
    accuracy_full: float
    accuracy_circuit: float
    accuracy_empty: float
    metric: str
    ablation: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _legal = {"ablation": COMPONENT_ABLATIONS, "accuracy_full": PROBABILITY, "accuracy_circuit": PROBABILITY,
              "accuracy_empty": PROBABILITY}
    _saved_names = ("FaithfulnessResult",)
    _field_names = {"mode": "ablation"}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(
            dict(
                run=["full model", "circuit only", "everything ablated"],
                metric=[self.metric_full, self.metric_circuit, self.metric_empty],
                accuracy=[self.accuracy_full, self.accuracy_circuit, self.accuracy_empty],
                faithfulness=[self.faithfulness] * 3,
            )
        )

    def plot(self, **kwargs):
        from arithinterp.viz.patching import plot_component_faithfulness

        return plot_component_faithfulness(self, **kwargs)


FAITHFULNESS_METRICS = ANSWER_METRICS  # a prompt's own answer: no counterfactual to compare with


@checked
def component_faithfulness(model: HookedModel, prompts: PromptSet, circuit: Sequence[str], metric: str = "logit",
                           *, ablation: str = "mean", seed: int = 0) -> ComponentFaithfulnessResult:
    """Faithfulness of a circuit of components (nodes: heads and MLPs; Nikankin et al. 2025,
    "Arithmetic Without Algorithms"). The faithfulness of an edge-level circuit is
    :func:`arithinterp.circuits.edge_faithfulness` (over sizes, :func:`arithinterp.circuits.faithfulness_curve`).

    Every attention head and MLP outside the circuit is mean-ablated (``ablation``: also ``"zero"``,
    ``"resample"``) and the metric on the correct answer's
    first token compared with the full model and with everything ablated:
    ``(m(circuit) − m(empty)) / (m(full) − m(empty))`` — 1 is fully faithful, 0 no better than the
    ablation baseline.

    circuit: component names as in :func:`ablate` (``"L2H1"``, ``"attn0"`` = every head of layer
        0, ``"mlp1"``, optionally ``"@position"`` to keep a component at one position only).
    metric: one of :data:`arithinterp.metrics.ANSWER_METRICS`: ``"logit"`` (default, *(choice)*),
        ``"logprob"``, ``"prob"`` or ``"accuracy"``.
    """
    check_belongs(model, "patching.component_faithfulness", prompts=prompts)
    check_choice("metric", metric, FAITHFULNESS_METRICS)
    check_choice("ablation", ablation, COMPONENT_ABLATIONS)
    if len(prompts) == 0:
        raise AnalysisError("the prompt set is empty; nothing to measure")
    parsed = parse_components(model, list(circuit), ("attn", "mlp", "head"), prompts) if len(circuit) else []
    prompts = prompts.with_scoring("first_token")

    def score(logits, rows):  # [B, 1, V] -> the metric and whether the answer is the argmax, [B, 2]
        logits, answer = logits[:, -1], prompts.answer_tokens[rows, 0].to(logits.device)
        values = {
            "logit": lambda: metric_lib.logit(logits, answer),
            "logprob": lambda: metric_lib.logprob(logits, answer),
            "prob": lambda: metric_lib.prob(logits, answer),
            "accuracy": lambda: (logits.argmax(-1) == answer).float(),
        }[metric]()
        return torch.stack([values.float(), (logits.argmax(-1) == answer).float()], dim=1)

    means: dict = {}  # the circuit and the empty run ablate the same activations: their means are taken once

    def mean_score(components, keep):
        scores = ablated_scores(model, prompts, components, ablation, seed, keep=keep, score=score, means=means)
        return scores.mean(0).tolist()

    # nothing ablated; everything outside the circuit; everything
    (m_full, a_full), (m_circ, a_circ), (m_empty, a_empty) = (
        mean_score([], False), mean_score(parsed, True), mean_score([], True)
    )
    if abs(m_full - m_empty) < 1e-12:
        raise AnalysisError("the full model and the fully ablated model score the same; faithfulness is undefined")
    return ComponentFaithfulnessResult(
        circuit=[c.name for c in parsed],
        faithfulness=(m_circ - m_empty) / (m_full - m_empty),
        metric_full=m_full,
        metric_circuit=m_circ,
        metric_empty=m_empty,
        accuracy_full=a_full,
        accuracy_circuit=a_circ,
        accuracy_empty=a_empty,
        metric=metric,
        ablation=ablation,
        meta=build_meta(model, n_prompts=len(prompts), seed=seed),
    )

