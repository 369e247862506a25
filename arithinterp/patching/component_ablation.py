"""Ablating components (:func:`ablate` → :class:`AblationResult`): zero, mean or resample ablation of
named components at their positions, scored on the prompts' own answers, teacher-forced."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from arithinterp.checks import check_belongs, check_choice
from arithinterp.drawing import draw
from arithinterp.engine import Read, RunningMean, Write
from arithinterp.engine import run as engine_run
from arithinterp.errors import AnalysisError
from arithinterp.patching.core import COMPONENT_ABLATIONS, SCORINGS
from arithinterp.results import PROBABILITY, Result, build_meta
from arithinterp.types import HookedModel, checked
from arithinterp.patching.components import Component, parse_components, scored_answer_tokens

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

# --- ablation ------------------------------------------------------------------------------------

#: The component kinds :func:`ablate` takes (as :func:`~arithinterp.patching.components.parse_components` names them).
ABLATABLE_KINDS = ("attn", "mlp", "head", "neuron")


@dataclass(frozen=True)
class AblationResult(Result):
    """Accuracy and answer log-probability before and after ablating components.

    ``token_correct_before`` / ``token_correct_after`` are ``[n_prompts, n_scored]``: whether each
    scored answer token is the argmax — the first token only, or with ``scoring="full-answer"``
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

    def to_frame(self):
        """One row per run (full model, ablated): accuracy, mean answer log-prob, per-token accuracy.

        Returns:
            A pandas DataFrame.
        """
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
        """Accuracy and log-probability before and after (see ``viz.patching``).

        Args:
            **kwargs: Passed to :func:`arithinterp.viz.patching.plot_ablation`.

        Returns:
            A plotly Figure.
        """
        return draw(self, **kwargs)


def position_rows(prompts, position: Optional[str], idx: torch.Tensor, offset: int,
                   length: int) -> Optional[torch.Tensor]:
    """Per-prompt unpadded position ``[B]`` of a component's ``@position`` (None: every position).

    Specs are resolved by ``PromptSet.locate`` (``a``, ``a[0]``, ``final-1``, ``answer[k]`` — the
    teacher-forced answer token k, fed with ``scoring="full-answer"`` — an int on same-length prompts).

    Args:
        prompts: The prompts.
        position: The component's ``@position``, or ``None``.
        idx: The batch's prompt indices [B].
        offset: The batch's left padding.
        length: The batch's fed length.

    Returns:
        long [B], or ``None`` for every position.
    """
    if position is None:
        return None
    fed = length - (prompts.tokens.shape[1] - offset)
    spec = int(position) if re.fullmatch(r"-?\d+", position) else position
    return prompts.locate(spec, answers=fed)[1][idx, 0] - offset


def _ablation_masks(model, prompts, parsed: list[Component], idx, offset, length,
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


def teacher_forced(prompts, n_scored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts with all but the last scored answer token appended, in the left-padded frame
    (answer padding fed as 0).

    Args:
        prompts: The prompts (N of them, T tokens).
        n_scored: The answer tokens scored.

    Returns:
        ``(tokens [N, T + n_scored - 1], fed length [N])``.
    """
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

    With ``scoring="full-answer"`` the answer's tokens but the last are fed after the prompt, so the
    logits (float32) at the last ``n_scored`` positions predict each answer token (teacher forcing).
    ``ablation``: ``"zero"``; ``"mean"``, the engine's one definition
    (:func:`arithinterp.engine.mean_activation`: the mean over these prompts at each position
    counted from the prompt's end, over the prompts that have it); ``"resample"``, the activation
    of a random other prompt of the same token length (seeded).

    Args:
        model: The hooked model.
        prompts: The prompts.
        parsed: The components (:func:`~arithinterp.patching.components.parse_components`).
        ablation: ``"zero"``, ``"mean"`` or ``"resample"``.
        seed: The resampling's seed.
        keep: Ablate everything but ``parsed`` instead.
        score: ``score(logits [B, n_scored, V], rows) -> [B, ...]``.
        batch_size: Prompts per forward.
        means: A dict kept across calls on the same prompts, so mean ablation computes each
            activation's mean once.

    Returns:
        The scores of every prompt, ``[N, ...]``.
    """
    n_scored, out = scored_answer_tokens(prompts), None
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
                    interventions.append(Write(site, layer, value=value_fn))
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
    ``[B, n_scored, 2]`` (padding of shorter answers counts as correct with log-probability 0).

    Args:
        prompts: The prompts scored.

    Returns:
        ``score(logits, rows)``.
    """
    n_scored = scored_answer_tokens(prompts)

    def score(logits, rows):
        return answer_scores(logits, prompts.answer_tokens[rows, :n_scored])

    return score


def answer_scores(logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Argmax correct and log-probability of an answer under logits (a padded answer token, −1,
    counts as correct with log-probability 0).

    Args:
        logits: [..., V].
        answer: Answer tokens [...].

    Returns:
        ``[..., 2]``: correct (0 / 1), log-probability.
    """
    answer = answer.to(logits.device)
    real = answer >= 0
    logprob = logits.float().log_softmax(-1).gather(-1, answer.clamp(min=0)[..., None])[..., 0]
    correct = (logits.argmax(-1) == answer) | ~real
    return torch.stack([correct.float(), logprob * real], dim=-1)


@checked
def ablate(model: HookedModel, prompts: PromptSet, components: Sequence[str], *, ablation: str = "mean",
           seed: int = 0) -> AblationResult:
    """Ablate components and measure accuracy and answer log-probability (Nikankin et al. 2025; Quirke & Barez 2024).

    Prompts with ``scoring="full-answer"`` (``prompts.with_scoring("full-answer")``) are scored on
    every answer token, teacher-forced, so a multi-digit answer is scored digit by digit (Quirke &
    Barez: mean-ablate a head at the position of one answer digit and see which digit breaks).

    Args:
        model: The hooked model.
        prompts: The prompts scored.
        components: ``"attn{l}"`` (every head of layer l), ``"mlp{l}"``, ``"L{l}H{h}"`` (one head,
            through its ``hook_z``), ``"L{l}N{n}"`` (one MLP neuron), each optionally restricted to
            one position with ``"@a"``, ``"@b"``, ``"@final"``, ``"@answer[k]"`` (answer token k,
            written order from 0: ``"@final"`` predicts the first, ``"@answer[k-1]"`` token k) or
            ``"@{int}"``.
        ablation: ``"zero"``; ``"mean"`` (:func:`arithinterp.engine.mean_activation`: the mean over
            these prompts at each position counted from the prompt's end, over the prompts that have
            that position); ``"resample"`` (the activation of a random other prompt of the same
            length, seeded).
        seed: The resampling's seed.

    Returns:
        Accuracy and answer log-probability before and after.

    Raises:
        AnalysisError: the prompt set is empty.
        ConfigError: an unknown ablation, or a component that is not allowed.
    """
    check_belongs(model, "patching.ablate", prompts=prompts)
    check_choice("ablation", ablation, COMPONENT_ABLATIONS)
    if len(prompts) == 0:
        raise AnalysisError("the prompt set is empty; nothing to ablate")
    parsed = parse_components(model, components, ABLATABLE_KINDS, prompts)
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
