"""The causal stage: distributed alignment search for the variables of the task's built-in causal
model, probe accuracy (readable) beside DAS IIA and a random rotation's (used)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from arithinterp.errors import AnalysisError
from arithinterp.report.budget import StagePlan, over_budget, secs
from arithinterp.report.stage import Section, Stage, joined, require
from arithinterp.report.work import BACKWARD, work_seconds
from arithinterp.tasks.places import PLACES

if TYPE_CHECKING:
    from arithinterp.report.budget import Context
    from arithinterp.tasks import PromptSet


CAUSAL_PAIRS = 400  # interchange pairs per variable at most (about 30% held out by operand pair and scored)
CAUSAL_STEPS = 100  # DAS training steps per fit: never cut to fit a budget (fewer cells instead)
CAUSAL_K = 4  # dimensions interchanged
CAUSAL_LOCALISED = 0.9  # IIA from which a finding calls the variable localised at a cell


def _causal_cells(prompts: PromptSet) -> tuple[list[str], str]:
    """The variables the causal stage aligns and the position it aligns them at, from the task the
    prompts pose (its built-in causal model raises :class:`AnalysisError`, shown as "not run", for a
    task without one): ``wraps`` for modular addition and ``sum_mod_10`` and ``magnitude`` for
    single-token numbers, at the final position; for numbers spelled digit by digit, the carries
    these operands make — into the operands' top column (``carry_tens`` for two-digit operands), and
    out of it where the sums reach the next power of ten — at b's last token, where both operands'
    digits are first seen together.

    Args:
        prompts: The correctly answered prompts.

    Returns:
        ``(variables, position)``; only variables that take two values or more on the prompts.
    """
    from arithinterp.causal import for_prompts

    largest = int(max(prompts.a.max(), prompts.b.max()))
    n_digits = max(1, len(str(largest)))
    single = prompts.single_token_operands and int(prompts.meta.get("answer_digits", 0)) == 0
    model = for_prompts(prompts.op, prompts.modulus, n_digits, single)
    if prompts.modulus is not None:
        candidates, position = ["wraps"], "final"
    elif single:
        candidates, position = ["sum_mod_10", "magnitude"], "final"
    else:
        into_top = [f"carry_{PLACES[n_digits - 1]}"] if n_digits > 1 else []
        candidates, position = [*into_top, f"carry_{PLACES[n_digits]}"], "b"
    values = model.values(prompts.a, prompts.b)
    return [v for v in candidates if v in values and len(values[v].unique()) > 1], position


def _das_layers(n_layers: int, count: int) -> list[int]:
    """``count`` of ``n_layers`` layers evenly spread over the inside of the depth (one: the middle),
    all of them when ``count`` covers them: a variable is computed and moved in the middle layers,
    and the last layer's stream at an operand has nothing left to move."""
    if count >= n_layers:
        return list(range(n_layers))
    return sorted({min(n_layers - 1, round((i + 1) * n_layers / (count + 1))) for i in range(count)})


