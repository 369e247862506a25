"""Which model gets a stepper: the one-time check per model and prompt-length class, cached.

:func:`stepper_for` gives a model's checked :class:`~arithinterp.engine.Stepper` where stepping
reproduces its logits (else ``None`` and the reason, so the caller runs whole forwards); the check
runs once per model and :func:`length_class`, and again when a parameter changes
(:func:`model_fingerprint`). :func:`read_last` reads activations from a stepped run that computes
the prompts' shared first tokens once, and :func:`final_gradients` the final position's activations
and a metric's gradients there.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from arithinterp.engine.shared_prefixes import shared_prefix
from arithinterp.engine.stepping import Stepper, check_n_last
from arithinterp.errors import AnalysisError, ConfigError, accepted

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

# model -> (parameter fingerprint, {length class: (checked stepper or None, status)}); weak keys, so a
# model is freed with its steppers
_STEPPERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: How an analysis runs its patched forwards: stepped, whole forwards with hooks, or "auto"
#: (stepped where exact); the engine choices of :func:`stepper_for`, which analyses pass on.
ENGINES = ("auto", "stepped", "hooks")


def model_fingerprint(model) -> tuple:
    """Changes whenever one of the model's parameters is replaced or modified in place: a key
    for results computed from the model (its stepper, its answers).

    Args:
        model: A torch module.

    Returns:
        Each parameter's storage address and version counter.
    """
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def stepper_for(
    model: HookedModel, tokens: torch.Tensor, engine: str = "auto", warn: bool = True
) -> tuple[Optional[Stepper], str]:
    """The model's :class:`Stepper` when stepping reproduces its logits, else ``None``, with a status.

    A model without blocks to step falls back too. The check runs once per model and
    prompt-length class (:func:`length_class`), and again after the model's parameters change.

    Args:
        model: The hooked model.
        tokens: Prompts [B, T] of the length to be stepped (the check runs on a few of them).
        engine: ``"auto"``, ``"stepped"`` (refuses to fall back) or ``"hooks"`` (whole forwards).
        warn: Warn when falling back; ``False`` falls back silently (a caller with a path of its own).

    Returns:
        ``(stepper or None, status)``: the status says which engine runs and why.

    Raises:
        ConfigError: ``engine`` is not one of :data:`ENGINES`.
        AnalysisError: ``engine="stepped"`` and the model cannot be stepped, or its logits are not finite.
    """
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; accepted: {accepted(ENGINES)}")
    if engine == "hooks":
        return None, "hooks: requested"
    stepper, status = _checked_stepper(model, tokens)
    if stepper is None:
        if not warn and engine == "auto":
            return None, f"hooks: {status}"
        if engine == "stepped":
            raise AnalysisError(f"this model cannot be stepped block by block ({status}); use engine='hooks' or 'auto'")
        import warnings

        warnings.warn(f"patching falls back to whole forwards: {status}", RuntimeWarning, stacklevel=3)
        return None, f"hooks: {status}"
    return stepper, status


def length_class(model: HookedModel, length: int) -> tuple:
    """Prompt lengths the one-time check treats alike: those in one power-of-two range, on the
    same side of every attention window the model's config names. Whether stepping is exact can
    depend on the length (a sliding window masks differently past its width, a block may take a
    length-dependent argument the engine does not know), so a length checked once does not vouch
    for one many times longer.

    Args:
        model: The hooked model (its ``cfg`` names the windows).
        length: A prompt length.

    Returns:
        A hashable class: the length's bit length and which windows it exceeds.
    """
    cfg = getattr(model, "cfg", None)
    windows = sorted({w for w in (getattr(cfg, name, None) for name in ("window_size", "sliding_window"))
                      if isinstance(w, int) and not isinstance(w, bool) and w > 0})
    return (int(length).bit_length(), tuple(length > w for w in windows))


def _checked_stepper(model: HookedModel, tokens: torch.Tensor) -> tuple[Optional[Stepper], str]:
    """The checked stepper (or None) and status for ``tokens``' length class, from the cache."""
    fingerprint = model_fingerprint(model)
    known = _STEPPERS.get(model)
    if known is None or known[0] != fingerprint:
        known = (fingerprint, {})
        try:
            _STEPPERS[model] = known
        except TypeError:  # not weak-referenceable: checked again next time
            pass
    by_length = known[1]
    key = length_class(model, int(tokens.shape[-1]))
    if key not in by_length:
        by_length[key] = _new_stepper(model, tokens)
    return by_length[key]


