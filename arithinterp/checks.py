"""Shared input checks: one helper per kind of input, used at every public entry.

* :func:`integer` / :func:`integers` — whole numbers (Python, numpy or torch integers; never a
  bool, float or string, never truncated);
* :func:`check_model` — the object passed as ``model`` is a hooked model, not a spec string;
* :func:`architecture` — the facts about a model that results and detectors are tied to, and
  :func:`model_id` the name results give it;
* :func:`check_tokens` — token ids a forward can take (integers, within the vocabulary and context),
  and :func:`prompt_tokens` one prompt exactly as given (not empty, no unknown tokens, not cut);
* :func:`fingerprint` — a hash of a model's weights, which parts and results made on it record and
  :func:`check_fingerprint` compares;
* :func:`check_belongs` — prompts, pairs, circuits and detectors were made for this model;
* :func:`check_pairs` — counterfactual pairs that can be patched (aligned, not empty);
* :func:`check_choice` — one of a fixed set of names (a metric, a direction, an ablation).
"""

from __future__ import annotations

import hashlib
import operator
import os
import weakref
from typing import Any, Iterable, Optional

import torch

from arithinterp.types import HookedModel
from arithinterp.errors import (
    AnalysisError, ArithInterpError, ConfigError, ModelMismatchError, ModelSpecError, SiteError, TokenizationError,
    accepted,
)

# --- whole numbers ----------------------------------------------------------------------------------


def integer(name: str, value: Any, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
            error: type[ArithInterpError] = ConfigError, hint: str = "") -> int:
    """Read a whole number. Python, numpy and torch integers (and 0-d integer tensors) are accepted;
    bools, floats and strings are refused, never truncated.

    Args:
        name: The parameter to name in the error message.
        value: The value to read.
        minimum: The smallest accepted value (inclusive); ``None`` for no bound.
        maximum: The largest accepted value (inclusive); ``None`` for no bound.
        error: The error class to raise.
        hint: Text that ends the message (what the number means, another accepted form).

    Returns:
        ``value`` as an int.

    Raises:
        ArithInterpError: ``error``, when ``value`` is not an integer or is out of bounds.
    """
    low, high = ("" if minimum is None else str(minimum)), ("" if maximum is None else str(maximum))
    span = f" in {low}..{high}" if low and high else (f" >= {low}" if low else (f" <= {high}" if high else ""))
    problem = f"{name} must be an integer{span}{hint}, got {value!r}"
    if isinstance(value, (bool, str, bytes)) or (isinstance(value, torch.Tensor) and value.is_floating_point()):
        raise error(f"{problem} ({type(value).__name__})")
    try:
        number = operator.index(value)
    except TypeError:
        raise error(f"{problem} ({type(value).__name__})") from None
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise error(f"{name} must be an integer{span}{hint}, got {number}")
    return number


def integers(name: str, values: Any, error: type[ArithInterpError] = SiteError) -> list[int]:
    """Read one integer or several; floats, strings and bools are refused, never truncated.

    Args:
        name: The parameter to name in the error message.
        values: An integer, an iterable of integers, or an integer tensor (flattened).
        error: The error class to raise.

    Returns:
        The values as a list of ints.

    Raises:
        ArithInterpError: ``error``, when a value is not an integer.
    """
    if isinstance(values, (str, bytes)):
        raise error(f"{name} must be an int or a list of ints, got the string {values!r}")
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist() if not values.is_floating_point() else values.reshape(-1)
    items = list(values) if isinstance(values, Iterable) else [values]
    out = []
    for v in items:
        try:
            if isinstance(v, (bool, str, bytes)) or (isinstance(v, torch.Tensor) and v.is_floating_point()):
                raise TypeError
            out.append(operator.index(v))
        except TypeError:
            shown = v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
            raise error(f"{name} must be whole numbers (ints), got {shown!r} ({type(shown).__name__})") from None
    return out


#: The most optimizer steps a training run takes (das, train, train-transcoders): the recipes take
#: hundreds to tens of thousands, and past 2**63 the progress bar's range overflows.
STEPS_MAX = 10_000_000


# --- models -----------------------------------------------------------------------------------------

_MODEL_SURFACE = ("cfg", "to_tokens", "run_with_cache")


