"""The release: ``python -m build`` makes a wheel and an sdist that carry the zoo models and the
shipped transcoders, and the wheel, installed into a fresh virtual environment with no checkout on
the path, runs the README's quick start and ``arithinterp report``.

Kept cheap: one build (``--no-isolation``: this environment's setuptools, nothing downloaded; the
wheel is built from the sdist, so both are checked), the wheel installed with ``--no-deps`` into a
virtual environment that reaches this environment's packages through a ``.pth`` line (torch,
TransformerLens and the rest are not installed again), and a report of two stages on 300 prompts.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import doc_examples
from arithinterp._version import __version__

ROOT = Path(__file__).resolve().parent.parent
#: What the release must carry besides the code: the zoo's checkpoints and the shipped transcoders.
SHIPPED = ["arithinterp/models/checkpoints", "arithinterp/features/weights"]
#: What a source distribution needs: the build configuration, the package, what the metadata names.
SOURCES = ["pyproject.toml", "MANIFEST.in", "README.md", "CHANGELOG.md", "LICENSE", "arithinterp"]


def _shipped_files() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for folder in SHIPPED for p in (ROOT / folder).rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict:
    """The sdist and the wheel built from it, from a copy of the checkout's sources (the build
    writes its egg-info beside them)."""
    pytest.importorskip("build")
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is
                                            shutil.copytree else {}))
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return dict(wheel=out / f"arithinterp-{__version__}-py3-none-any.whl",
                sdist=out / f"arithinterp-{__version__}.tar.gz")


@pytest.mark.slow
def test_the_wheel_and_the_sdist_carry_the_models_and_transcoders(dist):
    shipped = _shipped_files()
    assert len(shipped) >= 40 and any(p.endswith(".safetensors") for p in shipped)
    wheel = set(zipfile.ZipFile(dist["wheel"]).namelist())
    assert shipped <= wheel, sorted(shipped - wheel)[:5]
    prefix = f"arithinterp-{__version__}/"
    with tarfile.open(dist["sdist"]) as sdist:
        names = {name.removeprefix(prefix) for name in sdist.getnames()}
    assert shipped <= names, sorted(shipped - names)[:5]
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml"} <= names
    assert not any(name.startswith("tests/") for name in names)  # the tests need the whole checkout
    metadata = zipfile.ZipFile(dist["wheel"]).read(f"arithinterp-{__version__}.dist-info/METADATA").decode()
    assert f"Version: {__version__}" in metadata and "License-Expression: MIT" in metadata
    assert __version__ == "0.1.0"


@pytest.mark.slow
def test_the_wheel_runs_the_quick_start_and_the_report_in_a_fresh_environment(dist, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                                "--no-deps", "--no-index", str(dist["wheel"])], capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    # this environment's packages (torch, ...) after the new environment's own: a plain path in a .pth
    # file, so the site-packages' own .pth files (an editable install of the checkout) are not read
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # the README's quick start, the block the docs test leaves to this one
    quick_start = next(b for b in doc_examples.blocks(ROOT / "README.md") if (b.run_in or "").startswith(
        "tests/test_release.py")).code
    check = ("import arithinterp, sys\n"
             "assert arithinterp.__file__.startswith(sys.prefix), arithinterp.__file__  # the wheel, not a checkout\n"
             "assert acts['resid_post'].shape[1:] == (model.cfg.n_layers, 2, model.cfg.d_model)\n"
             "print(len(prompts), len(pairs))\n")
    run = subprocess.run([str(python), "-c", quick_start + check], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    n_prompts, n_pairs = map(int, run.stdout.split())
    assert n_prompts > 9900 and n_pairs > 9000  # zoo:add-100 answers 99.9% of the 10,000 problems right
    report = subprocess.run([str(venv / "bin" / "arithinterp"), "report", "--stages", "accuracy,patching",
                             "--limit", "300", "--no-progress", "--out", "report.html"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    page = (tmp_path / "report.html").read_text()
    assert "Accuracy and error profile" in page and "Activation patching" in page
