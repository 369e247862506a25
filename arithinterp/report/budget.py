"""The report's planning: what a stage may spend (:class:`Budget`: seconds of model work at the
reference rate of :mod:`arithinterp.report.work`, and bytes), what every stage shares
(:class:`Context`), and how a stage fits its sample to its share — :meth:`Context.fit` (fewer
items), :meth:`Context.fit_layers` (fewer layers) — from costs counted in model work. Nothing
here reads a clock: the same model, task, seed and budget give the same plan on any machine,
under any load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.report.work import Shape
from arithinterp.sites import looking_first_at, spread

if TYPE_CHECKING:
    from arithinterp.tasks import Evaluation, PromptPairs, PromptSet
    from arithinterp.types import HookedModel

# seconds of model work at the reference rate (one thread of the development machine) for the evaluation and
# every stage: Gemma 3 270M's report with every stage past its minimum sample, in about four minutes on the
# machine's two cores when nothing else runs (its evaluation runs at about 1.6-2.5 times the reference rate there)
DEFAULT_BUDGET = 360.0
MIN_BUDGET = 1.0  # seconds: less does not hold the evaluation's first prompts
MAX_BUDGET = 7 * 24 * 3600.0  # a week: more is a mistake (a budget in milliseconds, an exponent)
# the evaluation's share of the budget, against the stages' (each stage declares its own weight):
# little, since a few hundred prompts serve every stage's minimum
EVALUATION_WEIGHT = 1.0
# how far beyond the budget the stages' minimums may reach, as a part of the budget: a stage a few seconds
# short of its minimum borrows them rather than being skipped; one further short is not run and says so
BORROW = 0.1


class OverBudget(AnalysisError):
    """Even a stage's minimum would not fit its share of the budget; it is not run, and says what
    budget would run it. ``seconds``: what the minimum costs, in reference seconds; ``what``: the
    minimum, in words."""

    seconds: float = 0.0
    what: str = ""


def default_max_memory() -> int:
    """Transient bytes a stage may use beyond the model: half the memory available now, at most
    2 GiB (the analyses' batches, not the model's weights, which are already loaded).

    Returns:
        The bytes, at least 256 MiB; 2 GiB where the available memory cannot be read.
    """
    from arithinterp.engine.budget import available_bytes

    free = available_bytes()
    return 2 * 2**30 if free is None else int(min(2 * 2**30, max(2**28, free // 2)))


def parse_memory(value: Any) -> int:
    """Bytes from an int or a size such as ``"512MB"``, ``"2GiB"``, ``"1.5G"`` (powers of 1024).

    Args:
        value: A number of bytes or a size string.

    Returns:
        The size in bytes.

    Raises:
        ConfigError: A malformed size, or one below 16 MiB.
    """
    import re

    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(value), re.I)
        if match is None:
            raise ConfigError(f"max_memory must be bytes or a size such as '512MB' or '2GiB', got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * 1024 ** " kmgt".index(unit or " "))
    if size < 2**24:
        raise ConfigError(f"max_memory must be at least 16 MiB, got {value!r} ({size:,} bytes)")
    return size


@dataclass(frozen=True)
class Budget:
    """What one stage may spend: ``seconds`` of model work at the reference rate (its share of the
    report's budget) and ``bytes`` of transient memory beyond the model (batch sizes come from it
    through :func:`arithinterp.engine.decode.batch_size_for`).

    Attributes:
        seconds: The stage's share, in reference seconds (infinite: no limit).
        bytes: Transient memory; None: the engine's default (half the model's parameter bytes).
        total: The whole report's budget, in reference seconds (for the budget a shortfall would need).
    """

    seconds: float = float("inf")
    bytes: Optional[int] = None
    total: float = float("inf")

    def batch_size(self, model: Any, seq_len: int, n_new: int = 0) -> int:
        """Prompts per forward-only batch whose transient memory fits ``bytes`` (analyses with a
        backward size their own batches from :meth:`memory`)."""
        from arithinterp.engine.decode import batch_size_for

        return batch_size_for(model, seq_len, n_new=n_new, budget_bytes=self.memory(model))

    def memory(self, model: Any) -> int:
        """``bytes``, or the engine's default for ``model`` (half its parameter bytes, at least
        :data:`arithinterp.engine.decode.MIN_BUDGET`)."""
        from arithinterp.engine.decode import MIN_BUDGET

        return self.bytes if self.bytes is not None else int(max(MIN_BUDGET, _model_bytes(model) // 2))


def secs(seconds: float) -> str:
    """``"60 s"``; below 10 s with two significant digits (``"0.31 s"``)."""
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"


def _model_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def seeded_pick(n: int, k: int, seed: int):
    """``k`` of ``range(n)`` in a seeded random order, sorted (a sample that keeps the set's order)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values


def over_budget(budget: Budget, what: str, seconds: float) -> OverBudget:
    """The refusal of a stage whose minimum (``what``, costing ``seconds``) does not fit: what it
    would take, the share it has, and the budget that would run it (the report's, with the
    shortfall added: every stage's minimum is reserved before the rest is shared)."""
    need = budget.total + seconds - budget.seconds
    refusal = OverBudget(
        f"Not run within the budget: {what} takes about {secs(seconds)} of model work at the reference rate, "
        f"more than the {secs(budget.seconds)} this stage could have of the {secs(budget.total)} budget; a budget "
        f"of about {math.ceil(need / 10) * 10:,} s would run it (budget=, --budget SECONDS).")
    refusal.seconds, refusal.what = seconds, what
    return refusal


def _largest(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The largest ``k`` in ``low..high`` with ``fits(k)`` (``fits`` monotone, true at ``low``)."""
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


@dataclass
class StagePlan:
    """What a stage will run, decided before it runs: a function of the model's shape, the task,
    the seed and the stage's share, never of a clock.

    Attributes:
        choices: Its sample sizes, layers, positions, steps, as plain JSON (recorded in the page).
        seconds: What it costs, in reference seconds.
        sample: What the budget bought, for the sample line ("sampled 60 of 238 prompts to fit
            its 40 s share"); empty when everything fits.
        budget: The share it was planned in (set by :func:`plan_stages`).
    """

    choices: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    sample: str = ""
    budget: Budget = field(default_factory=Budget)

    @property
    def share(self) -> float:
        return self.budget.seconds


def plan_stages(ctx: Context, stages: Sequence[Any], seconds: float, total: float, memory: Optional[int],
                recorded: Optional[dict[str, tuple[float, dict[str, Any]]]] = None) -> dict[str, Any]:
    """Every stage's plan, before any of them runs. First what each one's minimum costs (its plan
    in no share at all, which :class:`OverBudget` prices) is reserved for it, in the page's order,
    while the minimums fit ``seconds`` — a stage a few seconds short borrows them, up to
    :data:`BORROW` of the budget for all stages together; a stage further short is not run, and its
    refusal says what budget would run it. Then in the page's order each stage's share is its
    minimum and a part of what is left beyond the later stages' minimums by the weights, and what
    its plan does not use goes on to the later ones.

    Args:
        ctx: The report's shared state (the evaluation done).
        stages: The stages, in the page's order.
        seconds: Reference seconds for them all.
        total: The report's whole budget (for the messages and what may be borrowed).
        memory: Bytes each stage's batches may use.
        recorded: A replayed plan's ``{stage: (share, choices)}``: the stages it ran, with those
            shares and those choices over the ones planned now.

    Returns:
        ``{name: StagePlan}``, or for a stage that cannot run the exception that says why
        (:class:`OverBudget` with the budget that would run it, :class:`NotEnoughData`, or another
        :class:`~arithinterp.errors.ArithInterpError` for a stage that does not apply).
    """
    from arithinterp.errors import ArithInterpError

    outcome: dict[str, Any] = {}
    floors: dict[str, float] = {}  # the minimums reserved, in the page's order
    borrowed: dict[str, float] = {}  # what a stage's minimum reserved beyond ``seconds``
    for stage in stages:
        ctx.budget = Budget(0.0, memory, total)
        try:
            floor = stage.plan(ctx).seconds if stage.plan is not None else 0.0
        except OverBudget as priced:
            floor = priced.seconds
            reserved = sum(floors.values())
            replayed = recorded is not None and stage.name in recorded
            if reserved + floor > seconds + BORROW * total and not replayed:  # more than a few seconds short
                available = max(seconds - reserved, 0.0)
                outcome[stage.name] = over_budget(Budget(available, memory, total), priced.what, floor)
                continue
        except ArithInterpError as why:  # does not apply, or too little data: said before the run
            outcome[stage.name] = why
            continue
        over = sum(floors.values()) + floor - max(seconds, 0.0)
        if over > 0:
            borrowed[stage.name] = over - sum(borrowed.values())
        floors[stage.name] = floor
    left = max(seconds, 0.0) + sum(borrowed.values())
    for i, stage in enumerate(stages):
        if stage.name in outcome:
            continue
        later = [s for s in stages[i + 1:] if s.name not in outcome]
        spare = max(left - floors[stage.name] - sum(floors[s.name] for s in later), 0.0)
        share = floors[stage.name] + spare * stage.weight / (stage.weight + sum(s.weight for s in later))
        if recorded is not None and stage.name in recorded:
            share = recorded[stage.name][0]
        ctx.budget = Budget(share, memory, total)
        try:
            planned = stage.plan(ctx) if stage.plan is not None else StagePlan()
        except ArithInterpError as why:
            outcome[stage.name] = why
            continue
        if recorded is not None and stage.name in recorded:
            planned.choices = dict(recorded[stage.name][1])
        if stage.name in borrowed:
            lent = f"its minimum borrowed {secs(borrowed[stage.name])} beyond the {secs(total)} budget"
            planned.sample = "; ".join(filter(None, [planned.sample, lent]))
        planned.budget = ctx.budget
        outcome[stage.name] = planned
        left -= planned.seconds
    ctx.budget = Budget(bytes=memory)
    return outcome


@dataclass
class Context:
    """What every stage shares: the model, its task's prompts, counterfactual pairs, and the
    running stage's :class:`Budget` and :class:`StagePlan` (set by :func:`write_report` before
    each stage; a stage run on its own plans itself with an unlimited budget)."""

    model: HookedModel
    spec: str
    prompts: PromptSet  # the prompts the model answers correctly (may be empty)
    all_prompts: PromptSet  # every prompt of the task, with the model's evaluation
    evaluation: Evaluation
    pairs: Optional[PromptPairs]  # counterfactual pairs of the correct prompts; None when there are none
    seed: int = 0
    task_prompts: Optional[PromptSet] = None  # every prompt of the task, before the evaluation sampled them
    # the most each stage looks at; within these, the stage's share decides (see fit)
    n_pairs: int = 200
    n_probe_prompts: int = 1000
    n_detector_prompts: int = 6000
    n_digit_prompts: int = 500
    n_neuron_prompts: int = 2000
    top_k_neurons: int = 50
    budget: Budget = field(default_factory=Budget)
    planned: Optional[StagePlan] = None  # the running stage's plan (None: the stage plans itself)
    control: Optional[HookedModel] = None  # the random-init model of the same architecture, built once (control_model)
    correct_only: bool = True  # False: prompts and pairs include the wrongly answered prompts
    # the blocks in which the patching stage saw the varied operand reach the final position; a later
    # stage that can afford only some layers looks at these first (empty: not measured, or not found)
    arrival_layers: list[int] = field(default_factory=list)

    @property
    def shape(self) -> Shape:
        return Shape.of(self.model)

    def control_model(self) -> HookedModel:
        """A random-init model of the same architecture (seeded), built on first use and shared by
        every stage that needs the control (probes, Fourier, neurons)."""
        control = self.control
        if control is None:
            from arithinterp.models import random_like

            control = self.control = random_like(self.model, self.seed)
        return control

    def plan_of(self, stage: Any) -> StagePlan:
        """The running stage's plan: the one the runner made, else ``stage.plan(self)`` now."""
        if self.planned is not None:
            return self.planned
        planned = stage.plan(self) if stage.plan is not None else StagePlan()
        planned.budget = self.budget
        return planned

    def fit(self, items: Any, what: str, minimum: int, cost: Callable[[int], float]) -> tuple[int, float, str]:
        """How many of ``items`` (prompts or pairs, a seeded sample of them) this stage's share
        holds at ``cost(count)`` reference seconds: all of them, else as many as fit, at least
        ``minimum``.

        Args:
            items: The items (their count is what matters).
            what: What they are, for the sentence ("pairs").
            minimum: The fewest the stage draws a conclusion from.
            cost: Reference seconds of the stage's work on ``count`` items (monotone).

        Returns:
            ``(count, seconds, sentence)``: the sentence says what was sampled ("sampled 60 of
            200 pairs to fit its 45 s share"), empty when every item fits.

        Raises:
            OverBudget: Not even ``minimum`` items fit.
        """
        n = len(items)
        least = min(minimum, n)
        if cost(n) <= self.budget.seconds:
            return n, cost(n), ""
        if cost(least) > self.budget.seconds:
            raise over_budget(self.budget, f"the minimum of {least} {what}", cost(least))
        count = _largest(least, n, lambda k: cost(k) <= self.budget.seconds)
        return count, cost(count), self.sampled(count, n, what)

    def fit_layers(self, items: Any, what: str, minimum: int, n_layers: int, cost: Callable[[int, int], float],
                   first: Sequence[int] = ()) -> tuple[int, list[int], float, str]:
        """For a stage whose cost grows with the layers it covers: every layer with as many
        items as fit there; else, when not even ``minimum`` items fit at every layer, ``minimum``
        items over as many evenly spread layers as fit (the first and the last among them;
        ``first``, such as :attr:`arrival_layers`, before the spread's).

        Args:
            items: The items.
            what: What they are, for the sentence.
            minimum: The fewest items the stage draws a conclusion from.
            n_layers: The model's layers.
            cost: Reference seconds of ``cost(count, n_covered)``: ``count`` items over
                ``n_covered`` layers (monotone in both).
            first: Layers to cover first.

        Returns:
            ``(count, layers, seconds, sentence)``.

        Raises:
            OverBudget: Not even ``minimum`` items at one layer fit.
        """
        n = len(items)
        least = min(minimum, n)
        if cost(least, n_layers) <= self.budget.seconds:
            count, seconds, sentence = self.fit(items, what, minimum, lambda k: cost(k, n_layers))
            return count, list(range(n_layers)), seconds, sentence
        if cost(least, 1) > self.budget.seconds:
            raise over_budget(self.budget, f"the minimum of {least} {what} at a single layer", cost(least, 1))
        fits = _largest(1, n_layers, lambda m: cost(least, m) <= self.budget.seconds)
        layers = looking_first_at(spread(n_layers, fits), first)
        return least, layers, cost(least, fits), (
            f"{self.sampled(least, n, what, share=False)} and {len(layers)} of {n_layers} layers "
            f"({', '.join(map(str, layers))}) to fit its {secs(self.budget.seconds)} share: every layer would take "
            f"about {secs(cost(least, n_layers))}")

    def sampled(self, count: int, n: int, what: str, share: bool = True) -> str:
        """``"sampled 60 of 200 pairs to fit its 45 s share"`` (a seeded sample), or that all fit."""
        text = f"all {n:,} {what}" if count >= n else f"sampled {count:,} of {n:,} {what}"
        return f"{text} to fit its {secs(self.budget.seconds)} share" if share else text

    def pick(self, items: Any, count: int) -> Any:
        """``count`` of ``items``: a seeded sample in their order (all of them when ``count`` covers them)."""
        return items if count >= len(items) else items[seeded_pick(len(items), count, self.seed)]
