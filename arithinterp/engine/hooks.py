"""Where hooks are installed: the only module of the package that touches a model's hooks.

TransformerLens hook points (``blocks.3.hook_resid_pre``) are named by the analyses' sites;
PyTorch module hooks are used by the block stepper to see how each block is called. Every hook is
removed when its ``with`` block ends, whatever happens inside it.

The unembedding is the largest product of a forward on a model with a big vocabulary (Gemma 3:
262,144 logits, 1 MiB of float32, per position), and most callers read one position or none.
:func:`unembed_last` makes the model's own unembedding module run on the last positions only (a
forward pre-hook that narrows its input: the final norm, and any soft-capping or scaling the model
applies after the unembedding, still run as the model runs them), or not at all, when no hook
watches the unembedding itself.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch

from arithinterp.errors import AnalysisError

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

HookList = Sequence[tuple[str, Callable]]


def forward_with_hooks(
    model: HookedModel, tokens: torch.Tensor, fwd_hooks: HookList, *, last: Optional[int] = None, **kwargs: Any
) -> Any:
    """``model(tokens)`` with TransformerLens hooks ``(name, fn(activation, hook))`` in place.

    Args:
        last: with ``return_type="logits"`` (the default), the logits of the last ``last``
            positions only, ``[B, last, V]``: the unembedding runs on those alone
            (:func:`unembed_last`). ``None``: every position's.
        **kwargs: passed on to ``run_with_hooks``. ``return_type=None`` stops the forward before
            the unembedding (no logits are built) and returns None.
    """
    return_type = kwargs.get("return_type", "logits")
    if return_type is None:
        with unembed_last(model, 0):
            try:
                model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), **kwargs)
            except _Unembedding:
                pass
        return None
    if return_type != "logits" or last is None:
        return model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), **kwargs)
    with unembed_last(model, last):
        return model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), **kwargs)


class _Unembedding(Exception):
    """Raised where the unembedding would start, when no logits are needed (:func:`unembed_last` with 0)."""


def _watched(module: torch.nn.Module) -> bool:
    """Whether a TransformerLens hook point inside ``module`` has a hook attached."""
    from transformer_lens.hook_points import HookPoint

    return any(isinstance(m, HookPoint) and (m._forward_hooks or m._forward_pre_hooks) for m in module.modules())


@contextlib.contextmanager
def unembed_last(model: HookedModel, n: int) -> Iterator[None]:
    """While the ``with`` block runs, the model's unembedding computes the logits of the last ``n``
    positions only, ``[B, n, V]`` (``n = 0``: it does not run; the forward raises an internal
    exception there, which :func:`forward_with_hooks` with ``return_type=None`` catches).

    The final norm runs on every position as before; whatever the model does after the
    unembedding (Gemma 2's final soft-capping, a logit scale) then acts on the logits that were
    computed, so they equal the full forward's at those positions. Left alone: a model without an
    ``unembed`` module, and a forward in which a hook watches the unembedding's own hook points
    (``unembed.hook_in`` / ``hook_out``), which then see the full forward's shapes.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise AnalysisError(f"n must be a non-negative int (positions to unembed), got {n!r}")
    unembed = getattr(model, "unembed", None)
    if not isinstance(unembed, torch.nn.Module):
        yield
        return

    def narrow(module, args, kwargs):
        if _watched(module):
            return None
        if n == 0:
            raise _Unembedding
        if args and isinstance(args[0], torch.Tensor) and args[0].ndim >= 3:
            return (args[0][..., -n:, :], *args[1:]), kwargs
        for key, value in kwargs.items():  # the hidden state passed by name
            if isinstance(value, torch.Tensor) and value.ndim >= 3:
                return args, {**kwargs, key: value[..., -n:, :]}
        return None

    with module_hooks(pre=[(unembed, narrow)]):
        yield


@contextlib.contextmanager
def hook_points(model: HookedModel, fwd_hooks: HookList) -> Iterator[None]:
    """TransformerLens hooks in place for the ``with`` block (for calls other than a whole forward)."""
    with model.hooks(fwd_hooks=list(fwd_hooks)):
        yield


@contextlib.contextmanager
def module_hooks(
    pre: Sequence[tuple[torch.nn.Module, Callable]] = (), post: Sequence[tuple[torch.nn.Module, Callable]] = ()
) -> Iterator[None]:
    """PyTorch forward pre-hooks (``fn(module, args, kwargs)``, may return new ones) and forward
    hooks (``fn(module, args, output)``) on the given modules for the ``with`` block."""
    handles = [module.register_forward_pre_hook(fn, with_kwargs=True) for module, fn in pre]
    handles += [module.register_forward_hook(fn) for module, fn in post]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
