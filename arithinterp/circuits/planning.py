"""What scoring every edge costs, exactly and by EAP-IG: the choice of ``score_edges(method="auto")``.

EAP-IG (Hanna et al. 2024) estimates what exact path patching (Wang et al. 2023) measures, at a
fixed cost: per pair, two forwards for the sender outputs and a forward and backward per step,
each over every layer and position. Exact patching runs one copy of the base run per edge, but
through the block stepper (:mod:`arithinterp.engine.edge_steps`) each copy starts at its
receiver's layer and at the first position where the pair's prompts differ: an edge into layer
``l`` of an ``L``-layer model runs ``L − l`` blocks over the ``w`` positions from the first
difference on, and one row of the unembedding. On short graphs and few-shot prompts that differ
only in their last problem this costs about as much as EAP-IG, and then there is nothing to
estimate: :func:`choose_method` picks exact patching.

Costs are counted in multiply-adds of the model's matrix products (per position and block: the
Q, K, V and O projections, attention over the context, the MLP; per read position: the
unembedding), a backward as two forwards. They rank the two methods; they are no time forecast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from arithinterp.engine.steppers import stepper_for

if TYPE_CHECKING:
    from arithinterp.circuits.graph import EdgeGraph
    from arithinterp.tasks import PromptPairs

# ``method="auto"`` patches exactly while that is estimated to cost at most this many times EAP-IG: where
# it did, exact patching took 0.6-1.3x EAP-IG's time (docs/circuits.md, "Choosing the method")
AUTO_RATIO = 2.0


@dataclass(frozen=True)
class EdgeCosts:
    """Estimated multiply-adds of scoring every edge of a graph on a set of pairs: ``exact``
    (every edge alone, as :func:`~arithinterp.circuits.patch_edges` runs it) and ``eap_ig``
    (:func:`~arithinterp.circuits.attribute_edges` with ``steps``); ``stepped``: whether exact
    patching can start at the receiver's layer and first changed position (else each edge is a
    whole forward)."""

    exact: float
    eap_ig: float
    steps: int
    stepped: bool

    @property
    def ratio(self) -> float:
        """Exact patching's cost over EAP-IG's."""
        return self.exact / max(self.eap_ig, 1.0)


def _block_costs(model: Any, context: int) -> tuple[float, float]:
    """Multiply-adds of one block at one position attending over ``context`` positions, and of its
    keys and values alone (what the stepper computes of the last block at positions it does not read)."""
    cfg = model.cfg
    d, heads = int(cfg.d_model), int(cfg.n_heads)
    kv = int(getattr(cfg, "n_key_value_heads", None) or heads)
    d_head = int(getattr(cfg, "d_head", 0) or d // heads)
    keys_values = d * d_head * 2 * kv
    attention = keys_values + d * d_head * 2 * heads + 2 * heads * d_head * context
    mlp = 0
    if not bool(getattr(cfg, "attn_only", False)):
        d_mlp = int(getattr(cfg, "d_mlp", 0) or 4 * d)
        gated = hasattr(model.blocks[0].mlp, "gate")
        mlp = d * d_mlp * (3 if gated else 2)
    return float(attention + mlp), float(keys_values)


def edge_costs(model: Any, pairs: PromptPairs, graph: EdgeGraph, steps: int, engine: str = "auto") -> EdgeCosts:
    """The estimated cost of scoring every edge of ``graph`` on ``pairs``, both ways.

    Args:
        model: the hooked model.
        pairs: the counterfactual pairs (left-padded tokens ``[N, T]``).
        graph: the edges to score (position-free or per position).
        steps: EAP-IG's interpolation steps.
        engine: how exact patching would run (``"auto"``, ``"stepped"``, ``"hooks"``).

    Returns:
        :class:`EdgeCosts`, summed over the pairs.
    """
    L = graph.layout
    clean, corrupt = pairs.clean.tokens, pairs.corrupt.tokens
    T_pad = int(clean.shape[1])
    lengths = pairs.clean.lengths
    unembed = float(model.cfg.d_model) * float(getattr(model.cfg, "d_vocab", 0) or 0)
    stepper, _ = stepper_for(model, pairs.clean.unpadded(torch.arange(1)), engine, warn=False)
    stepped = stepper is not None
    reuses = stepped and bool(getattr(stepper, "reuses_prefix", False))
    # each edge's receiver layer (the logits at n_layers) and its position label
    per_layer = L.per_layer_receivers()
    p, r, _ = graph.edge_index.T
    r_layer = torch.clamp(r // per_layer, max=L.n_layers)
    at: Optional[torch.Tensor] = None
    if graph.positions != [None]:
        from arithinterp.tasks import resolve_positions

        _, at = resolve_positions(pairs, graph.positions)  # [P, N] in the padded frame
    exact = eap_ig = 0.0
    for i in range(len(pairs)):
        T = int(lengths[i])
        differ = torch.nonzero(clean[i] != corrupt[i]).flatten()
        first = int(differ[0]) if len(differ) else T_pad  # the padded frame
        block, keys_values = _block_costs(model, T)
        forward = L.n_layers * T * block + unembed
        eap_ig += (2 + 3 * steps) * forward
        exact += 2 * forward  # both prompts' unpatched runs
        if not stepped:
            exact += graph.n_edges * forward
            continue
        start = torch.full((graph.n_edges,), first)
        if at is not None:  # a positional edge carries its sender's output at its own position alone
            start = torch.where(at[p, i] >= first, at[p, i], T_pad)
        width = (T_pad - start).clamp(min=0)
        if not reuses:  # every position is recomputed
            width = torch.where(width > 0, T, 0)
        live = width > 0
        width, below_last = width[live], (L.n_layers - 1 - r_layer[live]).clamp(min=0)
        into_blocks = r_layer[live] < L.n_layers
        # the blocks below the last at every position from the start; the last block at the read position
        # (and, with the prefix reused, only the keys and values of the positions before it)
        last = torch.where(into_blocks, block + (width - 1) * (keys_values if reuses else block), 0.0)
        exact += float((below_last * width * block + last).sum()) + int(live.sum()) * unembed
    return EdgeCosts(exact=exact, eap_ig=eap_ig, steps=steps, stepped=stepped)


def choose_method(costs: EdgeCosts) -> str:
    """``"exact"`` when exact patching costs at most :data:`AUTO_RATIO` times EAP-IG, else ``"eap-ig"``."""
    return "exact" if costs.ratio <= AUTO_RATIO else "eap-ig"
