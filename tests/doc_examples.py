"""The examples of the documentation: every ```python and ```bash block of README.md and docs/*.md.

A block that cannot run here (a GPU, a download, a job of minutes) says so on the line before its
fence, ``<!-- not run: the reason -->``; one that another test runs says which,
``<!-- run in tests/test_release.py: how -->`` (the README's quick start, from the built wheel);
every other block runs here. The blocks of one page run in order
in one namespace and one working folder (a copy of ``examples/``), so a page reads as a session: a
name one block defines, the next may use. Shell blocks run the ``arithinterp`` command (and ``python
-m arithinterp.sweep``) in this process, through the same ``main`` the console script calls; any
other shell line belongs in a block marked not run.
"""

from __future__ import annotations

import re
import shlex
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<language>python|bash)[^\S\n]*\n(?P<body>.*?)^(?P=indent)```[^\S\n]*$",
                   re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.+?)\s*-->")
RUN_IN = re.compile(r"<!--\s*run in (?P<test>tests/\w+\.py):\s*(?P<how>.+?)\s*-->")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and code, and why it is not run (or ``None``)."""

    page: str
    line: int
    language: str
    code: str
    not_run: Optional[str]
    run_in: Optional[str] = None  # the test that runs it instead

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The ```python and ```bash blocks of a page, in order."""
    text = path.read_text()
    page = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1].strip()
        marked, elsewhere = NOT_RUN.fullmatch(before), RUN_IN.fullmatch(before)
        found.append(Block(page=page, line=text[: match.start()].count("\n") + 1,
                           language=match["language"], code=textwrap.dedent(match["body"]),
                           not_run=marked["reason"] if marked else None,
                           run_in=f"{elsewhere['test']} ({elsewhere['how']})" if elsewhere else None))
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continued lines joined, comments dropped, split into words."""
    joined = re.sub(r"\\\n", " ", code)
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def run_shell(code: str) -> None:
    """Run a shell block's ``arithinterp`` commands in this process; each must exit with status 0."""
    from arithinterp.cli import main
    from arithinterp.sweep.cli import main as sweep_main

    for words in shell_commands(code):
        if words[0] == "arithinterp":
            status = main(words[1:])
        elif words[:3] == ["python", "-m", "arithinterp.sweep"]:
            status = sweep_main(words[3:])
        else:
            raise AssertionError(f"{shlex.join(words)!r} is not an arithinterp command: run here are `arithinterp "
                                 "...` and `python -m arithinterp.sweep ...`; mark the block <!-- not run: reason -->")
        assert status == 0, f"{shlex.join(words)!r} exited with status {status}"


@dataclass
class PageSession:
    """The namespace and working folder of one page's blocks, run in order up to the one asked for."""

    page: str
    folder: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__docs__"})
    done: int = 0  # blocks of the page run so far
    failed: Optional[str] = None

    def run_through(self, page_blocks: list[Block], index: int) -> None:
        while self.done <= index:
            block = page_blocks[self.done]
            self.done += 1
            if block.not_run or block.run_in:
                continue
            if self.failed:
                raise AssertionError(f"an earlier block of the page failed: {self.failed}")
            try:
                if block.language == "python":
                    exec(compile(block.code, block.id, "exec"), self.namespace)
                else:
                    run_shell(block.code)
            except BaseException:
                self.failed = block.id
                raise


def new_session(page: str, folder: Path) -> PageSession:
    """A session for ``page`` working in ``folder``, which holds a copy of ``examples/``."""
    shutil.copytree(ROOT / "examples", folder / "examples")
    return PageSession(page, folder)
