"""Progress of long loops: a bar on a terminal, whole log lines anywhere else (a log file, a job's output)."""

from __future__ import annotations

import io

import pytest
from tqdm.std import tqdm as std_tqdm

from arithinterp import progress
from arithinterp.progress import LogLines, progress_bar


class Clock:
    """A clock the test moves by hand (the lines must not depend on how fast the machine is)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(progress.time, "monotonic", fake)
    return fake


def test_a_log_gets_a_line_per_tenth_of_the_work_and_one_at_the_end(clock):
    log = io.StringIO()
    for _ in progress_bar(range(100), desc="collect", file=log):
        clock.now += 1.0  # 10 s per tenth: every tenth is logged
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and log.getvalue().endswith("\n")
    assert len(lines) == 10 and all(line.startswith("collect:") for line in lines)
    assert [line.split("%")[0].split()[-1] for line in lines] == [str(p) for p in range(10, 101, 10)]
    assert "100/100" in lines[-1]


def test_a_slow_tenth_is_logged_every_30_seconds_and_quick_steps_at_most_every_5(clock):
    log = io.StringIO()
    bar = progress_bar(desc="graphs", total=4, file=log)
    for seconds in (31.0, 31.0, 1.0, 1.0):  # steps of a quarter: the first two log, the quick ones wait
        clock.now += seconds
        bar.update(1)
    bar.close()
    lines = log.getvalue().splitlines()
    assert [line.split("|")[-1].split()[0] for line in lines] == ["1/4", "2/4", "4/4"]


def test_a_short_loop_logs_one_line_and_an_unsized_one_its_count(clock):
    log = io.StringIO()
    for _ in progress_bar(range(1000), desc="fast", file=log):
        pass
    assert log.getvalue().count("\n") == 1 and "1000/1000" in log.getvalue()
    log = io.StringIO()
    for _ in progress_bar(iter(range(7)), desc="unsized", file=log):
        clock.now += 40.0
    assert log.getvalue().splitlines()[-1].startswith("unsized: 7it")


def test_a_terminal_gets_the_bar_and_progress_false_nothing():
    terminal = Terminal()
    bar = progress_bar(range(3), desc="bar", file=terminal)
    assert type(bar) is not LogLines and isinstance(bar, std_tqdm)
    list(bar)
    assert "\r" in terminal.getvalue()
    quiet = io.StringIO()
    assert list(progress_bar(range(3), desc="off", disable=True, file=quiet)) == [0, 1, 2] and quiet.getvalue() == ""
    assert isinstance(progress_bar(range(3), desc="log", disable=None, file=io.StringIO()), LogLines)


def test_an_analysis_writes_its_progress_as_lines_when_stderr_is_not_a_terminal(tiny_model, capsys):
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    collect(tiny_model, arithmetic(tiny_model, "+", range(6), range(6)), positions="final", batch_size=12)
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[-1].startswith("collect: 100%") and "3/3" in err
