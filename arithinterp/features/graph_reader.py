"""Attribution graphs read from circuit-tracer's ``Graph.to_pt`` files (format: circuit-tracer 0.5.0,
see :mod:`~arithinterp.features.graph_files`).

The file is a pickled dict; it is read with ``torch.load(weights_only=True)``: circuit-tracer's two
classes (``LogitTarget``, ``UnifiedConfig``) are allowed by name onto plain stand-ins here, and
nothing else is unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Union

import torch

from arithinterp.errors import ResultFileError
from arithinterp.features.graph import AttributionGraph
from arithinterp.features.graph_files import FORMAT_VERSION, circuit_tracer_prune, influence_series, normalize_rows
from arithinterp.types import checked

PathLike = Union[str, Path]


class LogitTarget(NamedTuple):
    """Stand-in for ``circuit_tracer.attribution.targets.LogitTarget`` when reading a ``.pt``."""

    token_str: str
    vocab_idx: int


class UnifiedConfig:
    """Stand-in for circuit-tracer's model config when reading a ``.pt``: its fields as attributes."""


STAND_INS = [(LogitTarget, "circuit_tracer.attribution.targets.LogitTarget"),
             (UnifiedConfig, "circuit_tracer.utils.tl_nnsight_mapping.UnifiedConfig")]


@checked
def read_circuit_tracer_graph(path: PathLike, model: Any = None, *, node_threshold: float = 0.8) -> AttributionGraph:
    """A :class:`~arithinterp.features.AttributionGraph` from a circuit-tracer ``Graph.to_pt`` file.

    Edges are circuit-tracer's, permuted into this package's node order; ``kept`` is circuit-tracer's
    pruning at ``node_threshold``; ``influence`` each node's influence on the logits. ``bias`` and
    ``values`` are not in the file (zero and the sum of incoming edges).

    Args:
        path: The ``.pt`` file.
        model: The hooked model, for token strings; without it they are the token ids written out.
        node_threshold: circuit-tracer's node pruning threshold, for ``kept``.

    Returns:
        The graph.

    Raises:
        ResultFileError: No such file, or one that is not a circuit-tracer graph that loads safely.
    """
    file = Path(path)
    if not file.is_file():
        raise ResultFileError(f"no circuit-tracer graph file at {file}")
    try:
        with torch.serialization.safe_globals(STAND_INS):
            d = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # the unpickler raises several types for a file that is not this format
        raise ResultFileError(f"{file} is not a circuit-tracer graph that loads safely ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from None
    needed = ("adjacency_matrix", "active_features", "selected_features", "activation_values", "logit_targets",
              "logit_probabilities", "input_tokens", "cfg")
    if not isinstance(d, dict) or any(key not in d for key in needed):
        raise ResultFileError(f"{file} is not a circuit-tracer graph: it needs the keys {', '.join(needed)}")
    adjacency = d["adjacency_matrix"].float()
    tokens = d["input_tokens"].flatten().tolist()
    n_pos = len(tokens)
    n_layers = int(d["cfg"].n_layers)
    selected = d["selected_features"].long()
    features = d["active_features"][selected].long()  # [n, 3] (layer, position, feature)
    activations = d["activation_values"][selected].float()
    targets = d["logit_targets"]
    if isinstance(targets, torch.Tensor):  # graphs written before LogitTarget
        targets = [LogitTarget("", int(i)) for i in targets.tolist()]
    n_f, n_logits = len(features), len(targets)
    if adjacency.shape != (n_f + (n_layers + 1) * n_pos + n_logits,) * 2:
        raise ResultFileError(f"{file}: adjacency {tuple(adjacency.shape)} does not fit {n_f} features, "
                              f"{n_layers} layers × {n_pos} positions and {n_logits} logits")
    probabilities = d["logit_probabilities"].float()
    strings = ([str(model.to_string(torch.tensor([t]))) for t in tokens] if model is not None
               else [str(t) for t in tokens])
    # circuit-tracer's order -> ours: embeddings, features, errors, logits
    ct_nodes: list[dict] = []
    for (layer, pos, f), a in zip(features.tolist(), activations.tolist()):
        ct_nodes.append(dict(kind="feature", layer=layer, position=pos, feature=f, activation=a))
    for layer in range(n_layers):
        for pos in range(n_pos):
            ct_nodes.append(dict(kind="error", layer=layer, position=pos, feature=-1, activation=0.0))
    for pos in range(n_pos):
        ct_nodes.append(dict(kind="embedding", layer=-1, position=pos, feature=-1, activation=0.0))
    for target, p in zip(targets, probabilities.tolist()):
        ct_nodes.append(dict(kind="logit", layer=n_layers, position=n_pos - 1, feature=int(target.vocab_idx),
                             activation=0.0, probability=p, token=str(target.token_str)))
    node_mask, _, _ = circuit_tracer_prune(adjacency, probabilities, n_f, n_pos, node_threshold, 0.98)
    weights = torch.zeros(len(ct_nodes))
    weights[-n_logits:] = probabilities
    influence = influence_series(normalize_rows(adjacency.double()), weights.double()).float()
    for i, node in enumerate(ct_nodes):
        node["influence"] = float(influence[i])
        node["kept"] = bool(node_mask[i])
        node["label"] = ""
        node["token_id"] = node["feature"] if node["kind"] == "logit" else tokens[node["position"]]
        if node["kind"] != "logit" or not node.get("token"):
            node["token"] = strings[node["position"]] if node["kind"] != "logit" else (
                str(model.to_string(torch.tensor([node["feature"]]))) if model is not None else str(node["feature"]))
    kinds = {"embedding": 0, "feature": 1, "error": 2, "logit": 3}
    ours = sorted(range(len(ct_nodes)), key=lambda i: (kinds[ct_nodes[i]["kind"]], i))
    order = torch.tensor(ours)
    edges = adjacency[order][:, order]
    nodes = [ct_nodes[i] for i in ours]
    replacement, completeness = circuit_tracer_scores(adjacency, weights, n_f, n_layers * n_pos, n_pos)
    scores = dict(replacement=replacement, completeness=completeness, completeness_all_nodes=completeness,
                  n_kept=int(node_mask.sum()), n_nodes=len(nodes), n_active_features=n_f)
    cfg = {k: v for k, v in vars(d["cfg"]).items() if isinstance(v, (str, int, float, bool)) or v is None}
    meta = dict(source=FORMAT_VERSION, path=str(file), scan=d.get("scan"), model=cfg.get("model_name"), cfg=cfg,
                node_threshold=node_threshold, completeness="all-nodes")
    return AttributionGraph(nodes=nodes, edges=edges, bias=torch.zeros(len(nodes)), values=edges.sum(1),
                 prompt=str(d.get("input_string", "")), tokens=strings, scores=scores, meta=meta)


def circuit_tracer_scores(adjacency: torch.Tensor, weights: torch.Tensor, n_f: int, n_errors: int,
                          n_pos: int) -> tuple[float, float]:
    """circuit-tracer's ``compute_graph_scores``: replacement and completeness (every node)."""
    normalized = normalize_rows(adjacency.double())
    influence = influence_series(normalized, weights.double())
    token = influence[n_f + n_errors : n_f + n_errors + n_pos].sum()
    error = influence[n_f : n_f + n_errors].sum()
    non_error = 1 - normalized[:, n_f : n_f + n_errors].sum(-1)
    output = influence + weights.double()
    return float(token / (token + error)), float((non_error * output).sum() / output.sum())
