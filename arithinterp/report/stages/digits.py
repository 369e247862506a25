"""The per-digit stage: for multi-token answers, which head computes which answer token
(each head mean-ablated at the position that predicts one answer token)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from arithinterp.errors import AnalysisError
from arithinterp.report.budget import StagePlan, secs
from arithinterp.report.stage import Section, Stage, joined, require
from arithinterp.report.work import work_seconds
from arithinterp.sites import looking_first_at, spread

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


def digits_plan(ctx: Context) -> StagePlan:
    """Every layer's heads on as many prompts as the share holds; else the heads of the minimum of
    prompts at as many evenly spread layers as fit (at run time, the blocks where patching saw
    the operand arrive come first among them).

    The cost, in token-layers per prompt: the heads of layer ``l`` ablated at the position that
    predicts answer token ``k`` resume there and run the blocks from ``l`` on the positions from
    it to the answer's end ((L − l)(n − k) for n answer tokens), each position unembedded; and a
    base run and the mean-ablation run over the prompt and its answer.

    Args:
        ctx: The report's shared state; ``ctx.budget`` is the stage's share.

    Returns:
        The plan: ``prompts`` (how many), ``layers`` (how many).

    Raises:
        AnalysisError: The answers are single tokens: the stage does not apply.
    """
    from arithinterp.report.evaluation import prompt_positions

    if int(ctx.all_prompts.n_answer_tokens.max()) < 2:  # does not apply, whatever the sample size
        raise AnalysisError("the answers are single tokens; per-digit ablation needs multi-token answers "
                            "(e.g. zoo:add-3digit)")
    prompts = ctx.prompts[: ctx.n_digit_prompts]
    require("digits", len(prompts))
    shape = ctx.shape
    n_layers, n_answer = shape.n_layers, int(ctx.all_prompts.answer_tokens.shape[1])
    after = n_answer * (n_answer + 1) // 2  # positions from each answer token's to the answer's end
    base = 2 * (prompt_positions(prompts) + n_answer) * n_layers

    def cost(count: int, n_covered: int) -> float:
        steps = sum(n_layers - layer for layer in spread(n_layers, n_covered))
        return work_seconds(shape, token_layers=count * (shape.n_heads * steps * after + base),
                            unembeds=count * shape.n_heads * n_covered * after,
                            calls=steps * n_answer * math.ceil(count / 64))

    count, layers, seconds, sample = ctx.fit_layers(prompts, "prompts", MINIMUM[0], n_layers, cost)
    return StagePlan(dict(prompts=count, layers=len(layers)), seconds, sample)


def digits_stage(ctx: Context) -> Section:
    """Which head computes which answer token: each head mean-ablated at the position that predicts
    one answer token (multi-token answers only), at the layers of the stage's plan (:func:`digits_plan`).

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, plan, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import patching

    plan = ctx.plan_of(STAGE)
    prompts = ctx.pick(ctx.prompts[: ctx.n_digit_prompts], plan.choices["prompts"])
    cfg = ctx.model.cfg
    n_covered = plan.choices["layers"]
    # the blocks that moved the operand to the answer position first, where patching located them
    layers = sorted(looking_first_at(spread(cfg.n_layers, n_covered), ctx.arrival_layers))
    sample = plan.sample
    if n_covered < cfg.n_layers:
        sample = (f"{ctx.sampled(len(prompts), len(ctx.prompts[: ctx.n_digit_prompts]), 'prompts', share=False)} and "
                  f"{n_covered} of {cfg.n_layers} layers ({', '.join(map(str, layers))}) to fit its "
                  f"{secs(plan.share)} share")
        first = [layer for layer in ctx.arrival_layers if layer in layers]
        if first:
            sample += (f"; layer{'s' if len(first) > 1 else ''} {', '.join(map(str, first))} among them, where "
                       "patching saw the varied operand reach the answer position")
    heads = [f"L{layer}H{head}" for layer in layers for head in range(cfg.n_heads)]
    result = patching.digit_ablation(ctx.model, prompts, heads=heads, progress=False)
    section = Section(STAGE.title, sample=joined(require("digits", len(prompts)), sample))
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


STAGE = Stage(name="digits", title="Which head computes which answer digit", order=30, weight=1.5, minimum=MINIMUM,
              run=digits_stage, plan=digits_plan)
