"""Shared input checks: one helper per kind of input, used at every public entry.

* :func:`integer` / :func:`integers` — whole numbers (Python, numpy or torch integers; never a
  bool, float or string, never truncated);
* :func:`check_model` — the object passed as ``model`` is a hooked model, not a spec string;
* :func:`architecture` — the facts about a model that results and detectors are tied to, and
  :func:`model_id` the name results give it;
* :func:`check_tokens` — token ids a forward can take (integers, within the vocabulary and context);
* :func:`check_belongs` — prompts, pairs, circuits and detectors were made for this model;
* :func:`check_pairs` — counterfactual pairs that can be patched (aligned, not empty);
* :func:`check_choice` — one of a fixed set of names (a metric, a direction, an ablation).
"""

from __future__ import annotations

import operator
import os
import weakref
from typing import Any, Iterable, Optional

import torch

from arithinterp.errors import (
    AnalysisError, ArithInterpError, ConfigError, ModelMismatchError, ModelSpecError, SiteError, accepted,
)

# --- whole numbers ----------------------------------------------------------------------------------


def integer(name: str, value: Any, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
            error: type[ArithInterpError] = ConfigError, hint: str = "") -> int:
    """``value`` as an int. Python, numpy and torch integers (and 0-d integer tensors) are accepted;
    bools, floats and strings are refused, never truncated; ``minimum`` / ``maximum`` are inclusive.
    ``hint`` ends the message (what the number means, another accepted form)."""
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
    """``values`` (one integer or several) as ints; floats, strings and bools are refused, never truncated."""
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


# --- models -----------------------------------------------------------------------------------------

_MODEL_SURFACE = ("cfg", "to_tokens", "run_with_cache")


def check_model(model: Any, where: str) -> None:
    """Refuse anything that is not a hooked model (a spec string, a path, another object)."""
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
    """What a model's graph and activations are shaped by: layer and head counts, widths, vocabulary
    and context sizes, MLP and parallel-block flags."""
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



def model_id(model: Any) -> str:
    """A short human-readable id for a loaded model (the spec it was loaded from, if known)."""
    return str(getattr(model, "arithinterp_spec", None) or getattr(model.cfg, "model_name", "model"))


# --- tokens -----------------------------------------------------------------------------------------


def check_tokens(model: Any, tokens: Any, what: str = "tokens", extra: int = 0) -> None:
    """``tokens [B, T]`` can be fed to ``model``: an integer tensor, ids in ``0..d_vocab-1``, and
    ``T + extra`` (``extra`` tokens fed after the prompt) within the context ``n_ctx``."""
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
    circuit's ``meta["layout"]``). ``None`` values are skipped. The model itself is checked first.
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


# --- pairs and choices --------------------------------------------------------------------------------


def check_pairs(pairs: Any) -> None:
    """Counterfactual pairs that can be patched: ``PromptPairs``, not empty, clean and corrupt
    prompts of identical token shapes and lengths."""
    if not hasattr(pairs, "clean") or not hasattr(pairs, "corrupt"):
        raise AnalysisError(f"expected PromptPairs (from PromptSet.counterfactual), got {type(pairs).__name__}")
    if len(pairs) == 0:
        raise AnalysisError("the prompt pairs are empty; nothing to patch")
    if pairs.clean.tokens.shape != pairs.corrupt.tokens.shape or not torch.equal(
        pairs.clean.lengths, pairs.corrupt.lengths
    ):
        raise AnalysisError("clean and corrupt prompts must have identical token shapes and lengths within each pair")


def check_choice(name: str, value: Any, choices: Iterable) -> None:
    """``value`` is one of ``choices``, else a :class:`ConfigError` naming ``name`` and the accepted ones."""
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}; accepted: {accepted(choices)}")
