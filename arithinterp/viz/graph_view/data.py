"""What the graph viewer draws: a plain, JSON-able description of an attribution graph or a circuit.

The description is the page's only input (:mod:`arithinterp.viz.graph_view.page` embeds it), so
anything that produces one can be viewed. Its fields (``version`` 1):

* ``kind``: ``"graph"`` (an :class:`~arithinterp.features.AttributionGraph`) or ``"circuit"`` (a
  :class:`~arithinterp.circuits.Circuit`); ``title``, ``subtitle`` (a line of scores), ``notes``
  (what was left out of the page, in words).
* ``rows``: the row labels, bottom to top (``"embeddings"``, ``"L0"`` … ``"logits"``); ``columns``:
  the column labels, left to right (the prompt's tokens; a circuit's positions).
* ``nodes``: one list per field, one entry per node: ``id``, ``kind`` (``embedding``, ``feature``,
  ``error``, ``logit``; ``head``, ``mlp`` in circuits), ``row``, ``col``, ``name`` (short),
  ``label``, ``token``, ``layer``, ``feature`` (the feature's index; the head's in circuits),
  ``activation``, ``influence``, ``probability`` (logits), ``grid`` (an index into ``grids`` or -1)
  and, in graphs, ``rank`` (the node's place in the slider's order, -1 for nodes always shown).
  Node ids: ``"L{layer}F{feature}@{position}"`` (features), ``"L{layer}err@{position}"`` (error
  nodes), ``"token@{position}"`` (embeddings), ``"logit:{token id}"`` (answer logits); in
  circuits the component's name (``"L0H1"``, ``"MLP0"``, ``"embed"``, ``"logits"``), with
  ``"@{position}"`` in a per-position graph.
* ``links``: ``source``, ``target`` (node indices), ``weight`` (an edge's direct effect, or a
  circuit edge's score), and in circuits ``channel`` (``q``, ``k``, ``v``, ``mlp``, ``logits``).
* ``slider``: ``by`` — ``"nodes"`` (a graph: the first ``k`` source nodes by ``rank`` are shown, with
  the logits, and the links among them) or ``"links"`` (a circuit: the links arrive in order, the
  first ``k`` are shown with the nodes they touch); ``count`` (the most ``k``), ``default`` (``k``
  of the graph as pruned, or of the circuit's kept edges), ``cumulative`` (graphs: the share of
  the source nodes' influence held by the first ``k``, ``k = 0..count``).
* ``groups``: supernodes, ``{"name", "members"}`` (node indices), drawn collapsed into one node.
* ``grids``: operand plots, ``{"title", "a", "b", "lo", "hi", "values"}``: a feature's activation
  over the a × b operand grid, quantised to bytes (0-254 from ``lo`` to ``hi``, 255 for no value,
  row-major over ``a`` then ``b``) and base64-encoded.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch

from arithinterp.errors import ConfigError
from arithinterp.types import PositiveInt, checked

VERSION = 1
# links a page holds by default: the pruned graph's and each node's strongest, then the rest by
# influence; 30,000 links keep a 1,000-feature graph's page near 1 MB and its slider fast
MAX_LINKS = 30_000
# links drawn at once: past it the strongest are drawn (a canvas drawn in software, as in a browser
# without a GPU, takes about 100 ms for 10,000 long thin lines on two cores)
MAX_DRAWN = 10_000
STRONGEST = 3  # each node's strongest incoming and outgoing links are always in the page
SIGNIFICANT = 4  # digits kept of each number written


def _round(value: Optional[float]) -> Optional[float]:
    """``value`` to :data:`SIGNIFICANT` digits (the page's precision); None for a missing or non-finite one."""
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.{SIGNIFICANT}g}")


def _rounded(values: torch.Tensor) -> list:
    return [_round(v) for v in values.tolist()]


def graph_node_id(node: Mapping) -> str:
    """The viewer's id of an :class:`~arithinterp.features.AttributionGraph` node (see the module docstring).

    Args:
        node: One of the graph's ``nodes``.

    Returns:
        The id, e.g. ``"L0F18@4"``.
    """
    kind, layer, position = node["kind"], node["layer"], node["position"]
    if kind == "feature":
        return f"L{layer}F{node['feature']}@{position}"
    if kind == "error":
        return f"L{layer}err@{position}"
    if kind == "embedding":
        return f"token@{position}"
    return f"logit:{node.get('token_id', node['feature'])}"


