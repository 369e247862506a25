"""The HTML report: the standard battery of analyses on one model, in one offline file.

``report(model, out="report.html")`` runs each stage (accuracy and error profile, activation
patching, attribution vs exact, per-digit head ablation for multi-token answers, probes and the
error detector, Fourier spectra and helix fits with the causal test, heuristic neurons), writes a
short summary computed from each stage's results, and saves one self-contained HTML file:
plotly.js is embedded once, so it opens with no network. Every stage is a function
``(context) -> Section`` in :data:`STAGES`; the report is a thin layer over the same calls a
notebook makes. A stage that does not apply to the model (an :class:`ArithInterpError` such as
single-token answers for the digit stage, or multi-token numbers for Fourier features) is shown
as not run, with the reason, and the others go on.
"""

from __future__ import annotations

import html
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from tqdm.auto import tqdm

from arithinterp.errors import ArithInterpError, ConfigError, accepted


@dataclass
class Section:
    """One stage of the report: findings in words, figures, and how long it took."""

    title: str
    findings: list[str] = field(default_factory=list)
    figures: list[Any] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Context:
    """What every stage shares: the model, its task's prompts, and counterfactual pairs."""

    model: Any
    spec: str
    prompts: Any  # the prompts the model answers correctly
    all_prompts: Any  # every prompt of the task, with the model's evaluation
    evaluation: Any
    pairs: Any
    seed: int = 0
    # how much each stage looks at: sized so the whole report runs in well under 3 minutes on 2 cores
    n_pairs: int = 200
    n_probe_prompts: int = 1000
    n_detector_prompts: int = 6000
    n_digit_prompts: int = 500
    top_k_neurons: int = 50


# --- stages --------------------------------------------------------------------------------------

STAGE_TITLES = {
    "accuracy": "Accuracy and error profile",
    "patching": "Activation patching",
    "digits": "Which head computes which answer digit",
    "probes": "Linear probes",
    "errors": "Error detection",
    "fourier": "Fourier features and the helix",
    "neurons": "Heuristic neurons",
}


def accuracy_stage(ctx: Context) -> Section:
    from arithinterp.viz import bars

    ev, prompts = ctx.evaluation, ctx.all_prompts
    errors = (ev.model_answer - prompts.answer)[~ev.correct]
    section = Section(STAGE_TITLES["accuracy"])
    section.findings.append(
        f"The model answers {int(ev.correct.sum())} of {len(prompts)} prompts correctly "
        f"({100 * ev.accuracy:.1f}%); the analyses below use the {len(ctx.prompts)} correct ones."
    )
    if len(errors):
        values, counts = errors.unique(return_counts=True)
        order = counts.argsort(descending=True)[:10]
        top = ", ".join(f"{int(values[i]):+d} ({int(counts[i])}×)" for i in order[:3])
        section.findings.append(f"Most common errors (answer − truth): {top}.")
        section.figures.append(
            bars(
                {f"{int(values[i]):+d}": int(counts[i]) for i in order},
                title="Errors by offset from the true answer",
                y_title="wrong answers",
            )
        )
    else:
        section.findings.append("The model makes no errors on these prompts.")
    return section


def _top_cells(result, k: int = 3) -> str:
    """The k cells with the largest mean effect, e.g. ``L0 'a' (0.92)``."""
    from itertools import product

    def label(axis, value):
        if axis == "position":
            positions = [str(p) for p in result.positions]
            return repr(result.tokens[positions.index(str(value))]) if str(value) in positions else f"pos {value}"
        return {"layer": "L", "head": "H", "neuron": "N"}[axis] + str(value)

    cells = [" ".join(label(a, v) for a, v in zip(result.axes, combo))
             for combo in product(*(result.axis_labels(a) for a in result.axes))]
    mean = result.mean.flatten()
    order = mean.argsort(descending=True)[:k]
    return ", ".join(f"{cells[i]} ({mean[i]:.2f})" for i in order.tolist())


