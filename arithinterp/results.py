"""The base of every analysis result.

A result is a frozen dataclass of tensors (and plain values) plus ``meta``. Every result has

* ``.to_frame()`` — a tidy pandas DataFrame, one row per cell;
* ``.plot(**kwargs)`` — a plotly ``Figure`` built by :mod:`arithinterp.viz`;
* ``.save(path)`` / ``Result.load(path)`` — tensors in safetensors, everything else in JSON
  (``path`` is a directory), never pickle. The JSON carries a format version
  (:data:`FORMAT_VERSION`); ``load`` checks the folder and raises
  :class:`~arithinterp.errors.ResultFileError` naming the file and field of any damage, and
  ``save`` does not replace a different saved result unless ``overwrite=True``. A folder is
  sealed when saved: the JSON records the tensor file's sha256 and the tensor file's header the
  model fingerprint, so ``load`` refuses tensors edited by hand (a weight transposed) and a
  ``meta`` emptied or stripped of its fingerprint (which would skip the model check).

Subclasses declare their fields as a dataclass and implement ``to_frame`` and ``plot`` (abstract
here: a subclass without them cannot be made), and declare their saved folders' invariants for
``load`` to check (``_shapes``, ``_legal``: see :class:`Result`). ``tests/test_result_contract.py``
checks the whole contract on every subclass in the package, damaging each field of a saved folder.

One module past 500 lines on purpose: the result contract (fields, invariants, files, meta) is one
base class every result type inherits whole.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import itertools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Union

import numpy as np
import torch

from arithinterp.checks import architecture, fingerprint, model_id
from arithinterp.errors import ConfigError, ResultFileError
from arithinterp.types import HookedModel

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

TENSOR_FILE = "tensors.safetensors"
JSON_FILE = "result.json"
FORMAT_VERSION = 1  # of the saved JSON; a newer format is refused with a clear message on load
DIGEST_KEY = "tensors_sha256"  # result.json's record of the tensor file's bytes
WRITTEN_BY = "arithinterp"  # the tensor file header's "written_by": a folder this package saved and sealed


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
    """Provenance for a result's ``meta``.

    Args:
        model: The model the result was made on; ``None`` records the versions only.
        **extra: Further entries (the analysis's arguments), made JSON-friendly (tensors and ranges
            as lists).

    Returns:
        The arithinterp and TransformerLens versions and, with a model, its id, architecture,
        weight fingerprint and compatibility mode, then ``extra``.
    """
    from arithinterp._version import __version__

    meta: dict[str, Any] = {
        "arithinterp_version": __version__,
        "transformer_lens_version": transformer_lens_version(),
    }
    if model is not None:
        meta["model"] = model_id(model)
        meta["architecture"] = architecture(model)  # what check_belongs compares when the result is reused
        meta["fingerprint"] = fingerprint(model)  # the weights it was made on (a model of the same shape is not it)
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
class Result(abc.ABC):
    """Base class: subclasses add fields (tensors, lists, numbers) and define ``to_frame`` / ``plot``.

    Subclasses declare, for :meth:`load` to check (a folder that breaks them raises
    :class:`~arithinterp.errors.ResultFileError` naming the field):

    * ``_shapes``: field -> its axes by name, e.g. ``{"values": "pair layer ...", "layers": "layer"}``.
      Fields that name one axis share its length; ``...`` (last) stands for any further axes; a
      number is a fixed length. A list's length is its one axis; an int field named by one axis is
      that axis's length (``{"basis": "d k", "k": "k"}``).
    * ``_legal``: field -> the values it may take: a tuple of the accepted values (a list field:
      each item), or a :class:`Rule` or list of rules (:data:`PROBABILITY`, :data:`NON_NEGATIVE`,
      :data:`INCREASING`, ...) the value keeps.
    * ``_required_meta``: keys ``meta`` must hold.

    and, for folders that spell the type, a field or a value another way (the package's names are
    one per concept; a folder written under another name still loads):

    * ``_saved_names``: other type names a folder of this type may carry (``("Graph",)`` for
      :class:`~arithinterp.features.AttributionGraph`);
    * ``_field_names``: a field's other name in a folder -> the field (``{"mode": "ablation"}``);
    * ``_value_names``: field -> {another spelling of a value: the value} (``{"method":
      {"integrated_gradients": "integrated-gradients"}}``).

    Subclasses are frozen dataclasses; each lists its fields under ``Attributes:``.
    """

    _shapes: ClassVar[dict[str, str]] = {}
    _legal: ClassVar[dict[str, Any]] = {}
    _required_meta: ClassVar[tuple] = ()
    _saved_names: ClassVar[tuple[str, ...]] = ()
    _field_names: ClassVar[dict[str, str]] = {}
    _value_names: ClassVar[dict[str, dict[str, str]]] = {}

    @abc.abstractmethod
    def to_frame(self) -> pd.DataFrame:
        """The result as a tidy DataFrame: one row per cell, string column names, one scalar per cell."""

    @abc.abstractmethod
    def plot(self, **kwargs: Any) -> go.Figure:
        """The result's figure, drawn by :mod:`arithinterp.viz`.

        Args:
            **kwargs: Options of the result's figure builder.

        Returns:
            A plotly figure.
        """

    def on_model(self, model: HookedModel) -> "Result":
        """This result declared for use on ``model``, another model of the same shape (a control with
        other weights, another checkpoint): a copy whose ``meta["fingerprint"]`` is ``model``'s, the
        one it was made on kept in ``meta["made_on_fingerprint"]``. Without it a result or part made
        on one model is refused on another (:class:`~arithinterp.errors.ModelMismatchError`).

        Args:
            model: The model to declare the result for.

        Returns:
            A copy of the result with the new fingerprint.
        """
        meta = dict(getattr(self, "meta", None) or {})
        meta["made_on_fingerprint"] = meta.get("made_on_fingerprint", meta.get("fingerprint"))
        meta["fingerprint"] = fingerprint(model)
        return dataclasses.replace(self, meta=meta)  # pyright: ignore[reportCallIssue]

    def save(self, path: Union[str, Path], *, overwrite: bool = False) -> Path:
        """Write the result to a directory: tensors to ``tensors.safetensors``, the rest to ``result.json``.

        Args:
            path: The directory, created when missing.
            overwrite: Replace a *different* saved result in the folder (saving the same result again
                is always allowed).

        Returns:
            The directory.

        Raises:
            ConfigError: ``overwrite`` is not a bool, or the folder is not writable.
            ResultFileError: The folder holds a different result and ``overwrite`` is false.
            OutputError: A file could not be written.
        """
        from arithinterp.outputs import atomic_write, check_writable_dir

        if not isinstance(overwrite, bool):
            raise ConfigError(f"overwrite must be True or False, got {overwrite!r}")
        path = check_writable_dir(path, "save")
        tensors, plain = {}, {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                tensors[field.name] = value.detach().cpu().contiguous()
            else:
                plain[field.name] = _plain(value)
        stored: dict[str, Any] = {"type": type(self).__name__, "format": FORMAT_VERSION, "fields": plain}
        if not overwrite:
            _refuse_other_result(path, json.loads(json.dumps(stored)), tensors)
        # tensors first, the JSON that marks a saved result last: a half-saved result never loads
        stored[DIGEST_KEY] = _write_tensors(path / TENSOR_FILE, tensors, plain.get("meta"))
        text = json.dumps(stored, indent=1)
        atomic_write(path / JSON_FILE, lambda tmp: tmp.write_text(text))
        return path

    @classmethod
    def load(cls, path: Union[str, Path]):
        """Read a result written by :meth:`save`.

        Args:
            path: The directory :meth:`save` wrote.

        Returns:
            The result, of this class.

        Raises:
            ResultFileError: The folder holds another type of result, or is damaged (a missing or
                unreadable file, a missing field, a field of the wrong kind, fields that should be as
                long as each other and are not, a format newer than this version reads), or was
                changed after saving (tensors edited by hand, ``meta`` emptied or its fingerprint
                removed); the message names the file and the field.
        """
        path = Path(path)
        stored = _read_json(path)
        kind = stored.get("type")
        if kind != cls.__name__ and kind not in cls._saved_names:
            raise ResultFileError(f"{path} holds a {kind}, not a {cls.__name__}")
        fields = stored.get("fields")
        if not isinstance(fields, dict):
            raise ResultFileError(f"{path / JSON_FILE} has no 'fields' object; the file is damaged")
        values = dict(fields)
        tensors, header = _read_tensors(path)
        overlap = sorted(set(values) & set(tensors))
        if overlap:
            raise ResultFileError(f"{path}: field {overlap[0]!r} is in both {JSON_FILE} and {TENSOR_FILE}; "
                                  "the folder mixes two saved results")
        values.update(tensors)
        _read_other_names(cls, values)
        _check_fields(cls, values, path)
        _check_sealed(path / TENSOR_FILE, stored.get(DIGEST_KEY), header, values.get("meta"), path / JSON_FILE)
        try:
            return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
        except (TypeError, ValueError) as error:
            raise ResultFileError(f"{path} does not hold a valid {cls.__name__}: {error}") from None

    # --- how a result prints: a short repr and, in a notebook, an HTML table (arithinterp.printing) ---

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # @dataclass writes a repr of every field (a PatchResult's ran to 8,500 characters of tensors)
        # unless the class body defines one: each subclass gets the short one before the decorator runs
        if "__repr__" not in cls.__dict__:
            cls.__repr__ = cls.__mro__[1].__repr__  # pyright: ignore[reportAttributeAccessIssue]

    def headline(self) -> dict[str, Any]:
        """The few numbers that say what the result found (its strongest cell, its best score), shown
        first when the result prints. The base has none: a result's plain-number fields (an accuracy,
        an IIA) are shown anyway; types whose findings sit in tensors override it.

        Returns:
            ``{name: value}``, in the order to show.
        """
        return {}

    def _printed_parts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(what, sizes)``: the plain fields (site, metric, accuracies) and the model; then the counts
        ``meta`` records, the tensors and the non-empty lists."""
        what: dict[str, Any] = {}
        tensors: dict[str, Any] = {}
        lists: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "meta" or not field.repr or value is None:
                continue
            if isinstance(value, torch.Tensor):
                tensors[field.name] = value
            elif isinstance(value, (list, tuple, dict)):
                if value:
                    lists[field.name] = value
            else:
                what[field.name] = value
        meta = getattr(self, "meta", None)
        counts = {}
        if isinstance(meta, dict):
            if isinstance(meta.get("model"), str):
                what["model"] = meta["model"]
            counts = {k: v for k, v in meta.items() if k.startswith("n_") and isinstance(v, int)}
        return what, {**counts, **tensors, **lists}

    def __repr__(self) -> str:
        from arithinterp.printing import short_repr

        what, sizes = self._printed_parts()
        headline = self.headline()  # first, and not again under a field's name
        rest = {key: value for key, value in {**what, **sizes}.items() if key not in headline}
        return short_repr(type(self).__name__, {**headline, **rest})

    def _repr_html_(self) -> str:
        """The table a notebook shows: what the result is, its sizes, its headline numbers, and the
        first rows of :meth:`to_frame`."""
        from arithinterp.printing import html_table

        what, sizes = self._printed_parts()
        return html_table(type(self).__name__, {"headline": self.headline(), "what": what, "sizes": sizes},
                          self.to_frame(), "to_frame()")


