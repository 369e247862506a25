"""The report's time and memory planning: what a stage may spend (:class:`Budget`), what it
shares with the others (:class:`Context`), and how it fits its sample to the time left of its
budget: :meth:`Context.fit` (fewer items), :meth:`Context.fit_layers` (fewer layers), both from
costs measured by :func:`pilot_cost` on a few items. Budget code reads ``time.perf_counter``
through the ``time`` module, so a test can replace the clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.sites import looking_first_at, spread

if TYPE_CHECKING:
    from arithinterp.tasks import Evaluation, PromptPairs, PromptSet
    from arithinterp.types import HookedModel

DEFAULT_BUDGET = 480.0  # seconds for the evaluation and every stage: a 135M model's report in under 10 minutes
MIN_BUDGET = 1.0  # seconds: less does not hold the evaluation's warm-up
MAX_BUDGET = 7 * 24 * 3600.0  # a week: more is a mistake (a budget in milliseconds, an exponent)
PILOT = 4  # items a stage times its analyses on (and on half as many) before choosing how many fit its budget
PILOT_SHARE = 0.2  # at most this share of the time left goes to a pilot (by the stage's prior cost)
SLOPE_FLOOR = 0.02  # a pilot's cost per item is at least this share of its cost per item with the fixed cost
MARGIN = 0.85  # share of the time left that a measured cost may fill (the pilots' timing noise)
# the evaluation's share of the budget, against the stages' (each stage declares its own weight):
# little, since a few hundred prompts serve every stage's minimum
EVALUATION_WEIGHT = 1.0


class OverBudget(AnalysisError):
    """Even a stage's minimum sample would not fit the time left of its budget; it is not run."""


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
    """What one stage may spend: ``seconds`` of wall time and ``bytes`` of transient memory beyond
    the model (batch sizes come from it through :func:`arithinterp.engine.decode.batch_size_for`).
    ``forward_seconds``: one prompt's evaluation, measured at the start of the report."""

    seconds: float = float("inf")
    bytes: Optional[int] = None  # None: the engine's default (half the model's parameter bytes)
    forward_seconds: float = 0.0

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


def _timed(run: Callable[..., object], *args: Any) -> float:
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def pilot_cost(pilot: Callable[[Any], object], items: Any, k: int) -> tuple[float, float]:
    """``(seconds per call, seconds per item)`` of ``pilot``, timed on the first ``k`` items and
    then on ``k // 2``: a straight line through the two, so that what a call pays once (base
    runs, building the graph, small batches) is not counted per item, as one timing divided by
    ``k`` would count it. The larger size runs first: what only a first call pays then raises the
    slope, over- rather than under-stating the cost per item. The slope is kept at least
    :data:`SLOPE_FLOOR` of the larger pilot's cost per item (timing noise must not make an item
    free); ``k < 2`` times one size and counts it all per item.

    Args:
        pilot: Runs the analysis on some items.
        items: The items (sliceable).
        k: The larger pilot's item count.

    Returns:
        ``(seconds per call, seconds per item)``.
    """
    big = _timed(pilot, items[:k])
    if k < 2:
        return 0.0, big / max(k, 1)
    small_k = k // 2
    small = _timed(pilot, items[:small_k])
    per_item = max((big - small) / (k - small_k), SLOPE_FLOOR * big / k)
    return max(big - per_item * k, 0.0), per_item


def cost_text(fixed: float, per_item: float, unit: str = "each") -> str:
    """``"0.5 s each"``, or with a fixed cost ``"3 s, then 0.5 s each"``."""
    return f"{secs(fixed)}, then {per_item:.2g} s {unit}" if fixed >= 0.05 else f"{per_item:.2g} s {unit}"