def patching_stage(ctx: Context) -> Section:
    from arithinterp import patching

    pairs = ctx.pairs[: ctx.n_pairs]
    section = Section(STAGE_TITLES["patching"])
    resid = patching.sweep(ctx.model, pairs, "resid_pre", normalize=True, progress=False)
    heads = patching.sweep(ctx.model, pairs, "attn_z", normalize=True, per_position=False, progress=False)
    mlps = patching.sweep(ctx.model, pairs, "mlp_out", normalize=True, progress=False)
    section.findings.append(
        f"Patching the clean residual stream into {len(pairs)} prompts whose first operand was "
        f"changed restores the answer most at {_top_cells(resid)} "
        "(1 = fully restored)."
    )
    section.findings.append(f"Heads (all positions at once) that restore it most: {_top_cells(heads)}.")
    section.findings.append(f"MLP outputs that restore it most: {_top_cells(mlps)}.")
    comparison = patching.attribution_vs_exact(ctx.model, pairs, sites=["resid_pre", "mlp_out"], normalize=True)
    correlations = ", ".join(f"{s}: r = {c:.2f}" for s, c in zip(comparison.sites, comparison.correlation))
    section.findings.append(f"Attribution patching tracks exact patching with {correlations}.")
    section.figures += [resid.plot(), heads.plot(), mlps.plot(), comparison.plot()]
    return section


def digits_stage(ctx: Context) -> Section:
    from arithinterp import patching

    section = Section(STAGE_TITLES["digits"])
    result = patching.digit_ablation(ctx.model, ctx.prompts[: ctx.n_digit_prompts], progress=False)
    drop = result.drop
    order = drop.flatten().argsort(descending=True)[:3].tolist()
    n_answer = drop.shape[1]
    top = ", ".join(f"{result.heads[i // n_answer]} on answer token {i % n_answer} (−{100 * float(drop.flatten()[i]):.0f} points)" for i in order)
    section.findings.append(
        f"Mean-ablating one head at the position that predicts one answer token (teacher-forced, "
        f"{result.meta['n_prompts']} prompts) costs that token most for {top}."
    )
    per_layer = drop.reshape(ctx.model.cfg.n_layers, -1).max(1).values  # the heads come layer by layer
    section.findings.append(
        "Largest drop by any head of each layer: "
        + ", ".join(f"layer {layer}: {100 * float(v):.0f} points" for layer, v in enumerate(per_layer)) + "."
    )
    section.figures.append(result.plot())
    return section


def probes_stage(ctx: Context) -> Section:
    from arithinterp import probes
    from arithinterp.activations import collect

    prompts = ctx.prompts[: ctx.n_probe_prompts]
    acts = collect(ctx.model, prompts, sites="resid_post", positions=["a", "b", "final"], progress=False)
    section = Section(STAGE_TITLES["probes"])
    # whole numbers where each is one token; digit by digit (and the carry) where numbers are spelled out
    targets = ("a", "answer_digit_0", "answer") if prompts.single_token_operands else ("a_digit_0", "carry_0", "answer_digit_0")
    for target in targets:
        result = probes.sweep(acts, target, kind="logistic", cv=3, progress=False)
        best = result.best()
        section.findings.append(
            f"'{target}' is best read at layer {best['layer']}, position '{best['position']}' with held-out "
            f"accuracy {best['score']:.2f} (shuffled-label control {best['shuffled_score']:.2f})."
        )
        section.figures.append(result.plot())
    return section


