"""The features stage: the transcoders shipped for a zoo model, the replacement model on the
report's prompts, and the attribution graph of one correctly answered prompt."""

from __future__ import annotations

from typing import TYPE_CHECKING

from arithinterp.errors import ModelSpecError, accepted
from arithinterp.report.stage import Section, Stage, joined, require

if TYPE_CHECKING:
    from arithinterp.report.budget import Context


def features_stage(ctx: Context) -> Section:
    """The transcoders shipped for a zoo model: their card, the replacement model on the report's
    prompts, and the attribution graph of one correctly answered prompt. Other models: not run, with
    the reason (no transcoders ship for them; ``arithinterp.features.train_transcoders`` makes some).

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp.features import attribution_graph, load_transcoders, replacement_metrics

    from arithinterp.features.shipped import RECIPES

    if not ctx.spec.startswith("zoo:"):  # the report shows the reason as "not run on this model"
        raise ModelSpecError(f"transcoders ship only for the zoo models {accepted(['zoo:' + n for n in RECIPES])}, "
                             f"not for {ctx.spec!r}; train some with arithinterp.features.train_transcoders")
    transcoders = load_transcoders(ctx.spec)  # a zoo model without them: ModelSpecError, which says so
    transcoders.check_model(ctx.model)
    require("features", 0 if ctx.prompts is None else len(ctx.prompts), "the graph of a correctly answered prompt")
    correct = ctx.prompts
    assert correct is not None  # require() counted them
    prompt = correct.texts[0]
    graph = attribution_graph(ctx.model, correct[:1], transcoders, progress=False)  # the first correctly answered
    prompts, fitted = ctx.fit(ctx.all_prompts, "prompts", 30, per_item=2 * ctx.budget.forward_seconds)
    measured = replacement_metrics(ctx.model, prompts, transcoders).as_dict()
    section = Section(STAGE.title,
                      sample=joined(f"{len(prompts):,} of the task's prompts for the replacement model", fitted))
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
    section.figures.append(transcoders.plot())
    section.views.append(graph.show(grids=_operand_plots(ctx, transcoders, graph)))
    return section


GRID_SIDE = 50  # operand values per axis of the graph's operand plots: 2,500 prompts a layer


def _operand_plots(ctx: Context, transcoders, graph) -> list:
    """The kept features' operand plots over an evenly spaced grid of the task, for the graph's
    page; none where the task's answers are several tokens or its prompts of several lengths."""
    from arithinterp.features import graph_feature_grids
    from arithinterp.models.zoo import grid_prompts

    grid = grid_prompts(ctx.model, ctx.spec, GRID_SIDE)
    if bool((grid.n_answer_tokens != 1).any()) or not grid.uniform_length:
        return []
    return graph_feature_grids(ctx.model, grid, transcoders, graph)


STAGE = Stage(name="features", title="Feature circuits: transcoders and an attribution graph", order=90, weight=0.5,
              minimum=(1, "correctly answered prompt"), run=features_stage)
