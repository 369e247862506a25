"""The patching stage: exact patching of the residual stream, heads and MLP outputs, and
attribution patching against it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Sequence

from arithinterp.report.budget import OverBudget, StagePlan
from arithinterp.report.stage import Section, Stage, joined, require, require_pairs
from arithinterp.report.work import BACKWARD, work_seconds
from arithinterp.sites import spread

if TYPE_CHECKING:
    from arithinterp.report.budget import Context

# A mean over 30 pairs has a standard error under a fifth of the spread between pairs
MINIMUM = (30, "counterfactual pairs")


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
    approx = patching.attribute_sites(ctx.model, pairs, ["resid_pre", "mlp_out"], normalize=True,
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


def arrival_layers(resid, n_layers: int) -> list[int]:
    """The blocks in which the varied operand reaches the final position: after the last layer whose
    residual stream there restores under half of the answer and before the first that restores half
    or more (``resid_pre`` at layer L holds what the blocks before L wrote). Empty unless that
    locates it: no layer restores half, or the layers patched leave more than a quarter of the
    model's blocks in between.

    Args:
        resid: A normalised ``resid_pre`` patching result over layers and positions.
        n_layers: The model's layers.

    Returns:
        The block indices, ascending.
    """
    positions = [str(p) for p in resid.positions]
    column = positions.index("final") if "final" in positions else len(positions) - 1  # else ascending indices
    layers = list(resid.layers)
    for i, layer in enumerate(layers):
        if float(resid.mean[i, column]) >= 0.5:
            blocks = list(range(layers[i - 1] if i else 0, layer))
            return blocks if len(blocks) <= max(1, n_layers // 4) else []
    return []


def _named_positions(clean) -> list[str]:
    """The operands' tokens and the final one (each operand's first and last token where it has several)."""
    return [k for k in clean.positions if "[" not in k or k.endswith("[0]")]


def patching_plan(ctx: Context) -> StagePlan:
    """Every layer at the positions from the first one where the pairs differ (a few-shot prefix
    shared by clean and corrupted prompts cannot change anything: those cells are the corrupted
    run exactly) on as many pairs as the share holds; when not even the minimum of pairs fits
    that way, the named positions (the operands' tokens and the final one) at as many evenly
    spread layers as fit.

    The cost, in token-layers per pair: a cell patched at layer ``l`` and position ``p`` resumes
    there and runs the blocks from ``l`` on the positions from ``p`` ((L − l)(T − p)), for the
    residual stream and the MLP outputs at each position and for each head at every position
    from the first that differs; and each sweep's clean and corrupted base runs, and attribution
    patching's forwards and backward.

    Args:
        ctx: The report's shared state; ``ctx.budget`` is the stage's share.

    Returns:
        The plan: ``pairs`` (how many), ``layers`` (None: all), ``positions`` (None: all).
    """
    from arithinterp.report.evaluation import prompt_positions

    pairs, _ = require_pairs(ctx, "patching")
    shape = ctx.shape
    n_layers, clean = shape.n_layers, pairs.clean
    width = int(clean.tokens.shape[1])
    first = _changing_span(pairs)
    span: Optional[list[Any]] = list(range(first, width)) if first is not None else None
    span_index = span if span is not None else list(range(width)) if clean.uniform_length else None
    named = _named_positions(clean)
    named_index = clean.locate(named)[1].float().mean(0).tolist()
    # each sweep's clean and corrupted base runs, and attribution patching's two forwards and backward per site
    base = prompt_positions(clean) * n_layers * (8 + BACKWARD)

    def cost(count: int, layers: Sequence[int], index: Sequence[float]) -> float:
        steps = sum(n_layers - layer for layer in layers)
        tail = sum(width - p for p in index)
        cells = steps * (2 * tail + shape.n_heads * (width - min(index)))
        return work_seconds(shape, token_layers=count * (cells + base), calls=3 * steps * math.ceil(count / 32))

    minimum = MINIMUM[0]
    try:
        count, seconds, sample = ctx.fit(pairs, "pairs", minimum,
                                         lambda k: cost(k, range(n_layers), span_index or named_index))
        return StagePlan(dict(pairs=count, layers=None, positions=span), seconds, sample)
    except OverBudget:  # fewer cells instead of no section: the named positions, a sample of the layers
        count, layers, seconds, sample = ctx.fit_layers(
            pairs, "pairs", minimum, n_layers, lambda k, m: cost(k, spread(n_layers, m), named_index))
        return StagePlan(dict(pairs=count, layers=layers, positions=named),
                         seconds, f"{sample}; positions {', '.join(named)} only")


def patching_stage(ctx: Context) -> Section:
    """Patching sweeps at the layers and positions of the stage's plan (:func:`patching_plan`).

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, plan, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import patching

    plan = ctx.plan_of(STAGE)
    pairs, _ = require_pairs(ctx, "patching")
    pairs = ctx.pick(pairs, plan.choices["pairs"])
    cfg, width = ctx.model.cfg, int(pairs.clean.tokens.shape[1])
    layers, positions = plan.choices["layers"], plan.choices["positions"]
    span = ""
    if positions and isinstance(positions[0], int):
        span = (f"positions {positions[0]} to {width - 1}, from the first token where the pairs differ (a patch in "
                f"the {positions[0]} tokens before, which clean and corrupted prompts share, is the corrupted run "
                "exactly)")
    section = Section(STAGE.title, sample=joined(require("patching", len(pairs)), plan.sample, span))
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
    ctx.arrival_layers = arrival_layers(resid, cfg.n_layers)
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


STAGE = Stage(name="patching", title="Activation patching", order=20, weight=3.0, minimum=MINIMUM,
              run=patching_stage, plan=patching_plan)
