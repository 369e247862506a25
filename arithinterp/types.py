"""The types the analyses share, and the one place their declared parameters are enforced.

:class:`HookedModel` is what every analysis asks of a model: TransformerLens's hooked surface.
``load_model`` returns a ``TransformerBridge`` (TransformerLens 4), which has it; a 2.x / 3.x
``HookedTransformer`` has it too, and so does a user's own model with these members. Prompts
travel as :class:`arithinterp.tasks.PromptSet` and :class:`arithinterp.tasks.PromptPairs`.

Tensor shapes in annotations use jaxtyping, as TransformerLens does: ``Float[Tensor, "batch pos
d_model"]``; the names below are the ones the package uses.

**Declared parameters.** A public function states what each parameter accepts in its signature
(``k: PositiveInt``, ``features: Sequence[NonNegativeInt]``, ``lr: PositiveFiniteFloat``,
``max_memory: Optional[ByteSize]``) and carries :func:`checked`, which enforces the signature with
pydantic's strict validation before the body runs. Strict means nothing is coerced: ``"12"`` is not
12, ``1.5`` and ``True`` are not ints, a string is not a list of characters. What *is* accepted
beyond the Python type: integers of numpy and torch (and 0-d integer tensors) where an int is
declared, numpy / torch scalars where a float is, ``range``, integer arrays and tensors where a
sequence of ints is, ``str`` or any ``os.PathLike`` where a ``Path`` is, and ``"1GiB"`` / ``2e9``
where a :data:`ByteSize` is. A plain ``float`` is finite unless declared :data:`AnyFloat`. A
violation raises :class:`arithinterp.errors.ConfigError` naming the function, the parameter, the
value and what the parameter accepts.

pydantic is used (rather than beartype) because it checks every item of a list, not one sampled at
random, so ``features=[1, 2.5]`` is refused on every call; its errors carry the parameter and the
offending item, which the message repeats; and its constraints (``gt``, ``ge``, finite numbers,
byte sizes) are declarations rather than code. Checks that need the model — a position inside the
prompt, a layer the model has, a token its tokenizer knows — stay in the analyses, where the model
is at hand.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import math
import operator
import os
import types as _pytypes
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Optional, Protocol, TypeVar, Union

import numpy as np
import pydantic
import torch
from jaxtyping import Float, Int
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from arithinterp.errors import ConfigError

# Axis names used in shape annotations: batch (prompts or pairs), pos (token positions), layer,
# d_model / d_mlp (residual / neuron width), vocab, n (numbers on an axis), freq (Fourier frequencies).
Logits = Float[torch.Tensor, "batch pos vocab"]
Tokens = Int[torch.Tensor, "batch pos"]


class HookedModel(Protocol):
    """The hooked-model surface the analyses use.

    ``cfg`` (``n_layers``, ``d_model``, ``n_heads``, ``d_mlp``, ...), ``tokenizer`` (a Hugging Face
    tokenizer), ``to_tokens``, a forward call returning logits and ``run_with_cache``. TransformerLens's
    hook methods are the engine's business (:mod:`arithinterp.engine.hooks`), so analyses never see
    them here; they and the other attributes of TransformerLens models (``W_U``, ``blocks``,
    ``ln_final``, ...) are reached through ``__getattr__``, as on any ``torch.nn.Module``.
    """

    cfg: Any
    tokenizer: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def to_tokens(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any: ...

    def __getattr__(self, name: str) -> Any: ...


# --- declared parameter types ------------------------------------------------------------------------


class Accepts:
    """The words an error message uses for what a declared type accepts (``Annotated`` metadata)."""

    def __init__(self, words: str):
        self.words = words

    def __repr__(self) -> str:
        return f"Accepts({self.words!r})"


def _as_int(value: Any) -> Any:
    """numpy / torch integers (and 0-d integer tensors) as int; anything else is left for strict
    validation to refuse (bools, floats and strings are never turned into ints)."""
    if isinstance(value, (bool, int, float, str, bytes, np.bool_)):
        return value
    if isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.is_floating_point()
                                            or value.is_complex() or value.numel() != 1):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _as_float(value: Any) -> Any:
    """numpy / torch real scalars as float (bools stay bools, for strict validation to refuse)."""
    if isinstance(value, (np.floating, np.integer)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool \
            and not value.is_complex():
        return float(value.item())
    return value


def _as_list(value: Any) -> Any:
    """A ``range``, an iterator, a set, a numpy array or a tensor as a list (then checked item by item);
    a string stays a string, which a sequence refuses."""
    if isinstance(value, (range, collections.abc.Iterator, set, frozenset)):  # a generator is read once, here
        return list(value)
    if isinstance(value, np.ndarray):
        return value.reshape(-1).tolist() if value.ndim else value
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist() if value.ndim else value
    return value


def _as_bytes(value: Any) -> Any:
    """``"1GiB"`` / ``"512MB"`` read by pydantic's byte-size parser, a whole float (``2e9``) as int."""
    if isinstance(value, str):
        try:
            return int(TypeAdapter(pydantic.ByteSize).validate_python(value))
        except ValidationError:
            raise ValueError(f"{value!r} is not a size (accepted: bytes as a number, or a size such as "
                             "'512MiB', '1GiB', '2GB')") from None
    value = _as_float(value) if not isinstance(value, (bool, int)) else value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return _as_int(value)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("a finite number is needed")
    return value


