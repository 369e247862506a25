"""No work lost: outputs are checked before the work and written atomically, failures are
reported (also as JSON), and sweeps survive damaged files, full disks and a killed driver."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from arithinterp.cli import main

UNWRITABLE = "/proc/arithinterp-nope"  # not writable even by root


@pytest.fixture()
def no_model_loads(monkeypatch):
    """Fail the test if a command starts its work (loading a model) before checking its outputs."""
    import arithinterp.models as models

    def refuse(*args, **kwargs):
        raise AssertionError("the command loaded a model before checking that it can write its output")

    monkeypatch.setattr(models, "load_model", refuse)


# --- --json on failure ----------------------------------------------------------------------------


def test_json_failure_prints_an_error_object(capsys):
    assert main(["info", "zoo:nope", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == 2 and out["command"] == "info"
    assert "unknown zoo model 'nope'" in out["error"]


def test_json_unexpected_failure_prints_an_error_object(capsys, monkeypatch):
    from arithinterp import cli

    def broken(args):
        raise RuntimeError("disk controller on fire")

    monkeypatch.setitem(cli.COMMANDS, "info", broken)
    assert main(["info", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out == dict(command="info", error="disk controller on fire", error_type="RuntimeError", exit_code=1)


def test_json_usage_error_prints_an_error_object(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["patch", "--limit", "many", "--json"])
    assert stop.value.code == 2
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == 2 and out["command"] == "patch" and "invalid arguments" in out["error"]


# --- outputs checked before the work -------------------------------------------------------------


@pytest.mark.parametrize("argv, flag", [
    (["report", "--out", f"{UNWRITABLE}/report.html"], "out"),
    (["patch", "--figure", f"{UNWRITABLE}/patch.html"], "--figure"),
    (["patch", "--out", f"{UNWRITABLE}/result"], "--out"),
    (["train", "add-100", "--out", f"{UNWRITABLE}/model"], "--out"),
])
def test_unwritable_output_fails_before_the_work(argv, flag, no_model_loads, capsys):
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: cannot write to {UNWRITABLE}" in err and "give a path in a writable directory" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_fails_before_the_report(tmp_path, no_model_loads, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert main(["report", "--out", str(folder / "report.html"), "--no-progress"]) == 2
    finally:
        folder.chmod(0o755)
    assert "Permission denied" in capsys.readouterr().err


def test_unwritable_sweep_out_fails_before_any_cell(tmp_path, capsys):
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["zoo:add-100"]\n[[tasks]]\nname = "t"\na = [0, 5]\nb = [0, 5]\n'
                      '[[analyses]]\nname = "accuracy"\n')
    assert main(["sweep", str(config), "--out", f"{UNWRITABLE}/sweep", "--no-progress"]) == 2
    assert f"error: out: cannot write to {UNWRITABLE}/sweep" in capsys.readouterr().err


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    from arithinterp.outputs import atomic_write

    target = tmp_path / "report.html"
    target.write_text("the previous report")

    def half_then_crash(tmp: Path):
        tmp.write_text("<html>half a rep")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(target, half_then_crash)
    assert target.read_text() == "the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temp file left behind
    atomic_write(target, lambda tmp: tmp.write_text("new"))
    assert target.read_text() == "new" and oct(target.stat().st_mode & 0o777) != "0o600"


def test_saved_result_is_replaced_whole(tmp_path, tiny_model, monkeypatch):
    import safetensors.torch

    from arithinterp.tasks import arithmetic

    evaluation_result = _small_result(tiny_model, arithmetic)
    folder = evaluation_result.save(tmp_path / "r")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def crash(tensors, filename):  # the disk fills up half way through the tensors
        Path(filename).write_bytes(b"half a safetensors file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError):
        evaluation_result.save(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def _small_result(model, arithmetic):
    from arithinterp import patching

    prompts = arithmetic(model, "+", range(5), range(5))
    return patching.ablate(model, prompts, ["attn0"])


# --- CLI inputs that crashed or gave effects from nothing -----------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["patch", "--vary", "operator", "--limit", "50"], "vary='operator' needs the operator in the prompt text"),
    (["patch", "--limit", "0"], "limit must be a positive number of prompts (e.g. --limit 1000), got 0"),
    (["helix", "--periods", "2,x", "--limit", "50"], "--periods: 'x' is not a number; give comma-separated numbers"),
    (["ablate", "--components", "attn0@99", "--limit", "50"],
     "component 'attn0@99': position 99 is out of range for prompts of 5 tokens"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
