"""A report that always writes a page: rewritten as each stage ends, readable when the run is
killed, interrupted or a stage fails, and every stage within a time and memory budget that it
meets by sampling fewer prompts or pairs, saying so."""

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
                                NotEnoughData, OverBudget, parse_memory, require, spread, write_report)
from arithinterp.report.budget import seeded_pick as _seeded_pick
from arithinterp.sites import looking_first_at
from arithinterp.report.stages import circuits as circuits_module, digits as digits_module, probes as probes_module
from arithinterp.report.stages.circuits import _fit_curve

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


def test_fit_samples_what_the_time_left_allows_and_says_so(tiny_model):
    items = torch.arange(1000)
    ctx = Context(tiny_model, "tiny", None, None, None, None, seed=3, budget=Budget(seconds=1.0))
    sample, sentence = ctx.fit(items, "pairs", 30, per_item=0.01)  # about 100 fit in the second
    assert 90 <= len(sample) <= 100 and sentence == f"sampled {len(sample)} of 1,000 pairs to fit the 1 s budget"
    assert torch.equal(sample, sample.unique()) and bool((sample < 1000).all())  # a sorted subset, no repeats
    assert torch.equal(_seeded_pick(1000, 95, 3), _seeded_pick(1000, 95, 3))  # seeded: the same call, the same sample
    assert not torch.equal(_seeded_pick(1000, 95, 3), _seeded_pick(1000, 95, 4))
    # a pilot measures the cost: 0.4 s a call and 0.02 s an item; 30 items cannot fit in what is left of the second
    with pytest.raises(OverBudget, match=r"the minimum of 30 pairs would take about [\d.]+ s \([\d.]+ s, then "
                                         r"[\d.]+ s each\), more"):
        ctx.fit(items, "pairs", 30, pilot=lambda some: time.sleep(0.02 * len(some) + 0.4))
    everything, sentence = Context(tiny_model, "tiny", None, None, None, None).fit(items, "pairs", 30, per_item=1.0)
    assert len(everything) == 1000 and sentence == ""  # no budget given: nothing sampled


def test_a_pilot_counts_a_calls_fixed_cost_once_not_per_item(tiny_model, monkeypatch):
    """EAP-IG-like costs (a large cost per call, a small one per item): a pilot timed at two sizes
    fits far more items than one timing divided by its size would, and no more than fit."""
    import arithinterp.report as report

    now = [0.0]  # a clock the pilot advances: exact costs, whatever the machine's load
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    calls = []

    def pilot(some):  # 5 s a call, 0.1 s an item
        calls.append(len(some))
        now[0] += 5.0 + 0.1 * len(some)

    assert report.pilot_cost(pilot, torch.arange(100), 4) == pytest.approx((5.0, 0.1))
    assert calls == [4, 2]  # the larger first: a first call's one-off costs raise the slope, not lower it
    ctx = Context(tiny_model, "tiny", None, None, None, None, seed=0, budget=Budget(seconds=60.0))
    ctx.stage_start = now[0]
    sample, sentence = ctx.fit(torch.arange(1000), "pairs", 30, pilot=pilot)
    # the pilots took 10.6 s; of the 49.4 s left 0.85 (the margin for timing noise): (41.99 s − 5 s) / 0.1 s = 369
    # fit, where one timing divided by its items (1.35 s each) would have fitted 36
    assert len(sample) == 369 and sentence == "sampled 369 of 1,000 pairs to fit the 60 s budget"
    assert 5.0 + 0.1 * len(sample) <= ctx.seconds_left() + 1e-9  # the run itself fits what is left


