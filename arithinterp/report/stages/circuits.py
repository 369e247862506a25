"""The circuits stage: EAP-IG scores for every edge of the model's graph, and the smallest top-k
circuit that restores 0.9 of the logit difference (the faithfulness curve)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from arithinterp.report.budget import OverBudget, StagePlan, over_budget, secs
from arithinterp.report.stage import Section, Stage, joined, require, require_pairs
from arithinterp.report.work import BACKWARD, work_seconds
from arithinterp.sites import spread

if TYPE_CHECKING:
    from arithinterp.report.budget import Context

MINIMUM = (30, "counterfactual pairs")


STEPS = 5  # EAP-IG's integration steps (Hanna et al. 2024), when they fit the budget
CURVE_PAIRS = 10  # the fewest pairs a sampled faithfulness curve rests on (its intervals say how sure it is)
CURVE_SIZES = 4  # the fewest sizes a sampled curve measures (no edge, every edge and two between)


def circuits_plan(ctx: Context) -> StagePlan:
    """EAP-IG scores for every edge and the whole faithfulness curve on as many pairs as the share
    holds; when not even the minimum of pairs fits that way, EAP-IG on the minimum of pairs with as
    many of its :data:`STEPS` integration steps as fit, and the curve at as many of its sizes
    (evenly spread, at least :data:`CURVE_SIZES`: no edge, every edge and some between) on as many
    of those pairs (at least :data:`CURVE_PAIRS`) as the rest holds.

    The cost, in token-layers per pair: EAP-IG's ``2 + 2·steps`` passes, each a forward and a
    backward of the whole model; the curve's clean and corrupted runs and one patched forward
    per size.

    Args:
        ctx: The report's shared state; ``ctx.budget`` is the stage's share.

    Returns:
        The plan: ``pairs``, ``steps``, ``curve_pairs``, ``sizes`` (None: the default sizes).

    Raises:
        AnalysisError: The model's residual stream is no sum of its parts (edges do not apply).
    """
    import torch

    from arithinterp import circuits
    from arithinterp.engine.edges import sender_outputs
    from arithinterp.report.evaluation import prompt_positions

    # whether edges apply to this architecture, before whether there are pairs enough: a model whose
    # stream is no sum of its parts is "not run", whatever the data (one prompt's senders, a forward)
    sender_outputs(ctx.model, ctx.all_prompts.unpadded(torch.arange(1)))
    pairs, _ = require_pairs(ctx, "circuits")
    shape = ctx.shape
    n_edges = circuits.EdgeGraph.of(ctx.model).n_edges
    default = circuits.curve_sizes(n_edges)
    shared = prompt_positions(pairs.clean)
    # EAP-IG's passes share less of a few-shot prefix than a plain forward does (its gradients reach every position)
    passed = (shared + int(pairs.clean.tokens.shape[1])) / 2 * shape.n_layers

    def cost(count: int, steps: int, curve_pairs: int, n_sizes: int) -> float:
        passes = count * (2 + 2 * steps)
        runs = curve_pairs * (n_sizes + 2)
        return work_seconds(shape, token_layers=passes * (1 + BACKWARD) * passed + runs * shared * shape.n_layers,
                            calls=(passes * (1 + BACKWARD) + runs) * shape.n_layers / 16,
                            fit_flops=passes * n_edges * shape.d_model * 2)

    n, minimum = len(pairs), MINIMUM[0]
    try:
        count, seconds, sample = ctx.fit(pairs, "pairs", minimum, lambda k: cost(k, STEPS, k, len(default)))
        return StagePlan(dict(pairs=count, steps=STEPS, curve_pairs=count, sizes=None), seconds, sample)
    except OverBudget:  # every edge on the minimum of pairs with fewer steps, the curve at fewer sizes and pairs
        pass
    count = min(n, minimum)
    curve_least = min(count, CURVE_PAIRS)
    least_sizes = min(CURVE_SIZES, len(default))
    if cost(count, 1, curve_least, least_sizes) > ctx.budget.seconds:
        raise over_budget(ctx.budget, f"EAP-IG at one step on the minimum of {count} pairs and a faithfulness curve of "
                                      f"{least_sizes} sizes on {curve_least} of them",
                          cost(count, 1, curve_least, least_sizes))
    fits = lambda steps, k, m: cost(count, steps, k, m) <= ctx.budget.seconds  # noqa: E731
    # the scores first (up to the default steps), then the curve's sizes (where a circuit is located), then its pairs
    steps = max(s for s in range(1, STEPS + 1) if fits(s, curve_least, least_sizes))
    n_sizes = max(m for m in range(least_sizes, len(default) + 1) if fits(steps, curve_least, m))
    curve_pairs = max(k for k in range(curve_least, count + 1) if fits(steps, k, n_sizes))
    sizes = [default[i] for i in spread(len(default), n_sizes)]
    fewer = "" if steps == STEPS else f" with {steps} of EAP-IG's {STEPS} default integration steps"
    sample = f"{ctx.sampled(count, n, 'pairs', share=False)}{fewer} to fit its {secs(ctx.budget.seconds)} share"
    return StagePlan(dict(pairs=count, steps=steps, curve_pairs=curve_pairs,
                          sizes=None if n_sizes == len(default) else sizes),
                     cost(count, steps, curve_pairs, n_sizes), sample)


def circuits_stage(ctx: Context) -> Section:
    """EAP-IG scores for every edge of the model's graph and the faithfulness curve of the top-k
    circuits, on the pairs, steps and sizes of the stage's plan (:func:`circuits_plan`). Where the
    curve was measured at fewer sizes than the default, the finding bounds the circuit between
    the measured sizes, and says the curve is too coarse to locate it when no measured size below
    every edge restores the target.

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, plan, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import circuits

    plan = ctx.plan_of(STAGE)
    pairs, _ = require_pairs(ctx, "circuits")
    pairs = ctx.pick(pairs, plan.choices["pairs"])
    steps, sizes = plan.choices["steps"], plan.choices["sizes"]
    curve_pairs = pairs[: plan.choices["curve_pairs"]]
    memory = ctx.budget.memory(ctx.model)  # EAP-IG's batches and the curve's stacked edge sets fit the stage's memory
    scored = circuits.score_edges(ctx.model, pairs, "eap-ig", ig_steps=steps, max_memory=memory, progress=False)
    sample = plan.sample
    if sizes is not None or len(curve_pairs) < len(pairs):
        sample = joined(sample, _curve_phrase(len(curve_pairs), sizes or circuits.curve_sizes(scored.n_edges),
                                              scored.n_edges))
    section = Section(STAGE.title, sample=joined(require("circuits", len(pairs)), sample))
    curve = circuits.faithfulness_curve(ctx.model, curve_pairs, scored, sizes, max_memory=memory)
    if not curve.reported:  # every edge and no edge are not distinguishable: nothing to restore a fraction of
        section.findings.append(f"No signal above the control: on {len(curve_pairs)} pairs, {curve.note}.")
        section.figures.append(curve.plot())
        return section
    measured = [int(k) for k in curve.sizes.tolist()]
    smallest = curve.smallest(0.9)
    low, high = curve.smallest_interval(0.9)
    scoring = (f"EAP-IG (Hanna et al. 2024, {steps} step{'s' if steps > 1 else ''}) scores all {scored.n_edges} edges "
               "of the graph (embeddings, each head's query, key and value input, MLPs, logits) on "
               f"{len(pairs)} pairs whose first operand differs. ")
    coarse = sizes is not None  # the curve skipped some of the default sizes
    if smallest is not None and coarse and smallest == scored.n_edges:
        restored = ", ".join(f"{k:,} edges {float(v):.2f}" for k, v in zip(measured, curve.faithfulness.tolist()))
        section.findings.append(
            f"{scoring}The faithfulness curve, measured at {len(measured)} sizes ({restored}), is too coarse to "
            "locate a circuit: no measured size below every edge restores 0.9 of the answer's logit difference, and "
            "the sizes between were not measured; give the report more time (--budget) for the whole curve.")
        section.figures.append(curve.plot())
        return section
    interval = (f" (95% bootstrap interval over pairs: {low} to {high} edges)" if high is not None else
                " (the 95% bootstrap interval's lower bound does not stay above 0.9 at any size, so no size is sure)")
    if smallest is None:
        found = ("No top-k subset of the edges restores 0.9 of the answer's logit difference with every larger "
                 "subset measured doing so too.")
    elif coarse:
        below = measured[measured.index(smallest) - 1]
        found = (f"The {smallest:,} top edges ({100 * smallest / scored.n_edges:.1f}% of all) restore 0.9 of the "
                 f"answer's logit difference, and every larger top-k set measured does too, with every other edge "
                 f"resampled from the corrupted prompt{interval}; the curve was measured at {len(measured)} sizes, so "
                 f"the smallest such circuit has more than {below:,} and at most {smallest:,} edges.")
    else:
        found = (f"The {smallest} top edges ({100 * smallest / scored.n_edges:.1f}% of all) restore 0.9 of the "
                 "answer's logit difference, and every larger top-k set measured does too, with every other edge "
                 f"resampled from the corrupted prompt{interval}.")
    section.findings.append(scoring + found)
    circuit = circuits.top_n(scored, smallest if smallest is not None else scored.n_edges)
    top = ", ".join(f"{e} ({float(v):.2f})" for e, v in zip(*_top_edges(circuit, 5)))
    section.findings.append(f"Largest edges (estimated logit-difference change): {top}.")
    section.figures.append(curve.plot())
    section.views.append(circuit.show())
    return section


def _curve_phrase(n_pairs: int, sizes: list[int], n_edges: int) -> str:
    from arithinterp.circuits import curve_sizes

    return (f"the faithfulness curve on {n_pairs} of them at {len(sizes)} of {len(curve_sizes(n_edges))} sizes "
            f"({', '.join(f'{k:,}' for k in sizes)} edges), its intervals over those pairs")


def _top_edges(circuit, k: int):
    order = circuit.scores.abs().argsort(descending=True)[:k].tolist()
    return [circuit.edges[i] for i in order], [circuit.scores[i] for i in order]


STAGE = Stage(name="circuits", title="Circuit: edges from the operands to the answer", order=80, weight=2.5,
              minimum=MINIMUM, run=circuits_stage, plan=circuits_plan)
