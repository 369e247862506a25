"""Where hooks are installed: the only module of the package that touches a model's hooks.

TransformerLens hook points (``blocks.3.hook_resid_pre``) are named by the analyses' sites;
PyTorch module hooks are used by the block stepper to see how each block is called. Every hook is
removed when its ``with`` block ends, whatever happens inside it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

HookList = Sequence[tuple[str, Callable]]


def forward_with_hooks(model: HookedModel, tokens: torch.Tensor, fwd_hooks: HookList, **kwargs: Any) -> Any:
    """``model(tokens)`` with TransformerLens hooks ``(name, fn(activation, hook))`` in place."""
    return model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), **kwargs)


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
