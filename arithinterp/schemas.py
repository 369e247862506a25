"""Declared schemas for the files the package reads, and the one way they are read.

Every format read from disk — a saved result's ``result.json``, circuit-tracer's graph ``.pt`` and
viewer index, transcoders in circuit-tracer's ``config.yaml`` + ``layer_{i}.safetensors`` and
SAELens's ``cfg.json`` + ``sae_weights.safetensors``, pyvene's ``config.json`` + ``intkey_*.bin`` —
is declared as a pydantic model beside its reader (strict: nothing is coerced, ``"12"`` is not 12,
``true`` is not 1) and validated here *before anything is built from it*. Tensors are checked
against the shapes the validated fields imply (:func:`check_tensor`): floating point, finite, of the
declared shape. A violation is one :class:`~arithinterp.errors.FormatError` naming the file, the
field and what was expected; a damaged file (truncated, not JSON, not safetensors, a pickle of
something else) is one too, never a raw ``JSONDecodeError`` or ``UnpicklingError``.

Checks that need the model (a layer below ``n_layers``, a token id inside the vocabulary, a
position inside the prompt, the fingerprint of the weights) are made by each reader with
:func:`below`, as soon as the model is known and before the work.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Optional, Sequence, TypeVar, Union

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from arithinterp.errors import FormatError

_M = TypeVar("_M", bound=BaseModel)

#: The configuration every schema shares: strict types; keys a schema does not declare are kept
#: (the other tools add keys from version to version) and not read.
STRICT = ConfigDict(strict=True, extra="allow", arbitrary_types_allowed=True, allow_inf_nan=False)


def _fingerprint(value: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{16}", value):
        raise ValueError("a weight fingerprint is 16 hex digits (arithinterp.checks.fingerprint)")
    return value


#: A model's weight fingerprint (:func:`arithinterp.checks.fingerprint`): 16 hex digits.
Fingerprint = Annotated[str, AfterValidator(_fingerprint)]
#: A sha256 digest, 64 hex digits.
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
#: A count of at least one.
Count = Annotated[int, Field(gt=0)]
#: An index (0 or more).
Index = Annotated[int, Field(ge=0)]
#: A finite number.
Finite = Annotated[float, Field(allow_inf_nan=False)]


class Schema(BaseModel):
    """Base of every file schema: strict, extra keys allowed."""

    model_config = STRICT


def _where(loc: Sequence[Union[str, int]]) -> str:
    """``("metadata", "hook_name")`` -> ``'metadata.hook_name'``; list items as ``[3]``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(the whole file)"


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate(schema: type[_M], data: Any, file: Union[str, Path], what: str = "") -> _M:
    """``data`` read from ``file`` checked against ``schema``.

    Args:
        schema: The declared schema.
        data: What the file held (parsed JSON or YAML, or a dict unpickled safely).
        file: The file, for the message.
        what: What the file is, for the message (``"a SAELens cfg.json"``).

    Returns:
        The validated model.

    Raises:
        FormatError: The first violation: the file, the field, the value and what is expected.
    """
    if not isinstance(data, dict):
        kind = what or f"a {schema.__name__}"
        raise FormatError(f"{file}: expected {kind} (a mapping of fields), got {type(data).__name__} "
                          f"{_shown(data)}")
    try:
        return schema.model_validate(data, strict=True)
    except ValidationError as error:
        first = error.errors()[0]
        loc = first.get("loc", ())
        problem = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        if first.get("type") == "missing":
            raise FormatError(f"{file}: field {_where(loc)!r} is missing; {what or schema.__name__} needs it") from None
        raise FormatError(f"{file}: field {_where(loc)!r} holds {_shown(first.get('input'))}: {problem}") from None


def read_json(file: Union[str, Path], what: str = "JSON") -> Any:
    """The JSON value in ``file``.

    Args:
        file: The file.
        what: What the file is, for the message.

    Returns:
        The parsed value.

    Raises:
        FormatError: No such file, or one that cannot be read as JSON (damaged, truncated, not UTF-8,
            nested beyond what can be read).
    """
    path = Path(file)
    if not path.is_file():
        raise FormatError(f"{path}: no such file; {what} is read from it")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as error:
        raise FormatError(f"{path} is damaged or truncated: it cannot be read as {what} "
                          f"({type(error).__name__}: {_shown(str(error), 120)})") from None


