"""The neurons stage: heuristic neurons of the trained model against a random-init model of the
same architecture."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

from arithinterp.report.budget import StagePlan
from arithinterp.report.stage import Section, Stage, joined, require
from arithinterp.report.work import BACKWARD, work_seconds

if TYPE_CHECKING:
    import pandas as pd

    from arithinterp.report.budget import Context

# neuron heuristics are scored on maps over the (a, b) grid, which 100 prompts cover only sparsely
MINIMUM = (100, "correctly answered prompts")


def _coverage(table) -> str:
    """Per-layer shares of labelled neurons: each layer's for a few layers, else their range."""
    shares = table.coverage()
    if len(shares) <= 4:
        return ", ".join(f"{100 * v:.0f}% in layer {layer}" for layer, v in shares.items())
    low, high = min(shares, key=shares.__getitem__), max(shares, key=shares.__getitem__)
    return f"from {100 * shares[low]:.0f}% (layer {low}) to {100 * shares[high]:.0f}% (layer {high}) per layer"


def _more_often(a, b) -> bool:
    """Whether table ``a`` labels a larger share of its neurons than ``b`` by more than 1.96
    standard errors (two-proportion test, pooled)."""
    n_a, n_b = len(a.layer), len(b.layer)
    k_a, k_b = int(a.classified.sum()), int(b.classified.sum())
    pooled = (k_a + k_b) / (n_a + n_b)
    se = (pooled * (1 - pooled) * (1 / n_a + 1 / n_b)) ** 0.5
    return se > 0 and k_a / n_a - k_b / n_b > 1.96 * se  # se = 0: both shares 0 or both 1, equal


def neurons_plan(ctx: Context) -> StagePlan:
    """Every layer on as many prompts as the share holds, with the random-init control; else the
    minimum of prompts at as many evenly spread layers as fit, with the control.

    The cost, per classification (the model's, and the control's the same): the ranking's
    forward and backward of each counterfactual pair, reading the maps (a forward of each
    prompt), and scoring each ranked neuron's map against every heuristic with the cell-shuffle
    control.

    Args:
        ctx: The report's shared state; ``ctx.budget`` is the stage's share.

    Returns:
        The plan: ``prompts`` (how many), ``layers`` (None: all).
    """
    from arithinterp.report.evaluation import prompt_positions

    prompts = ctx.prompts[: ctx.n_neuron_prompts]
    require("neurons", len(prompts))
    shape = ctx.shape
    n_layers, positions = shape.n_layers, prompt_positions(prompts)
    n_pairs = 0 if ctx.pairs is None else len(ctx.pairs)

    def cost(count: int, n_covered: int, copies: int) -> float:
        pairs = min(n_pairs, count)
        neurons = ctx.top_k_neurons * n_covered
        return copies * work_seconds(
            shape, token_layers=(pairs * (3 + BACKWARD) + count) * positions * n_layers,
            calls=3 * n_layers * math.ceil(count / 64),
            fit_steps=neurons * SCORING_STEPS, fit_flops=neurons * count * SCORING_FLOPS)

    # the control is part of the minimum: without it the share of labelled neurons is no finding
    count, layers, seconds, sample = ctx.fit_layers(prompts, "prompts and their random-init control", MINIMUM[0],
                                                    n_layers, lambda k, m: cost(k, m, 2))
    return StagePlan(dict(prompts=count, layers=None if len(layers) == n_layers else layers), seconds,
                     sample.replace(" and their random-init control", ""))


# what scoring one ranked neuron's map costs (against every heuristic, with the cell-shuffle control): steps of
# vectorised work per neuron, and FLOPs per neuron and prompt (measured with the cost model's calibration)
SCORING_STEPS = 0.5
SCORING_FLOPS = 1e5


def neurons_stage(ctx: Context) -> Section:
    """Heuristic neurons of the trained model against a random-init model of the same
    architecture, ranked and classified the same way on the same prompts and layers when the
    stage's plan holds it (:func:`neurons_plan`): the share that implement a heuristic is a
    finding only when it beats the control's (a neuron of any model that reads digit tokens
    follows some operand rule).

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, plan, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import neurons

    plan = ctx.plan_of(STAGE)
    prompts = ctx.pick(ctx.prompts[: ctx.n_neuron_prompts], plan.choices["prompts"])
    require("neurons", len(prompts))
    layers = plan.choices["layers"]
    memory = ctx.budget.memory(ctx.model)  # classify sizes each phase's batches (a backward in the ranking) from it

    def classify(model: Any):
        pairs = None if ctx.pairs is None else ctx.pairs[: min(len(ctx.pairs), len(prompts))]
        return neurons.classify(model, prompts, layers=layers, top_k=ctx.top_k_neurons, pairs=pairs,
                                max_memory=memory, progress=False)

    section = Section(STAGE.title, sample=joined(require("neurons", len(prompts)), plan.sample))
    table = classify(ctx.model)
    counts = (f"Of the {len(table.layer)} most important MLP neurons (ranked on {len(prompts)} prompts), "
              f"{100 * float(table.classified.float().mean()):.0f}% implement at least one heuristic (score ≥ "
              f"{table.threshold}): {_coverage(table)}")
    control = classify(ctx.control_model())
    counts += (f"; a random-init model of the same architecture, ranked and scored the same way: "
               f"{100 * float(control.classified.float().mean()):.0f}% ({_coverage(control)})")
    above = _more_often(table, control)
    section.findings.append(f"{counts} — more than the control: training put them there." if above
                            else f"No signal above the control: {counts[0].lower()}{counts[1:]}.")
    histogram = table.histogram()
    if above and len(histogram):
        # one column of a groupby sums to a Series; pandas annotates the sum as any scalar or frame
        per_family = cast("pd.Series", histogram.groupby("family")["neurons"].sum())
        top = per_family.sort_values(ascending=False).head(4)
        section.findings.append(
            "Most common heuristic families: " + ", ".join(f"{f} ({n})" for f, n in top.items()) + ".")
    section.figures.append(table.plot())
    return section


STAGE = Stage(name="neurons", title="Heuristic neurons", order=70, weight=1.0, minimum=MINIMUM, run=neurons_stage,
              plan=neurons_plan)
