"""No work lost: outputs are checked before the work and written atomically, failures are
reported (also as JSON), and sweeps survive damaged files, full disks and a killed driver."""

from __future__ import annotations

import dataclasses
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
    (["report", "--out", f"{UNWRITABLE}/report.html"], "--out"),
    (["patch", "--figure", f"{UNWRITABLE}/patch.html"], "--figure"),
    (["patch", "--out", f"{UNWRITABLE}/result"], "--out"),
    (["train", "add-100", "--out", f"{UNWRITABLE}/model"], "--out"),
])
def test_unwritable_output_fails_before_the_work(argv, flag, no_model_loads, capsys):
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: cannot write to {UNWRITABLE}" in err and "give a path in a writable directory" in err


ANALYSES = ["patch", "probe", "fourier", "helix", "neurons", "ablate", "digits", "circuit"]


def test_every_command_declares_its_outputs():
    from arithinterp.cli import COMMANDS, OUTPUTS, build_parser

    build_parser()  # registers the sweep command too
    assert set(OUTPUTS) == set(COMMANDS)
    assert all(OUTPUTS[name] == dict(out="result", figure="file") for name in set(ANALYSES) - {"circuit"})
    assert OUTPUTS["circuit"] == OUTPUTS["graph"] == dict(out="result", figure="file", html="file")


