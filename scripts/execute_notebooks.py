"""Execute the notebooks in place, keeping their outputs, and render each one as a page of the docs.

    python scripts/execute_notebooks.py                       # every notebook that runs offline, then the pages
    python scripts/execute_notebooks.py notebooks/03_*.ipynb  # these notebooks only, then the pages
    python scripts/execute_notebooks.py --docs-only           # the pages only, from the stored notebooks

Needs ``pip install -e '.[notebooks]'`` and a Chromium for kaleido to drive: the notebooks draw their
figures with ``arithinterp.viz.show_static``, so the stored figures are PNG images, which a code host
and the docs show (plotly's interactive output they do not). The notebooks are stored executed so that
a reader sees every number and figure without running them; each one runs in a temporary folder, and
what it writes to stderr (progress bars, library warnings) is not kept.

Each notebook's page is ``docs/notebooks/<stem>.md``: its markdown cells as they are, its code in
``python`` fences, its text outputs in ``text`` fences and its images as files beside the page
(``docs/notebooks/<stem>/fig-N.png``). ``tests/test_notebooks.py`` renders them again from the stored
notebooks and fails when a page is out of date. The notebooks that need a pretrained model from the
package index (:data:`PRETRAINED`) are built and executed by their own scripts, with this one's
:func:`execute` and :func:`write_page`.
"""

from __future__ import annotations

import argparse
import base64
import copy
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PAGES = ROOT / "docs" / "notebooks"
#: Notebooks that need a pretrained model from the package index, and the script that builds and executes each.
PRETRAINED = {"08_gemma3_270m": "scripts/gemma3_notebook.py"}
#: What a cell may take to run, in seconds.
CELL_TIMEOUT = 1800


def notebook_paths() -> list[Path]:
    """Every notebook, in order."""
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def check_png_export() -> None:
    """Stop with a message unless plotly can export a PNG here (kaleido and a Chromium)."""
    import plotly.graph_objects as go

    try:
        go.Figure(go.Bar(y=[1])).to_image(format="png", width=100, height=100)
    except Exception as error:
        reason = " ".join(str(error).split())
        raise SystemExit(
            f"plotly cannot export PNG images here ({type(error).__name__}: {reason}); the stored notebooks' "
            "figures are images: pip install -e '.[notebooks]' and install a Chromium"
        ) from None


