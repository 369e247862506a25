"""The report on a model that knows nothing: every stage states its sample size and, below its
minimum, says "not enough data" instead of drawing a conclusion.

The model is a random re-initialisation of the add-100 zoo model (same shape and tokenizer): it
answers about 1% of the problems, so a report that prints confident numbers about it is wrong.
"""

from __future__ import annotations

import html
import re

import pytest

from arithinterp.report import MINIMUMS, write_report


def _sections(text: str) -> dict[str, str]:
    return {html.unescape(title): body for title, body in re.findall(r"<section><h2>(.*?)</h2>(.*?)</section>", text, re.S)}


@pytest.fixture(scope="module")
def random_report(tmp_path_factory):
    from arithinterp.models import load_model, random_like

    model = random_like(load_model("zoo:add-100"), seed=0)
    out = tmp_path_factory.mktemp("report") / "random.html"
    write_report(model, out=out, limit=2000, seed=0, progress=False)
    return out.read_text()


@pytest.mark.slow
def test_a_model_that_knows_nothing_gets_not_enough_data(random_report):
    sections = _sections(random_report)
    accuracy = re.search(r"answers (\d+) of (\d+) prompts correctly", random_report)
    correct, total = int(accuracy.group(1)), int(accuracy.group(2))
    assert total == 2000 and 0 < correct < 0.1 * total
    refused = [title for title, body in sections.items() if re.search(r"<ul class='findings'>\s*<li>Not enough data", body)]
    assert {"Activation patching", "Linear probes", "Error detection", "Heuristic neurons"} <= set(refused)
    for title in refused:
        body = sections[title]
        assert "id=\"figure-" not in body  # nothing drawn from too little data
        # the only numbers are the sample size and the minimum it is held to
        findings = re.findall(r"<li>(.*?)</li>", body, re.S)
        assert len(findings) == 1 and re.fullmatch(r"Not enough data: \d+ .*; this stage needs at least \d+ .*\.", findings[0])
        for word in ("accuracy", "AUROC", "restores", "R²", "%"):
            assert word not in findings[0]
    # the Fourier stage keeps what needs no prompts (the embedding spectrum) but fits no helix
    fourier = sections["Fourier features and the helix"]
    assert "Helix: Not enough data" in fourier and "R²" not in fourier
    assert re.search(r"Not enough data: (\d+) counterfactual pairs", sections["Activation patching"])
    # the summary says it too
    summary = random_report.split("<h2>Summary</h2>")[1].split("<section>")[0]
    assert summary.count("Not enough data") >= 4


@pytest.mark.slow
def test_every_stage_that_ran_states_its_sample_size(random_report):
    for title, body in _sections(random_report).items():
        if "Not run on this model" in body:  # does not apply (single-token answers): no sample to state
            continue
        assert re.search(r"class='sample'>sample: \d+ |<li>Not enough data: \d+ ", body), title


def test_unparsable_answers_stay_out_of_the_error_sizes(tiny_model):
    import torch

    from arithinterp.report import Context, accuracy_stage
    from arithinterp.tasks import UNPARSABLE, Evaluation, arithmetic

    prompts = arithmetic(tiny_model, "+", range(10), range(4))
    answers = prompts.answer.clone()
    answers[:6] = UNPARSABLE  # six answers that are not numbers
    answers[6:10] += 10  # four off by +10
    evaluation = Evaluation(answers == prompts.answer, answers, [str(v) for v in answers.tolist()],
                            torch.zeros(len(prompts), 1, dtype=torch.long))
    ctx = Context(tiny_model, "tiny", prompts[evaluation.correct], prompts, evaluation, None)
    section = accuracy_stage(ctx)
    text = " ".join(section.findings)
    assert "6 of the 10 wrong answers are not numbers" in text and "+10 (4×)" in text
    assert "1000000" not in text
    assert list(section.figures[0].data[0].x) == ["+10"]  # only numeric error sizes are drawn
    assert section.sample == f"{len(prompts)} prompts"