@checked
def graph_data(graph: Any, *, labels: Optional[dict] = None, supernodes: Any = None, grids: Any = None,
               max_links: PositiveInt = MAX_LINKS, max_drawn: PositiveInt = MAX_DRAWN) -> dict:
    """The viewer's description of an attribution graph (see the module docstring).

    Every node of the graph is in it, ordered for the slider: the logits (always shown), then the
    source nodes the graph kept, by influence, then the others by influence — so the slider's
    default shows the pruned graph. Its links are every non-zero edge when there are at most
    ``max_links``; otherwise the pruned graph's edges, each node's :data:`STRONGEST` strongest
    incoming and outgoing edges, then the others by their influence on the answer (an edge's
    share of its target's incoming weight times the target's influence, as circuit-tracer scores
    edges) until ``max_links`` in all; ``notes`` says how many were left out.

    Args:
        graph: An :class:`~arithinterp.features.AttributionGraph`.
        labels: ``{(layer, feature): text}``, shown on feature nodes over the graph's own labels.
        supernodes: Groups of features drawn as one node: ``[{"name": ..., "members": [...]}, ...]``
            (or ``{name: members}``), each member ``(layer, feature)`` (at every position),
            ``(layer, feature, position)`` or a node id. ``None``: features that share a label are
            grouped by it; ``[]``: no groups.
        grids: Operand plots to attach: a :class:`~arithinterp.features.FeatureGridsResult` or a
            list of them (:func:`~arithinterp.features.graph_feature_grids` makes them for a graph's
            kept features); each is attached to the feature nodes at the position it was read at.
        max_links: The most links in the page (beyond the pruned graph's and each node's strongest).
        max_drawn: The most links drawn at once: when the slider shows more, the strongest are
            drawn and the slider's line says so.

    Returns:
        The description, a dict of lists, strings and numbers.

    Raises:
        ConfigError: Not an attribution graph, counts that are not positive ints, labels not keyed
            by (layer, feature), or supernodes that are not groups of the graph's nodes (a member in
            two groups, a malformed group).
    """
    if not all(hasattr(graph, name) for name in ("nodes", "edges", "tokens", "prompt", "scores")):
        raise ConfigError(f"graph must be a features.AttributionGraph, got {type(graph).__name__}")
    nodes: list[dict] = [dict(n) for n in graph.nodes]
    labels = dict(labels or {})
    for key in labels:
        if not (isinstance(key, tuple) and len(key) == 2 and all(type(v) is int for v in key)):
            raise ConfigError(f"labels are keyed by (layer, feature) pairs of ints, e.g. {{(0, 18): 'ones digit'}}; "
                              f"got the key {key!r}")
    for node in nodes:
        if node["kind"] == "feature" and (node["layer"], node["feature"]) in labels:
            node["label"] = str(labels[(node["layer"], node["feature"])])
    n_layers = max((n["layer"] for n in nodes if n["kind"] != "logit"), default=-1) + 1
    is_logit = torch.tensor([n["kind"] == "logit" for n in nodes])
    influence = torch.tensor([float(n.get("influence", 0.0)) for n in nodes], dtype=torch.float64)
    kept = torch.tensor([bool(n.get("kept", False)) for n in nodes])
    # slider order: logits, kept sources by influence, other sources by influence (kept is a prefix of
    # the influence order, so the slider's default k is the pruned graph)
    sources = [i for i in range(len(nodes)) if not nodes[i]["kind"] == "logit"]
    sources.sort(key=lambda i: (not bool(kept[i]), -float(influence[i]), i))
    logits = [i for i in range(len(nodes)) if nodes[i]["kind"] == "logit"]
    order = logits + sources
    rank = torch.full((len(nodes),), -1, dtype=torch.long)
    rank[torch.tensor(sources, dtype=torch.long)] = torch.arange(len(sources))
    held = influence[torch.tensor(sources, dtype=torch.long)].clamp_min(0)
    total = float(held.sum())
    cumulative = [0.0] + [(float(c) / total if total > 0 else 1.0) for c in held.cumsum(0)]

    weights = graph.edges.float()
    chosen, n_nonzero = _choose_graph_links(weights, nodes, influence, kept, is_logit, max_links)
    targets, sources_of = chosen.nonzero(as_tuple=True)
    at = torch.empty(len(nodes), dtype=torch.long)
    at[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    grid_list, grid_of = _graph_grids(grids, nodes, len(graph.tokens))
    ordered = [nodes[i] for i in order]
    ids = [graph_node_id(n) for n in ordered]
    data = dict(
        id=ids,
        kind=[n["kind"] for n in ordered],
        row=[0 if n["kind"] == "embedding" else n_layers + 1 if n["kind"] == "logit" else n["layer"] + 1
             for n in ordered],
        col=[int(n["position"]) for n in ordered],
        name=[_graph_name(n) for n in ordered],
        label=[str(n.get("label", "") or "") for n in ordered],
        token=[str(n.get("token", "")) for n in ordered],
        layer=[int(n["layer"]) for n in ordered],
        feature=[int(n["feature"]) if n["kind"] == "feature" else -1 for n in ordered],
        activation=[_round(float(n["activation"])) if n.get("activation") is not None else None for n in ordered],
        influence=[None if n["kind"] == "logit" else _round(float(n.get("influence", 0.0))) for n in ordered],
        probability=[_round(float(n["probability"])) if n["kind"] == "logit" and "probability" in n else None
                     for n in ordered],
        rank=[int(rank[i]) for i in order],
        grid=[grid_of.get(i, -1) for i in order],
    )
    groups = _groups(supernodes, ordered, ids, by_label=True)
    s = graph.scores
    n_kept = int(kept[~is_logit].sum())
    subtitle = (f"{n_kept} of {len(sources)} source nodes kept, holding {cumulative[n_kept]:.2f} of their influence"
                + (f" · replacement {s['replacement']:.3f}" if "replacement" in s else "")
                + (f" · completeness {s['completeness']:.3f}" if "completeness" in s else ""))
    notes = []
    if len(targets) < n_nonzero:
        notes.append(f"{len(targets):,} of the graph's {n_nonzero:,} non-zero edges are in this page: the pruned "
                     f"graph's, each node's {STRONGEST} strongest in and out, then the rest by influence on the answer "
                     f"(max_links={max_links:,}).")
    expanded, active = s.get("n_expanded_features"), s.get("n_active_features")
    if expanded is not None and active is not None and expanded < active:
        notes.append(f"{expanded:,} of {active:,} active features were expanded; the others are not in the graph.")
    return dict(
        format="arithinterp-graph-view", version=VERSION, kind="graph",
        title=f"Attribution graph of {graph.prompt!r}", subtitle=subtitle, notes=notes,
        rows=["embeddings", *[f"L{layer}" for layer in range(n_layers)], "logits"],
        columns=[str(t) for t in graph.tokens],
        nodes=data,
        links=dict(source=at[sources_of].tolist(), target=at[targets].tolist(),
                   weight=_rounded(weights[targets, sources_of])),
        slider=dict(by="nodes", count=len(sources), default=n_kept, cumulative=[_round(c) for c in cumulative]),
        groups=groups, grids=grid_list, max_drawn=max_drawn,
    )


def _graph_name(node: Mapping) -> str:
    kind = node["kind"]
    if kind == "feature":
        return f"#{node['feature']}"
    if kind == "error":
        return "error"
    if kind == "embedding":
        return str(node.get("token", node["position"]))
    return repr(str(node.get("token", node["feature"])))


def _choose_graph_links(weights: torch.Tensor, nodes: list, influence: torch.Tensor, kept: torch.Tensor,
                        is_logit: torch.Tensor, max_links: int) -> tuple[torch.Tensor, int]:
    """The ``[target, source]`` mask of the links a page holds, and the number of non-zero edges."""
    nonzero = weights != 0
    n_nonzero = int(nonzero.sum())
    if n_nonzero <= max_links:
        return nonzero, n_nonzero
    shown = kept | is_logit
    chosen = nonzero & shown[:, None] & shown[None, :]  # the pruned graph's edges
    magnitude = weights.abs()
    for dim in (0, 1):  # each source's strongest outgoing (down a column), each target's strongest incoming
        top = magnitude.topk(min(STRONGEST, weights.shape[0]), dim=dim).indices
        mark = torch.zeros_like(chosen)
        mark.scatter_(dim, top, True)
        chosen |= mark & nonzero
    room = max_links - int(chosen.sum())
    if room > 0:
        # an edge's influence on the answer: its share of the target's incoming |weight| times the
        # target's own influence (logits: their share of the answer's probability)
        probability = torch.tensor([float(node.get("probability", 0.0)) if node["kind"] == "logit" else 0.0
                                    for node in nodes], dtype=torch.float64)
        answer = probability / probability.sum() if float(probability.sum()) > 0 else is_logit.double()
        totals = magnitude.double().sum(1, keepdim=True).clamp_min(1e-30)
        score = magnitude.double() / totals * (influence.clamp_min(0) + answer)[:, None]
        score[~nonzero | chosen] = -1.0
        best = score.flatten().topk(min(room, int((score >= 0).sum()))).indices
        chosen.view(-1)[best] = True
    return chosen, n_nonzero


def _graph_grids(grids: Any, nodes: list, n_tokens: int) -> tuple[list, dict[int, int]]:
    """The operand plots in the page's form and which node (index into ``nodes``) shows which."""
    if grids is None:
        return [], {}
    results = [grids] if hasattr(grids, "maps") else list(grids)
    if not all(hasattr(g, "maps") and hasattr(g, "layer") for g in results):
        raise ConfigError("grids must be a features.FeatureGridsResult or a list of them (features.feature_grids, "
                          "features.graph_feature_grids)")
    where: dict[tuple[int, int, int], int] = {}
    for i, node in enumerate(nodes):
        if node["kind"] == "feature":
            where[(node["layer"], node["feature"], node["position"])] = i
    out: list[dict] = []
    shown: dict[int, int] = {}
    for result in results:
        position = int(result.meta.get("position", -1))
        position = position + n_tokens if position < 0 else position
        for j, feature in enumerate(result.features):
            node = where.get((int(result.layer), int(feature), position))
            if node is None or node in shown:
                continue
            shown[node] = len(out)
            title = f"L{result.layer} #{feature} at position {position}, over the operand grid"
            out.append(operand_grid(result.maps[j], result.a_values, result.b_values, title))
    return out, shown


def operand_grid(values: torch.Tensor, a_values: Iterable, b_values: Iterable, title: str = "") -> dict:
    """One operand plot in the page's form: ``values [a, b]`` quantised to bytes, base64-encoded.

    Args:
        values (Float[Tensor, "a b"]): The activation over the grid (NaN: no value).
        a_values: The rows' operand values.
        b_values: The columns' operand values.
        title: The plot's title.

    Returns:
        ``{"title", "a", "b", "lo", "hi", "values"}`` (see the module docstring).
    """
    grid = torch.as_tensor(values, dtype=torch.float64)
    finite = torch.isfinite(grid)
    lo = float(grid[finite].min()) if bool(finite.any()) else 0.0
    hi = float(grid[finite].max()) if bool(finite.any()) else 0.0
    span = hi - lo if hi > lo else 1.0
    q = ((grid - lo) / span * 254).round().clamp(0, 254).to(torch.uint8)
    q[~finite] = 255
    return dict(title=title, a=[int(a) for a in a_values], b=[int(b) for b in b_values], lo=_round(lo), hi=_round(hi),
                values=base64.b64encode(bytes(q.flatten().tolist())).decode("ascii"))


@checked
def circuit_data(circuit: Any, *, supernodes: Any = None, max_links: PositiveInt = MAX_LINKS,
                 max_drawn: PositiveInt = MAX_DRAWN) -> dict:
    """The viewer's description of a circuit's scored edges (see the module docstring).

    The links arrive in the slider's order: the kept edges by |score|, then the others by
    |score| (at most ``max_links`` in all), so the slider's default shows the kept circuit and
    moving it right adds the next strongest edges. Nodes are the components the links touch, one
    per position in a per-position graph; rows are layers, columns positions.

    Args:
        circuit: A :class:`~arithinterp.circuits.Circuit`.
        supernodes: Groups of components drawn as one node: ``[{"name": ..., "members": [...]}, ...]``
            (or ``{name: members}``), each member a component's name (``"L0H1"``: at every
            position) or a node id (``"L0H1@final"``). ``None`` or ``[]``: no groups.
        max_links: The most links in the page.
        max_drawn: As for :func:`graph_data`.

    Returns:
        The description, a dict of lists, strings and numbers.

    Raises:
        ConfigError: Not a circuit, counts that are not positive ints, or malformed supernodes.
    """
    if not all(hasattr(circuit, name) for name in ("scores", "kept", "senders", "receivers", "channels", "graph")):
        raise ConfigError(f"circuit must be a circuits.Circuit, got {type(circuit).__name__}")
    graph = circuit.graph()
    scores = circuit.scores.float()
    magnitude = scores.abs().nan_to_num(-1.0)
    kept = circuit.kept.bool()
    order = sorted(range(len(scores)), key=lambda i: (not bool(kept[i]), -float(magnitude[i]), i))[:max_links]
    n_kept = int(kept.sum())
    labels = list(graph.positions)
    per_position = labels != [None]
    component = {n.name: n for n in graph.nodes}
    index: dict[str, int] = {}
    rows_of: dict[str, tuple] = {}  # node id -> (position label, component)

    def node_of(name: str, position: Any) -> int:
        node_id = name if not per_position else f"{name}@{position}"
        if node_id not in index:
            index[node_id] = len(index)
            rows_of[node_id] = (position, component[name])
        return index[node_id]

    sources, targets = [], []
    for i in order:
        sources.append(node_of(circuit.senders[i], circuit.positions[i]))
        targets.append(node_of(circuit.receivers[i], circuit.positions[i]))
    # nodes in graph order within each position, so that a cell lists heads before its MLP
    slot = {n.name: k for k, n in enumerate(graph.nodes)}
    ids = sorted(index, key=lambda node_id: (labels.index(rows_of[node_id][0]), slot[rows_of[node_id][1].name]))
    renumber = torch.empty(len(ids), dtype=torch.long)
    for new, node_id in enumerate(ids):
        renumber[index[node_id]] = new
    parts = [rows_of[node_id] for node_id in ids]
    kinds = {"embed": "embedding", "logits": "logit"}
    nodes = dict(
        id=ids,
        kind=[kinds.get(c.kind, c.kind) for _, c in parts],
        row=[c.layer + 1 for _, c in parts],
        col=[labels.index(p) for p, _ in parts],
        name=[c.name for _, c in parts],
        label=["" for _ in parts],
        token=["every position" if p is None else str(p) for p, _ in parts],
        layer=[c.layer for _, c in parts],
        feature=[-1 if c.head is None else c.head for _, c in parts],
    )
    groups = _groups(supernodes, [dict(name=c.name, id=node_id) for node_id, (_, c) in zip(ids, parts)], ids,
                     by_label=False)
    n_layers = graph.layout.n_layers
    shown = len(order)
    notes = []
    if shown < len(scores):
        notes.append(f"{shown:,} of the circuit's {len(scores):,} scored edges are in this page (the kept ones, then "
                     f"the rest by |score|; max_links={max_links:,}).")
    extraction = circuit.meta.get("extraction", "")
    subtitle = (f"{n_kept:,} of {len(scores):,} edges kept" + (f" ({extraction})" if extraction else "")
                + f" · method {circuit.method}, metric {circuit.metric}"
                + (f", {circuit.meta['n_pairs']} pairs" if circuit.meta.get("n_pairs") else ""))
    return dict(
        format="arithinterp-graph-view", version=VERSION, kind="circuit",
        title=f"Circuit ({circuit.method}, {circuit.metric}): {n_kept:,} of {len(scores):,} edges",
        subtitle=subtitle, notes=notes,
        rows=["embeddings", *[f"L{layer}" for layer in range(n_layers)], "logits"],
        columns=["every position"] if not per_position else [str(p) for p in labels],
        nodes=nodes,
        links=dict(source=renumber[torch.tensor(sources, dtype=torch.long)].tolist() if sources else [],
                   target=renumber[torch.tensor(targets, dtype=torch.long)].tolist() if targets else [],
                   weight=[_round(float(scores[i])) for i in order],
                   channel=[circuit.channels[i] for i in order]),
        slider=dict(by="links", count=shown, default=min(n_kept, shown)),
        groups=groups, grids=[], max_drawn=max_drawn,
    )


def _groups(supernodes: Any, nodes: list, ids: list[str], by_label: bool) -> list[dict]:
    """Supernodes as ``{"name", "members"}`` with node indices: given ones resolved, or (graphs) the
    features grouped by a label two or more of them share."""
    if supernodes is None:
        if not by_label:
            return []
        by: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            if node.get("kind") == "feature" and node.get("label"):
                by.setdefault(str(node["label"]), []).append(i)
        return [dict(name=name, members=members) for name, members in by.items() if len(members) > 1]
    groups = _group_list(supernodes)
    position_of = {node_id: i for i, node_id in enumerate(ids)}
    owner: dict[int, str] = {}
    out = []
    for name, members in groups:
        found: list[int] = []
        for member in members:
            for i in _matches(member, nodes, position_of):
                if i in owner and owner[i] != name:
                    raise ConfigError(f"supernodes: node {ids[i]!r} is in both {owner[i]!r} and {name!r}; a node "
                                      "belongs to one supernode")
                if i not in found:
                    owner[i] = name
                    found.append(i)
        if found:  # a group none of whose members is in this graph is not drawn
            out.append(dict(name=name, members=found))
    return out


def _group_list(supernodes: Any) -> list[tuple[str, list]]:
    entries: list[Any] = []
    if isinstance(supernodes, Mapping):
        entries = list(supernodes.items())
    elif isinstance(supernodes, Iterable) and not isinstance(supernodes, (str, bytes)):
        entries = list(supernodes)
    else:
        raise ConfigError(f"supernodes must be a list of {{'name', 'members'}} groups or a {{name: members}} dict, "
                          f"got {type(supernodes).__name__}")
    groups: list[tuple[str, list]] = []
    for entry in entries:
        name: Any = None
        members: Any = None
        if isinstance(entry, Mapping) and "name" in entry and "members" in entry:
            name, members = entry["name"], entry["members"]
        elif isinstance(entry, tuple) and len(entry) == 2:
            name, members = entry
        listed = isinstance(members, Iterable) and not isinstance(members, (str, bytes))
        if not isinstance(name, str) or not name or not listed:
            raise ConfigError(f"supernodes: {entry!r} is not a group; give {{'name': 'ones digit', 'members': "
                              "[(0, 18), (1, 6, 4), 'L0F51@4']}} (a non-empty name and a list of members)")
        groups.append((name, list(members)))
    names = [name for name, _ in groups]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"supernodes: {twice} named more than once; give each group one name")
    return groups


def _matches(member: Any, nodes: list, position_of: Mapping[str, int]) -> list[int]:
    """The nodes a supernode member names: a node id, a component name (circuits), or a feature's
    ``(layer, feature)`` / ``(layer, feature, position)``."""
    if isinstance(member, str):
        if member in position_of:
            return [position_of[member]]
        return [i for i, node in enumerate(nodes) if node.get("name") == member]
    if isinstance(member, (tuple, list)) and len(member) in (2, 3) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in member):
        return [i for i, node in enumerate(nodes) if node.get("kind") == "feature"
                and (node["layer"], node["feature"]) == tuple(member[:2])
                and (len(member) == 2 or node["position"] == member[2])]
    raise ConfigError(f"supernodes: member {member!r} is not accepted; give a node id ('L0F18@4'), a feature "
                      "(layer, feature) or (layer, feature, position), or in a circuit a component's name ('L0H1')")

