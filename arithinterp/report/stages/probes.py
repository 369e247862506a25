"""The probes stage: linear probes per target over layers, against chance, shuffled labels and a
random-init model of the same architecture."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from arithinterp.errors import AnalysisError
from arithinterp.report.budget import StagePlan, over_budget, secs
from arithinterp.report.stage import Section, Stage, joined, require
from arithinterp.report.work import work_seconds
from arithinterp.sites import coarse_to_fine
from arithinterp.tasks.places import PLACES

if TYPE_CHECKING:
    from arithinterp.report.budget import Context

# a 3-fold probe on 60 prompts is tested on 20 per fold
MINIMUM = (60, "correctly answered prompts")
PROBE_LAYERS = 4  # the fewest layers the probes stage covers before it samples fewer prompts instead


def _probe_targets(prompts: Any) -> tuple[str, ...]:
    """Whole numbers where each is one token; where numbers are spelled out digit by digit, a's
    units digit, the carry into the tens, and the answer's leading digit (the first token the
    model writes) and units digit (written last: read at the prompt's end, it is computed ahead)."""
    if prompts.single_token_operands:
        return ("a", "answer_units", "answer")
    varying = [place for place in PLACES[1:4] if f"answer_{place}" in prompts.label_names()
               and len(prompts.label(f"answer_{place}").unique()) > 1]
    return ("a_units", "carry_tens") + ((f"answer_{varying[-1]}",) if varying else ()) + ("answer_units",)


def _folds(count: int) -> int:
    # five folds when there are prompts enough: a fold-mean's t interval with 2 degrees of freedom is 1.5 times as wide
    return 5 if count >= 100 else 3


def probes_plan(ctx: Context) -> StagePlan:
    """Prompts before layers: every prompt at as many layers as the share holds, coarse to fine
    (:func:`coarse_to_fine`: the last, the first, the middle, ...); prompts are sampled only when
    not even :data:`PROBE_LAYERS` layers fit with all of them.

    The cost: reading the prompts' residual stream (the model and its random-init control, every
    block), and per layer, target and position two batched L-BFGS fits (:class:`LogisticProbe`:
    every fold on the labels and on shuffled labels, and on every prompt; then every fold on the
    control's activations) of at most 100 steps, each step a product of the rows' weights with
    the prompts' activations for each class.

    Args:
        ctx: The report's shared state; ``ctx.budget`` is the stage's share.

    Returns:
        The plan: ``prompts`` (how many), ``layers`` (which).
    """
    from arithinterp.report.evaluation import prompt_positions

    prompts = ctx.prompts[: ctx.n_probe_prompts]
    require("probes", len(prompts))
    shape = ctx.shape
    n_layers, targets = shape.n_layers, _probe_targets(prompts)
    classes = sum(len(prompts.label(target).unique()) for target in targets)
    positions, steps = 3, 100  # a, b and final; LogisticProbe's max_iter
    read = 2 * prompt_positions(prompts) * n_layers  # the model and its control, up to the last layer

    def cost(count: int, n_covered: int) -> float:
        folds = _folds(count)
        rows = 2 * folds + 1 + folds  # the labels' folds, the shuffled labels', every prompt; the control's folds
        flops = steps * 6 * rows * count * shape.d_model * classes * positions * n_covered
        return work_seconds(shape, token_layers=count * read, calls=2 * n_layers * math.ceil(count / 64),
                            fit_steps=steps * 2 * len(targets) * positions * n_covered, fit_flops=flops)

    n, least = len(prompts), min(PROBE_LAYERS, n_layers)
    order = coarse_to_fine(list(range(n_layers)))
    if cost(n, least) <= ctx.budget.seconds:
        count, sample = n, ""
        covered = _largest_fit(least, n_layers, lambda m: cost(n, m) <= ctx.budget.seconds)
    else:
        count, _, sample = ctx.fit(prompts, "prompts", MINIMUM[0], lambda k: cost(k, least))
        covered = least
        if cost(count, least) > ctx.budget.seconds:  # not even the minimum at PROBE_LAYERS layers: fewer layers
            if cost(count, 1) > ctx.budget.seconds:
                raise over_budget(ctx.budget, f"the minimum of {count} prompts at a single layer", cost(count, 1))
            covered = _largest_fit(1, least, lambda m: cost(count, m) <= ctx.budget.seconds)
    layers = sorted(order[:covered])
    if covered < n_layers:
        sample = joined(sample, f"probed at {covered} of {n_layers} layers ({', '.join(map(str, layers))}) to fit its "
                                f"{secs(ctx.budget.seconds)} share")
    return StagePlan(dict(prompts=count, layers=layers), cost(count, covered), sample)


def _largest_fit(low: int, high: int, fits) -> int:
    return max([low] + [m for m in range(low, high + 1) if fits(m)])


def probes_stage(ctx: Context) -> Section:
    """Probes per target, each against chance, shuffled labels and a random-init model of the
    same architecture on the same prompts: a finding only when the trained model beats all three
    (readable because of training, not because the input shows it); on the prompts and layers of
    the stage's plan (:func:`probes_plan`).

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, plan, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import probes
    from arithinterp.activations import collect

    plan = ctx.plan_of(STAGE)
    prompts = ctx.pick(ctx.prompts[: ctx.n_probe_prompts], plan.choices["prompts"])
    require("probes", len(prompts))
    layers = list(plan.choices["layers"])
    where: dict[str, Any] = dict(sites="resid_post", layers=layers, positions=["a", "b", "final"], progress=False)
    acts = collect(ctx.model, prompts, **where)
    control = collect(ctx.control_model(), prompts, **where)
    targets = _probe_targets(prompts)
    probe: dict[str, Any] = dict(kind="logistic", cv=_folds(len(prompts)), seed=ctx.seed, progress=False)
    section = Section(STAGE.title, sample=joined(require("probes", len(prompts)), plan.sample))
    fold_scheme = None  # of the last target probed
    for target in targets:
        try:
            result = probes.probe_layers(acts, target, layers=layers, control_acts=control, **probe)
        except AnalysisError as why:  # e.g. one class among these prompts
            section.findings.append(f"'{target}' not probed: {str(why).rstrip('.')}.")
            continue
        section.findings.append(result.finding()["text"])
        section.figures.append(result.plot())
        fold_scheme = result.fold_scheme
    section.sample += f"; folds: {fold_scheme}" if fold_scheme is not None else ""
    section.sample += "; controls: chance, shuffled labels, a random-init model of the same architecture"
    return section


STAGE = Stage(name="probes", title="Linear probes", order=40, weight=1.5, minimum=MINIMUM, run=probes_stage,
              plan=probes_plan)
