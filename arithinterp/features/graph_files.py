"""Attribution graphs in circuit-tracer's files: the viewer's JSON, and its pruning and scores.

The format is circuit-tracer 0.5.0's (``circuit_tracer/frontend/graph_models.py``,
``utils/create_graph_files.py``, ``graph.py``):

* **JSON** (what ``create_graph_files`` writes and its local viewer and Neuronpedia read):
  ``{"metadata": {slug, scan, transcoder_list, prompt_tokens, prompt, node_threshold,
  schema_version}, "qParams": {...}, "nodes": [...], "links": [{source, target, weight}]}``. A
  node has ``node_id`` (``"{layer}_{feature}_{pos}"`` for features, ``"0_{layer}_{pos}"`` for
  error nodes, ``"E_{token id}_{pos}"`` for embeddings, ``"{n_layers + 1}_{token id}_{pos}"`` for
  logits), ``feature`` (Cantor pairing of layer and feature index; the position for embeddings;
  the token id for logits; -1 for errors), ``layer`` (a string, ``"E"`` for embeddings),
  ``ctx_idx`` (the position), ``feature_type``, ``jsNodeId``, ``influence`` (the cumulative share
  of influence at this node's rank, as ``prune_graph`` returns it), ``activation``, and for logits
  ``token_prob``, ``is_target_logit`` and ``clerp``. Only the nodes and links circuit-tracer's
  pruning keeps are written (``node_threshold`` on node influence, ``edge_threshold`` on edge
  influence, then nodes left without incoming or outgoing edges dropped), so a graph written here
  holds what circuit-tracer would write for the same edges.
* **.pt** (``Graph.to_pt``, a pickled dict; read by
  :mod:`~arithinterp.features.graph_reader`): ``adjacency_matrix [N, N]`` (rows targets, columns
  sources) over nodes ordered ``[selected features, error nodes (layer-major), embeddings,
  logits]``, ``active_features [n, 3]`` (layer, position, feature), ``selected_features``,
  ``activation_values``, ``logit_targets`` (``LogitTarget(token_str, vocab_idx)``),
  ``logit_probabilities``, ``input_tokens``, ``input_string``, ``cfg`` (``UnifiedConfig``),
  ``scan``, ``vocab_size``.

This package's :class:`~arithinterp.features.AttributionGraph` orders nodes ``[embeddings, features, error
nodes, logits]``; both files are converted by permutation, the edges themselves are the same
quantity (the direct effect of a source on a target's pre-activation or demeaned logit).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.outputs import check_target, write_file, writes
from arithinterp.schemas import Schema, read_json, validate
from arithinterp.types import checked

PathLike = Union[str, Path]
FORMAT_VERSION = "circuit-tracer 0.5.0"


def cantor_pairing(x: int, y: int) -> int:
    """circuit-tracer's ``feature`` number of a feature node: a unique int for (layer, feature)."""
    return (x + y) * (x + y + 1) // 2 + y


# ---- circuit-tracer's pruning (graph.py), on its node order --------------------------------------


def normalize_rows(matrix: torch.Tensor) -> torch.Tensor:
    """``|matrix|`` with each row scaled to sum to 1 (rows of zeros stay zero)."""
    normalized = matrix.abs()
    return normalized / normalized.sum(dim=1, keepdim=True).clamp(min=1e-10)


def influence_series(A: torch.Tensor, logit_weights: torch.Tensor) -> torch.Tensor:
    """``w (A + A² + …)``: every node's influence on the weighted logits ``[N]``."""
    current = logit_weights @ A
    influence = current.clone()
    for _ in range(A.shape[0] + 1):  # edges go to later layers only: the series ends
        if not bool(current.any()):
            return influence
        current = current @ A
        influence += current
    raise AnalysisError("the graph's influence did not converge: its edges form a cycle")


