"""The error-detection stage: the probe-based error detector on held-out prompts, of the model
itself when it errs often enough, else of the zoo's deliberately imperfect model."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from arithinterp.report.budget import Budget, StagePlan, secs
from arithinterp.report.stage import Section, Stage, joined, require
from arithinterp.report.work import Shape, work_seconds

if TYPE_CHECKING:
    from arithinterp.report.budget import Context

# the detector's balanced accuracy averages two rates, each over at least 20 held-out answers
MINIMUM = (20, "held-out answers of the rarer kind, wrong or correct")


def _beats_chance(m: dict) -> bool:
    """Whether balanced accuracy is above 0.5 (what answering always "correct" or always "wrong"
    scores) by more than 1.96 standard errors (normal approximation over the two classes)."""
    n_errors, n_correct = m["n_errors"], m["n"] - m["n_errors"]
    if n_errors == 0 or n_correct == 0:  # one class only: balanced accuracy has no second rate to beat chance with
        return False
    tpr = m["recall"]  # correct answers called correct
    tnr = 2 * m["balanced_accuracy"] - tpr  # wrong answers flagged
    se = 0.5 * (tpr * (1 - tpr) / n_correct + tnr * (1 - tnr) / n_errors) ** 0.5
    return m["balanced_accuracy"] - 1.96 * se > 0.5


WEAK = "zoo:add-3digit-weak"  # the zoo model stopped early so that it still errs


def _detector_task(ctx: Context) -> tuple[Any, Any, str, float, int]:
    """``(model, its prompts in the order the detector takes them, its name, the rarer kind's
    share of answers, prompts of them already evaluated)``: the report's own model and task when
    the model errs often enough (the evaluation's prompts first: its seeded order), else the
    zoo's weak model and its held-out problems (its card's measured error rate)."""
    import torch

    from arithinterp.models import load_model
    from arithinterp.models.zoo import get_entry, held_out_prompts

    n_errors = int((~ctx.evaluation.correct).sum())
    if n_errors >= 50:
        task = ctx.task_prompts if ctx.task_prompts is not None else ctx.all_prompts
        order = torch.randperm(len(task), generator=torch.Generator().manual_seed(ctx.seed))
        done = len(ctx.all_prompts) if ctx.task_prompts is not None else len(task)
        rarer = min(n_errors, len(ctx.all_prompts) - n_errors) / len(ctx.all_prompts)
        return ctx.model, task[order[: ctx.n_detector_prompts]], ctx.spec, rarer, done
    model = load_model(WEAK)
    entry = get_entry(WEAK)
    accuracy = float(entry.card().get("held_out_accuracy", 0.9))
    prompts = held_out_prompts(model, entry, limit=ctx.n_detector_prompts, seed=ctx.seed)  # in a seeded order
    return model, prompts, WEAK, min(accuracy, 1 - accuracy), 0


def _candidates(shape: Any, n_slots: int) -> int:
    from arithinterp.probes.detector import JOINT_MAX_FEATURES

    return shape.n_layers + (shape.n_layers > 1 and n_slots * shape.n_layers * shape.d_model <= JOINT_MAX_FEATURES)


def errors_plan(ctx: Context) -> StagePlan:
    """The detector as it runs on its own: on every prompt of the task (at most
    ``ctx.n_detector_prompts``), two thirds to fit and the rest held out, with its whole layer
    search; when the share does not hold that, all the prompts with fewer layer candidates (coarse
    to fine over the depth, the last layer first), then fewer prompts with one candidate — and the
    sample line says what the detector alone would take and what budget would give it that.

    The cost: evaluating the prompts the report's evaluation did not, reading every prompt's slots
    (a forward through every block: the search starts at the last layer), and per candidate the
    batched L-BFGS fits of its probes (digit, output and carry probes per slot and the direct
    probe, every fold) of at most 100 steps.

    Args:
        ctx: The report's shared state; ``ctx.budget`` is the stage's share.

    Returns:
        The plan: ``prompts`` (how many, in the task's seeded order), ``candidates`` (layer
        candidates tried; the whole search when it equals their number).
    """
    from arithinterp.report.evaluation import evaluation_seconds, prompt_positions

    model, prompts, name, rarer, done = _detector_task(ctx)
    n = len(prompts)
    shape = Shape.of(model)
    least = min(n, math.ceil(3 * MINIMUM[0] / max(rarer, 1e-9)))
    if round(rarer * n / 3) < MINIMUM[0]:  # the held-out third cannot hold the minimum of each kind
        require("errors", int(rarer * n / 3))
    n_slots = int(prompts.answer_tokens.shape[1])
    per_eval = evaluation_seconds(model, prompts, 256)
    read = (prompt_positions(prompts) + n_slots) * shape.n_layers
    every = _candidates(shape, n_slots)

    def cost(count: int, candidates: int) -> float:
        fit = 2 * count // 3
        classes = 10 * 2 * n_slots + 2 * n_slots + 2  # true and output digits, carries, the direct probe
        flops = 100 * 6 * 6 * fit * shape.d_model * classes * candidates
        # the first candidate is the last layer: every read runs the whole depth
        return (max(count - done, 0) * per_eval
                + work_seconds(shape, token_layers=count * read, calls=2 * shape.n_layers * math.ceil(count / 256),
                               fit_steps=150 * (3 * n_slots + 1) * candidates, fit_flops=flops))

    alone = cost(n, every)
    if alone <= ctx.budget.seconds:
        return StagePlan(dict(prompts=n, candidates=every), alone, "")
    if cost(n, 1) <= ctx.budget.seconds:
        count = n
        candidates = max(c for c in range(1, every + 1) if cost(n, c) <= ctx.budget.seconds)
    else:
        count, _, _ = ctx.fit(prompts, "prompts", least, lambda k: cost(k, 1))
        candidates = 1
    short = (f"the detector on its own (all {n:,} prompts of {name}, its {every} layer candidates) would take about "
             f"{secs(alone)} of model work, more than this stage's {secs(ctx.budget.seconds)} share: a budget of about "
             f"{math.ceil((ctx.budget.total + alone - ctx.budget.seconds) / 10) * 10:,} s would give it that")
    return StagePlan(dict(prompts=count, candidates=candidates), cost(count, candidates), short)


def error_detector_stage(ctx: Context) -> Section:
    """Probe-based error detection on the main model if it errs often enough, else on the zoo's
    deliberately imperfect model (and the finding says which), on the prompts and layer
    candidates of the stage's plan (:func:`errors_plan`).

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, plan, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    import torch

    from arithinterp import probes
    from arithinterp.tasks import Evaluation

    plan = ctx.plan_of(STAGE)
    model, task, name, _, done = _detector_task(ctx)
    count, candidates = plan.choices["prompts"], plan.choices["candidates"]
    prompts = task[:count]
    section = Section(STAGE.title)
    batch_size = Budget(bytes=ctx.budget.bytes).batch_size(model, int(prompts.lengths.max()),
                                                            n_new=int(prompts.answer_tokens.shape[1]))
    if model is ctx.model and done:  # the evaluation's answers for the prompts it read: the seeded order's first ones
        every_prompt = ctx.task_prompts if ctx.task_prompts is not None else ctx.all_prompts
        order = torch.randperm(len(every_prompt), generator=torch.Generator().manual_seed(ctx.seed))
        rank = torch.empty(len(every_prompt), dtype=torch.long)
        rank[order[:done].sort().values] = torch.arange(done)  # where each evaluated prompt sits in ctx.evaluation
        known = ctx.evaluation[rank[order[: min(count, done)]]]
        parts = [known] + ([prompts[done:].evaluate(model, batch_size=batch_size)] if count > done else [])
        evaluation = Evaluation(torch.cat([p.correct for p in parts]), torch.cat([p.model_answer for p in parts]),
                                [t for p in parts for t in p.answer_text],
                                torch.cat([p.generated_tokens for p in parts]))
    else:
        evaluation = prompts.evaluate(model, batch_size=batch_size)
    if model is not ctx.model:
        n_errors = int((~ctx.evaluation.correct).sum())
        section.findings.append(
            f"{ctx.spec} makes only {n_errors} errors here, too few to learn from; this section detects the "
            f"errors of {name}, a model stopped early so that it still errs.")
    split = len(prompts) * 2 // 3
    held_out = evaluation.correct[split:]
    n_wrong, n_right = int((~held_out).sum()), int(held_out.sum())
    require("errors", min(n_wrong, n_right))
    every = _candidates(Shape.of(model), int(prompts.answer_tokens.shape[1]))
    detector = probes.ErrorDetector(batch_size=batch_size, progress=False,
                                    max_candidates=None if candidates >= every else candidates)
    detector.fit(model, prompts[:split], evaluation=evaluation[:split])
    tried = len(detector.meta_["layer_search"])
    searched = "" if candidates >= every else (
        f"searched {tried} of its {every} layer candidates, spread over the depth (the last layer first), to fit its "
        f"{secs(plan.share)} share")
    section.sample = joined(f"{len(prompts) - split} held-out prompts of {name} ({n_wrong} wrong, {n_right} correct; "
                            f"minimum {MINIMUM[0]} of each), {split} to train on",
                            ctx.sampled(count, len(task), "prompts", share=False) if count < len(task) else "",
                            searched, plan.sample)
    result = detector.evaluate(model, prompts[split:], evaluation=evaluation[split:])
    m = result.metrics()
    verdict = "" if _beats_chance(m) else "No signal above the control: "
    section.findings.insert(
        0,
        f"{verdict}On {len(prompts) - split} held-out prompts of {name} (error rate {m['error_rate']:.1%}), "
        f"the detector at layers {detector.layers_} predicts correctness with balanced accuracy "
        f"{m['balanced_accuracy']:.1%} "
        f"(answering always 'correct' or always 'wrong' scores 50.0%), accuracy {m['accuracy']:.1%} and AUROC "
        f"{m['auroc']:.2f}.",
    )
    section.figures.append(result.plot())
    return section


STAGE = Stage(name="errors", title="Error detection", order=50, weight=1.0, minimum=MINIMUM, run=error_detector_stage,
              plan=errors_plan)