def holds_result(path: Union[str, Path]) -> bool:
    """Whether a folder holds a saved result (what :meth:`Result.save` refuses to replace).

    Args:
        path: The folder.

    Returns:
        True when it holds a ``result.json``.
    """
    return (Path(path).expanduser() / JSON_FILE).exists()


# --- sealed folders of what is not a result (a fitted ErrorDetector): the same files and seal ------


def write_sealed(path: Union[str, Path], kind: str, fields: dict[str, Any], tensors: dict[str, torch.Tensor],
                 meta: Any, overwrite: bool = False) -> Path:
    """Write a folder as :meth:`Result.save` does: ``tensors`` to ``tensors.safetensors`` (sealed with
    the fingerprint ``meta`` records), ``fields`` to ``result.json`` with the tensor file's sha256.

    Args:
        path: The folder, created when missing.
        kind: What the folder holds (its ``type``).
        fields: JSON-ready values.
        tensors: The tensors, by name.
        meta: The provenance whose fingerprint seals the tensor file.
        overwrite: Replace a *different* saved folder.

    Returns:
        The folder.

    Raises:
        ConfigError: ``overwrite`` is not a bool, or the folder is not writable.
        ResultFileError: The folder holds something else and ``overwrite`` is false.
        OutputError: A file could not be written.
    """
    from arithinterp.outputs import atomic_write, check_writable_dir

    if not isinstance(overwrite, bool):
        raise ConfigError(f"overwrite must be True or False, got {overwrite!r}")
    path = check_writable_dir(path, "save")
    tensors = {name: value.detach().cpu().contiguous() for name, value in tensors.items()}
    stored: dict[str, Any] = {"type": kind, "format": FORMAT_VERSION, "fields": fields}
    if not overwrite:
        _refuse_other_result(path, json.loads(json.dumps(stored)), tensors)
    stored[DIGEST_KEY] = _write_tensors(path / TENSOR_FILE, tensors, meta)  # the JSON, written last, marks it saved
    text = json.dumps(stored, indent=1)
    atomic_write(path / JSON_FILE, lambda tmp: tmp.write_text(text))
    return path