#: An int, or a numpy / torch integer; never a bool, float or string.
Integer = Annotated[int, BeforeValidator(_as_int), Accepts("an int")]
#: An int >= 1.
PositiveInt = Annotated[int, BeforeValidator(_as_int), Field(gt=0), Accepts("a positive int (1, 2, ...)")]
#: The most interpolation steps an integrated-gradient method takes: each is a forward and a backward
#: pass over every pair, and attributions settle within 5–100 steps.
MAX_IG_STEPS = 1000
#: Interpolation steps of an integrated-gradient method: 1 to :data:`MAX_IG_STEPS`.
IntegrationSteps = Annotated[int, BeforeValidator(_as_int), Field(gt=0, le=MAX_IG_STEPS),
                             Accepts(f"an int from 1 to {MAX_IG_STEPS} (5–100 is usual)")]
#: An int >= 0.
NonNegativeInt = Annotated[int, BeforeValidator(_as_int), Field(ge=0), Accepts("a non-negative int (0, 1, ...)")]
#: A real number, NaN and infinities included (a plain ``float`` annotation means a finite one).
AnyFloat = Annotated[float, BeforeValidator(_as_float), Accepts("a number")]
#: A finite real number.
FiniteFloat = Annotated[float, BeforeValidator(_as_float), AfterValidator(_finite), Accepts("a finite number")]
#: A finite number > 0.
PositiveFiniteFloat = Annotated[float, BeforeValidator(_as_float), AfterValidator(_finite), Field(gt=0),
                                Accepts("a finite number > 0")]
#: A finite number >= 0.
NonNegativeFiniteFloat = Annotated[float, BeforeValidator(_as_float), AfterValidator(_finite), Field(ge=0),
                                   Accepts("a finite number >= 0")]
#: The largest float32: a learning rate or a value written into float32 activations beyond it overflows.
FLOAT32_MAX = 3.4028234663852886e38
#: A finite number within float32's range (a value written into activations).
Float32 = Annotated[float, BeforeValidator(_as_float), AfterValidator(_finite), Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX),
                    Accepts("a finite number within ±3.4e38 (what float32 holds)")]
#: A finite number > 0 within float32's range (a learning rate of a float32 optimizer).
PositiveFloat32 = Annotated[float, BeforeValidator(_as_float), AfterValidator(_finite), Field(gt=0, le=FLOAT32_MAX),
                            Accepts("a finite number > 0, at most 3.4e38 (what float32 holds)")]
