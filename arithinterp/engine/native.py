"""A key/value cache for TransformerLens-native attention.

Hugging Face attention modules take a key/value cache, so the stepper hands them the base run's
keys and values of earlier positions and computes only the positions that can change.
TransformerLens's own ``NativeAttention`` (the zoo, models made with ``boot_native``) takes none.
While the stepper runs, each native attention gets a forward that reads a cache passed as
``past_key_values``: the same projection modules (so every hook fires), rotary tables, scale,
soft-cap, masks and pattern hook as its own forward, with queries for the given positions only
and keys/values for every position up to them. Without a cache it is the module's own forward.
The stepper's one-time check compares stepped logits with the model's own, so a change in
TransformerLens that this forward does not follow is caught, not trusted.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch
from transformer_lens.utilities.activation_functions import apply_softcap

from arithinterp.errors import AnalysisError


def _native_attention(block: Any) -> Optional[torch.nn.Module]:
    attention = getattr(getattr(block, "attn", None), "original_component", None)
    return attention if type(attention).__name__ == "NativeAttention" else None


# attention module -> (its layer, how many native_attention_cache contexts are open on it); the
# cache-reading forward stays while any is open, so nested and concurrent uses each keep it
_USERS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, int]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


@contextlib.contextmanager
def native_attention_cache(blocks: Sequence[Any]) -> Iterator[None]:
    """Give every native attention in ``blocks`` a cache-reading forward while the block runs.

    Re-entrant: contexts may nest or overlap (threads); the module's own forward comes back when
    the last one closes. Block ``l`` of ``blocks`` must be layer ``l`` in every open context.
    """
    attentions = [(layer, attention) for layer, block in enumerate(blocks)
                  if (attention := _native_attention(block)) is not None]
    with _LOCK:
        for layer, attention in attentions:
            known, _ = _USERS.get(attention, (layer, 0))
            if known != layer:
                raise AnalysisError(
                    f"an attention module is already stepped as layer {known} and cannot be layer {layer} at the same "
                    "time: pass the model's blocks in order, from block 0"
                )
        for layer, attention in attentions:
            _, users = _USERS.get(attention, (layer, 0))
            if not users:
                attention.forward = functools.partial(_forward, attention, layer)
            _USERS[attention] = (layer, users + 1)
    try:
        yield
    finally:
        with _LOCK:
            for layer, attention in attentions:
                users = _USERS[attention][1] - 1
                if users:
                    _USERS[attention] = (layer, users)
                else:
                    del _USERS[attention]
                    del attention.forward  # back to the class's own forward


def _forward(
    attn: Any,
    layer: int,
    hidden_states: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    pattern_fn: Any = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``NativeAttention.forward`` for queries at positions ``start:`` given keys/values before them.

    ``hidden_states [B, S, d]`` are positions ``start .. start + S - 1``, where ``start`` is the
    cache's length for this layer; ``past_key_values.update`` returns the keys and values of every
    position ``< start + S`` ``[B, kv_heads, start + S, d_head]``. Returns ``(out [B, S, d],
    pattern [B, heads, S, start + S])``.
    """
    if past_key_values is None:
        return type(attn).forward(
            attn, hidden_states, attention_mask=attention_mask, position_ids=position_ids, pattern_fn=pattern_fn,
            **kwargs,
        )
    batch, seq, _ = hidden_states.shape
    start = past_key_values.get_seq_length(layer)
    k = attn.k(hidden_states).view(batch, seq, attn.n_kv_heads, attn.d_head).transpose(1, 2)
    v = attn.v(hidden_states).view(batch, seq, attn.n_kv_heads, attn.d_head).transpose(1, 2)
    if attn.rotary is not None:
        if position_ids is None:
            position_ids = torch.arange(start, start + seq, device=hidden_states.device)[None].expand(batch, -1)
        _, k = attn.rotary.apply_rope(k, k, position_ids=position_ids)
    # keys and values first: a cache that only collects them stops the block here (the queries
    # would be wasted); the cache keeps them before grouped heads are repeated
    k, v = past_key_values.update(k, v, layer)
    q = attn.q(hidden_states).view(batch, seq, attn.n_heads, attn.d_head).transpose(1, 2)
    if attn.rotary is not None:
        q, _ = attn.rotary.apply_rope(q, q, position_ids=position_ids)
    if attn.kv_repeats > 1:
        k = k.repeat_interleave(attn.kv_repeats, dim=1)
        v = v.repeat_interleave(attn.kv_repeats, dim=1)
    total = k.shape[-2]
    scores = apply_softcap(torch.matmul(q, k.transpose(-2, -1)) / attn.scale, attn.attn_scores_soft_cap)
    if attn.causal:  # query i sits at position start + i
        block_mask = attn.causal_mask[total - seq : total, :total]
    else:
        block_mask = torch.zeros(seq, total, dtype=torch.bool, device=scores.device)
    if attention_mask is not None:
        block_mask = type(attn)._combine_attention_mask(block_mask, attention_mask, batch=batch)
    pattern = torch.softmax(scores.masked_fill(block_mask, float("-inf")), dim=-1).masked_fill(block_mask, 0.0)
    if pattern_fn is not None:
        pattern = pattern_fn(pattern)
    z = torch.matmul(pattern, v).transpose(1, 2).contiguous().view(batch, seq, -1)
    return attn.o(z), pattern
