"""The documentation: every example runs (or says why not), and the site builds in strict mode
(broken links, bad docstrings and missing pages fail)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import doc_examples

ROOT = Path(__file__).parent.parent
BLOCKS = doc_examples.all_blocks()


@pytest.fixture(scope="session")
def page_sessions():
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.id)
def test_example_runs(block, page_sessions, tmp_path_factory, monkeypatch):
    """A documented example runs as written: a name the package no longer has cannot stay in the
    docs. The blocks of a page share one namespace and folder, run in order (a block run on its own
    first runs the page's earlier blocks)."""
    if block.not_run:
        pytest.skip(f"not run: {block.not_run}")
    if block.run_in:
        pytest.skip(f"run in {block.run_in}")
    from arithinterp.sweep import registry

    page_blocks = [b for b in BLOCKS if b.page == block.page]
    session = page_sessions.get(block.page)
    if session is None:
        folder = tmp_path_factory.mktemp(block.page.replace("/", "-"))
        session = page_sessions[block.page] = doc_examples.new_session(block.page, folder)
    monkeypatch.chdir(session.folder)
    # an analysis a block registers stays with the block, not with the other tests of this process
    monkeypatch.setattr(registry, "ANALYSES", dict(registry.ANALYSES))
    session.run_through(page_blocks, page_blocks.index(block))


def quick_start() -> doc_examples.Block:
    return next(b for b in doc_examples.blocks(ROOT / "README.md") if b.language == "python")


def test_examples_are_marked_run_or_not_run_with_a_reason(tmp_path):
    assert len(BLOCKS) >= 50 and {b.language for b in BLOCKS} == {"python", "bash"}
    assert all(b.not_run is None or len(b.not_run) > 10 for b in BLOCKS)
    # the README's quick start runs from the built wheel in a fresh environment, not again here
    assert [b.id for b in BLOCKS if b.run_in] == [quick_start().id]
    text = "```python\nx = 1\n```\n\n<!-- not run: needs a GPU we do not have -->\n```bash\narithinterp info\n```\n"
    page = tmp_path / "page.md"
    page.write_text(text)
    found = doc_examples.blocks(page)
    assert [(b.line, b.language, b.code, b.not_run) for b in found] == [
        (1, "python", "x = 1\n", None), (6, "bash", "arithinterp info\n", "needs a GPU we do not have")]
    assert doc_examples.shell_commands("arithinterp report \\\n  --limit 3  # a comment\n\n") == [
        ["arithinterp", "report", "--limit", "3"]]
    with pytest.raises(AssertionError, match="not an arithinterp command"):
        doc_examples.run_shell("pip install arithinterp")


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
    # the API reference: a page per subpackage, the docstrings' Sphinx roles rendered as links
    api = {p.parent.name: p.read_text() for p in (tmp_path / "site" / "api").glob("*/index.html")}
    assert {"patching", "probes", "causal", "tasks", "core"} <= set(api)
    raw = {name: re.findall(r":(?:func|class|meth|mod|attr|data|exc):`?[^\s<]*", text) for name, text in api.items()}
    assert not any(raw.values()), {name: found[:3] for name, found in raw.items() if found}
    assert 'href="#arithinterp.causal.das_layers"' in api["causal"]
    assert sum(text.count("autorefs-internal") for text in api.values()) > 1000


def test_every_docs_page_is_in_the_nav():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(entries):
        for entry in entries:
            for value in ([entry] if isinstance(entry, str) else entry.values()):  # "page.md" or {title: ...}
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


def test_the_api_pages_are_generated_from_every_public_module():
    """docs/api/ is what scripts/api_docs.py writes: a page per subpackage, every public module with
    its exported names."""
    pages = _api_docs().render()
    on_disk = {p.name: p.read_text() for p in (ROOT / "docs" / "api").glob("*.md")}
    assert pages == on_disk, "docs/api/ is out of date: run python scripts/api_docs.py"
    text = "".join(pages.values())
    for name in ("patching", "probes", "fourier", "helix", "neurons", "circuits", "engine", "engine.decode",
                 "features", "causal", "tasks", "activations", "models", "sweep", "viz", "report", "metrics"):
        assert f"::: arithinterp.{name}\n" in text, name
    assert "::: arithinterp.patching.activation_patching\n" in pages["patching.md"]
    assert "::: arithinterp.engine.Stepper\n" in pages["engine.md"] and "::: arithinterp.metrics\n" in pages["core.md"]


def test_the_api_pages_go_out_of_date_when_a_module_exports_more(monkeypatch):
    from arithinterp import patching

    def newly_exported():
        """A function patching starts to export."""

    api_docs = _api_docs()
    assert "newly_exported" not in api_docs.public_names(patching)
    monkeypatch.setattr(patching, "newly_exported", newly_exported, raising=False)
    monkeypatch.setattr(patching, "__all__", [*patching.__all__, "newly_exported"])
    after = api_docs.render()["patching.md"]
    assert "::: arithinterp.patching.newly_exported\n" in after
    assert after != (ROOT / "docs" / "api" / "patching.md").read_text()


def test_the_report_page_lists_every_notebook():
    words = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    text = (ROOT / "docs" / "report.md").read_text()
    assert f"holds {words[len(notebooks)]} notebooks" in text
    assert all(f"`{stem}`" in text for stem in notebooks), [s for s in notebooks if f"`{s}`" not in text]
