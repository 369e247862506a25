"""The results directory: one atomic Parquet file per cell, the manifest, combined tables."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any, Optional, Union

from arithinterp.errors import ConfigError, accepted
from arithinterp.outputs import TEMP_SUFFIX, write_file
from arithinterp.sweep.config import Cell

STATUSES = ("pending", "done", "failed")
MANIFEST = "manifest.json"
RESULTS = "results"


def cell_path(out: Union[str, Path], cell: Cell) -> Path:
    """Where a cell's table is written.

    Args:
        out: The results directory.
        cell: The cell.

    Returns:
        ``OUT/results/<analysis>/<cell id>.parquet``.
    """
    return Path(out) / RESULTS / cell.analysis / f"{cell.id}.parquet"


def _plain_column(values: list) -> list:
    """Arrow needs one type per column: lists/dicts become JSON, mixed types strings."""
    if any(isinstance(v, (list, tuple, dict)) for v in values):
        return [None if v is None else json.dumps(v) for v in values]
    kinds = {type(v) for v in values if v is not None}
    if len(kinds) > 1 and not kinds <= {int, float}:
        return [None if v is None else str(v) for v in values]
    return values


def tidy(cell: Cell, frame: Any) -> Any:
    """The cell's table with its identity in front: ``cell``, ``model``, ``task``, ``analysis``, params.

    A parameter the analysis already reports as a column (e.g. ``site``) keeps the analysis's column.

    Args:
        cell: The cell.
        frame: The table its analysis returned.

    Returns:
        The table with the identity columns in front and one Arrow type per column (lists and dicts
        as JSON, mixed types as strings).
    """
    import pandas as pd

    frame = frame.reset_index(drop=True)
    ident = dict(cell=cell.id, model=cell.model, task=cell.task["name"], analysis=cell.analysis)
    frame = frame.rename(columns={k: f"result_{k}" for k in ident if k in frame.columns})
    front = dict(ident, **{k: v for k, v in cell.params.items() if k not in frame.columns})
    head = pd.DataFrame({k: _plain_column([v] * len(frame)) for k, v in front.items()}, index=frame.index)
    out = pd.concat([head, frame], axis=1)
    for column in out.columns:
        if out[column].dtype == object:
            out[column] = _plain_column(out[column].tolist())
    return out


def write_cell(out: Path, cell: Cell, frame: Any) -> tuple[int, str]:
    """Write a cell's table; returns its row count and the file's SHA-256 for the manifest."""
    table = tidy(cell, frame)
    path = cell_path(out, cell)
    # the sweep's own file: a rerun replaces it (a cell recomputed), through the guarded writer
    write_file(path, lambda tmp: table.to_parquet(tmp, index=False), overwrite=True, what="out")
    return len(table), file_digest(path)


def file_digest(path: Union[str, Path]) -> str:
    """SHA-256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_cell_file(path: Path, entry: Optional[dict] = None) -> tuple[Optional[str], Optional[int], Optional[str]]:
    """Verify a cell's Parquet file: ``(problem or None, rows, sha256)``.

    Against the manifest's checksum when it has one; otherwise (a manifest lost, or a cell
    finished just before a kill) by reading the whole table.
    """
    entry = entry or {}
    try:
        digest = file_digest(path)
    except OSError as error:
        return f"it cannot be read ({error.strerror or error})", None, None
    if entry.get("sha256"):
        if digest != entry["sha256"]:
            return "its checksum differs from the one recorded when it was written (damaged or cut short)", None, None
        return None, entry.get("rows"), digest
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).num_rows
    except Exception as error:  # Arrow raises several types for truncated or foreign files
        return f"it is not a readable Parquet table ({type(error).__name__}: {error})", None, None
    if entry.get("rows") is not None and rows != entry["rows"]:
        return f"it holds {rows} rows where {entry['rows']} were written", None, None
    return None, rows, digest


def versions() -> dict:
    """The versions a sweep's manifest records.

    Returns:
        ``arithinterp``, ``torch``, ``transformer_lens``, ``pyarrow`` and ``python`` versions, as strings.
    """
    import torch

    from arithinterp._version import __version__

    return dict(arithinterp=__version__, torch=str(torch.__version__),  # a plain str, as it reads back from JSON
                transformer_lens=_package_version("transformer-lens"), pyarrow=_package_version("pyarrow"),
                python=platform.python_version())


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def read_manifest(out: Union[str, Path]) -> dict:
    """Read a sweep's manifest.

    Args:
        out: The results directory.

    Returns:
        The manifest: the config hash, the versions and a ``cells`` table by cell id.

    Raises:
        ConfigError: No manifest, a damaged one, or one without a ``cells`` table.
    """
    path = Path(out) / MANIFEST
    if not path.is_file():
        raise ConfigError(f"{out} is not a sweep results directory (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} is damaged ({error}); rerun the sweep's config to rebuild it "
                          "from the result files") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("cells"), dict):
        raise ConfigError(f"{path} is not a sweep manifest (no 'cells' table); rerun the sweep's config to rebuild it")
    return manifest


def write_manifest(out: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=1, default=str)
    write_file(out / MANIFEST, text, overwrite=True, what="out")  # the sweep's own file, rewritten as cells end


def load_results(out: Union[str, Path], analysis: Optional[str] = None) -> Any:
    """The combined tidy table of each analysis: ``{analysis: DataFrame}`` (or one DataFrame).

    Rows are the finished cells of the sweep last run in ``out``, in the sweep's cell order.

    Args:
        out: The results directory.
        analysis: One analysis's name, or ``None`` for all.

    Returns:
        ``{analysis: DataFrame}``, or the one DataFrame of ``analysis``; ``attrs["cell_columns"]``
        names the columns that say what a cell is.

    Raises:
        ConfigError: No manifest, a damaged cell file, or no finished cell of ``analysis``.
    """
    import pandas as pd

    out = Path(out)
    manifest = read_manifest(out)
    tables: dict[str, list] = {}
    for cid, entry in manifest["cells"].items():
        path = out / entry["path"]
        if path.is_file():
            problem = check_cell_file(path, entry)[0]
            if problem:
                raise ConfigError(f"cell {cid} ({entry['analysis']}): {path} is damaged: {problem}; rerun the sweep's "
                                  "config to recompute it (finished cells are kept)")
            tables.setdefault(entry["analysis"], []).append(pd.read_parquet(path))
    combined = {}
    for name, frames in tables.items():
        frame = pd.concat(frames, ignore_index=True)
        # which columns say what a cell is (plots label cells by those that vary)
        params = dict.fromkeys(k for e in manifest["cells"].values() if e["analysis"] == name for k in e["params"])
        frame.attrs["cell_columns"] = ["model", "task"] + [k for k in params if k in frame.columns]
        combined[name] = frame
    if analysis is None:
        return combined
    if analysis not in combined:
        raise ConfigError(f"no finished cells of analysis {analysis!r} in {out}; accepted: {accepted(combined)}")
    return combined[analysis]


def clean_temp_files(out: Path) -> None:
    """Remove temp files a killed run left behind (only the writer's: ``.<name>.<random>.tmp``)."""
    for path in list((out / RESULTS).glob(f"*/.*{TEMP_SUFFIX}")) + list(out.glob(f".{MANIFEST}.*{TEMP_SUFFIX}")):
        path.unlink(missing_ok=True)
