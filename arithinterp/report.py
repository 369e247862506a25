"""The HTML report: the standard battery of analyses on one model, in one offline file.

``write_report(model, out="report.html")`` runs each stage (accuracy and error profile, activation
patching, attribution vs exact, per-digit head ablation for multi-token answers, probes and the
error detector, Fourier spectra and helix fits with the causal test, heuristic neurons), writes a
short summary computed from each stage's results, and saves one self-contained HTML file:
plotly.js is embedded once, so it opens with no network. Every stage is a function
``(context) -> Section`` in :data:`STAGES`; the report is a thin layer over the same calls a
notebook makes. A stage that does not apply to the model (an :class:`ArithInterpError` such as
single-token answers for the digit stage, or multi-token numbers for Fourier features) is shown
as not run, with the reason, and the others go on.

Every stage states its sample size and, below the minimum in :data:`MINIMUMS`, says "not enough
data" instead of drawing a conclusion; where a result does not beat its control, the finding
says "no signal above the control". Effects are quoted as measured; only the intervals of bounded
scores (accuracies) are clipped to their range, and answers that are not numbers are counted, not
drawn as error sizes.
"""

from __future__ import annotations

import contextlib
import gc
import html
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union, cast

from tqdm.auto import tqdm

from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError, ModelSpecError, TaskError, accepted
from arithinterp.outputs import atomic_write, check_writable_file

if TYPE_CHECKING:
    import pandas as pd

# The least data each stage draws a conclusion from (count, what is counted). Below it the stage
# says "not enough data". A mean over 30 pairs has a standard error under a fifth of the spread
# between pairs; a 3-fold probe on 60 prompts is tested on 20 per fold; the detector's balanced
# accuracy averages two rates, each over at least 20 held-out answers; neuron heuristics are
# scored on maps over the (a, b) grid, which 100 prompts cover only sparsely.
MINIMUMS: dict[str, tuple[int, str]] = {
    "patching": (30, "counterfactual pairs"),
    "digits": (30, "correctly answered prompts"),
    "probes": (60, "correctly answered prompts"),
    "errors": (20, "held-out answers of the rarer kind, wrong or correct"),
    "helix": (30, "counterfactual pairs"),
    "neurons": (100, "correctly answered prompts"),
    "circuits": (30, "counterfactual pairs"),
}


class NotEnoughData(AnalysisError):
    """A stage has fewer samples than its minimum (:data:`MINIMUMS`); it draws no conclusion."""

    def __init__(self, name: str, n: int, who: str = "this stage"):
        minimum, what = MINIMUMS[name]
        super().__init__(f"Not enough data: {n} {what}; {who} needs at least {minimum} {what}.")


class OverBudget(AnalysisError):
    """Even a stage's minimum sample would not fit the time left of its budget; it is not run."""


def require(name: str, n: int, who: str = "this stage") -> str:
    """Raise :class:`NotEnoughData` when ``n`` is below the minimum of ``name``; else the sample
    statement (``"385 counterfactual pairs (minimum 30)"``)."""
    minimum, what = MINIMUMS[name]
    if n < minimum:
        raise NotEnoughData(name, n, who)
    return f"{n} {what} (minimum {minimum})"


def _require_pairs(ctx: Context, name: str, who: str = "this stage") -> tuple[Any, str]:
    """The first ``ctx.n_pairs`` counterfactual pairs and their sample statement (:func:`require`);
    :class:`NotEnoughData` when there are none."""
    if ctx.pairs is None:
        raise NotEnoughData(name, 0, who)
    pairs = ctx.pairs[: ctx.n_pairs]
    return pairs, require(name, len(pairs), who)


# --- budgets -------------------------------------------------------------------------------------

DEFAULT_BUDGET = 480.0  # seconds for the evaluation and every stage: a 135M model's report in under 10 minutes
PILOT = 4  # items a stage times its analyses on (and on half as many) before choosing how many fit its budget
PILOT_SHARE = 0.2  # at most this share of the time left goes to a pilot (by the stage's prior cost)
SLOPE_FLOOR = 0.02  # a pilot's cost per item is at least this share of its cost per item with the fixed cost
MARGIN = 0.85  # share of the time left that a measured cost may fill (the pilots' timing noise)
# each stage's share of the budget (the evaluation's too); what a stage leaves unused goes to the later ones.
# Sized from what each needs at its minimum sample on a 135M-shaped model: circuits (EAP-IG and the
# faithfulness curve) the most, the evaluation little (a few hundred prompts serve every stage's minimum)
WEIGHTS = {"evaluation": 1.0, "accuracy": 0.25, "patching": 2.5, "digits": 1.0, "probes": 1.5, "errors": 1.0,
           "fourier": 2.0, "neurons": 1.5, "circuits": 3.5}