def test_fit_layers_covers_the_layers_that_fit_and_says_so(tiny_model, monkeypatch):
    """Not even the minimum of items fits at every layer: the minimum over evenly spread layers (the
    first and the last among them), as many as the measured cost per layer allows."""
    import arithinterp.report as report

    assert spread(30, 4) == [0, 10, 19, 29] and spread(30, 1) == [29] and spread(5, 9) == [0, 1, 2, 3, 4]
    # stages that run their layers in groups while the time lasts cover them coarse to fine
    assert report.coarse_to_fine([0, 2, 5, 7]) == [7, 0, 5, 2]
    assert sorted(report.coarse_to_fine(list(range(9)))) == list(range(9))
    now = [100.0]  # a clock the pilot advances: the costs are exact, whatever the machine's load
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    items = torch.arange(200)
    ctx = Context(tiny_model, "tiny", None, None, None, None, seed=1, budget=Budget(seconds=2.0))

    def pilot(some, layers):  # 1 ms per item and 2 ms per item and layer: 30 items at 30 layers take 1.83 s
        now[0] += len(some) * (0.001 + 0.002 * len(layers))

    ctx.stage_start = now[0] - 1.0  # 1 s of the 2 s already spent
    sample, layers, sentence = ctx.fit_layers(items, "pairs", 30, 30, pilot)
    assert len(sample) == 30 and torch.equal(sample, sample.unique()) and bool((sample < 200).all())
    # the pilots (one item at the last layer, then 4 items and 2 at two layers and at one) took 51 ms; of the
    # 0.949 s left, 0.85 (the margin for timing noise): one layer takes 90 ms, each more 60 ms:
    # 1 + (0.807 s − 90 ms) / 60 ms = 12.9 layers
    assert layers == spread(30, 12) and layers[0] == 0 and layers[-1] == 29
    assert sentence == (f"sampled 30 of 200 pairs and 12 of 30 layers ({', '.join(map(str, layers))}) to fit the 2 s "
                        "budget: every layer would take about 1.8 s")
    first = [True]

    def once(some, layers):  # what only a first call pays (the engine's checks of the model): 0.5 s
        if first:
            first.clear()
            now[0] += 0.5
        pilot(some, layers)

    # the one-off second is spent but not counted per layer: of the 1.449 s left after it and the pilots,
    # 0.85: 1 + (1.232 s − 90 ms) / 60 ms = 20 layers (counted per layer, it would leave one)
    ctx.stage_start = now[0]
    _, layers, _ = ctx.fit_layers(items, "pairs", 30, 30, once)
    assert layers == spread(30, 20), layers
    ctx.stage_start = now[0] - 1.99
    with pytest.raises(OverBudget, match=r"the minimum of 30 pairs at a single layer would take about 0.09 s, more"):
        ctx.fit_layers(items, "pairs", 30, 30, pilot)
    # every layer fits after all: at the minimum, not at a count extrapolated from a few items' timing
    ctx.budget, ctx.stage_start = Budget(seconds=10.0), now[0]
    sample, layers, sentence = ctx.fit_layers(items, "pairs", 30, 30, pilot)
    assert len(sample) == 30 and layers == list(range(30))
    assert sentence == "sampled 30 of 200 pairs to fit the 10 s budget"
    ctx.budget = Budget(seconds=2.0)

    def stacked(some, layers):  # each layer 50 ms a call (its stacked runs) and 1 ms an item
        now[0] += len(layers) * (0.05 + 0.001 * len(some))

    # a layer's cost per call is not counted per item: the pilots take 0.369 s, and of the 1.631 s left 0.85:
    # 1 + (1.386 s − 80 ms) / 80 ms = 17.3 layers, where 13.5 ms an item and layer (the added layer's
    # pilot divided by its 4 items) would have put 0.4 s on each layer and fitted 4
    ctx.stage_start = now[0]
    _, layers, _ = ctx.fit_layers(items, "pairs", 30, 30, stacked)
    assert layers == spread(30, 17), layers

    def backward(some, layers):  # a backward down to the lowest layer asked for (0.3 ms an item and layer), shared
        now[0] += len(some) * (0.001 + 0.0003 * (30 - min(layers)) + 0.0002 * len(layers))

    # every layer costs 16 ms an item, the last alone 1.5 ms, the middle (14) and the last 6.2 ms: timed at two
    # layers, each layer looks like 4.7 ms an item (half the backward) and 12 fit; timed at every layer (shared=),
    # 0.5 ms
    ctx.stage_start = now[0]
    _, layers, _ = ctx.fit_layers(items, "pairs", 30, 30, backward)
    assert len(layers) == 12, layers
    ctx.stage_start = now[0]
    sample, layers, sentence = ctx.fit_layers(items, "pairs", 30, 30, backward, shared=True)
    assert layers == list(range(30)) and len(sample) > 30, sentence
    assert 0.016 * len(sample) <= ctx.seconds_left()  # the run at every layer fits what is left
    # the stage runs the timed work twice (the model and its control): half as many items, and both runs fit;
    # the minimum fits at every layer, so only the every-layer pilots ran (one item first, then 4 and 2)
    calls: list[int] = []
    ctx.stage_start = now[0]
    twice, layers, _ = ctx.fit_layers(items, "pairs", 30, 30, lambda some, layers: (
        calls.append(len(some)), backward(some, layers)), shared=True, copies=2)
    assert layers == list(range(30)) and calls == [1, 4, 2]
    assert abs(len(twice) - len(sample) / 2) <= 2 and 2 * 0.016 * len(twice) <= ctx.seconds_left()
    # not even one layer fits twice, but it fits once: the plan counts one run (the stage runs the model and says
    # the control did not fit) rather than none. The pilots take 51 ms; of the 0.15 s left, 0.85 (0.1275 s) holds
    # the 90 ms of 30 items at one layer once, not 180 ms twice
    ctx.stage_start = now[0] - (2.0 - 0.051 - 0.15)
    _, layers, _ = ctx.fit_layers(items, "pairs", 30, 30, pilot, copies=2)
    assert layers == [29], layers
    ctx.stage_start = now[0] - (2.0 - 0.051 - 0.1)  # not even once: not run, and the time it would take is said
    with pytest.raises(OverBudget, match=r"the minimum of 30 pairs at a single layer would take about 0.09 s, more"):
        ctx.fit_layers(items, "pairs", 30, 30, pilot, copies=2)
    # two layers: the pilot times both (the middle of 2 is layer 0), so the second one is not free: 30 items take
    # 0.3 s at one layer and 0.6 s at both, and of the 0.61 s left after the pilots, 0.85 (0.52 s) holds one
    ctx.stage_start = now[0] - 1.2
    _, layers, _ = ctx.fit_layers(items, "pairs", 30, 2, lambda some, layers: now.__setitem__(
        0, now[0] + 0.01 * len(some) * len(layers)))
    assert layers == [1], layers
    # a prior that puts one layer far beyond the time left: no pilot is run
    ctx = Context(tiny_model, "tiny", None, None, None, None, budget=Budget(seconds=2.0, forward_seconds=0.1))
    ctx.stage_start = now[0]
    with pytest.raises(OverBudget, match=r"at a single layer would take about 30 s \(estimated from the evaluation"):
        ctx.fit_layers(items, "pairs", 30, 30, pilot, prior=10)
    assert ctx.stage_start == now[0]  # the clock did not move: no pilot ran