def test_minimums_are_stated():
    assert MINIMUMS["patching"][0] >= 30 and MINIMUMS["errors"][0] >= 20
    assert all(isinstance(n, int) and isinstance(what, str) for n, what in MINIMUMS.values())


def test_report_command_takes_template_and_operands(tmp_path):
    from arithinterp.cli import main

    out = tmp_path / "r.html"
    code = main(["report", "zoo:add-100", "--stages", "accuracy", "--template", "{a} + {b} =",
                 "--operands", "0-39", "--limit", "60", "--out", str(out), "--no-progress"])
    assert code == 0
    text = html.unescape(out.read_text())
    assert "template: {a} + {b} =" in text and "operands: 0-39" in text
    assert re.search(r"answers \d+ of 60 prompts correctly", text)


def test_report_few_shot_prompts(tmp_path, tiny_model):
    out = write_report(tiny_model, out=tmp_path / "r.html", stages=["accuracy"], few_shot=2, operands="10-29", limit=50,
                 progress=False)
    text = html.unescape(out.read_text())
    assert "few-shot: 2" in text and re.search(r"answers \d+ of 50 prompts correctly", text)


def test_few_shot_prompts_longer_than_the_context_are_refused(tmp_path, capsys):
    from arithinterp.cli import main

    code = main(["report", "zoo:add-100", "--stages", "accuracy", "--few-shot", "2", "--limit", "20",
                 "--out", str(tmp_path / "r.html"), "--no-progress"])
    assert code == 2
    assert re.search(r"\d+ tokens long.*context of 8 tokens.*few-shot", capsys.readouterr().err)


def test_bad_operands_are_rejected(tmp_path):
    from arithinterp.errors import ConfigError

    with pytest.raises(ConfigError, match="operands"):
        write_report("zoo:add-100", out=tmp_path / "r.html", operands="ten-twenty", stages=["accuracy"], progress=False)


def test_the_docs_state_every_minimum():
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "controls.md").read_text()
    for name, (n, what) in MINIMUMS.items():
        assert f"{n} {what.rstrip(',')}" in page, name


@pytest.mark.slow
def test_probes_stage_says_no_signal_where_the_probe_does_not_beat_its_control(tiny_model):
    """A random model: its residual stream at the a token holds a's embedding (readable), but a
    random-init model of the same architecture reads it just as well, so it is no finding; and
    nothing computes the sum (not readable)."""
    from arithinterp.report import Context, probes_stage
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny_model, "+", range(12), range(12))
    section = probes_stage(Context(tiny_model, "tiny", prompts, prompts, prompts.evaluate(tiny_model), None))
    findings = dict(zip(("a", "answer_units", "answer"), section.findings))
    for target, text in findings.items():
        assert text.startswith(f"'{target}': no signal above chance and the controls"), text
        # every finding quotes chance and the random-init control, and no interval leaves [0, 1]
        assert "chance 0." in text and "a random-init model of the same architecture" in text
        assert all(0 <= float(v) <= 1 for v in re.findall(r"CI (-?[\d.]+) to", text) + re.findall(r"to (-?[\d.]+)\)", text))
    assert re.search(r"held-out accuracy (0\.9\d|1\.00) .* random-init model of the same architecture (0\.9\d|1\.00)",
                     findings["a"])
    assert section.sample.startswith("144 correctly answered prompts (minimum 60); folds: 5-fold")
    assert section.sample.endswith("controls: chance, shuffled labels, a random-init model of the same architecture")


def test_error_detector_verdict_against_chance():
    from arithinterp.report.stages.errors import _beats_chance

    # 40 correct and 40 wrong held-out answers: 52% balanced accuracy is chance, 80% is not
    assert not _beats_chance(dict(n=80, n_errors=40, recall=0.54, balanced_accuracy=0.52))
    assert _beats_chance(dict(n=80, n_errors=40, recall=0.8, balanced_accuracy=0.8))