def check_model(model: Any, where: str) -> None:
    """Refuse anything that is not a hooked model (a spec string, a path, another object).

    Args:
        model: The object passed as ``model``.
        where: The function to name in the error message.

    Raises:
        ModelSpecError: ``model`` is a string or path, or lacks ``cfg``, ``to_tokens``,
            ``run_with_cache`` or the config's layer, width and head counts.
    """
    if isinstance(model, (str, bytes, os.PathLike)):
        raise ModelSpecError(f"{where}: model must be a loaded model, got the {type(model).__name__} {str(model)!r}; "
                             f"load it first: model = arithinterp.load_model({str(model)!r})")
    missing = [name for name in _MODEL_SURFACE if not hasattr(model, name)]
    cfg = getattr(model, "cfg", None)
    missing += [f"cfg.{name}" for name in ("n_layers", "d_model", "n_heads") if cfg is not None
                and not hasattr(cfg, name)]
    if missing:
        raise ModelSpecError(
            f"{where}: model must be a hooked model (from arithinterp.load_model, or a TransformerLens model), got "
            f"{type(model).__name__}, which lacks {', '.join(missing)}"
        )


def architecture(model: Any) -> dict[str, Any]:
    """What a model's graph and activations are shaped by.

    Args:
        model: A hooked model.

    Returns:
        ``n_layers``, ``d_model``, ``n_heads``, ``n_kv_heads``, ``d_mlp``, ``d_vocab``, ``n_ctx``
        (``None`` when unset), ``has_mlp`` and ``parallel`` (attention and MLP read the same input).
    """
    cfg = model.cfg

    def size(name: str) -> Optional[int]:  # None when unset (TransformerLens writes -1 for "not known yet")
        value = getattr(cfg, name, None)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    return dict(
        n_layers=int(cfg.n_layers), d_model=int(cfg.d_model), n_heads=int(cfg.n_heads),
        n_kv_heads=int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads), d_mlp=size("d_mlp"),
        d_vocab=size("d_vocab"), n_ctx=size("n_ctx"), has_mlp=not bool(getattr(cfg, "attn_only", False)),
        parallel=bool(getattr(cfg, "parallel_attn_mlp", False)),
    )



def model_id(model: HookedModel) -> str:
    """A short human-readable id for a loaded model.

    Args:
        model: A hooked model.

    Returns:
        The spec it was loaded from when known, else ``cfg.model_name``.

    Raises:
        ModelSpecError: ``model`` is not a hooked model.
    """
    check_model(model, "model_id")
    return str(getattr(model, "arithinterp_spec", None) or getattr(model.cfg, "model_name", "model"))


_WEIGHTS: "weakref.WeakKeyDictionary[Any, tuple[tuple, str]]" = weakref.WeakKeyDictionary()
_SAMPLE = 256  # values read from each parameter


def fingerprint(model: Any) -> str:
    """A hash of a model's weights: every parameter's shape and 256 values strided across it, rounded
    to bfloat16 so that the same weights in another dtype or on another device agree.

    Two models of one shape and vocabulary with different weights get different fingerprints; parts
    and results made on one carry it (``meta["fingerprint"]``) and are refused on the other. Cached
    per model until a parameter is changed in place.

    Args:
        model: A model with ``parameters()`` (anything else hashes as having no weights).

    Returns:
        16 hex digits.
    """
    parameters = list(model.parameters()) if hasattr(model, "parameters") else []
    versions = tuple(int(getattr(p, "_version", 0)) for p in parameters)
    try:
        cached = _WEIGHTS.get(model)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is not None and cached[0] == versions:
        return cached[1]
    digest = hashlib.sha256()
    with torch.no_grad():
        for p in parameters:
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // _SAMPLE)][:_SAMPLE]
            digest.update(str(tuple(p.shape)).encode())
            digest.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    found = digest.hexdigest()[:16]
    try:
        _WEIGHTS[model] = (versions, found)
    except TypeError:
        pass
    return found


def check_fingerprint(model: Any, saved: Optional[str], what: str, where: str, origin: Any = None) -> None:
    """Refuse a part or result whose recorded fingerprint is not ``model``'s.

    Args:
        model: The model it is used on.
        saved: The fingerprint it records; ``None`` (none recorded) is not checked.
        what: What it is, for the message (``"circuit"``, ``"detector"``).
        where: The function to name in the message.
        origin: The model it was made on, for the message.

    Raises:
        ModelMismatchError: The fingerprints differ.
    """
    if saved is None or not hasattr(model, "parameters"):
        return
    mine = fingerprint(model)
    if str(saved) != mine:
        made_on = f" ({origin})" if origin else ""
        raise ModelMismatchError(f"{where}: the {what} came from another model{made_on}: its weights' fingerprint "
                                 f"is {saved}, this model's is {mine}; a model of the same shape is not enough — "
                                 "make it again on this model")


# --- tokens -----------------------------------------------------------------------------------------