def test_a_sampled_faithfulness_curve_keeps_no_edge_every_edge_and_says_so(tiny_model):
    from arithinterp import tasks

    prompts = tasks.arithmetic(tiny_model, "+", range(20), range(20))
    pairs = prompts.counterfactual(vary="a", seed=0)
    ctx = Context(tiny_model, "tiny", prompts, prompts, None, pairs, seed=0, budget=Budget(seconds=10_000.0))
    chosen, curve_pairs, sizes, steps, sentence = _fit_curve(ctx, pairs, 2**28)
    assert len(chosen) == MINIMUMS["circuits"][0] and len(curve_pairs) == len(chosen) and steps == STEPS
    assert sizes[0] == 0 and sizes[-1] > 2 ** (sizes[-1].bit_length() - 1) and len(sizes) >= CURVE_SIZES
    assert re.fullmatch(rf"sampled 30 of {len(pairs):,} pairs to fit the [\d,]+ s budget", sentence), sentence
    ctx.budget = Budget(seconds=0.01)
    with pytest.raises(OverBudget, match=rf"a faithfulness curve of {CURVE_SIZES} sizes on {CURVE_PAIRS} of them"):
        _fit_curve(ctx, pairs, 2**28)


def test_circuits_shrink_the_integration_steps_before_skipping(tiny_model, monkeypatch):
    """EAP-IG on the minimum of pairs at every default step and the smallest curve do not fit:
    fewer integration steps instead of no section, and the sentence says how many."""
    import arithinterp.report as report
    from arithinterp import tasks

    monkeypatch.setattr(report.time, "perf_counter", lambda: 0.0)  # a stopped clock: the costs below are all
    costs = [(1.0, 0.4), (1.0, 0.4)]  # EAP-IG at one step (1 s, then 0.1 s a pass and pair), the curve (0.1 s a run)

    def measured(run, items, k):
        run(items[:1])  # the scores the curve's pilot reads
        return costs.pop(0)

    monkeypatch.setattr(circuits_module, "pilot_cost", measured)
    prompts = tasks.arithmetic(tiny_model, "+", range(20), range(20))
    pairs = prompts.counterfactual(vary="a", seed=0)
    ctx = Context(tiny_model, "tiny", prompts, prompts, None, pairs, seed=0, budget=Budget(seconds=40.0))
    ctx.stage_start = 0.0
    chosen, curve_pairs, sizes, steps, sentence = _fit_curve(ctx, pairs, 2**28)
    # 0.85 of 40 s: EAP-IG at s steps on 30 pairs takes 1 + 3·(2 + 2s) s and the smallest curve 7 s: s = 3;
    # the 8 s left after 3 steps and the curve's fixed second: 13 pairs at 4 sizes (6 runs of 0.1 s a pair)
    assert steps == 3 and len(chosen) == 30 and len(curve_pairs) == 13 and len(sizes) == CURVE_SIZES
    assert f"sampled 30 of {len(pairs):,} pairs with 3 of EAP-IG's 5 default integration steps to fit" in sentence
    costs[:] = [(1.0, 0.4), (1.0, 0.4)]
    ctx.budget = Budget(seconds=20.0)  # not even one step and the smallest curve: skipped, with the estimate
    with pytest.raises(OverBudget, match=r"EAP-IG at one step on the minimum of 30 pairs \(1 s, then 0.4 s each\) "
                                         r"and a faithfulness curve of 4 sizes on 10 of them \(1 s, then 0.1 s per "
                                         r"pair and size\) would take about 20 s"):
        _fit_curve(ctx, pairs, 2**28)


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