@pytest.mark.parametrize("command", ANALYSES)
def test_an_out_that_is_a_file_fails_before_the_analysis(command, tmp_path, no_model_loads, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("not a folder")
    assert main([command, "--out", str(taken), "--no-progress"]) == 2
    assert f"error: --out: {taken} exists and is not a directory; give a directory" in capsys.readouterr().err


@pytest.mark.parametrize("command", ANALYSES)
def test_a_figure_inside_a_file_fails_before_the_analysis(command, tmp_path, no_model_loads, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("not a folder")
    assert main([command, "--figure", str(taken / "x.html"), "--no-progress"]) == 2
    assert f"error: --figure: cannot write to {taken / 'x.html'}: {taken} is a file, not a folder" in \
        capsys.readouterr().err


def test_an_out_holding_a_saved_result_needs_overwrite(tmp_path, tiny_model, no_model_loads, capsys):
    from arithinterp.tasks import arithmetic

    folder = _small_result(tiny_model, arithmetic).save(tmp_path / "r")
    assert main(["circuit", "--out", str(folder), "--no-progress"]) == 2
    assert f"error: --out: {folder} already holds a saved result; pass --overwrite" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="loaded a model"):  # past the check: the work would start now
        main(["circuit", "--out", str(folder), "--overwrite", "--no-progress"])


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


def test_the_writer_keeps_the_old_file_when_writing_fails(tmp_path):
    from arithinterp.outputs import write_file

    target = tmp_path / "report.html"
    target.write_text("the previous report")

    def half_then_crash(tmp: Path):
        tmp.write_text("<html>half a rep")
        raise OSError(28, "No space left on device")

    from arithinterp.errors import OutputError

    with pytest.raises(OutputError, match=r"cannot write .*report\.html: No space left on device; the previous file"):
        write_file(target, half_then_crash, overwrite=True)
    assert target.read_text() == "the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temp file left behind
    write_file(target, "new", overwrite=True)
    assert target.read_text() == "new" and oct(target.stat().st_mode & 0o777) != "0o600"


def test_saved_result_is_replaced_whole(tmp_path, tiny_model, monkeypatch):
    import safetensors.torch

    from arithinterp.tasks import arithmetic

    evaluation_result = _small_result(tiny_model, arithmetic)
    folder = evaluation_result.save(tmp_path / "r")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def crash(tensors, filename, metadata=None):  # the disk fills up half way through the tensors
        Path(filename).write_bytes(b"half a safetensors file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    other = dataclasses.replace(evaluation_result, meta={**evaluation_result.meta, "note": "another run"})
    with pytest.raises(OSError):
        other.save(folder, overwrite=True)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["r"]  # no temp folder left behind


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


# --- sweeps: damaged files, full disks, killed drivers, huge grids ------------------------------------

import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

SWEEP_TOML = """
models = ["zoo:add-100"]
[[tasks]]
name = "add"
a = [0, 100]
b = [0, 100]
limit = 60
[[analyses]]
name = "accuracy"
[[analyses]]
name = "patching"
grid = {{ site = [{sites}], vary = ["a", "b"] }}
"""


def _sweep_config(tmp_path: Path, sites: str = '"resid_pre"') -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP_TOML.format(sites=sites))
    return path


def _cli(*args: str, wait: bool = True):
    """The ``arithinterp sweep`` command in its own process (its stdout is the JSON summary)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "arithinterp.sweep", *args, "--no-progress", "--json"]
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def _cell_files(out: Path) -> dict:
    return {p.relative_to(out): p.read_bytes() for p in sorted((out / "results").rglob("*.parquet"))}


def _sweep(capsys, *args: str) -> tuple[int, str, str]:
    """The ``arithinterp sweep`` command run in this process: its exit code, stdout (the JSON summary) and stderr."""
    code = main(["sweep", *args, "--no-progress", "--json"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_damaged_cell_files_are_caught_and_recomputed_through_the_cli(tmp_path, capsys):
    config, out = _sweep_config(tmp_path), tmp_path / "out"
    code, _, err = _sweep(capsys, str(config), "--out", str(out))
    assert code == 0, err
    original = _cell_files(out)
    assert len(original) == 3
    truncated, emptied = [out / p for p in list(original)[:2]]
    truncated.write_bytes(original[truncated.relative_to(out)][:100])
    emptied.write_bytes(b"")

    assert main(["sweep", "--plot", str(out), "--json"]) == 2
    plot = capsys.readouterr()
    error = json.loads(plot.out)["error"]
    assert "is damaged: its checksum differs from the one recorded when it was written" in error
    assert "rerun the sweep's config to recompute it" in error and "Traceback" not in plot.err

    code, stdout, err = _sweep(capsys, str(config), "--out", str(out))
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["done"] == 2 and summary["skipped"] == 1 and len(summary["recomputed"]) == 2
    assert "2 finished cell file(s) failed their check and are recomputed" in err
    assert _cell_files(out) == original  # byte-identical to the undamaged run

    # with the manifest gone too, the files themselves are checked (no checksum to compare with)
    (out / "manifest.json").unlink()
    truncated.write_bytes(original[truncated.relative_to(out)][:100])
    code, stdout, err = _sweep(capsys, str(config), "--out", str(out))
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["done"] == 1 and summary["skipped"] == 2
    assert "not a readable Parquet table" in summary["recomputed"][0]["reason"]
    assert _cell_files(out) == original
    assert main(["sweep", "--plot", str(out), "--json"]) == 0


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it exited meanwhile
        return b""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie holds no memory; only its exit status waits to be read


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table from /proc")
def test_workers_exit_when_the_driver_is_killed(tmp_path):
    config, out = _sweep_config(tmp_path, '"resid_pre", "attn_out", "mlp_out", "resid_post"'), tmp_path / "out"
    driver = _cli(str(config), "--out", str(out), "--executor", "processes", "--workers", "2", wait=False)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 300  # a bound so a broken run cannot hang the suite, not a speed claim
        while time.monotonic() < deadline and driver.poll() is None:
            workers = [p for p in _children(driver.pid) if b"spawn_main" in _cmdline(p)]
            if len(workers) == 2 and list((out / "results").rglob("*.parquet")):
                break  # both workers up and computing cells
            time.sleep(0.05)
        assert driver.poll() is None and len(workers) == 2, "the kill must land while the workers run"
        assert all(_running(p) for p in workers)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 120
        while any(_running(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(p) for p in workers), "worker processes outlived the killed driver"
    finally:  # never leave this test's processes behind, whatever happened
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()


@pytest.mark.slow
def test_full_disk_names_the_cell_and_rerunning_resumes(tmp_path, monkeypatch, capsys):
    import errno

    from arithinterp.sweep import storage

    config, out = _sweep_config(tmp_path), tmp_path / "out"
    real_write, written = storage.write_file, []

    def disk_fills_after_one_cell(path, content, **kwargs):
        if path.suffix == ".parquet":
            if written:
                raise OSError(errno.ENOSPC, "No space left on device")
            written.append(path)
        return real_write(path, content, **kwargs)

    monkeypatch.setattr(storage, "write_file", disk_fills_after_one_cell)
    assert main(["sweep", str(config), "--out", str(out), "--no-progress", "--json"]) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]
    assert error.startswith("cannot write the results of cell ") and "No space left on device" in error
    assert "rerun the same command: finished cells are kept and the sweep resumes from this cell" in error
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err

    monkeypatch.setattr(storage, "write_file", real_write)
    assert main(["sweep", str(config), "--out", str(out), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped"] == 1 and summary["done"] == 2 and summary["failed"] == 0


def test_huge_grid_is_sampled_without_building_it(tiny_digit_model, monkeypatch):
    from arithinterp import tasks
    from arithinterp.sweep import load_config
    from arithinterp.sweep.worker import build_prompts

    def whole_grid(*args, **kwargs):
        raise AssertionError("the whole operand grid was built")

    monkeypatch.setattr(tasks, "arithmetic", whole_grid)
    cfg = load_config(dict(models=["zoo:add-100"], analyses=[dict(name="accuracy")],
                           tasks=[dict(name="big", op="//", a=[0, 10**8], b=[0, 10**8], template="{a}/{b}=", limit=10)]))
    task = cfg.tasks[0]
    prompts = build_prompts(tiny_digit_model, task)
    assert len(prompts) == 10 and len(set(zip(prompts.a.tolist(), prompts.b.tolist()))) == 10
    assert (prompts.b > 0).all() and (prompts.a < 10**8).all() and (prompts.b < 10**8).all()
    assert prompts.texts == build_prompts(tiny_digit_model, task).texts  # seeded
    assert prompts.texts != build_prompts(tiny_digit_model, dict(task, seed=1)).texts


def test_huge_grid_without_limit_is_refused_by_dry_run(tmp_path, capsys):
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["zoo:add-100"]\n[[tasks]]\nname = "big"\na = [0, 100000000]\nb = [0, 10]\n'
                      '[[analyses]]\nname = "accuracy"\n')
    assert main(["sweep", str(config), "--dry-run", "--out", str(tmp_path / "out")]) == 2
    assert "tasks[0].limit: the operand grid has 1,000,000,000 pairs, too many to build whole" in capsys.readouterr().err


def test_sweep_template_contradicting_the_operator_is_refused(tmp_path, capsys):
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["zoo:add-100"]\n[[tasks]]\nname = "sub"\nop = "-"\na = [0, 10]\nb = [0, 10]\n'
                      '[[analyses]]\nname = "accuracy"\n')
    assert main(["sweep", str(config), "--dry-run"]) == 2
    assert "tasks[0].template: template '{a}+{b}=' writes the operator '+' but op is '-'" in capsys.readouterr().err
