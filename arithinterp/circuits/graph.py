"""The computational graph of a transformer, as data.

Nodes are the embeddings (the input), every attention head, every MLP and the logits. An edge
runs from a sender's output to one input of a receiver: a head's query, key or value input
(three separate edges), an MLP's input, or the logits (the final residual stream). Because the
residual stream is a sum, the input of a receiver is the sum of the outputs of every sender
upstream of it (Elhage et al. 2021), and an edge can be patched alone (Wang et al. 2023;
Conmy et al. 2023).

With ``positions`` every edge also carries a token position: the sender's output at that
position into the receiver's input at the same position (the residual stream never moves
information between positions; only attention, a receiver, does). A position-free graph
patches every position at once, and its edge ``s → r`` is the sum of the positional edges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from arithinterp.engine.edges import CHANNELS, Layout
from arithinterp.errors import AnalysisError, SiteError, accepted
from arithinterp.tasks.positions import position_labels

if TYPE_CHECKING:
    from arithinterp.types import HookedModel


@dataclass(frozen=True)
class Node:
    """A node of a model's graph.

    Attributes:
        name: ``"embed"``, ``"L3H1"``, ``"MLP2"`` or ``"logits"``.
        kind: ``"embed"``, ``"head"``, ``"mlp"`` or ``"logits"``.
        layer: The block; embeddings sit at layer −1 and the logits at ``n_layers`` (for drawing by layer).
        head: The head's index, for a head.
    """

    name: str
    kind: str
    layer: int
    head: Optional[int] = None


@dataclass(frozen=True)
class Edge:
    """An edge of a model's graph.

    Attributes:
        sender: The sending node's name.
        receiver: The receiving node's name.
        channel: The receiver's input: ``q``, ``k``, ``v``, ``mlp`` or ``logits``.
        position: A position label, or ``None`` for every position.
    """

    sender: str
    receiver: str
    channel: str
    position: Optional[str] = None

    @property
    def name(self) -> str:
        """The edge's name, e.g. ``"L0H1->L2H3.q"`` or ``"MLP0->logits@final"``."""
        target = f"{self.receiver}.{self.channel}" if self.channel in CHANNELS else self.receiver
        return f"{self.sender}->{target}" + ("" if self.position is None else f"@{self.position}")