def prompt_tokens(model: Any, prompt: Any, where: str) -> torch.Tensor:
    """One prompt as token ids, exactly as given; never cut to the context.

    Args:
        model: The hooked model whose tokenizer reads the prompt.
        prompt: A non-empty string every piece of which the tokenizer knows, or token ids
            ``[pos]`` / ``[1, pos]`` in the vocabulary.
        where: The function to name in the error message.

    Returns:
        Int[Tensor, "1 pos"]: The prompt's token ids.

    Raises:
        TokenizationError: The prompt is empty, of another type, holds unknown tokens or ids
            outside the vocabulary, or is longer than the context.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise TokenizationError(f"{where}: the prompt is empty; give the text to analyse, e.g. '36+59='")
        try:
            tokens = model.to_tokens(prompt, truncate=False)
        except TypeError:  # a model whose to_tokens has no truncate option
            tokens = model.to_tokens(prompt)
        unk = getattr(getattr(model, "tokenizer", None), "unk_token_id", None)
        if unk is not None and bool((tokens == unk).any()):
            n = int((tokens == unk).sum())
            raise TokenizationError(f"{where}: {n} piece(s) of the prompt {prompt!r} are not in this model's "
                                    "vocabulary (they would be read as the unknown token); use only text its "
                                    "tokenizer knows")
    elif isinstance(prompt, torch.Tensor) and not isinstance(prompt, bool):
        tokens = prompt.reshape(1, -1) if prompt.ndim == 1 else prompt
        if tokens.ndim != 2 or tokens.shape[0] != 1:
            raise TokenizationError(f"{where}: one prompt at a time: token ids [T] or [1, T], got shape "
                                    f"{tuple(prompt.shape)}")
        if tokens.shape[1] == 0:
            raise TokenizationError(f"{where}: the prompt has no tokens")
    else:
        raise TokenizationError(f"{where}: a prompt is a string or a tensor of token ids, got "
                                f"{type(prompt).__name__} {prompt!r:.60}")
    try:
        check_tokens(model, tokens, "the prompt's tokens")
    except SiteError as error:
        raise TokenizationError(f"{where}: {error}") from None
    return tokens



def check_tokens(model: Any, tokens: Any, what: str = "tokens", extra: int = 0) -> None:
    """Check that token ids can be fed to a model.

    Args:
        model: The hooked model.
        tokens (Int[Tensor, "batch pos"]): Token ids.
        what: What they are, for the message.
        extra: Tokens fed after the prompt (teacher-forced answer tokens), counted against the context.

    Raises:
        SiteError: ``tokens`` is not a 2-D integer tensor, holds ids outside ``0..d_vocab - 1``, or
            ``pos + extra`` exceeds the context ``n_ctx``.
    """
    if not isinstance(tokens, torch.Tensor):
        raise SiteError(f"{what} must be a torch tensor of token ids [batch, pos], got {type(tokens).__name__}")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise SiteError(f"{what} must hold integer token ids (torch.long), got dtype {tokens.dtype}; "
                        "build them with model.to_tokens or arithinterp.tasks")
    if tokens.ndim != 2:
        raise SiteError(f"{what} must be [batch, pos], got shape {tuple(tokens.shape)}")
    facts = architecture(model)
    n_ctx = facts["n_ctx"]
    _check_ids(tokens, facts["d_vocab"], what)
    width = int(tokens.shape[1]) + extra
    if n_ctx is not None and width > n_ctx:
        fed = f" (with {extra} fed answer token(s))" if extra else ""
        raise SiteError(f"{what} are {width} tokens long{fed}, more than this model's context of {n_ctx} tokens")


def _check_ids(ids: torch.Tensor, vocab: Optional[int], what: str) -> None:
    if ids.numel() and vocab is not None:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            bad = high if high >= vocab else low
            raise SiteError(f"{what} hold the token id {bad}, outside this model's vocabulary of {vocab} tokens "
                            f"(accepted: 0..{vocab - 1}); were they made with another tokenizer?")


# --- does it belong to this model -------------------------------------------------------------------

# the facts that must agree for a circuit or a detector made on one model to be used on another
_SHAPE_KEYS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_mlp", "has_mlp", "parallel")
_FINGERPRINTS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _vocabulary(tokenizer: Any) -> Optional[int]:
    """A fingerprint of a tokenizer's vocabulary (cached), or None when it has none to compare."""
    try:
        return _FINGERPRINTS[tokenizer]
    except (KeyError, TypeError):
        pass
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    fingerprint = hash(frozenset(get_vocab().items()))
    try:
        _FINGERPRINTS[tokenizer] = fingerprint
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return fingerprint


