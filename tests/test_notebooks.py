"""The notebooks are stored executed, their figures as PNG images, so that a reader sees every number and
figure without running them (on a code host, or rendered into the docs); they still run top to bottom,
offline — all but the ones that need a pretrained model from the package index
(``scripts/execute_notebooks.py``'s ``PRETRAINED``), which run only in the opt-in real-model tier.
``python scripts/execute_notebooks.py`` executes them again and renders their pages under
``docs/notebooks/``."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PAGES = ROOT / "docs" / "notebooks"


def _script():
    spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / "scripts" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_cells(notebook: dict) -> list[dict]:
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


def _source(cell: dict) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def test_the_numbered_notebooks_are_there():
    assert {p.stem[:2] for p in NOTEBOOKS} >= {"01", "02", "03", "04", "05", "06", "07", "08"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_stored_executed(path):
    """Every code cell ran and none failed; every figure is a PNG image (``show_static``), never plotly's
    interactive output, which a code host does not draw and which would swell the file."""
    notebook = json.loads(path.read_text())
    cells = _code_cells(notebook)
    not_run = [i for i, c in enumerate(cells) if not c.get("execution_count")]
    assert not not_run, f"{path.name}: code cells {not_run} have no outputs: python scripts/execute_notebooks.py {path}"
    outputs = [o for c in cells for o in c.get("outputs", [])]
    errors = [f"{o['ename']}: {o['evalue']}" for o in outputs if o.get("output_type") == "error"]
    assert not errors, f"{path.name} stored with errors: {errors}"
    assert not [o for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"], path.name
    assert not [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})], (
        f"{path.name} holds interactive figures: draw them with arithinterp.viz.show_static (needs kaleido)"
    )
    code = "\n".join(_source(c) for c in cells)
    calls = code.count("show_static(")
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert images >= calls, f"{path.name}: {images} PNG images for {calls} show_static calls"
    if ".plot(" in code:
        assert images, f"{path.name} draws figures but holds no image"


def test_the_stored_notebooks_stay_small():
    sizes = {p.name: p.stat().st_size for p in NOTEBOOKS}
    assert sum(sizes.values()) < 3 * 2**20, sizes
    assert max(sizes.values()) < 2**20, sizes


def test_the_docs_pages_are_the_stored_notebooks_rendered():
    """``docs/notebooks/<stem>.md`` and its images are what the script renders from the stored notebook, so a
    notebook changed without rendering its page again fails here."""
    nbformat = pytest.importorskip("nbformat")
    script = _script()
    stale = "out of date: python scripts/execute_notebooks.py --docs-only"
    for path in NOTEBOOKS:
        page, images = script.render(nbformat.read(str(path), as_version=4), path.stem)
        target = PAGES / f"{path.stem}.md"
        assert target.exists() and target.read_text() == page, f"{target.relative_to(ROOT)} is {stale}"
        folder = PAGES / path.stem
        on_disk = {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else {}
        assert on_disk == images, f"the images of {target.relative_to(ROOT)} are {stale}"
        assert f"![Figure 1]({path.stem}/fig-1.png)" in page
    assert {p.stem for p in PAGES.glob("*.md")} == {p.stem for p in NOTEBOOKS}, f"docs/notebooks/ is {stale}"
    assert {p.name for p in PAGES.iterdir() if p.is_dir()} <= {p.stem for p in NOTEBOOKS}


def test_every_notebook_page_is_in_the_nav():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    section = next(entry["Notebooks"] for entry in nav if "Notebooks" in entry)
    listed = [page for entry in section for page in entry.values()]
    assert listed == [f"notebooks/{p.stem}.md" for p in NOTEBOOKS]


def test_a_page_renders_code_text_and_images():
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# Title\n\nIntro."),
        nbformat.v4.new_code_cell(
            "print('```')\nfig",
            outputs=[
                nbformat.v4.new_output("stream", name="stdout", text="```\n"),
                nbformat.v4.new_output("stream", name="stderr", text="progress\n"),
                nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0K", "text/plain": "<Image>"}),
                nbformat.v4.new_output("execute_result", data={"text/plain": "42"}, execution_count=1),
            ],
        ),
    ]
    page, images = _script().render(notebook, "demo")
    assert page.startswith("# Title\n\n*The notebook `notebooks/demo.ipynb` as stored")
    assert "Intro.\n\n````python\nprint('```')\nfig\n````" in page  # a fence longer than any inside
    assert "````text\n```\n````" in page and "progress" not in page and "```text\n42\n```" in page
    assert "![Figure 1](demo/fig-1.png)" in page and list(images) == ["fig-1.png"]


def test_show_static_displays_a_png_and_falls_back_to_the_interactive_figure(monkeypatch):
    import IPython.display
    import plotly.graph_objects as go

    from arithinterp.errors import ConfigError
    from arithinterp.viz import show_static

    import arithinterp.viz.notebook as notebook_viz

    shown, started = [], []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    monkeypatch.setattr(notebook_viz, "_server", "not started")
    kaleido = pytest.importorskip("kaleido")
    monkeypatch.setattr(kaleido, "start_sync_server", lambda **kw: started.append(kw))
    fig = go.Figure(go.Bar(y=[1, 2]))
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
    monkeypatch.setattr(go.Figure, "to_image", lambda self, **kw: png)
    show_static(fig)
    assert isinstance(shown[-1], IPython.display.Image) and shown[-1].data == png
    show_static(fig)
    assert len(started) == 1, "every figure after the first reuses the export server (one browser per process)"

    def no_export(self, **kw):
        raise ValueError("Image export using the 'kaleido' engine requires the kaleido package")

    monkeypatch.setattr(go.Figure, "to_image", no_export)
    show_static(fig)
    assert shown[-1] is fig
    with pytest.raises(ConfigError, match="fig=list is not accepted"):
        show_static([fig])

    # No browser to drive: the figure is shown interactive, and later figures do not try to start one again.
    def no_browser(**kw):
        started.append(kw)
        raise RuntimeError("no Chromium found")

    monkeypatch.setattr(notebook_viz, "_server", "not started")
    monkeypatch.setattr(kaleido, "start_sync_server", no_browser)
    started.clear()
    show_static(fig)
    show_static(fig)
    assert shown[-2:] == [fig, fig] and len(started) == 1


@pytest.fixture(scope="module")
def kernel():
    """One kernel for the notebooks this test process runs: each starts from an empty namespace (so a
    name it does not define itself fails), and is spared the kernel's start, its imports and the
    figure export server's start."""
    pytest.importorskip("nbclient")
    from nbclient.util import run_sync

    running = _script().start_kernel()
    yield running
    run_sync(running.shutdown_kernel)(now=True)