def _head(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


class EdgeGraph:
    """Every node and edge of ``model``'s graph, with index tables into the dense edge tensor.

    The dense layout is ``[P, R, S]``: position labels × receiver inputs × senders (see
    :class:`~arithinterp.engine.edges.Layout` for the receiver and sender order). ``edge_index``
    is ``[n_edges, 3]`` (p, r, s) for the edges that exist (a sender upstream of the receiver).

    Args:
        layout: The model's receiver and sender layout (:meth:`of` builds it from a model).
        positions: Position labels for a positional graph, or ``None`` for edges over all positions.

    Raises:
        SiteError: Positions that are empty, repeated, or ``"all"``.
    """

    def __init__(self, layout: Layout, positions: Optional[Sequence] = None):
        self.layout = layout
        L = layout
        self.positions: list = [None] if positions is None else position_labels(positions)
        if positions is not None and not self.positions:
            raise SiteError(
                "positions is empty; pass None for a position-free graph or labels such as ['a', 'b', 'final']"
            )
        twice = sorted({p for p in self.positions if self.positions.count(p) > 1}, key=str)
        if twice:
            # a repeated label would give every edge at that position twice, counted twice in every sum
            raise SiteError(f"positions {twice} appear more than once in {self.positions}; name each position once")
        if "all" in self.positions:
            raise SiteError("a per-position graph needs the positions named, not 'all'; pass labels such as "
                            "['a', 'b', 'final'] (or token indices, e.g. list(range(5)), for prompts of one length), "
                            "or None for a position-free graph")
        senders = [Node("embed", "embed", -1)]
        receivers: list[tuple[Node, str, int]] = []  # (node, channel, unit)
        nodes = [senders[0]]
        for layer in range(L.n_layers):
            heads = [Node(_head(layer, h), "head", layer, h) for h in range(L.n_heads)]
            nodes += heads
            senders += heads
            for h in range(L.n_heads):
                receivers.append((heads[h], "q", h))
            for channel in ("k", "v"):
                group = L.n_heads // L.n_kv_heads
                for g in range(L.n_kv_heads):
                    # a shared key/value input belongs to its first query head (grouped-query attention)
                    receivers.append((heads[g * group], channel, g))
            if L.has_mlp:
                mlp = Node(f"MLP{layer}", "mlp", layer)
                nodes.append(mlp)
                senders.append(mlp)
                receivers.append((mlp, "mlp", 0))
        logits = Node("logits", "logits", L.n_layers)
        nodes.append(logits)
        receivers.append((logits, "logits", 0))
        self.nodes, self.senders, self.receivers = nodes, senders, receivers
        self.node_index = {n.name: i for i, n in enumerate(nodes)}
        rows, edges = [], []
        for p, label in enumerate(self.positions):
            for r, (node, channel, _unit) in enumerate(receivers):
                n_up = L.senders_before(node.layer, channel)
                for s in range(n_up):
                    rows.append((p, r, s))
                    edges.append(Edge(senders[s].name, node.name, channel, label))
        self.edges: list[Edge] = edges
        self.edge_index = torch.tensor(rows, dtype=torch.long).reshape(-1, 3)
        self._by_name = {e.name: i for i, e in enumerate(edges)}

    @classmethod
    def of(cls, model: HookedModel, positions: Optional[Sequence] = None) -> "EdgeGraph":
        """The graph of a model.

        Args:
            model: Anything with ``cfg.n_layers``, ``n_heads``, ...
            positions: Position labels for a positional graph, or ``None``.

        Returns:
            The graph.
        """
        return cls(Layout.of(model), positions)

    @property
    def n_edges(self) -> int:
        """The number of edges."""
        return len(self.edges)

    @property
    def dense_shape(self) -> tuple[int, int, int]:
        """``(positions, receivers, senders)``, the dense edge tensor's shape."""
        return (len(self.positions), self.layout.n_receivers, self.layout.n_senders)

    def index(self, edges) -> torch.Tensor:
        """Edge indices for edge names, :class:`Edge` objects or indices.

        Args:
            edges: The edges.

        Returns:
            Int[Tensor, "k"]: Their indices.

        Raises:
            AnalysisError: An unknown name or an index out of range.
        """
        out = []
        for e in edges:
            if isinstance(e, Edge):
                e = e.name
            if isinstance(e, str):
                if e not in self._by_name:
                    raise AnalysisError(
                        f"unknown edge {e!r}; edges are named like {self.edges[0].name!r} (see EdgeGraph.edges)"
                    )
                out.append(self._by_name[e])
            else:
                i = int(e)
                if not 0 <= i < self.n_edges:
                    raise AnalysisError(f"edge index {i} is out of range; accepted: 0..{self.n_edges - 1}")
                out.append(i)
        return torch.tensor(out, dtype=torch.long)

    def dense(self, chosen: torch.Tensor) -> torch.Tensor:
        """Per-edge values as the dense tensor.

        Args:
            chosen (Float[Tensor, "set edge"]): Per-edge values (or ``[edge]``).

        Returns:
            Float[Tensor, "set position receiver sender"]: Zero where no edge exists.

        Raises:
            AnalysisError: The last axis is not ``n_edges`` long.
        """
        chosen = torch.as_tensor(chosen)
        if chosen.shape[-1] != self.n_edges:
            raise AnalysisError(f"edge values must end in n_edges = {self.n_edges}, got shape {tuple(chosen.shape)}")
        flat = chosen.reshape(-1, self.n_edges).float()
        out = torch.zeros(flat.shape[0], *self.dense_shape)
        p, r, s = self.edge_index.T
        out[:, p, r, s] = flat
        return out

    def from_dense(self, dense: torch.Tensor) -> torch.Tensor:
        """The per-edge values of a dense tensor (the inverse of :meth:`dense` on existing edges).

        Args:
            dense (Float[Tensor, "... position receiver sender"]): The dense tensor.

        Returns:
            Float[Tensor, "... edge"]: The values at the existing edges.
        """
        p, r, s = self.edge_index.T
        return dense[..., p, r, s]

    def receiver_slice(self, layer: int, channel: str) -> slice:
        """The receivers of one layer and channel.

        Args:
            layer: The block.
            channel: ``q``, ``k``, ``v``, ``mlp`` or ``logits``.

        Returns:
            A slice of the dense receiver axis.
        """
        L = self.layout
        start = L.receiver(layer, channel)
        return slice(start, start + L.units(channel))

    def nodes_of(self, edge_ids: torch.Tensor) -> list[str]:
        """The nodes some edges touch.

        Args:
            edge_ids (Int[Tensor, "k"]): Edge indices.

        Returns:
            The nodes' names, in graph order.
        """
        names = {self.edges[int(i)].sender for i in edge_ids} | {self.edges[int(i)].receiver for i in edge_ids}
        return [n.name for n in self.nodes if n.name in names]

    def check_positions(self, labels: Sequence[str]) -> None:
        if self.positions != [None] and list(self.positions) != list(labels):
            raise SiteError(
                f"graph positions {accepted(self.positions)} differ from the resolved positions {accepted(labels)}"
            )
