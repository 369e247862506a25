"""The report refuses what it cannot honour before any work, says "failed" for a stage that ran out
of memory (with a non-zero exit from the command line), and keeps every finished stage when it is
interrupted while writing its page."""

from __future__ import annotations

import dataclasses
import html
import re

import pytest

from arithinterp import report
from arithinterp.cli import main
from arithinterp.errors import ConfigError, MemoryBudgetError
from arithinterp.report.html import Page


@pytest.mark.parametrize("budget", [1e300, 1e-9, 0.5, float("nan"), -5])
def test_a_budget_outside_a_second_to_a_week_is_refused_before_the_model_loads(budget, tmp_path, monkeypatch):
    monkeypatch.setattr("arithinterp.models.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(ConfigError, match=r"budget must be seconds from 1 .* to 604,800 \(a week\)"):
        report.write_report("zoo:add-100", out=tmp_path / "r.html", budget=budget, progress=False)


def test_no_stages_is_refused_not_read_as_all_of_them(tmp_path, capsys):
    with pytest.raises(ConfigError, match="stages names no stage"):
        report.write_report("zoo:add-100", out=tmp_path / "r.html", stages=[], progress=False)
    for given in ("", " , "):
        assert main(["report", "zoo:add-100", "--stages", given, "--out", str(tmp_path / "r.html")]) == 2
        assert "stages names no stage" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_an_existing_page_is_replaced_only_with_overwrite(tmp_path, capsys):
    out = tmp_path / "r.html"
    out.write_text("a page someone keeps")
    args = ["report", "zoo:add-100", "--stages", "accuracy", "--limit", "50", "--no-progress", "--out", str(out)]
    assert main(args) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "a page someone keeps"
    with pytest.raises(ConfigError, match="already exists; pass overwrite=True"):
        report.write_report("zoo:add-100", out=out, stages=["accuracy"], limit=50, progress=False)
    assert main([*args, "--overwrite"]) == 0
    assert "Accuracy and error profile" in out.read_text()


def _failing(name: str, error: BaseException):
    def run(ctx):
        raise error

    return dataclasses.replace(report.STAGES[name], run=run)


def test_a_stage_out_of_memory_is_failed_not_inapplicable_and_the_command_exits_non_zero(tmp_path, monkeypatch,
                                                                                          capsys):
    short = MemoryBudgetError("max_memory=16777216 bytes is too small: one edge set needs about 40 MiB")
    monkeypatch.setitem(report.STAGES, "patching", _failing("patching", short))
    out = tmp_path / "r.html"
    with pytest.warns(UserWarning, match="report stage 'patching' failed: Failed for lack of memory"):
        report.write_report("zoo:add-100", out=out, stages=["accuracy", "patching"], limit=100, progress=False)
    text = html.unescape(out.read_text())
    assert re.search(r"<b>Activation patching</b>: failed: ", text), "the state says failed"
    assert "Failed for lack of memory (MemoryBudgetError: max_memory=16777216 bytes is too small" in text
    assert "give the report more (--max-memory)" in text and "not run" not in re.sub(r"not yet run", "", text)
    assert "Finished with gaps: 1 of 2 stages state findings; 1 failed" in text
    code = main(["report", "zoo:add-100", "--stages", "accuracy,patching", "--limit", "100", "--no-progress",
                 "--out", str(out), "--overwrite"])
    err = capsys.readouterr().err
    assert code == 2 and "1 report stage(s) failed (patching)" in err and "Traceback" not in err
    assert "Accuracy and error profile" in out.read_text()  # the page is written all the same


def test_a_memory_budget_no_forward_fits_is_refused_before_the_evaluation(tmp_path, monkeypatch):
    import arithinterp.engine.budget as engine_budget

    monkeypatch.setattr(engine_budget, "forward_bytes_per_prompt", lambda model, seq_len: 2**30)
    with pytest.raises(MemoryBudgetError, match=r"max_memory 256 MiB cannot hold one prompt's forward of "
                                                r"zoo:add-100 \(about 1,024 MiB\): no stage could run"):
        report.write_report("zoo:add-100", out=tmp_path / "r.html", max_memory="256MiB", progress=False)
    assert not (tmp_path / "r.html").exists()


def test_ctrl_c_while_the_page_is_written_keeps_the_finished_stage(tmp_path, monkeypatch, capsys):
    """The interrupt lands in the write that follows a finished stage: the page is written again with
    that stage's section, says it was interrupted, and the command exits 130 without a traceback."""
    real_write, writes = Page.write, []

    def write(self):
        writes.append(dict(self.state))
        if self.state.get("accuracy", "").startswith("done") and not getattr(self, "_hit", False):
            self._hit = True
            raise KeyboardInterrupt
        return real_write(self)

    monkeypatch.setattr(Page, "write", write)
    out = tmp_path / "r.html"
    code = main(["report", "zoo:add-100", "--stages", "accuracy,patching", "--limit", "100", "--no-progress",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 130 and "interrupted" in err and "Traceback" not in err
    text = html.unescape(out.read_text())
    assert "<section><h2>Accuracy and error profile</h2>" in text
    assert re.search(r"<b>Accuracy and error profile</b>: done", text)
    assert "Interrupted: 1 of 2 stages finished before the run was stopped." in text


def test_without_progress_the_analyses_bars_are_quiet_too(tmp_path, monkeypatch, capsys):
    """A stage's library calls draw their own bars unless told otherwise; progress=False holds them all."""
    from tqdm.auto import tqdm

    from arithinterp.report.stage import Section

    def run(ctx):
        for _ in tqdm(range(3), desc="an analysis's own bar"):
            pass
        return Section(report.STAGES["accuracy"].title, findings=["Counted."])

    monkeypatch.setitem(report.STAGES, "accuracy", dataclasses.replace(report.STAGES["accuracy"], run=run))
    report.write_report("zoo:add-100", out=tmp_path / "r.html", stages=["accuracy"], limit=50, progress=False)
    assert "an analysis's own bar" not in capsys.readouterr().err
    report.write_report("zoo:add-100", out=tmp_path / "r.html", stages=["accuracy"], limit=50, progress=True,
                        overwrite=True)
    assert "an analysis's own bar" in capsys.readouterr().err