def error_detector_stage(ctx: Context) -> Section:
    """Probe-based error detection on the main model if it errs often enough, else on the zoo's
    deliberately imperfect model (and the finding says which)."""
    from arithinterp import probes
    from arithinterp.models import load_model
    from arithinterp.models.zoo import get_entry, held_out_prompts

    section = Section(STAGE_TITLES["errors"])
    n_errors = int((~ctx.evaluation.correct).sum())
    if n_errors >= 50:
        model, prompts, name = ctx.model, ctx.all_prompts, ctx.spec
    else:
        name = "zoo:add-3digit-weak"
        model = load_model(name)
        prompts = held_out_prompts(model, get_entry(name), limit=ctx.n_detector_prompts, seed=ctx.seed)
        section.findings.append(
            f"{ctx.spec} makes only {n_errors} errors here, too few to learn from; this section detects the "
            f"errors of {name}, a model stopped early so that it still errs."
        )
    evaluation = prompts.evaluate(model)
    split = len(prompts) * 2 // 3
    detector = probes.ErrorDetector(progress=False).fit(model, prompts[:split], evaluation=evaluation[:split])
    result = detector.evaluate(model, prompts[split:], evaluation=evaluation[split:])
    m = result.metrics()
    section.findings.insert(
        0,
        f"On {len(prompts) - split} held-out prompts of {name} (error rate {m['error_rate']:.1%}), the detector "
        f"at layer {detector.layer_} predicts correctness with accuracy {m['accuracy']:.1%}, balanced accuracy "
        f"{m['balanced_accuracy']:.1%} and AUROC {m['auroc']:.2f}; always answering 'correct' scores "
        f"{m['baseline_accuracy']:.1%}.",
    )
    section.figures.append(result.plot())
    return section


def fourier_helix_stage(ctx: Context) -> Section:
    from arithinterp import fourier, helix
    from arithinterp.activations import collect

    section = Section(STAGE_TITLES["fourier"])
    numbers = sorted(set(ctx.prompts.a.tolist()))
    spectrum = fourier.embedding_spectrum(ctx.model, range(numbers[0], numbers[-1] + 1))
    periods = [f"{spectrum.n / k:.3g}" for k in spectrum.key[0] if k > 0]
    if periods:
        section.findings.append(
            f"The number embeddings concentrate {float(spectrum.key_fraction[0]):.0%} of their non-constant power "
            f"in {len(periods)} key frequencies (periods {', '.join(periods)})."
        )
    else:
        power = spectrum.power[0, 1:]
        k = int(power.argmax()) + 1
        section.findings.append(
            f"The number embeddings have no key frequency (none has 10x the median power); the strongest is "
            f"period {spectrum.n / k:.3g} with {float(power[k - 1] / power.sum()):.0%} of the non-constant power."
        )
    section.figures.append(spectrum.plot())
    acts = collect(ctx.model, ctx.prompts, sites="resid_pre", layers=[0], positions="a", progress=False)
    fit = helix.fit(acts, "a", periods=(2, 5, 10, 100), site="resid_pre", layer=0, position="a")
    test = helix.patch_test(ctx.model, ctx.pairs[: ctx.n_pairs], fit, layer=0, position="a")
    frac = dict(zip(test.methods, test.fraction.tolist()))
    section.findings.append(
        f"A helix with periods 2, 5, 10, 100 fitted at layer 0 on the a token has held-out R² "
        f"{float(fit.r2_full):.2f}; patched in at the corrupted value it restores "
        + ", ".join(f"{m}: {100 * f:.0f}%" for m, f in frac.items())
        + " of the full layer patch's effect."
    )
    section.figures += [fit.plot(), test.plot()]
    return section


def neurons_stage(ctx: Context) -> Section:
    from arithinterp import neurons

    section = Section(STAGE_TITLES["neurons"])
    table = neurons.classify(ctx.model, ctx.prompts, top_k=ctx.top_k_neurons, pairs=ctx.pairs)
    coverage = ", ".join(f"{100 * v:.0f}% in layer {layer}" for layer, v in table.coverage().items())
    section.findings.append(
        f"Of the {len(table.layer)} most important MLP neurons, {coverage} implement at least one "
        f"heuristic (score ≥ {table.threshold})."
    )
    histogram = table.histogram()
    if len(histogram):
        top = histogram.groupby("family")["neurons"].sum().sort_values(ascending=False).head(4)
        section.findings.append("Most common heuristic families: " + ", ".join(f"{f} ({n})" for f, n in top.items()) + ".")
    section.figures.append(table.plot())
    return section


