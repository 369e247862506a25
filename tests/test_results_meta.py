"""Result provenance: the meta every result carries."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

PYPROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]


@pytest.fixture(autouse=True)
def _fresh_version_cache():  # the version is cached: each test reads it anew
    from arithinterp import results

    results.transformer_lens_version.cache_clear()
    yield
    results.transformer_lens_version.cache_clear()


def test_meta_names_the_installed_versions():
    """The TransformerLens version is the installed one, a release the package accepts; the
    package's own version is the one it is released as."""
    from arithinterp.results import build_meta

    meta = build_meta()
    installed = importlib.metadata.version("transformer-lens")
    assert meta["transformer_lens_version"] == installed
    declared = next(r for r in map(Requirement, PYPROJECT["dependencies"]) if r.name == "transformer-lens")
    assert Version(meta["transformer_lens_version"]) in declared.specifier  # a parseable version the package accepts
    from arithinterp._version import __version__

    assert meta["arithinterp_version"] == __version__ == importlib.metadata.version("arithinterp")


def test_meta_says_when_transformer_lens_is_not_installed_as_a_package(monkeypatch):
    from arithinterp import results

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert results.build_meta()["transformer_lens_version"] == "not installed as a package"
