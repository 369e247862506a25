"""The probes stage: linear probes per target over layers, against chance, shuffled labels and a
random-init model of the same architecture."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from arithinterp.errors import AnalysisError
from arithinterp.report.budget import MARGIN, secs, seeded_pick
from arithinterp.report.stage import Section, Stage, joined, require
from arithinterp.sites import coarse_to_fine
from arithinterp.tasks.places import PLACES

if TYPE_CHECKING:
    from arithinterp.report.budget import Context

# a 3-fold probe on 60 prompts is tested on 20 per fold
MINIMUM = (60, "correctly answered prompts")
PROBE_LAYERS = 4  # the fewest layers the probes stage covers before it samples fewer prompts instead


def _probe_targets(prompts: Any) -> tuple[str, ...]:
    """Whole numbers where each is one token; where numbers are spelled out digit by digit, a's
    units digit, the carry into the tens, and the answer's leading digit (the first token the
    model writes) and units digit (written last: read at the prompt's end, it is computed ahead)."""
    if prompts.single_token_operands:
        return ("a", "answer_units", "answer")
    varying = [place for place in PLACES[1:4] if f"answer_{place}" in prompts.label_names()
               and len(prompts.label(f"answer_{place}").unique()) > 1]
    return ("a_units", "carry_tens") + ((f"answer_{varying[-1]}",) if varying else ()) + ("answer_units",)


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
    :data:`PROBE_LAYERS` layers fit with all of them.

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import probes
    from arithinterp.activations import collect

    prompts = ctx.prompts[: ctx.n_probe_prompts]
    require("probes", len(prompts))
    where: dict[str, Any] = dict(sites="resid_post", positions=["a", "b", "final"], progress=False)
    acts = collect(ctx.model, prompts, **where)
    control = collect(ctx.control_model(), prompts, **where)
    targets = _probe_targets(prompts)
    # five folds when there are prompts enough: a fold-mean's t interval with 2 degrees of freedom is 1.5 times as wide
    probe: dict[str, Any] = dict(kind="logistic", cv=5 if len(prompts) >= 100 else 3, seed=ctx.seed,
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
        keep = max(MINIMUM[0], int(len(prompts) * (left + took) / (least * took)))
        if keep < len(prompts):
            pick = seeded_pick(len(prompts), keep, ctx.seed)
            sampled = f"sampled {keep} of {len(prompts)} prompts to fit the {secs(ctx.budget.seconds)} budget"
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
        f"{secs(ctx.budget.seconds)} budget")
    section = Section(STAGE.title, sample=joined(require("probes", len(prompts)), sampled, fitted))
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


STAGE = Stage(name="probes", title="Linear probes", order=40, weight=1.5, minimum=MINIMUM, run=probes_stage)
