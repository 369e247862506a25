"""What a stage of the report is: one :class:`Stage` object declaring its name, title, place on
the page, share of the budget, minimum sample, ``plan`` and ``run``, and the :class:`Section` it returns.

Each module of :mod:`arithinterp.report.stages` declares one stage as its ``STAGE``; the registry
(:data:`arithinterp.report.stages.STAGES`) is built from those modules, so adding a stage is adding
one module. The minimums are looked up in that registry by name (:func:`require`), when a stage
runs: the registry imports the stage modules, which import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from arithinterp.errors import AnalysisError

if TYPE_CHECKING:
    from arithinterp.report.budget import Context, StagePlan
    from arithinterp.tasks import PromptPairs


@dataclass
class Section:
    """One stage of the report: findings in words, figures, interactive views (a
    :class:`~arithinterp.viz.graph_view.GraphView` each, shown in an inline frame), and how long it took."""

    title: str
    findings: list[str] = field(default_factory=list)
    figures: list[Any] = field(default_factory=list)
    views: list[Any] = field(default_factory=list)
    seconds: float = 0.0
    sample: str = ""  # what the findings rest on, e.g. "385 counterfactual pairs (minimum 30)"


@dataclass(frozen=True)
class Stage:
    """One stage of the report, declared once in its own module of :mod:`arithinterp.report.stages`.

    Attributes:
        name: the stage's name (``write_report(stages=[...])``, ``--stages``).
        title: its section's heading on the page.
        order: where it goes on the page and in the default run: the registry sorts by it.
        weight: its part of the budget beyond every stage's minimum (which is reserved first,
            :func:`~arithinterp.report.budget.plan_stages`), against the others' and the
            evaluation's (:data:`arithinterp.report.budget.EVALUATION_WEIGHT`); what a stage's plan
            leaves unused goes to the later ones. Sized by what more buys: patching's layers the
            most, then the circuit's steps and sizes.
        run: ``run(ctx) -> Section``: runs what ``ctx.plan_of(stage)`` says.
        minimum: the least data it draws a conclusion from, ``(count, what is counted)``; below it
            the stage says "not enough data". None: no minimum.
        minimum_name: the name the minimum is known by in :data:`MINIMUMS` when it is not the
            stage's (the Fourier stage's minimum is its helix test's).
        plan: ``plan(ctx) -> StagePlan``: what it will run within ``ctx.budget`` (its share, in
            reference seconds of model work) and what that costs, from the model's shape, the
            task and the seed — never a clock. It raises :class:`NotEnoughData` below the
            minimum, :class:`~arithinterp.report.budget.OverBudget` (priced) when not even the
            minimum fits, another :class:`~arithinterp.errors.ArithInterpError` when the stage
            does not apply. None: the stage costs nothing worth planning.
    """

    name: str
    title: str
    order: float
    weight: float
    run: Callable[[Context], Section]
    minimum: Optional[tuple[int, str]] = None
    minimum_name: str = ""
    plan: Optional[Callable[[Context], StagePlan]] = None


# The least data each stage draws a conclusion from (count, what is counted), by the name each is
# known by (the Fourier stage's is its helix test's); below it the stage says "not enough data".
# Filled by the registry (arithinterp.report.stages) from the stages' declarations as it collects them.
MINIMUMS: dict[str, tuple[int, str]] = {}


class NotEnoughData(AnalysisError):
    """A stage has fewer samples than its minimum (:data:`MINIMUMS`); it draws no conclusion."""

    def __init__(self, name: str, n: int, who: str = "this stage"):
        minimum, what = MINIMUMS[name]
        super().__init__(f"Not enough data: {n} {what}; {who} needs at least {minimum} {what}.")


def require(name: str, n: int, who: str = "this stage") -> str:
    """Check a stage's sample against its minimum.

    Args:
        name: The stage (a key of the minimums).
        n: The sample's size.
        who: What needs it, for the message.

    Returns:
        The sample statement, e.g. ``"385 counterfactual pairs (minimum 30)"``.

    Raises:
        NotEnoughData: ``n`` is below the minimum.
    """
    minimum, what = MINIMUMS[name]
    if n < minimum:
        raise NotEnoughData(name, n, who)
    return f"{n} {what} (minimum {minimum})"


def require_pairs(ctx: Context, name: str, who: str = "this stage") -> tuple[PromptPairs, str]:
    """The first ``ctx.n_pairs`` counterfactual pairs and their sample statement (:func:`require`);
    :class:`NotEnoughData` when there are none."""
    if ctx.pairs is None:
        raise NotEnoughData(name, 0, who)
    pairs = ctx.pairs[: ctx.n_pairs]
    return pairs, require(name, len(pairs), who)


def joined(*parts: str) -> str:
    """The non-empty ``parts`` joined by ``"; "`` (a sample line from its pieces)."""
    return "; ".join(p for p in parts if p)
