"""Prompts that share their first tokens: finding the prefix worth computing once, and joining the reads.

:func:`shared_prefix` picks the prefix length that saves most positions; the stepper runs the
distinct prefixes once and every prompt's later positions over their keys and values, then
:func:`joined` puts an activation read in the two passes back together.
"""

from __future__ import annotations

from typing import Optional

import torch


def prefix_order(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of ``tokens`` in lexicographic order.

    Rows sharing their first ``k`` tokens are neighbours, so ``1 + (first < k).sum()`` prefixes
    of length ``k`` are distinct.

    Args:
        tokens: Token ids [B, T].

    Returns:
        ``(first, inverse)``: for each pair of neighbours the first position where they differ
        [R - 1], and each row's place in that order [B].
    """
    distinct, inverse = torch.unique(tokens, dim=0, return_inverse=True)
    differs = distinct[1:] != distinct[:-1]
    return differs.int().argmax(1), inverse  # distinct rows differ somewhere


def split_at(tokens: torch.Tensor, k: int, order: Optional[tuple] = None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One row of ``tokens`` per distinct prefix ``[:k]``, and each row's prefix.

    Args:
        tokens: Token ids [B, T].
        k: The prefix length.
        order: :func:`prefix_order` of ``tokens`` (computed when ``None``).

    Returns:
        ``(k, representatives, inverse)``: a row index per distinct prefix [P], and each row's
        prefix as an index into them [B].
    """
    first, rows = order if order is not None else prefix_order(tokens)
    group = torch.cat([first.new_zeros(1), (first < k).long().cumsum(0)])  # prefix of each distinct row
    inverse = group[rows]
    representatives = torch.empty(int(group[-1]) + 1, dtype=torch.long, device=tokens.device)
    representatives[inverse] = torch.arange(len(tokens), device=tokens.device)
    return k, representatives, inverse


def shared_prefix(tokens: torch.Tensor, n_read: int) -> Optional[tuple]:
    """The prefix length that saves most positions when each distinct prefix is computed once.

    Args:
        tokens: Token ids [B, T].
        n_read: Positions read at the end of every row (never part of the prefix).

    Returns:
        ``(k, representatives, inverse)`` (see :func:`split_at`), or ``None`` when no prefix
        saves a fifth of the positions.
    """
    B, T = tokens.shape
    order = prefix_order(tokens)
    first = order[0]
    lengths = torch.arange(1, T - n_read + 1, device=tokens.device)
    n_distinct = 1 + (first[None, :] < lengths[:, None]).sum(1)
    cost = n_distinct * lengths + B * (T - lengths)
    best = int(cost.argmin())
    return split_at(tokens, best + 1, order) if len(lengths) and cost[best] <= 0.8 * B * T else None


def joined(name: str, early: torch.Tensor, late: torch.Tensor, T: int) -> torch.Tensor:
    """An activation read in two passes, positions ``:k`` (``early``) then ``k:`` (``late``), put
    back together: along dim 1, or for attention patterns ``[B, H, query, key]`` along the query
    axis, the early queries' missing keys (all later, so masked) given weight 0.

    Args:
        name: The hook name read.
        early: The activation at positions ``:k``.
        late: The activation at positions ``k:``.
        T: The prompts' length.

    Returns:
        The activation over all ``T`` positions.
    """
    if name.endswith(("hook_pattern", "hook_attn_scores")):
        fill = 0.0 if name.endswith("hook_pattern") else float("-inf")
        early = torch.nn.functional.pad(early, (0, T - early.shape[-1]), value=fill)
        return torch.cat([early, late], 2)
    return torch.cat([early, late], 1)
