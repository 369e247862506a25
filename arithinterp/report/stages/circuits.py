"""The circuits stage: EAP-IG scores for every edge of the model's graph, and the smallest top-k
circuit that restores 0.9 of the logit difference (the faithfulness curve)."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from arithinterp.errors import AnalysisError
from arithinterp.report.budget import MARGIN, OverBudget, cost_text, pilot_cost, secs, seeded_pick
from arithinterp.report.stage import Section, Stage, joined, require, require_pairs
from arithinterp.sites import spread

if TYPE_CHECKING:
    from arithinterp.report.budget import Context

MINIMUM = (30, "counterfactual pairs")


def circuits_stage(ctx: Context) -> Section:
    """EAP-IG scores for every edge of the model's graph and the faithfulness curve of the top-k
    circuits, on as many pairs as the budget holds.

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    import torch

    from arithinterp import circuits
    from arithinterp.engine.edges import sender_outputs

    # whether edges apply to this architecture, before whether there are pairs enough: a model whose
    # stream is no sum of its parts is "not run", whatever the data (one prompt's senders, a forward)
    sender_outputs(ctx.model, ctx.all_prompts.unpadded(torch.arange(1)))
    pairs, _ = require_pairs(ctx, "circuits")
    memory = ctx.budget.memory(ctx.model)  # EAP-IG's batches and the curve's stacked edge sets fit the stage's memory

    def pilot(some):
        scored = circuits.score_edges(ctx.model, some, "eap-ig", ig_steps=STEPS, max_memory=memory, progress=False)
        with contextlib.suppress(AnalysisError):  # a pilot's pairs may not differ; the timing is what counts
            circuits.faithfulness_curve(ctx.model, some, scored, max_memory=memory)

    cfg = ctx.model.cfg  # EAP-IG's 2 + 2·steps passes and a stacked forward per curve size, 5× (measured)
    edges = (1 + cfg.n_layers * (cfg.n_heads + 1)) * (cfg.n_layers * (3 * cfg.n_heads + 1) + 1) // 2
    curve_pairs, sizes, steps = None, None, STEPS
    prior = 5 * (2 + 2 * STEPS + edges.bit_length() + 2)
    try:
        if prior * ctx.budget.forward_seconds * MINIMUM[0] > ctx.seconds_left():
            # a pilot of the whole curve would itself take much of the time: time its parts instead
            raise OverBudget("the whole curve does not fit")
        fitted_pairs, fitted = ctx.fit(pairs, "pairs", MINIMUM[0], pilot=pilot, prior=prior)
        if len(fitted_pairs) < len(pairs):
            # a sample: the whole curve, extrapolated from a pilot on a few pairs, decides it; plan EAP-IG
            # and the curve by their parts instead, the curve re-planned from EAP-IG's measured cost below
            raise OverBudget("the whole curve does not fit every pair")
        pairs = fitted_pairs
    except OverBudget:  # every edge scored on the minimum of pairs, fewer steps; the curve at fewer sizes and pairs
        pairs, curve_pairs, sizes, steps, fitted = _fit_curve(ctx, pairs, memory)
    start = time.perf_counter()
    scored = circuits.score_edges(ctx.model, pairs, "eap-ig", ig_steps=steps, max_memory=memory, progress=False)
    if curve_pairs is not None and sizes is not None:
        # the curve's sizes again, at EAP-IG's cost per pass measured on every pair: the pilots' one or two
        # pairs can under-state it (222 s of 203 s before). A pair's run of an edge set cost 1.09 passes on
        # the 135M shape at 5 sizes and more with the larger sets of a longer curve, so 1.5
        per_run = 1.5 * (time.perf_counter() - start) / (len(pairs) * (2 + 2 * steps))
        room = int(max(ctx.seconds_left(), 0.0) * MARGIN / (per_run * len(curve_pairs))) - 2
        if room < len(sizes):
            sizes = [sizes[i] for i in spread(len(sizes), max(room, min(CURVE_SIZES, len(sizes))))]
        fitted += f"; {_curve_phrase(len(curve_pairs), sizes, scored.n_edges)}"
    section = Section(STAGE.title, sample=joined(require("circuits", len(pairs)), fitted))
    curve = circuits.faithfulness_curve(ctx.model, pairs if curve_pairs is None else curve_pairs, scored, sizes,
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
    section.figures.append(curve.plot())
    section.views.append(circuit.show())
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

    minimum, n = MINIMUM[0], len(pairs)
    chosen = pairs[seeded_pick(n, minimum, ctx.seed)] if n > minimum else pairs
    k = min(2, len(chosen))
    kept: list[Any] = []

    def score(some):
        kept.append(circuits.score_edges(ctx.model, some, "eap-ig", ig_steps=1, max_memory=memory, progress=False))

    score_fixed, per_pass = pilot_cost(score, chosen, k)
    per_pass /= 4  # EAP-IG's passes per pair: 2 + 2·steps
    n_edges = kept[0].n_edges

    def curve(some):
        with contextlib.suppress(AnalysisError):  # the pilot's pairs may not differ; the timing is what counts
            circuits.faithfulness_curve(ctx.model, some, kept[0], [0, n_edges], max_memory=memory)

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
            f"({cost_text(score_fixed, 4 * per_pass)}) and a faithfulness curve of {CURVE_SIZES} sizes on "
            f"{CURVE_PAIRS} of them ({cost_text(curve_fixed, per_size, 'per pair and size')}) would take about "
            f"{secs(least)}, more than the {secs(max(ctx.seconds_left(), 0.0))} left of this stage's "
            f"{secs(ctx.budget.seconds)} budget; give the report more time (budget=, --budget SECONDS).")
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
    sentence = f"sampled {len(chosen):,} of {n:,} pairs{fewer} to fit the {secs(ctx.budget.seconds)} budget"
    return chosen, curve_pairs, sizes, steps, sentence


def _curve_phrase(n_pairs: int, sizes: list[int], n_edges: int) -> str:
    from arithinterp.circuits import curve_sizes

    return (f"the faithfulness curve on {n_pairs} of them at {len(sizes)} of {len(curve_sizes(n_edges))} sizes "
            f"({', '.join(f'{k:,}' for k in sizes)} edges), its intervals over those pairs")


def _top_edges(circuit, k: int):
    order = circuit.scores.abs().argsort(descending=True)[:k].tolist()
    return [circuit.edges[i] for i in order], [circuit.scores[i] for i in order]


STAGE = Stage(name="circuits", title="Circuit: edges from the operands to the answer", order=80, weight=3.5,
              minimum=MINIMUM, run=circuits_stage)