def read_sealed(path: Union[str, Path], kind: str, meta_field: str = "meta") -> tuple[dict[str, Any], dict]:
    """Read a folder :func:`write_sealed` wrote, checking its type and seal.

    Args:
        path: The folder.
        kind: The type it must hold.
        meta_field: The field of ``fields`` that holds the provenance the seal records.

    Returns:
        ``(fields, tensors)``.

    Raises:
        ResultFileError: The folder holds another type, is damaged, or was changed after saving.
    """
    path = Path(path).expanduser()
    stored = _read_json(path)
    if stored.get("type") != kind:
        raise ResultFileError(f"{path} holds a {stored.get('type')}, not a saved {kind}")
    fields = stored.get("fields")
    if not isinstance(fields, dict):
        raise ResultFileError(f"{path / JSON_FILE} has no 'fields' object; the file is damaged")
    tensors, header = _read_tensors(path)
    _check_sealed(path / TENSOR_FILE, stored.get(DIGEST_KEY), header, fields.get(meta_field), path / JSON_FILE)
    return fields, tensors


# --- what a saved result's values may be ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """A condition a field's value keeps (``Result._legal``).

    Attributes:
        description: What is accepted, in the error a damaged folder raises.
        test: True of a legal value.
    """

    description: str
    test: Callable[[Any], bool]

    def __repr__(self) -> str:
        return self.description


def _numbers(value: Any) -> torch.Tensor:
    """Every number in ``value`` (a number, a tensor, or lists / dicts of them; ``None`` skipped) as one
    float64 tensor; a string or other non-number inside raises ``TypeError``."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).double()
    if isinstance(value, (bool, int, float)):
        return torch.tensor([float(value)], dtype=torch.float64)
    if isinstance(value, (list, tuple, dict)):
        items = value.values() if isinstance(value, dict) else value
        parts = [_numbers(v) for v in items if v is not None]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    raise TypeError(f"{type(value).__name__} is not a number")


