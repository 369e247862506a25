"""The report's causal stage: DAS for the task's causal variables within the stage's budget, shown as
"readable vs used" (probe accuracy, DAS IIA, random-rotation IIA) with its figure."""

from __future__ import annotations

import html
import re

import pytest

import arithinterp as ai
from arithinterp.causal.planted import planted_model
from arithinterp.errors import AnalysisError
from arithinterp.report import CAUSAL_STEPS, STAGE_TITLES, Context, causal_stage, write_report

ROW = re.compile(r"(\w+), layer (\d+): probe accuracy ([\d.]+) \[[\d.]+, [\d.]+\] \(shuffled labels ([\d.]+)\); "
                 r"DAS IIA ([\d.]+) \[([\d.]+), ([\d.]+)\], random rotation ([\d.]+) \(chance ([\d.]+)\): (.+)\.")


def _rows(findings: list[str]) -> list[tuple]:
    return [m.groups() for line in findings for m in [ROW.fullmatch(line)] if m]


@pytest.mark.slow
def test_causal_stage_localises_a_planted_variable(number_tokenizer):
    """The planted model stores sum_mod_10 in two dims of resid_post L0 at the final token: the stage
    calls it localised there, far above the random rotation."""
    model = planted_model(number_tokenizer)
    prompts = ai.tasks.arithmetic(model, op="+", a=range(10), b=range(10), template="{a}+{b}=")
    section = causal_stage(Context(model, "planted", prompts, prompts, None, None))
    rows = {r[0]: r for r in _rows(section.findings)}
    assert set(rows) == {"sum_mod_10", "magnitude"}
    _, layer, _, _, iia, _, _, random_iia, chance, verdict = rows["sum_mod_10"]
    assert layer == "0" and float(iia) >= 0.95 and float(random_iia) <= float(chance) + 0.05
    assert verdict.startswith("localised here")
    assert float(rows["magnitude"][2]) >= 0.9 > float(rows["magnitude"][3])  # the tens flag is readable too
    assert "100 correctly answered prompts (minimum 100)" in section.sample
    assert len(section.figures) == 1 and "Readable vs used" in section.figures[0].layout.title.text


def test_causal_stage_is_not_run_without_a_built_in_causal_model(tiny_model):
    prompts = ai.tasks.arithmetic(tiny_model, op="-", a=range(10, 20), b=range(10), template="{a}-{b}=")
    with pytest.raises(AnalysisError, match="describe addition"):
        causal_stage(Context(tiny_model, "tiny", prompts, prompts, None, None))


@pytest.mark.slow
def test_causal_stage_on_a_zoo_model_fits_its_budget_and_says_so(tmp_path):
    out = write_report("zoo:add-100", out=tmp_path / "r.html", stages=["causal"], limit=300, budget=6,
                       progress=False)
    text = html.unescape(out.read_text())
    state = re.search(rf"<li><b>{re.escape(STAGE_TITLES['causal'])}</b>: (.*?)</li>", text)
    assert state is not None and state.group(1).startswith("done: "), state
    # the sample says what the budget bought: every layer, or fewer layers at the full training steps (never
    # fewer steps: a fit cut short has not converged)
    cut = re.search(rf"(\d) of 2 layers \([\d, ]+\) at {CAUSAL_STEPS} training steps per fit", state.group(1))
    n_layers = 2 if cut is None else int(cut.group(1))
    findings = re.findall(r"<li>(.*?)</li>", text.split(f"<h2>{STAGE_TITLES['causal']}</h2>")[1])
    assert findings[0].startswith("DAS: ")  # the summary's bullet is the verdict, not the method
    rows = _rows(findings)
    assert {r[0] for r in rows} == {"sum_mod_10", "magnitude"} and len(rows) == 2 * n_layers
    for row in rows:
        iia, low, high, random_iia = map(float, row[4:8])
        assert low <= iia <= high
        assert random_iia <= 0.05  # the random rotation stays at chance (0 for balanced pairs)
    # readable is not used: add-100's last layer reads the units digit of the sum, yet swapping 4 dims moves nothing
    last = {r[0]: r for r in rows if r[1] == "1"}
    if last:
        assert float(last["sum_mod_10"][2]) > float(last["sum_mod_10"][3]) + 0.3
        assert float(last["sum_mod_10"][4]) <= 0.1
    assert "id=\"figure-" in text.split(f"<h2>{STAGE_TITLES['causal']}</h2>")[1]


