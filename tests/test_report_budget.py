"""A report that always writes a page: rewritten as each stage ends, readable when the run is
killed, interrupted or a stage fails; every stage planned before it runs, within a budget of model
work that it meets by sampling fewer prompts, pairs, layers or steps, saying so — the same plan
under any clock and any thread count, recorded in the page and replayed from it."""

from __future__ import annotations

import html
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch

from arithinterp.errors import ConfigError
from arithinterp.report import (CURVE_PAIRS, CURVE_SIZES, MINIMUMS, STAGE_TITLES, STAGES, STEPS, Budget, Context,
                                NotEnoughData, OverBudget, StagePlan, parse_memory, read_plan, require, spread,
                                write_report)
from arithinterp.report import budget as report_budget
from arithinterp.report.budget import plan_stages, seeded_pick as _seeded_pick
from arithinterp.report.stages import probes as probes_module
from arithinterp.sites import looking_first_at

ROOT = Path(__file__).parent.parent
VOID = {"meta", "br", "img", "input", "link", "hr", "area", "base", "col", "embed", "source", "track", "wbr"}


class _Balance(HTMLParser):
    """Checks that every element that opens also closes, in order."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def assert_complete_html(text: str) -> None:
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</body></html>")
    parser = _Balance()
    parser.feed(text)
    parser.close()
    assert not parser.errors and not parser.stack, (parser.errors[:3], parser.stack)


def stage_states(text: str) -> dict[str, str]:
    block = text.split("<h2>Stages</h2><ul class='status'>")[1].split("</ul>")[0]
    return {html.unescape(a): html.unescape(b) for a, b in re.findall(r"<li><b>(.*?)</b>: (.*?)</li>", block)}


def section_titles(text: str) -> list[str]:
    return [html.unescape(t) for t in re.findall(r"<section><h2>(.*?)</h2>", text)]


@pytest.mark.slow
def test_a_killed_report_leaves_a_readable_page_of_the_finished_stages(tmp_path):
    out = tmp_path / "r.html"
    names = ["accuracy", "patching", "probes", "neurons", "circuits"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "arithinterp.cli", "report", "zoo:add-100", "--stages", ",".join(names),
               "--limit", "400", "--out", str(out), "--no-progress"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        done = False
        while process.poll() is None and not done:  # until the first stage's page is on disk
            done = out.exists() and "<b>Accuracy and error profile</b>: done" in out.read_text()
            time.sleep(0.02)
        assert process.poll() is None, "the report ended before the first stage's page could be seen"
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
    text = out.read_text()
    assert_complete_html(text)
    states = stage_states(text)
    assert list(states) == ["Evaluating the task", *(STAGE_TITLES[n] for n in names)]
    assert states["Evaluating the task"].startswith("done")
    assert states["Accuracy and error profile"].startswith("done: ")
    finished = [t for t, s in states.items() if s.startswith("done")][1:]
    unfinished = [t for t, s in states.items() if s.startswith(("running", "not yet run"))]
    assert finished and unfinished and len(finished) + len(unfinished) == len(names)
    assert section_titles(text) == finished  # the finished stages' sections, and only those
    assert "Partial page: " in text and re.search(r"\d+ of 5 stages finished", text)
    assert re.search(r"answers \d+ of \d+ prompts correctly", text)  # the finished stage's findings


def _raises(name: str, error: BaseException):
    """The stage ``name`` with a run that raises ``error``."""
    def run(ctx):
        raise error

    return replace(STAGES[name], run=run)


@pytest.mark.slow
def test_a_failing_stage_is_recorded_and_the_next_stage_runs(tmp_path, monkeypatch):
    monkeypatch.setitem(STAGES, "patching", _raises("patching", RuntimeError("CUDA error: out of memory")))
    monkeypatch.setitem(STAGES, "probes", _raises("probes", MemoryError()))
    with pytest.warns(UserWarning, match="'patching' failed: RuntimeError: CUDA error: out of memory"):
        out = write_report("zoo:add-100", out=tmp_path / "r.html", stages=["accuracy", "patching", "probes", "fourier"],
                           limit=200, progress=False)
    text = out.read_text()
    assert_complete_html(text)
    states = stage_states(text)
    assert states["Activation patching"].startswith("failed: ")
    assert states["Linear probes"].startswith("failed: ")
    assert states["Fourier features and the helix"].startswith("done: ")  # ran after the failures
    assert "Failed: RuntimeError: CUDA error: out of memory" in html.unescape(text)
    assert "Failed for lack of memory (MemoryError); give the report more (--max-memory)" in html.unescape(text)
    assert ("Finished with gaps: 2 of 4 stages state findings; 2 failed. Failed: the reasons are in their sections."
            in text)


def test_an_interrupted_report_says_so_and_stops(tmp_path, monkeypatch):
    monkeypatch.setitem(STAGES, "probes", _raises("probes", KeyboardInterrupt()))
    out = tmp_path / "r.html"
    with pytest.raises(KeyboardInterrupt):
        write_report("zoo:add-100", out=out, stages=["accuracy", "patching", "probes", "fourier"], limit=200,
                     progress=False)
    text = out.read_text()
    assert_complete_html(text)
    states = stage_states(text)
    assert states["Accuracy and error profile"].startswith("done") and states["Activation patching"].startswith("done")
    assert states["Linear probes"].startswith("interrupted")
    assert states["Fourier features and the helix"] == "not yet run"
    assert "Interrupted: 2 of 4 stages finished before the run was stopped." in text
    assert section_titles(text) == ["Accuracy and error profile", "Activation patching"]


def test_fit_samples_what_the_share_holds_and_says_what_budget_the_minimum_needs(tiny_model):
    items = torch.arange(1000)
    ctx = Context(tiny_model, "tiny", None, None, None, None, seed=3, budget=Budget(seconds=1.0, total=10.0))
    count, seconds, sentence = ctx.fit(items, "pairs", 30, lambda k: 0.5 + 0.01 * k)  # 50 fit in the second
    assert count == 50 and seconds == pytest.approx(1.0)
    assert sentence == "sampled 50 of 1,000 pairs to fit its 1 s share"
    picked = ctx.pick(items, count)
    assert torch.equal(picked, picked.unique()) and bool((picked < 1000).all())  # a sorted subset, no repeats
    assert torch.equal(_seeded_pick(1000, 95, 3), _seeded_pick(1000, 95, 3))  # seeded: the same call, the same sample
    assert not torch.equal(_seeded_pick(1000, 95, 3), _seeded_pick(1000, 95, 4))
    # not even the minimum: refused before any work, with what it would take and the budget that would run it
    with pytest.raises(OverBudget, match=r"the minimum of 30 pairs takes about 1.2 s of model work at the reference "
                                         r"rate, more than the 1 s this stage could have of the 10 s budget; a budget "
                                         r"of about 20 s would run it") as refused:
        ctx.fit(items, "pairs", 30, lambda k: 0.9 + 0.01 * k)
    assert refused.value.seconds == pytest.approx(1.2)  # the price the planner reserves for the minimum
    everything = Context(tiny_model, "tiny", None, None, None, None).fit(items, "pairs", 30, lambda k: 1.0 * k)
    assert everything == (1000, 1000.0, "")  # no budget given: nothing sampled


def test_a_stage_a_few_seconds_short_borrows_them_and_one_further_short_says_what_it_needs(tiny_model):
    """Minimums are reserved in the page's order: one that overruns the budget by less than BORROW of
    it borrows the difference (and says so); one short by more is not run, before any stage runs, with
    the budget that would run it; what is left is shared by weight."""
    from arithinterp.report.budget import BORROW
    from arithinterp.report.stage import Stage

    def stage(name: str, minimum: float, weight: float = 1.0) -> Stage:
        def plan(ctx: Context) -> StagePlan:  # the minimum, or as much more (up to 4×) as the share holds
            if ctx.budget.seconds < minimum:
                raise report_budget.over_budget(ctx.budget, f"{name}'s minimum", minimum)
            return StagePlan(dict(work=min(ctx.budget.seconds, 4 * minimum)), min(ctx.budget.seconds, 4 * minimum))

        return Stage(name=name, title=name, order=0, weight=weight, run=lambda ctx: None, plan=plan)

    ctx = Context(tiny_model, "tiny", None, None, None, None)
    stages = [stage("first", 30.0), stage("second", 65.0), stage("third", 50.0)]
    assert BORROW * 100 == 10.0
    # 100 s: 30 + 65 fit, the third's 50 s would reach 45 s past the budget (more than 10 s): not run
    plans = plan_stages(ctx, stages, 100.0, 100.0, None)
    assert [plans["first"].seconds, plans["second"].seconds] == [pytest.approx(30.0 + 5.0 / 2), pytest.approx(67.5)]
    assert isinstance(plans["third"], OverBudget)
    assert re.search(r"third's minimum takes about 50 s .* more than the 5 s this stage could have of the 100 s "
                     r"budget; a budget of about 150 s would run it", str(plans["third"])), str(plans["third"])
    # 140 s: the three minimums (145 s) are 5 s short, within 10% of the budget: the third borrows them
    plans = plan_stages(ctx, stages, 140.0, 140.0, None)
    assert [p.seconds for p in plans.values()] == [30.0, 65.0, 50.0]
    assert plans["third"].sample == "its minimum borrowed 5 s beyond the 140 s budget" and not plans["first"].sample


def test_fit_layers_covers_the_layers_that_fit_and_says_so(tiny_model):
    """Not even the minimum of items fits at every layer: the minimum over evenly spread layers (the
    first and the last among them), as many as the cost per layer allows."""
    import arithinterp.report as report

    assert spread(30, 4) == [0, 10, 19, 29] and spread(30, 1) == [29] and spread(5, 9) == [0, 1, 2, 3, 4]
    assert report.coarse_to_fine([0, 2, 5, 7]) == [7, 0, 5, 2]
    items = torch.arange(200)

    def cost(count: int, n_layers: int) -> float:  # 1 ms per item and 2 ms per item and layer
        return count * (0.001 + 0.002 * n_layers)

    ctx = Context(tiny_model, "tiny", None, None, None, None, seed=1, budget=Budget(seconds=2.0, total=20.0))
    count, layers, seconds, sentence = ctx.fit_layers(items, "pairs", 30, 30, cost)  # 30 at every layer: 1.83 s
    assert layers == list(range(30)) and count == 32 and sentence == "sampled 32 of 200 pairs to fit its 2 s share"
    ctx.budget = Budget(seconds=1.0, total=20.0)  # 0.03 s + 60 ms a layer: 16 layers
    count, layers, seconds, sentence = ctx.fit_layers(items, "pairs", 30, 30, cost)
    assert count == 30 and layers == spread(30, 16) and layers[0] == 0 and layers[-1] == 29 and seconds <= 1.0
    assert sentence == (f"sampled 30 of 200 pairs and 16 of 30 layers ({', '.join(map(str, layers))}) to fit its 1 s "
                        "share: every layer would take about 1.8 s")
    _, first, _, _ = ctx.fit_layers(items, "pairs", 30, 30, cost, first=[12])
    assert 12 in first and len(first) == 16 and first == looking_first_at(spread(30, 16), [12])
    ctx.budget = Budget(seconds=0.05, total=20.0)
    with pytest.raises(OverBudget, match=r"the minimum of 30 pairs at a single layer takes about 0.09 s"):
        ctx.fit_layers(items, "pairs", 30, 30, cost)


def _plans(outcome: dict) -> dict:
    return {name: (p.choices, round(p.seconds, 9), p.sample, round(p.share, 9)) if isinstance(p, StagePlan)
            else f"{type(p).__name__}: {p}" for name, p in outcome.items()}


def test_every_stages_plan_is_the_same_under_any_clock(six_layer_llama, monkeypatch):
    """The plans read no clock: planned under a clock that barely moves, under one that jumps an hour
    at every reading, and under the real one, every stage's sample, layers, steps and cost are the
    same — the same command gives the same plan on a fast, slow or busy machine."""
    model, prompts, pairs = six_layer_llama
    evaluation = prompts.evaluate(model)
    heavy = [STAGES[name] for name in ("patching", "digits", "probes", "fourier", "neurons", "circuits", "causal")]

    def planned() -> dict:
        ctx = Context(model, "llama6", prompts, prompts, evaluation, pairs, seed=0, correct_only=False,
                      task_prompts=prompts)
        return _plans(plan_stages(ctx, heavy, 40.0, 40.0, 2**28))

    reference = planned()
    assert all(isinstance(p, tuple) for p in reference.values()), reference  # every heavy stage planned to run
    # a share that holds some of every stage, not all of it: the plans sample, so a clock could have moved them
    assert any(p[2] for p in reference.values()), reference
    for step in (1e-9, 3600.0):
        now = [0.0]

        def clock(now=now, step=step) -> float:
            now[0] += step
            return now[0]

        with monkeypatch.context() as patch:
            for name in ("perf_counter", "monotonic", "time", "process_time"):
                patch.setattr(time, name, clock)
            assert planned() == reference, step


def _some_layers(ctx: Context, stage) -> StagePlan:
    """``stage``'s plan in the smallest share (growing from the price of its minimum at one layer) in
    which it covers more than one layer."""
    ctx.budget = Budget(0.0, total=1.0)
    with pytest.raises(OverBudget) as priced:  # the price of the minimum at one layer
        stage.plan(ctx)
    share = priced.value.seconds
    while True:
        share *= 1.25
        ctx.budget = Budget(share, total=10.0)
        plan = stage.plan(ctx)
        layers = plan.choices["layers"]  # a count, the layers, or None for all of them
        if layers is None or (layers if isinstance(layers, int) else len(layers)) > 1:
            return plan


def test_the_heavy_stages_run_their_plans_sampled_along_several_axes(six_layer_llama):
    """Each heavy stage planned in a share in which its minimum fits at a few layers (or steps) but
    not at all of them runs on the minimum of items over a sample of the layers (circuits: fewer
    integration steps, a shorter curve), and its sample line says exactly what."""
    model, prompts, pairs = six_layer_llama
    n_layers = model.cfg.n_layers
    ctx = Context(model, "llama6", prompts, prompts, prompts.evaluate(model), pairs, seed=0, correct_only=False)
    for name, what in (("patching", "pairs"), ("digits", "prompts"), ("neurons", "prompts")):
        stage = STAGES[name]
        plan = _some_layers(ctx, stage)
        assert plan.seconds <= ctx.budget.seconds
        ctx.planned = plan
        section = stage.run(ctx)
        ctx.planned = None
        found = re.search(rf"sampled {MINIMUMS[name][0]} of [\d,]+ {what} and (\d) of {n_layers} layers \(([\d, ]+)\)",
                          section.sample)
        assert found and 1 < int(found.group(1)) < n_layers, (name, section.sample)
        assert [int(v) for v in found.group(2).split(", ")] == spread(n_layers, int(found.group(1)))
        assert section.findings and section.figures  # it ran: findings and figures, not a skip
        if name == "patching":  # the named positions, when the span at every layer does not fit
            assert "positions a, b, final, a[0], b[0] only" in section.sample
    ctx.budget = Budget(0.0, total=1.0)
    with pytest.raises(OverBudget, match="EAP-IG at one step on the minimum of 30 pairs and a faithfulness curve of "
                                         f"{CURVE_SIZES} sizes on {CURVE_PAIRS} of them") as priced:
        STAGES["circuits"].plan(ctx)
    ctx.budget = Budget(priced.value.seconds * 1.5, total=10.0)
    plan = STAGES["circuits"].plan(ctx)
    assert plan.choices["steps"] < STEPS and plan.choices["sizes"][0] == 0 and len(plan.choices["sizes"]) >= CURVE_SIZES
    ctx.planned = plan
    circuit = STAGES["circuits"].run(ctx).sample
    assert re.search(r"sampled 30 of [\d,]+ pairs with \d of EAP-IG's 5 default integration steps", circuit), circuit
    assert re.search(r"the faithfulness curve on \d+ of them at \d+ of \d+ sizes", circuit), circuit


@pytest.mark.slow
def test_a_faithfulness_curve_too_coarse_to_locate_a_circuit_says_so(six_layer_llama, monkeypatch):
    """A curve measured at a few sizes bounds the circuit between the sizes measured; one whose only
    size restoring 0.9 is the whole graph says it is too coarse to locate a circuit, never that the
    whole graph is the circuit."""
    import dataclasses

    from arithinterp import circuits

    model, prompts, pairs = six_layer_llama
    ctx = Context(model, "llama6", prompts, prompts, prompts.evaluate(model), pairs, seed=0, correct_only=False)
    ctx.budget = Budget(0.0, total=1.0)
    with pytest.raises(OverBudget) as priced:
        STAGES["circuits"].plan(ctx)
    ctx.budget = Budget(priced.value.seconds, total=10.0)
    ctx.planned = STAGES["circuits"].plan(ctx)  # the minimum: the curve at a few sizes
    sizes = ctx.planned.choices["sizes"]
    assert sizes is not None and len(sizes) == CURVE_SIZES
    real = circuits.faithfulness_curve
    for reaching, said in ((len(sizes) - 1, "is too coarse to locate a circuit"),
                           (2, f"has more than {sizes[1]:,} and at most {sizes[2]:,} edges")):
        def curve(*args, reaching=reaching, **kwargs):  # restores 0.9 from the size at index `reaching` on
            measured = real(*args, **kwargs)
            values = torch.tensor([0.0, 0.3, 0.6, 0.8][:reaching] + [1.0] * (len(sizes) - reaching))
            return dataclasses.replace(measured, faithfulness=values, ci_low=values - 0.01, ci_high=values + 0.01,
                                       meta=dict(measured.meta, denominator=dict(distinguishable=True)))

        monkeypatch.setattr(circuits, "faithfulness_curve", curve)
        finding = STAGES["circuits"].run(ctx).findings[0]
        assert said in finding, finding
        assert "100% of all" not in finding and "100.0% of all" not in finding


def test_per_digit_heads_sample_the_layers_where_patching_saw_the_operand_arrive(six_layer_llama):
    """With a share for some layers only, the per-digit stage covers the blocks the patching stage
    located (:attr:`Context.arrival_layers`) and the spread's others, and says so; without them, the spread."""
    model, prompts, pairs = six_layer_llama
    n_layers = model.cfg.n_layers
    samples = {}
    for arrival in ([], [1]):
        ctx = Context(model, "llama6", prompts, prompts, prompts.evaluate(model), pairs, seed=0, correct_only=False,
                      arrival_layers=arrival)
        ctx.planned = _some_layers(ctx, STAGES["digits"])
        section = STAGES["digits"].run(ctx)
        found = re.search(rf"and (\d) of {n_layers} layers \(([\d, ]+)\)", section.sample)
        assert found and 1 < int(found.group(1)) < n_layers, section.sample
        samples[tuple(arrival)] = [int(v) for v in found.group(2).split(", ")], section.sample
    spread_layers, plain = samples[()]
    located, sample = samples[(1,)]
    assert 1 not in spread_layers and "where patching" not in plain
    assert located == sorted(looking_first_at(spread_layers, [1])) and len(located) == len(spread_layers)
    assert "layer 1 among them, where patching saw the varied operand reach the answer position" in sample


