"""The patching stage: exact patching of the residual stream, heads and MLP outputs, and
attribution patching against it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from arithinterp.report.budget import MARGIN, PILOT, OverBudget
from arithinterp.report.stage import Section, Stage, joined, require, require_pairs

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


def patching_stage(ctx: Context) -> Section:
    """Patching sweeps over every layer, at the positions from the first one where the pairs differ
    (a few-shot prefix shared by clean and corrupted prompts cannot change anything: those cells
    are the corrupted run exactly); when not even the minimum of pairs fits the budget that way,
    the named positions (the operands' tokens and the final one) at as many evenly spread layers
    as fit (:meth:`Context.fit_layers`), and the sample says so.

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    from arithinterp import patching

    pairs, _ = require_pairs(ctx, "patching")
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
    # and per call about one prompt evaluation per cell, whatever the pairs (each cell's resumed run steps
    # through the later blocks once; Gemma 3 270M: 318 evaluations for 288 cells, then 55 per pair)
    per_call = 1.1 * cfg.n_layers * (cfg.n_heads + 2 * swept)
    minimum = MINIMUM[0]
    # the whole sweep's two pilots (three calls' cost, PILOT and PILOT // 2 pairs), then its minimum
    guess = (3 * per_call + (PILOT + PILOT // 2 + minimum) * prior) * ctx.budget.forward_seconds
    try:
        if guess > MARGIN * ctx.seconds_left():  # the pilots would spend what fewer layers can use
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
    fitted = joined(fitted, span)
    section = Section(STAGE.title, sample=joined(require("patching", len(pairs)), fitted))
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


STAGE = Stage(name="patching", title="Activation patching", order=20, weight=2.5, minimum=MINIMUM,
              run=patching_stage)