#: A number in [0, 1].
Probability = Annotated[float, BeforeValidator(_as_float), Field(ge=0, le=1), Accepts("a number in [0, 1]")]
#: A number in (0, 1]: a share that must keep something.
PositiveProbability = Annotated[float, BeforeValidator(_as_float), Field(gt=0, le=1), Accepts("a number in (0, 1]")]
#: A number strictly between 0 and 1 (a confidence level, a significance level).
OpenUnitFloat = Annotated[float, BeforeValidator(_as_float), Field(gt=0, lt=1),
                          Accepts("a number strictly between 0 and 1")]
if TYPE_CHECKING:
    # Type checkers see what a caller may pass: declared as the int the body receives, a user's
    # max_memory="1GiB" (which runs) would be reported. checked() reads the Annotated form below at run
    # time; code that does arithmetic on the value reads it with byte_size (or memory_budget) first.
    ByteSize = Union[int, float, str]
else:
    #: A positive number of bytes: an int, a whole float (``2e9``) or a size string (``"1GiB"``, ``"512MB"``).
    ByteSize = Annotated[int, BeforeValidator(_as_bytes), Field(gt=0),
                         Accepts("a positive number of bytes, or a size such as '512MiB' or '1GiB'")]


def _named(path: Any) -> Any:
    if isinstance(path, str) and not path.strip():  # "" would be the working directory, unasked
        raise ValueError("an empty path names no file or folder")
    return path


#: A file-system path: a non-empty ``str`` or any ``os.PathLike`` (kept as given).
PathLike = Annotated[Union[str, os.PathLike], AfterValidator(_named), Accepts("a path (a non-empty str or a "
                                                                               "pathlib.Path)")]
#: A random seed: an int.
Seed = Annotated[int, BeforeValidator(_as_int), Accepts("an int seed")]
#: A modulus answers are reduced by: an int >= 2 (mod 1 makes every answer 0).
Modulus = Annotated[int, BeforeValidator(_as_int), Field(ge=2), Accepts("an int >= 2 (a modulus)")]
#: A list of ints (a ``range``, an integer array or tensor also); never a string.
IntList = Annotated[collections.abc.Sequence[Integer], BeforeValidator(_as_list),
                    Accepts("a list of ints (or a range)")]
#: A list of non-negative ints (indices); never a string.
IndexList = Annotated[collections.abc.Sequence[NonNegativeInt], BeforeValidator(_as_list),
                      Accepts("a list of non-negative ints (or a range)")]
#: A non-empty string.
Name = Annotated[str, Field(min_length=1), Accepts("a non-empty string")]


def byte_size(value: Any, name: str = "max_memory") -> int:
    """Read ``value`` as a :data:`ByteSize`, for code that receives a size other than through a declared
    parameter.

    Args:
        value: A number of bytes (``2e9``, ``1 << 30``) or a string with a unit (``"1GiB"``, ``"512MB"``).
        name: The parameter to name in the error message.

    Returns:
        The size in bytes, positive.

    Raises:
        ConfigError: ``value`` is not a positive size; the message names ``name``.
    """
    try:
        return int(_BYTES.validate_python(value))
    except ValidationError as error:
        problem = str(error.errors()[0].get("msg", "")).removeprefix("Value error, ")
        raise ConfigError(f"{name}={_shown(value)} is not accepted ({problem}); {name} accepts "
                          f"{_words(ByteSize)}") from None


# --- enforcing them ------------------------------------------------------------------------------------

_STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)
_BYTES: TypeAdapter = TypeAdapter(ByteSize, config=_STRICT)
_SEQUENCES = (collections.abc.Sequence, list, tuple, collections.abc.MutableSequence)
_LAZY = (collections.abc.Iterable, collections.abc.Iterator, collections.abc.Generator, collections.abc.Collection)
_F = TypeVar("_F", bound=Callable[..., Any])


def _usable(tp: Any) -> bool:
    """Whether pydantic builds a strict validator for ``tp`` (a class it can only check by isinstance
    is fine; a Protocol or a jaxtyping shape is not)."""
    try:
        TypeAdapter(tp, config=_STRICT)
    except pydantic.PydanticUserError:  # a dataclass or model carries its own config
        try:
            TypeAdapter(tp)
        except Exception:  # any schema failure means: leave this parameter to the function
            return False
    except Exception:
        return False
    return True