def causal_plan(ctx: Context) -> StagePlan:
    """Every variable at every layer, each fit trained for :data:`CAUSAL_STEPS` steps; when the
    share does not hold that, fewer layers (evenly spread inside the depth, :func:`_das_layers`),
    then one variable — never fewer steps, which would leave the fits unconverged.

    The cost, per variable: the base and source prompts' runs; per layer ``l``, Adam's steps on
    batches of training pairs, each pair's run resumed at ``l`` and the position and run forward
    and backward through the blocks after it, its answer positions unembedded over the vocabulary
    (the loss is a cross-entropy); the held-out pairs scored under DAS, no intervention and a
    random rotation, and the training pairs under DAS; and a grouped probe per layer (100 L-BFGS
    steps).

    Args:
        ctx: The report's shared state; ``ctx.budget`` is the stage's share.

    Returns:
        The plan: ``variables`` and ``layers``.

    Raises:
        AnalysisError: The task has no built-in causal model, or none of its variables varies.
    """
    from arithinterp.causal import interchange_dataset
    from arithinterp.causal.scoring import pairs_per_step
    from arithinterp.report.evaluation import prompt_positions

    prompts = ctx.prompts
    require("causal", 0 if prompts is None else len(prompts))
    variables, position = _causal_cells(prompts)
    if not variables:
        raise AnalysisError("none of the causal model's variables varies on these prompts")
    shape = ctx.shape
    n_layers = shape.n_layers
    n_pairs = min(CAUSAL_PAIRS, len(prompts))
    dataset = interchange_dataset(prompts, variables[0], n=n_pairs, seed=ctx.seed)
    per_step = pairs_per_step(ctx.model, dataset, ctx.budget.memory(ctx.model))
    width = int(prompts.tokens.shape[1]) + int(prompts.answer_tokens.shape[1])
    tail = width - float(prompts.locate([position])[1].float().mean())  # positions from the intervened one
    n_test = round(0.3 * len(dataset))
    runs = 2 * len(dataset) * prompt_positions(prompts) * n_layers

    n_answer = int(prompts.answer_tokens.shape[1])

    def cost(n_variables: int, n_covered: int) -> float:
        steps = sum(n_layers - layer for layer in _das_layers(n_layers, n_covered))
        trained = CAUSAL_STEPS * per_step * (1 + BACKWARD) + 3 * n_test + (len(dataset) - n_test)
        return n_variables * work_seconds(
            shape, token_layers=runs + steps * tail * trained, unembeds=n_covered * n_answer * trained,
            calls=n_covered * (CAUSAL_STEPS * (1 + BACKWARD) + 8) * n_layers / 2,
            fit_steps=n_covered * (CAUSAL_STEPS + 100),
            fit_flops=n_covered * 100 * 6 * 6 * len(prompts) * shape.d_model * 10)

    def layers_fitting(n_variables: int) -> int:
        return max([0] + [m for m in range(1, n_layers + 1) if cost(n_variables, m) <= ctx.budget.seconds])

    covered, only = layers_fitting(len(variables)), ""
    if covered == 0 and len(variables) > 1:  # one variable at a layer or more rather than none
        variables, only = variables[:1], f"{variables[0]} only"
        covered = layers_fitting(1)
    if covered == 0:
        raise over_budget(ctx.budget, f"one DAS fit of {CAUSAL_STEPS} steps for {variables[0]} at one layer",
                          cost(1, 1))
    layers = _das_layers(n_layers, covered)
    seconds = cost(len(variables), covered)
    sample = joined(only, "" if covered == n_layers else (
        f"{covered} of {n_layers} layers ({', '.join(map(str, layers))}) at {CAUSAL_STEPS} training steps per fit "
        f"to fit its {secs(ctx.budget.seconds)} share"))
    return StagePlan(dict(variables=variables, position=position, layers=layers), seconds, sample)