def _threshold(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    index = min(int(torch.searchsorted(cumulative, threshold).item()), len(cumulative) - 1)
    return ordered[index]


def circuit_tracer_prune(adjacency: torch.Tensor, logit_probabilities: torch.Tensor, n_features: int,
                         n_tokens: int, node_threshold: float = 0.8,
                         edge_threshold: float = 0.98) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """circuit-tracer's ``prune_graph`` on an adjacency ``[N, N]`` in its node order: the node mask
    ``[N]``, edge mask ``[N, N]`` and each node's cumulative influence score ``[N]``."""
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} must be in [0, 1], got {value!r}")
    n_logits = len(logit_probabilities)
    weights = torch.zeros(adjacency.shape[0], dtype=adjacency.dtype)
    weights[-n_logits:] = logit_probabilities.to(adjacency.dtype)
    node_influence = influence_series(normalize_rows(adjacency), weights)
    node_mask = node_influence >= _threshold(node_influence, node_threshold)
    node_mask[-n_logits - n_tokens:] = True
    pruned = adjacency.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized = normalize_rows(pruned)
    edge_scores = normalized * (influence_series(normalized, weights) + weights)[:, None]
    edge_mask = edge_scores >= _threshold(edge_scores.flatten(), edge_threshold)
    old = node_mask.clone()
    node_mask[: -n_logits - n_tokens] &= edge_mask[:, : -n_logits - n_tokens].any(0)
    node_mask[:n_features] &= edge_mask[:n_features].any(1)
    while not bool(torch.all(node_mask == old)):
        old[:] = node_mask
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[: -n_logits - n_tokens] &= edge_mask[:, : -n_logits - n_tokens].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)
    ordered, order = torch.sort(node_influence, descending=True)
    scores = torch.zeros_like(node_influence)
    scores[order] = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    return node_mask, edge_mask, scores


# ---- out: the viewer's JSON -----------------------------------------------------------------------


def circuit_tracer_order(graph: Any) -> torch.Tensor:
    """Indices into ``graph.nodes`` in circuit-tracer's order: features, error nodes, embeddings, logits."""
    by_kind: dict[str, list[int]] = {kind: [] for kind in ("feature", "error", "embedding", "logit")}
    for i, node in enumerate(graph.nodes):
        by_kind[node["kind"]].append(i)
    by_kind["feature"].sort(key=lambda i: (graph.nodes[i]["layer"], graph.nodes[i]["position"],
                                           graph.nodes[i]["feature"]))
    by_kind["error"].sort(key=lambda i: (graph.nodes[i]["layer"], graph.nodes[i]["position"]))
    by_kind["embedding"].sort(key=lambda i: graph.nodes[i]["position"])
    return torch.tensor(by_kind["feature"] + by_kind["error"] + by_kind["embedding"] + by_kind["logit"])


class IndexedGraph(Schema):
    """One graph the viewer's index lists (its other keys are kept as they are)."""

    slug: str


class GraphIndex(Schema):
    """circuit-tracer's ``graph-metadata.json`` (the viewer's index of the graphs in a folder)."""

    graphs: list[IndexedGraph] = []