def _declared(tp: Any) -> Any:
    """``tp`` as enforced: plain int / float / Path / sequences widened to the package's meaning of them
    (see the module docstring); what pydantic cannot check strictly becomes ``Any`` (left to the body)."""
    if tp is Any or tp is None or tp is type(None):
        return tp
    if tp is int:
        return Integer
    if tp is float:
        return FiniteFloat
    if tp is bool or tp is str:
        return tp
    if tp is Path or tp is os.PathLike:
        return PathLike
    if tp is HookedModel:  # checked by the analyses' own check_model / check_belongs, with their messages
        return Any
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        base, *meta = args
        if base is int or base is float:  # a constrained int / float: numpy and torch scalars too
            tp = Annotated[(_declared(base), *meta)]  # type: ignore[valid-type]
        return tp if _usable(tp) else Any
    if origin is Union or origin is _pytypes.UnionType:
        parts = tuple(_declared(a) for a in args)
        return Any if Any in parts else Union[parts]  # type: ignore[valid-type]
    if origin is Literal:
        return tp
    if origin in _SEQUENCES and args:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            inner = tuple(_declared(a) for a in args)
            return Any if Any in inner else tuple[inner]  # type: ignore[valid-type]
        item = _declared(args[0])
        if item is Any:
            return Any
        seq = tuple[item, ...] if origin is tuple else (list[item] if origin is list
                                                         else collections.abc.Sequence[item])
        return Annotated[seq, BeforeValidator(_as_list)]
    if origin in _LAZY or tp in _LAZY:  # an iterable may be read once: left to the body, which reads it
        return Any
    if getattr(tp, "_is_protocol", False):
        return Any
    if isinstance(tp, type):  # a class: an instance of it, as given (pydantic would rebuild a dataclass)
        return pydantic.InstanceOf[tp] if _usable(pydantic.InstanceOf[tp]) else Any
    return tp if _usable(tp) else Any


def _resolve(fn: Callable, name: str, annotation: Any) -> Any:
    """One parameter's annotation as an object (string annotations evaluated in the function's module;
    a name imported only for type checkers leaves that parameter to the body)."""
    if isinstance(annotation, str):
        namespace = {**vars(typing), **vars(collections.abc), "HookedModel": HookedModel, **fn.__globals__}
        try:
            annotation = eval(annotation, namespace)  # noqa: S307 - the package's own annotations
        except Exception:  # a name imported for type checkers only: the body checks that argument (duck types)
            return Any
    return _declared(annotation)


