"""The base of every analysis result.

A result is a frozen dataclass of tensors (and plain values) plus ``meta``. Every result has

* ``.to_frame()`` — a tidy pandas DataFrame, one row per cell;
* ``.plot(**kwargs)`` — a plotly ``Figure`` built by :mod:`arithinterp.viz`;
* ``.save(path)`` / ``Result.load(path)`` — tensors in safetensors, everything else in JSON
  (``path`` is a directory), never pickle.

Subclasses declare their fields as a dataclass and implement ``to_frame`` and ``plot``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from arithinterp.errors import ResultFileError
from arithinterp.types import HookedModel

_TENSOR_FILE = "tensors.safetensors"
_JSON_FILE = "result.json"


@functools.lru_cache(maxsize=1)
def transformer_lens_version() -> str:
    """The installed TransformerLens version, from the package metadata (the module has no
    ``__version__`` in 4.x)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("transformer-lens", "transformer_lens"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "not installed as a package"


def build_meta(model: Optional[HookedModel] = None, **extra: Any) -> dict[str, Any]:
    """Provenance for a result: model id, TransformerLens version, compatibility mode, extras."""
    from arithinterp import __version__

    meta: dict[str, Any] = {
        "arithinterp_version": __version__,
        "transformer_lens_version": transformer_lens_version(),
    }
    if model is not None:
        from arithinterp.models import model_id

        meta["model"] = model_id(model)
        meta["compatibility_mode"] = bool(getattr(model, "compatibility_mode", False))
    meta.update({k: _plain(v) for k, v in extra.items()})
    return meta


def _plain(value: Any) -> Any:
    """Make ``value`` JSON-friendly (tensors and arrays become lists, ranges lists)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, range):
        return list(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class Result:
    """Base class: subclasses add fields (tensors, lists, numbers) and define ``to_frame`` / ``plot``."""

    def save(self, path: Union[str, Path]) -> Path:
        """Write the result to directory ``path`` (created if needed); returns the path."""
        from safetensors.torch import save_file

        from arithinterp.outputs import atomic_write, check_writable_dir

        path = check_writable_dir(path, "save")
        tensors, plain = {}, {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                tensors[field.name] = value.detach().cpu().contiguous()
            else:
                plain[field.name] = _plain(value)
        text = json.dumps({"type": type(self).__name__, "fields": plain}, indent=1)
        # tensors first, the JSON that marks a saved result last: a half-saved result never loads
        atomic_write(path / _TENSOR_FILE, lambda tmp: save_file(tensors, str(tmp)))
        atomic_write(path / _JSON_FILE, lambda tmp: tmp.write_text(text))
        return path

    @classmethod
    def load(cls, path: Union[str, Path]):
        """Read a result written by :meth:`save`."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / _JSON_FILE).exists():
            raise ResultFileError(f"{path} is not a saved result (no {_JSON_FILE} inside)")
        stored = json.loads((path / _JSON_FILE).read_text())
        if stored["type"] != cls.__name__:
            raise ResultFileError(f"{path} holds a {stored['type']}, not a {cls.__name__}")
        values = dict(stored["fields"])
        values.update(load_file(str(path / _TENSOR_FILE)))
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})
