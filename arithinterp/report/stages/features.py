"""The feature-circuit stage: the model's transcoders (shipped for a zoo model, or cached by
``arithinterp train-transcoders``), the replacement model on the report's prompts, and the
attribution graph of one correctly answered prompt read at the level of labelled supernodes, with
the swap test that checks the labels by intervention."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from arithinterp.errors import AnalysisError, ModelSpecError
from arithinterp.report.budget import StagePlan
from arithinterp.report.stage import Section, Stage, joined, require
from arithinterp.report.work import BACKWARD, work_seconds

if TYPE_CHECKING:
    from arithinterp.report.budget import Context
    from arithinterp.features import Transcoders

SWAP_PROMPTS = 20  # problems the swap test runs on, each with SWAP_DRAWS random controls
SWAP_DRAWS = 5


def _transcoders(ctx: Context) -> Transcoders:
    """The model's transcoders (shipped or cached); :class:`ModelSpecError`, shown as "not run on
    this model" with the command that makes them, when there are none."""
    from arithinterp.features.cache import cache_folder, find_transcoders

    transcoders = find_transcoders(ctx.model)
    if transcoders is None:
        raise ModelSpecError(f"no transcoders ship or are cached for {ctx.spec}; `arithinterp train-transcoders "
                             f"{ctx.spec}` makes them (into {cache_folder(ctx.model)}, where the report finds them)")
    return transcoders


def features_plan(ctx: Context) -> StagePlan:
    """The attribution graph of one prompt, its transcoders' operand plots (read over their grid at
    every layer unless they are cached beside the transcoders) and the swap test whatever the share,
    and the replacement model on as many of the task's prompts as the rest holds (at least 30): two
    forwards of each, the model's and the replacement's.

    Args:
        ctx: The report's shared state; ``ctx.budget`` is the stage's share.

    Returns:
        The plan: ``prompts`` (for the replacement model).

    Raises:
        ModelSpecError: The model has no transcoders: the stage does not apply.
    """
    from arithinterp.features.cache import find_operand_plots
    from arithinterp.features.plan import plan_grid, plan_transcoders
    from arithinterp.features.transcoder import transcoders_digest
    from arithinterp.report.evaluation import prompt_positions

    transcoders = _transcoders(ctx)
    require("features", 0 if ctx.prompts is None else len(ctx.prompts), "the graph of a correctly answered prompt")
    shape = ctx.shape
    forward = prompt_positions(ctx.all_prompts) * shape.n_layers
    fixed = work_seconds(shape, token_layers=forward * (1 + BACKWARD) * shape.d_mlp / 8, fit_steps=50)
    runs = SWAP_PROMPTS * (2 + SWAP_DRAWS)  # the swap test: a read, the swap and its controls per problem
    fixed += work_seconds(shape, token_layers=runs * forward, unembeds=runs, calls=runs * shape.n_layers)
    cached = find_operand_plots(ctx.model)
    if cached is None or cached.meta.get("transcoders") != transcoders_digest(transcoders):
        grid = plan_grid(ctx.model, plan_transcoders(ctx.model))
        fixed += work_seconds(shape, token_layers=len(grid) * prompt_positions(grid) * shape.n_layers,
                              calls=shape.n_layers * math.ceil(len(grid) / 64))
    count, seconds, sample = ctx.fit(ctx.all_prompts, "prompts", 30, lambda k: fixed + work_seconds(
        shape, token_layers=2 * k * forward, unembeds=2 * k, calls=4 * shape.n_layers * math.ceil(k / 64)))
    return StagePlan(dict(prompts=count), seconds, sample)