def _each(description: str, test: Callable[[torch.Tensor], torch.Tensor]) -> Rule:
    """A rule every number of the value keeps (NaN allowed: a score that could not be computed)."""
    def check(value: Any) -> bool:
        x = _numbers(value)
        return bool((test(x) | x.isnan()).all())

    return Rule(description, check)


# float32 sums can land a hair past a bound (a mean of probabilities at 1.0000001)
_SLACK = 1e-5
PROBABILITY = _each("numbers in [0, 1] (or NaN)", lambda x: (x >= -_SLACK) & (x <= 1 + _SLACK))
CORRELATION = _each("numbers in [-1, 1] (or NaN)", lambda x: x.abs() <= 1 + _SLACK)
NON_NEGATIVE = _each("numbers >= 0 (or NaN)", lambda x: x >= 0)
POSITIVE = _each("numbers > 0 (or NaN)", lambda x: x > 0)
INTEGRAL = _each("whole numbers", lambda x: x == x.round())
INCREASING = Rule("a strictly increasing list (each value once, in order)",
                  lambda value: all(a < b for a, b in zip(value, value[1:])))
FLOATING = Rule("a floating-point tensor", lambda value: bool(value.is_floating_point()))
DISTINCT = Rule("a list with each value once", lambda value: len({repr(v) for v in value}) == len(value))


