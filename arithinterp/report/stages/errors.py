"""The error-detection stage: the probe-based error detector on held-out prompts, of the model
itself when it errs often enough, else of the zoo's deliberately imperfect model."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from arithinterp.report.budget import MARGIN, Budget, secs
from arithinterp.report.evaluation import evaluate_within
from arithinterp.report.stage import Section, Stage, joined, require

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


def error_detector_stage(ctx: Context) -> Section:
    """Probe-based error detection on the main model if it errs often enough, else on the zoo's
    deliberately imperfect model (and the finding says which).

    Within a budget the prompts are sampled to about three forwards each, and the detector's layer
    search, its main cost whatever the prompts, gets the time left less the held-out prompts'
    forward (``ErrorDetector(max_seconds=...)``: candidates spread over the depth first).

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import probes
    from arithinterp.models import load_model
    from arithinterp.models.zoo import get_entry, held_out_prompts

    import torch

    section = Section(STAGE.title)
    n_errors = int((~ctx.evaluation.correct).sum())
    fitted, batch_size, per_prompt = "", 256, ctx.budget.forward_seconds
    if n_errors >= 50:
        model, prompts, name, evaluation = ctx.model, ctx.all_prompts, ctx.spec, ctx.evaluation
        # fit and evaluate each read every prompt's activations once (a forward), then fit probes
        held_out = evaluation.correct[len(prompts) * 2 // 3:]
        require("errors", min(int((~held_out).sum()), int(held_out.sum())))  # too few even before sampling
        rarer = min(n_errors, len(prompts) - n_errors) / len(prompts)
        # enough prompts that the held-out third holds the minimum of the rarer kind, as the whole set does
        least = min(len(prompts), math.ceil(3 * MINIMUM[0] / max(rarer, 1e-9)))
        pick, fitted = ctx.fit(torch.arange(len(prompts)), "prompts", least, per_item=3 * ctx.budget.forward_seconds)
        prompts, evaluation = prompts[pick], evaluation[pick]
        batch_size = ctx.budget.batch_size(model, int(prompts.lengths.max()))
    else:
        name = "zoo:add-3digit-weak"
        model = load_model(name)
        prompts = held_out_prompts(model, get_entry(name), limit=ctx.n_detector_prompts, seed=ctx.seed)
        if ctx.budget.seconds != float("inf"):  # sampled to the stage's share like the main model's prompts:
            # a quarter of the time left evaluates them, the rest fits the detector (about three forwards each)
            seconds = max(ctx.seconds_left(), 0.0) / 4
            prompts, evaluation, per_prompt, _ = evaluate_within(model, prompts, seconds, seconds,
                                                                  Budget(seconds, ctx.budget.bytes), ctx.seed)
            rarer = min(int((~evaluation.correct).sum()), int(evaluation.correct.sum())) / len(prompts)
            least = min(len(prompts), math.ceil(3 * MINIMUM[0] / max(rarer, 1e-9)))
            pick, fitted = ctx.fit(torch.arange(len(prompts)), "prompts", least, per_item=3 * per_prompt)
            prompts, evaluation = prompts[pick], evaluation[pick]
        else:
            evaluation = prompts.evaluate(model)
        section.findings.append(
            f"{ctx.spec} makes only {n_errors} errors here, too few to learn from; this section detects the "
            f"errors of {name}, a model stopped early so that it still errs."
        )
    split = len(prompts) * 2 // 3
    held_out = evaluation.correct[split:]
    n_wrong, n_right = int((~held_out).sum()), int(held_out.sum())
    require("errors", min(n_wrong, n_right))
    # the detector's cost is mostly its layer search (a probe set per candidate layer, whatever the prompts):
    # the search stops where the held-out prompts' forward would no longer fit the time left
    max_seconds = None
    if ctx.budget.seconds != float("inf"):
        max_seconds = max(MARGIN * ctx.seconds_left() - per_prompt * (len(prompts) - split), 1e-3)
    detector = probes.ErrorDetector(batch_size=batch_size, progress=False, max_seconds=max_seconds)
    detector.fit(model, prompts[:split], evaluation=evaluation[:split])
    tried, candidates = len(detector.meta_["layer_search"]), detector.meta_["layer_candidates"]
    searched = (f"searched {tried} of {candidates} layer candidates, spread over the depth, to fit the "
                f"{secs(ctx.budget.seconds)} budget") if tried < candidates else ""
    section.sample = joined(f"{len(prompts) - split} held-out prompts of {name} ({n_wrong} wrong, {n_right} correct; "
                            f"minimum {MINIMUM[0]} of each), {split} to train on", fitted, searched)
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


STAGE = Stage(name="errors", title="Error detection", order=50, weight=1.0, minimum=MINIMUM, run=error_detector_stage)