def _new_stepper(model: HookedModel, tokens: torch.Tensor) -> tuple[Optional[Stepper], str]:
    """A new stepper for ``model`` checked on ``tokens`` (None where the check fails), and its status."""
    try:
        stepper = Stepper(model)
    except AnalysisError as why:  # no blocks to step: whole forwards still work through the hooks
        return None, str(why)
    except Exception as why:  # noqa: BLE001 - reported, never swallowed silently
        return None, f"blocks cannot be stepped ({type(why).__name__}: {why})"
    try:
        with torch.inference_mode():
            ok, status = stepper.check(tokens)
    except AnalysisError:  # the model itself is broken (non-finite logits): no engine would help
        raise
    except Exception as why:  # noqa: BLE001 - reported, never swallowed silently
        ok, status = False, f"blocks cannot be stepped ({type(why).__name__}: {why})"
    return (stepper if ok else None), status


@torch.inference_mode()
def read_last(
    model: HookedModel, tokens: torch.Tensor, names: Sequence[str], n_last: int, only_if_shared: bool = True
) -> Optional[dict]:
    """Activations at the last positions, from a stepped base run that computes the first tokens
    the rows share once (:meth:`Stepper.base` with ``read_only``).

    Args:
        model: The hooked model.
        tokens: Same-length prompts [B, T].
        names: Hook names inside the blocks, position on dim 1.
        n_last: How many last positions are read.
        only_if_shared: Give up when the rows share no prefix worth a fifth of their positions.

    Returns:
        ``{name: [B, n_last, ...]}``, or ``None`` when the model's blocks cannot be stepped that
        way or (``only_if_shared``) the rows share too little: the caller then runs whole forwards.

    Raises:
        AnalysisError: ``n_last`` is not 1..T.
    """
    check_n_last(n_last, int(tokens.shape[1]))
    try:
        stepper, _ = stepper_for(model, tokens, warn=False)
    except AnalysisError:  # no blocks to step
        return None
    if stepper is None or not (stepper.reuses_prefix and stepper.shares_prefixes):
        return None
    if only_if_shared and shared_prefix(tokens, n_last) is None:
        return None
    # reads only: nothing is unembedded
    run = stepper.base(tokens, read=names, n_last=n_last, read_only=True, with_logits=False)
    return {name: run.acts[name][:, -n_last:] for name in names}


def final_gradients(
    model: HookedModel, tokens: torch.Tensor, names: Sequence[tuple[int, str]],
    metric: Callable[[torch.Tensor], torch.Tensor], columns: Optional[torch.Tensor] = None,
) -> Optional[tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]]:
    """The final position's activations at hook points inside blocks, and the gradients there of
    ``metric(final logits).sum()``, from a stepped run: the base run without gradients (the
    prompts' shared first tokens computed once), then the final position alone resumed with
    gradients from the earliest block named. Attention is causal, so the final position's
    activations reach nothing but its own later computation: the earlier positions' keys and
    values enter the backward as constants, and the gradients are the whole forward's.

    Args:
        model: The hooked model.
        tokens: Same-length, unpadded prompts [B, T]; the final position is ``T - 1``.
        names: ``(layer, hook name)`` of each activation read, position on dim 1.
        metric: ``f(final logits [B, V]) -> [B]``, the logits at ``columns`` alone when given.
        columns (Int[Tensor, "V"] | None): The vocabulary entries the metric reads.

    Returns:
        ``([B, ...] per name, gradient [B, ...] or None where the metric does not depend on it)``,
        or ``None`` where the model's blocks cannot be stepped (the caller runs whole forwards).
    """
    try:
        stepper, _ = stepper_for(model, tokens, warn=False)
    except AnalysisError:  # no blocks to step
        return None
    if stepper is None or not stepper.reuses_prefix:
        return None
    T, first = int(tokens.shape[1]), min(layer for layer, _ in names)
    with torch.no_grad():  # not inference mode: its keys and values enter the backward
        base = stepper.base(tokens, read_only=True, with_logits=False)
    kept: dict = {}
    probes: dict = {}

    def probe(name):
        def hook(activation, hook=None):  # a differentiable point, whatever the parameters' flags
            probes[name] = torch.zeros_like(activation, dtype=torch.float32, requires_grad=True)
            kept[name] = activation.detach()
            return activation + probes[name].to(activation.dtype)

        return hook

    with torch.enable_grad():
        logits = stepper.resume(base, first, base.resid[first][:, T - 1:], T - 1,
                                edits=[(name, probe(name)) for _, name in names], columns=columns)
        value = metric(logits.float())
        found = torch.autograd.grad(value.sum(), [probes[name] for _, name in names], allow_unused=True)
    return [kept[name][:, 0] for _, name in names], [None if g is None else g[:, 0] for g in found]