def _axes(value: Any) -> Optional[list[int]]:
    """The lengths ``_shapes`` compares: a tensor's shape, a list's length, an int's value."""
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [len(value)]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return None


def _check_shapes(cls: type, values: dict, path: Path) -> None:
    """Fields that name an axis share its length; each field has the axes it declares."""
    seen: dict[str, tuple[int, str]] = {}
    for name, spec in getattr(cls, "_shapes", {}).items():
        sizes = _axes(values.get(name))
        if sizes is None:
            continue  # absent (defaulted), None (optional) or of a wrong kind (reported by _check_fields)
        axes = spec.split()
        open_ended = axes[-1:] == ["..."]
        axes = axes[:-1] if open_ended else axes
        if len(sizes) < len(axes) or (not open_ended and len(sizes) != len(axes)):
            raise ResultFileError(f"{path}: field {name!r} should have axes ({spec}), got shape {tuple(sizes)}; "
                                  "the file is damaged")
        for axis, size in zip(axes, sizes):
            if axis.isdigit():
                if size != int(axis):
                    raise ResultFileError(f"{path}: field {name!r} should have {axis} along its axes ({spec}), got "
                                          f"shape {tuple(sizes)}; the file is damaged")
                continue
            first = seen.setdefault(axis, (size, name))
            if first[0] != size:
                raise ResultFileError(f"{path} ({JSON_FILE}, {TENSOR_FILE}): {first[1]!r} and {name!r} share the "
                                      f"{axis!r} axis but have {first[0]} and {size} along it; the files are "
                                      "damaged or come from two different results")


def _check_legal(cls: type, values: dict, path: Path) -> None:
    """Each declared field holds values it may take."""
    for name, legal in getattr(cls, "_legal", {}).items():
        value = values.get(name)
        if value is None:
            continue
        if isinstance(legal, tuple):
            items = value if isinstance(value, list) else [value]
            bad = [v for v in items if not any(type(v) is type(x) and v == x for x in legal)]
            if bad:
                raise ResultFileError(f"{path / JSON_FILE}: field {name!r} holds {bad[0]!r}; accepted: "
                                      f"{', '.join(map(repr, legal))}; the file is damaged")
            continue
        for rule in legal if isinstance(legal, list) else [legal]:
            try:
                kept = rule.test(value)
            except (TypeError, ValueError, RuntimeError):
                kept = False
            if not kept:
                shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
                raise ResultFileError(f"{path}: field {name!r} should hold {rule.description}, got {shown:.200}; "
                                      "the file is damaged")


# --- loading and checking saved folders ------------------------------------------------------------


def _read_json(path: Path) -> dict:
    file = path / JSON_FILE
    if not file.exists():
        raise ResultFileError(f"{path} is not a saved result (no {JSON_FILE} inside)")
    try:
        stored = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ResultFileError(f"{file} is damaged or truncated: it cannot be read as JSON ({error})") from None
    if not isinstance(stored, dict) or "type" not in stored:
        raise ResultFileError(f"{file} has no 'type' field; it is not a saved arithinterp result")
    version = stored.get("format", 1)  # results saved before the format was written are format 1
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ResultFileError(f"{file}: 'format' must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise ResultFileError(f"{file} is in result format {version}, newer than this arithinterp reads "
                              f"(format {FORMAT_VERSION}); upgrade arithinterp to load it")
    return stored


def _read_tensors(path: Path) -> tuple[dict, dict[str, str]]:
    """The tensors of a saved folder and its tensor file's header metadata (``{}`` when it has none)."""
    from safetensors import SafetensorError, safe_open

    file = path / TENSOR_FILE
    if not file.exists():
        raise ResultFileError(f"{file} is missing; a saved result keeps its tensors there (was the folder copied "
                              "in part?)")
    try:
        with safe_open(str(file), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}, dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError) as error:
        raise ResultFileError(f"{file} is damaged, truncated or not a safetensors file ({error})") from None