def test_the_probes_stage_keeps_its_prompts_and_gives_up_layers_first(digit_tokenizer):
    """Every prompt at as many layers (coarse to fine) as the share holds; prompts are sampled only
    when not even PROBE_LAYERS layers fit with all of them."""
    import arithinterp.report as report
    from arithinterp.tasks import arithmetic
    from conftest import tiny_bridge

    model = tiny_bridge(digit_tokenizer, n_layers=8)
    prompts = arithmetic(model, "+", range(10, 40), range(10, 40))[:150]
    ctx = Context(model, "tiny", prompts, prompts, None, None, seed=0)
    assert probes_module._probe_targets(prompts) == ("a_units", "carry_tens", "answer_tens", "answer_units")
    ctx.budget = Budget(total=1.0)
    every = STAGES["probes"].plan(ctx)
    assert every.choices == dict(prompts=150, layers=list(range(8))) and every.sample == ""

    def planned(share: float):
        ctx.budget = Budget(share * every.seconds, total=100.0)
        return STAGES["probes"].plan(ctx)

    order = report.coarse_to_fine(list(range(8)))
    some = planned(0.7)  # every prompt, at the layers that fit: coarse to fine
    n_layers = len(some.choices["layers"])
    assert some.choices == dict(prompts=150, layers=sorted(order[:n_layers])) and report.PROBE_LAYERS <= n_layers < 8
    assert some.sample == (f"probed at {n_layers} of 8 layers ({', '.join(map(str, some.choices['layers']))}) to fit "
                           f"its {report.secs(ctx.budget.seconds)} share")
    # shrinking the share: every prompt down to PROBE_LAYERS layers, and only then fewer prompts, at PROBE_LAYERS
    share, last = 0.7, some
    while True:
        share *= 0.95
        try:
            plan = planned(share)
        except OverBudget:
            break
        if plan.choices["prompts"] < 150:
            assert len(last.choices["layers"]) == report.PROBE_LAYERS and last.choices["prompts"] == 150
            assert 60 <= plan.choices["prompts"] and plan.choices["layers"] == sorted(order[:report.PROBE_LAYERS])
            assert plan.sample.startswith(f"sampled {plan.choices['prompts']} of 150 prompts to fit its")
            break
        assert len(plan.choices["layers"]) >= report.PROBE_LAYERS
        last = plan
    assert last.choices["layers"] == sorted(order[:report.PROBE_LAYERS])


