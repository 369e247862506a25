"""Attribution graphs read from circuit-tracer's ``Graph.to_pt`` files (format: circuit-tracer 0.5.0,
see :mod:`~arithinterp.features.graph_files`).

The file is a pickled dict; it is read with ``torch.load(weights_only=True)``: circuit-tracer's two
classes (``LogitTarget``, ``UnifiedConfig``) are allowed by name onto plain stand-ins here, and
nothing else is unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import pydantic
import torch

from arithinterp.checks import architecture
from arithinterp.errors import AnalysisError, FormatError, ResultFileError
from arithinterp.features.graph import AttributionGraph
from arithinterp.features.graph_files import FORMAT_VERSION, circuit_tracer_prune, influence_series, normalize_rows
from arithinterp.results import build_meta
from arithinterp.schemas import Count, Schema, below, check_tensor, read_pickle, validate
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


#: The largest feature index read without transcoders to check against: no transcoder has more
#: features per layer (its weights alone would take 2 · 2**24 · d_model floats).
MAX_FEATURES = 2**24


class GraphConfig(Schema):
    """The fields of the ``.pt``'s ``cfg`` (circuit-tracer's ``UnifiedConfig``, or a dict) read here."""

    n_layers: Count
    d_model: Optional[Count] = None
    d_vocab: Optional[Count] = None
    model_name: Optional[str] = None
    tokenizer_name: Optional[str] = None


Tensor = pydantic.InstanceOf[torch.Tensor]


class GraphFile(Schema):
    """circuit-tracer's ``Graph.to_pt`` dict (format: circuit-tracer 0.5.0); tensors are checked against
    each other by :func:`read_circuit_tracer_graph`."""

    adjacency_matrix: Tensor
    active_features: Tensor
    selected_features: Tensor
    activation_values: Tensor
    logit_targets: Union[Tensor, list[Any]]
    logit_probabilities: Tensor
    input_tokens: Tensor
    cfg: Any
    input_string: Optional[str] = None
    scan: Optional[Any] = None
    vocab_size: Optional[Count] = None


def _graph_config(file: Path, cfg: Any) -> GraphConfig:
    fields = cfg if isinstance(cfg, dict) else (vars(cfg) if isinstance(cfg, UnifiedConfig) else cfg)
    plain = {k: v for k, v in fields.items() if k in GraphConfig.model_fields} if isinstance(fields, dict) else fields
    return validate(GraphConfig, plain, f"{file} (field 'cfg')", "circuit-tracer's model config")


def _targets(file: Path, targets: Any) -> list[LogitTarget]:
    if isinstance(targets, torch.Tensor):  # graphs written before LogitTarget
        check_tensor(file, "logit_targets", targets, (None,), floating=False)
        return [LogitTarget("", int(i)) for i in targets.tolist()]
    out = []
    for i, target in enumerate(targets):
        if not (isinstance(target, tuple) and len(target) == 2 and isinstance(target[0], str)
                and isinstance(target[1], int) and not isinstance(target[1], bool)):
            raise FormatError(f"{file}: field 'logit_targets[{i}]' holds {target!r:.60}; expected a LogitTarget "
                              "(token_str, vocab_idx)")
        out.append(LogitTarget(*target))
    return out


@checked
def read_circuit_tracer_graph(path: PathLike, model: Any = None, *, transcoders: Any = None,
                              node_threshold: float = 0.8) -> AttributionGraph:
    """A :class:`~arithinterp.features.AttributionGraph` from a circuit-tracer ``Graph.to_pt`` file.

    Edges are circuit-tracer's, permuted into this package's node order; ``kept`` is circuit-tracer's
    pruning at ``node_threshold``; ``influence`` each node's influence on the logits. ``bias`` and
    ``values`` are not in the file (zero and the sum of incoming edges).

    The file is checked against :class:`GraphFile` before anything is built: integer indices and
    floating, finite weights; the adjacency ``[N, N]`` with ``N`` = features + (layers + 1) ×
    positions + logits; feature layers below ``cfg.n_layers``, positions inside the prompt, token and
    logit ids inside the vocabulary, one probability in [0, 1] per logit. With ``model``, the file
    must be the model's: its layer count, width and vocabulary, and (when the file holds the prompt)
    the model's own tokens of that prompt. With ``transcoders``, feature indices below their size.

    Args:
        path: The ``.pt`` file.
        model: The hooked model, for token strings and the checks above; without it tokens are the ids
            written out.
        transcoders: The transcoders the graph was made with, to check its feature indices against
            (without them, indices up to :data:`MAX_FEATURES` are read).
        node_threshold: circuit-tracer's node pruning threshold, for ``kept``.

    Returns:
        The graph.

    Raises:
        ResultFileError: No such file.
        FormatError: A file that is not a circuit-tracer graph that loads safely, or breaks its schema,
            or was made on another model than ``model``; the message names the field.
    """
    file = Path(path)
    if not file.is_file():
        raise ResultFileError(f"no circuit-tracer graph file at {file}")
    d = validate(GraphFile, read_pickle(file, STAND_INS, "a circuit-tracer graph"), file, "a circuit-tracer graph")
    cfg = _graph_config(file, d.cfg)
    n_layers = cfg.n_layers
    tokens_t = check_tensor(file, "input_tokens", d.input_tokens.reshape(-1), (None,), floating=False)
    n_pos = len(tokens_t)
    if n_pos == 0:
        raise FormatError(f"{file}: field 'input_tokens' is empty; a graph has at least one token")
    active = check_tensor(file, "active_features", d.active_features, (None, 3), floating=False)
    selected = check_tensor(file, "selected_features", d.selected_features.reshape(-1), (None,), floating=False)
    below(file, "selected_features", selected, len(active), f"the {len(active)} active features")
    values = check_tensor(file, "activation_values", d.activation_values.reshape(-1), (len(active),))
    features, activations = active[selected].long(), values[selected].float()  # [n, 3] (layer, position, feature)
    targets = _targets(file, d.logit_targets)
    n_f, n_logits = len(features), len(targets)
    if n_logits == 0:
        raise FormatError(f"{file}: field 'logit_targets' is empty; a graph has at least one logit")
    probabilities = check_tensor(file, "logit_probabilities", d.logit_probabilities.reshape(-1), (n_logits,)).float()
    if not bool(((probabilities >= 0) & (probabilities <= 1)).all()):
        raise FormatError(f"{file}: field 'logit_probabilities' holds numbers outside [0, 1]")
    n = n_f + (n_layers + 1) * n_pos + n_logits
    adjacency = check_tensor(file, "adjacency_matrix", d.adjacency_matrix, (n, n)).float()
    below(file, "active_features (layer)", features[:, 0], n_layers, f"the file's {n_layers} layers (cfg.n_layers)")
    below(file, "active_features (position)", features[:, 1], n_pos, f"the prompt's {n_pos} tokens")
    size = transcoders.n_features if transcoders is not None else MAX_FEATURES
    below(file, "active_features (feature)", features[:, 2], size,
          f"the transcoders' {size} features" if transcoders is not None else "any transcoder's features")
    vocab = d.vocab_size or cfg.d_vocab
    tokens = tokens_t.tolist()
    if model is not None:
        vocab = _check_model(file, model, cfg, d)
    if vocab is not None:
        below(file, "input_tokens", tokens, vocab, f"the vocabulary of {vocab} tokens")
        below(file, "logit_targets (vocab_idx)", [t.vocab_idx for t in targets], vocab,
              f"the vocabulary of {vocab} tokens")
    else:
        below(file, "input_tokens", tokens, 2**31, "token ids")
        below(file, "logit_targets (vocab_idx)", [t.vocab_idx for t in targets], 2**31, "token ids")
    if model is not None and d.input_string:  # the model's own tokens of the prompt, or another tokenizer's
        made = [model.to_tokens(d.input_string, **kw).reshape(-1).tolist() for kw in ({}, {"prepend_bos": False})]
        if tokens not in made:
            raise FormatError(f"{file}: field 'input_tokens' is not this model's tokens of the prompt "
                              f"{d.input_string!r} (the file's {tokens[:8]}, the model's {made[0][:8]}): the graph "
                              "was made with another tokenizer; read it with the model it was made on")
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
    try:
        node_mask, _, _ = circuit_tracer_prune(adjacency, probabilities, n_f, n_pos, node_threshold, 0.98)
        weights = torch.zeros(len(ct_nodes))
        weights[-n_logits:] = probabilities
        influence = influence_series(normalize_rows(adjacency.double()), weights.double()).float()
        replacement, completeness = circuit_tracer_scores(adjacency, weights, n_f, n_layers * n_pos, n_pos)
    except AnalysisError as error:  # edges that form a cycle: not a graph circuit-tracer can make
        raise FormatError(f"{file}: field 'adjacency_matrix': {error}") from None
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
    scores = dict(replacement=replacement, completeness=completeness, completeness_all_nodes=completeness,
                  n_kept=int(node_mask.sum()), n_nodes=len(nodes), n_active_features=n_f)
    fields = vars(d.cfg) if isinstance(d.cfg, UnifiedConfig) else d.cfg
    plain = {k: v for k, v in fields.items() if isinstance(v, (str, int, float, bool)) or v is None}
    meta = dict(source=FORMAT_VERSION, path=str(file), scan=d.scan if isinstance(d.scan, str) else None,
                model=cfg.model_name, cfg=plain, node_threshold=node_threshold, completeness="all-nodes")
    if model is not None:
        meta.update(build_meta(model, source=FORMAT_VERSION, path=str(file), scan=meta["scan"], cfg=plain,
                               node_threshold=node_threshold, completeness="all-nodes"))
    return AttributionGraph(nodes=nodes, edges=edges, bias=torch.zeros(len(nodes)), values=edges.sum(1),
                            prompt=d.input_string or "", tokens=strings, scores=scores, meta=meta)


def _check_model(file: Path, model: Any, cfg: GraphConfig, d: GraphFile) -> Optional[int]:
    """Refuse a graph whose config is another model's than ``model``; return the model's vocabulary size."""
    facts = architecture(model)
    mine = dict(n_layers=facts["n_layers"], d_model=facts["d_model"], d_vocab=facts["d_vocab"])
    theirs = dict(n_layers=cfg.n_layers, d_model=cfg.d_model, d_vocab=d.vocab_size or cfg.d_vocab)
    differ = [k for k in mine if theirs[k] is not None and mine[k] is not None and theirs[k] != mine[k]]
    if differ:
        described = ", ".join(f"{k} {theirs[k]} vs {mine[k]}" for k in differ)
        raise FormatError(f"{file}: field 'cfg' says the graph was made on another model: {described} (the file's vs "
                          "this model's); read it with the model it was made on")
    return facts["d_vocab"]


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