# --- the seal: what a folder held when it was saved ---------------------------------------------------


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:  # in blocks: a large result is not read into memory whole
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_tensors(file: Path, tensors: dict[str, torch.Tensor], meta: Any) -> str:
    """Write a saved folder's tensors, sealed: the header metadata says this package wrote the file and
    records the fingerprint ``meta`` holds (``""`` for none), which :func:`_check_sealed` compares.

    Args:
        file: The safetensors file to write (atomically).
        tensors: The tensors, contiguous and on the CPU.
        meta: The ``meta`` saved beside them.

    Returns:
        The file's sha256 (hex), for the JSON beside it to record.

    Raises:
        OutputError: The file could not be written.
    """
    from safetensors.torch import save_file

    from arithinterp.outputs import atomic_write

    made_on = meta.get("fingerprint") if isinstance(meta, dict) else None
    # safetensors' header metadata holds strings only: "" stands for no fingerprint
    header = {"written_by": WRITTEN_BY, "fingerprint": made_on if isinstance(made_on, str) else ""}
    atomic_write(file, lambda tmp: save_file(tensors, str(tmp), metadata=header))
    return _sha256(file)


def _check_sealed(file: Path, digest: Any, header: dict[str, str], meta: Any, meta_file: Path) -> None:
    """Refuse a saved folder changed after :func:`_write_tensors` sealed it. A folder without a seal
    (saved by an earlier version, or written by another program) has neither record and is not
    checked; a saved import from SAELens or circuit-tracer files is sealed with no fingerprint, as
    its ``meta`` names no model.

    Args:
        file: The tensor file.
        digest: The sha256 the JSON records for it (``None`` when it records none).
        header: The tensor file's header metadata.
        meta: The ``meta`` read from the JSON.
        meta_file: The file ``meta`` was read from, for the message.

    Raises:
        ResultFileError: The tensor file's bytes are not the ones saved (a tensor edited, transposed or
            re-saved by hand), or ``meta`` lacks or changed the fingerprint the tensor file records
            (emptied, the key deleted: the model check would be skipped).
    """
    redo = "save the result again (result.save(path, overwrite=True)) or make it again on the model"
    if digest is not None and (not isinstance(digest, str) or _sha256(file) != digest):
        raise ResultFileError(f"{file} was changed after saving: its bytes are not the ones whose sha256 "
                              f"{meta_file.name} records ({str(digest)[:16]}...), so a tensor in it was edited, "
                              f"transposed or re-saved by hand; {redo}")
    if header.get("written_by") != WRITTEN_BY:
        return
    made_on = header.get("fingerprint", "")
    kept = meta.get("fingerprint", "") if isinstance(meta, dict) else ""
    if kept != made_on:
        saved = f"for the model whose weight fingerprint is {made_on}" if made_on else "with no model fingerprint"
        now = f"holds the fingerprint {kept}" if kept else "has no fingerprint"
        raise ResultFileError(f"{meta_file}: the folder's metadata was removed or edited after saving: {file.name} "
                              f"was saved {saved}, but field 'meta' {now}, so the check that the result is used "
                              f"on the model it was made on would be skipped or wrong; {redo} (to use a result on "
                              "another model on purpose, save result.on_model(model))")


def _kind(annotation: Any) -> tuple[Optional[type], bool]:
    """``(type the stored value must have, None allowed)`` from a field's annotation (a string
    under ``from __future__ import annotations``); ``(None, True)`` when the annotation says nothing
    checkable."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = text.replace(" ", "")
    optional = text.startswith("Optional[") or "None" in text.split("|")
    if text.startswith("Optional["):
        text = text[len("Optional["):-1]
    text = text.split("|")[0]
    base = text.split("[")[0].split(".")[-1]
    kinds = {"Tensor": torch.Tensor, "list": list, "List": list, "tuple": list, "dict": dict, "Dict": dict,
             "str": str, "int": int, "float": (int, float), "bool": bool}
    return kinds.get(base), optional  # type: ignore[return-value]


def _read_other_names(cls: type, values: dict) -> None:
    """Give the fields and values a folder spells another way (``_field_names``, ``_value_names``)
    the class's names, in place."""
    for saved, name in getattr(cls, "_field_names", {}).items():
        if saved in values and name not in values:
            values[name] = values.pop(saved)
    for name, spellings in getattr(cls, "_value_names", {}).items():
        value = values.get(name)
        if isinstance(value, str):
            values[name] = spellings.get(value, value)
        elif isinstance(value, list):
            values[name] = [spellings.get(v, v) if isinstance(v, str) else v for v in value]