def test_the_evaluation_goes_on_past_its_share_until_the_stages_have_their_correct_prompts(add100, monkeypatch):
    """Deterministic: the prompts of the evaluation's share first, then rounds until the stages'
    minimum of correct prompts, within the cap; with a cap too small the sentence says how many
    prompts it would take."""
    from arithinterp.report.evaluation import evaluate_planned
    from arithinterp.tasks import Evaluation, PromptSet

    model, prompts = add100

    def evaluate(self, model, batch_size=None, progress=False, writes=()):  # every 10th a is answered correctly
        correct = self.a % 10 == 0
        return Evaluation(correct, self.answer.clone(), [str(int(v)) for v in self.answer], self.answer_tokens.clone())

    monkeypatch.setattr(PromptSet, "evaluate", evaluate)
    kept, evaluation, note = evaluate_planned(model, prompts, 200, 4000, 100, 64, seed=0)
    assert int(evaluation.correct.sum()) >= 100 and 200 < len(kept) < 1200, note
    assert note == (f"sampled {len(kept):,} of 4,000 prompts (200 for the evaluation's share, then more to reach 100 "
                    "correct)")
    again = evaluate_planned(model, prompts, 200, 4000, 100, 64, seed=0)
    assert torch.equal(again[0].tokens, kept.tokens)  # the same prompts: the counts decide, not a clock
    kept, evaluation, note = evaluate_planned(model, prompts, 200, 400, 100, 64, seed=0)
    assert len(kept) == 400 and int(evaluation.correct.sum()) < 100
    assert re.search(r"fewer than the 100 the stages need: at this accuracy \(\d+\.\d%\) that takes about [\d,]+ "
                     r"prompts; give the report more time", note), note
    few = prompts[prompts.a < 20]  # 800 prompts, 80 of them correct
    _, evaluation, note = evaluate_planned(model, few, 200, 4000, 100, 64, seed=0)
    assert len(evaluation) == 800 and "all 800 prompts hold only 80" in note and "--operands" in note


