"""The per-digit stage: for multi-token answers, which head computes which answer token
(each head mean-ablated at the position that predicts one answer token)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from arithinterp.errors import AnalysisError
from arithinterp.report.budget import OverBudget
from arithinterp.sites import coarse_to_fine
from arithinterp.report.stage import Section, Stage, joined, require

if TYPE_CHECKING:
    from arithinterp.report.budget import Context

MINIMUM = (30, "correctly answered prompts")


def _points(drop: float) -> str:
    """An accuracy drop (a fraction) in percentage points, e.g. ``"−12 points"``, ``"−0.4 points"``,
    ``"no drop"`` (never a signed zero)."""
    value = 100 * drop
    if abs(value) < 0.05:
        return "no drop"
    sign = "−" if value > 0 else "+"
    return f"{sign}{abs(value):.0f} points" if abs(value) >= 10 else f"{sign}{abs(value):.1f} points"


def digits_stage(ctx: Context) -> Section:
    """Which head computes which answer token: each head mean-ablated at the position that predicts
    one answer token (multi-token answers only).

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import patching

    if int(ctx.all_prompts.n_answer_tokens.max()) < 2:  # does not apply, whatever the sample size
        raise AnalysisError("the answers are single tokens; per-digit ablation needs multi-token answers "
                            "(e.g. zoo:add-3digit)")
    prompts = ctx.prompts[: ctx.n_digit_prompts]
    require("digits", len(prompts))
    cfg = ctx.model.cfg  # a teacher-forced forward per head and answer token

    def heads_of(layers: list[int]) -> list[str]:
        return [f"L{layer}H{head}" for layer in layers for head in range(cfg.n_heads)]

    layers = list(range(cfg.n_layers))
    # in prompt evaluations per prompt and layer: the heads of a layer ablated at one position and
    # resumed from there (about 4 on a 135M-shaped model; whole forwards would be heads × answer tokens)
    per_layer = 4
    minimum = MINIMUM[0]
    try:
        if per_layer * cfg.n_layers * ctx.budget.forward_seconds * minimum > ctx.seconds_left():
            raise OverBudget("every layer does not fit")  # a pilot at every layer would be wasted
        prompts, fitted = ctx.fit(prompts, "prompts", minimum,
                                  pilot=lambda p: patching.digit_ablation(ctx.model, p, progress=False),
                                  prior=per_layer * cfg.n_layers)
    except OverBudget:  # the heads of a sample of the layers rather than none
        # the heads that moved the operand to the answer position first, where patching located that
        prompts, layers, fitted = ctx.fit_layers(
            prompts, "prompts", minimum, cfg.n_layers,
            pilot=lambda p, ls: patching.digit_ablation(ctx.model, p, heads=heads_of(ls), progress=False),
            prior=per_layer, first=ctx.arrival_layers)
    first = [layer for layer in ctx.arrival_layers if layer in layers]
    if len(layers) < cfg.n_layers and first:
        fitted += (f"; layer{'s' if len(first) > 1 else ''} {', '.join(map(str, first))} among them, where patching "
                   "saw the varied operand reach the answer position")
    if ctx.budget.seconds != float("inf"):  # in groups, coarse to fine, while the time lasts: estimates can be low
        result, covered = _ablate_while_time_lasts(ctx, prompts, layers, heads_of, first)
        if len(covered) < len(layers):
            those = "those layers" if len(layers) < cfg.n_layers else f"the {cfg.n_layers} layers"
            fitted += (f"; stopped after {len(covered)} of {those} ({', '.join(map(str, covered))}): the "
                       "next ones would not have fitted the time left")
        layers = covered
    else:
        result = patching.digit_ablation(ctx.model, prompts, heads=heads_of(layers), progress=False)
    section = Section(STAGE.title, sample=joined(require("digits", len(prompts)), fitted))
    drop = result.drop
    order = drop.flatten().argsort(descending=True)[:3].tolist()
    n_answer = drop.shape[1]
    ablating = (f"Mean-ablating one head at the position that predicts one answer token (teacher-forced, "
                f"{result.meta['n_prompts']} prompts)")
    if float(drop.max()) * 100 < 0.05:  # a model that gets no token right has nothing to lose
        section.findings.append(f"{ablating} costs no answer token any accuracy, at any head of the layers ablated.")
    else:
        top = ", ".join(f"{result.heads[i // n_answer]} on answer token {i % n_answer} "
                        f"({_points(float(drop.flatten()[i]))})" for i in order)
        section.findings.append(f"{ablating} costs that token most for {top}.")
        per_layer = drop.reshape(len(layers), -1).max(1).values  # the heads come layer by layer
        section.findings.append(
            "Largest drop by any head of each layer: "
            + ", ".join(f"layer {layer}: {_points(float(v))}" for layer, v in zip(layers, per_layer)) + "."
        )
    section.figures.append(result.plot())
    return section


def _ablate_while_time_lasts(ctx: Context, prompts, layers: list[int], heads_of: Callable[[list[int]], list[str]],
                             first: Sequence[int] = ()) -> tuple[Any, list[int]]:
    """Per-digit ablation of the heads of ``layers`` in four groups, ``first`` then coarse to fine
    (:func:`coarse_to_fine`), each run only when the time the groups so far took per layer says
    it fits the time left → ``(result over the covered layers, covered layers ascending)``."""
    import dataclasses

    import torch

    from arithinterp import patching

    order = coarse_to_fine(layers, first)
    size = max(1, math.ceil(len(order) / 4))
    parts, covered, start = [], [], time.perf_counter()
    for group in (order[i:i + size] for i in range(0, len(order), size)):
        if covered and (time.perf_counter() - start) / len(covered) * len(group) > ctx.seconds_left():
            break
        parts.append(patching.digit_ablation(ctx.model, prompts, heads=heads_of(sorted(group)), progress=False))
        covered += sorted(group)
    heads = [h for part in parts for h in part.heads]
    accuracy = torch.cat([part.accuracy for part in parts])
    rank = {h: i for i, h in enumerate(heads_of(sorted(covered)))}  # layer by layer, as one call returns them
    keep = sorted(range(len(heads)), key=lambda i: rank[heads[i]])
    merged = dataclasses.replace(parts[0], heads=[heads[i] for i in keep], accuracy=accuracy[keep])
    return merged, sorted(covered)


STAGE = Stage(name="digits", title="Which head computes which answer digit", order=30, weight=1.0, minimum=MINIMUM,
              run=digits_stage)