def features_stage(ctx: Context) -> Section:
    """The model's transcoders: their held-out numbers, the replacement model on the report's prompts,
    the attribution graph of the first correctly answered prompt (what feeds its answer logit, its
    features grouped into labelled supernodes, drawn in the interactive viewer) and the swap test.
    A model without transcoders: not run, with the command that makes them.

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, plan, seed.

    Returns:
        The stage's section: findings, figures, the graph's view and the sample it used.
    """
    from arithinterp.features import attribution_graph, replacement_metrics
    from arithinterp.features.operand_plots import graph_feature_grids
    from arithinterp.features.plan import transcoder_plots
    from arithinterp.features.shipped import shipped_names
    from arithinterp.features.supernodes import label_graph, labelled_share, supernodes

    transcoders = _transcoders(ctx)
    require("features", 0 if ctx.prompts is None else len(ctx.prompts), "the graph of a correctly answered prompt")
    correct = ctx.prompts
    assert correct is not None  # require() counted them
    prompt = correct[:1]
    graph = attribution_graph(ctx.model, prompt, transcoders, progress=False)  # the first correctly answered
    plots = transcoder_plots(ctx.model, transcoders, progress=False)
    labels = label_graph(graph, plots, prompt)
    groups = supernodes(graph, labels, prompt, plots)
    plan = ctx.plan_of(STAGE)
    prompts = ctx.pick(ctx.all_prompts, plan.choices["prompts"])
    measured = replacement_metrics(ctx.model, prompts, transcoders, progress=False).as_dict()
    section = Section(STAGE.title,
                      sample=joined(f"{len(prompts):,} of the task's prompts for the replacement model", plan.sample))
    held = transcoders.metrics.get("replacement", {})
    origin = "shipped" if ctx.spec.removeprefix("zoo:") in shipped_names() else "cached"
    section.findings.append(
        f"Transcoders ({origin}; {transcoders.n_features} TopK features per layer, k={transcoders.k}"
        f"{'' if any(transcoders.skipped) else ', no skip'}): on their held-out prompts the replacement model "
        f"(every MLP replaced, no error term) keeps the model's top token at {held.get('agreement', float('nan')):.3f} "
        f"of {held.get('n_positions', 0):,} answer positions (KL {held.get('kl', float('nan')):.3f} nats); on "
        f"{measured['n_positions']:,} answer positions of the report's prompts at {measured['agreement']:.3f} "
        f"(KL {measured['kl']:.3f}).")
    s = graph.scores
    section.findings.append(
        f"Attribution graph of {correct.texts[0]!r} (Ameisen et al. 2025): the answer logit's direct inputs come "
        f"{s['logit_inputs_feature']:.0%} from features, {s['logit_inputs_embedding']:.0%} from token embeddings "
        f"and {s['logit_inputs_error']:.0%} from error nodes; the pruned graph keeps {s['n_kept']} nodes holding "
        f"{s['kept_influence']:.2f} of the influence on the answer (replacement score {s['replacement']:.3f}, "
        f"completeness {s['completeness']:.3f}).")
    named = [group for group in groups if group.label][:4]
    listed = ": " + "; ".join(f"{g.name} ({len(g.members)} features)" for g in named) if named else (
        "; no feature got a label above its null")
    section.findings.append(
        f"Supernodes (features grouped by the label of their operand plot, then by attribution profile): labelled "
        f"ones hold {labelled_share(groups):.0%} of the kept features' influence "
        f"({labelled_share(groups, direct=True):.0%} by features labelled themselves){listed}.")
    section.findings.append(_swap_finding(ctx, transcoders, plots))
    section.figures.append(transcoders.plot())
    view_groups = [dict(name=g.name, members=[(graph.nodes[i]["layer"], graph.nodes[i]["feature"],
                                               graph.nodes[i]["position"]) for i in g.members])
                   for g in groups if len(g.members) > 1]
    section.views.append(graph.show(grids=graph_feature_grids(graph, plots, prompt), supernodes=view_groups))
    return section


def _swap_finding(ctx: Context, transcoders: Any, plots: Any) -> str:
    """The swap test on the report's prompts, in a sentence (or why it does not apply)."""
    from arithinterp.features.steering import swap_test

    assert ctx.prompts is not None  # the stage required them
    sample = ctx.prompts[:SWAP_PROMPTS]
    try:
        result = swap_test(ctx.model, sample, transcoders, plots, role="final", n_random=SWAP_DRAWS, seed=ctx.seed,
                           progress=False)
    except AnalysisError as why:
        return f"Swap test (Lindsey et al. 2025's validation of supernodes): does not apply here: {why}."
    tested = int(result.meta["n_tested"])
    verdict = ("the labels predict the answer's change" if result.as_predicted > result.as_predicted_control + 0.1
               else "no signal above the control")
    return (f"Swap test on {tested} problems (each answer's labelled supernode zeroed and another token's set to its "
            f"typical activity): the answer became the swapped-in token in {result.as_predicted:.0%} of them, against "
            f"{result.as_predicted_control:.0%} for the same number of random features ({SWAP_DRAWS} draws each): "
            f"{verdict}.")


STAGE = Stage(name="features", title="Feature circuits: transcoders, an attribution graph and labelled supernodes",
              order=90, weight=0.5, minimum=(1, "correctly answered prompt"), run=features_stage, plan=features_plan)