def default_max_memory() -> int:
    """Transient bytes a stage may use beyond the model: half the memory available now, at most
    2 GiB (the analyses' batches, not the model's weights, which are already loaded)."""
    from arithinterp.engine.budget import available_bytes

    free = available_bytes()
    return 2 * 2**30 if free is None else int(min(2 * 2**30, max(2**28, free // 2)))


def parse_memory(value: Any) -> int:
    """Bytes from an int or a size such as ``"512MB"``, ``"2GiB"``, ``"1.5G"`` (powers of 1024)."""
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


def _secs(seconds: float) -> str:
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
    free); ``k < 2`` times one size and counts it all per item."""
    big = _timed(pilot, items[:k])
    if k < 2:
        return 0.0, big / max(k, 1)
    small_k = k // 2
    small = _timed(pilot, items[:small_k])
    per_item = max((big - small) / (k - small_k), SLOPE_FLOOR * big / k)
    return max(big - per_item * k, 0.0), per_item


def _each(fixed: float, per_item: float, unit: str = "each") -> str:
    """``"0.5 s each"``, or with a fixed cost ``"3 s, then 0.5 s each"``."""
    return f"{_secs(fixed)}, then {per_item:.2g} s {unit}" if fixed >= 0.05 else f"{per_item:.2g} s {unit}"


def _seeded_pick(n: int, k: int, seed: int):
    """``k`` of ``range(n)`` in a seeded random order, sorted (a sample that keeps the set's order)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values


@dataclass
class Section:
    """One stage of the report: findings in words, figures, and how long it took."""

    title: str
    findings: list[str] = field(default_factory=list)
    figures: list[Any] = field(default_factory=list)
    seconds: float = 0.0
    sample: str = ""  # what the findings rest on, e.g. "385 counterfactual pairs (minimum 30)"


@dataclass
class Context:
    """What every stage shares: the model, its task's prompts, counterfactual pairs, and the
    running stage's :class:`Budget` (set by :func:`write_report` before each stage)."""

    model: Any
    spec: str
    prompts: Any  # the prompts the model answers correctly (may be empty)
    all_prompts: Any  # every prompt of the task, with the model's evaluation
    evaluation: Any
    pairs: Any  # counterfactual pairs of the correct prompts; None when there are none
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
    control: Any = None  # the random-init model of the same architecture, built once (control_model)
    correct_only: bool = True  # False: prompts and pairs include the wrongly answered prompts

    def seconds_left(self) -> float:
        return self.budget.seconds - (time.perf_counter() - self.stage_start)

    def control_model(self) -> Any:
        """A random-init model of the same architecture (seeded), built on first use and shared by
        every stage that needs the control (probes, Fourier, neurons)."""
        if self.control is None:
            from arithinterp.models import random_like

            self.control = random_like(self.model, self.seed)
        return self.control

    def fit_layers(self, items: Any, what: str, minimum: int, n_layers: int,
                   pilot: Callable[[Any, list[int]], object], pilot_items: int = PILOT,
                   prior: float = 0.0, shared: bool = False) -> tuple[Any, list[int], str]:
        """For a stage whose cost grows with the layers it covers, when not even ``minimum`` items
        fit the time left at every layer: ``minimum`` items (seeded) over as many evenly spread
        layers as fit, the first and last among them, and the sentence that says so. The cost is
        a fixed cost per call and per item, and per layer a cost per call (its stacked runs,
        whatever the items) and per item, measured by ``pilot(items, layers)`` at two layers (the
        middle and the last) and at one (the last), each on up to ``pilot_items`` items and on half
        as many (:func:`pilot_cost`'s lines), after one item at the last layer (its first-call
        costs). ``shared``: the layers share most of the cost (one backward reaches them all), so a
        second layer costs far more than each one after it: timed at every layer instead of two,
        and the difference spread over the layers added. :class:`OverBudget` when not even one
        layer fits, without a pilot when ``prior`` (prompt evaluations per item at one layer) puts
        the minimum at one layer above twice the time left."""
        guess = prior * self.budget.forward_seconds * minimum
        if guess > 2 * self.seconds_left():
            raise OverBudget(
                f"Not run within the budget: the minimum of {minimum} {what} at a single layer would take about "
                f"{_secs(guess)} (estimated from the evaluation's time per prompt), more than the "
                f"{_secs(max(self.seconds_left(), 0.0))} left of this stage's {_secs(self.budget.seconds)} budget; "
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
        wide = _timed(pilot, items[:k], wide_layers)
        fixed, per_item = pilot_cost(lambda some: pilot(some, last), items, k)  # at one layer: a line in items
        # a layer more: a cost per call (its stacked runs, whatever the items) and one per item
        added = wide - (fixed + per_item * k)
        half = k // 2
        if 1 <= half < k:
            added_half = _timed(pilot, items[:half], wide_layers) - (fixed + per_item * half)
            layer_item = max((added - added_half) / (k - half), SLOPE_FLOOR * max(added, 0.0) / k)
        else:
            layer_item = max(added, 0.0) / max(k, 1)
        layer_call = max(added - layer_item * k, 0.0)
        added_layers = max(len(wide_layers) - 1, 1)  # what the pilot's layers beyond the last cost, each
        layer_item, layer_call = max(layer_item / added_layers, 1e-9), layer_call / added_layers
        left = max(self.seconds_left(), 0.0) * MARGIN

        def cost(count: int, n_cover: int) -> float:  # ``count`` items over ``n_cover`` layers
            return fixed + per_item * count + (n_cover - 1) * (layer_call + layer_item * count)

        fits = 0 if cost(minimum, 1) > left else min(
            n_layers, 1 + int((left - cost(minimum, 1)) / (layer_call + layer_item * minimum)))
        if fits < 1:
            raise OverBudget(
                f"Not run within the budget: the minimum of {minimum} {what} at a single layer would take about "
                f"{_secs(cost(minimum, 1))}, more than the {_secs(max(self.seconds_left(), 0.0))} left of "
                "this stage's "
                f"{_secs(self.budget.seconds)} budget; give the report more time (budget=, --budget SECONDS).")
        layers = spread(n_layers, fits)
        n = len(items)
        if fits == n_layers:  # every layer fits after all (the estimate that sent us here was high)
            every = per_item + (n_layers - 1) * layer_item  # an item at every layer
            count = min(n, max(minimum, int((left - fixed - (n_layers - 1) * layer_call) / every)))
            chosen, sentence = (items, f"all {n:,} {what} fit") if count >= n else (
                items[_seeded_pick(n, count, self.seed)], f"sampled {count:,} of {n:,} {what} to fit")
            return chosen, layers, f"{sentence} the {_secs(self.budget.seconds)} budget"
        chosen = items[_seeded_pick(n, minimum, self.seed)] if n > minimum else items
        return chosen, layers, (
            f"sampled {len(chosen):,} of {n:,} {what} and {len(layers)} of {n_layers} layers "
            f"({', '.join(map(str, layers))}) to fit the {_secs(self.budget.seconds)} budget: every layer would take "
            f"about {_secs(cost(len(chosen), n_layers))}")

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
        budget = f"the {_secs(self.budget.seconds)} budget"
        if fits >= n:
            return items, f"all {n:,} {what} fit {budget}"
        if fits < minimum:
            raise OverBudget(
                f"Not run within the budget: the minimum of {minimum} {what} would take about "
                f"{_secs(fixed + minimum * per_item)} ({_each(fixed, per_item)}), more than the "
                f"{_secs(max(left, 0.0))} left of this stage's {_secs(self.budget.seconds)} budget; give the report "
                "more time (budget=, --budget SECONDS).")
        return items[_seeded_pick(n, fits, self.seed)], f"sampled {fits:,} of {n:,} {what} to fit {budget}"


def spread(n: int, k: int) -> list[int]:
    """``k`` evenly spread values of ``range(n)``, the first and the last among them (``k ≥ 2``)."""
    if k >= n:
        return list(range(n))
    if k == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


# --- stages --------------------------------------------------------------------------------------

STAGE_TITLES = {
    "accuracy": "Accuracy and error profile",
    "patching": "Activation patching",
    "digits": "Which head computes which answer digit",
    "probes": "Linear probes",
    "errors": "Error detection",
    "fourier": "Fourier features and the helix",
    "neurons": "Heuristic neurons",
    "circuits": "Circuit: edges from the operands to the answer",
}


def accuracy_stage(ctx: Context) -> Section:
    from arithinterp.tasks import UNPARSABLE
    from arithinterp.viz import bars

    ev, prompts = ctx.evaluation, ctx.all_prompts
    wrong = ~ev.correct
    parsable = ev.model_answer != UNPARSABLE
    errors = (ev.model_answer - prompts.answer)[wrong & parsable]
    section = Section(STAGE_TITLES["accuracy"], sample=f"{len(prompts)} prompts")
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


def _top_cells(result, k: int = 3) -> str:
    """The (at most) k cells with the largest mean effect whose 95% interval over pairs lies above
    0 and which show as more than 0.00, e.g. ``L0 'a' (0.92)``: a cell that restores nothing beyond
    noise, or too little to print, is not a finding."""
    from itertools import product

    def label(axis, value):
        if axis == "position":
            positions = [str(p) for p in result.positions]
            return repr(result.tokens[positions.index(str(value))]) if str(value) in positions else f"pos {value}"
        return {"layer": "L", "head": "H", "neuron": "N"}[axis] + str(value)

    cells = [" ".join(label(a, v) for a, v in zip(result.axes, combo))
             for combo in product(*(result.axis_labels(a) for a in result.axes))]
    mean, low = result.mean.flatten(), result.ci_low.flatten()
    order = [i for i in mean.argsort(descending=True).tolist() if low[i] > 0 and mean[i] >= 0.005][:k]
    return ", ".join(f"{cells[i]} ({mean[i]:.2f})" for i in order)


_NONE_ABOVE_NOISE = "none beyond noise (every cell's 95% interval over pairs reaches 0)"


def _restoring(what: str, result) -> str:
    """``"<what> that restore it most: <cells>."``, or none beyond noise."""
    return f"{what} that restore it most: {_top_cells(result) or _NONE_ABOVE_NOISE}."


def _points(drop: float) -> str:
    """An accuracy drop (a fraction) in percentage points, e.g. ``"−12 points"``, ``"−0.4 points"``,
    ``"no drop"`` (never a signed zero)."""
    value = 100 * drop
    if abs(value) < 0.05:
        return "no drop"
    sign = "−" if value > 0 else "+"
    return f"{sign}{abs(value):.0f} points" if abs(value) >= 10 else f"{sign}{abs(value):.1f} points"


def _no_gap(result) -> bool:
    """Whether clean and corrupt runs do not differ on the metric (|mean gap| within 2 SEM), so
    that restoring one from the other is undefined."""
    gap = (result.clean_baseline - result.corrupt_baseline).double()
    sem = float(gap.std() / len(gap) ** 0.5) if len(gap) > 1 else float("inf")
    return abs(float(gap.mean())) <= 2 * sem


def _sweeps(ctx: Context, pairs, check_gap: bool = True, layers: Optional[list[int]] = None,
            positions: Optional[list[str]] = None) -> tuple[Any, Any, Any, Any]:
    """The patching stage's analyses on ``pairs``: exact ``resid_pre``, heads and ``mlp_out``
    sweeps, and attribution patching of ``resid_pre`` and ``mlp_out`` (compared with the exact
    ones), at ``layers`` and ``positions`` (default: all). With ``check_gap``, only the first when
    clean and corrupted runs do not differ."""
    from arithinterp import patching

    where: dict[str, Any] = dict(layers=layers, positions=positions)
    resid = patching.activation_patching(ctx.model, pairs, "resid_pre", normalize=True, progress=False, **where)
    if check_gap and _no_gap(resid):
        return resid, None, None, None
    heads = patching.activation_patching(ctx.model, pairs, "attn_z", normalize=True, per_position=False,
                                         layers=layers, progress=False)
    mlps = patching.activation_patching(ctx.model, pairs, "mlp_out", normalize=True, progress=False, **where)
    approx = patching.attribute(ctx.model, pairs, ["resid_pre", "mlp_out"], normalize=True,
                                max_memory=ctx.budget.memory(ctx.model), progress=False, **where)
    return resid, heads, mlps, approx


def _changing_span(pairs) -> Optional[int]:
    """For pairs of same-length prompts, the first position at which any pair's clean and corrupted
    prompts differ (every patch before it is the corrupted run exactly, see
    :meth:`arithinterp.engine.PatchRunner.cell_states`); None when the prompts differ in length
    or already at position 0."""
    clean, corrupt = pairs.clean, pairs.corrupt
    if not (clean.uniform_length and corrupt.uniform_length) or clean.tokens.shape != corrupt.tokens.shape:
        return None
    first = int((clean.tokens != corrupt.tokens).any(0).int().argmax())
    return first or None


def patching_stage(ctx: Context) -> Section:
    """Patching sweeps over every layer, at the positions from the first one where the pairs differ
    (a few-shot prefix shared by clean and corrupted prompts cannot change anything: those cells
    are the corrupted run exactly); when not even the minimum of pairs fits the budget that way,
    the named positions (the operands' tokens and the final one) at as many evenly spread layers
    as fit (:meth:`Context.fit_layers`), and the sample says so."""
    from arithinterp import patching

    pairs, _ = _require_pairs(ctx, "patching")
    cfg, clean = ctx.model.cfg, pairs.clean
    width = int(clean.tokens.shape[1])
    first = _changing_span(pairs)
    layers: Optional[list[int]] = None
    positions: Optional[list[Any]] = None
    span = ""
    if first is not None:
        positions = list(range(first, width))
        span = (f"positions {first} to {width - 1}, from the first token where the pairs differ (a patch in the "
                f"{first} tokens before, which clean and corrupted prompts share, is the corrupted run exactly)")
    swept = (width - first) if first is not None else width if clean.uniform_length else sum(
        "[" not in k for k in clean.positions)
    # in prompt evaluations per pair: a head patched at every position resumes from its layer at the
    # positions that differ (about half a forward's layers, the changing share of its positions); a
    # layer × position cell, a tenth; measured on a 135M-shaped model within a factor of two
    share = swept / width
    prior = 0.5 * cfg.n_layers * cfg.n_heads * share + 0.2 * cfg.n_layers * swept + 6
    minimum = MINIMUMS["patching"][0]
    try:
        if prior * ctx.budget.forward_seconds * minimum > ctx.seconds_left():  # a whole-sweep pilot would be wasted
            raise OverBudget("every layer does not fit")
        pairs, fitted = ctx.fit(pairs, "pairs", minimum,
                                pilot=lambda p: _sweeps(ctx, p, check_gap=False, positions=positions), prior=prior)
    except OverBudget:  # fewer cells instead of no page section: the named positions, a sample of the layers
        positions = [k for k in clean.positions if "[" not in k or k.endswith("[0]")]
        span = ""
        pairs, layers, fitted = ctx.fit_layers(
            pairs, "pairs", minimum, cfg.n_layers,
            pilot=lambda p, ls: _sweeps(ctx, p, check_gap=False, layers=ls, positions=positions))
        fitted += f"; positions {', '.join(positions)} only"
    fitted = _joined(fitted, span)
    section = Section(STAGE_TITLES["patching"], sample=_joined(require("patching", len(pairs)), fitted))
    resid, heads, mlps, approx = _sweeps(ctx, pairs, layers=layers, positions=positions)
    if heads is None or mlps is None or approx is None:  # no gap between the clean and corrupted runs
        gap = float((resid.clean_baseline - resid.corrupt_baseline).mean())
        section.findings.append(
            f"No signal above the control: on {len(pairs)} pairs the clean and corrupted prompts do not differ on "
            f"the answer's logit difference (mean gap {gap:.3g}, "
            "within two standard errors of 0), so there is nothing for patching to restore."
        )
        section.figures.append(resid.plot())
        return section
    section.findings.append(
        f"Patching the clean residual stream into {len(pairs)} prompts whose first operand was "
        f"changed restores the answer most at {_top_cells(resid) or _NONE_ABOVE_NOISE} "
        "(1 = fully restored; values above 1 overshoot the clean run and are shown as they are)."
    )
    section.findings.append(_restoring("Heads (all positions at once)", heads))
    section.findings.append(_restoring("MLP outputs", mlps))
    comparison = patching.compare({"resid_pre": resid, "mlp_out": mlps}, approx)
    correlations = ", ".join(f"{s}: r = {c:.2f}" for s, c in zip(comparison.sites, comparison.correlation))
    section.findings.append(f"Attribution patching tracks exact patching with {correlations}.")
    section.figures += [resid.plot(), heads.plot(), mlps.plot(), comparison.plot()]
    return section


def _joined(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def digits_stage(ctx: Context) -> Section:
    from arithinterp import patching

    if int(ctx.all_prompts.n_answer_tokens.max()) < 2:  # does not apply, whatever the sample size
        raise AnalysisError("the answers are single tokens; per-digit ablation needs multi-token answers "
                            "(e.g. zoo:add-3digit)")
    prompts = ctx.prompts[: ctx.n_digit_prompts]
    require("digits", len(prompts))
    cfg = ctx.model.cfg  # a teacher-forced forward per head and answer token

    def heads_of(layers: list[int]) -> list[str]:
        return [f"L{layer}H{head}" for layer in layers for head in range(cfg.n_heads)]

    layers = list(range(cfg.n_layers))
    # in prompt evaluations per prompt and layer: the heads of a layer ablated at one position and
    # resumed from there (about 4 on a 135M-shaped model; whole forwards would be heads × answer tokens)
    per_layer = 4
    minimum = MINIMUMS["digits"][0]
    try:
        if per_layer * cfg.n_layers * ctx.budget.forward_seconds * minimum > ctx.seconds_left():
            raise OverBudget("every layer does not fit")  # a pilot at every layer would be wasted
        prompts, fitted = ctx.fit(prompts, "prompts", minimum,
                                  pilot=lambda p: patching.digit_ablation(ctx.model, p, progress=False),
                                  prior=per_layer * cfg.n_layers)
    except OverBudget:  # the heads of a sample of the layers rather than none
        prompts, layers, fitted = ctx.fit_layers(
            prompts, "prompts", minimum, cfg.n_layers,
            pilot=lambda p, ls: patching.digit_ablation(ctx.model, p, heads=heads_of(ls), progress=False),
            prior=per_layer)
    if len(layers) < cfg.n_layers:  # in groups, coarse to fine, while the time lasts: estimates can be low
        result, covered = _ablate_while_time_lasts(ctx, prompts, layers, heads_of)
        if len(covered) < len(layers):
            fitted += (f"; stopped after {len(covered)} of those layers ({', '.join(map(str, covered))}): the "
                       "next ones would not have fitted the time left")
        layers = covered
    else:
        result = patching.digit_ablation(ctx.model, prompts, heads=heads_of(layers), progress=False)
    section = Section(STAGE_TITLES["digits"], sample=_joined(require("digits", len(prompts)), fitted))
    drop = result.drop
    order = drop.flatten().argsort(descending=True)[:3].tolist()
    n_answer = drop.shape[1]
    ablating = (f"Mean-ablating one head at the position that predicts one answer token (teacher-forced, "
                f"{result.meta['n_prompts']} prompts)")
    if float(drop.max()) * 100 < 0.05:  # a model that gets no token right has nothing to lose
        section.findings.append(f"{ablating} costs no answer token any accuracy, at any head of the layers ablated.")
    else:
        top = ", ".join(f"{result.heads[i // n_answer]} on answer token {i % n_answer} "
                        f"({_points(float(drop.flatten()[i]))})" for i in order)
        section.findings.append(f"{ablating} costs that token most for {top}.")
        per_layer = drop.reshape(len(layers), -1).max(1).values  # the heads come layer by layer
        section.findings.append(
            "Largest drop by any head of each layer: "
            + ", ".join(f"layer {layer}: {_points(float(v))}" for layer, v in zip(layers, per_layer)) + "."
        )
    section.figures.append(result.plot())
    return section


def coarse_to_fine(layers: list[int]) -> list[int]:
    """``layers`` reordered so that every prefix is spread over them: the last, the first, the
    middle, then the quarters, ... (:func:`spread` of more and more)."""
    order: list[int] = []
    for k in range(1, len(layers) + 1):
        order += [layers[i] for i in spread(len(layers), k) if layers[i] not in order]
    return order


def _ablate_while_time_lasts(ctx: Context, prompts, layers: list[int],
                             heads_of: Callable[[list[int]], list[str]]) -> tuple[Any, list[int]]:
    """Per-digit ablation of the heads of ``layers`` in four groups, coarse to fine
    (:func:`coarse_to_fine`), each run only when the time the groups so far took per layer says
    it fits the time left → ``(result over the covered layers, covered layers ascending)``."""
    import dataclasses

    import torch

    from arithinterp import patching

    order = coarse_to_fine(layers)
    size = max(1, math.ceil(len(order) / 4))
    parts, covered, start = [], [], time.perf_counter()
    for group in (order[i:i + size] for i in range(0, len(order), size)):
        if covered and (time.perf_counter() - start) / len(covered) * len(group) > ctx.seconds_left():
            break
        parts.append(patching.digit_ablation(ctx.model, prompts, heads=heads_of(sorted(group)), progress=False))
        covered += sorted(group)
    heads = [h for part in parts for h in part.heads]
    accuracy = torch.cat([part.accuracy for part in parts])
    rank = {h: i for i, h in enumerate(heads_of(sorted(covered)))}  # layer by layer, as one call returns them
    keep = sorted(range(len(heads)), key=lambda i: rank[heads[i]])
    merged = dataclasses.replace(parts[0], heads=[heads[i] for i in keep], accuracy=accuracy[keep])
    return merged, sorted(covered)


PROBE_LAYERS = 4  # the fewest layers the probes stage covers before it samples fewer prompts instead


def _probe_targets(prompts: Any) -> tuple[str, ...]:
    """Whole numbers where each is one token; where numbers are spelled out digit by digit, a's
    units digit, the carry out of the units, and the answer's leading digit (the first token the
    model writes) and units digit (written last: read at the prompt's end, it is computed ahead)."""
    if prompts.single_token_operands:
        return ("a", "answer_digit_0", "answer")
    varying = [i for i in range(1, 4) if f"answer_digit_{i}" in prompts.label_names()
               and len(prompts.label(f"answer_digit_{i}").unique()) > 1]
    return ("a_digit_0", "carry_0") + ((f"answer_digit_{max(varying)}",) if varying else ()) + ("answer_digit_0",)


def _merged_over_layers(parts: list) -> Any:
    """One probe result from results at one layer each (the same target, prompts and positions)."""
    import dataclasses

    import torch

    parts = sorted(parts, key=lambda part: part.layers[0])
    first = parts[0]
    return dataclasses.replace(
        first, layers=[layer for part in parts for layer in part.layers],
        fold_scores=torch.cat([part.fold_scores for part in parts]),
        control_scores=torch.cat([part.control_scores for part in parts], dim=1),
        directions=None if first.directions is None else torch.cat([part.directions for part in parts]))


def probes_stage(ctx: Context) -> Section:
    """Probes per target, each against chance, shuffled labels and a random-init model of the
    same architecture on the same prompts: a finding only when the trained model beats all three
    (readable because of training, not because the input shows it).

    Within a budget, prompts come before layers: every prompt is probed (narrower intervals; a
    few dozen prompts leave a real difference from the random-init model inside the noise), one
    layer at a time coarse to fine (:func:`coarse_to_fine`) while the time the layers so far took
    says the next fits — a probe's cost differs from layer to layer, so no single layer's timing
    predicts the rest. Prompts are sampled only when the first layer says that not even
    :data:`PROBE_LAYERS` layers fit with all of them."""
    from arithinterp import probes
    from arithinterp.activations import collect

    prompts = ctx.prompts[: ctx.n_probe_prompts]
    require("probes", len(prompts))
    where: dict[str, Any] = dict(sites="resid_post", positions=["a", "b", "final"], progress=False)
    acts = collect(ctx.model, prompts, **where)
    control = collect(ctx.control_model(), prompts, **where)
    targets = _probe_targets(prompts)
    # five folds when there are prompts enough: a fold-mean's t interval with 2 degrees of freedom is 1.5 times as wide
    probe: dict[str, Any] = dict(kind="logistic", cv=5 if len(prompts) >= 100 else 3, random_state=ctx.seed,
                                 progress=False)
    order = coarse_to_fine(list(acts.layers))
    least = min(PROBE_LAYERS, len(order))
    timed = ctx.budget.seconds != float("inf")
    parts: dict[str, list] = {target: [] for target in targets}
    refused: dict[str, str] = {}  # target -> why it cannot be probed (e.g. one class among these prompts)
    covered: list[int] = []

    def probe_at(layer: int) -> None:
        for target in targets:
            if target not in refused:
                try:
                    parts[target].append(probes.probe_layers(acts, target, layers=[layer], control_acts=control,
                                                             **probe))
                except AnalysisError as why:
                    refused[target] = str(why).rstrip(".")
        covered.append(layer)

    sampled, start = "", time.perf_counter()
    probe_at(order[0])
    took = time.perf_counter() - start
    left = MARGIN * max(ctx.seconds_left(), 0.0)
    if timed and took * (least - 1) > left:  # a probe's cost grows about linearly with its prompts
        keep = max(MINIMUMS["probes"][0], int(len(prompts) * (left + took) / (least * took)))
        if keep < len(prompts):
            pick = _seeded_pick(len(prompts), keep, ctx.seed)
            sampled = f"sampled {keep} of {len(prompts)} prompts to fit the {_secs(ctx.budget.seconds)} budget"
            prompts, acts, control = prompts[pick], acts.subset(pick), control.subset(pick)
            parts, covered, start = {target: [] for target in targets}, [], time.perf_counter()
            probe_at(order[0])
    for layer in order[1:]:
        per_layer = (time.perf_counter() - start) / len(covered)
        if timed and len(covered) >= least and per_layer > MARGIN * ctx.seconds_left():
            break
        probe_at(layer)
    layers = sorted(covered)
    fitted = "" if len(layers) == len(order) else (
        f"probed at {len(layers)} of {len(order)} layers ({', '.join(map(str, layers))}) to fit the "
        f"{_secs(ctx.budget.seconds)} budget")
    section = Section(STAGE_TITLES["probes"], sample=_joined(require("probes", len(prompts)), sampled, fitted))
    fold_scheme = None  # of the last target probed
    for target in targets:
        if target in refused:
            section.findings.append(f"'{target}' not probed: {refused[target]}.")
            continue
        result = _merged_over_layers(parts[target])
        section.findings.append(result.finding()["text"])
        section.figures.append(result.plot())
        fold_scheme = result.fold_scheme
    section.sample += f"; folds: {fold_scheme}" if fold_scheme is not None else ""
    section.sample += "; controls: chance, shuffled labels, a random-init model of the same architecture"
    return section


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
    deliberately imperfect model (and the finding says which)."""
    from arithinterp import probes
    from arithinterp.models import load_model
    from arithinterp.models.zoo import get_entry, held_out_prompts

    import torch

    section = Section(STAGE_TITLES["errors"])
    n_errors = int((~ctx.evaluation.correct).sum())
    fitted, batch_size = "", 256
    if n_errors >= 50:
        model, prompts, name, evaluation = ctx.model, ctx.all_prompts, ctx.spec, ctx.evaluation
        # fit and evaluate each read every prompt's activations once (a forward), then fit probes
        held_out = evaluation.correct[len(prompts) * 2 // 3:]
        require("errors", min(int((~held_out).sum()), int(held_out.sum())))  # too few even before sampling
        rarer = min(n_errors, len(prompts) - n_errors) / len(prompts)
        # enough prompts that the held-out third holds the minimum of the rarer kind, as the whole set does
        least = min(len(prompts), math.ceil(3 * MINIMUMS["errors"][0] / max(rarer, 1e-9)))
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
            prompts, evaluation, per_prompt, _ = _evaluate_within(model, prompts, seconds, seconds,
                                                                  Budget(seconds, ctx.budget.bytes), ctx.seed)
            rarer = min(int((~evaluation.correct).sum()), int(evaluation.correct.sum())) / len(prompts)
            least = min(len(prompts), math.ceil(3 * MINIMUMS["errors"][0] / max(rarer, 1e-9)))
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
    section.sample = _joined(f"{len(prompts) - split} held-out prompts of {name} ({n_wrong} wrong, {n_right} correct; "
                             f"minimum {MINIMUMS['errors'][0]} of each), {split} to train on", fitted)
    detector = probes.ErrorDetector(batch_size=batch_size, progress=False)
    detector.fit(model, prompts[:split], evaluation=evaluation[:split])
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


def _interval(value: float, low: float, high: float, percent: bool = False) -> str:
    if percent:
        return f"{100 * value:.0f}% (95% CI {100 * low:.0f}% to {100 * high:.0f}%)"
    return f"{value:.3g} (95% CI {low:.3g} to {high:.3g})"


def fourier_helix_stage(ctx: Context) -> Section:
    """The spectrum of the number representation and its key periods; next to them, whether
    ``x mod T`` is linearly readable there beyond chance, shuffled numbers and a random-init model
    of the same architecture (Fu et al. 2026); and the helix fit with its causal test, whose
    shares of the layer patch are printed only when the layer patch is distinguishable from zero.
    Single-token numbers are read from the embeddings; numbers of several tokens from the residual
    stream at their last token in a middle layer of the report's own prompts."""
    import math

    from arithinterp import fourier, helix
    from arithinterp.activations import collect

    section = Section(STAGE_TITLES["fourier"])
    axis = range(int(ctx.all_prompts.a.min()), int(ctx.all_prompts.a.max()) + 1)
    control_model = ctx.control_model()
    if ctx.all_prompts.single_token_operands:
        spectrum = fourier.embedding_spectrum(ctx.model, axis, seed=ctx.seed)
        rows = fourier.number_representations(ctx.model, axis)["embed"]
        control_rows = fourier.number_representations(control_model, axis)["embed"]
        what, helix_site, helix_layer = "the number embeddings", "resid_pre", 0
    else:  # several tokens per number: each is read whole at its last token, entering the middle layer
        helix_site, helix_layer = "resid_pre", ctx.model.cfg.n_layers // 2
        from arithinterp.tasks import prompts_for_pairs

        if len(axis) < 100:  # a spectrum sees periods up to its length: the whole hundred the operands lie in
            low = axis.start // 100 * 100
            axis = range(low, max(low + 100, axis.stop))

        # one prompt per number, in the report's template and few-shot prefix: what comes before a
        # number's last token is the same whatever b and the operator are
        template = ctx.all_prompts.template or "{a}+{b}="
        per_number = prompts_for_pairs(ctx.model, "+", list(axis), [axis.start] * len(axis), template,
                                       few_shot=ctx.all_prompts.prefix or 0)
        read: dict[str, Any] = dict(site="resid_pre", layers=[helix_layer], prompts=per_number, seed=ctx.seed)
        rows = next(iter(fourier.number_representations(ctx.model, axis, **read).values()))
        control_rows = next(iter(fourier.number_representations(control_model, axis, **read).values()))
        spectrum = fourier.activation_spectrum(rows, numbers=axis, seed=ctx.seed)
        what = f"the residual stream entering layer {helix_layer} at each number's last token"
    section.sample = f"{spectrum.n} numbers ({what})"
    # the same representation in a random-init model: periods that spike there come from the tokens
    control_spectrum = fourier.activation_spectrum(control_rows, numbers=axis, seed=ctx.seed)
    control_keys = set(control_spectrum.key[0]) - {0}
    in_control = (f"a random-init model of the same architecture has {len(control_keys)} key frequencies there "
                  f"({float(control_spectrum.key_fraction[0]):.0%} of its power)" if control_keys else
                  "a random-init model of the same architecture has no key frequency there")
    periods = [f"{spectrum.n / k:.3g}" for k in spectrum.key[0] if k > 0]
    if periods:
        shown = ", ".join(periods[:8]) + (f" and {len(periods) - 8} more" if len(periods) > 8 else "")
        learned = [f"{spectrum.n / k:.3g}" for k in spectrum.key[0] if k > 0 and k not in control_keys]
        verdict = (f"period{'s' if len(learned) > 1 else ''} {', '.join(learned[:8])} "
                   f"{'are' if len(learned) > 1 else 'is'} key only in the trained model" if learned else
                   "every one of these periods is key there too, so the spectrum alone shows no learned period")
        section.findings.append(
            f"In {what}, {float(spectrum.key_fraction[0]):.0%} of the non-constant power lies in {len(periods)} key "
            f"frequencies that beat the numbers shuffled (periods {shown}); {in_control}: {verdict}."
        )
    else:
        power = spectrum.power[0, 1:]
        k = int(power.argmax()) + 1
        section.findings.append(
            f"No signal above the control: no frequency of {what} has 10× the median power and beats the numbers "
            f"shuffled; the strongest is period {spectrum.n / k:.3g} with {float(power[k - 1] / power.sum()):.0%} of "
            f"the non-constant power ({in_control})."
        )
    section.figures.append(spectrum.plot())
    key_periods = fourier.integer_periods([spectrum.n / k for k in spectrum.key[0] if k > 0], spectrum.n)
    mod_periods = fourier.integer_periods(sorted(set(key_periods) | {2, 5, 10}), spectrum.n)
    try:
        separable = fourier.separability(rows, list(axis), mod_periods, control=control_rows, seed=ctx.seed)
    except ArithInterpError as why:
        section.findings.append(f"Mod-T separability not measured: {str(why).rstrip('.')}.")
    else:
        beats = separable.beats_controls()[0].tolist()
        assert separable.random_init is not None  # a control was given
        scored = [p for p in range(len(separable.periods)) if not math.isnan(float(separable.accuracy[0, p]))]
        quoted = "; ".join(
            f"T={separable.periods[p]}{' (a key period)' if separable.periods[p] in key_periods else ''}: "
            f"{float(separable.accuracy[0, p]):.2f} (95% CI {float(separable.ci[0, 0, p]):.2f} to "
            f"{float(separable.ci[1, 0, p]):.2f}), chance {float(separable.chance[p]):.2f}, random-init model "
            f"{float(separable.random_init[0, p]):.2f}, numbers shuffled {float(separable.shuffled[0, p]):.2f}"
            for p in scored)
        skipped = [str(entry["period"]) for entry in separable.meta["skipped"]]
        if skipped:
            quoted += f"; not scored, too few numbers per class: T={', '.join(skipped)}"
        readable = [T for T, b in zip(separable.periods, beats) if b]
        verdict = (f"x mod T is linearly readable from {what} beyond chance and a random-init model of the same "
                   f"architecture for T = {', '.join(map(str, readable))}" if readable else
                   f"No signal above the control: x mod T is not linearly readable from {what} beyond chance and a "
                   "random-init model of the same architecture for any of these periods")
        section.findings.append(f"{verdict} (held-out accuracy over unseen numbers, {separable.meta['cv']} folds: "
                                f"{quoted}).")
        section.figures.append(separable.plot())
    try:
        pairs, sample = _require_pairs(ctx, "helix", "the causal helix test")
        section.sample += "; helix: " + sample
    except NotEnoughData as why:
        section.findings.append(f"Helix: {why}")
        return section
    acts = collect(ctx.model, ctx.prompts, sites=helix_site, layers=[helix_layer], positions="a", progress=False)
    try:
        fit = helix.fit(acts, "a", periods=(2, 5, 10, 100), site=helix_site, layer=helix_layer, position="a")
        test = helix.patch_test(ctx.model, pairs, fit, random_state=ctx.seed)
    except ArithInterpError as why:
        section.findings.append(f"Helix: not tested: {str(why).rstrip('.')}.")
        return section
    where = f"{helix_site} of layer {helix_layer} on the a token of {len(ctx.prompts)} prompts"
    assert test.effect_ci is not None and test.fraction_ci is not None  # patch_test always sets them
    low, high = test.effect_ci[0].tolist(), test.effect_ci[1].tolist()
    head = (f"A helix with periods 2, 5, 10, 100 fitted at {where} has held-out R² {float(fit.r2_full):.3g} (values "
            f"shuffled: {fit.meta['control']['r2_full_mean']:.3g}); on {len(pairs)} pairs the layer patch moves the "
            f"corrupted answer's logit by {_interval(float(test.effect[0]), low[0], high[0])}")
    if test.layer_patch_distinct:
        f_low, f_high = test.fraction_ci[0].tolist(), test.fraction_ci[1].tolist()
        shares = ", ".join(f"{m}: {_interval(f, f_low[i], f_high[i], percent=True)}"
                           for i, (m, f) in enumerate(zip(test.methods, test.fraction.tolist())) if i > 0)
        section.findings.append(f"{head}; patched in at the corrupted value, they restore {shares} of it.")
    else:
        section.findings.append(f"{head}: not distinguishable from zero, so no share of it is reported.")
    if test.layer_patch_distinct and "helix" in test.methods and "shuffled" in test.methods:
        h, c = test.methods.index("helix"), test.methods.index("shuffled")
        if float(test.fraction_ci[0, h]) <= float(test.fraction_ci[1, c]):
            section.findings.append("Helix: no signal above the control (its share's interval overlaps that of a "
                                    "helix fitted to shuffled values).")
    section.figures += [fit.plot(), test.plot()]
    return section


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


def neurons_stage(ctx: Context) -> Section:
    """Heuristic neurons of the trained model against a random-init model of the same
    architecture, ranked and classified the same way on the same prompts and layers when the time
    left holds it: the share that implement a heuristic is a finding only when it beats the
    control's (a neuron of any model that reads digit tokens follows some operand rule)."""
    from arithinterp import neurons

    prompts = ctx.prompts[: ctx.n_neuron_prompts]
    require("neurons", len(prompts))
    memory = ctx.budget.memory(ctx.model)  # classify sizes each phase's batches (a backward in the ranking) from it

    def classify(some, layers: Optional[list[int]] = None, model: Any = None):
        pairs = None if ctx.pairs is None else ctx.pairs[: min(len(ctx.pairs), len(some))]
        return neurons.classify(ctx.model if model is None else model, some, layers=layers, top_k=ctx.top_k_neurons,
                                pairs=pairs, max_memory=memory, progress=False)

    # timed, not estimated from the evaluation: ranking the neurons (a forward and a backward of each
    # pair), reading their maps and scoring them with the shuffle control cost many forwards' worth
    # per prompt and layer, most of it fixed per call
    layers: Optional[list[int]] = None
    fitted = ""
    if ctx.budget.seconds != float("inf"):
        def pilot(some, layers: list[int]):  # the model and its random-init control: the page compares the two
            for model in (ctx.model, ctx.control_model()):
                with contextlib.suppress(ArithInterpError):  # a pilot's prompts may leave no heuristic: timing counts
                    classify(some, layers, model)

        # 16 prompts, not 4: the heuristics are scored on a grid that 4 prompts hardly cover. Shared: the
        # ranking's forward and backward of each pair reach every layer at once and are most of the cost
        # (135M shape, 100 prompts, top 100 neurons: 35 s at every layer, 34 s at the first and last, 28 s at
        # the last alone)
        n_layers = ctx.model.cfg.n_layers
        prompts, fitted_layers, fitted = ctx.fit_layers(prompts, "prompts", MINIMUMS["neurons"][0], n_layers,
                                                        pilot=pilot, pilot_items=16, shared=True)
        layers = None if len(fitted_layers) == n_layers else fitted_layers
    section = Section(STAGE_TITLES["neurons"], sample=_joined(require("neurons", len(prompts)), fitted))
    start = time.perf_counter()
    table = classify(prompts, layers)
    took = time.perf_counter() - start
    counts = (f"Of the {len(table.layer)} most important MLP neurons (ranked on {len(prompts)} prompts), "
              f"{100 * float(table.classified.float().mean()):.0f}% implement at least one heuristic (score ≥ "
              f"{table.threshold}): {_coverage(table)}")
    above = False
    if MARGIN * ctx.seconds_left() < took:  # the control costs what the model did: the same prompts and layers
        section.findings.append(
            f"{counts}. The random-init control did not fit the time left, so this share "
            "is not compared with it (a neuron of any model that reads digit tokens follows some operand rule); "
            "give the report more time (--budget SECONDS).")
    else:
        control = classify(prompts, layers, ctx.control_model())
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


def circuits_stage(ctx: Context) -> Section:
    import torch

    from arithinterp import circuits
    from arithinterp.engine.edges import sender_outputs

    # whether edges apply to this architecture, before whether there are pairs enough: a model whose
    # stream is no sum of its parts is "not run", whatever the data (one prompt's senders, a forward)
    sender_outputs(ctx.model, ctx.all_prompts.unpadded(torch.arange(1)))
    pairs, _ = _require_pairs(ctx, "circuits")
    memory = ctx.budget.memory(ctx.model)  # EAP-IG's batches and the curve's stacked edge sets fit the stage's memory

    def pilot(some):
        scored = circuits.score_edges(ctx.model, some, "eap-ig", steps=STEPS, max_memory=memory, progress=False)
        with contextlib.suppress(AnalysisError):  # a pilot's pairs may not differ; the timing is what counts
            circuits.faithfulness(ctx.model, some, scored, max_memory=memory)

    cfg = ctx.model.cfg  # EAP-IG's 2 + 2·steps passes and a stacked forward per curve size, 5× (measured)
    edges = (1 + cfg.n_layers * (cfg.n_heads + 1)) * (cfg.n_layers * (3 * cfg.n_heads + 1) + 1) // 2
    curve_pairs, sizes, steps = None, None, STEPS
    prior = 5 * (2 + 2 * STEPS + edges.bit_length() + 2)
    try:
        if prior * ctx.budget.forward_seconds * MINIMUMS["circuits"][0] > ctx.seconds_left():
            # a pilot of the whole curve would itself take much of the time: time its parts instead
            raise OverBudget("the whole curve does not fit")
        fitted_pairs, fitted = ctx.fit(pairs, "pairs", MINIMUMS["circuits"][0], pilot=pilot, prior=prior)
        if len(fitted_pairs) < len(pairs):
            # a sample: the whole curve, extrapolated from a pilot on a few pairs, decides it; plan EAP-IG
            # and the curve by their parts instead, the curve re-planned from EAP-IG's measured cost below
            raise OverBudget("the whole curve does not fit every pair")
        pairs = fitted_pairs
    except OverBudget:  # every edge scored on the minimum of pairs, fewer steps; the curve at fewer sizes and pairs
        pairs, curve_pairs, sizes, steps, fitted = _fit_curve(ctx, pairs, memory)
    start = time.perf_counter()
    scored = circuits.score_edges(ctx.model, pairs, "eap-ig", steps=steps, max_memory=memory, progress=False)
    if curve_pairs is not None and sizes is not None:
        # the curve's sizes again, at EAP-IG's cost per pass measured on every pair: the pilots' one or two
        # pairs can under-state it (222 s of 203 s before). A pair's run of an edge set cost 1.09 passes on
        # the 135M shape at 5 sizes and more with the larger sets of a longer curve, so 1.5
        per_run = 1.5 * (time.perf_counter() - start) / (len(pairs) * (2 + 2 * steps))
        room = int(max(ctx.seconds_left(), 0.0) * MARGIN / (per_run * len(curve_pairs))) - 2
        if room < len(sizes):
            sizes = [sizes[i] for i in spread(len(sizes), max(room, min(CURVE_SIZES, len(sizes))))]
        fitted += f"; {_curve_phrase(len(curve_pairs), sizes, scored.n_edges)}"
    section = Section(STAGE_TITLES["circuits"], sample=_joined(require("circuits", len(pairs)), fitted))
    curve = circuits.faithfulness(ctx.model, pairs if curve_pairs is None else curve_pairs, scored, sizes,
                                  max_memory=memory)
    if not curve.reported:  # every edge and no edge are not distinguishable: nothing to restore a fraction of
        section.findings.append(f"No signal above the control: on {len(pairs)} pairs, {curve.note}.")
        section.figures.append(curve.plot())
        return section
    smallest = curve.smallest(0.9)
    low, high = curve.smallest_interval(0.9)
    interval = (f" (95% bootstrap interval over pairs: {low} to {high} edges)" if high is not None else
                " (the 95% bootstrap interval's lower bound does not stay above 0.9 at any size, so no size is sure)")
    size = smallest if smallest is not None else scored.n_edges
    circuit = circuits.top_n(scored, size)
    section.findings.append(
        f"EAP-IG (Hanna et al. 2024, {steps} step{'s' if steps > 1 else ''}) scores all {scored.n_edges} edges of "
        "the graph (embeddings, each head's "
        f"query, key and value input, MLPs, logits) on {len(pairs)} pairs whose first operand differs. "
        + (f"The {smallest} top edges ({100 * smallest / scored.n_edges:.1f}% of all) restore 0.9 of the "
           "answer's logit difference, and every larger top-k set measured does too, with every other edge "
           f"resampled from the corrupted prompt{interval}."
           if smallest is not None else "No top-k subset of the edges restores 0.9 of the answer's logit difference "
           "with every larger subset measured doing so too.")
    )
    top = ", ".join(f"{e} ({float(v):.2f})" for e, v in zip(*_top_edges(circuit, 5)))
    section.findings.append(f"Largest edges (estimated logit-difference change): {top}.")
    section.figures += [curve.plot(), circuit.plot(max_edges=60)]
    return section


STEPS = 5  # EAP-IG's integration steps (Hanna et al. 2024), when they fit the budget
CURVE_PAIRS = 10  # the fewest pairs a sampled faithfulness curve rests on (its intervals say how sure it is)
CURVE_SIZES = 4  # the fewest sizes a sampled curve measures (no edge, every edge and two between)


def _fit_curve(ctx: Context, pairs, memory: int) -> tuple[Any, Any, list[int], int, str]:
    """When EAP-IG with the whole faithfulness curve on the minimum of pairs does not fit: EAP-IG
    on the minimum of pairs (seeded) with as many integration steps as fit (1 to :data:`STEPS`),
    and the curve at as many sizes (evenly spread over the default ones) on as many of those
    pairs as fit, at least :data:`CURVE_SIZES` sizes on :data:`CURVE_PAIRS` pairs →
    ``(pairs, curve pairs, sizes, steps, sentence)`` (the sentence says what was sampled; the stage
    adds the curve's pairs and sizes, :func:`_curve_phrase`, once it has fixed them). Timed on two pairs and on one
    (:func:`pilot_cost`): EAP-IG at one step (its 4 passes; each step adds 2), and the curve at no
    edge and every edge (4 edge-set runs a pair); :class:`OverBudget` when not even one step and
    the smallest curve fit."""
    from arithinterp import circuits

    minimum, n = MINIMUMS["circuits"][0], len(pairs)
    chosen = pairs[_seeded_pick(n, minimum, ctx.seed)] if n > minimum else pairs
    k = min(2, len(chosen))
    kept: list[Any] = []

    def score(some):
        kept.append(circuits.score_edges(ctx.model, some, "eap-ig", steps=1, max_memory=memory, progress=False))

    score_fixed, per_pass = pilot_cost(score, chosen, k)
    per_pass /= 4  # EAP-IG's passes per pair: 2 + 2·steps
    n_edges = kept[0].n_edges

    def curve(some):
        with contextlib.suppress(AnalysisError):  # the pilot's pairs may not differ; the timing is what counts
            circuits.faithfulness(ctx.model, some, kept[0], [0, n_edges], max_memory=memory)

    curve_fixed, per_size = pilot_cost(curve, chosen, k)
    # the two sizes, every edge ablated and the clean run: four edge-set runs per pair, each a patched
    # forward, so at least one of EAP-IG's passes (a pilot on one or two pairs that stops early, or
    # fits one stacked forward, would make a run look free: 19 sizes on 30 pairs then took minutes)
    per_size = max(per_size / 4, per_pass)
    default = circuits.curve_sizes(n_edges)

    def scoring(steps: int) -> float:
        return score_fixed + len(chosen) * per_pass * (2 + 2 * steps)

    def curving(n_pairs: int, n_sizes: int) -> float:
        return curve_fixed + n_pairs * (n_sizes + 2) * per_size

    left = max(ctx.seconds_left(), 0.0) * MARGIN
    least = scoring(1) + curving(CURVE_PAIRS, CURVE_SIZES)
    if least > left:
        raise OverBudget(
            f"Not run within the budget: EAP-IG at one step on the minimum of {minimum} pairs "
            f"({_each(score_fixed, 4 * per_pass)}) and a faithfulness curve of {CURVE_SIZES} sizes on {CURVE_PAIRS} "
            f"of them ({_each(curve_fixed, per_size, 'per pair and size')}) would take about {_secs(least)}, more than "
            f"the {_secs(max(ctx.seconds_left(), 0.0))} left of this stage's {_secs(ctx.budget.seconds)} budget; "
            "give the report more time (budget=, --budget SECONDS).")
    # the scores first (up to the default steps), then the curve's pairs, then its sizes
    steps = max(s for s in range(1, STEPS + 1) if scoring(s) + curving(CURVE_PAIRS, CURVE_SIZES) <= left)
    rest = left - scoring(steps) - curve_fixed
    n_curve = min(len(chosen), int(rest / (per_size * (CURVE_SIZES + 2))))
    n_sizes = min(len(default), max(CURVE_SIZES, int(rest / (per_size * n_curve)) - 2))
    # a curve that fills the time on an estimate from one or two pairs is kept to 4 times the smallest
    if curving(n_curve, n_sizes) > 0.5 * left and n_curve * (n_sizes + 2) > 4 * CURVE_PAIRS * (CURVE_SIZES + 2):
        n_sizes = min(n_sizes, max(CURVE_SIZES, 4 * CURVE_PAIRS * (CURVE_SIZES + 2) // n_curve - 2))
    sizes = [default[i] for i in spread(len(default), n_sizes)]
    curve_pairs = chosen[:n_curve]
    fewer = "" if steps == STEPS else f" with {steps} of EAP-IG's {STEPS} default integration steps"
    sentence = f"sampled {len(chosen):,} of {n:,} pairs{fewer} to fit the {_secs(ctx.budget.seconds)} budget"
    return chosen, curve_pairs, sizes, steps, sentence


def _curve_phrase(n_pairs: int, sizes: list[int], n_edges: int) -> str:
    from arithinterp.circuits import curve_sizes

    return (f"the faithfulness curve on {n_pairs} of them at {len(sizes)} of {len(curve_sizes(n_edges))} sizes "
            f"({', '.join(f'{k:,}' for k in sizes)} edges), its intervals over those pairs")


def _top_edges(circuit, k: int):
    order = circuit.scores.abs().argsort(descending=True)[:k].tolist()
    return [circuit.edges[i] for i in order], [circuit.scores[i] for i in order]


def features_stage(ctx: Context) -> Section:
    """The transcoders shipped for a zoo model: their card, the replacement model on the report's
    prompts, and the attribution graph of one correctly answered prompt. Other models: not run, with
    the reason (no transcoders ship for them; ``arithinterp.features.train_transcoders`` makes some)."""
    from arithinterp.features import attribution_graph, load_transcoders, replacement_metrics
    from arithinterp.features.training import full_tokens

    from arithinterp.features.shipped import RECIPES

    if not ctx.spec.startswith("zoo:"):  # the report shows the reason as "not run on this model"
        raise ModelSpecError(f"transcoders ship only for the zoo models {accepted(['zoo:' + n for n in RECIPES])}, "
                             f"not for {ctx.spec!r}; train some with arithinterp.features.train_transcoders")
    transcoders = load_transcoders(ctx.spec)  # a zoo model without them: ModelSpecError, which says so
    transcoders.check_model(ctx.model)
    require("features", 0 if ctx.prompts is None else len(ctx.prompts), "the graph of a correctly answered prompt")
    correct = ctx.prompts
    assert correct is not None  # require() counted them
    prompt, width = correct.texts[0], int(correct.tokens.shape[1])
    graph = attribution_graph(ctx.model, correct.tokens[0][width - int(correct.lengths[0]):], transcoders,
                              progress=False)  # the first correctly answered prompt, its padding dropped
    prompts, fitted = ctx.fit(ctx.all_prompts, "prompts", 30, per_item=2 * ctx.budget.forward_seconds)
    tokens, _, n_answer = full_tokens(prompts)
    measured = replacement_metrics(ctx.model, transcoders, tokens, n_answer)
    section = Section(STAGE_TITLES["features"],
                      sample=_joined(f"{len(prompts):,} of the task's prompts for the replacement model", fitted))
    rows = transcoders.metrics.get("layers", [])
    per_layer = "; ".join(f"layer {layer}: FVU {r['fvu']:.3f}, L0 {r['l0']:.1f}, dead {100 * r['dead_fraction']:.1f}%"
                          for layer, r in zip(transcoders.layers, rows))
    section.findings.append(
        f"Shipped transcoders for {ctx.spec} ({transcoders.n_features} TopK features per layer, k={transcoders.k}, "
        f"made by `arithinterp train-transcoders {ctx.spec}`), on their own held-out prompts: {per_layer}.")
    section.findings.append(
        f"Replacement model (every MLP replaced by its transcoder, no error term) on {measured['n_positions']:,} "
        f"answer positions: top-1 agreement with the model {measured['agreement']:.3f}, "
        f"KL {measured['kl']:.3f} nats.")
    s = graph.scores
    section.findings.append(
        f"Attribution graph of {prompt!r} (Ameisen et al. 2025): {s['n_active_features']} active features; the pruned "
        f"graph keeps {s['n_kept']} nodes holding {s['kept_influence']:.2f} of the influence on the answer; "
        f"replacement score {s['replacement']:.3f}, completeness {s['completeness']:.3f}; edges + bias match each "
        f"feature's pre-activation within {s['max_abs_error']:.1e}.")
    section.figures += [transcoders.plot(), graph.plot()]
    return section


STAGES: dict[str, Callable[[Context], Section]] = {
    "accuracy": accuracy_stage,
    "patching": patching_stage,
    "digits": digits_stage,
    "probes": probes_stage,
    "errors": error_detector_stage,
    "fourier": fourier_helix_stage,
    "neurons": neurons_stage,
    "circuits": circuits_stage,
}
STAGE_TITLES["features"] = "Feature circuits: transcoders and an attribution graph"
STAGES["features"], WEIGHTS["features"], MINIMUMS["features"] = features_stage, 0.5, (1, "correctly answered prompt")


CAUSAL_PAIRS = 400  # interchange pairs per variable at most (about 30% held out by operand pair and scored)
CAUSAL_STEPS = 100  # DAS training steps per cell when the budget allows (fewer, and said so, when not)
CAUSAL_MIN_STEPS = 30  # below this a fit says little: fewer cells first, then "over budget"
CAUSAL_K = 4  # dimensions interchanged
CAUSAL_LOCALISED = 0.9  # IIA from which a finding calls the variable localised at a cell


def _causal_variables(prompts: Any) -> list[str]:
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
    # operands have no digit there (add-3digit: carry_3, into the thousands), else that digit of the sum
    top = n_digits - 1
    only_carry = int(max(prompts.a.max(), prompts.b.max())) < 10**top
    return [f"carry_{top}" if only_carry else f"sum_digit_{top}"]


def causal_stage(ctx: Context) -> Section:
    """Distributed alignment search (Geiger et al. 2024) for the variables of the task's built-in
    causal model at the final position: per variable and layer, probe accuracy with folds grouped
    by operand pair (readable) beside held-out DAS IIA and a random rotation's (used). Cells and
    training steps are cut to the budget (timed on the first variable's fit) and the sample says so."""
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
            causal.das(ctx.model, dataset, "resid_post", n_layers - 1, "final", CAUSAL_K, steps=few,
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
                f"take about {_secs(fixed + CAUSAL_MIN_STEPS * per_step)}, more than the {_secs(left)} left of this "
                f"stage's {_secs(ctx.budget.seconds)} budget; give the report more time (budget=, --budget SECONDS).")
        if steps < CAUSAL_STEPS or len(layers) < n_layers:
            fitted = (f"{steps} of {CAUSAL_STEPS} training steps per fit at {len(layers)} of {n_layers} layers "
                      f"({', '.join(map(str, layers))}) to fit the {_secs(ctx.budget.seconds)} budget")
        else:
            fitted = f"every layer at {steps} training steps per fit fits the {_secs(ctx.budget.seconds)} budget"
    result = causal.readable_vs_used(ctx.model, prompts, variables, layers=layers, position="final", k=CAUSAL_K,
                                     steps=steps, n=n_pairs, max_memory=memory, seed=ctx.seed, progress=False)
    frame = result.to_frame()
    section = Section(STAGE_TITLES["causal"], sample=_joined(
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


STAGE_TITLES["causal"] = "Causal variables: readable vs used (DAS)"
STAGES["causal"], WEIGHTS["causal"], MINIMUMS["causal"] = causal_stage, 0.5, (100, "correctly answered prompts")


# --- HTML ----------------------------------------------------------------------------------------

_STYLE = """
body { font-family: Inter, Helvetica, Arial, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
h1 { margin-bottom: 0.2em; } .meta { color: #666; margin-top: 0; }
section { border-top: 1px solid #ddd; margin-top: 2em; padding-top: 0.5em; }
.findings li { margin: 0.3em 0; } .figure { margin: 1em 0; } .seconds { color: #999; font-size: 0.85em; }
.sample { color: #555; font-size: 0.9em; } .state { font-weight: bold; } .status li { margin: 0.15em 0; }
"""


def section_html(section: Section, first_figure: int = 0) -> str:
    """One section's HTML; its figures are numbered from ``first_figure`` (ids unique in the page)."""
    parts = [f"<section><h2>{html.escape(section.title)}</h2>"]
    if section.sample:
        parts.append(f"<p class='sample'>sample: {html.escape(section.sample)}</p>")
    parts.append("<ul class='findings'>")
    parts += [f"<li>{html.escape(line)}</li>" for line in section.findings]
    parts.append("</ul>")
    for i, fig in enumerate(section.figures):
        div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{first_figure + i}")
        parts.append(f"<div class='figure'>{div}</div>")
    parts.append(f"<p class='seconds'>computed in {section.seconds:.1f} s</p></section>")
    return "\n".join(parts)


def render(title: str, meta: dict, sections: list[Section], status: Optional[list[tuple[str, str]]] = None,
           note: str = "", bodies: Optional[list[str]] = None) -> str:
    """One self-contained HTML page; plotly.js is inlined once. ``status``: (stage title, state)
    lines listed under the title; ``bodies``: the sections' HTML when already rendered."""
    from plotly.offline import get_plotlyjs

    if bodies is None:
        bodies, first = [], 0
        for section in sections:
            bodies.append(section_html(section, first))
            first += len(section.figures)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style>",
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<p class='meta'>"
        + " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items())
        + "</p>",
    ]
    if note:
        parts.append(f"<p class='state'>{html.escape(note)}</p>")
    if status:
        parts.append("<h2>Stages</h2><ul class='status'>")
        parts += [f"<li><b>{html.escape(name)}</b>: {html.escape(state)}</li>" for name, state in status]
        parts.append("</ul>")
    parts += [
        "<h2>Summary</h2><ul class='findings'>",
        *[f"<li><b>{html.escape(s.title)}.</b> {html.escape(s.findings[0])}</li>" for s in sections if s.findings],
        "</ul>",
        *bodies,
        "</body></html>",
    ]
    return "\n".join(parts)


FINISHED = ("done", "not enough data", "not run", "skipped", "failed")  # the states of a stage that has ended


class _Page:
    """The report as it stands, rewritten to ``out`` (atomically) whenever a stage starts or ends,
    so that a run stopped at any point (killed, interrupted, out of memory) leaves a readable
    page listing what finished, what was running and what was not yet run."""

    def __init__(self, out: Path, title: str, meta: dict, names: list[str]):
        self.out, self.title, self.meta, self.start = out, title, meta, time.perf_counter()
        self.names = ["evaluation", *names]
        self.state = {name: "not yet run" for name in self.names}
        self.sections: list[Section] = []
        self.bodies: list[str] = []
        self.figures = 0
        self.note = ""

    def set(self, name: str, state: str) -> None:
        self.state[name] = state
        self.write()

    def add(self, name: str, section: Section, state: str) -> None:
        self.sections.append(section)
        self.bodies.append(section_html(section, self.figures))  # figures rendered once, not at every write
        self.figures += len(section.figures)
        self.set(name, state)

    def outcome(self) -> str:
        """The closing line of a finished run: how many stages reached a finding, and for the rest
        why not and what to change. "Complete" only when every stage ran on enough data."""
        states = [self.state[n] for n in self.names[1:]]
        counts = {kind: sum(1 for st in states if st.startswith(kind)) for kind in FINISHED}
        total = len(states)
        apply = "does not apply" if counts["not run"] == 1 else "do not apply"
        if counts["done"] + counts["not run"] == total:
            return (f"Complete: all {total} stages ran and state their findings below." if not counts["not run"] else
                    f"Complete: {counts['done']} of {total} stages state findings; {counts['not run']} {apply} "
                    "to this model (their sections say why).")
        missing = [f"{counts[kind]} {label}" for kind, label in (
            ("not enough data", "had not enough data"), ("skipped", "did not fit the budget"),
            ("failed", "failed"), ("not run", f"{apply} to this model")) if counts[kind]]
        advice = []
        if counts["not enough data"]:
            advice.append("too few correctly answered prompts: give the report more time (--budget), more prompts "
                          "(--limit, --operands) or an easier task (smaller operands, more --few-shot examples)")
        if counts["skipped"]:
            advice.append("over budget: give the report more time (--budget)")
        if counts["failed"]:
            advice.append("failed: the reasons are in their sections")
        text = "; ".join(advice)
        return (f"Finished with gaps: {counts['done']} of {total} stages state findings; " + ", ".join(missing)
                + (f". {text[:1].upper()}{text[1:]}." if text else "."))

    def write(self) -> Path:
        finished = sum(1 for n in self.names[1:] if self.state[n].startswith(FINISHED))
        running = [STAGE_TITLES.get(n, "evaluation") for n in self.names if self.state[n].startswith("running")]
        stopped = [n for n in self.names if self.state[n].startswith("interrupted")]
        total = len(self.names) - 1
        if stopped:
            note = f"Interrupted: {finished} of {total} stages finished before the run was stopped."
        elif finished == total:
            note = self.outcome()
        else:
            note = (f"Partial page: {finished} of {total} stages finished"
                    + (f", {running[0]} running" if running else "") + "; the page is rewritten as each stage ends.")
        meta = dict(self.meta, seconds=round(time.perf_counter() - self.start, 1))
        status = [("Evaluating the task" if n == "evaluation" else STAGE_TITLES[n], self.state[n]) for n in self.names]
        page = render(self.title, meta, self.sections, status, note or self.note, self.bodies)
        return atomic_write(self.out, lambda tmp: tmp.write_text(page, encoding="utf-8"))


# --- entry point ---------------------------------------------------------------------------------


def parse_operands(operands: Any) -> list[int]:
    """Operand values from ``"LO-HI"`` (inclusive), ``"1,5,9"``, or an iterable of ints."""
    import re

    if isinstance(operands, str):
        text = operands.replace(" ", "")
        span = re.fullmatch(r"(\d+)-(\d+)", text)
        if span and int(span.group(1)) <= int(span.group(2)):
            return list(range(int(span.group(1)), int(span.group(2)) + 1))
        if re.fullmatch(r"\d+(,\d+)*", text):
            return [int(v) for v in text.split(",")]
        raise ConfigError(
            f"operands must be a range 'LO-HI' (inclusive, e.g. '0-99') or a list '1,5,9', got {operands!r}")
    try:
        values = [int(v) for v in operands]
    except (TypeError, ValueError) as error:
        raise ConfigError(f"operands must be non-negative ints, 'LO-HI' or '1,5,9', got {operands!r}") from error
    if not values or min(values) < 0:
        raise ConfigError(f"operands must be a non-empty list of non-negative ints, got {operands!r}")
    return values


def _task_prompts(model: Any, spec: str, limit: int, seed: int, template: Optional[str], few_shot: Union[int, str],
                  operands: Any):
    """The report's prompts: the model's own task (a zoo task, else single-token addition), with
    the template, few-shot prefix and operand values replaced where given; a seeded sample."""
    import torch

    from arithinterp.models.zoo import get_entry, task_prompts
    from arithinterp.tasks import number_check, prompts_for_pairs

    if template is None and not few_shot and operands is None:
        return task_prompts(model, spec, limit, seed)
    op, modulus, answer_digits, default_template = "+", None, 0, "{a}+{b}="
    if spec.startswith("zoo:"):
        task = get_entry(spec).task
        op, modulus, answer_digits, default_template = task.op, task.modulus, task.answer_digits, task.template
        values = list(range(*task.a_range))
    else:
        values = number_check(model, range(100))["single_token"]
    if operands is not None:
        values = parse_operands(operands)
    a = torch.tensor(values).repeat_interleave(len(values))
    b = torch.tensor(values).repeat(len(values))
    pick = torch.randperm(len(a), generator=torch.Generator().manual_seed(seed))[:limit]
    prompts = prompts_for_pairs(model, op, a[pick].tolist(), b[pick].tolist(), template or default_template,
                                modulus=modulus, answer_digits=answer_digits, few_shot=few_shot, seed=seed)
    n_ctx = getattr(model.cfg, "n_ctx", None)
    longest = int(prompts.lengths.max()) + prompts.answer_tokens.shape[1]
    if n_ctx is not None and longest > n_ctx:
        raise ConfigError(f"the prompts with their answers are up to {longest} tokens long, more than the model's "
                          f"context of {n_ctx} tokens; use fewer few-shot examples or a shorter template")
    return prompts


def _check_budget(budget: Any) -> float:
    if budget is None:
        return DEFAULT_BUDGET
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise ConfigError(f"budget must be a positive number of seconds (e.g. 600), got {budget!r}")
    return float(budget)


WARM_UP = 8  # prompts evaluated first, untimed: they pay the one-off costs (the engine's checks of the model)
EVAL_CHUNK = 64  # prompts per later round of the evaluation; each round's time gives the rate per prompt
EVAL_CAP = 0.5  # the largest share of the whole budget the evaluation may take to reach the stages' minimums


def correct_needed(stages: list[str]) -> int:
    """The correctly answered prompts the evaluation aims for: every chosen stage's minimum that
    counts them (probes, neurons, digits), and twice the pair minimum for the stages that use
    counterfactual pairs (a correct prompt gives at most one pair, and pairs whose answers start
    with the same token are left out). 0 when no chosen stage uses correct prompts."""
    needs = [MINIMUMS[name][0] for name in ("digits", "probes", "neurons") if name in stages]
    if any(name in stages for name in ("patching", "fourier", "circuits", "features", "causal")):
        needs.append(2 * MINIMUMS["patching"][0])
    if "errors" in stages:  # a third is held out, and it needs the minimum of each kind
        needs.append(3 * MINIMUMS["errors"][0])
    return max(needs, default=0)


def _evaluate_within(model: Any, prompts: Any, seconds: float, cap: float, budget: Budget, seed: int,
                     need: int = 0) -> tuple[Any, Any, float, str]:
    """Evaluate a seeded sample of ``prompts``: rounds of :data:`EVAL_CHUNK` prompts (in a seeded
    order) while the ``seconds`` of the evaluation's share last, and past them, up to ``cap``
    seconds, until ``need`` prompts are answered correctly (the stages' minimums,
    :func:`correct_needed`). The first :data:`WARM_UP` prompts pay the one-off costs and are not
    timed; the rate per prompt comes from the later rounds (``0`` prompts: the warm-up's).

    Returns ``(prompts evaluated, their evaluation, seconds per prompt, sample sentence)``; when
    ``need`` is not reached, the sentence says how many prompts it would take and how long."""
    import torch

    from arithinterp.tasks import Evaluation

    n = len(prompts)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    batch = budget.batch_size(model, int(prompts.lengths.max()), n_new=int(prompts.answer_tokens.shape[1]))
    start = time.perf_counter()
    parts = [prompts[order[:WARM_UP]].evaluate(model, batch_size=batch)]
    done, timed, timed_seconds = min(WARM_UP, n), 0, 0.0
    per_prompt = (time.perf_counter() - start) / done  # until a timed round: an over-estimate

    def n_correct() -> int:
        return sum(int(part.correct.sum()) for part in parts)

    while done < n:
        elapsed = time.perf_counter() - start
        limit = seconds if n_correct() >= need else cap
        # the first timed round small; later ones a batch, but a quarter of the share at most: a round
        # that ends far past the stages' minimums, or past the share, is time the stages do not get
        size = min(max(EVAL_CHUNK, min(batch, int(0.25 * seconds / per_prompt))) if timed else WARM_UP, n - done)
        if timed and elapsed + size * per_prompt > limit:  # the next round would overrun: a smaller last one, or stop
            size = int(max(limit - elapsed, 0.0) / per_prompt)
            if size < min(EVAL_CHUNK, n - done) // 4:
                break
        round_start = time.perf_counter()
        parts.append(prompts[order[done:done + size]].evaluate(model, batch_size=batch))
        timed, timed_seconds, done = timed + size, timed_seconds + time.perf_counter() - round_start, done + size
        per_prompt = timed_seconds / timed
    chosen = order[:done]
    keep, where = chosen.sort()  # the sample in the prompt set's order, and where each was evaluated
    joined = Evaluation(torch.cat([p.correct for p in parts]), torch.cat([p.model_answer for p in parts]),
                        [t for p in parts for t in p.answer_text], torch.cat([p.generated_tokens for p in parts]))
    evaluation = joined[where]
    took = time.perf_counter() - start
    note = (f"all {n:,} prompts evaluated in {_secs(took)}" if done == n else
            f"sampled {done:,} of {n:,} prompts in {_secs(took)} ({_secs(seconds)} budget"
            + (f", extended up to {_secs(cap)} to reach {need} correct)" if took > seconds else ")"))
    correct = int(evaluation.correct.sum())
    if correct < need:
        accuracy = max(correct, 1) / done
        wanted = math.ceil(need / accuracy)
        note += (f"; {correct} answered correctly, fewer than the {need} the stages need"
                 + (f": at this accuracy ({accuracy:.1%}) that takes about {wanted:,} prompts "
                    f"(about {_secs(wanted * per_prompt)} to evaluate); give the report more time (--budget) "
                    if wanted <= n else
                    f", and all {n:,} prompts hold only {correct} (about {wanted:,} would be needed at "
                    f"{accuracy:.1%}): use more operand values (--operands), more prompts (--limit) ")
                 + "or an easier task (smaller operands, more --few-shot examples)")
    return prompts[keep], evaluation, per_prompt, note


# stages whose own code takes no budget: run at the minimum first, then larger when the time allows
KNOBS = {"fourier": ("n_pairs", "helix", "pairs")}


def _run_stage(ctx: Context, name: str) -> Section:
    """One stage within ``ctx.budget``; a stage listed in :data:`KNOBS` is timed at its minimum
    sample, then run again on as many as fit the time left (when that is at least twice as many)."""
    if name not in KNOBS or ctx.budget.seconds == float("inf"):
        return STAGES[name](ctx)
    knob, minimum_of, what = KNOBS[name]
    minimum = MINIMUMS[minimum_of][0]
    have = len(ctx.prompts) if knob == "n_probe_prompts" else (0 if ctx.pairs is None else len(ctx.pairs))
    cap = getattr(ctx, knob)
    available = min(cap, have)
    if available < 2 * minimum:
        return STAGES[name](ctx)
    try:
        setattr(ctx, knob, minimum)
        start = time.perf_counter()
        section = STAGES[name](ctx)
        per_item = (time.perf_counter() - start) / minimum  # fixed costs counted per item: an over-estimate
        fits = min(available, int(max(ctx.seconds_left(), 0.0) / max(per_item, 1e-9)))
        if fits >= 2 * minimum:
            setattr(ctx, knob, fits)
            section = STAGES[name](ctx)
        used = getattr(ctx, knob)
    finally:
        setattr(ctx, knob, cap)
    budget = f"the {_secs(ctx.budget.seconds)} budget"
    section.sample = _joined(section.sample, f"all {available:,} {what} fit {budget}" if used >= available
                             else f"sampled {used:,} of {available:,} {what} to fit {budget}")
    return section


def write_report(
    model: Union[str, Any] = "zoo:add-100",
    out: Union[str, Path] = "report.html",
    *,
    stages: Optional[list[str]] = None,
    limit: int = 2000,
    seed: int = 0,
    template: Optional[str] = None,
    few_shot: Union[int, str] = 0,
    operands: Any = None,
    budget: Optional[float] = None,
    max_memory: Any = None,
    correct_only: bool = True,
    progress: bool = True,
) -> Path:
    """Run the standard battery on ``model`` and write a self-contained HTML report to ``out``.

    Args:
        model: a model spec (``zoo:NAME``, a path, a hub id) or a loaded hooked model.
        stages: which stages to run (default: all of :data:`STAGES`, in order).
        limit: at most this many prompts of the task (a seeded sample).
        template: the prompt template (``{a}`` and ``{b}``; default: the zoo task's, else ``"{a}+{b}="``).
        few_shot: solved examples to prefix each prompt with (seeded), or a prefix string.
        operands: operand values for both a and b: ``"0-99"``, ``"1,5,9"`` or ints (default: the
            zoo task's range, else the numbers below 100 that are single tokens).
        budget: seconds for the evaluation and all stages together (default :data:`DEFAULT_BUDGET`),
            shared by :data:`WEIGHTS`; what a stage leaves unused goes to the later ones. A stage
            samples fewer prompts or pairs (seeded) to fit its share and says so.
        max_memory: transient bytes (or ``"2GiB"``) each stage's batches may use beyond the model
            (default :func:`default_max_memory`: half the available memory, at most 2 GiB).
        correct_only: analyse only the prompts the model answers correctly (the default, as the
            papers do); ``False`` analyses every evaluated prompt, scored on the true answers — for
            a model that answers few correctly, such as a random-init control.

    The page is written when the evaluation starts and rewritten as every stage starts and ends:
    a run stopped at any point leaves a readable page that lists finished, running and unrun
    stages. A stage that fails (any exception, e.g. ``MemoryError``) is recorded with its reason
    and the next one runs; ``KeyboardInterrupt`` writes the page as interrupted and is re-raised.
    Each stage states its sample size and, below :data:`MINIMUMS`, says "not enough data".
    """
    from arithinterp._version import __version__
    from arithinterp.models import load_model, model_id

    chosen = list(STAGES) if stages is None else list(stages)
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown report stage(s) {unknown}; accepted: {accepted(STAGES)}")
    if limit < 10:
        raise ConfigError(f"limit must be at least 10 prompts, got {limit}")
    if operands is not None:
        parse_operands(operands)  # bad operands fail before the model loads
    if not isinstance(correct_only, bool):
        raise ConfigError(f"correct_only must be True or False, got {correct_only!r}")
    total = _check_budget(budget)
    memory = default_max_memory() if max_memory is None else parse_memory(max_memory)
    out = check_writable_file(out, "out")  # before minutes of analysis, not after
    loaded = load_model(model) if isinstance(model, str) else model
    spec = model if isinstance(model, str) else model_id(loaded)
    all_prompts = _task_prompts(loaded, spec, limit, seed, template, few_shot, operands)

    meta: dict[str, Any] = dict(model=spec, prompts=len(all_prompts))
    if template is not None:
        meta["template"] = template
    if few_shot:
        meta["few-shot"] = few_shot
    if operands is not None:
        meta["operands"] = operands if isinstance(operands, str) else f"{len(parse_operands(operands))} values"
    if not correct_only:
        meta["prompts analysed"] = "all, answered correctly or not"
    meta.update(seed=seed, budget=_secs(total), memory=f"{memory / 2**20:,.0f} MiB per stage",
                arithinterp=__version__)
    page = _Page(out, f"How does {spec} do arithmetic?", meta, chosen)
    clock = time.perf_counter()  # the budget counts from here: loading the model is not the report's to shorten

    def share(name: str, later: list[str]) -> float:
        left = total - (time.perf_counter() - clock)
        return max(left, 0.0) * WEIGHTS[name] / sum(WEIGHTS[n] for n in [name, *later])

    seconds = share("evaluation", chosen)
    page.set("evaluation", f"running (budget {_secs(seconds)})")
    try:
        all_prompts, evaluation, per_prompt, sampled = _evaluate_within(
            loaded, all_prompts, seconds, max(seconds, EVAL_CAP * total), Budget(seconds, memory), seed,
            need=correct_needed(chosen) if correct_only else 0)
    except KeyboardInterrupt:
        page.set("evaluation", "interrupted")
        raise
    except Exception as error:  # nothing can run without the evaluation: say why on the page, then stop
        page.set("evaluation", f"failed: {_reason(error)}")
        raise
    # may be empty: each stage holds itself to its minimum
    prompts = all_prompts[evaluation.correct] if correct_only else all_prompts
    pairs = None
    if len(prompts) >= 2:
        try:  # pairs whose answers start alike have a first-token logit difference of 0: leave them out
            pairs = prompts.counterfactual(vary="a", seed=seed, distinct_first_token=True)
        except TaskError:
            pairs = None
    page.meta.update(evaluated=len(all_prompts), correct=int(evaluation.correct.sum()),
                     pairs=0 if pairs is None else len(pairs))
    page.set("evaluation", f"done: {time.perf_counter() - clock:.1f} s of its {_secs(seconds)} budget; {sampled}")
    ctx = Context(loaded, spec, prompts, all_prompts, evaluation, pairs, seed, correct_only=correct_only)

    for i, name in enumerate(tqdm(chosen, desc="report", disable=not progress)):
        seconds = share(name, chosen[i + 1:])
        ctx.budget, ctx.stage_start = Budget(seconds, memory, per_prompt), time.perf_counter()
        page.set(name, f"running (budget {_secs(seconds)})")
        state = "done"
        try:
            section = _run_stage(ctx, name)
            if name == "accuracy":
                section.sample = _joined(section.sample, f"the evaluation: {sampled}")
        except NotEnoughData as why:  # too little data to conclude anything: say so, draw nothing
            section, state = Section(STAGE_TITLES[name], findings=[str(why)]), "not enough data"
        except OverBudget as why:  # not even the minimum fits: say so rather than overrun
            section, state = Section(STAGE_TITLES[name], findings=[str(why)]), "skipped (over budget)"
        except ArithInterpError as why:  # the stage does not apply to this model: say so, keep the rest
            section, state = Section(STAGE_TITLES[name], findings=[f"Not run on this model: {why}"]), "not run"
            if stages is not None:  # asked for by name: say so here too, not only in the page
                warnings.warn(f"report stage {name!r} not run: {why}", stacklevel=2)
        except KeyboardInterrupt:
            page.set(name, f"interrupted after {time.perf_counter() - ctx.stage_start:.1f} s")
            raise
        except Exception as error:  # out of memory, a torch error, a bug: record it and go on with the next
            section, state = Section(STAGE_TITLES[name], findings=[f"Failed: {_reason(error)}"]), "failed"
            warnings.warn(f"report stage {name!r} failed: {_reason(error)}", stacklevel=2)
            gc.collect()  # what the failed stage held is garbage now; free it before the next one
        section.seconds = time.perf_counter() - ctx.stage_start
        if not correct_only:  # the minimums count correct prompts; here every evaluated prompt is used
            section.sample = section.sample.replace("correctly answered prompts", "prompts, answered correctly or not")
            section.findings = [f.replace("correctly answered prompts", "prompts") for f in section.findings]
        page.add(name, section, f"{state}: {section.seconds:.1f} s of its {_secs(seconds)} budget"
                 + (f"; {section.sample}" if state == "done" and section.sample else ""))
    return page.write()


def _reason(error: BaseException) -> str:
    """``"MemoryError: ..."``: the exception's type and message, on one line."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