def causal_stage(ctx: Context) -> Section:
    """Distributed alignment search (Geiger et al. 2024) for the variables the task poses
    (:func:`_causal_cells`): per variable and layer, probe accuracy with folds grouped by operand
    pair (readable) beside held-out DAS IIA and a random rotation's (used), at the cells of the
    stage's plan (:func:`causal_plan`). A fit whose loss was still falling when its steps ran out is
    flagged as not converged and no finding is drawn from it. The first finding is the verdict.

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, plan, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import causal

    plan = ctx.plan_of(STAGE)
    prompts = ctx.prompts
    require("causal", 0 if prompts is None else len(prompts))
    assert prompts is not None  # require() counted them
    variables, position, layers = plan.choices["variables"], plan.choices["position"], plan.choices["layers"]
    n_pairs = min(CAUSAL_PAIRS, len(prompts))
    result = causal.readable_vs_used(ctx.model, prompts, variables, layers=layers, positions=position, k=CAUSAL_K,
                                     steps=CAUSAL_STEPS, n=n_pairs, max_memory=ctx.budget.memory(ctx.model),
                                     seed=ctx.seed, progress=False)
    frame = result.to_frame()
    where = "the final position" if position == "final" else f"{position}'s last token"
    section = Section(STAGE.title, sample=joined(
        require("causal", len(prompts)), f"up to {n_pairs:,} interchange pairs per variable, about 30% held out "
        f"by operand pair; {', '.join(variables)} at {where}", plan.sample))
    rows, verdicts = [], []
    for row in frame.to_dict("records"):
        probe = ("not probed (one value)" if math.isnan(row["probe_accuracy"]) else
                 f"{row['probe_accuracy']:.3f} [{row['probe_low']:.3f}, {row['probe_high']:.3f}] "
                 f"(shuffled labels {row['probe_control']:.3f})")
        control = max(row["random_iia"], row["chance"]) + 1e-9  # an interval from 0 hits starts at 0 up to rounding
        verdict = (f"not converged after {CAUSAL_STEPS} steps (its loss was still falling): no finding from it"
                   if not row["converged"] else
                   "no signal above the control" if row["das_low"] <= control else
                   f"localised here (IIA ≥ {CAUSAL_LOCALISED})" if row["das_iia"] >= CAUSAL_LOCALISED else
                   f"above the control but not localised (IIA < {CAUSAL_LOCALISED})")
        verdicts.append((row, verdict))
        rows.append(f"{row['variable']}, layer {row['layer']}: probe accuracy {probe}; DAS IIA {row['das_iia']:.3f} "
                    f"[{row['das_low']:.3f}, {row['das_high']:.3f}], random rotation {row['random_iia']:.3f} (chance "
                    f"{row['chance']:.3f}): {verdict}.")
    section.findings.append(_verdict(verdicts, where))
    section.findings.append(
        f"Distributed alignment search (Geiger et al. 2024): a learned {CAUSAL_K}-dimensional subspace of resid_post "
        f"at {where} is swapped from a source prompt into a base prompt; interchange-intervention accuracy "
        "(IIA) is the share of held-out pairs on which the model then answers what the causal model predicts for "
        "the source's value of the variable (0 when copying either prompt). 'Readable' is a logistic probe's "
        "accuracy with folds grouped by operand pair (95% intervals in brackets).")
    section.findings += rows
    section.figures.append(result.plot())
    return section


def _verdict(verdicts: list[tuple[dict, str]], where: str) -> str:
    """The stage's summary: per variable, the cell with the highest IIA among the converged fits
    that beat the control, else "no signal above the control" — or, when no fit converged, that
    nothing is read from them."""
    parts = []
    for variable in dict.fromkeys(row["variable"] for row, _ in verdicts):
        mine = [(row, v) for row, v in verdicts if row["variable"] == variable]
        found = [(row, v) for row, v in mine if v.startswith(("localised", "above"))]
        unconverged = sum(1 for _, v in mine if v.startswith("not converged"))
        if found:
            row, verdict = max(found, key=lambda pair: pair[0]["das_iia"])
            # "used" only where the alignment carries most interventions; a weak one is said as what it is
            said = (f"{variable} is localised at {where}" if verdict.startswith("localised") else
                    f"{variable} at {where} is above the control but not localised (IIA < {CAUSAL_LOCALISED})")
            parts.append(f"{said}: best at layer {row['layer']}, DAS IIA {row['das_iia']:.3f} "
                         f"[{row['das_low']:.3f}, {row['das_high']:.3f}] against a random rotation's "
                         f"{row['random_iia']:.3f} and chance {row['chance']:.3f}")
        elif unconverged == len(mine):
            parts.append(f"no finding for {variable} at {where}: {'its' if unconverged == 1 else 'every one of its'} "
                         f"{unconverged} fit{'s' * (unconverged > 1)} was still improving after {CAUSAL_STEPS} "
                         "training steps (not converged), so no IIA is read from it")
        else:
            parts.append(f"no signal above the control for {variable} at {where} (no converged fit's IIA interval "
                         "clears the random rotation and chance)"
                         + (f"; {unconverged} fit{'s' * (unconverged > 1)} did not converge" if unconverged else ""))
    return "DAS: " + "; ".join(parts) + "."


STAGE = Stage(name="causal", title="Causal variables: readable vs used (DAS)", order=100, weight=1.5,
              minimum=(100, "correctly answered prompts"), run=causal_stage, plan=causal_plan)