#: Run before each notebook's own cells. Every figure a notebook shows is built and serialised as plotly
#: would send it to kaleido, but not drawn: drawing is the browser's work (seconds to start one, a fifth
#: of a second per image), not the notebook's, and ``show_static``'s own test covers what it does with
#: the image. A 1×1 PNG stands in for it.
FIGURES_NOT_DRAWN = """\
import base64
import plotly.graph_objects as go
import arithinterp.viz.notebook as notebook_viz
notebook_viz._server = "running"
PIXEL = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==")
go.Figure.to_image = lambda self, **options: self.to_json() and PIXEL
"""


#: Run after a notebook's own cells, in its namespace: the known results it shows, so that a notebook whose
#: findings fade fails as one that raises does. Error detection on ``zoo:add-3digit-weak`` (Sun, Stolfo &
#: Sachan 2025): every answer digit is readable where it is predicted, the detector beats chance on
#: held-out problems, and where the model is wrong it believes the right answer more than the model's own.
KNOWN_RESULTS = {
    "03_error_detection": """\
from arithinterp.probes.reask import _answer_evaluation

metrics = result.metrics()
assert 0.7 < evaluation.accuracy < 0.97  # a model that still makes errors
# each answer digit is readable where it is predicted, far above chance and the shuffled control
for place, probe in digits.items():
    best = probe.best()
    assert best["score"] >= 0.9 and best["score"] > best["chance"] + 0.3 and best["beats_controls"], (place, best)
# errors are rare (about 10%): the threshold is set for balanced accuracy, not accuracy
assert metrics["auroc"] >= 0.95 and metrics["balanced_accuracy"] >= 0.85 and metrics["beats_chance"]
assert detector.meta_["beats_majority_baseline"] and detector.meta_["threshold_rule"] == "balanced"
held_out = prompts[split:]
wrong = torch.nonzero(~evaluation.correct[split:])[:, 0]
right, scorable = _answer_evaluation(held_out[wrong], held_out.answer[wrong])
own = evaluation[split:][wrong]
believed = (detector.answer_confidence(model, held_out[wrong], right)
            > detector.answer_confidence(model, held_out[wrong], own))
assert scorable.all() and believed.float().mean() >= 0.9
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, request):
    """Each notebook runs top to bottom without an error (outputs are not compared: they are the stored
    ones' numbers on another machine), its figures built but not drawn (:data:`FIGURES_NOT_DRAWN`), and
    its known results hold (:data:`KNOWN_RESULTS`)."""
    if path.stem in _script().PRETRAINED and os.environ.get("ARITHINTERP_GEMMA3") != "1":
        pytest.skip("needs Gemma 3 270M: the opt-in real-model tier (bash scripts/test-gemma3.sh) runs it")
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(str(path), as_version=4)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(FIGURES_NOT_DRAWN))
    if path.stem in KNOWN_RESULTS:
        notebook.cells.append(nbformat.v4.new_code_cell(KNOWN_RESULTS[path.stem]))
    notebook = _script().execute(notebook, kernel=request.getfixturevalue("kernel"))
    errors = [
        o
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
    code = "\n".join(c.source for c in notebook.cells[1:] if c.cell_type == "code")
    images = sum("image/png" in o.get("data", {}) for c in notebook.cells for o in c.get("outputs", []))
    assert images >= code.count("show_static("), "a figure fell back to the interactive display"