def _check_prompt_set(model: Any, prompts: Any, what: str, where: str) -> None:
    mine, theirs = getattr(model, "tokenizer", None), getattr(prompts, "tokenizer", None)
    if mine is not None and theirs is not None and mine is not theirs and _vocabulary(mine) != _vocabulary(theirs):
        sizes = (f"a vocabulary of {len(theirs)} tokens; this model's has {len(mine)}" if len(theirs) != len(mine)
                 else f"the same number of tokens, {len(mine)}, but other ones")
        raise ModelMismatchError(f"{where}: the {what} were built with another tokenizer ({sizes}); build them for "
                                 "this model: arithinterp.tasks.arithmetic(model, ...)")
    answers = getattr(prompts, "answer_tokens", None)
    extra = 0 if answers is None else max(int(answers.shape[1]) - 1, 0)
    try:
        check_tokens(model, prompts.tokens, f"the {what}' tokens", extra=extra)
        if answers is not None:
            _check_ids(answers[answers >= 0], architecture(model)["d_vocab"], f"the {what}' answer tokens")
    except SiteError as error:
        raise ModelMismatchError(f"{where}: the {what} do not fit this model: {error}; build them for this model: "
                                 "arithinterp.tasks.arithmetic(model, ...)") from None


def _check_shape(model: Any, saved: dict, what: str, where: str, origin: Any) -> None:
    facts = architecture(model)
    differ = [k for k in _SHAPE_KEYS if k in saved and saved[k] is not None and saved[k] != facts[k]]
    if differ:
        made_on = f" ({origin!r})" if origin else ""
        described = ", ".join(f"{k} {saved[k]} vs {facts[k]}" for k in differ)
        raise ModelMismatchError(f"{where}: the {what} was made on another model{made_on}: {described} (its value vs "
                                 f"this model's); make it again on this model")


def check_belongs(model: Any, where: str, **things: Any) -> None:
    """Refuse prompts, pairs, a circuit or a fitted detector that were made for another model.

    Each keyword names what is checked (``pairs=...``, ``prompts=...``, ``circuit=...``,
    ``detector=...``): prompt sets must share this model's vocabulary and fit its context; a
    result or estimator must come from a model of the same shape (``meta["architecture"]``, or a
    circuit's ``meta["layout"]``) and, when it records one, the same weights' fingerprint.

    Args:
        model: The model they are used on; checked first.
        where: The function to name in the error message.
        **things: What to check, by name (``pairs=...``, ``prompts=...``, ``circuit=...``,
            ``detector=...``); ``None`` values are skipped.

    Raises:
        ModelSpecError: ``model`` is not a hooked model.
        AnalysisError: ``pairs`` is not PromptPairs, or ``prompts`` not a PromptSet.
        ModelMismatchError: A thing was made for another model (vocabulary, context, shape or weights).
    """
    check_model(model, where)
    for what, thing in things.items():
        if thing is None:
            continue
        is_pairs = hasattr(thing, "clean") and hasattr(thing, "corrupt")
        is_set = hasattr(thing, "tokens") and hasattr(thing, "lengths")
        if (what == "pairs" and not is_pairs) or (what == "prompts" and not (is_set or is_pairs)):
            made = "PromptSet.counterfactual" if what == "pairs" else "arithinterp.tasks.arithmetic"
            kind = "PromptPairs" if what == "pairs" else "a PromptSet"
            raise AnalysisError(f"{where}: {what} must be {kind} (from {made}), got {type(thing).__name__}")
        if is_pairs:
            _check_prompt_set(model, thing.clean, what, where)
            _check_prompt_set(model, thing.corrupt, what, where)
        elif is_set:
            _check_prompt_set(model, thing, what, where)
        meta = getattr(thing, "meta", None)
        meta = getattr(thing, "meta_", None) if not isinstance(meta, dict) else meta
        if isinstance(meta, dict):
            saved = {**(meta.get("layout") or {}), **(meta.get("architecture") or {})}
            _check_shape(model, saved, what, where, meta.get("model"))
            check_fingerprint(model, meta.get("fingerprint"), what, where, meta.get("model"))


# --- pairs and choices --------------------------------------------------------------------------------


def check_pairs(pairs: Any) -> None:
    """Check that counterfactual pairs can be patched.

    Args:
        pairs: The pairs.

    Raises:
        AnalysisError: ``pairs`` is not ``PromptPairs``, is empty, or its clean and corrupt prompts
            differ in token shape or lengths.
    """
    if not hasattr(pairs, "clean") or not hasattr(pairs, "corrupt"):
        raise AnalysisError(f"expected PromptPairs (from PromptSet.counterfactual), got {type(pairs).__name__}")
    if len(pairs) == 0:
        raise AnalysisError("the prompt pairs are empty; nothing to patch")
    if pairs.clean.tokens.shape != pairs.corrupt.tokens.shape or not torch.equal(
        pairs.clean.lengths, pairs.corrupt.lengths
    ):
        raise AnalysisError("clean and corrupt prompts must have identical token shapes and lengths within each pair")


def check_choice(name: str, value: Any, choices: Iterable) -> None:
    """Check that a value is one of a fixed set of names.

    Args:
        name: The parameter to name in the error message.
        value: The value given.
        choices: The accepted values.

    Raises:
        ConfigError: ``value`` is not one of ``choices``; the message lists them.
    """
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}; accepted: {accepted(choices)}")
