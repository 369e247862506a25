"""The HTML report: the standard battery of analyses on one model, in one offline file.

``report(model, out="report.html")`` runs each stage (accuracy and error profile, activation
patching, attribution vs exact, probes and the error detector, Fourier spectra and helix fits with
the causal test, heuristic neurons), writes a short summary computed from each stage's results,
and saves one self-contained HTML file: plotly.js is embedded once, so it opens with no network.
Every stage is a function ``(context) -> Section`` in :data:`STAGES`; the report is a thin layer
over the same calls a notebook makes.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from tqdm.auto import tqdm

from arithinterp.errors import ConfigError, accepted


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
    extra: dict = field(default_factory=dict)


def _task_prompts(model: Any, spec: str, limit: int, seed: int):
    """The model's own task (zoo) or single-token addition, sampled to ``limit`` prompts."""
    from arithinterp.models.zoo import get_entry, zoo_prompts
    from arithinterp.tasks import arithmetic, number_check

    if spec.startswith("zoo:"):
        prompts = zoo_prompts(model, get_entry(spec))
    else:
        single = number_check(model, range(100))["single_token"]
        if len(single) < 10:
            raise ConfigError(f"{spec}: fewer than 10 numbers below 100 are single tokens; pass a zoo model or a task")
        prompts = arithmetic(model, "+", single, single, "{a}+{b}=")
    if len(prompts) > limit:
        pick = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))[:limit]
        prompts = prompts[pick.sort().values]
    return prompts


# --- stages --------------------------------------------------------------------------------------


def accuracy_stage(ctx: Context) -> Section:
    from arithinterp.viz import bars

    ev, prompts = ctx.evaluation, ctx.all_prompts
    errors = (ev.model_answer - prompts.answer)[~ev.correct]
    section = Section("Accuracy and error profile")
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


STAGES: dict[str, Callable[[Context], Section]] = {"accuracy": accuracy_stage}


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

    chosen = list(STAGES) if stages is None else list(stages)
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown report stage(s) {unknown}; accepted: {accepted(STAGES)}")
    if limit < 10:
        raise ConfigError(f"limit must be at least 10 prompts, got {limit}")
    start = time.perf_counter()
    loaded = load_model(model) if isinstance(model, str) else model
    spec = model if isinstance(model, str) else model_id(loaded)
    all_prompts = _task_prompts(loaded, spec, limit, seed)
    evaluation = all_prompts.evaluate(loaded)
    prompts = all_prompts.correct_only(loaded, evaluation)
    pairs = prompts.counterfactual(vary="a", seed=seed)
    ctx = Context(loaded, spec, prompts, all_prompts, evaluation, pairs, seed)

    sections = []
    for name in tqdm(chosen, desc="report", disable=not progress):
        stage_start = time.perf_counter()
        section = STAGES[name](ctx)
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
