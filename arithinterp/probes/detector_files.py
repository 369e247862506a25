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

from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

from arithinterp.errors import ConfigError, ResultFileError
from arithinterp.probes.estimators import CircularProbe, MonotoneLogistic, RidgeProbe
from arithinterp.probes.logistic import LogisticProbe
from arithinterp.probes.slot_probes import Constant
from arithinterp.results import JSON_FILE, TENSOR_FILE, read_sealed, write_sealed

if TYPE_CHECKING:
    from arithinterp.probes.detector import ErrorDetector

KIND = "ErrorDetector"
#: The estimators a detector folder may hold, by name: rebuilt from their saved attributes.
SAVED_ESTIMATORS: dict[str, type] = {cls.__name__: cls for cls in (LogisticProbe, RidgeProbe, CircularProbe,
                                                                    MonotoneLogistic, Constant)}
# the one-key objects that stand for what JSON cannot hold
TENSOR, ARRAY, TUPLE, ESTIMATOR = "__tensor__", "__array__", "__tuple__", "__estimator__"


class _Encoder:
    """A detector's attributes as JSON and tensors: a tensor becomes ``{"__tensor__": key}`` (a numpy
    array ``{"__array__": key}``), a tuple ``{"__tuple__": [...]}``, an estimator
    ``{"__estimator__": [name, {attribute: value}]}``; dicts and lists stay as they are."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            self.tensors[where] = value
            return {TENSOR: where}
        if isinstance(value, np.ndarray):
            self.tensors[where] = torch.from_numpy(np.ascontiguousarray(value))
            return {ARRAY: where}
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, tuple):
            return {TUPLE: [self.encode(v, f"{where}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
        name = type(value).__name__
        if SAVED_ESTIMATORS.get(name) is type(value):
            return {ESTIMATOR: [name, self.encode(vars(value), where)]}
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
    marker = next(iter(value)) if len(value) == 1 else None
    if marker in (TENSOR, ARRAY):
        key = value[marker]
        if key not in tensors:
            raise ResultFileError(f"{file}: {key!r} refers to a tensor that {TENSOR_FILE} does not hold; the folder is "
                                  "damaged")
        return tensors[key] if marker == TENSOR else tensors[key].numpy()
    if marker == TUPLE:
        return tuple(_decode(value[TUPLE], tensors, file))
    if marker == ESTIMATOR:
        name, state = value[ESTIMATOR] if isinstance(value[ESTIMATOR], list) and len(value[ESTIMATOR]) == 2 else ("", 0)
        cls, state = SAVED_ESTIMATORS.get(name), _decode(state, tensors, file)
        if cls is None or not isinstance(state, dict):
            raise ResultFileError(f"{file}: holds an estimator {name!r}; a detector folder holds only "
                                  f"{', '.join(SAVED_ESTIMATORS)}; the folder is damaged or not a saved detector")
        estimator = object.__new__(cls)  # rebuilt from its attributes: no constructor runs
        estimator.__dict__.update(state)
        return estimator
    return {k: _decode(v, tensors, file) for k, v in value.items()}


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
    encoder = _Encoder()
    fields = encoder.encode(vars(detector), "detector")
    return write_sealed(path, KIND, fields, encoder.tensors, detector.meta_, overwrite=overwrite)


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
    fields, tensors = read_sealed(path, KIND, meta_field="meta_")
    state = _decode(fields, tensors, Path(path) / JSON_FILE)
    if not isinstance(state.get("meta_"), dict) or "calibrators_" not in state:
        raise ResultFileError(f"{Path(path) / JSON_FILE} does not hold a fitted detector's attributes; the file is "
                              "damaged")
    detector = object.__new__(cls)
    detector.__dict__.update(state)
    return detector