def without_stderr(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook without its stderr streams (progress bars and library warnings): what is stored is
    the results."""
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
    return notebook


def start_kernel() -> Any:
    """A kernel that :func:`execute` can run several notebooks in, one after the other (stop it with
    ``shutdown_kernel(now=True)``). Each notebook still starts from an empty namespace; what it
    shares with the ones before is the modules they imported and the figure export server, whose
    start is most of a small notebook's run."""
    from jupyter_client.manager import AsyncKernelManager
    from nbclient.util import run_sync

    _offline()
    kernel = AsyncKernelManager(kernel_name="python3")
    run_sync(kernel.start_kernel)()
    return kernel


def execute(notebook: nbformat.NotebookNode, kernel: Any = None) -> nbformat.NotebookNode:
    """Run every cell of ``notebook`` in a fresh kernel (or in ``kernel``, from :func:`start_kernel`,
    its namespace emptied first), in a temporary folder, and keep the outputs (stderr left out).
    Raises ``nbclient.exceptions.CellExecutionError`` when a cell fails."""
    from nbclient import NotebookClient

    _offline()
    with tempfile.TemporaryDirectory() as folder:
        run = notebook
        if kernel is not None:  # a cell before the notebook's own: an empty namespace, in this notebook's folder
            run = copy.deepcopy(notebook)
            run.cells.insert(0, nbformat.v4.new_code_cell(f"import os\nos.chdir({folder!r})\n%reset -f"))
        NotebookClient(
            run,
            km=kernel,
            timeout=CELL_TIMEOUT,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": folder}},
        ).execute()
        if kernel is not None:
            notebook.cells = run.cells[1:]
    return without_stderr(notebook)


def _offline() -> None:
    """Kernels started from here read models and tokenizers from disk only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _fence(text: str, language: str) -> str:
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    marks = "`" * max(3, longest + 1)
    return f"{marks}{language}\n{text.rstrip()}\n{marks}"


def _header(stem: str) -> str:
    command = PRETRAINED.get(stem, f"scripts/execute_notebooks.py notebooks/{stem}.ipynb")
    return (
        f"*The notebook `notebooks/{stem}.ipynb` as stored, executed: `python {command}` runs it again and "
        f"rewrites this page.*"
    )


def render(notebook: nbformat.NotebookNode, stem: str) -> tuple[str, dict[str, bytes]]:
    """A notebook as a Markdown page and its images.

    Args:
        notebook: The notebook, as stored.
        stem: Its file name without ``.ipynb``; the images are linked as ``<stem>/fig-N.png``.

    Returns:
        The page's text, and the images' bytes by file name (``fig-1.png``, ...).
    """
    parts: list[str] = []
    images: dict[str, bytes] = {}
    for cell in notebook.cells:
        source = cell.source.strip()
        if cell.cell_type == "markdown":
            parts.append(source)
            continue
        if cell.cell_type != "code":
            continue
        if source:
            parts.append(_fence(source, "python"))
        for output in cell.get("outputs", []):
            kind = output.output_type
            if kind == "stream" and output.name == "stdout":
                parts.append(_fence(output.text, "text"))
            elif kind == "error":
                parts.append(_fence(f"{output.ename}: {output.evalue}", "text"))
            elif kind in ("execute_result", "display_data"):
                data = output.data
                if "image/png" in data:
                    name = f"fig-{len(images) + 1}.png"
                    images[name] = base64.b64decode(data["image/png"])
                    parts.append(f"![Figure {len(images)}]({stem}/{name})")
                elif "application/vnd.plotly.v1+json" in data:
                    parts.append("*An interactive figure: run the notebook to see it.*")
                elif "text/plain" in data:
                    parts.append(_fence(data["text/plain"], "text"))
    if parts and parts[0].startswith("# "):  # the header goes under the title
        title, _, rest = parts[0].partition("\n")
        parts[:1] = [title, _header(stem)] + ([rest.strip()] if rest.strip() else [])
    else:
        parts.insert(0, _header(stem))
    return "\n\n".join(parts) + "\n", images


def write_page(path: Path) -> Path:
    """Render the stored notebook at ``path`` to ``docs/notebooks/<stem>.md`` and its images beside it.

    Args:
        path: The notebook file.

    Returns:
        The page's path.
    """
    page, images = render(nbformat.read(str(path), as_version=4), path.stem)
    PAGES.mkdir(parents=True, exist_ok=True)
    target = PAGES / f"{path.stem}.md"
    target.write_text(page)
    folder = PAGES / path.stem
    shutil.rmtree(folder, ignore_errors=True)
    if images:
        folder.mkdir()
        for name, data in images.items():
            (folder / name).write_bytes(data)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "notebooks",
        nargs="*",
        type=Path,
        help="the notebooks to execute (default: every one but those that need a pretrained model: "
        + ", ".join(PRETRAINED)
        + ")",
    )
    parser.add_argument("--docs-only", action="store_true", help="render the pages from the stored notebooks only")
    args = parser.parse_args(argv)
    if not args.docs_only:
        paths = args.notebooks or [p for p in notebook_paths() if p.stem not in PRETRAINED]
        check_png_export()
        for path in paths:
            print(f"executing {path.name}", flush=True)
            notebook = execute(nbformat.read(str(path), as_version=4))
            nbformat.write(notebook, str(path))
    current = {p.stem for p in notebook_paths()}
    for stale in PAGES.glob("*.md") if PAGES.exists() else []:
        if stale.stem not in current:  # a notebook that is gone: its page and images go too
            stale.unlink()
            shutil.rmtree(PAGES / stale.stem, ignore_errors=True)
    for path in notebook_paths():
        print(write_page(path).relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
