"""Saving a fitted :class:`~arithinterp.probes.ErrorDetector` and loading it back, never through pickle.

A detector folder is sealed as a saved result is (:mod:`arithinterp.results`): its tensors (probe
weights, standardisation, calibrators, the fitting labels) go to ``tensors.safetensors``, whose
header records the fingerprint of the model it was fitted on; everything else (parameters, thresholds,
the cross-validated rows, ``meta_``) goes to ``result.json`` with the tensor file's sha256. Only the
estimators this package defines are rebuilt (:data:`SAVED_ESTIMATORS`), each from its attributes: a
folder cannot make Python run code of its choosing. A detector built on another estimator (a
scikit-learn classifier, an :class:`~arithinterp.probes.MLPProbe`) is refused when saved, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

from arithinterp.errors import ConfigError, ResultFileError
from arithinterp.probes.estimators import CircularProbe, MonotoneLogistic, RidgeProbe
from arithinterp.probes.logistic import LogisticProbe
from arithinterp.probes.slot_probes import Constant
from arithinterp.results import (
    DIGEST_KEY, FORMAT_VERSION, JSON_FILE, TENSOR_FILE, _check_sealed, _read_json, _read_tensors, _refuse_other_result,
    _write_tensors,
)

if TYPE_CHECKING:
    from arithinterp.probes.detector import ErrorDetector

KIND = "ErrorDetector"
#: The estimators a detector folder may hold, by name: rebuilt from their saved attributes.
SAVED_ESTIMATORS: dict[str, type] = {cls.__name__: cls for cls in (LogisticProbe, RidgeProbe, CircularProbe,
                                                                    MonotoneLogistic, Constant)}


class _Encoder:
    """A detector's attributes as JSON and tensors: a tensor becomes ``{"tensor": key}`` (numpy arrays
    ``{"array": key}``), a tuple ``{"tuple": [...]}``, an estimator ``{"estimator": name, "vars": {...}}``."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            self.tensors[where] = value.detach().cpu().contiguous()
            return {"tensor": where}
        if isinstance(value, np.ndarray):
            self.tensors[where] = torch.from_numpy(np.ascontiguousarray(value))
            return {"array": where}
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, tuple):
            return {"tuple": [self.encode(v, f"{where}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {"dict": {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}}
        name = type(value).__name__
        if SAVED_ESTIMATORS.get(name) is type(value):
            return {"estimator": name, "vars": self.encode(vars(value), where)}
        raise ConfigError(f"this ErrorDetector cannot be saved: {where} is a {type(value).__module__}.{name}, and only "
                          f"arithinterp's own estimators are saved without pickle ({', '.join(SAVED_ESTIMATORS)}); "
                          "fit the detector with probe=LogisticProbe(...) (the default) to save it")


def _decode(value: Any, tensors: dict[str, torch.Tensor], file: Path) -> Any:
    """The value :class:`_Encoder` encoded; a reference to a missing tensor or an unknown estimator
    raises ``ResultFileError``."""
    if isinstance(value, list):
        return [_decode(v, tensors, file) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) in ({"tensor"}, {"array"}):
        key = next(iter(value.values()))
        if key not in tensors:
            raise ResultFileError(f"{file}: {key!r} refers to a tensor that {TENSOR_FILE} does not hold; the folder is "
                                  "damaged")
        return tensors[key] if "tensor" in value else tensors[key].numpy()
    if set(value) == {"tuple"}:
        return tuple(_decode(value["tuple"], tensors, file))
    if set(value) == {"dict"} and isinstance(value["dict"], dict):
        return {k: _decode(v, tensors, file) for k, v in value["dict"].items()}
    if set(value) == {"estimator", "vars"}:
        cls = SAVED_ESTIMATORS.get(value["estimator"])
        state = _decode(value["vars"], tensors, file)
        if cls is None or not isinstance(state, dict):
            raise ResultFileError(f"{file}: holds an estimator {value['estimator']!r}; a detector folder holds only "
                                  f"{', '.join(SAVED_ESTIMATORS)}; the folder is damaged or not a saved detector")
        estimator = cls.__new__(cls)
        estimator.__dict__.update(state)
        return estimator
    raise ResultFileError(f"{file}: an entry with the keys {sorted(value)} is none this package writes; the folder is "
                          "damaged")


def save_detector(detector: ErrorDetector, path: Union[str, Path], overwrite: bool = False) -> Path:
    """Write a fitted detector to a sealed folder (see the module docstring).

    Args:
        detector: The fitted detector.
        path: The folder, created when missing.
        overwrite: Replace a *different* saved detector or result in the folder.

    Returns:
        The folder.

    Raises:
        ConfigError: ``overwrite`` is not a bool, the folder is not writable, or the detector holds an
            estimator this package does not save.
        ResultFileError: The folder holds something else and ``overwrite`` is false.
        OutputError: A file could not be written.
    """
    from arithinterp.outputs import atomic_write, check_writable_dir

    if not isinstance(overwrite, bool):
        raise ConfigError(f"overwrite must be True or False, got {overwrite!r}")
    encoder = _Encoder()
    fields = encoder.encode(vars(detector), "detector")
    path = check_writable_dir(path, "save")
    stored: dict[str, Any] = {"type": KIND, "format": FORMAT_VERSION, "fields": fields}
    if not overwrite:
        _refuse_other_result(path, json.loads(json.dumps(stored)), encoder.tensors)
    # tensors first, the JSON that marks a saved folder last: a half-saved detector never loads
    stored[DIGEST_KEY] = _write_tensors(path / TENSOR_FILE, encoder.tensors, detector.meta_)
    text = json.dumps(stored, indent=1)
    atomic_write(path / JSON_FILE, lambda tmp: tmp.write_text(text))
    return path


def load_detector(cls: type, path: Union[str, Path]) -> Any:
    """Read a folder :func:`save_detector` wrote, checking its seal.

    Args:
        cls: The detector class to rebuild.
        path: The folder.

    Returns:
        The fitted detector.

    Raises:
        ResultFileError: The folder holds something else, is damaged, or was changed after it was
            saved (tensors edited, ``meta_`` stripped of the model's fingerprint).
    """
    path = Path(path).expanduser()
    stored = _read_json(path)
    if stored.get("type") != KIND:
        raise ResultFileError(f"{path} holds a {stored.get('type')}, not a saved {KIND}")
    tensors, header = _read_tensors(path)
    state = _decode(stored.get("fields"), tensors, path / JSON_FILE)
    if not isinstance(state, dict) or not isinstance(state.get("meta_"), dict) or "calibrators_" not in state:
        raise ResultFileError(f"{path / JSON_FILE} does not hold a fitted detector's attributes; the file is damaged")
    _check_sealed(path / TENSOR_FILE, stored.get(DIGEST_KEY), header, state["meta_"], path / JSON_FILE)
    detector = cls.__new__(cls)
    detector.__dict__.update(state)
    return detector
