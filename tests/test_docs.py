"""The documentation builds in strict mode (broken links, bad docstrings and missing pages fail)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "papers" / "index.html").exists()


def test_every_docs_page_is_in_the_nav():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(entries):
        for entry in entries:
            for value in entry.values():
                yield from (pages(value) if isinstance(value, list) else [value])

    listed = set(pages(nav))
    on_disk = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert on_disk == listed, on_disk ^ listed
