"""Calling a model's own blocks: on chosen positions and rows, over a key/value prefix, or only until
their keys and values are in.

:class:`BlockRunner` holds a model's blocks and how they are called (bound to parameter names, as
the model's own forward calls them); the :class:`~arithinterp.engine.Stepper` builds its base runs,
resumed runs and greedy decoding on these calls.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Optional

import torch

from arithinterp.engine.base_run import BaseRun, slice_call, take_call
from arithinterp.engine.hooks import module_hooks
from arithinterp.engine.prefix_cache import (
    KeysValuesKept, PrefixCache, cache_reaches_attention, is_cache, stacked_cat,
)
from arithinterp.errors import AnalysisError


class StopBeforeBlock(Exception):
    """Ends the model's own forward before a block, which the stepper then runs itself."""


class BlockRunner:
    """A model's blocks, called as its own forward calls them (the :class:`~arithinterp.engine.Stepper`'s base).

    Args:
        model: The hooked model, held weakly (it has ``blocks`` and ``unembed``).

    Raises:
        AnalysisError: the model has no ``blocks`` and ``unembed``.
    """

    def __init__(self, model: Any):
        # weakly: the cache of steppers is keyed on the model, and a stepper holding its model
        # would keep every model ever stepped alive
        self._model = weakref.ref(model)
        blocks = getattr(model, "blocks", None)
        if blocks is None or not hasattr(model, "unembed"):
            raise AnalysisError("the model has no 'blocks' and 'unembed': its blocks cannot be stepped")
        self.blocks = list(blocks)
        self.n_layers = len(self.blocks)
        self.final_norm = getattr(model, "ln_final", None) or torch.nn.Identity()
        component = getattr(self.blocks[0], "original_component", self.blocks[0])
        self._signature = inspect.signature(component.forward)
        cap = float(getattr(model.cfg, "output_logits_soft_cap", -1.0) or -1.0)
        self.logit_cap = cap if cap > 0 else None
        self.reuses_prefix = True  # settled by check()
        self.shares_prefixes = False  # prompts sharing a prefix compute it once: settled by check()
        self.columns_exact: Optional[bool] = None  # W_U's columns reproduce the unembedding: settled on first use

    @property
    def model(self) -> Any:
        """The model stepped; an ``AnalysisError`` once it has been freed."""
        model = self._model()
        if model is None:
            raise AnalysisError("the model this stepper stepped has been freed; get a stepper for a live model")
        return model

    def _calls_until(self, tokens: torch.Tensor, stop: int) -> list[dict]:
        """How the model's own forward on ``tokens`` calls blocks ``0..stop`` (hidden states
        included, bound to parameter names), stopped before block ``stop`` runs."""
        calls: list = []

        def before(layer):
            def hook(module, args, kwargs):
                calls.append(self._bind(args, kwargs))
                if layer == stop:
                    raise StopBeforeBlock

            return hook

        with module_hooks([(block, before(i)) for i, block in enumerate(self.blocks[: stop + 1])]):
            try:
                self.model(tokens, return_type="logits")
            except StopBeforeBlock:
                pass
        if len(calls) != stop + 1:
            raise AnalysisError(f"the model's forward did not call its blocks 0..{stop} in order")
        return calls

    def _bind(self, args: tuple, kwargs: dict) -> dict:
        bound = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        for name, parameter in self._signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in bound:
                bound.update(bound.pop(name))
        if "hidden_states" not in bound:  # the first parameter is the hidden state, whatever its name
            first = next(iter(self._signature.parameters))
            bound["hidden_states"] = bound.pop(first)
        return bound

    def _keys_values_at(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, base: BaseRun
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``layer``'s keys and values ``[E, kv_heads, 1, d_head]`` of ``hidden [E, 1, d]``,
        row ``e`` sitting at ``positions[e]`` of base prompt ``rows[e]``; the block stops as soon as
        its attention has them."""
        B = base.tokens.shape[0]
        cache = PrefixCache()
        kwargs = {}
        for key, value in base.calls[layer].items():
            if is_cache(value):
                value = cache
            elif key == "attention_mask" or key == "cache_position":
                value = None  # read only after the keys and values, which is never reached here
            else:
                value = take_call(value, key, rows, positions, B)
            kwargs[key] = value
        with cache_reaches_attention(self.blocks, cache, self.reuses_prefix):
            self._keys_values_only(layer, hidden, kwargs, cache)
        return cache.prefix[layer]

    def _run(
        self, base: BaseRun, layer: int, hidden: torch.Tensor, start: int, cache: PrefixCache, n_stack: int = 1,
        n_read: int = 1, read_only: bool = False, local: bool = False, inputs: Optional[list] = None,
    ) -> torch.Tensor:
        """Blocks ``layer…`` on ``hidden`` (positions ``start:``, or ``start`` alone with ``local``;
        see :meth:`resume`): the final residual stream from ``start`` on, or with ``read_only`` of
        the last ``n_read`` positions only (none: the last block only adds its keys and values to
        ``cache``). ``inputs`` collects each block's input."""
        T, last = base.tokens.shape[1], self.n_layers - 1
        for i in range(layer, self.n_layers):
            if inputs is not None:
                inputs.append(hidden)
            if i == last and read_only:
                self._keep_keys_values(i, hidden[:, : hidden.shape[1] - n_read], start, n_stack, base, cache)
                hidden, start = hidden[:, hidden.shape[1] - n_read :], T - n_read
                if not n_read:
                    break
            end = start + hidden.shape[1]
            calls = base.calls[i].items()
            kwargs = {key: slice_call(key, value, start, n_stack, base, cache, end) for key, value in calls}
            out = self.blocks[i](hidden, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            if local and i == layer:  # the block's other positions are the base run's
                hidden = stacked_cat([hidden, base.resid[i + 1][:, start + 1 :]], 1)
        return hidden

    def _keep_keys_values(
        self, layer: int, hidden: torch.Tensor, start: int, n_stack: int, base: BaseRun, cache: PrefixCache
    ) -> None:
        """Append block ``layer``'s keys and values of ``hidden`` (positions ``start:``) to its prefix
        in ``cache``."""
        end = start + hidden.shape[1]
        calls = base.calls[layer].items()
        kwargs = {key: slice_call(key, value, start, n_stack, base, cache, end) for key, value in calls}
        self._keys_values_only(layer, hidden, kwargs, cache)

    def _keys_values_only(self, layer: int, hidden: torch.Tensor, kwargs: dict, cache: PrefixCache) -> None:
        """Call block ``layer``, stopping it as soon as its attention hands ``cache`` its keys and
        values (which become that layer's prefix there)."""
        cache.keep_only = layer
        try:
            self.blocks[layer](hidden, **kwargs)
        except KeysValuesKept:
            return
        finally:
            cache.keep_only = None
        raise AnalysisError(f"block {layer} ran without asking its cache for keys and values")