@writes
@checked
def write_circuit_tracer_graph(graph: Any, path: PathLike, *, slug: Optional[str] = None,
                               scan: Optional[str] = None, node_threshold: float = 0.8,
                               edge_threshold: float = 0.98, overwrite: bool = False) -> Path:
    """Write ``graph`` as circuit-tracer's viewer JSON (see the module docstring), pruned as
    ``create_graph_files(..., node_threshold, edge_threshold)`` prunes.

    ``graph-metadata.json`` beside the file lists the graph (the viewer's index, merged by slug: the
    other graphs it lists are kept). Both files go through the guarded writer
    (:func:`arithinterp.outputs.write_file`).

    Args:
        graph: An :class:`~arithinterp.features.AttributionGraph`.
        path: A ``.json`` file, or a folder (the file is ``{slug}.json`` there, as circuit-tracer
            writes it).
        slug: The graph's name in the viewer (default: the file's stem, or one made from the prompt).
        scan: Names the transcoders (default: ``meta['transcoders']`` or the model's id).
        node_threshold: circuit-tracer's node pruning threshold.
        edge_threshold: circuit-tracer's edge pruning threshold.
        overwrite: Replace a graph file of that name (the index is merged, never replaced).

    Returns:
        The JSON file's path.

    Raises:
        AnalysisError: ``graph`` is not an AttributionGraph, or its nodes lack token ids or logit
            probabilities.
        ConfigError: The file cannot be written, or exists and ``overwrite`` is false.
        FormatError: The folder's ``graph-metadata.json`` is damaged (it is left as it is).
    """
    if not all(hasattr(graph, name) for name in ("nodes", "edges", "tokens", "prompt", "meta")):
        raise ConfigError(f"graph must be a features.AttributionGraph, got {type(graph).__name__}")
    missing = [n for n in graph.nodes if "token_id" not in n or (n["kind"] == "logit" and "probability" not in n)]
    if missing:
        raise AnalysisError("this graph's nodes carry no token ids or logit probabilities (it was made by an "
                            "older version); make it again with attribution_graph to write it for circuit-tracer")
    target = Path(path).expanduser()
    if target.suffix == ".json":
        folder, slug = target.parent, slug or target.stem
        file = target
    else:
        folder, slug = target, slug or "graph-" + hashlib.sha1(graph.prompt.encode()).hexdigest()[:8]
        file = folder / f"{slug}.json"
    check_target(file, overwrite=overwrite, what="path")
    index_file = folder / "graph-metadata.json"
    check_target(index_file, overwrite=True, what="path")  # merged: the other graphs it lists are kept
    index = GraphIndex()
    if os.path.lexists(index_file):
        index = validate(GraphIndex, read_json(index_file, "circuit-tracer's graph index"), index_file,
                         "circuit-tracer's graph index")
    order = circuit_tracer_order(graph)
    nodes = [graph.nodes[i] for i in order.tolist()]
    adjacency = graph.edges.float()[order][:, order]
    n_features = sum(n["kind"] == "feature" for n in nodes)
    n_tokens = sum(n["kind"] == "embedding" for n in nodes)
    logits = [n for n in nodes if n["kind"] == "logit"]
    probabilities = torch.tensor([n["probability"] for n in logits], dtype=torch.float32)
    node_mask, edge_mask, cumulative = circuit_tracer_prune(adjacency, probabilities, n_features, n_tokens,
                                                            node_threshold, edge_threshold)
    n_layers = max(n["layer"] for n in nodes if n["kind"] != "logit") + 1
    written: dict[int, dict] = {}
    for i in node_mask.nonzero().flatten().tolist():
        written[i] = _node(nodes[i], float(cumulative[i]), n_layers, first_logit=nodes[i] is logits[0])
    dsts, srcs = edge_mask.nonzero(as_tuple=True)
    weights = adjacency[dsts, srcs].tolist()
    links = [dict(source=written[s]["node_id"], target=written[t]["node_id"], weight=w)
             for s, t, w in zip(srcs.tolist(), dsts.tolist(), weights) if s in written and t in written]
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    used = [n for n in written.values() if n["node_id"] in connected or n["feature_type"] in ("embedding", "logit")]
    scan = scan or str(graph.meta.get("transcoders") or graph.meta.get("model", "arithinterp"))
    metadata = dict(slug=slug, scan=scan,
                    transcoder_list=[], prompt_tokens=list(graph.tokens), prompt=graph.prompt,
                    node_threshold=node_threshold, schema_version=1)
    document = dict(metadata=metadata,
                    qParams=dict(pinnedIds=[], supernodes=[], linkType="both", clickedId="", sg_pos=""),
                    nodes=used, links=links)
    listed = dict(index.model_dump(), graphs=[g.model_dump() for g in index.graphs if g.slug != slug] + [metadata])
    previous = file.read_bytes() if file.is_file() else None
    write_file(file, json.dumps(document, indent=2), overwrite=overwrite, what="path")
    try:
        write_file(index_file, json.dumps(listed, indent=2), overwrite=True, what="path")
    except BaseException:  # the two files go together: the graph goes back to what it was
        if previous is None:
            file.unlink(missing_ok=True)
        else:
            write_file(file, previous, overwrite=True, what="path")
        raise
    return file


def _node(node: dict, influence: float, n_layers: int, first_logit: bool) -> dict:
    """One node as circuit-tracer's ``Node`` model dumps it (its fields, in its order)."""
    layer, position, kind = node["layer"], node["position"], node["kind"]
    base = dict(token_prob=0.0, is_target_logit=False, run_idx=0, reverse_ctx_idx=0)
    if kind == "feature":
        f = node["feature"]
        return dict(node_id=f"{layer}_{f}_{position}", feature=cantor_pairing(layer, f), layer=str(layer),
                    ctx_idx=position, feature_type="cross layer transcoder", **base, jsNodeId=f"{layer}_{f}-0",
                    clerp=node.get("label", "") or "", influence=influence, activation=float(node["activation"]))
    if kind == "error":
        return dict(node_id=f"0_{layer}_{position}", feature=-1, layer=str(layer), ctx_idx=position,
                    feature_type="mlp reconstruction error", **base, jsNodeId=f"{layer}_{position}-0", clerp="",
                    influence=influence, activation=None)
    if kind == "embedding":
        token = node["token_id"]
        return dict(node_id=f"E_{token}_{position}", feature=position, layer="E", ctx_idx=position,
                    feature_type="embedding", **base, jsNodeId=f"E_{token}-{position}", clerp="",
                    influence=influence, activation=None)
    token, p = node["token_id"], float(node["probability"])
    out_layer = str(n_layers + 1)
    return dict(node_id=f"{out_layer}_{token}_{position}", feature=token, layer=out_layer, ctx_idx=position,
                feature_type="logit", token_prob=p, is_target_logit=first_logit, run_idx=0, reverse_ctx_idx=0,
                jsNodeId=f"L_{token}-{position}", clerp=f'Output "{node["token"]}" (p={p:.3f})', influence=None,
                activation=None)