def test_the_error_stage_plans_for_the_detector_on_its_own_or_says_what_it_would_need():
    """The detector as it runs alone (every prompt of the task, its whole layer search) when the share
    holds it; else fewer layer candidates, coarse to fine, and the sample line says what the detector
    alone would take and the budget that would give it that."""
    import arithinterp as ai
    import arithinterp.report as report
    from arithinterp.models.zoo import task_prompts

    model = ai.load_model("zoo:add-3digit-weak")  # 2 layers: candidates [1], [0], [0, 1]
    prompts = task_prompts(model, "zoo:add-3digit-weak", 900, 0)
    evaluation = prompts.evaluate(model)
    assert int((~evaluation.correct).sum()) >= 50  # the model's own errors are detected
    ctx = Context(model, "zoo:add-3digit-weak", prompts.correct_only(model), prompts, evaluation, None,
                  task_prompts=prompts)
    ctx.budget = Budget(total=1.0)
    alone = STAGES["errors"].plan(ctx)
    assert alone.choices == dict(prompts=900, candidates=3) and alone.sample == ""
    ctx.budget = Budget(0.99 * alone.seconds, total=100.0)
    short = STAGES["errors"].plan(ctx)
    assert short.choices["prompts"] == 900 and short.choices["candidates"] == 2
    assert re.fullmatch(r"the detector on its own \(all 900 prompts of zoo:add-3digit-weak, its 3 layer candidates\) "
                        r"would take about [\d.]+ s of model work, more than this stage's [\d.]+ s share: a budget of "
                        r"about [\d,]+ s would give it that", short.sample), short.sample
    ctx.planned = short
    section = report.error_detector_stage(ctx)
    assert "searched 2 of its 3 layer candidates, spread over the depth (the last layer first)" in section.sample
    assert "the detector at layers [1]" in section.findings[0]


