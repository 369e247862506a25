"""The accuracy stage: how many prompts the model answers correctly, and its most common errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from arithinterp.report.stage import Section, Stage

if TYPE_CHECKING:
    from arithinterp.report.budget import Context


def accuracy_stage(ctx: Context) -> Section:
    """How many prompts the model answers correctly, and its most common errors.

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp.tasks import UNPARSABLE
    from arithinterp.viz import bars

    ev, prompts = ctx.evaluation, ctx.all_prompts
    wrong = ~ev.correct
    parsable = ev.model_answer != UNPARSABLE
    errors = (ev.model_answer - prompts.answer)[wrong & parsable]
    section = Section(STAGE.title, sample=f"{len(prompts)} prompts")
    section.findings.append(
        f"The model answers {int(ev.correct.sum())} of {len(prompts)} prompts correctly "
        f"({100 * ev.accuracy:.1f}%); "
        + (f"the analyses below use the {len(ctx.prompts)} correct ones." if ctx.correct_only else
           f"the analyses below use all {len(ctx.prompts)}, answered correctly or not (correct_only=False), "
           "each scored on the true answers.")
    )
    n_unparsable = int((wrong & ~parsable).sum())
    if n_unparsable:
        section.findings.append(
            f"{n_unparsable} of the {int(wrong.sum())} wrong answers are not numbers; they are counted here "
            "and kept out of the error sizes below."
        )
    if len(errors):
        values, counts = errors.unique(return_counts=True)
        order = counts.argsort(descending=True)
        shown = order[:10]
        top = ", ".join(f"{int(values[i]):+d} ({int(counts[i])}×)" for i in order[:3])
        section.findings.append(
            f"Most common errors among the {len(errors)} numeric wrong answers (answer − truth): {top}.")
        if len(order) > len(shown):
            rest = int(counts[order[10:]].sum())
            section.findings.append(
                f"The figure shows the {len(shown)} most common of {len(values)} distinct error sizes; "
                f"the other {rest} wrong answers have rarer ones."
            )
        section.figures.append(
            bars(
                {f"{int(values[i]):+d}": int(counts[i]) for i in shown},
                title="Errors by offset from the true answer (numeric answers only)",
                y_title="wrong answers",
            )
        )
    elif not wrong.any():
        section.findings.append("The model makes no errors on these prompts.")
    return section


STAGE = Stage(name="accuracy", title="Accuracy and error profile", order=10, weight=0.25, run=accuracy_stage)