STAGES: dict[str, Callable[[Context], Section]] = {
    "accuracy": accuracy_stage,
    "patching": patching_stage,
    "digits": digits_stage,
    "probes": probes_stage,
    "errors": error_detector_stage,
    "fourier": fourier_helix_stage,
    "neurons": neurons_stage,
}


# --- HTML ----------------------------------------------------------------------------------------

_STYLE = """
body { font-family: Inter, Helvetica, Arial, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
h1 { margin-bottom: 0.2em; } .meta { color: #666; margin-top: 0; }
section { border-top: 1px solid #ddd; margin-top: 2em; padding-top: 0.5em; }
.findings li { margin: 0.3em 0; } .figure { margin: 1em 0; } .seconds { color: #999; font-size: 0.85em; }
"""


def render(title: str, meta: dict, sections: list[Section]) -> str:
    """One self-contained HTML page; plotly.js is inlined once."""
    from plotly.offline import get_plotlyjs

    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style>",
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<p class='meta'>" + " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items()) + "</p>",
        "<h2>Summary</h2><ul class='findings'>",
        *[f"<li><b>{html.escape(s.title)}.</b> {html.escape(s.findings[0])}</li>" for s in sections if s.findings],
        "</ul>",
    ]
    figure_index = 0
    for section in sections:
        parts.append(f"<section><h2>{html.escape(section.title)}</h2><ul class='findings'>")
        parts += [f"<li>{html.escape(line)}</li>" for line in section.findings]
        parts.append("</ul>")
        for fig in section.figures:
            div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{figure_index}")
            parts.append(f"<div class='figure'>{div}</div>")
            figure_index += 1
        parts.append(f"<p class='seconds'>computed in {section.seconds:.1f} s</p></section>")
    parts.append("</body></html>")
    return "\n".join(parts)


# --- entry point ---------------------------------------------------------------------------------


def report(
    model: Union[str, Any] = "zoo:add-100",
    out: Union[str, Path] = "report.html",
    *,
    stages: Optional[list[str]] = None,
    limit: int = 2000,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Run the standard battery on ``model`` and write a self-contained HTML report to ``out``.

    Args:
        model: a model spec (``zoo:NAME``, a path, a hub id) or a loaded hooked model.
        stages: which stages to run (default: all of :data:`STAGES`, in order).
        limit: at most this many prompts of the task (a seeded sample).
    """
    from arithinterp import __version__
    from arithinterp.models import load_model, model_id
    from arithinterp.models.zoo import task_prompts

    chosen = list(STAGES) if stages is None else list(stages)
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown report stage(s) {unknown}; accepted: {accepted(STAGES)}")
    if limit < 10:
        raise ConfigError(f"limit must be at least 10 prompts, got {limit}")
    start = time.perf_counter()
    loaded = load_model(model) if isinstance(model, str) else model
    spec = model if isinstance(model, str) else model_id(loaded)
    all_prompts = task_prompts(loaded, spec, limit, seed)
    evaluation = all_prompts.evaluate(loaded)
    prompts = all_prompts.correct_only(loaded, evaluation)
    pairs = prompts.counterfactual(vary="a", seed=seed)
    ctx = Context(loaded, spec, prompts, all_prompts, evaluation, pairs, seed)

    sections = []
    for name in tqdm(chosen, desc="report", disable=not progress):
        stage_start = time.perf_counter()
        try:
            section = STAGES[name](ctx)
        except ArithInterpError as why:  # the stage does not apply to this model: say so, keep the rest
            section = Section(STAGE_TITLES[name], findings=[f"Not run on this model: {why}"])
            if stages is not None:  # asked for by name: say so here too, not only in the page
                warnings.warn(f"report stage {name!r} not run: {why}", stacklevel=2)
        section.seconds = time.perf_counter() - stage_start
        sections.append(section)
    meta = dict(
        model=spec,
        prompts=len(all_prompts),
        correct=len(prompts),
        seed=seed,
        arithinterp=__version__,
        seconds=round(time.perf_counter() - start, 1),
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(f"How does {spec} do arithmetic?", meta, sections), encoding="utf-8")
    return out