def test_all_prompts_are_analysed_when_asked_for(tmp_path, llama_folder):
    """correct_only=False: a random Llama that answers nothing still gets its analyses, on every
    evaluated prompt, each scored on the true answers — and the page says so."""
    out = write_report(str(llama_folder("digit")), out=tmp_path / "r.html", stages=["accuracy", "patching"],
                       template="{a}+{b}=", few_shot=2, operands="10-29", limit=120, correct_only=False, progress=False)
    text = html.unescape(out.read_text())
    assert "prompts analysed: all, answered correctly or not" in text
    assert re.search(r"answers 0 of 120 prompts correctly \(0\.0%\); the analyses below use all 120, answered "
                     r"correctly or not", text)
    states = stage_states(out.read_text())
    assert states["Activation patching"].startswith("done"), states
    with pytest.raises(ConfigError, match="correct_only=.yes. is not accepted .*correct_only accepts True or False"):
        write_report("zoo:add-100", out=tmp_path / "x.html", correct_only="yes",  # pyright: ignore[reportArgumentType]
                     progress=False)


def test_a_small_budget_plans_the_heavy_stages_or_says_what_budget_they_need(tmp_path, capsys):
    out = write_report("zoo:add-100", out=tmp_path / "r.html", stages=["patching", "probes", "neurons", "circuits"],
                       limit=400, budget=1.0)
    # the probes' minimum (60 prompts at every layer, with the random-init control) is seconds more than the whole
    # budget: said on the command line with the plan, before any stage runs
    said = capsys.readouterr().err
    plan_line = re.search(r"report plan: probes will not run\. Not run within the budget: the minimum of 60 prompts "
                          r"takes about [\d.]+ s .*?a budget of about [\d,]+ s would run it", said)
    assert plan_line and said.index("report plan: probes") > said.index("report plan: "), said
    assert_complete_html(out.read_text())  # escaped as written: a viewer's page is inside an attribute
    text = html.unescape(out.read_text())
    states = stage_states(out.read_text())
    assert states["Linear probes"].startswith("skipped (over budget)")
    for name in ("Activation patching", "Linear probes", "Heuristic neurons",
                 "Circuit: edges from the operands to the answer"):
        state = states[name]
        if state.startswith("done"):
            assert re.search(r"\(([\d.]+) s of model work planned of its ([\d.]+) s share", state), state
            sampled = re.search(r"sampled ([\d,]+) of ([\d,]+) (pairs|prompts)", state)
            if sampled:  # fewer than there are, at least the minimum
                k, n = (int(g.replace(",", "")) for g in sampled.groups()[:2])
                assert 30 <= k <= n, state
        else:  # not even the minimum fits: said before the run, with the budget that would run it
            assert state.startswith("skipped (over budget)"), state
            found = re.search(rf"<h2>{re.escape(name)}</h2>.*?Not run within the budget: .*? takes about [\d.]+ s of "
                              r"model work at the reference rate, .*?a budget of about ([\d,]+) s would run it", text,
                              re.S)
            assert found and int(found.group(1).replace(",", "")) > 1, state
    assert "budget: 1 s of model work at the reference rate" in text
    assert not all(s.startswith("done") and "sampled" not in s for n, s in states.items() if n != "Evaluating the task")