def read_yaml(file: Union[str, Path], what: str = "YAML") -> Any:
    """The YAML value in ``file``, read safely (``yaml.safe_load``: no objects are built).

    Args:
        file: The file.
        what: What the file is, for the message.

    Returns:
        The parsed value.

    Raises:
        FormatError: No such file, or one that cannot be read as YAML.
    """
    import yaml

    path = Path(file)
    if not path.is_file():
        raise FormatError(f"{path}: no such file; {what} is read from it")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError) as error:
        raise FormatError(f"{path} is damaged or truncated: it cannot be read as {what} "
                          f"({type(error).__name__}: {_shown(str(error), 120)})") from None


def read_safetensors(file: Union[str, Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a safetensors file and its header metadata (``{}`` when it has none).

    Args:
        file: The file.

    Returns:
        ``(tensors by name, metadata)``.

    Raises:
        FormatError: No such file, or one that is damaged, truncated or not safetensors.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(file)
    if not path.is_file():
        raise FormatError(f"{path}: no such file; the weights are read from it")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}, dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as error:
        raise FormatError(f"{path} is damaged, truncated or not a safetensors file "
                          f"({type(error).__name__}: {_shown(str(error), 120)})") from None


def read_pickle(file: Union[str, Path], allowed: Sequence[Any] = (), what: str = "a torch.save file") -> Any:
    """What ``torch.save`` wrote to ``file``, read with ``weights_only=True``: tensors and plain
    containers only, plus the ``allowed`` classes (``(stand-in, "module.Name")`` pairs); a file that
    would run or build anything else is refused, never executed.

    Args:
        file: The file.
        allowed: Classes allowed by name (:func:`torch.serialization.safe_globals`).
        what: What the file is, for the message.

    Returns:
        The unpickled value.

    Raises:
        FormatError: No such file, or one that is damaged or holds something else.
    """
    path = Path(file)
    if not path.is_file():
        raise FormatError(f"{path}: no such file; {what} is read from it")
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # the unpickler raises several types for a file that is not this format
        first = str(error).splitlines()[0] if str(error) else ""
        raise FormatError(f"{path} is not {what} that loads safely ({type(error).__name__}: "
                          f"{_shown(first, 160)})") from None


def file_sha256(file: Union[str, Path]) -> str:
    """The sha256 of a file's bytes (hex), read in blocks (a large file is not read into memory whole).

    Args:
        file: The file.

    Returns:
        64 hex digits.
    """
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_tensor(file: Union[str, Path], name: str, value: Any, shape: Sequence[Optional[int]], *,
                 floating: bool = True, finite: bool = True) -> torch.Tensor:
    """Refuse a tensor of the wrong kind, shape or values.

    Args:
        file: The file it was read from, for the message.
        name: Its name in the file.
        value: What the file holds under ``name``.
        shape: The expected shape; ``None`` for an axis of any length.
        floating: It must be floating point (weights), else an integer tensor (indices).
        finite: Every value must be finite (no NaN, no infinity).

    Returns:
        ``value``.

    Raises:
        FormatError: Not a tensor, of another dtype kind or shape, or with non-finite values.
    """
    if not isinstance(value, torch.Tensor):
        raise FormatError(f"{file}: {name!r} should be a tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise FormatError(f"{file}: {name!r} should be floating point (weights), got {value.dtype}")
    if not floating and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        raise FormatError(f"{file}: {name!r} should hold integers, got {value.dtype}")
    wanted = tuple(shape)
    if value.ndim != len(wanted) or any(w is not None and w != s for w, s in zip(wanted, value.shape)):
        shown = "[" + ", ".join("*" if w is None else str(w) for w in wanted) + "]"
        raise FormatError(f"{file}: {name!r} should have shape {shown}, got {list(value.shape)}")
    if floating and finite and value.numel() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise FormatError(f"{file}: {name!r} holds {bad} non-finite value(s) (NaN or infinity); weights must be finite")
    return value


def below(file: Union[str, Path], field: str, values: Any, limit: int, what: str) -> None:
    """Refuse an index outside ``0..limit - 1``.

    Args:
        file: The file, for the message.
        field: The field holding the indices.
        values: An int, a list of ints or an integer tensor.
        limit: The exclusive upper bound.
        what: What bounds it (``"the model's 2 layers"``).

    Raises:
        FormatError: A value below 0 or at least ``limit``.
    """
    flat = values.reshape(-1).tolist() if isinstance(values, torch.Tensor) else (
        list(values) if isinstance(values, (list, tuple)) else [values])
    bad = [v for v in flat if not 0 <= v < limit]
    if bad:
        raise FormatError(f"{file}: field {field!r} holds {bad[0]}, outside {what} (accepted: 0..{limit - 1})")


__all__ = [
    "STRICT", "Schema", "Fingerprint", "Digest", "Count", "Index", "Finite", "validate", "read_json", "read_yaml",
    "read_safetensors", "read_pickle", "file_sha256", "check_tensor", "below",
]
