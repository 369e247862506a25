"""The causal stage: distributed alignment search for the variables of the task's built-in causal
model, probe accuracy (readable) beside DAS IIA and a random rotation's (used)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from arithinterp.report.budget import OverBudget, secs
from arithinterp.report.stage import Section, Stage, joined, require
from arithinterp.sites import spread
from arithinterp.tasks.places import PLACES

if TYPE_CHECKING:
    from arithinterp.report.budget import Context
    from arithinterp.tasks import PromptSet


CAUSAL_PAIRS = 400  # interchange pairs per variable at most (about 30% held out by operand pair and scored)
CAUSAL_STEPS = 100  # DAS training steps per cell when the budget allows (fewer, and said so, when not)
CAUSAL_MIN_STEPS = 30  # below this a fit says little: fewer cells first, then "over budget"
CAUSAL_K = 4  # dimensions interchanged
CAUSAL_LOCALISED = 0.9  # IIA from which a finding calls the variable localised at a cell


def _causal_variables(prompts: PromptSet) -> list[str]:
    """The variables the causal stage aligns, from the task's built-in causal model (which raises
    :class:`AnalysisError`, shown as "not run", for a task without one): those decided where the
    first answer token is predicted, at the final position."""
    from arithinterp.causal import for_prompts

    n_digits = int(prompts.meta.get("n_digits", 1))
    single = prompts.single_token_operands and int(prompts.meta.get("answer_digits", 0)) == 0
    for_prompts(prompts.op, prompts.modulus, n_digits, single)
    if prompts.modulus is not None:
        return ["wraps"]
    if single:
        return ["sum_mod_10", "magnitude"]
    # the leading answer digit is predicted at the final position: the carry into that column where the
    # operands have no digit there (add-3digit: carry_thousands), else that digit of the sum
    top = n_digits - 1
    only_carry = int(max(prompts.a.max(), prompts.b.max())) < 10**top
    return [f"carry_{PLACES[top]}" if only_carry else f"answer_{PLACES[top]}"]


def causal_stage(ctx: Context) -> Section:
    """Distributed alignment search (Geiger et al. 2024) for the variables of the task's built-in
    causal model at the final position: per variable and layer, probe accuracy with folds grouped
    by operand pair (readable) beside held-out DAS IIA and a random rotation's (used). Cells and
    training steps are cut to the budget (timed on the first variable's fit) and the sample says so.

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import causal

    prompts = ctx.prompts
    require("causal", 0 if prompts is None else len(prompts))
    assert prompts is not None  # require() counted them
    variables = _causal_variables(prompts)
    memory = ctx.budget.memory(ctx.model)
    n_pairs = min(CAUSAL_PAIRS, len(prompts))
    n_layers = int(ctx.model.cfg.n_layers)
    layers, steps, fitted = list(range(n_layers)), CAUSAL_STEPS, ""
    if ctx.budget.seconds != float("inf"):  # time one fit at two step counts: a fixed cost plus one per step
        dataset = causal.interchange_dataset(prompts, variables[0], n=n_pairs, seed=ctx.seed)
        times = []
        for few in (2, 12):
            start = time.perf_counter()
            causal.das(ctx.model, dataset, "resid_post", n_layers - 1, CAUSAL_K, positions="final", steps=few,
                       baselines=("random",), max_memory=memory, seed=ctx.seed, progress=False)
            times.append(time.perf_counter() - start)
        # a step's time is the difference of two timings, noisy on a busy machine: counted 1.5 times over
        per_step = 1.5 * max((times[1] - times[0]) / 10, 0.05 * times[0] / 2, 1e-3)
        fixed = max(times[0] - 2 * per_step, 0.0)
        left = max(ctx.seconds_left(), 0.0) * 0.8  # the probes and the datasets take the rest

        def steps_for(n_vars: int, n_cells: int) -> int:
            return int((left / (n_vars * n_cells) - fixed) / per_step)

        while len(layers) > 1 and steps_for(len(variables), len(layers)) < CAUSAL_MIN_STEPS:
            layers = spread(n_layers, len(layers) - 1)
        if steps_for(len(variables), len(layers)) < CAUSAL_MIN_STEPS:
            variables = variables[:1]
        steps = min(CAUSAL_STEPS, steps_for(len(variables), len(layers)))
        if steps < CAUSAL_MIN_STEPS:
            raise OverBudget(
                f"Not run within the budget: one DAS fit of {CAUSAL_MIN_STEPS} steps on {len(dataset)} pairs would "
                f"take about {secs(fixed + CAUSAL_MIN_STEPS * per_step)}, more than the {secs(left)} left of this "
                f"stage's {secs(ctx.budget.seconds)} budget; give the report more time (budget=, --budget SECONDS).")
        if steps < CAUSAL_STEPS or len(layers) < n_layers:
            fitted = (f"{steps} of {CAUSAL_STEPS} training steps per fit at {len(layers)} of {n_layers} layers "
                      f"({', '.join(map(str, layers))}) to fit the {secs(ctx.budget.seconds)} budget")
        else:
            fitted = f"every layer at {steps} training steps per fit fits the {secs(ctx.budget.seconds)} budget"
    result = causal.readable_vs_used(ctx.model, prompts, variables, layers=layers, positions="final", k=CAUSAL_K,
                                     steps=steps, n=n_pairs, max_memory=memory, seed=ctx.seed, progress=False)
    frame = result.to_frame()
    section = Section(STAGE.title, sample=joined(
        require("causal", len(prompts)), f"up to {n_pairs:,} interchange pairs per variable, about 30% held out "
        "by operand pair", fitted))
    section.findings.append(
        f"Distributed alignment search (Geiger et al. 2024): a learned {CAUSAL_K}-dimensional subspace of resid_post "
        "at the final position is swapped from a source prompt into a base prompt; interchange-intervention accuracy "
        "(IIA) is the share of held-out pairs on which the model then answers what the causal model predicts for "
        "the source's value of the variable (0 when copying either prompt). 'Readable' is a logistic probe's "
        "accuracy with folds grouped by operand pair (95% intervals in brackets).")
    for row in frame.to_dict("records"):
        probe = ("not probed (one value)" if math.isnan(row["probe_accuracy"]) else
                 f"{row['probe_accuracy']:.3f} [{row['probe_low']:.3f}, {row['probe_high']:.3f}] "
                 f"(shuffled labels {row['probe_control']:.3f})")
        control = max(row["random_iia"], row["chance"]) + 1e-9  # an interval from 0 hits starts at 0 up to rounding
        verdict = ("no signal above the control" if row["das_low"] <= control else
                   f"localised here (IIA ≥ {CAUSAL_LOCALISED})" if row["das_iia"] >= CAUSAL_LOCALISED else
                   f"above the control but not localised (IIA < {CAUSAL_LOCALISED})")
        section.findings.append(
            f"{row['variable']}, layer {row['layer']}: probe accuracy {probe}; DAS IIA {row['das_iia']:.3f} "
            f"[{row['das_low']:.3f}, {row['das_high']:.3f}], random rotation {row['random_iia']:.3f} (chance "
            f"{row['chance']:.3f}): {verdict}.")
    section.figures.append(result.plot())
    return section


STAGE = Stage(name="causal", title="Causal variables: readable vs used (DAS)", order=100, weight=0.5,
              minimum=(100, "correctly answered prompts"), run=causal_stage)
