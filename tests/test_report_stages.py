"""A report stage is one module declaring one object: adding a module adds the stage to the page."""

from __future__ import annotations

import html
import importlib
import re

from arithinterp import report
from arithinterp.report.stages import collect

# everything a new stage needs: this module, saved beside the others in arithinterp/report/stages/
GREETING = '''
from arithinterp.report.stage import Section, Stage


def greeting_stage(ctx):
    n = len(ctx.prompts)
    return Section(STAGE.title, findings=[f"{n} prompts answered correctly, counted by a stage of one module."],
                   sample=f"{n} prompts")


STAGE = Stage(name="greeting", title="A stage in one module", order=15, weight=0.25, run=greeting_stage)
'''


def test_every_stage_module_declares_one_stage_in_the_pages_order():
    assert list(report.STAGES) == ["accuracy", "patching", "digits", "probes", "errors", "fourier", "neurons",
                                   "circuits", "features", "causal"]
    for name, stage in report.STAGES.items():
        module = importlib.import_module(f"arithinterp.report.stages.{name}")
        assert module.STAGE is stage and stage.name == name and report.STAGE_TITLES[name] == stage.title
        assert report.WEIGHTS[name] == stage.weight > 0
    assert report.MINIMUMS["helix"] == report.STAGES["fourier"].minimum  # known by its helix test's name


def test_a_stage_added_as_one_module_shows_on_the_page(tmp_path, monkeypatch):
    package = tmp_path / "more_stages"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "greeting.py").write_text(GREETING)
    monkeypatch.syspath_prepend(str(tmp_path))
    stages = collect(importlib.import_module("arithinterp.report.stages"), importlib.import_module("more_stages"))
    assert list(stages)[:3] == ["accuracy", "greeting", "patching"]  # its order puts it after the accuracy stage
    monkeypatch.setattr(report, "STAGES", stages)
    out = report.write_report("zoo:add-100", out=tmp_path / "r.html", stages=["accuracy", "greeting"], limit=100,
                              progress=False)
    text = html.unescape(out.read_text())
    assert re.findall(r"<section><h2>(.*?)</h2>", text) == ["Accuracy and error profile", "A stage in one module"]
    assert re.search(r"<b>A stage in one module</b>: done: [\d.]+ s \([\d.]+ s of model work planned of its [\d.]+ s "
                     r"share, \d threads?\); \d+ prompts", text)
    assert re.search(r"<b>A stage in one module\.</b> \d+ prompts answered correctly, counted by a stage", text)
