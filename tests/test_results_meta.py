"""Result provenance: the meta every result carries."""

from __future__ import annotations

import importlib.metadata


def test_meta_names_the_installed_transformer_lens_version():
    from arithinterp.results import build_meta

    meta = build_meta()
    assert meta["transformer_lens_version"] == importlib.metadata.version("transformer-lens")
    assert meta["transformer_lens_version"] != "unknown"
