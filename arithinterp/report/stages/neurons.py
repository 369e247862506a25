"""The neurons stage: heuristic neurons of the trained model against a random-init model of the
same architecture."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Optional, cast

from arithinterp.errors import ArithInterpError
from arithinterp.report.budget import MARGIN
from arithinterp.report.stage import Section, Stage, joined, require

if TYPE_CHECKING:
    import pandas as pd

    from arithinterp.report.budget import Context

# neuron heuristics are scored on maps over the (a, b) grid, which 100 prompts cover only sparsely
MINIMUM = (100, "correctly answered prompts")


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
    control's (a neuron of any model that reads digit tokens follows some operand rule).

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
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
        def pilot(some, layers: list[int]):  # the model; its random-init control costs the same (copies=2)
            with contextlib.suppress(ArithInterpError):  # a pilot's prompts may leave no heuristic: timing counts
                classify(some, layers)

        # 16 prompts, not 4: the heuristics are scored on a grid that 4 prompts hardly cover. Shared: the
        # ranking's forward and backward of each pair reach every layer at once and are most of the cost
        # (135M shape, 100 prompts, top 100 neurons: 35 s at every layer, 34 s at the first and last, 28 s at
        # the last alone)
        n_layers = ctx.model.cfg.n_layers
        prompts, fitted_layers, fitted = ctx.fit_layers(prompts, "prompts", MINIMUM[0], n_layers,
                                                        pilot=pilot, pilot_items=16, shared=True, copies=2)
        layers = None if len(fitted_layers) == n_layers else fitted_layers
    section = Section(STAGE.title, sample=joined(require("neurons", len(prompts)), fitted))
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


STAGE = Stage(name="neurons", title="Heuristic neurons", order=70, weight=1.5, minimum=MINIMUM, run=neurons_stage)