def test_a_small_budget_samples_the_heavy_stages_and_says_so(tmp_path):
    out = write_report("zoo:add-100", out=tmp_path / "r.html", stages=["patching", "neurons", "circuits"], limit=400,
                       budget=1.0, progress=False)
    assert_complete_html(out.read_text())  # escaped as written: a viewer's page is inside an attribute
    text = html.unescape(out.read_text())
    states = stage_states(out.read_text())
    whole = 0  # stages whose every item fitted (the engine is fast enough for some on a quiet machine)
    for name in ("Activation patching", "Heuristic neurons", "Circuit: edges from the operands to the answer"):
        state = states[name]
        if re.search(r"all [\d,]+ (pairs|prompts) fit the [\d.]+ s budget", state):
            whole += 1
            continue
        sampled = re.search(r"sampled ([\d,]+) of ([\d,]+) (pairs|prompts)( and \d+ of \d+ layers \([\d, ]+\))?[ ;]",
                            state)
        if sampled:  # fewer than there are, at least the minimum
            k, n = (int(g.replace(",", "")) for g in sampled.groups()[:2])
            assert 30 <= k < n or (sampled.group(4) and 30 <= k <= n), state  # fewer items, or fewer layers
        elif state.startswith("not enough data"):  # a loaded machine evaluates fewer prompts in the 1 s
            assert re.search(rf"<h2>{re.escape(name)}</h2>.*?Not enough data: \d+ ", text, re.S)
        else:  # not even the minimum fits: the stage says so instead of overrunning
            assert state.startswith("skipped (over budget)"), state
            assert re.search(rf"<h2>{re.escape(name)}</h2>.*?Not run within the budget: (the minimum of \d+ "
                             r"(pairs|prompts)( at a single layer)? would take about|EAP-IG at one step on the "
                             r"minimum of \d+ pairs \([^)]*\) and a faithfulness curve)", text, re.S)
    assert whole < 3, states  # a 1 s budget cannot hold all three at full size
    assert "budget: 1 s" in text


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
    assert all(re.search(r": [\d.]+ s of its [\d.]+ s budget", s) for s in states.values()), states
    evaluated = re.search(r"sampled ([\d,]+) of 2,000 prompts in [\d.]+ s", states["Evaluating the task"])
    # a tiny model may evaluate every prompt within its share (measured at the second round's rate)
    assert (evaluated and 16 <= int(evaluated.group(1).replace(",", "")) < 2000) or re.search(
        r"all 2,000 prompts evaluated in [\d.]+ s", states["Evaluating the task"]), states["Evaluating the task"]
    # every section says what it rests on, or why it drew nothing
    for title, body in re.findall(r"<section><h2>(.*?)</h2>(.*?)</section>", text, re.S):
        assert re.search(r"class='sample'>sample: \d+ |<li>(Not enough data|Not run|Failed)", body), title
    assert "memory: 256 MiB per stage" in text
    # a budget that fits them all evaluates every prompt
    roomy = write_report(folder, out=tmp_path / "roomy.html", stages=["accuracy"], template="{a}+{b}=", few_shot=2,
                         operands="10-59", limit=300, budget=10_000, progress=False)
    assert "all 300 prompts evaluated in" in roomy.read_text()


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


