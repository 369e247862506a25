"""What a base run leaves behind (:class:`BaseRun`), and its block calls cut to what a resumed run computes.

The stepper records how the model's own forward calls each block (hidden states, attention mask,
rotary tables, position ids, the cache); a resumed run calls the block on fewer positions, on
stacked copies of the rows, or at one position per row. Only the position-indexed arguments it
recognises (:data:`POSITION_AXIS`) are sliced; a block with another one is resumed from position 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from arithinterp.engine.prefix_cache import is_cache

#: Call arguments that carry a position axis, and where it is.
POSITION_AXIS = {"position_ids": -1, "cache_position": -1, "position_embeddings": -2, "attention_mask": -2}


@dataclass
class BaseRun:
    """What a base forward leaves behind for resuming patched runs from any layer.

    ``resid[l]`` is the input of block ``l`` ``[B, T, d]`` (``resid[n_layers]`` the final
    residual); ``calls[l]`` block ``l``'s other call arguments; ``kv[l]`` its keys and values
    (``[B, heads, T, d_head]`` each) when the blocks use a cache; ``logits`` ``[B, V]`` at the final
    position (``[B, k, V]`` at the last ``k`` positions when the run was made with ``n_last=k``);
    ``acts`` the activations read by name.
    """

    tokens: torch.Tensor
    resid: list
    calls: list
    kv: Optional[dict]
    logits: torch.Tensor
    acts: dict = field(default_factory=dict)

    def rows(self, index: Any) -> "BaseRun":
        """The run of prompts ``index`` alone.

        Args:
            index: A slice or an index tensor of base prompts.

        Returns:
            A run whose per-prompt tensors hold those rows only.
        """
        B = self.tokens.shape[0]

        def take(value: Any) -> Any:
            if isinstance(value, (tuple, list)):
                return type(value)(take(v) for v in value)
            if isinstance(value, dict):
                return {key: take(v) for key, v in value.items()}
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == B:
                return value[index]
            return value

        parts = (self.tokens, self.resid, self.calls, self.kv, self.logits, self.acts)
        return BaseRun(*(take(value) for value in parts))


def slice_call(
    key: str, value: Any, start: int, n_stack: int, base: BaseRun, cache: Any, end: Optional[int] = None
) -> Any:
    """A recorded call argument for the stacked runs at positions ``start:end``.

    Args:
        key: The argument's name.
        value: Its recorded value (a tensor, a tuple of them, a cache, or anything else).
        start: The first position computed.
        n_stack: How many stacked runs share the base prompts (row ``c * B + b``).
        base: The base run (its ``tokens`` ``[B, T]`` give the shapes).
        cache: The cache handed to the block in place of a recorded one.
        end: One past the last position computed (default ``T``).

    Returns:
        The argument for the resumed call: masks and position-indexed tensors narrowed, per-row
        tensors repeated ``n_stack`` times, a cache replaced by ``cache``.
    """
    if is_cache(value):
        return cache
    if isinstance(value, tuple):
        return tuple(slice_call(key, v, start, n_stack, base, cache, end) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    B, T = base.tokens.shape
    end = T if end is None else end
    if key == "attention_mask":  # keys are positions :end; a 2-D mask is a key-padding mask
        value = value.narrow(-1, 0, end)
        if value.ndim == 4:  # [B, 1, queries, keys]
            value = value.narrow(-2, start, end - start)
    elif (start or end < T) and key in POSITION_AXIS:
        value = value.narrow(POSITION_AXIS[key], start, end - start)
    if value.ndim and value.shape[0] == B and n_stack > 1:
        value = value.repeat(n_stack, *[1] * (value.ndim - 1))
    return value


def take_call(value: Any, key: str, rows: torch.Tensor, positions: torch.Tensor, B: int) -> Any:
    """A recorded call argument for rows ``rows`` of the base prompts at one position each.

    Args:
        value: The recorded value.
        key: The argument's name.
        rows: The base prompt of each row, long [E].
        positions: The position of each row, long [E].
        B: How many base prompts there are.

    Returns:
        The argument for ``E`` rows of one position.
    """
    if isinstance(value, tuple):
        return tuple(take_call(v, key, rows, positions, B) for v in value)
    if not isinstance(value, torch.Tensor) or not value.ndim:
        return value
    if key in POSITION_AXIS:
        axis = POSITION_AXIS[key] % value.ndim
        value = value.expand(B, *value.shape[1:]) if value.shape[0] == 1 else value
        value = value[rows].movedim(axis, 1)
        value = value[torch.arange(len(rows), device=value.device), positions.to(value.device)][:, None]
        return value.movedim(1, axis)
    return value[rows] if value.shape[0] == B else value


def unknown_position_argument(call: dict, T: int) -> bool:
    """Whether a block's call has a tensor with a position axis of length ``T`` that
    :data:`POSITION_AXIS` does not name (so it cannot be sliced).

    Args:
        call: A block's recorded call arguments.
        T: The prompts' length.

    Returns:
        ``True`` when such an argument is there.
    """
    for key, value in call.items():
        tensors = value if isinstance(value, tuple) else (value,)
        for t in tensors:
            if isinstance(t, torch.Tensor) and key not in POSITION_AXIS and T in t.shape[1:]:
                return True
    return False


def edits_block(edits: Sequence[tuple[str, Callable]], layer: int) -> bool:
    """Whether an edit may act inside block ``layer`` (a hook outside the blocks counts).

    Args:
        edits: ``(hook name, fn)`` pairs.
        layer: The block.

    Returns:
        ``True`` when some edit's hook is in block ``layer`` or outside every block.
    """
    for name, _ in edits:
        match = re.match(r"blocks\.(\d+)\.", name)
        if match is None or int(match.group(1)) == layer:
            return True
    return False
