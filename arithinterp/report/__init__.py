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

Every stage's sample, layers, positions and steps are planned before any of them runs, from the
model's shape, the task, the seed and the budget — costs counted in model work and converted at a
fixed reference rate (:mod:`~arithinterp.report.work`), never read from a clock — so the same
command gives the same page on any machine and under any load; the page records its plan
(:mod:`~arithinterp.report.plan`) and ``plan=`` replays it. Only the threads each part runs on
follow the machine (:mod:`~arithinterp.report.threads`): they change how fast, not what.

The package: :mod:`~arithinterp.report.budget` (planning within the budget, :class:`Context`),
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
import sys
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
    DEFAULT_BUDGET, EVALUATION_WEIGHT, MAX_BUDGET, MIN_BUDGET, Budget, Context, OverBudget, StagePlan,
    default_max_memory, parse_memory, plan_stages, secs,
)
from arithinterp.report.evaluation import (
    EVAL_CAP, EVAL_CHUNK, check_operand_pairs, check_report_template, correct_needed, evaluate_planned,
    evaluation_seconds, parse_operands, report_prompts,
)
from arithinterp.report.html import FINISHED, Page, render, section_html
from arithinterp.report.plan import (
    PLAN_VERSION, PlanRecord, StageRecord, TaskRecord, check_plan_model, check_plan_task, plan_html, read_plan,
    task_digest,
)
from arithinterp.report.stage import NotEnoughData, Section, Stage, joined, require
from arithinterp.report.stages import MINIMUMS, STAGE_TITLES, STAGES, WEIGHTS
from arithinterp.report.stages.accuracy import accuracy_stage
from arithinterp.report.stages.causal import (
    CAUSAL_K, CAUSAL_LOCALISED, CAUSAL_PAIRS, CAUSAL_STEPS, causal_stage,
)
from arithinterp.report.stages.circuits import CURVE_PAIRS, CURVE_SIZES, STEPS, circuits_stage
from arithinterp.report.stages.digits import digits_stage
from arithinterp.report.stages.errors import error_detector_stage
from arithinterp.report.stages.features import features_stage
from arithinterp.report.stages.fourier import fourier_helix_stage
from arithinterp.report.stages.neurons import neurons_stage
from arithinterp.report.stages.patching import patching_stage
from arithinterp.report.stages.probes import PROBE_LAYERS, probes_stage
from arithinterp.report.threads import choose_threads, products_thread_invariant, usable_cpus
from arithinterp.report.work import REFERENCE
from arithinterp.sites import coarse_to_fine, spread
from arithinterp.types import (
    Accepts, ByteSize, HookedModel, Integer, Name, NonNegativeInt, PathLike, Seed, checked,
)

