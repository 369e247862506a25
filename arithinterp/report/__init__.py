"""The HTML report: the standard battery of analyses on one model, in one offline file.

``write_report(model, out="report.html")`` runs each stage (accuracy and error profile, activation
patching, attribution vs exact, per-digit head ablation for multi-token answers, probes and the
error detector, Fourier spectra and helix fits with the causal test, heuristic neurons, circuits,
feature circuits, causal variables), writes a short summary computed from each stage's results,
and saves one self-contained HTML file: plotly.js is embedded once, so it opens with no network.
Every stage is one :class:`Stage` object in its own module of :mod:`arithinterp.report.stages`
(name, title, weight, minimum, ``run(context) -> Section``), listed in :data:`STAGES` in the
page's order; the report is a thin layer over the same calls a notebook makes. A stage that does
not apply to the model (an :class:`ArithInterpError` such as single-token answers for the digit
stage, or multi-token numbers for Fourier features) is shown as not run, with the reason, and the
others go on.

Every stage states its sample size and, below the minimum in :data:`MINIMUMS`, says "not enough
data" instead of drawing a conclusion; where a result does not beat its control, the finding
says "no signal above the control". Effects are quoted as measured; only the intervals of bounded
scores (accuracies) are clipped to their range, and answers that are not numbers are counted, not
drawn as error sizes.

The package: :mod:`~arithinterp.report.budget` (time and memory planning, :class:`Context`),
:mod:`~arithinterp.report.stage` (:class:`Stage`, :class:`Section`, minimums),
:mod:`~arithinterp.report.stages` (one module per stage, and the registry),
:mod:`~arithinterp.report.evaluation` (the prompts and their evaluation),
:mod:`~arithinterp.report.html` (the page), and here :func:`write_report`, the runner.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
import warnings
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional, Union

from pydantic import Field

from arithinterp.checks import check_model
from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError, MemoryBudgetError, TaskError, accepted
from arithinterp.outputs import check_target, writes
from arithinterp.progress import progress_bar
from arithinterp.report.budget import (
    DEFAULT_BUDGET, EVALUATION_WEIGHT, MARGIN, MAX_BUDGET, MIN_BUDGET, PILOT, PILOT_SHARE, SLOPE_FLOOR, Budget,
    Context, OverBudget, default_max_memory, parse_memory, pilot_cost, secs,
)
from arithinterp.report.evaluation import (
    EVAL_CAP, EVAL_CHUNK, WARM_UP, check_operand_pairs, check_report_template, correct_needed, evaluate_within,
    parse_operands, report_prompts,
)
from arithinterp.report.html import FINISHED, Page, render, section_html
from arithinterp.report.stage import Knob, NotEnoughData, Section, Stage, joined, require
from arithinterp.report.stages import KNOBS, MINIMUMS, STAGE_TITLES, STAGES, WEIGHTS
from arithinterp.report.stages.accuracy import accuracy_stage
from arithinterp.report.stages.causal import (
    CAUSAL_K, CAUSAL_LOCALISED, CAUSAL_MIN_STEPS, CAUSAL_PAIRS, CAUSAL_STEPS, causal_stage,
)
from arithinterp.report.stages.circuits import CURVE_PAIRS, CURVE_SIZES, STEPS, circuits_stage
from arithinterp.report.stages.digits import digits_stage
from arithinterp.report.stages.errors import error_detector_stage
from arithinterp.report.stages.features import features_stage
from arithinterp.report.stages.fourier import fourier_helix_stage
from arithinterp.report.stages.neurons import neurons_stage
from arithinterp.report.stages.patching import patching_stage
from arithinterp.report.stages.probes import PROBE_LAYERS, probes_stage
from arithinterp.sites import coarse_to_fine, spread
from arithinterp.types import (
    Accepts, ByteSize, HookedModel, Integer, Name, NonNegativeInt, PathLike, Seed, checked,
)

__all__ = [
    "write_report", "StageFailed", "STAGES", "Stage", "Knob", "Section", "Context", "Budget", "NotEnoughData",
    "OverBudget", "MINIMUMS", "WEIGHTS", "STAGE_TITLES", "KNOBS", "require", "DEFAULT_BUDGET", "MIN_BUDGET",
    "MAX_BUDGET", "EVALUATION_WEIGHT", "PILOT",
    "PILOT_SHARE", "SLOPE_FLOOR", "MARGIN", "default_max_memory", "parse_memory", "pilot_cost", "spread",
    "coarse_to_fine", "accuracy_stage", "patching_stage", "digits_stage", "probes_stage", "error_detector_stage",
    "fourier_helix_stage", "neurons_stage", "circuits_stage", "features_stage", "causal_stage", "PROBE_LAYERS",
    "STEPS", "CURVE_PAIRS", "CURVE_SIZES", "CAUSAL_PAIRS", "CAUSAL_STEPS", "CAUSAL_MIN_STEPS", "CAUSAL_K",
    "CAUSAL_LOCALISED", "section_html", "render", "FINISHED", "parse_operands", "WARM_UP", "EVAL_CHUNK", "EVAL_CAP",
    "correct_needed",
]


def _check_budget(budget: Any) -> float:
    if budget is None:
        return DEFAULT_BUDGET
    if (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget)
            or not MIN_BUDGET <= budget <= MAX_BUDGET):
        raise ConfigError(f"budget must be seconds from {MIN_BUDGET:.0f} (the evaluation alone) to {MAX_BUDGET:,.0f} "
                          f"(a week), e.g. 600; got {budget!r}")
    return float(budget)


class StageFailed(AnalysisError):
    """A report stage failed (out of memory, a bug); the page is written and names it."""


def _run_stage(ctx: Context, name: str) -> Section:
    """One stage within ``ctx.budget``; a stage with a :class:`Knob` (a sample size its own code
    does not fit to its budget) is timed at its minimum sample, then run again on as many as fit
    the time left (when that is at least twice as many)."""
    stage = STAGES[name]
    if stage.knob is None or ctx.budget.seconds == float("inf"):
        return stage.run(ctx)
    knob, minimum_of, what = stage.knob
    minimum = MINIMUMS[minimum_of][0]
    have = len(ctx.prompts) if knob == "n_probe_prompts" else (0 if ctx.pairs is None else len(ctx.pairs))
    cap = getattr(ctx, knob)
    available = min(cap, have)
    if available < 2 * minimum:
        return stage.run(ctx)
    try:
        setattr(ctx, knob, minimum)
        start = time.perf_counter()
        section = stage.run(ctx)
        per_item = (time.perf_counter() - start) / minimum  # fixed costs counted per item: an over-estimate
        fits = min(available, int(max(ctx.seconds_left(), 0.0) / max(per_item, 1e-9)))
        if fits >= 2 * minimum:
            setattr(ctx, knob, fits)
            section = stage.run(ctx)
        used = getattr(ctx, knob)
    finally:
        setattr(ctx, knob, cap)
    budget = f"the {secs(ctx.budget.seconds)} budget"
    section.sample = joined(section.sample, f"all {available:,} {what} fit {budget}" if used >= available
                            else f"sampled {used:,} of {available:,} {what} to fit {budget}")
    return section


#: The fewest prompts a report samples from its task.
MIN_LIMIT = 10
ReportLimit = Annotated[Integer, Field(ge=MIN_LIMIT), Accepts(f"an int >= {MIN_LIMIT} (prompts)")]


@writes
@checked
def write_report(
    model: Union[Name, HookedModel] = "zoo:add-100",
    out: PathLike = "report.html",
    *,
    stages: Optional[list[Name]] = None,
    limit: ReportLimit = 2000,
    seed: Seed = 0,
    template: Optional[Name] = None,
    few_shot: Union[NonNegativeInt, str] = 0,
    operands: Any = None,
    budget: Any = None,  # _check_budget reads it (its message names the range in seconds)
    max_memory: Optional[ByteSize] = None,
    correct_only: bool = True,
    progress: bool = True,
    overwrite: bool = False,
    raise_on_failure: bool = False,
) -> Path:
    """Run the standard battery on ``model`` and write a self-contained HTML report to ``out``.

    Args:
        model: a model spec (``zoo:NAME``, a path, a hub id) or a loaded hooked model.
        out: the HTML file to write (by the guarded writer, :func:`arithinterp.outputs.write_file`).
        stages: which stages to run (default: all of :data:`STAGES`, in order).
        limit: at most this many prompts of the task (a seeded sample).
        seed: seeds every sample and analysis.
        template: the prompt template (``{a}`` and ``{b}``; default: the zoo task's, else ``"{a}+{b}="``).
        few_shot: solved examples to prefix each prompt with (seeded), or a prefix string.
        operands: operand values for both a and b: ``"0-99"``, ``"1,5,9"`` or ints (default: the
            zoo task's range, else the numbers below 100 that are single tokens).
        budget: seconds for the evaluation and all stages together (default :data:`DEFAULT_BUDGET`),
            shared by the stages' weights (:data:`WEIGHTS`); what a stage leaves unused goes to the later ones. A stage
            samples fewer prompts or pairs (seeded) to fit its share and says so.
        max_memory: transient bytes (or ``"2GiB"``) each stage's batches may use beyond the model
            (default :func:`default_max_memory`: half the available memory, at most 2 GiB).
        correct_only: analyse only the prompts the model answers correctly (the default, as the
            papers do); ``False`` analyses every evaluated prompt, scored on the true answers — for
            a model that answers few correctly, such as a random-init control.
        progress: show a progress bar over the stages.
        overwrite: replace ``out`` when it exists (checked before any work; strictly ``True`` or
            ``False``). The page in progress is then written beside it, to ``NAME.in-progress.html``,
            and replaces ``out`` only when the run ends: a run stopped part way keeps the old page.
        raise_on_failure: raise :class:`StageFailed` after the page is written when a stage
            failed (the command line's exit status).

    Returns:
        ``out``, the written page.

    Raises:
        ConfigError: a bad option, before the model loads: an argument of the wrong type (every one
            is declared and checked, strictly), an unknown or empty list of stages, a budget outside
            :data:`MIN_BUDGET`..:data:`MAX_BUDGET`, a template without ``{a}`` and ``{b}``, more
            operand pairs than :data:`~arithinterp.report.evaluation.MAX_OPERAND_PAIRS`, ``out``
            taken without ``overwrite``; just after it loads, before any prompt set is built, a
            few-shot prefix or template whose prompts do not fit the model's context.
            :class:`MemoryBudgetError` when ``max_memory`` cannot hold one prompt's forward of the model.
        StageFailed: with ``raise_on_failure``, when a stage failed.

    The page is written when the evaluation starts and rewritten as every stage starts and ends
    (each time whole, through the guarded writer): a run stopped at any point leaves a readable page
    that lists finished, running and unrun stages (beside ``out``, with ``overwrite``, which keeps
    the old page). A stage that fails (any exception, e.g. ``MemoryError``) is recorded with its reason
    and the next one runs; ``KeyboardInterrupt`` writes the page as interrupted and is re-raised.
    Each stage states its sample size and, below :data:`MINIMUMS`, says "not enough data".
    """
    from arithinterp._version import __version__
    from arithinterp.models import load_model, model_id

    chosen = list(STAGES) if stages is None else list(stages)
    if not chosen:
        raise ConfigError(f"stages names no stage; give some of {accepted(STAGES)}, or None for all of them")
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown report stage(s) {unknown}; accepted: {accepted(STAGES)}")
    if operands is not None:
        check_operand_pairs(parse_operands(operands))  # bad operands fail before the model loads
    if template is not None:
        check_report_template(model, template)
    total = _check_budget(budget)
    memory = default_max_memory() if max_memory is None else parse_memory(max_memory)
    out = check_target(out, overwrite=overwrite, what="out")  # before minutes of analysis, not after
    # an old page stays until the new one is complete: the page in progress is written beside it
    page_file = out.with_name(f"{out.stem}.in-progress{out.suffix or '.html'}") if os.path.lexists(out) else out
    check_target(page_file, overwrite=True, what="out")
    if not isinstance(model, str):
        check_model(model, "write_report")
    loaded = load_model(model) if isinstance(model, str) else model
    spec = model if isinstance(model, str) else model_id(loaded)
    all_prompts = report_prompts(loaded, spec, limit, seed, template, few_shot, operands)
    _check_memory(loaded, spec, all_prompts, memory)

    meta: dict[str, Any] = dict(model=spec, prompts=len(all_prompts))
    if template is not None:
        meta["template"] = template
    if few_shot:
        meta["few-shot"] = few_shot
    if operands is not None:
        meta["operands"] = operands if isinstance(operands, str) else f"{len(parse_operands(operands))} values"
    if not correct_only:
        meta["prompts analysed"] = "all, answered correctly or not"
    meta.update(seed=seed, budget=secs(total), memory=f"{memory / 2**20:,.0f} MiB per stage",
                arithinterp=__version__)
    page = Page(page_file, f"How does {spec} do arithmetic?", meta, chosen,
                {name: STAGES[name].title for name in chosen}, replaces=out)
    clock = time.perf_counter()  # the budget counts from here: loading the model is not the report's to shorten

    def weight(name: str) -> float:
        return EVALUATION_WEIGHT if name == "evaluation" else STAGES[name].weight

    def share(name: str, later: list[str]) -> float:
        left = total - (time.perf_counter() - clock)
        return max(left, 0.0) * weight(name) / sum(weight(n) for n in [name, *later])

    seconds = share("evaluation", chosen)
    page.set("evaluation", f"running (budget {secs(seconds)})")
    try:
        all_prompts, evaluation, per_prompt, sampled = evaluate_within(
            loaded, all_prompts, seconds, max(seconds, EVAL_CAP * total), Budget(seconds, memory), seed,
            need=correct_needed(chosen) if correct_only else 0)
    except KeyboardInterrupt:
        page.set("evaluation", "interrupted")
        raise
    except Exception as error:  # nothing can run without the evaluation: say why on the page, then stop
        page.set("evaluation", f"failed: {_reason(error)}")
        raise
    # may be empty: each stage holds itself to its minimum
    prompts = all_prompts[evaluation.correct] if correct_only else all_prompts
    pairs = None
    if len(prompts) >= 2:
        try:  # pairs whose answers start alike have a first-token logit difference of 0: leave them out
            pairs = prompts.counterfactual(vary="a", seed=seed, distinct_first_token=True)
        except TaskError:
            pairs = None
    page.meta.update(evaluated=len(all_prompts), correct=int(evaluation.correct.sum()),
                     pairs=0 if pairs is None else len(pairs))
    page.set("evaluation", f"done: {time.perf_counter() - clock:.1f} s of its {secs(seconds)} budget; {sampled}")
    ctx = Context(loaded, spec, prompts, all_prompts, evaluation, pairs, seed, correct_only=correct_only)

    for i, name in enumerate(progress_bar(chosen, desc="report", disable=not progress)):
        seconds = share(name, chosen[i + 1:])
        ctx.budget, ctx.stage_start = Budget(seconds, memory, per_prompt), time.perf_counter()
        page.set(name, f"running (budget {secs(seconds)})")
        state = "done"
        try:
            with _library_bars(progress):
                section = _run_stage(ctx, name)
            if name == "accuracy":
                section.sample = joined(section.sample, f"the evaluation: {sampled}")
        except (MemoryBudgetError, MemoryError) as error:  # failed, not "does not apply": more memory would run it
            reason = f"Failed for lack of memory ({_reason(error)}); give the report more (--max-memory)"
            section, state = Section(STAGES[name].title, findings=[reason]), "failed"
            warnings.warn(f"report stage {name!r} failed: {reason}", stacklevel=2)
            gc.collect()
        except NotEnoughData as why:  # too little data to conclude anything: say so, draw nothing
            section, state = Section(STAGES[name].title, findings=[str(why)]), "not enough data"
        except OverBudget as why:  # not even the minimum fits: say so rather than overrun
            section, state = Section(STAGES[name].title, findings=[str(why)]), "skipped (over budget)"
        except ArithInterpError as why:  # the stage does not apply to this model: say so, keep the rest
            section, state = Section(STAGES[name].title, findings=[f"Not run on this model: {why}"]), "not run"
            if stages is not None:  # asked for by name: say so here too, not only in the page
                warnings.warn(f"report stage {name!r} not run: {why}", stacklevel=2)
        except KeyboardInterrupt:
            page.set(name, f"interrupted after {time.perf_counter() - ctx.stage_start:.1f} s")
            raise
        except Exception as error:  # out of memory, a torch error, a bug: record it and go on with the next
            section, state = Section(STAGES[name].title, findings=[f"Failed: {_reason(error)}"]), "failed"
            warnings.warn(f"report stage {name!r} failed: {_reason(error)}", stacklevel=2)
            gc.collect()  # what the failed stage held is garbage now; free it before the next one
        section.seconds = time.perf_counter() - ctx.stage_start
        if not correct_only:  # the minimums count correct prompts; here every evaluated prompt is used
            section.sample = section.sample.replace("correctly answered prompts", "prompts, answered correctly or not")
            section.findings = [f.replace("correctly answered prompts", "prompts") for f in section.findings]
        try:
            page.add(name, section, f"{state}: {section.seconds:.1f} s of its {secs(seconds)} budget"
                     + (f"; {section.sample}" if state == "done" and section.sample else ""))
        except KeyboardInterrupt:  # while the page was written: write it again, with the stage just finished
            page.interrupted = True
            page.write()
            raise
    path = page.finish()
    failed = [name for name in chosen if page.state[name].startswith("failed")]
    if raise_on_failure and failed:
        raise StageFailed(f"{len(failed)} report stage(s) failed ({', '.join(failed)}); their sections in {path} say "
                          "why, and the other stages' findings are there")
    return path


@contextlib.contextmanager
def _library_bars(progress: bool) -> Iterator[None]:
    """The analyses' own progress bars follow the report's ``progress``: off, every tqdm bar made
    meanwhile is disabled (a stage need not pass ``progress=False`` to each call it makes; tqdm
    reads its ``TQDM_DISABLE`` setting only at import), then tqdm is put back as it was."""
    if progress:
        yield
        return
    from tqdm import std

    made = std.tqdm.__init__

    def quiet(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        made(self, *args, **kwargs)

    std.tqdm.__init__ = quiet
    try:
        yield
    finally:
        std.tqdm.__init__ = made


def _check_memory(model: Any, spec: str, prompts: Any, memory: int) -> None:
    """Refuse a memory budget in which no stage can run: one prompt's forward does not fit it."""
    from arithinterp.engine.budget import forward_bytes_per_prompt

    need = forward_bytes_per_prompt(model, int(prompts.lengths.max()))
    if memory < need:
        raise MemoryBudgetError(f"max_memory {memory / 2**20:,.0f} MiB cannot hold one prompt's forward of {spec} "
                                f"(about {need / 2**20:,.0f} MiB): no stage could run; give at least that")


def _reason(error: BaseException) -> str:
    """``"MemoryError: ..."``: the exception's type and message, on one line."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