def _check_fields(cls: type, values: dict, path: Path) -> None:
    """Every field the class needs is there, of the right kind; aligned fields agree in length."""
    for field in dataclasses.fields(cls):
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        where = TENSOR_FILE if _kind(field.type)[0] is torch.Tensor else JSON_FILE
        if field.name not in values:
            if required:
                raise ResultFileError(f"{path / where} has no field {field.name!r}, which a {cls.__name__} needs; "
                                      + _missing_field_advice(values.get("meta")))
            continue  # a field added since the folder was saved: it takes its default
        kind, optional = _kind(field.type)
        value = values[field.name]
        if kind is None or (value is None and optional):
            continue
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            expected = "a tensor" if kind is torch.Tensor else f"a {field.type}"
            raise ResultFileError(f"{path / where}: field {field.name!r} should be {expected}, got "
                                  f"{type(value).__name__}; the file is damaged")
    meta = values.get("meta")
    for key in getattr(cls, "_required_meta", ()):
        if not isinstance(meta, dict) or key not in meta:
            raise ResultFileError(f"{path / JSON_FILE}: field 'meta' has no {key!r}, which a {cls.__name__} "
                                  "needs; the file is damaged")
    if isinstance(meta, dict) and "model" in meta and "fingerprint" not in meta:  # build_meta writes both or neither
        raise ResultFileError(f"{path / JSON_FILE}: meta names the model {meta['model']!r} it was made on but not "
                              "that model's weight fingerprint; the file is damaged")
    saved = meta.get("fingerprint", "0" * 16) if isinstance(meta, dict) else "0" * 16
    if not (isinstance(saved, str) and re.fullmatch(r"[0-9a-f]{16}", saved)):  # None would skip the model check
        raise ResultFileError(f"{path / JSON_FILE}: meta 'fingerprint' holds {saved!r}, not the 16 hex digits of the "
                              "weights it was made on; the file is damaged")
    _check_shapes(cls, values, path)
    _check_legal(cls, values, path)


def _missing_field_advice(meta: Any) -> str:
    """What to do about a missing field: a folder saved by an older arithinterp predates the field
    (recompute, or load it with that version), one saved by a newer one dropped it (load it with
    that version); otherwise the file is damaged."""
    from arithinterp._version import __version__

    saved = meta.get("arithinterp_version") if isinstance(meta, dict) else None
    if not isinstance(saved, str) or saved == __version__:
        return "the file is damaged or was written by another program"
    if _release(saved) < _release(__version__):
        return (f"the result was saved by arithinterp {saved}, before this version ({__version__}) added the field: "
                f"recompute it with this version, or load it with arithinterp {saved}")
    return (f"the result was saved by arithinterp {saved}, newer than this version ({__version__}): "
            f"load it with arithinterp {saved} or later")


def _release(version: str) -> tuple[int, ...]:
    """``"0.1.0rc1"`` -> ``(0, 1, 0)``: the release numbers, enough to order two versions."""
    parts = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _refuse_other_result(path: Path, stored: dict, tensors: dict) -> None:
    """Refuse to replace a saved result in ``path`` by a different one (the same one may be re-saved)."""
    if not holds_result(path):
        return
    try:
        old = json.loads((path / JSON_FILE).read_text())
        old_tensors = _read_tensors(path)[0]
    except Exception:  # noqa: BLE001 - an unreadable old result is still a result we would replace
        old, old_tensors = None, {}
    same = (isinstance(old, dict) and old.get("type") == stored["type"] and old.get("fields") == stored["fields"]
            and old_tensors.keys() == tensors.keys()
            and all(torch.equal(old_tensors[k], tensors[k]) for k in tensors))
    if not same:
        what = f"a saved {old.get('type')}" if isinstance(old, dict) and old.get("type") else "a saved result"
        raise ResultFileError(f"{path} already holds {what} that differs from this {stored['type']}; "
                              "pass overwrite=True to replace it, or save to another folder")