def _findings(page: str) -> list[str]:
    """Every section's sample, findings and figure data (timings left out)."""
    lines = []
    for title, body in re.findall(r"<section><h2>(.*?)</h2>(.*?)</section>", page, re.S):
        lines += [title, *re.findall(r"<p class='sample'>(.*?)</p>", body), *re.findall(r"<li>(.*?)</li>", body, re.S)]
        lines += re.findall(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{", body, re.S)
    return lines


@pytest.fixture(scope="module")
def planned_page(tmp_path_factory):
    """A zoo report whose small budget makes its stages sample, and its recorded plan."""
    out = tmp_path_factory.mktemp("plan") / "planned.html"
    write_report("zoo:add-100", out=out, stages=["accuracy", "patching", "circuits"], limit=200, budget=4.0,
                 progress=False)
    return out


def test_the_page_records_its_plan_and_replaying_it_gives_the_same_page(planned_page, tmp_path):
    record = read_plan(planned_page)
    assert record.model == "zoo:add-100" and record.budget == 4.0 and record.task.seed == 0
    assert record.task.stages == ["accuracy", "patching", "circuits"] and 0 < record.evaluated <= 200
    assert record.stages["patching"].choices["pairs"] >= MINIMUMS["patching"][0]
    assert sum(s.seconds for s in record.stages.values()) <= record.budget  # the plan fits its budget
    from arithinterp.cli import main

    # `arithinterp report --plan PAGE.html`: the plan's model and task, no option repeated
    assert main(["report", "--plan", str(planned_page), "--out", str(tmp_path / "again.html"), "--no-progress"]) == 0
    again = tmp_path / "again.html"
    assert read_plan(again) == record
    assert _findings(again.read_text()) == _findings(planned_page.read_text())
    assert f"plan: replayed from {planned_page}" in html.unescape(again.read_text())


def test_a_plan_is_refused_for_another_task_or_model(planned_page, tmp_path):
    from arithinterp.errors import ModelMismatchError
    from arithinterp.models import load_model, random_like

    with pytest.raises(ConfigError, match=r"plan: seed=1 differs from the plan's seed=0 in .*planned\.html; leave "
                                          r"seed out to replay the plan"):
        write_report(plan=planned_page, seed=1, out=tmp_path / "r.html", progress=False)
    with pytest.raises(ConfigError, match="a replayed plan keeps the budget it was made with"):
        write_report(plan=planned_page, budget=10, out=tmp_path / "r.html", progress=False)
    other = random_like(load_model("zoo:add-100"), seed=5)
    with pytest.raises(ModelMismatchError, match=r"was made for zoo:add-100 \(weights fingerprint [0-9a-f]+\), not"):
        write_report(other, plan=planned_page, out=tmp_path / "r.html", progress=False)
    (tmp_path / "plain.html").write_text("<html><body>a page</body></html>")
    with pytest.raises(ConfigError, match="holds no report plan"):
        write_report(plan=tmp_path / "plain.html", out=tmp_path / "r.html", progress=False)
    damaged = planned_page.read_text().replace('"budget":4.0', '"budget":"four"')
    (tmp_path / "damaged.html").write_text(damaged)
    with pytest.raises(ConfigError, match="is damaged or of another layout"):
        write_report(plan=tmp_path / "damaged.html", out=tmp_path / "r.html", progress=False)
    assert not (tmp_path / "r.html").exists()  # refused before any work


def test_a_deadline_fits_the_wall_clock_and_the_page_says_its_samples_depend_on_the_machine(tmp_path):
    out = write_report("zoo:add-100", out=tmp_path / "r.html", stages=["accuracy", "patching"], limit=100,
                       deadline=60, progress=False)
    text = html.unescape(out.read_text())
    assert "budget: 60 s on this machine (deadline): its samples depend on the machine" in text
    assert read_plan(out).deadline == 60
    with pytest.raises(ConfigError, match=r"give budget= .* or deadline= .*, not both"):
        write_report("zoo:add-100", out=tmp_path / "x.html", budget=60, deadline=60, progress=False)


def test_the_thread_count_changes_no_finding(tmp_path, monkeypatch):
    """Two runs of the same report on one thread and on two give the same findings, samples and figure
    data: the thread count follows the free CPUs, the numbers do not."""
    import arithinterp.report as report

    pages = []
    for threads in (1, 2):
        monkeypatch.setattr(report, "choose_threads", lambda threads=threads: threads)
        out = write_report("zoo:add-100", out=tmp_path / f"t{threads}.html", stages=["accuracy", "patching"],
                           limit=150, budget=2.0, progress=False)
        text = out.read_text()
        assert f"{threads} thread{'s' * (threads > 1)})" in text
        pages.append(text)
    assert _findings(pages[0]) == _findings(pages[1])


def test_threads_follow_the_cpus_the_process_may_use_and_that_are_free(tmp_path, monkeypatch):
    from arithinterp.report import threads

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "a" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpus(tmp_path, "/a/b") == 1.5  # the smallest quota on the way up
    assert threads.cgroup_cpus(tmp_path, "/") is None
    monkeypatch.setattr(threads, "allowed_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(threads, "cgroup_cpus", lambda: 2.5)
    assert threads.usable_cpus() == 2  # a quota of 2.5 CPUs holds two threads, not three
    assert [threads.choose_threads(free) for free in (0.0, 0.7, 0.8, 1.9, 4.0)] == [1, 1, 1, 2, 2]
    assert threads.products_thread_invariant()  # MKL's strict reproducible mode, set when arithinterp is imported


@pytest.mark.slow
def test_a_random_llama_with_few_shot_prompts_gets_a_complete_page_within_a_small_budget(tmp_path, llama_folder):
    folder = str(llama_folder("digit"))
    out = write_report(folder, out=tmp_path / "r.html", template="{a}+{b}=", few_shot=2, operands="10-59",
                       limit=2000, budget=3.0, max_memory="256MiB", progress=False)
    text = out.read_text()
    assert_complete_html(text)
    states = stage_states(text)
    gaps = [s for s in states.values() if s.startswith(("not enough data", "skipped", "failed"))]
    # "Complete" only when every stage found something or does not apply; else the gaps and what to change
    assert ("Complete: " in text) == (not gaps) and ("Finished with gaps: " in text) == bool(gaps), states
    assert set(states) == {"Evaluating the task", *STAGE_TITLES.values()}
    assert all(s.startswith(("done", "not enough data", "not run", "skipped")) for s in states.values()), states
    planned = (r"(: [\d.]+ s \([\d.]+ s of model work planned of its [\d.]+ s share|^not run: |^not enough data: "
               r"|^skipped)")
    assert all(re.search(planned, s) for t, s in states.items() if t != "Evaluating the task"), states
    evaluated = re.search(r"sampled ([\d,]+) of 2,000 prompts", states["Evaluating the task"])
    assert (evaluated and 16 <= int(evaluated.group(1).replace(",", "")) < 2000) or re.search(
        r"all 2,000 prompts evaluated", states["Evaluating the task"]), states["Evaluating the task"]
    # every section says what it rests on, or why it drew nothing
    for title, body in re.findall(r"<section><h2>(.*?)</h2>(.*?)</section>", text, re.S):
        assert re.search(r"class='sample'>sample: \d+ |<li>(Not enough data|Not run|Failed)", body), title
    assert "memory: 256 MiB per stage" in text
    # a budget that fits them all evaluates every prompt
    roomy = write_report(folder, out=tmp_path / "roomy.html", stages=["accuracy"], template="{a}+{b}=", few_shot=2,
                         operands="10-59", limit=300, budget=10_000, progress=False)
    assert "all 300 prompts evaluated" in roomy.read_text()


@pytest.mark.parametrize("name", sorted(MINIMUMS))
def test_not_enough_data_sentences_are_grammatical(name):
    minimum, what = MINIMUMS[name]
    sentences = [str(NotEnoughData(name, n, who)) for n in (0, minimum - 1) for who in ("this stage", "the helix test")]
    sentences.append(require(name, minimum) + ".")
    for sentence in sentences:
        assert not re.search(r"[,;:]\s*[,;:.]|\.\.|\s[,;.]|\s\s|,$", sentence), sentence
        assert sentence[0].isupper() or sentence[0].isdigit()
        assert sentence.endswith(".") and not sentence.endswith("..")
    assert not what.endswith((",", ";", ".")) and what == what.strip()


def test_budget_and_memory_are_validated(tmp_path, capsys):
    from arithinterp.cli import main

    assert parse_memory("2GiB") == 2 * 2**30 and parse_memory("512MB") == 512 * 2**20 and parse_memory(2**30) == 2**30
    for bad in ("lots", "-1GB", "1KB"):
        with pytest.raises(ConfigError, match="max_memory"):
            parse_memory(bad)
    bad: Any
    for bad in (0, -5, float("nan"), "60"):
        with pytest.raises(ConfigError, match="budget must be seconds from 1"):
            write_report("zoo:add-100", out=tmp_path / "r.html", stages=["accuracy"], budget=bad, progress=False)
    code = main(["report", "zoo:add-100", "--stages", "accuracy", "--max-memory", "lots", "--out",
                 str(tmp_path / "r.html"), "--no-progress"])
    assert code == 2 and "max_memory='lots' is not accepted" in capsys.readouterr().err
    code = main(["report", "zoo:add-100", "--stages", "accuracy", "--budget", "30", "--limit", "50", "--out",
                 str(tmp_path / "r.html"), "--no-progress"])
    assert code == 0 and "budget: 30 s" in (tmp_path / "r.html").read_text()


@pytest.fixture(scope="module")
def six_layer_llama(tmp_path_factory):
    """A random 6-layer Llama (digit tokens) and its few-shot 2-digit prompts, every one analysed."""
    from families import save_llama, tokenizer_for

    from arithinterp.models import load_model
    from arithinterp.report.evaluation import report_prompts

    folder = save_llama(tmp_path_factory.mktemp("llama6"), tokenizer_for("digit"), n_layers=6)
    model = load_model(str(folder))
    prompts = report_prompts(model, "llama6", 300, 0, "{a}+{b}=", 2, "10-59")
    pairs = prompts.counterfactual(vary="a", seed=0, distinct_first_token=True)
    return model, prompts, pairs


def test_patching_locates_where_the_operand_arrives_only_when_its_layers_pin_it_down():
    from types import SimpleNamespace

    from arithinterp.report.stages.patching import arrival_layers

    def resid(layers, restored, positions=("a", "b", "final")):  # restored: at the final position, per layer
        mean = torch.zeros(len(layers), len(positions))
        mean[:, list(positions).index("final") if "final" in positions else -1] = torch.tensor(restored)
        return SimpleNamespace(layers=layers, positions=list(positions), mean=mean)

    # resid_pre at layer 13 holds what blocks up to 12 wrote: the operand arrived in block 12
    assert arrival_layers(resid([0, 6, 12, 13, 17], [0.0, 0.02, 0.1, 0.95, 1.0]), 18) == [12]
    assert arrival_layers(resid([0, 10, 12, 17], [0.0, 0.1, 0.9, 1.0]), 18) == [10, 11]
    assert arrival_layers(resid([0, 5], [0.0, 0.9]), 6) == []  # blocks 0-4: a quarter of the depth does not hold it
    assert arrival_layers(resid([0, 6, 12, 17], [0.0, 0.1, 0.2, 0.3]), 18) == []  # never half restored
    assert arrival_layers(resid([0, 1, 2], [0.0, 0.6, 1.0], positions=(3, 4, 5)), 3) == [0]  # the last index is final
    assert looking_first_at([0, 3, 6, 8, 11, 14, 17], [12]) == [0, 3, 6, 8, 11, 12, 17]  # the finest drops out
    assert looking_first_at([0, 17], [11, 12, 13]) == [11, 12]  # as many as the budget affords, no more
    assert looking_first_at([0, 9, 17], []) == [0, 9, 17]


def test_the_neurons_stage_hands_its_memory_budget_to_the_classification(tmp_path, monkeypatch):
    """The ranking runs a backward: its batches are sized by ``classify`` from the stage's
    ``max_memory``, not fixed by the report from a forward-only estimate."""
    from arithinterp import neurons
    from arithinterp.errors import AnalysisError

    calls: list = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        raise AnalysisError("recorded")  # the call is what this test checks; the stage then says "not run"

    monkeypatch.setattr(neurons, "classify", spy)
    with pytest.warns(UserWarning, match="recorded"):
        write_report("zoo:add-100", out=tmp_path / "r.html", stages=["neurons"], limit=300, budget=10_000,
                     max_memory="64MiB", progress=False)
    assert calls and all(c.get("max_memory") == 64 * 2**20 and c.get("batch_size") is None for c in calls), calls


def test_accuracy_drops_read_as_points_never_as_a_signed_zero():
    from arithinterp.report.stages.digits import _points

    assert _points(0.123) == "−12 points" and _points(0.004) == "−0.4 points" and _points(-0.02) == "+2.0 points"
    assert _points(0.0) == _points(-0.0) == _points(0.0004) == "no drop"


def test_a_stage_refusing_the_architecture_says_so_before_counting_data(add100, monkeypatch):
    """With no correctly answered prompts, a model whose residual stream is no sum of its parts gets
    "not run on this model" from the circuits stage, not "not enough data" (more data would not help)."""
    from arithinterp import report
    from arithinterp.engine import edges
    from arithinterp.errors import AnalysisError

    model, prompts = add100
    ctx = Context(model, "zoo:add-100", prompts[:0], prompts, None, None)
    with pytest.raises(NotEnoughData):  # the zoo model's edges apply: then the data is counted
        report.circuits_stage(ctx)

    def refuse(model, tokens):
        raise AnalysisError("this model's residual stream is not the sum of the embeddings, head and MLP outputs")

    monkeypatch.setattr(edges, "sender_outputs", refuse)
    with pytest.raises(AnalysisError, match="not the sum") as raised:
        report.circuits_stage(ctx)
    assert not isinstance(raised.value, NotEnoughData)


@pytest.fixture(scope="module")
def add100():
    import arithinterp as ai
    from arithinterp.tasks import arithmetic

    model = ai.load_model("zoo:add-100")
    return model, arithmetic(model, a=range(100), b=range(40))
