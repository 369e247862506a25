"""The documentation builds in strict mode (broken links, bad docstrings and missing pages fail)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
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
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == listed, on_disk ^ listed


def _api_docs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_page_is_generated_from_every_public_module():
    """docs/api.md is what scripts/api_docs.py writes: every public module with its exported names."""
    text = (ROOT / "docs" / "api.md").read_text()
    assert _api_docs().render() == text, "docs/api.md is out of date: run python scripts/api_docs.py"
    for name in ("patching", "probes", "fourier", "helix", "neurons", "circuits", "engine", "engine.decode",
                 "features", "causal", "tasks", "activations", "models", "sweep", "viz", "report", "metrics"):
        assert f"## `arithinterp.{name}`" in text, name
    assert "::: arithinterp.patching.activation_patching\n" in text and "::: arithinterp.engine.Stepper\n" in text


def test_the_api_page_goes_out_of_date_when_a_module_exports_more(monkeypatch):
    from arithinterp import patching

    def newly_exported():
        """A function patching starts to export."""

    api_docs = _api_docs()
    assert "newly_exported" not in api_docs.public_names(patching)
    monkeypatch.setattr(patching, "newly_exported", newly_exported, raising=False)
    monkeypatch.setattr(patching, "__all__", [*patching.__all__, "newly_exported"])
    after = api_docs.render()
    assert "::: arithinterp.patching.newly_exported\n" in after and after != (ROOT / "docs" / "api.md").read_text()


def test_the_report_page_lists_every_notebook():
    words = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    text = (ROOT / "docs" / "report.md").read_text()
    assert f"holds {words[len(notebooks)]} notebooks" in text
    assert all(f"`{stem}`" in text for stem in notebooks), [s for s in notebooks if f"`{s}`" not in text]
