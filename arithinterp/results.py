"""The base of every analysis result.

One module past 600 lines on purpose: the Result contract and its sealed folder format (what
``save`` writes, ``load`` checks) change together; splitting the format out would leave two modules
that each need the other's private details.

A result is a frozen dataclass of tensors (and plain values) plus ``meta``. Every result has

* ``.to_frame()`` — a tidy pandas DataFrame, one row per cell;
* ``.plot(**kwargs)`` — a plotly ``Figure`` built by :mod:`arithinterp.viz`;
* ``.save(path)`` / ``Result.load(path)`` — tensors in safetensors, everything else in JSON
  (``path`` is a directory, written whole by :func:`arithinterp.outputs.write_folder`), never
  pickle. The JSON carries a format version (:data:`FORMAT_VERSION`); ``load`` checks the folder
  and raises :class:`~arithinterp.errors.ResultFileError` naming the file and field of any damage,
  and ``save`` does not replace anything but the same result unless ``overwrite=True``.

**The seal.** A folder is sealed whole when saved: ``result.json`` records the sha256 of the tensor
file, and the tensor file's header records the model fingerprint and a digest of each of
``result.json``'s fields. ``load`` refuses a tensor edited by hand (a weight transposed), a field
edited, added or removed (``"axes": ["layer"]``, ``"site": "bogus"``), and a ``meta`` emptied or
stripped of its fingerprint (which would skip the model check), naming the field. A folder with no
seal (saved by an earlier version, or written by another program) is refused unless loaded with
``unsealed=True``, which checks its fields against the type's invariants and warns
(:class:`UnsealedResultWarning`); saving it again seals it.

**The model.** A result computed from a model records the model's weight fingerprint in ``meta``
(:func:`build_meta`, or :func:`made_from` for results computed from activations); every function
that takes a result and a model compares them and refuses another model's result
(:class:`~arithinterp.errors.ModelMismatchError`). :meth:`Result.on_model` declares a result for
another model on purpose (a fit applied to a random-init control).

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
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, Optional, Union

import numpy as np
import torch
from pydantic import Field

from arithinterp.checks import architecture, fingerprint, model_id
from arithinterp.errors import ConfigError, FormatError, ResultFileError
from arithinterp.outputs import writes
from arithinterp.sites import HOOKS
from arithinterp.schemas import Digest, Schema, file_sha256, read_json, read_safetensors, validate
from arithinterp.types import HookedModel

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

TENSOR_FILE = "tensors.safetensors"
JSON_FILE = "result.json"
FORMAT_VERSION = 1  # of the saved JSON; a newer format is refused with a clear message on load
DIGEST_KEY = "tensors_sha256"  # result.json's record of the tensor file's bytes
WRITTEN_BY = "arithinterp"  # the tensor file header's "written_by": a folder this package saved and sealed
FIELDS_KEY = "fields_sha256"  # the tensor file header's record of result.json's content, field by field


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


def build_meta(model: Optional[HookedModel] = None, /, **extra: Any) -> dict[str, Any]:
    """Provenance for a result's ``meta``.

    Args:
        model: The model the result was made on (positional); ``None`` records the versions only.
        **extra: Further entries (the analysis's arguments, or :func:`made_from`'s provenance of what
            the result was computed from), made JSON-friendly (tensors and ranges as lists).

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


#: The ``meta`` keys that say which model a result was made on (what :func:`build_meta` records).
PROVENANCE = ("model", "architecture", "fingerprint", "compatibility_mode")