def test_the_heavy_stages_run_sampled_along_several_axes_instead_of_skipping(six_layer_llama, monkeypatch):
    """Each heavy stage is given a share in which its minimum fits at a few layers (or a few steps)
    but not at all of them: it runs, on the minimum of items over a sample of the layers (circuits:
    fewer integration steps), and its sample line says exactly what. The costs are a clock the
    analyses advance (a fixed cost per call plus one per item and layer), so the choices are exact
    whatever the machine's load; the analyses themselves run for real on the small model."""
    import arithinterp.report as report
    from arithinterp import circuits, neurons, patching

    model, prompts, pairs = six_layer_llama
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    now = [0.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])

    def costly(module, name, cost):
        real = getattr(module, name)

        def run(*args, **kwargs):
            now[0] += cost(*args, **kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, run)

    def layers_of(kwargs):
        return len(kwargs.get("layers") or range(n_layers))

    costly(patching, "activation_patching", lambda m, p, site, **kw: 1 + 0.1 * len(p) * layers_of(kw))
    costly(patching, "attribute_sites", lambda m, p, sites, **kw: 0.1 * len(p))
    costly(patching, "digit_ablation", lambda m, p, heads=None, **kw: 1 + 0.2 * len(p) * (
        n_layers if heads is None else len(heads) // n_heads))
    costly(neurons, "classify", lambda m, p, layers=None, **kw: 2 + 0.05 * len(p) * len(layers or range(n_layers)))
    costly(circuits, "score_edges", lambda m, p, method, ig_steps=5, **kw: 1 + 0.1 * len(p) * (2 + 2 * ig_steps))
    costly(circuits, "faithfulness_curve", lambda m, p, c, sizes=None, **kw: 1 + 0.05 * len(p) * (
        (len(sizes) if sizes is not None else 16) + 2))

    evaluation = prompts.evaluate(model)
    ctx = Context(model, "llama6", prompts, prompts, evaluation, pairs, seed=0, correct_only=False)
    sections = {}
    # neurons: the model and its random-init control, each costing the same
    for name, seconds in (("patching", 70.0), ("digits", 40.0), ("neurons", 60.0), ("circuits", 40.0)):
        ctx.budget, ctx.stage_start = Budget(seconds, forward_seconds=0.1), now[0]
        sections[name] = report.STAGES[name].run(ctx)
        spent = now[0] - ctx.stage_start
        assert spent <= seconds, (name, spent, sections[name].sample)  # within its budget, pilots included
    for name, what in (("patching", "pairs"), ("digits", "prompts"), ("neurons", "prompts")):
        sample = sections[name].sample
        found = re.search(rf"sampled {MINIMUMS[name][0]} of [\d,]+ {what} and (\d) of {n_layers} layers \(([\d, ]+)\)",
                          sample)
        assert found and 1 <= int(found.group(1)) < n_layers, (name, sample)
        assert [int(v) for v in found.group(2).split(", ")] == spread(n_layers, int(found.group(1)))
        assert sections[name].findings and sections[name].figures  # it ran: findings and figures, not a skip
    # patching says which positions it swept: from the first token where the pairs differ, then the named ones
    assert "positions a, b, final, a[0], b[0] only" in sections["patching"].sample
    circuit = sections["circuits"].sample
    steps = re.search(r"sampled 30 of [\d,]+ pairs with (\d) of EAP-IG's 5 default integration steps", circuit)
    assert steps and 1 <= int(steps.group(1)) < 5, circuit
    assert re.search(r"the faithfulness curve on \d+ of them at \d+ of \d+ sizes", circuit), circuit
    assert sections["circuits"].findings


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


def test_per_digit_heads_sample_the_layers_where_patching_saw_the_operand_arrive(six_layer_llama, monkeypatch):
    """With time for some layers only, the per-digit stage covers the blocks the patching stage located
    (:attr:`Context.arrival_layers`) and the spread's others, and says so; without them, the spread."""
    import arithinterp.report as report
    from arithinterp import patching

    model, prompts, pairs = six_layer_llama
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    now = [0.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    real = patching.digit_ablation

    def costly(m, p, heads=None, **kw):  # a clock the analysis advances: per call, and per prompt and layer
        now[0] += 1 + 0.2 * len(p) * (n_layers if heads is None else len(heads) // n_heads)
        return real(m, p, heads=heads, **kw)

    monkeypatch.setattr(patching, "digit_ablation", costly)
    samples = {}
    for arrival in ([], [1]):
        ctx = Context(model, "llama6", prompts, prompts, prompts.evaluate(model), pairs, seed=0, correct_only=False,
                      arrival_layers=arrival)
        ctx.budget, ctx.stage_start = Budget(40.0, forward_seconds=0.1), now[0]
        section = report.STAGES["digits"].run(ctx)
        found = re.search(rf"and (\d) of {n_layers} layers \(([\d, ]+)\)", section.sample)
        assert found and 1 < int(found.group(1)) < n_layers, section.sample
        samples[tuple(arrival)] = [int(v) for v in found.group(2).split(", ")], section.sample
    spread_layers, plain = samples[()]
    located, sample = samples[(1,)]
    assert 1 not in spread_layers and "where patching" not in plain
    assert located == looking_first_at(spread_layers, [1]) and len(located) == len(spread_layers)
    assert "layer 1 among them, where patching saw the varied operand reach the answer position" in sample


def test_per_digit_heads_planned_at_every_layer_stop_in_time_when_the_plan_was_low(six_layer_llama, monkeypatch):
    """A pilot that says every layer fits can be wrong (on Gemma 3 270M: 50 s of a 33 s share): the
    layers are still ablated in groups, the located blocks first, and the stage stops between groups."""
    import arithinterp.report as report
    from arithinterp import patching

    model, prompts, pairs = six_layer_llama
    now = [0.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    real = patching.digit_ablation

    def cheap_pilot_slow_groups(m, p, heads=None, **kw):  # the pilot ablates every head; the groups name theirs
        now[0] += 0.001 * len(p) if heads is None else 10.0
        return real(m, p, heads=heads, **kw)

    monkeypatch.setattr(patching, "digit_ablation", cheap_pilot_slow_groups)
    ctx = Context(model, "llama6", prompts, prompts, prompts.evaluate(model), pairs, seed=0, correct_only=False,
                  arrival_layers=[4], budget=Budget(seconds=25.0, forward_seconds=0.0001), stage_start=0.0)
    section = report.STAGES["digits"].run(ctx)
    found = re.search(r"stopped after (\d) of the 6 layers \(([\d, ]+)\)", section.sample)
    assert found and int(found.group(1)) < 6, section.sample
    covered = [int(v) for v in found.group(2).split(", ")]
    assert 4 in covered and now[0] <= 25.0 and section.findings


def test_per_digit_ablation_stops_between_groups_when_the_time_runs_out(six_layer_llama, monkeypatch):
    """Estimates can be low: sampled layers are ablated in groups, coarse to fine, and a group that
    the time so far says would not fit is not started; the result covers the layers that ran."""
    import arithinterp.report as report
    from arithinterp import patching

    model, prompts, pairs = six_layer_llama
    now = [0.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    real = patching.digit_ablation

    def slow(*args, **kwargs):  # 10 s a group, whatever the estimate said
        now[0] += 10.0
        return real(*args, **kwargs)

    monkeypatch.setattr(patching, "digit_ablation", slow)
    ctx = Context(model, "llama6", prompts, prompts, None, pairs, seed=0, budget=Budget(seconds=25.0))
    ctx.stage_start = 0.0
    heads_of = lambda layers: [f"L{layer}H{h}" for layer in layers for h in range(model.cfg.n_heads)]  # noqa: E731
    result, covered = digits_module._ablate_while_time_lasts(ctx, prompts[:8], [0, 1, 3, 5], heads_of)
    assert covered == [0, 5]  # the last and the first ran; a third group (10 s) would not fit the 5 s left
    assert result.heads == heads_of([0, 5]) and result.accuracy.shape[0] == 2 * model.cfg.n_heads


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


def test_circuits_plan_the_curve_by_its_parts_when_not_every_pair_fits(tiny_model, monkeypatch):
    """The whole curve timed on a few pairs decides the sample only when every pair fits; when it
    would sample, the stage plans EAP-IG and the curve separately."""
    import arithinterp.report as report
    from arithinterp import tasks

    prompts = tasks.arithmetic(tiny_model, "+", range(20), range(20))
    pairs = prompts.counterfactual(vary="a", seed=0)
    ctx = Context(tiny_model, "tiny", prompts, prompts, None, pairs, seed=0, budget=Budget(seconds=1000.0))
    planned: list = []

    def by_parts(ctx, pairs, memory):
        planned.append(len(pairs))
        raise OverBudget("recorded")

    monkeypatch.setattr(circuits_module, "_fit_curve", by_parts)
    monkeypatch.setattr(Context, "fit", lambda self, items, *a, **k: (items[:40], "sampled 40 of them"))
    with pytest.raises(OverBudget, match="recorded"):
        report.circuits_stage(ctx)
    assert planned == [min(len(pairs), ctx.n_pairs)]
    # every pair fits: the whole-curve pilot's plan stands, and the stage goes on to score the edges
    from arithinterp import circuits

    def scored(*args, **kwargs):
        raise OverBudget("scored")

    monkeypatch.setattr(Context, "fit", lambda self, items, *a, **k: (items, "all fit"))
    monkeypatch.setattr(circuits, "score_edges", scored)
    with pytest.raises(OverBudget, match="scored"):
        report.circuits_stage(ctx)
    assert len(planned) == 1


def test_a_curve_planned_by_parts_shrinks_to_the_time_eap_ig_leaves(tiny_model, monkeypatch):
    """The curve's sizes are planned again from EAP-IG's cost per pass measured on every pair: when
    the scoring took longer than its pilot said, the curve keeps fewer sizes (no edge and every edge
    among them) and the sentence names them."""
    import arithinterp.report as report
    from arithinterp import circuits, tasks

    prompts = tasks.arithmetic(tiny_model, "+", range(20), range(20))
    pairs = prompts.counterfactual(vary="a", seed=0)
    n_edges = circuits.EdgeGraph.of(tiny_model).n_edges
    planned = circuits.curve_sizes(n_edges)
    now = [0.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    ctx = Context(tiny_model, "tiny", prompts, prompts, None, pairs, seed=0, budget=Budget(seconds=100.0))
    ctx.stage_start = 0.0
    sentence = f"sampled 30 of {len(pairs):,} pairs"
    monkeypatch.setattr(circuits_module, "_fit_curve", lambda ctx, p, memory: (p[:30], p[:10], planned, 1, sentence))
    original = circuits.score_edges

    def slow_scores(*args, **kwargs):  # 0.25 s a pass: 4 passes on each of 30 pairs take 30 s
        now[0] += 30.0
        return original(*args, **kwargs)

    curves: list = []

    def curve(model, some, scored, sizes, **kwargs):
        curves.append(list(sizes))
        raise OverBudget("recorded")

    monkeypatch.setattr(circuits, "score_edges", slow_scores)
    monkeypatch.setattr(circuits, "faithfulness_curve", curve)
    monkeypatch.setattr(Context, "fit", lambda self, *a, **k: (_ for _ in ()).throw(OverBudget("by parts")))
    with pytest.raises(OverBudget, match="recorded"):
        report.circuits_stage(ctx)
    # 70 s left, 0.85 of it, at 1.5 passes (0.375 s) a pair and size on 10 pairs: 15 runs a pair, the 2
    # fixed ones and 13 sizes
    fits = int(0.85 * 70 / (1.5 * 0.25 * 10)) - 2
    assert len(curves[0]) == min(len(planned), fits)
    now[0] = 0.0
    ctx.budget = Budget(seconds=40.0)  # 10 s left: 1 size fits, so the smallest curve
    with pytest.raises(OverBudget, match="recorded"):
        report.circuits_stage(ctx)
    assert curves[1] == [planned[i] for i in spread(len(planned), CURVE_SIZES)]
    assert curves[1][0] == 0 and curves[1][-1] == n_edges


def test_accuracy_drops_read_as_points_never_as_a_signed_zero():
    from arithinterp.report.stages.digits import _points

    assert _points(0.123) == "−12 points" and _points(0.004) == "−0.4 points" and _points(-0.02) == "+2.0 points"
    assert _points(0.0) == _points(-0.0) == _points(0.0004) == "no drop"


def test_a_stage_timed_at_its_minimum_runs_again_on_what_fits(tiny_model, monkeypatch):
    """The helix test runs at its minimum sample first, then on as many pairs as that run's time
    per pair says fit the time left, and the sample line says how many."""
    import arithinterp.report as report

    now = [0.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    runs = []
    minimum = MINIMUMS["helix"][0]

    def fourier(ctx):  # 0.1 s a pair
        runs.append(ctx.n_pairs)
        now[0] += 0.1 * ctx.n_pairs
        return report.Section("fourier", sample=f"{ctx.n_pairs} pairs")

    monkeypatch.setitem(report.STAGES, "fourier", replace(report.STAGES["fourier"], run=fourier))
    pairs = torch.arange(500)
    ctx = Context(tiny_model, "tiny", pairs, pairs, None, pairs, budget=Budget(seconds=18.0), n_pairs=200)
    ctx.stage_start = now[0]
    section = report._run_stage(ctx, "fourier")
    # 3 s at the minimum of 30; the 15 s left hold 150 at 0.1 s each
    assert runs == [minimum, 150] and ctx.n_pairs == 200  # the knob is restored
    assert section.sample == "150 pairs; sampled 150 of 200 pairs to fit the 18 s budget"
    runs.clear()
    ctx.budget, ctx.stage_start = Budget(seconds=8.0), now[0]
    assert report._run_stage(ctx, "fourier").sample.endswith(f"sampled {minimum} of 200 pairs to fit the 8 s budget")
    assert runs == [minimum]  # 50 more would fit, fewer than twice the minimum: the first run stands


def test_the_probes_stage_keeps_its_prompts_and_gives_up_layers_first(digit_tokenizer, monkeypatch):
    """Layers are probed one at a time, coarse to fine, while the time per layer so far fits the time
    left, on every prompt; prompts are sampled only when the first layer says not even PROBE_LAYERS
    layers fit. The layers probed one by one give the result one call over them gives."""
    import dataclasses

    import arithinterp.report as report
    from arithinterp import probes
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic
    from conftest import tiny_bridge

    model = tiny_bridge(digit_tokenizer, n_layers=8)
    prompts = arithmetic(model, "+", range(10, 40), range(10, 40))[:150]
    now = [0.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    real, calls, fitted = probes.probe_layers, [], {}

    def probe_layers(acts, target, layers=None, **kwargs):  # 0.01 s per prompt and layer
        calls.append(acts.n_prompts)
        now[0] += 0.01 * acts.n_prompts * len(layers)
        # the planning is under test here, not the probes: each target is fitted once (at the first layer
        # asked for) and that result stands for every layer (the merge of real per-layer fits is checked below)
        if (target, acts.n_prompts) not in fitted:
            fitted[target, acts.n_prompts] = real(acts, target, layers=layers, **kwargs)
        return dataclasses.replace(fitted[target, acts.n_prompts], layers=list(layers))

    monkeypatch.setattr(probes, "probe_layers", probe_layers)
    targets = probes_module._probe_targets(prompts)
    assert targets == ("a_units", "carry_tens", "answer_tens", "answer_units")
    per_layer = len(targets) * 1.5  # every target at one layer on 150 prompts
    # unlimited: every layer; 34 s: 5 layers (the sixth's 6 s no longer fits 85% of what is left);
    # 20 s: the first layer (6 s) says 4 layers do not fit, so 111 prompts (0.85 * 14 + 6 = 17.9 s
    # for 4 layers at 6 s each: 150 * 17.9 / 24), then at least 4 layers
    for seconds, n_prompts, n_layers in ((float("inf"), 150, 8), (5 * per_layer + 4, 150, 5), (20.0, 111, 4)):
        calls.clear()
        ctx = Context(model, "tiny", prompts, prompts, None, None, seed=0, budget=Budget(seconds))
        ctx.stage_start = now[0]
        section = report.probes_stage(ctx)
        assert section.sample.startswith(f"{n_prompts} correctly answered prompts"), section.sample
        assert calls[-len(targets) * n_layers:] == [n_prompts] * len(targets) * n_layers
        assert ("sampled" in section.sample) is (n_prompts < len(prompts)), section.sample
        layers = report.coarse_to_fine(list(range(8)))[:n_layers]
        assert (f"probed at {n_layers} of 8 layers ({', '.join(map(str, sorted(layers)))})" in section.sample) is (
            n_layers < 8), section.sample
        assert "folds: 5-fold" in section.sample and len(section.findings) == len(targets)
    # the merged per-layer results are the one-call result
    acts = collect(model, prompts[:120], sites="resid_post", positions=["a", "b", "final"], progress=False)
    one = real(acts, "carry_tens", layers=[1, 4, 6], cv=5, progress=False)
    merged = probes_module._merged_over_layers([real(acts, "carry_tens", layers=[layer], cv=5, progress=False)
                                         for layer in (6, 1, 4)])
    assert merged.layers == [1, 4, 6]
    assert torch.equal(merged.fold_scores, one.fold_scores) and torch.equal(merged.control_scores, one.control_scores)
    assert merged.finding() == one.finding()


def test_the_neurons_control_runs_only_when_the_time_left_holds_it(monkeypatch):
    """The random-init control costs what the model's classification did (same prompts and
    layers): when the time left does not hold that, the page gives the share without a verdict and
    says it was not compared, instead of overrunning the stage."""
    import arithinterp as ai
    import arithinterp.report as report
    from arithinterp import neurons

    model = ai.load_model("zoo:add-100")
    prompts = ai.tasks.arithmetic(model, "+", range(0, 100, 7), range(0, 100, 7)).correct_only(model)
    pairs = prompts.counterfactual(vary="a", seed=0)
    now = [0.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    real, calls = neurons.classify, []

    def classify(m, p, **kwargs):  # pilots (16 prompts or fewer) cost nothing; a full run 40 s
        calls.append(m is model)
        now[0] += 40.0 if len(p) >= MINIMUMS["neurons"][0] else 0.0
        return real(m, p, **kwargs)

    monkeypatch.setattr(neurons, "classify", classify)
    for seconds, control in ((60.0, False), (200.0, True)):
        calls.clear()
        ctx = Context(model, "zoo:add-100", prompts, prompts, None, pairs, seed=0, budget=Budget(seconds))
        ctx.stage_start = now[0]
        finding = report.STAGES["neurons"].run(ctx).findings[0]
        assert now[0] - ctx.stage_start <= seconds
        assert calls[-1] is (not control)  # the last classification: the control's, or the model's own
        assert ("The random-init control did not fit the time left" in finding) is (not control), finding
        assert ("a random-init model of the same architecture, ranked and scored the same way" in finding) is control


def _clocked_evaluation(monkeypatch, one_off: float, per_prompt: float, accuracy_every: int):
    """``PromptSet.evaluate`` replaced by a clock: the first call costs ``one_off`` more, each prompt
    ``per_prompt``; every ``accuracy_every``-th prompt (by its ``a``) is answered correctly."""
    from arithinterp import report
    from arithinterp.tasks import Evaluation, PromptSet

    now, calls = [0.0], []
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])

    def evaluate(self, model, batch_size=None, progress=False, writes=()):
        now[0] += (0.0 if calls else one_off) + per_prompt * len(self)
        calls.append(len(self))
        correct = self.a % accuracy_every == 0
        return Evaluation(correct, self.answer.clone(), [str(int(v)) for v in self.answer],
                          self.answer_tokens.clone())

    monkeypatch.setattr(PromptSet, "evaluate", evaluate)
    return calls


@pytest.fixture(scope="module")
def add100():
    import arithinterp as ai
    from arithinterp.tasks import arithmetic

    model = ai.load_model("zoo:add-100")
    return model, arithmetic(model, a=range(100), b=range(40))


def test_the_evaluation_rate_leaves_out_one_off_costs(add100, monkeypatch):
    """A first call that pays 5 s once must not be charged per prompt: at 0.01 s a prompt, the
    4,000 prompts (40 s) fill a 30 s share to about 2,500, not the 16 × (5 s / 16) rate's few."""
    from arithinterp.report.evaluation import evaluate_within as _evaluate_within

    model, prompts = add100
    _clocked_evaluation(monkeypatch, one_off=5.0, per_prompt=0.01, accuracy_every=1)
    kept, evaluation, rate, note = _evaluate_within(model, prompts, 30.0, 30.0, Budget(30.0), seed=0)
    assert rate == pytest.approx(0.01)
    assert 2300 <= len(kept) <= 2500 and len(evaluation) == len(kept), note
    assert note.startswith(f"sampled {len(kept):,} of 4,000 prompts in ")


def test_the_evaluation_goes_on_past_its_share_until_the_stages_have_their_correct_prompts(add100, monkeypatch):
    """At 10% accuracy, 100 correct prompts take about 1,000 prompts: past a 2 s share, within the
    cap; with a cap too small the sentence says how many prompts and how long it would take."""
    from arithinterp.report.evaluation import evaluate_within as _evaluate_within

    model, prompts = add100
    _clocked_evaluation(monkeypatch, one_off=1.0, per_prompt=0.01, accuracy_every=10)
    kept, evaluation, _, note = _evaluate_within(model, prompts, 2.0, 60.0, Budget(2.0), seed=0, need=100)
    assert int(evaluation.correct.sum()) >= 100 and len(kept) < 1200, note
    assert "extended up to 60 s to reach 100 correct" in note and "fewer than" not in note
    kept, evaluation, _, note = _evaluate_within(model, prompts, 2.0, 4.0, Budget(2.0), seed=0, need=100)
    assert int(evaluation.correct.sum()) < 100
    assert re.search(r"fewer than the 100 the stages need: at this accuracy \(1\d\.\d%\) that takes about [\d,]+ "
                     r"prompts \(about [\d.]+ s to evaluate\); give the report more time", note), note
    # every prompt of a task with too few correct answers: say so, and what would help
    few = prompts[prompts.a < 20]  # 800 prompts, 80 of them correct
    _, evaluation, _, note = _evaluate_within(model, few, 2.0, 600.0, Budget(2.0), seed=0, need=100)
    assert len(evaluation) == 800 and "all 800 prompts hold only 80" in note and "--operands" in note


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


def test_the_error_stage_stops_its_layer_search_within_its_share(monkeypatch):
    """The detector's cost is mostly its layer search, one probe set per candidate whatever the
    prompts: the stage gives the search the time left (less the held-out forward), the candidates
    run coarse to fine over the depth, and the sample line says how many of them fitted."""
    import arithinterp as ai
    import arithinterp.probes.detector as detector_module
    import arithinterp.report as report
    from arithinterp.models.zoo import task_prompts

    model = ai.load_model("zoo:add-3digit-weak")  # 2 layers: candidates [1], [0], [0, 1]
    prompts = task_prompts(model, "zoo:add-3digit-weak", 900, 0)
    evaluation = prompts.evaluate(model)
    assert int((~evaluation.correct).sum()) >= 50  # the model's own errors are detected
    now, real = [0.0], detector_module.fit_candidate

    def fit_candidate(*args, **kwargs):  # each candidate takes 10 s, nothing else takes time
        real(*args, **kwargs)
        now[0] += 10.0

    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(detector_module, "fit_candidate", fit_candidate)
    ctx = Context(model, "zoo:add-3digit-weak", prompts.correct_only(model), prompts, evaluation, None,
                  budget=Budget(20.0))
    ctx.stage_start = now[0]
    section = report.error_detector_stage(ctx)
    # 0.85 * 20 = 17 s for the search: the third candidate would start at 20 s
    assert "searched 2 of 3 layer candidates, spread over the depth, to fit the 20 s budget" in section.sample
    assert now[0] - ctx.stage_start == 20.0 and "the detector at layers [1]" in section.findings[0]