def seeded_pick(n: int, k: int, seed: int):
    """``k`` of ``range(n)`` in a seeded random order, sorted (a sample that keeps the set's order)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values


@dataclass
class Context:
    """What every stage shares: the model, its task's prompts, counterfactual pairs, and the
    running stage's :class:`Budget` (set by :func:`write_report` before each stage)."""

    model: HookedModel
    spec: str
    prompts: PromptSet  # the prompts the model answers correctly (may be empty)
    all_prompts: PromptSet  # every prompt of the task, with the model's evaluation
    evaluation: Evaluation
    pairs: Optional[PromptPairs]  # counterfactual pairs of the correct prompts; None when there are none
    seed: int = 0
    # the most each stage looks at; within these, the stage's budget decides (see fit)
    n_pairs: int = 200
    n_probe_prompts: int = 1000
    n_detector_prompts: int = 6000
    n_digit_prompts: int = 500
    n_neuron_prompts: int = 2000
    top_k_neurons: int = 50
    budget: Budget = field(default_factory=Budget)
    stage_start: float = field(default_factory=time.perf_counter)
    control: Optional[HookedModel] = None  # the random-init model of the same architecture, built once (control_model)
    correct_only: bool = True  # False: prompts and pairs include the wrongly answered prompts
    # the blocks in which the patching stage saw the varied operand reach the final position; a later
    # stage that can afford only some layers looks at these first (empty: not measured, or not found)
    arrival_layers: list[int] = field(default_factory=list)

    def seconds_left(self) -> float:
        return self.budget.seconds - (time.perf_counter() - self.stage_start)

    def control_model(self) -> HookedModel:
        """A random-init model of the same architecture (seeded), built on first use and shared by
        every stage that needs the control (probes, Fourier, neurons)."""
        control = self.control
        if control is None:
            from arithinterp.models import random_like

            control = self.control = random_like(self.model, self.seed)
        return control

    def fit_layers(self, items: Any, what: str, minimum: int, n_layers: int,
                   pilot: Callable[[Any, list[int]], object], pilot_items: int = PILOT,
                   prior: float = 0.0, shared: bool = False, copies: int = 1,
                   first: Sequence[int] = ()) -> tuple[Any, list[int], str]:
        """For a stage whose cost grows with the layers it covers, when not even ``minimum`` items
        fit the time left at every layer: ``minimum`` items (seeded) over as many evenly spread
        layers as fit, the first and last among them, and the sentence that says so. The cost is
        a fixed cost per call and per item, and per layer a cost per call (its stacked runs,
        whatever the items) and per item, measured by ``pilot(items, layers)`` at two layers (the
        middle and the last) and at one (the last), each on up to ``pilot_items`` items and on half
        as many (:func:`pilot_cost`'s lines), after one item at the last layer (its first-call
        costs). ``shared``: the layers share most of the cost (one backward reaches them all), so a
        second layer costs far more than each one after it: timed at every layer instead of two,
        and the difference spread over the layers added; when the minimum fits at every layer by
        that timing, the single-layer timings are skipped. ``copies``: the stage runs what the
        pilot times this many times when it can (the model and its random-init control, whose cost
        is the same architecture's), so the pilot times one and the plan counts ``copies``; when not
        even the minimum at one layer fits that many times, the plan counts one (the stage runs
        the model and says the control did not fit, rather than nothing). ``first``: layers
        to cover before the spread's (:func:`~arithinterp.sites.looking_first_at`), such as
        :attr:`arrival_layers`.
        :class:`OverBudget` when not even one layer fits, without a pilot when ``prior`` (prompt
        evaluations per item at one layer) puts the minimum at one layer above twice the time left."""
        guess = prior * self.budget.forward_seconds * minimum
        if guess > 2 * self.seconds_left():
            raise OverBudget(
                f"Not run within the budget: the minimum of {minimum} {what} at a single layer would take about "
                f"{secs(guess)} (estimated from the evaluation's time per prompt), more than the "
                f"{secs(max(self.seconds_left(), 0.0))} left of this stage's {secs(self.budget.seconds)} budget; "
                "give the report more time (budget=, --budget SECONDS).")
        k = min(pilot_items, len(items))
        last = [n_layers - 1]
        # a middle layer and the last: a run resumed at a layer costs what the layers after it do, so a
        # middle layer's cost is about the mean over the spread layers (with a shared cost, every layer:
        # the middle one would carry half of what all of them share). One item at the last layer
        # first: what only a first call pays (the engine's one-off checks of the model) would otherwise
        # be counted once per layer, and the stage would cover a tenth of the layers that fit
        wide_layers = list(range(n_layers)) if shared else sorted({(n_layers - 1) // 2, n_layers - 1})
        pilot(items[:1], last)
        half = k // 2
        wide = _timed(pilot, items[:k], wide_layers)
        wide_half = _timed(pilot, items[:half], wide_layers) if 1 <= half < k else None
        left = max(self.seconds_left(), 0.0) * MARGIN
        n = len(items)
        if shared and wide_half is not None:  # every layer timed: when the minimum fits there, that is the plan
            every = max((wide - wide_half) / (k - half), SLOPE_FLOOR * wide / k)  # an item at every layer
            base = max(wide - every * k, 0.0)
            if copies * (base + every * minimum) <= left:
                count = n if every <= 0 else min(n, max(minimum, int((left / copies - base) / every)))
                chosen, sentence = (items, f"all {n:,} {what} fit") if count >= n else (
                    items[seeded_pick(n, count, self.seed)], f"sampled {count:,} of {n:,} {what} to fit")
                return chosen, list(range(n_layers)), f"{sentence} the {secs(self.budget.seconds)} budget"
        fixed, per_item = pilot_cost(lambda some: pilot(some, last), items, k)  # at one layer: a line in items
        # a layer more: a cost per call (its stacked runs, whatever the items) and one per item
        added = wide - (fixed + per_item * k)
        if wide_half is not None:
            added_half = wide_half - (fixed + per_item * half)
            layer_item = max((added - added_half) / (k - half), SLOPE_FLOOR * max(added, 0.0) / k)
        else:
            layer_item = max(added, 0.0) / max(k, 1)
        layer_call = max(added - layer_item * k, 0.0)
        added_layers = max(len(wide_layers) - 1, 1)  # what the pilot's layers beyond the last cost, each
        layer_item, layer_call = max(layer_item / added_layers, 1e-9), layer_call / added_layers
        left = max(self.seconds_left(), 0.0) * MARGIN  # after the single-layer timings

        def cost(count: int, n_cover: int, runs: int = 1) -> float:  # ``count`` items over ``n_cover`` layers
            return runs * (fixed + per_item * count + (n_cover - 1) * (layer_call + layer_item * count))

        def layers_fitting(runs: int) -> int:
            one = cost(minimum, 1, runs)
            return 0 if one > left else min(
                n_layers, 1 + int((left - one) / (runs * (layer_call + layer_item * minimum))))

        # every copy at fewer layers, else one copy
        runs = next((c for c in dict.fromkeys((copies, 1)) if layers_fitting(c) >= 1), 1)
        fits = layers_fitting(runs)
        if fits < 1:
            raise OverBudget(
                f"Not run within the budget: the minimum of {minimum} {what} at a single layer would take about "
                f"{secs(cost(minimum, 1))}, more than the "
                f"{secs(left)} that a measured cost may fill of the "
                f"{secs(max(self.seconds_left(), 0.0))} left of this stage's {secs(self.budget.seconds)} budget "
                f"({MARGIN:.0%}, for the pilots' timing noise); give the report more time (budget=, --budget SECONDS).")
        layers = looking_first_at(spread(n_layers, fits), first)
        chosen = items[seeded_pick(n, minimum, self.seed)] if n > minimum else items
        if fits == n_layers:  # every layer fits after all, at the minimum: the estimate that sent us here was high.
            # Not more: a line timed on a few items, extrapolated to many at every layer, was measured to
            # undershoot (on Gemma 3 270M, 80 pairs planned for 83 s took 152 s)
            fit = f"all {n:,} {what} fit" if len(chosen) >= n else f"sampled {len(chosen):,} of {n:,} {what} to fit"
            return chosen, layers, f"{fit} the {secs(self.budget.seconds)} budget"
        return chosen, layers, (
            f"sampled {len(chosen):,} of {n:,} {what} and {len(layers)} of {n_layers} layers "
            f"({', '.join(map(str, layers))}) to fit the {secs(self.budget.seconds)} budget: every layer would take "
            f"about {secs(cost(len(chosen), n_layers, runs))}")

    def fit(self, items: Any, what: str, minimum: int, pilot: Optional[Callable[[Any], object]] = None,
            per_item: Optional[float] = None, prior: float = 0.0, fixed: float = 0.0) -> tuple[Any, str]:
        """The largest seeded sample of ``items`` (prompts or pairs) that fits the time left of this
        stage's budget, and the sentence that says so ("sampled 60 of 200 pairs to fit the 45 s
        budget"). The cost is ``fixed`` seconds plus ``per_item`` seconds per item, or is measured
        by running ``pilot`` (the stage's analyses) on up to :data:`PILOT` items and on half as
        many (:func:`pilot_cost`: a fixed cost per call and one per item). ``prior``: the stage's
        rough cost per item in prompt evaluations (``budget.forward_seconds``); it keeps the
        pilot within :data:`PILOT_SHARE` of the time left, and skips it when even the minimum
        would take four times the time left. :class:`OverBudget` when not even ``minimum`` items fit."""
        n = len(items)
        if self.budget.seconds == float("inf") or n == 0:
            return items, ""
        measured = per_item is None
        if per_item is None:
            if pilot is None:
                raise ConfigError("fit needs either pilot (a function to time) or per_item (seconds)")
            guess = prior * self.budget.forward_seconds
            if guess * minimum > 4 * self.seconds_left():  # hopeless: do not spend the budget finding out
                per_item = guess
            else:  # the two pilots together cost about 1.5 times the larger one
                k = min(PILOT, n, max(1, int(PILOT_SHARE / 1.5 * self.seconds_left() / guess) if guess > 0 else PILOT))
                fixed, per_item = pilot_cost(pilot, items, k)
        left = self.seconds_left()
        usable = left * (MARGIN if measured else 1.0)
        fits = n if per_item <= 0 else int(max(usable - fixed, 0.0) / per_item)
        budget = f"the {secs(self.budget.seconds)} budget"
        if fits >= n:
            return items, f"all {n:,} {what} fit {budget}"
        if fits < minimum:
            raise OverBudget(
                f"Not run within the budget: the minimum of {minimum} {what} would take about "
                f"{secs(fixed + minimum * per_item)} ({cost_text(fixed, per_item)}), more than the "
                f"{secs(max(left, 0.0))} left of this stage's {secs(self.budget.seconds)} budget; give the report "
                "more time (budget=, --budget SECONDS).")
        return items[seeded_pick(n, fits, self.seed)], f"sampled {fits:,} of {n:,} {what} to fit {budget}"