def made_from(source: Any) -> dict[str, Any]:
    """The model provenance of what a result is computed from (activations, another result): the
    ``meta`` keys of :data:`PROVENANCE` it holds, for :func:`build_meta`'s ``extra``, so that a result
    computed from activations is tied to the model they were collected on.

    Args:
        source: An object with a ``meta`` dict (``Activations``, a ``Result``), or a ``meta`` dict.

    Returns:
        Those keys and values (empty when ``source`` records no model).
    """
    meta = source if isinstance(source, dict) else getattr(source, "meta", None)
    return {k: meta[k] for k in PROVENANCE if k in meta} if isinstance(meta, dict) else {}


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
    * ``_relations``: :class:`Relation` s between fields (a cell-axis name per dimension of a tensor,
      the nodes a circuit's kept edges touch), each naming the field it is reported under;
    * ``_required_meta``: keys ``meta`` must hold.

    Subclasses are frozen dataclasses; each lists its fields under ``Attributes:``.
    """

    _shapes: ClassVar[dict[str, str]] = {}
    _legal: ClassVar[dict[str, Any]] = {}
    _relations: ClassVar[tuple["Relation", ...]] = ()
    _required_meta: ClassVar[tuple] = ()

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

    @writes
    def save(self, path: Union[str, Path], *, overwrite: bool = False,
             extra_files: Optional[dict[str, str]] = None) -> Path:
        """Write the result to a folder, whole: tensors to ``tensors.safetensors``, the rest to
        ``result.json``, sealed together (see the module docstring). The folder is written by the
        package's guarded writer (:func:`arithinterp.outputs.write_folder`): complete or not at all,
        never through a symbolic link out of its parent, the old folder kept until the new one is
        complete.

        Args:
            path: The folder. Saving the same result there again does nothing and is always allowed.
            overwrite: Replace a folder that holds anything else (a different result, other files);
                strictly ``True`` or ``False``.
            extra_files: Text files written into the folder with the result, in the same write (a
                card saying how the result was made), by name; not part of the seal.

        Returns:
            The folder.

        Raises:
            ConfigError: ``overwrite`` is not a bool, or the folder cannot be written, or holds files
                (not a saved result) and ``overwrite`` is false.
            ResultFileError: The folder holds a different saved result and ``overwrite`` is false.
            OutputError: A file could not be written; the folder is as it was.
        """
        tensors, plain = {}, {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                tensors[field.name] = value
            else:
                plain[field.name] = _plain(value)
        return write_sealed(path, type(self).__name__, plain, tensors, plain.get("meta"), overwrite=overwrite,
                            extra_files=extra_files)

    @classmethod
    def load(cls, path: Union[str, Path], *, unsealed: bool = False):
        """Read a result written by :meth:`save`.

        The folder is checked before anything is built from it: ``result.json`` against its schema,
        every field against the type's declared invariants (``_shapes``, ``_legal``, ``_relations``),
        then the seal — the tensors must be the bytes ``result.json`` records and ``result.json`` the
        content the tensor file's header records, so a field or tensor changed by hand is refused.

        Args:
            path: The folder :meth:`save` wrote.
            unsealed: Also load a folder that carries no seal (saved by arithinterp before 0.2, which
                sealed the tensors only, or written by another program): its fields are checked
                against the type's invariants but nothing proves they are the ones saved, so it loads
                with an :class:`UnsealedResultWarning`. Save it again to seal it.

        Returns:
            The result, of this class.

        Raises:
            ResultFileError: The folder holds another type of result, or is damaged (a missing or
                unreadable file, a missing field, a field of the wrong kind, fields that should agree
                and do not, a format newer than this version reads), or was changed after saving
                (a tensor or a field edited by hand, ``meta`` emptied or its fingerprint removed), or
                is unsealed and ``unsealed`` is false; the message names the file and the field
                (:class:`~arithinterp.errors.FormatError` where ``result.json`` breaks its schema).
            ConfigError: ``unsealed`` is not a bool.
        """
        from arithinterp.outputs import check_overwrite

        check_overwrite(unsealed, "unsealed")
        path = Path(path)
        stored = _read_json(path)
        kind = stored["type"]
        if kind != cls.__name__:
            raise ResultFileError(f"{path} holds a {kind}, not a {cls.__name__}")
        values = dict(stored["fields"])
        tensors, header = _read_tensors(path)
        overlap = sorted(set(values) & set(tensors))
        if overlap:
            raise ResultFileError(f"{path}: field {overlap[0]!r} is in both {JSON_FILE} and {TENSOR_FILE}; "
                                  "the folder mixes two saved results")
        values.update(tensors)
        _check_fields(cls, values, path)
        sealed = _check_sealed(path, stored, header, values.get("meta"))
        if not sealed:
            advice = (f"load it with {cls.__name__}.load(path, unsealed=True) if you trust where it came from, "
                      "then save it again to seal it")
            if not unsealed:
                raise ResultFileError(f"{path} is not sealed: nothing proves its {JSON_FILE} and {TENSOR_FILE} are "
                                      f"the ones one result was saved with (it was saved by an earlier version or "
                                      f"written by another program); {advice}")
            warnings.warn(f"{path} is not sealed: its fields keep the {cls.__name__} invariants, but nothing proves "
                          "they are the ones saved; save it again to seal it", UnsealedResultWarning, stacklevel=2)
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


class UnsealedResultWarning(UserWarning):
    """A result loaded with ``unsealed=True`` from a folder that carries no seal."""


def holds_result(path: Union[str, Path]) -> bool:
    """Whether a folder holds a saved result (what :meth:`Result.save` refuses to replace).

    Args:
        path: The folder.

    Returns:
        True when it holds a ``result.json``.
    """
    return (Path(path).expanduser() / JSON_FILE).exists()


# --- sealed folders of what is not a result (a fitted ErrorDetector): the same files and seal ------


@writes
def write_sealed(path: Union[str, Path], kind: str, fields: dict[str, Any], tensors: dict[str, torch.Tensor],
                 meta: Any, *, overwrite: bool = False, extra_files: Optional[dict[str, str]] = None) -> Path:
    """Write a sealed folder, whole, as :meth:`Result.save` does for a result (and a fitted
    :class:`~arithinterp.probes.ErrorDetector` for itself): ``tensors`` to ``tensors.safetensors``,
    whose header records the fingerprint ``meta`` holds and the digest of ``result.json``'s content;
    ``fields`` to ``result.json``, which records the tensor file's sha256.

    Args:
        path: The folder. Writing the same content there again does nothing and is always allowed.
        kind: What the folder holds (its ``type``).
        fields: JSON-ready values.
        tensors: The tensors, by name.
        meta: The provenance whose fingerprint seals the tensor file.
        overwrite: Replace a folder that holds anything else; strictly ``True`` or ``False``.
        extra_files: Text files written into the folder in the same write, by name; not sealed.

    Returns:
        The folder.

    Raises:
        ConfigError: ``overwrite`` is not a bool, or the folder cannot be written, or holds files
            (not a saved result) and ``overwrite`` is false.
        ResultFileError: The folder holds a different saved result and ``overwrite`` is false.
        OutputError: A file could not be written; the folder is as it was.
    """
    from arithinterp.outputs import check_overwrite, check_target, write_file, write_folder

    check_overwrite(overwrite)
    tensors = {name: value.detach().cpu().contiguous() for name, value in tensors.items()}
    stored: dict[str, Any] = json.loads(json.dumps({"type": kind, "format": FORMAT_VERSION, "fields": fields}))
    target = Path(path).expanduser()
    if holds_result(target):
        if _holds_same(target, stored, tensors):
            return check_target(target, overwrite=True, what="save", folder=True)
        if not overwrite:
            old = _saved_type(target)
            what = f"a saved {old}" if old else "a saved result"
            raise ResultFileError(f"{path} already holds {what} that differs from this {kind}; "
                                  "pass overwrite=True to replace it, or save to another folder")
    with write_folder(target, overwrite=overwrite, what="save") as folder:
        # the tensor file's header seals result.json's content; result.json records the tensor file's bytes
        stored[DIGEST_KEY] = _write_tensors(folder / TENSOR_FILE, tensors, meta, _fields_digest(stored))
        write_file(folder / JSON_FILE, json.dumps(stored, indent=1), overwrite=False, what="save")
        for name, text in (extra_files or {}).items():
            if Path(name).name != name or name in (JSON_FILE, TENSOR_FILE):
                raise ConfigError(f"extra_files: {name!r} is not a file name of its own in the folder")
            write_file(folder / name, text, overwrite=False, what="save")
    return target


def read_sealed(path: Union[str, Path], kind: str, meta_field: str = "meta") -> tuple[dict[str, Any], dict]:
    """Read a folder :func:`write_sealed` wrote, checking its type and its seal.

    Args:
        path: The folder.
        kind: The type it must hold.
        meta_field: The field of ``fields`` that holds the provenance the seal records.

    Returns:
        ``(fields, tensors)``.

    Raises:
        ResultFileError: The folder holds another type, is damaged, was changed after saving, or is
            not sealed.
    """
    path = Path(path).expanduser()
    stored = _read_json(path)
    if stored["type"] != kind:
        raise ResultFileError(f"{path} holds a {stored['type']}, not a saved {kind}")
    fields = stored["fields"]
    tensors, header = _read_tensors(path)
    if not _check_sealed(path, stored, header, fields.get(meta_field)):
        raise ResultFileError(f"{path} is not sealed: nothing proves its {JSON_FILE} and {TENSOR_FILE} are the ones "
                              f"one {kind} was saved with; save it again from where it was made")
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


@dataclasses.dataclass(frozen=True)
class Relation:
    """A condition between fields of a result (``Result._relations``), checked on load after each field's
    own kind, shape and values.

    Attributes:
        field: The field a violation is reported under.
        description: What is expected, in the error.
        test: True of legal field values (given the dict of every field by name).
    """

    field: str
    description: str
    test: Callable[[dict], bool]


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
#: A measured accuracy: a number in [0, 1] that was computed (not NaN).
MEASURED_PROBABILITY = Rule("a number in [0, 1] (not NaN)", lambda value: bool(
    ((_numbers(value) >= -_SLACK) & (_numbers(value) <= 1 + _SLACK)).all()))
SITE = Rule("a site of arithinterp.sites.HOOKS (a head's as 'attn_z[3]')",
            lambda value: isinstance(value, str) and value.partition("[")[0] in HOOKS)
INCREASING = Rule("a strictly increasing list (each value once, in order)",
                  lambda value: all(a < b for a, b in zip(value, value[1:])))
FLOATING = Rule("a floating-point tensor", lambda value: bool(value.is_floating_point()))
BOOLEAN = Rule("a bool tensor", lambda value: value.dtype == torch.bool)
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


class ResultFile(Schema):
    """The schema of a saved folder's ``result.json``: the type, the format, the fields (checked
    against the type's own declarations by :meth:`Result.load`) and the tensor file's digest."""

    type: Annotated[str, Field(min_length=1)]
    format: Annotated[int, Field(ge=1)] = 1  # results saved before the format was written are format 1
    fields: dict[str, Any]
    tensors_sha256: Optional[Digest] = None


def _read_json(path: Path) -> dict:
    file = path / JSON_FILE
    if not file.exists():
        raise ResultFileError(f"{path} is not a saved result (no {JSON_FILE} inside)")
    stored = read_json(file, "JSON")
    if not isinstance(stored, dict) or "type" not in stored:
        raise FormatError(f"{file} has no 'type' field; it is not a saved arithinterp result")
    if "fields" not in stored:
        raise FormatError(f"{file} has no 'fields' object; the file is damaged")
    validate(ResultFile, stored, file, f"a saved result's {JSON_FILE}")
    if stored.get("format", 1) > FORMAT_VERSION:
        raise FormatError(f"{file} is in result format {stored['format']}, newer than this arithinterp reads "
                          f"(format {FORMAT_VERSION}); upgrade arithinterp to load it")
    return stored


def _read_tensors(path: Path) -> tuple[dict, dict[str, str]]:
    """The tensors of a saved folder and its tensor file's header metadata (``{}`` when it has none)."""
    file = path / TENSOR_FILE
    if not file.exists():
        raise ResultFileError(f"{file} is missing; a saved result keeps its tensors there (was the folder copied "
                              "in part?)")
    return read_safetensors(file)


def _saved_type(path: Path) -> Optional[str]:
    """The type a saved folder names, or None when its JSON cannot be read."""
    try:
        stored = json.loads((path / JSON_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    kind = stored.get("type") if isinstance(stored, dict) else None
    return kind if isinstance(kind, str) else None


def _holds_same(path: Path, stored: dict, tensors: dict) -> bool:
    """Whether ``path`` already holds this very result, sealed (saving it again has nothing to do)."""
    try:
        old = json.loads((path / JSON_FILE).read_text())
        old_tensors, header = read_safetensors(path / TENSOR_FILE)
    except Exception:  # noqa: BLE001 - an unreadable old result is not this one
        return False
    return (isinstance(old, dict) and {k: old.get(k) for k in ("type", "format", "fields")} == stored
            and header.get(FIELDS_KEY) == _fields_digest(stored) and old_tensors.keys() == tensors.keys()
            and all(old_tensors[k].dtype == tensors[k].dtype and torch.equal(old_tensors[k], tensors[k])
                    for k in tensors))


# --- the seal: what a folder held when it was saved ---------------------------------------------------


def _canonical_sha256(value: Any) -> str:
    """The sha256 of ``value`` written as canonical JSON (keys sorted, no spaces): the same content gives
    the same digest however the file is laid out."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _fields_digest(stored: dict) -> str:
    """What seals ``result.json``: the sha256 of its type, its format and each of its fields, as JSON
    (``{"type": ..., "format": ..., "fields.NAME": ...}``), so that a change names the field changed."""
    digests = {"type": _canonical_sha256(stored.get("type")), "format": _canonical_sha256(stored.get("format", 1))}
    fields = stored.get("fields")
    for name, value in (fields.items() if isinstance(fields, dict) else ()):
        digests[f"fields.{name}"] = _canonical_sha256(value)
    return json.dumps(digests, sort_keys=True, separators=(",", ":"))


def _write_tensors(file: Path, tensors: dict[str, torch.Tensor], meta: Any, fields: str) -> str:
    """Write a saved folder's tensors, sealed: the header metadata says this package wrote the file,
    records the fingerprint ``meta`` holds (``""`` for none) and the digest of ``result.json``'s
    content, which :func:`_check_sealed` compares.

    Args:
        file: The safetensors file to write (a new file in the folder being written).
        tensors: The tensors, contiguous and on the CPU.
        meta: The ``meta`` saved beside them.
        fields: :func:`_fields_digest` of the ``result.json`` saved beside them.

    Returns:
        The file's sha256 (hex), for the JSON beside it to record.

    Raises:
        OutputError: The file could not be written.
    """
    from arithinterp.outputs import write_tensors

    made_on = meta.get("fingerprint") if isinstance(meta, dict) else None
    # safetensors' header metadata holds strings only: "" stands for no fingerprint
    header = {"written_by": WRITTEN_BY, "fingerprint": made_on if isinstance(made_on, str) else "",
              FIELDS_KEY: fields}
    write_tensors(file, tensors, metadata=header, overwrite=False, what="save")
    return file_sha256(file)


def _check_sealed(path: Path, stored: dict, header: dict[str, str], meta: Any) -> bool:
    """Refuse a saved folder changed after :func:`_write_tensors` sealed it; say whether it is sealed.

    A folder is sealed whole when ``result.json`` records the tensor file's sha256 and the tensor
    file's header (written by this package) records the digest of ``result.json``'s content. A
    folder that has neither record (saved by an earlier version, or written by another program) is
    unsealed: nothing here refuses it, and :meth:`Result.load` decides. A saved import from SAELens or
    circuit-tracer files is sealed with no fingerprint, as its ``meta`` names no model.

    Args:
        path: The folder.
        stored: ``result.json``'s content.
        header: The tensor file's header metadata.
        meta: The ``meta`` read from the JSON.

    Returns:
        Whether the folder is sealed whole.

    Raises:
        ResultFileError: The tensor file's bytes are not the ones saved (a tensor edited, transposed or
            re-saved by hand); ``meta`` lacks or changed the fingerprint the tensor file records
            (emptied, the key deleted: the model check would be skipped); ``result.json``'s content is
            not the one saved (a field edited by hand); or one of the two records was removed.
    """
    file, meta_file = path / TENSOR_FILE, path / JSON_FILE
    digest = stored.get(DIGEST_KEY)
    redo = "save the result again (result.save(path, overwrite=True)) or make it again on the model"
    if digest is not None and file_sha256(file) != digest:
        raise ResultFileError(f"{file} was changed after saving: its bytes are not the ones whose sha256 "
                              f"{meta_file.name} records ({str(digest)[:16]}...), so a tensor in it was edited, "
                              f"transposed or re-saved by hand; {redo}")
    if header.get("written_by") != WRITTEN_BY:
        return False
    made_on = header.get("fingerprint", "")
    kept = meta.get("fingerprint", "") if isinstance(meta, dict) else ""
    if kept != made_on:
        saved = f"for the model whose weight fingerprint is {made_on}" if made_on else "with no model fingerprint"
        now = f"holds the fingerprint {kept}" if kept else "has no fingerprint"
        raise ResultFileError(f"{meta_file}: the folder's metadata was removed or edited after saving: {file.name} "
                              f"was saved {saved}, but field 'meta' {now}, so the check that the result is used "
                              f"on the model it was made on would be skipped or wrong; {redo} (to use a result on "
                              "another model on purpose, save result.on_model(model))")
    fields = header.get(FIELDS_KEY)
    if fields is None:
        return False  # sealed by an earlier version, over its tensors only
    if digest is None:
        raise ResultFileError(f"{meta_file} was changed after saving: the sha256 of {file.name} it recorded "
                              f"('{DIGEST_KEY}') was removed; {redo}")
    if _fields_digest(stored) != fields:
        try:
            sealed = json.loads(fields)
        except ValueError:
            sealed = {}
        now = json.loads(_fields_digest(stored))
        changed = sorted(k for k in set(sealed) | set(now) if sealed.get(k) != now.get(k))
        names = ", ".join(repr(k.removeprefix("fields.")) for k in changed) or "its layout"
        raise ResultFileError(f"{meta_file} was changed after saving: field(s) {names} are not what {file.name} was "
                              f"sealed with (edited, added or removed by hand); {redo}")
    return True


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
    for relation in getattr(cls, "_relations", ()):
        try:
            kept = relation.test(values)
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError, AttributeError):
            kept = False
        if not kept:
            raise ResultFileError(f"{path}: field {relation.field!r} should be {relation.description}; the file is "
                                  "damaged")


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