__all__ = [
    "write_report", "StageFailed", "STAGES", "Stage", "Section", "Context", "Budget", "StagePlan", "NotEnoughData",
    "OverBudget", "MINIMUMS", "WEIGHTS", "STAGE_TITLES", "require", "DEFAULT_BUDGET", "MIN_BUDGET",
    "MAX_BUDGET", "EVALUATION_WEIGHT", "default_max_memory", "parse_memory", "spread",
    "coarse_to_fine", "accuracy_stage", "patching_stage", "digits_stage", "probes_stage", "error_detector_stage",
    "fourier_helix_stage", "neurons_stage", "circuits_stage", "features_stage", "causal_stage", "PROBE_LAYERS",
    "STEPS", "CURVE_PAIRS", "CURVE_SIZES", "CAUSAL_PAIRS", "CAUSAL_STEPS", "CAUSAL_K",
    "CAUSAL_LOCALISED", "section_html", "render", "FINISHED", "parse_operands", "EVAL_CHUNK", "EVAL_CAP",
    "correct_needed", "read_plan", "PlanRecord", "REFERENCE",
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


def _replayed_task(record: PlanRecord, given: dict[str, Any], defaults: dict[str, Any], page: Any) -> dict[str, Any]:
    """The task a replayed plan runs: the plan's, refusing any option given (not left at its
    default) that differs from it."""
    planned = record.task.model_dump()
    for name, value in given.items():
        mine = list(value) if isinstance(value, (list, tuple)) and not isinstance(value, str) else value
        if mine != defaults[name] and mine != planned[name]:
            raise ConfigError(f"plan: {name}={value!r} differs from the plan's {name}={planned[name]!r} in {page}; "
                              f"leave {name} out to replay the plan, or run without plan= for a new one")
    return {name: planned[name] for name in given}


#: The fewest prompts a report samples from its task.
MIN_LIMIT = 10
ReportLimit = Annotated[Integer, Field(ge=MIN_LIMIT), Accepts(f"an int >= {MIN_LIMIT} (prompts)")]


@writes
@checked
def write_report(
    model: Union[None, Name, HookedModel] = None,
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
    plan: Optional[PathLike] = None,
    deadline: Any = None,  # _check_budget reads it, as budget
) -> Path:
    """Run the standard battery on ``model`` and write a self-contained HTML report to ``out``.

    Args:
        model: a model spec (``zoo:NAME``, a path, a hub id) or a loaded hooked model; None:
            the model ``plan`` names, else ``zoo:add-100``.
        out: the HTML file to write (by the guarded writer, :func:`arithinterp.outputs.write_file`).
        stages: which stages to run (default: all of :data:`STAGES`, in order).
        limit: at most this many prompts of the task (a seeded sample).
        seed: seeds every sample and analysis.
        template: the prompt template (``{a}`` and ``{b}``; default: the zoo task's, else ``"{a}+{b}="``).
        few_shot: solved examples to prefix each prompt with (seeded), or a prefix string.
        operands: operand values for both a and b: ``"0-99"``, ``"1,5,9"`` or ints (default: the
            zoo task's range, else the numbers below 100 that are single tokens).
        budget: seconds of model work at the reference rate (:data:`REFERENCE`: one thread of the
            machine the cost model was measured on) for the evaluation and all stages together
            (default :data:`DEFAULT_BUDGET`). Every stage's minimum is reserved first; the rest is
            shared by the stages' weights (:data:`WEIGHTS`), and what a stage's plan leaves unused
            goes to the later ones. A stage samples fewer prompts, pairs, layers or steps (seeded)
            to fit its share and says so. The plan depends on the budget, never on the machine: a
            faster one finishes sooner, a busy one later, with the same findings.
        max_memory: transient bytes (or ``"2GiB"``) each stage's batches may use beyond the model
            (default :func:`default_max_memory`: half the available memory, at most 2 GiB).
        correct_only: analyse only the prompts the model answers correctly (the default, as the
            papers do); ``False`` analyses every evaluated prompt, scored on the true answers — for
            a model that answers few correctly, such as a random-init control.
        progress: show the estimate and a progress bar (with its time to go) over the report.
        overwrite: replace ``out`` when it exists (checked before any work; strictly ``True`` or
            ``False``). The page in progress is then written beside it, to ``NAME.in-progress.html``,
            and replaces ``out`` only when the run ends: a run stopped part way keeps the old page.
        raise_on_failure: raise :class:`StageFailed` after the page is written when a stage
            failed (the command line's exit status).
        plan: a report page whose recorded plan to run again: the same prompts, samples, layers and
            steps, so the same numbers. Its task (template, few-shot, operands, limit, seed,
            stages, correct_only) is the plan's; an option given here that differs is refused.
        deadline: instead of ``budget``, wall-clock seconds to fit on this machine: the speed of
            the evaluation here converts the rest into model work. The samples then depend on the
            machine and its load, and the page says so.

    Returns:
        ``out``, the written page.

    Raises:
        ConfigError: a bad option, before the model loads: an argument of the wrong type (every one
            is declared and checked, strictly), an unknown or empty list of stages, a budget outside
            :data:`MIN_BUDGET`..:data:`MAX_BUDGET`, a template without ``{a}`` and ``{b}``, more
            operand pairs than :data:`~arithinterp.report.evaluation.MAX_OPERAND_PAIRS`, ``out``
            taken without ``overwrite``, a page without a plan, or a plan with another task; just
            after it loads, before any prompt set is built, a few-shot prefix or template whose
            prompts do not fit the model's context.
            :class:`MemoryBudgetError` when ``max_memory`` cannot hold one prompt's forward of the
            model. :class:`~arithinterp.errors.ModelMismatchError` when ``plan`` was made for a
            model with other weights.
        StageFailed: with ``raise_on_failure``, when a stage failed.

    The page is written when the evaluation starts and rewritten as every stage starts and ends
    (each time whole, through the guarded writer): a run stopped at any point leaves a readable page
    that lists finished, running and unrun stages (beside ``out``, with ``overwrite``, which keeps
    the old page). A stage that fails (any exception, e.g. ``MemoryError``) is recorded with its reason
    and the next one runs; ``KeyboardInterrupt`` writes the page as interrupted and is re-raised.
    Each stage states its sample size and, below :data:`MINIMUMS`, says "not enough data".
    """
    import torch

    from arithinterp._version import __version__
    from arithinterp.checks import fingerprint
    from arithinterp.models import load_model, model_id

    replay = None if plan is None else read_plan(plan)
    if replay is not None:
        if budget is not None or deadline is not None:
            raise ConfigError("plan: a replayed plan keeps the budget it was made with; leave budget= and deadline= "
                              "out (or run without plan= for a new plan)")
        given = dict(stages=stages, limit=limit, seed=seed, template=template, few_shot=few_shot,
                     operands=operands, correct_only=correct_only)
        defaults = dict(stages=None, limit=2000, seed=0, template=None, few_shot=0, operands=None, correct_only=True)
        task = _replayed_task(replay, given, defaults, plan)
        stages, limit, seed, template, few_shot, operands, correct_only = (
            task[name] for name in ("stages", "limit", "seed", "template", "few_shot", "operands", "correct_only"))
    if model is None:  # the plan's model, else the default
        model = replay.model if replay is not None else "zoo:add-100"
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
    if deadline is not None and budget is not None:
        raise ConfigError("give budget= (model work, the same plan on any machine) or deadline= (wall-clock seconds "
                          "on this machine), not both")
    total = replay.budget if replay is not None else _check_budget(deadline if deadline is not None else budget)
    memory = default_max_memory() if max_memory is None else parse_memory(max_memory)
    if replay is not None and max_memory is None:
        memory = replay.memory  # the batches the plan ran with
    out = check_target(out, overwrite=overwrite, what="out")  # before minutes of analysis, not after
    # an old page stays until the new one is complete: the page in progress is written beside it
    page_file = out.with_name(f"{out.stem}.in-progress{out.suffix or '.html'}") if os.path.lexists(out) else out
    check_target(page_file, overwrite=True, what="out")
    if not isinstance(model, str):
        check_model(model, "write_report")
    loaded = load_model(model) if isinstance(model, str) else model
    spec = model if isinstance(model, str) else model_id(loaded)
    weights = fingerprint(loaded)
    if replay is not None:
        check_plan_model(replay, weights, spec, plan)
    all_prompts = report_prompts(loaded, spec, limit, seed, template, few_shot, operands)
    digest = task_digest(all_prompts)
    if replay is not None:
        check_plan_task(replay, digest, plan)
    _check_memory(loaded, spec, all_prompts, memory)
    # the thread count changes the speed, not the numbers, where products are thread-invariant; else one count
    fixed_threads = None if products_thread_invariant() else usable_cpus()

    meta: dict[str, Any] = dict(model=spec, prompts=len(all_prompts))
    if template is not None:
        meta["template"] = template
    if few_shot:
        meta["few-shot"] = few_shot
    if operands is not None:
        meta["operands"] = operands if isinstance(operands, str) else f"{len(parse_operands(operands))} values"
    if not correct_only:
        meta["prompts analysed"] = "all, answered correctly or not"
    meta.update(seed=seed, budget=(f"{secs(total)} on this machine (deadline): its samples depend on the machine"
                                   if deadline is not None else f"{secs(total)} of model work at the reference rate"),
                memory=f"{memory / 2**20:,.0f} MiB per stage", arithinterp=__version__)
    if replay is not None:
        meta["plan"] = f"replayed from {plan}"
    if fixed_threads is not None:
        meta["threads"] = (f"{fixed_threads} for the whole run (this BLAS's matrix products differ by thread count, "
                           "so the count is kept fixed)")
    page = Page(page_file, f"How does {spec} do arithmetic?", meta, chosen,
                {name: STAGES[name].title for name in chosen}, replaces=out)
    record: dict[str, Any] = dict(
        version=PLAN_VERSION, model=spec, fingerprint=weights, budget=total, memory=memory, reference=REFERENCE,
        deadline=deadline, evaluated=0, stages={},
        task=TaskRecord(limit=limit, seed=seed, template=template, few_shot=few_shot,
                        operands=list(operands) if operands is not None and not isinstance(operands, str) else operands,
                        correct_only=correct_only, stages=chosen, digest=digest))
    clock = time.perf_counter()  # for the page's timings and the estimate only: the plan never reads it

    def use_threads() -> int:
        threads = fixed_threads or choose_threads()
        torch.set_num_threads(threads)
        return threads

    weights_sum = EVALUATION_WEIGHT + sum(STAGES[name].weight for name in chosen)
    n_new = int(all_prompts.answer_tokens.shape[1])
    batch = Budget(bytes=memory).batch_size(loaded, int(all_prompts.lengths.max()), n_new=n_new)
    per_prompt = evaluation_seconds(loaded, all_prompts, batch)
    share = total * EVALUATION_WEIGHT / weights_sum
    first = replay.evaluated if replay is not None else min(len(all_prompts), max(1, math.floor(share / per_prompt)))
    cap = first if replay is not None else max(first, math.floor(EVAL_CAP * total / per_prompt))
    with _threads_kept():  # the threads each part runs on are chosen as it starts; the caller's come back
        task = all_prompts
        page.set("evaluation", f"running ({secs(first * per_prompt)} planned, {_threads(use_threads())})")
        if progress:
            print(f"report: evaluating {first:,} of {len(task):,} prompts ({secs(first * per_prompt)} of model work "
                  "at the reference rate), then planning every stage", file=sys.stderr)
        try:
            all_prompts, evaluation, sampled = evaluate_planned(
                loaded, all_prompts, first, cap, correct_needed(chosen) if correct_only else 0, batch, seed)
        except KeyboardInterrupt:
            page.set("evaluation", "interrupted")
            raise
        except Exception as error:  # nothing can run without the evaluation: say why on the page, then stop
            page.set("evaluation", f"failed: {_reason(error)}")
            raise
        took = time.perf_counter() - clock
        spent = len(all_prompts) * per_prompt
        speed = spent / max(took, 1e-9)  # this machine's speed against the reference rate: for the estimate only
        record["evaluated"] = len(all_prompts)
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
        page.set("evaluation", f"done: {took:.1f} s ({secs(spent)} of model work); {sampled}")
        ctx = Context(loaded, spec, prompts, all_prompts, evaluation, pairs, seed, correct_only=correct_only,
                      task_prompts=task)
        left = max(total - spent, 0.0) if deadline is None else max(total - took, 0.0) * speed
        recorded = None if replay is None else {name: (s.share, s.choices) for name, s in replay.stages.items()}
        plans = plan_stages(ctx, [STAGES[name] for name in chosen], left, total, memory, recorded)
        for name, planned in plans.items():
            if isinstance(planned, StagePlan):
                record["stages"][name] = StageRecord(share=planned.share, seconds=planned.seconds,
                                                     choices=planned.choices)
        page.plan = plan_html(PlanRecord(**record))
        planned_seconds = sum(p.seconds for p in plans.values() if isinstance(p, StagePlan))
        estimate = (f"{secs(planned_seconds)} of model work at the reference rate for the stages; at the speed the "
                    f"evaluation ran at here ({speed:.2g}× the reference), about {secs(planned_seconds / speed)}")
        page.meta["estimate"] = estimate
        short = {name: p for name, p in plans.items() if isinstance(p, OverBudget)}
        for name, why in short.items():  # said now, before any stage runs, with the budget that would run it
            page.state[name] = f"will not run (over budget): {why}"
        page.write()
        if progress:
            print(f"report plan: {estimate}", file=sys.stderr)
            for name, why in short.items():
                print(f"report plan: {name} will not run. {why}", file=sys.stderr)
        bar = progress_bar(total=planned_seconds, desc="report", unit="s", disable=not progress,
                           bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s of model work [{elapsed}<{remaining}]")

        for name in chosen:
            planned = plans[name]
            threads = use_threads() if isinstance(planned, StagePlan) else 0
            if isinstance(planned, StagePlan):
                page.set(name, f"running ({secs(planned.seconds)} planned, {_threads(threads)})")
            section, state = _run_stage(ctx, name, planned, page, progress, warn=stages is not None)
            if name == "accuracy":
                section.sample = joined(section.sample, f"the evaluation: {sampled}")
            if not correct_only:  # the minimums count correct prompts; here every evaluated prompt is used
                section.sample = section.sample.replace("correctly answered prompts",
                                                        "prompts, answered correctly or not")
                section.findings = [f.replace("correctly answered prompts", "prompts") for f in section.findings]
            how = f"{section.seconds:.1f} s"
            if isinstance(planned, StagePlan):  # its planned work done: the bar's time to go is at this machine's pace
                how += (f" ({secs(planned.seconds)} of model work planned of its {secs(planned.share)} share, "
                        f"{_threads(threads)})")
                bar.update(min(planned.seconds, bar.total - bar.n))
            try:
                page.add(name, section, f"{state}: {how}" + (f"; {section.sample}" if state == "done" and section.sample
                                                              else ""))
            except KeyboardInterrupt:  # while the page was written: write it again, with the stage just finished
                page.interrupted = True
                page.write()
                raise
        bar.close()
    path = page.finish()
    failed = [name for name in chosen if page.state[name].startswith("failed")]
    if raise_on_failure and failed:
        raise StageFailed(f"{len(failed)} report stage(s) failed ({', '.join(failed)}); their sections in {path} say "
                          "why, and the other stages' findings are there")
    return path


def _run_stage(ctx: Context, name: str, planned: Any, page: Page, progress: bool, warn: bool) -> tuple[Section, str]:
    """One stage on its plan → ``(its section, its state)``. A plan that is an exception (the stage
    cannot run, said before any stage ran) and any exception the run raises are the section's
    finding and the state; ``KeyboardInterrupt`` marks the page and goes on up."""
    start = time.perf_counter()
    state = "done"
    try:
        if not isinstance(planned, StagePlan):
            raise planned  # the plan said before the run that the stage cannot run, and why
        ctx.budget, ctx.planned = planned.budget, planned
        with _library_bars(progress):
            section = STAGES[name].run(ctx)
    except (MemoryBudgetError, MemoryError) as error:  # failed, not "does not apply": more memory would run it
        reason = f"Failed for lack of memory ({_reason(error)}); give the report more (--max-memory)"
        section, state = Section(STAGES[name].title, findings=[reason]), "failed"
        warnings.warn(f"report stage {name!r} failed: {reason}", stacklevel=3)
        gc.collect()
    except NotEnoughData as why:  # too little data to conclude anything: say so, draw nothing
        section, state = Section(STAGES[name].title, findings=[str(why)]), "not enough data"
    except OverBudget as why:  # not even the minimum fits: say so rather than overrun
        section, state = Section(STAGES[name].title, findings=[str(why)]), "skipped (over budget)"
    except ArithInterpError as why:  # the stage does not apply to this model: say so, keep the rest
        section, state = Section(STAGES[name].title, findings=[f"Not run on this model: {why}"]), "not run"
        if warn:  # asked for by name: say so here too, not only in the page
            warnings.warn(f"report stage {name!r} not run: {why}", stacklevel=3)
    except KeyboardInterrupt:
        page.set(name, f"interrupted after {time.perf_counter() - start:.1f} s")
        raise
    except Exception as error:  # out of memory, a torch error, a bug: record it and go on with the next
        section, state = Section(STAGES[name].title, findings=[f"Failed: {_reason(error)}"]), "failed"
        warnings.warn(f"report stage {name!r} failed: {_reason(error)}", stacklevel=3)
        gc.collect()  # what the failed stage held is garbage now; free it before the next one
    finally:
        ctx.planned = None
    section.seconds = time.perf_counter() - start
    return section, state


def _threads(count: int) -> str:
    return f"{count} thread{'s' * (count > 1)}"


@contextlib.contextmanager
def _threads_kept() -> Iterator[None]:
    """torch's thread count as it was before, whatever happens inside."""
    import torch

    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