def test_the_causal_stage_aligns_the_carries_the_task_poses(digit_tokenizer, number_tokenizer):
    """Two-digit sums carry into the tens (carry_tens), read where b's last digit meets a's; three-digit
    operands carry into the hundreds and, where sums pass 999, out of them; single-token numbers have
    their units and magnitude at the final position."""
    from conftest import tiny_bridge

    from arithinterp.report.stages.causal import _causal_cells

    digits = tiny_bridge(digit_tokenizer)
    assert _causal_cells(ai.tasks.arithmetic(digits, "+", range(10, 40), range(10, 40))) == (["carry_tens"], "b")
    three = ai.tasks.arithmetic(digits, "+", range(100, 1000, 37), range(400, 1000, 41))
    assert _causal_cells(three) == (["carry_hundreds", "carry_thousands"], "b")
    small = ai.tasks.arithmetic(digits, "+", range(100, 400, 37), range(100, 500, 41))  # sums below 1000
    assert _causal_cells(small) == (["carry_hundreds"], "b")
    single = ai.tasks.arithmetic(tiny_bridge(number_tokenizer), "+", range(10), range(10))
    assert _causal_cells(single) == (["sum_mod_10", "magnitude"], "final")


def test_a_fit_whose_loss_still_falls_is_not_converged_and_states_no_finding():
    from arithinterp.causal import converged
    from arithinterp.report.stages.causal import _verdict

    assert converged([2.0] * 50 + [1.0] * 50) and converged([1.0 + 0.001 * (-1) ** i for i in range(100)])
    assert not converged([100.0 - i for i in range(100)]) and not converged([1.0, 0.5]) and not converged([])
    noisy = [1.0 + 0.3 * ((7 * i) % 5 - 2) / 2 for i in range(100)]  # flat, with each batch's noise
    assert converged(noisy) and not converged([x + 2.0 - 0.02 * i for i, x in enumerate(noisy)])
    row = dict(variable="carry_tens", layer=6, das_iia=0.6, das_low=0.5, das_high=0.7, random_iia=0.0, chance=0.01)
    unconverged = "not converged after 100 steps (its loss was still falling): no finding from it"
    assert _verdict([(row, unconverged)], "b's last token") == (
        "DAS: no finding for carry_tens at b's last token: its 1 fit was still improving after 100 training steps (not "
        "converged), so no IIA is read from it.")
    flat = dict(row, layer=3, das_iia=0.0, das_low=0.0, das_high=0.05)
    assert _verdict([(row, unconverged), (flat, "no signal above the control")], "b's last token") == (
        "DAS: no signal above the control for carry_tens at b's last token (no converged fit's IIA interval clears the "
        "random rotation and chance); 1 fit did not converge.")
    assert _verdict([(row, "above the control but not localised (IIA < 0.9)")], "b's last token") == (
        "DAS: carry_tens at b's last token is above the control but not localised (IIA < 0.9): best at layer 6, DAS "
        "IIA 0.600 [0.500, 0.700] against a random rotation's 0.000 and chance 0.010.")
    strong = dict(row, das_iia=0.95, das_low=0.93, das_high=0.97)
    assert _verdict([(strong, "localised here (IIA ≥ 0.9)")], "b's last token").startswith(
        "DAS: carry_tens is localised at b's last token: best at layer 6, DAS IIA 0.950 [0.930, 0.970]")
