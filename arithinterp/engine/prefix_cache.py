"""The stepper's key/value cache: a stand-in for a Hugging Face cache that holds a reused prefix.

A block resumed at position ``s`` attends over the base run's keys and values of positions
``< s``: :class:`PrefixCache` hands them to its attention (every attention module gets it, through
:func:`cache_reaches_attention`), records the new ones, and can stop a block once its keys and
values are in (:class:`KeysValuesKept`). Stacked runs share the base run's rows without tiling
them (:func:`stacked_cat`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import torch

from arithinterp.engine.hooks import module_hooks
from arithinterp.engine.native import native_attention_cache
from arithinterp.errors import AnalysisError


def is_cache(value: Any) -> bool:
    """Whether a block's call argument is a key/value cache (duck-typed: ``update`` and ``get_seq_length``).

    Args:
        value: A recorded call argument.

    Returns:
        ``True`` for a cache.
    """
    return hasattr(value, "update") and hasattr(value, "get_seq_length")


class KeysValuesKept(Exception):
    """Raised by :class:`PrefixCache` once the keys and values it was asked to keep are in."""


class PrefixCache:
    """A stand-in for a Hugging Face key/value cache.

    A block's attention calls ``update(keys, values, layer)`` with the keys and values of the
    positions it computes and attends over what comes back. Here that is the stored prefix
    (positions ``< s``) followed by the new ones; with ``record`` the full tensors are kept. With
    ``keep_only=layer`` that layer's keys and values become its prefix and the block stops there
    (:class:`KeysValuesKept`): nothing after the projections is computed.

    Args:
        prefix: Per layer, the ``(keys, values)`` of the reused positions ``[B, heads, s, d_head]``.
        record: Keep every layer's full keys and values in ``kv``.
    """

    def __init__(self, prefix: Optional[dict] = None, record: bool = False):
        self.prefix = prefix or {}
        self.record = record
        self.keep_only: Optional[int] = None
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, keys, values, layer_idx, *args, **kwargs):
        """The prefix's keys and values followed by ``keys`` / ``values`` (the cache protocol).

        Args:
            keys: The new positions' keys ``[B, heads, t, d_head]``.
            values: Their values, shaped like ``keys``.
            layer_idx: The layer.
            *args: Ignored (the protocol's cache arguments).
            **kwargs: Ignored.

        Returns:
            ``(keys, values)`` over the prefix and the new positions.

        Raises:
            KeysValuesKept: ``layer_idx`` is the layer whose keys and values were to be kept.
        """
        if layer_idx in self.prefix:
            old_k, old_v = self.prefix[layer_idx]
            keys, values = stacked_cat([old_k, keys], -2), stacked_cat([old_v, values], -2)
        if self.record:
            self.kv[layer_idx] = (keys, values)
        if layer_idx == self.keep_only:
            self.prefix[layer_idx], self.keep_only = (keys, values), None
            raise KeysValuesKept
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """How many positions the prefix of ``layer_idx`` holds.

        Args:
            layer_idx: The layer.

        Returns:
            The prefix's length (0 for none).
        """
        prefix = self.prefix.get(layer_idx)
        return 0 if prefix is None else int(prefix[0].shape[-2])


def stacked_cat(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)`` for stacked runs (row ``c * B + b`` is run ``c`` of prompt ``b``),
    where a part with ``B`` rows instead of ``n * B`` is the base run's, shared by all ``n`` runs.

    The shared part is written straight into each run's slot of the output (one copy), never
    tiled first: the base run's keys and values of the reused prefix, its block outputs after a
    patched position.

    Args:
        parts: Tensors of ``B`` or ``n * B`` rows, equal but along ``dim``.
        dim: The axis joined.

    Returns:
        The joined tensor, ``n * B`` rows.

    Raises:
        AnalysisError: the parts' rows are not ``B`` or whole stacks of ``B``.
    """
    N = max(int(p.shape[0]) for p in parts)
    if all(p.shape[0] == N for p in parts):
        return torch.cat(list(parts), dim)
    B = min(int(p.shape[0]) for p in parts)
    n, rest = divmod(N, B)
    if rest or any(p.shape[0] not in (B, N) for p in parts):
        raise AnalysisError(f"parts of {sorted({int(p.shape[0]) for p in parts})} rows are not all {B} prompts or "
                            f"whole stacks of them")
    dim = dim % parts[0].ndim
    shape = list(parts[0].shape)
    shape[0], shape[dim] = B, sum(int(p.shape[dim]) for p in parts)
    out = parts[0].new_empty(n, *shape)
    at = 0
    for part in parts:
        width = int(part.shape[dim])
        out.narrow(dim + 1, at, width).copy_(part if part.shape[0] == B else part.reshape(n, B, *part.shape[1:]))
        at += width
    return out.view(N, *shape[1:])


@contextlib.contextmanager
def cache_reaches_attention(blocks: Sequence[Any], cache: PrefixCache, native: bool):
    """Hand ``cache`` to every attention module that is called without one.

    Blocks pass their cache on under different names (``cache``, ``layer_past``,
    ``past_key_values``) and not every attention reads the name its block uses, so the
    attention modules themselves get it as ``past_key_values``; TransformerLens-native
    attention reads it through :mod:`arithinterp.engine.native`.

    Args:
        blocks: The model's blocks.
        cache: The cache to hand over.
        native: Also route TransformerLens-native attention through the cache (where keys and
            values are reused).

    Yields:
        Nothing: the cache reaches the attention modules while the context is open.
    """

    def hook(module, args, kwargs):
        if kwargs.get("past_key_values") is None and kwargs.get("layer_past") is None:
            kwargs["past_key_values"] = cache
        return args, kwargs

    # TransformerLens's attention bridges read the cache as past_key_values / layer_past only
    attentions = [block.attn for block in blocks if hasattr(getattr(block, "attn", None), "_update_kv_cache")]
    routed = native_attention_cache(blocks) if native else contextlib.nullcontext()
    with module_hooks([(attention, hook) for attention in attentions]), routed:
        yield