def _words(tp: Any) -> str:
    """What a declared type accepts, in words."""
    if tp is Any:
        return "anything"
    if tp is None or tp is type(None):
        return "None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        said = [m.words for m in args[1:] if isinstance(m, Accepts)]
        if said:
            return said[-1]
        return _words(args[0])
    if origin is Union or origin is _pytypes.UnionType:
        return " or ".join(dict.fromkeys(_words(a) for a in args))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in _SEQUENCES and args:
        return f"a list (or tuple) whose items are each {_words(args[0])}"
    if origin in (dict, collections.abc.Mapping):
        return "a dict"
    simple = {bool: "True or False", str: "a string", int: "an int", float: "a number"}
    if tp in simple:
        return simple[tp]
    return f"a {getattr(tp, '__name__', str(tp))}"


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Signature:
    """A function's declared parameters as one pydantic validator, built on the first call (so string
    annotations resolve after every module has loaded)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.signature = inspect.signature(fn)
        self.positional = [p.name for p in self.signature.parameters.values()
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.annotations: dict[str, Any] = {}
        self.validator: Optional[Callable[..., Any]] = None

    def build(self) -> Callable[..., Any]:
        for p in self.signature.parameters.values():
            if p.annotation is not inspect.Parameter.empty:
                self.annotations[p.name] = _resolve(self.fn, p.name, p.annotation)

        def arguments(*args: Any, **kwargs: Any) -> tuple[tuple, dict]:
            return args, kwargs

        arguments.__signature__ = self.signature.replace(  # type: ignore[attr-defined]
            parameters=[p.replace(annotation=self.annotations.get(p.name, Any))
                        for p in self.signature.parameters.values()], return_annotation=inspect.Signature.empty)
        arguments.__annotations__ = {name: self.annotations.get(name, Any) for name in self.signature.parameters}
        arguments.__name__, arguments.__qualname__ = self.fn.__name__, self.fn.__qualname__
        arguments.__module__ = self.fn.__module__
        self.validator = pydantic.validate_call(config=_STRICT)(arguments)
        return self.validator

    def error(self, error: ValidationError, args: tuple, kwargs: dict) -> ConfigError:
        """The first violation as a ConfigError: function, parameter, value, what is accepted."""
        first = error.errors()[0]
        loc = list(first.get("loc", ()))
        name = loc[0] if loc else "?"
        if isinstance(name, int) and name < len(self.positional):
            name = self.positional[name]
        where = f"{self.fn.__qualname__}"
        kind = first.get("type", "")
        if kind in ("missing_argument", "missing_positional_only_argument", "missing_keyword_only_argument"):
            return ConfigError(f"{where}: the argument {name!r} is missing")
        if kind.startswith("unexpected_") or kind == "multiple_argument_values":
            shown = f" {name!r}" if isinstance(name, str) else ""
            return ConfigError(f"{where}: {first.get('msg', kind).lower()}{shown}; its parameters are "
                               f"{', '.join(self.signature.parameters)}")
        item = "".join(f"[{part!r}]" for part in loc[1:] if not isinstance(part, str) or part in kwargs)
        bound = kwargs.get(name) if isinstance(name, str) and name in kwargs else (
            args[self.positional.index(name)] if name in self.positional and self.positional.index(name) < len(args)
            else first.get("input"))
        value = f"{_shown(bound)}" + (f" (item {item}: {_shown(first.get('input'))})" if item else "")
        problem = str(first.get("msg", "")).rstrip(".")
        problem = problem.removeprefix("Value error, ")
        accepts = _words(self.annotations.get(name, Any)) if isinstance(name, str) else "?"
        return ConfigError(f"{where}: {name}={value} is not accepted ({problem}); {name} accepts {accepts}")


def checked(fn: _F) -> _F:
    """Enforce ``fn``'s declared parameter types (strict pydantic validation) before its body runs.

    Arguments reach the body as validated: numpy / torch integers as ``int``, ``"1GiB"`` as a number
    of bytes, a ``range`` given for a sequence as a list. A violation raises
    :class:`~arithinterp.errors.ConfigError` (the library's error converted) naming the function,
    the parameter, the value and what is accepted. Decorate public entry points only: the check costs
    microseconds per call, not nothing.

    Args:
        fn: The function whose annotations to enforce.

    Returns:
        ``fn`` wrapped (``functools.wraps``) so that every call validates its arguments first; the
        wrapper raises :class:`~arithinterp.errors.ConfigError` on a violation.
    """
    declared = _Signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        validator = declared.validator or declared.build()
        try:
            args, kwargs = validator(*args, **kwargs)
        except ValidationError as error:
            raise declared.error(error, args, kwargs) from None
        return fn(*args, **kwargs)

    call.__arithinterp_checked__ = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


__all__ = [
    "HookedModel", "Logits", "Tokens", "Accepts", "checked", "Integer", "PositiveInt", "NonNegativeInt", "AnyFloat",
    "FiniteFloat", "PositiveFiniteFloat", "NonNegativeFiniteFloat", "FLOAT32_MAX", "Float32", "PositiveFloat32",
    "Probability", "PositiveProbability", "OpenUnitFloat", "ByteSize", "byte_size", "PathLike", "Seed", "Modulus",
    "IntList", "IndexList", "Name",
]
