"""The Fourier stage: the spectrum of the number representation and its key periods, mod-T
separability, and a helix fit with its causal patch test."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from arithinterp.errors import ArithInterpError
from arithinterp.report.budget import StagePlan
from arithinterp.report.stage import NotEnoughData, Section, Stage, joined, require, require_pairs
from arithinterp.report.work import work_seconds

if TYPE_CHECKING:
    from arithinterp.report.budget import Context


def _interval(value: float, low: float, high: float, percent: bool = False) -> str:
    if percent:
        return f"{100 * value:.0f}% (95% CI {100 * low:.0f}% to {100 * high:.0f}%)"
    return f"{value:.3g} (95% CI {low:.3g} to {high:.3g})"


def _helix_site(ctx: Context) -> tuple[str, int]:
    """Where the helix is fitted: entering layer 0 for single-token numbers, the middle layer else."""
    return "resid_pre", 0 if ctx.all_prompts.single_token_operands else ctx.model.cfg.n_layers // 2


def fourier_plan(ctx: Context) -> StagePlan:
    """The spectrum, separability and the helix fit whatever the share (they are its fixed cost),
    and the causal helix test on as many pairs as the rest holds (at least the minimum; with fewer
    pairs than that the section says "not enough data" for the helix alone).

    The cost: reading the numbers' representations (the model and its control) and every correct
    prompt's residual stream up to the helix layer; the spectra's shuffled-number controls and the
    separability probes (fit steps); per pair, the helix test's clean run and its six patched
    ones, whole forwards.

    Args:
        ctx: The report's shared state; ``ctx.budget`` is the stage's share.

    Returns:
        The plan: ``pairs`` (0: the helix test has too few).
    """
    from arithinterp.report.evaluation import prompt_positions

    shape = ctx.shape
    _, layer = _helix_site(ctx)
    prompts = ctx.all_prompts
    numbers = int(prompts.a.max()) - int(prompts.a.min()) + 1
    if not prompts.single_token_operands:
        numbers = max(numbers, 100)
    positions = prompt_positions(prompts)
    read = (0 if prompts.single_token_operands else 2 * numbers * positions) + len(ctx.prompts) * positions
    fixed = work_seconds(shape, token_layers=read * (layer + 1), fit_steps=FOURIER_FIT_STEPS,
                         fit_flops=2 * numbers**3 * shape.d_model * SPECTRUM_SHUFFLES)
    if ctx.pairs is None or len(ctx.pairs) < MINIMUM[0]:
        return StagePlan(dict(pairs=0), fixed, "")
    pairs = ctx.pairs[: ctx.n_pairs]
    # whole forwards (the engine shares what it can of a prompt's prefix between the stacked runs)
    width = (float(pairs.clean.tokens.shape[1]) + prompt_positions(pairs.clean)) / 2
    per_pair = work_seconds(shape, token_layers=7 * width * shape.n_layers, unembeds=7,
                            calls=7 * shape.n_layers / 32)
    count, seconds, sample = ctx.fit(pairs, "pairs", MINIMUM[0], lambda k: fixed + per_pair * k)
    return StagePlan(dict(pairs=count), seconds, sample)


MINIMUM = (30, "counterfactual pairs")
# the spectra's and separability's own work (measured with the cost model's calibration): fit steps, and the
# shuffled-number controls' products (a share of numbers cubed times the width)
FOURIER_FIT_STEPS = 2000
SPECTRUM_SHUFFLES = 300.0


def fourier_helix_stage(ctx: Context) -> Section:
    """The spectrum of the number representation and its key periods; next to them, whether
    ``x mod T`` is linearly readable there beyond chance, shuffled numbers and a random-init model
    of the same architecture (Fu et al. 2026); and the helix fit with its causal test, whose
    shares of the layer patch are printed only when the layer patch is distinguishable from zero.
    Single-token numbers are read from the embeddings; numbers of several tokens from the residual
    stream at their last token in a middle layer of the report's own prompts.

    Args:
        ctx: The report's shared state: model, prompts, pairs, evaluation, budget, seed.

    Returns:
        The stage's section: findings, figures and the sample it used.
    """
    import math

    from arithinterp import fourier, helix
    from arithinterp.activations import collect

    plan = ctx.plan_of(STAGE)
    section = Section(STAGE.title)
    axis = range(int(ctx.all_prompts.a.min()), int(ctx.all_prompts.a.max()) + 1)
    control_model = ctx.control_model()
    helix_site, helix_layer = _helix_site(ctx)
    if ctx.all_prompts.single_token_operands:
        spectrum = fourier.embedding_spectrum(ctx.model, axis, seed=ctx.seed)
        rows = fourier.number_representations(ctx.model, axis)["embed"]
        control_rows = fourier.number_representations(control_model, axis)["embed"]
        what = "the number embeddings"
    else:  # several tokens per number: each is read whole at its last token, entering the middle layer
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
        pairs, _ = require_pairs(ctx, "helix", "the causal helix test")
        pairs = ctx.pick(pairs, plan.choices["pairs"])
        section.sample += "; helix: " + joined(require("helix", len(pairs), "the causal helix test"), plan.sample)
    except NotEnoughData as why:
        section.findings.append(f"Helix: {why}")
        return section
    acts = collect(ctx.model, ctx.prompts, sites=helix_site, layers=[helix_layer], positions="a", progress=False)
    try:
        fit = helix.fit(acts, "a", periods=(2, 5, 10, 100), site=helix_site, layer=helix_layer, positions="a")
        test = helix.patch_test(ctx.model, pairs, fit, seed=ctx.seed)
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


STAGE = Stage(name="fourier", title="Fourier features and the helix", order=60, weight=1.0,
              minimum=MINIMUM, minimum_name="helix", run=fourier_helix_stage, plan=fourier_plan)