def test_patching_verdict_when_clean_and_corrupt_runs_do_not_differ():
    from types import SimpleNamespace

    import torch

    from arithinterp.report.stages.patching import _no_gap

    g = torch.Generator().manual_seed(0)
    noise = torch.randn(40, generator=g)
    assert _no_gap(SimpleNamespace(clean_baseline=noise, corrupt_baseline=torch.randn(40, generator=g)))
    assert not _no_gap(SimpleNamespace(clean_baseline=noise + 3.0, corrupt_baseline=noise.flip(0) - 3.0))


def test_top_cells_are_only_those_above_noise():
    """A patching finding names the cells that restore the answer beyond noise (95% interval above
    0), largest first: a cell with a large mean but an interval reaching 0, or one too small to
    print, is not listed; with none left the sentence says so."""
    from types import SimpleNamespace

    import torch

    from arithinterp.report.stages.patching import _restoring, _top_cells

    result = SimpleNamespace(axes=["layer", "position"], positions=["a", "final"], tokens=["7", "="],
                             axis_labels=lambda axis: [0, 1] if axis == "layer" else ["a", "final"],
                             mean=torch.tensor([[0.9, 0.004], [1.4, 0.3]]),
                             ci_low=torch.tensor([[0.8, 0.001], [-0.1, 0.05]]))
    # L1 '7': mean 1.4 but its interval reaches 0; L0 '=': above 0 but it would print as 0.00
    assert _top_cells(result) == "L0 '7' (0.90), L1 '=' (0.30)"
    assert _restoring("MLP outputs", result) == "MLP outputs that restore it most: L0 '7' (0.90), L1 '=' (0.30)."
    nothing = SimpleNamespace(**{**vars(result), "ci_low": torch.zeros(2, 2)})
    assert _top_cells(nothing) == ""
    assert _restoring("MLP outputs", nothing) == (
        "MLP outputs that restore it most: none beyond noise (every cell's 95% interval over pairs reaches 0).")


def test_a_random_models_heuristic_neurons_are_no_signal(tmp_path):
    """Every prompt of a random-init model, answered correctly or not: its neurons follow operand
    rules about as often as another random-init model's, so the page states no finding (and no
    heuristic families)."""
    from arithinterp.models import load_model, random_like

    model = random_like(load_model("zoo:add-100"), seed=3)
    out = write_report(model, out=tmp_path / "r.html", stages=["neurons"], limit=400, correct_only=False,
                       progress=False)
    body = _sections(out.read_text())["Heuristic neurons"]
    assert "No signal above the control: of the " in body and "a random-init model of the same architecture" in body
    assert "Most common heuristic families" not in body


def test_neuron_coverage_in_words_and_the_two_proportion_test():
    from types import SimpleNamespace

    import torch

    from arithinterp.report.stages.neurons import _coverage, _more_often

    def table(labelled_per_layer, n=50):
        layer = torch.arange(len(labelled_per_layer)).repeat_interleave(n)
        classified = torch.cat([torch.arange(n) < k for k in labelled_per_layer])
        return SimpleNamespace(layer=layer, classified=classified,
                               coverage=lambda: {i: k / n for i, k in enumerate(labelled_per_layer)})

    assert _coverage(table([7, 46])) == "14% in layer 0, 92% in layer 1"
    assert _coverage(table([48, 50, 49, 45, 50, 47])) == "from 90% (layer 3) to 100% (layer 1) per layer"
    assert _more_often(table([25, 25]), table([10, 10]))  # 50% vs 20% of 100: far beyond 1.96 standard errors
    assert not _more_often(table([25, 25]), table([23, 22]))  # 50% vs 45%: within noise
    assert not _more_often(table([10, 10]), table([25, 25]))  # fewer than the control is never "more"
