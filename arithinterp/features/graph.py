"""Attribution graphs over transcoder features for one prompt (Ameisen et al. 2025, "Circuit Tracing").

:mod:`~arithinterp.features.attribution` computes the direct effects in the prompt's local
replacement model (every source's effect on the answer logits and on up to ``max_feature_nodes``
features chosen by influence); this module makes them a graph: the nodes kept are the token
embeddings, the expanded features, the error nodes and the answer logits (features not expanded
are left out with their edges, as circuit-tracer leaves them out), then pruned and scored.
The exactness check (edges + bias against each target's own value) is made over every source,
before those features are left out.

Pruning follows the paper: edges are made non-negative and each target's incoming edges
normalised to sum to 1 (``A``); a node's *influence* on the answer is ``w · (A + A² + …)`` with ``w``
the answer logits' probabilities; nodes (features, error nodes and embeddings) are kept in order
of influence until they hold ``node_threshold`` of the total (at most ``max_nodes`` with the
logits). The *replacement score* is the share of the answer's end-to-end influence that comes
from token embeddings rather than error nodes; *completeness* is the influence-weighted share of
the nodes' incoming edges that come from non-error nodes.

Two options follow circuit-tracer (``circuit_tracer`` 0.5.0, ``attribute`` and
``compute_graph_scores``): ``zero_positions`` — circuit-tracer zeroes the features and the error
nodes at position 0 (``<bos>``) by default: their MLP output is held constant (it joins the
bias), so they have no node of their own; ``zero_positions=(0,)`` does the same here (the default
here zeroes nothing). ``completeness`` — ``"features"`` (the default) averages the non-error share
of incoming edges over the feature and logit nodes, weighted by influence (logits by their
probability); ``"all-nodes"`` is circuit-tracer's: the average over *every* node, weighted by
influence plus the logit weights, where embedding and error nodes, which have no incoming edges,
count as complete. ``scores`` holds both (``completeness_features``, ``completeness_all_nodes``);
``scores["completeness"]`` is the one asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Union

import pandas as pd
import torch

from arithinterp import sites as site_lib
from arithinterp.checks import check_belongs, prompt_tokens
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.features.attribution import attribute
from arithinterp.features.cache import require_transcoders
from arithinterp.features.transcoder import Transcoders
from arithinterp.results import Relation, Result, build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import HookedModel, IndexList, PositiveInt, PositiveProbability, checked

KINDS = ("embedding", "feature", "error", "logit")
COMPLETENESS = ("features", "all-nodes")
# The default cap on the features whose incoming edges are computed (circuit-tracer's max_feature_nodes).
MAX_FEATURE_NODES = 1000


@dataclasses.dataclass(frozen=True)
class AttributionGraph(Result):
    """An attribution graph of one prompt.

    Attributes:
        nodes: One dict per node: ``kind`` in :data:`KINDS`, ``layer`` (-1 for embeddings, the
            number of layers for logits), ``position``, ``feature`` (the token id for logit nodes, -1
            otherwise), ``activation`` (a feature's activation, an error node's norm, a logit's
            demeaned value), ``token`` (the token at the position; the answer token for logits),
            ``token_id``, ``influence``, ``kept``, ``label``; logits also ``probability``.
        edges (Float[Tensor, "node node"]): ``edges[t, s]`` the direct effect of node ``s`` on node
            ``t`` (targets: features and logits).
        bias (Float[Tensor, "node"]): Each target's value with every source off.
        values (Float[Tensor, "node"]): Each target's own value (a feature's pre-activation, a
            logit's demeaned value; 0 for sources).
        prompt: The prompt's text.
        tokens: The prompt's token strings.
        scores: ``replacement``, ``completeness``, ``kept_influence`` (of the pruned graph),
            ``max_abs_error`` (the exactness check: incoming edges + bias against each active
            feature's own pre-activation), ``max_abs_error_logits`` / ``max_rel_error_logits`` (the
            same for the answer logits), ``max_error_of_terms`` (the largest error over every
            target as a share of the absolute sum of its terms, edges and bias: float rounding, measured
            7e-7 to 4e-5 in float32), ``n_active_features`` and
            ``n_expanded_features`` (those whose incoming edges were computed).
        meta: Provenance and the graph's settings.
    """

    nodes: list
    edges: torch.Tensor
    bias: torch.Tensor
    values: torch.Tensor
    prompt: str
    tokens: list
    scores: dict
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"nodes": "node", "edges": "node node", "bias": "node", "values": "node"}
    _relations = (Relation("nodes", "nodes whose positions lie within the prompt's tokens", lambda v: all(
        0 <= node["position"] < len(v["tokens"]) for node in v["nodes"])),)

    def to_frame(self, kept_only: bool = False) -> pd.DataFrame:
        """One row per edge with a non-zero weight: source and target nodes, weight (``kept_only``:
        between kept nodes)."""
        nodes = pd.DataFrame(self.nodes)
        t, s = self.edges.nonzero(as_tuple=True)
        frame = pd.DataFrame(dict(target=t.tolist(), source=s.tolist(), weight=self.edges[t, s].tolist()))
        for end in ("source", "target"):
            for column in ("kind", "layer", "position", "feature", "label"):
                frame[f"{end}_{column}"] = nodes[column].to_numpy()[frame[end].to_numpy()]
        if kept_only:
            kept = nodes["kept"].to_numpy()
            frame = pd.DataFrame(frame[kept[frame["source"].to_numpy()] & kept[frame["target"].to_numpy()]])
        return frame.reset_index(drop=True)

    def node_frame(self) -> pd.DataFrame:
        """One row per node."""
        return pd.DataFrame(self.nodes)

    def plot(self, **kwargs: Any):
        return draw(self, **kwargs)

    def show(self, **options: Any) -> Any:
        """The graph's interactive page (an inline frame in a notebook; no server): nodes by layer ×
        position, a pruning slider, details on click, supernodes, paths on hover. ``options``: those of
        :func:`arithinterp.viz.graph_view.view_graph` (``labels``, ``supernodes``, ``grids``, ``max_links``).
        Returns a :class:`~arithinterp.viz.graph_view.GraphView`."""
        return draw(self, "show", **options)

    def to_html(self, path: Union[str, Any], *, overwrite: bool = False, **options: Any) -> Any:
        """Write the graph's interactive page (:meth:`show`) to one offline HTML file, refusing an
        existing one unless ``overwrite``. Returns the file's path."""
        return self.show(**options).to_html(path, overwrite=overwrite)


@checked
def attribution_graph(model: HookedModel, prompts: PromptSet, transcoders: Optional[Transcoders] = None, *,
                      n_logits: PositiveInt = 1, node_threshold: PositiveProbability = 0.8,
                      max_nodes: PositiveInt = 100, max_feature_nodes: Optional[PositiveInt] = MAX_FEATURE_NODES,
                      batch_size: Optional[PositiveInt] = None, labels: Optional[dict] = None,
                      zero_positions: IndexList = (), completeness: Literal["features", "all-nodes"] = "features",
                      progress: bool = True) -> AttributionGraph:
    """The attribution graph of one prompt over transcoders (one per layer), with the top answer
    tokens at the final position as its outputs (:func:`graph_sample` draws one per prompt of a
    set; :func:`prompt_graph` takes a text or token ids instead of a prompt set).

    Args:
        model: The hooked model.
        prompts: A prompt set of one prompt (``prompts[i:i + 1]`` picks one), analysed without its
            padding.
        transcoders: As for :func:`prompt_graph`.
        n_logits: As for :func:`prompt_graph`.
        node_threshold: As for :func:`prompt_graph`.
        max_nodes: As for :func:`prompt_graph`.
        max_feature_nodes: As for :func:`prompt_graph`.
        batch_size: As for :func:`prompt_graph`.
        labels: As for :func:`prompt_graph`.
        zero_positions: As for :func:`prompt_graph`.
        completeness: As for :func:`prompt_graph`.
        progress: As for :func:`prompt_graph`.

    Returns:
        The pruned graph: its nodes, edges, replacement and completeness scores.

    Raises:
        ConfigError: A prompt set of more or fewer than one prompt.
        AnalysisError: Transcoders that do not map ``mlp_in`` to ``mlp_out``.
        ModelMismatchError: Prompts or transcoders made for another model.
    """
    check_belongs(model, "features.attribution_graph", prompts=prompts)
    if len(prompts) != 1:
        raise ConfigError(f"attribution_graph draws the graph of one prompt, got {len(prompts)}; pass prompts[i:i + 1] "
                          "for the i-th, or use graph_sample for one graph per prompt")
    tokens = prompts.unpadded(torch.arange(1))[0]
    return prompt_graph(model, tokens, transcoders, n_logits=n_logits, node_threshold=node_threshold,
                        max_nodes=max_nodes, max_feature_nodes=max_feature_nodes, batch_size=batch_size,
                        labels=labels, zero_positions=zero_positions, completeness=completeness, progress=progress)


@checked
def prompt_graph(model: HookedModel, prompt: Union[str, torch.Tensor], transcoders: Optional[Transcoders] = None, *,
                 n_logits: PositiveInt = 1, node_threshold: PositiveProbability = 0.8,
                 max_nodes: PositiveInt = 100, max_feature_nodes: Optional[PositiveInt] = MAX_FEATURE_NODES,
                 batch_size: Optional[PositiveInt] = None, labels: Optional[dict] = None,
                 zero_positions: IndexList = (), completeness: Literal["features", "all-nodes"] = "features",
                 progress: bool = True) -> AttributionGraph:
    """The attribution graph of one prompt given as text or token ids: the path under
    :func:`attribution_graph` for any text (a prompt that is not an arithmetic problem, one of
    circuit-tracer's). The prompt is analysed exactly as given, never cut.

    Args:
        model: The hooked model.
        prompt: A string, or token ids ``[pos]`` / ``[1, pos]``.
        transcoders: Transcoders from ``mlp_in`` to ``mlp_out`` for every layer (default: the model's
            shipped or cached ones, :func:`~arithinterp.features.cache.find_transcoders`).
        n_logits: The answer tokens (most probable first) that are the graph's outputs.
        node_threshold: Nodes are kept in order of influence until they hold this share of the total.
        max_nodes: The most nodes kept, the logits included.
        max_feature_nodes: The most active features whose incoming edges are computed, chosen by
            their influence on the answer (circuit-tracer's ``max_feature_nodes``); the others are
            left out of the graph. ``None``: every active feature.
        batch_size: Targets per batched backward (default: 32, fewer where their gradients would pass 64 MiB).
        labels: ``{(layer, feature): text}`` shown on feature nodes.
        zero_positions: Positions whose features and error nodes are held constant (``(0,)`` as
            circuit-tracer does).
        completeness: Which definition ``scores["completeness"]`` uses, one of :data:`COMPLETENESS`
            (see the module docstring).
        progress: Show a progress bar.

    Returns:
        The pruned graph: its nodes, edges, replacement and completeness scores.

    Raises:
        TokenizationError: An empty prompt, one with pieces the tokenizer does not know, or one
            longer than the model's context.
        AnalysisError: Transcoders that do not map ``mlp_in`` to ``mlp_out``.
        ModelMismatchError: Transcoders made for another model.
    """
    transcoders = require_transcoders(model) if transcoders is None else transcoders
    transcoders.check_model(model)
    if (transcoders.input_site, transcoders.output_site) != ("mlp_in", "mlp_out"):
        raise AnalysisError(f"an attribution graph needs transcoders from mlp_in to mlp_out; these read "
                            f"{transcoders.input_site} and write {transcoders.output_site}")
    n_layers = site_lib.n_layers(model)
    if sorted(transcoders.layers) != list(range(n_layers)):
        raise AnalysisError(f"an attribution graph needs a transcoder for every layer 0..{n_layers - 1}; "
                            f"these cover {transcoders.layers}")
    tokens = prompt_tokens(model, prompt, "prompt_graph")
    T = int(tokens.shape[1])
    vocab = int(model.W_U.shape[-1])
    if n_logits > vocab:
        raise ConfigError(f"n_logits={n_logits} is more answer tokens than the vocabulary's {vocab}")
    zeroed = list(zero_positions)
    if any(not p < T for p in zeroed):
        raise ConfigError(f"zero_positions must be positions in 0..{T - 1}, got {zero_positions!r}")
    found = attribute(model, tokens, transcoders, n_logits=n_logits, zero_positions=zeroed,
                      max_feature_nodes=max_feature_nodes, batch_size=batch_size, progress=progress)
    rows, row_node, n_sources = found.rows, found.targets, found.n_sources
    real_logits, top = found.logits, torch.tensor([n["feature"] for n in found.nodes[n_sources:]])
    # exactness, over every source (before the features not expanded are left out): the features'
    # pre-activations (the paper's check) and, separately, the answer logits; sums in float64
    check = (rows.sum(1) + found.bias - found.values).abs()
    is_logit_row = row_node >= n_sources
    terms = rows.abs().sum(1) + found.bias.abs()  # what float rounding of the sum scales with
    exactness = dict(
        max_abs_error=float(check[~is_logit_row].max()) if bool((~is_logit_row).any()) else 0.0,
        max_abs_error_logits=float(check[is_logit_row].max()),
        max_rel_error_logits=float((check / found.values.abs().clamp_min(1e-6))[is_logit_row].max()),
        max_error_of_terms=float((check / terms.clamp_min(1e-30)).max()),
        n_active_features=sum(n["kind"] == "feature" for n in found.nodes),
        n_expanded_features=int((~is_logit_row).sum()),
    )
    exactness.update(logit_inputs(found, real_logits.float().softmax(-1)[top]))

    # the graph: embeddings, the expanded features in node order, errors, logits
    error_start = next(i for i, n in enumerate(found.nodes) if n["kind"] == "error")
    kept_sources = torch.cat([torch.arange(T), row_node[~is_logit_row].sort().values,
                              torch.arange(error_start, n_sources)])
    keep = torch.cat([kept_sources, torch.arange(n_sources, len(found.nodes))])
    at = torch.full((len(found.nodes),), -1, dtype=torch.long)
    at[keep] = torch.arange(len(keep))
    nodes = [found.nodes[i] for i in keep.tolist()]
    N, logit_start = len(nodes), len(kept_sources)
    edges = torch.zeros(N, N, dtype=torch.float64)
    edges[at[row_node], :logit_start] = rows[:, kept_sources]
    bias, own = torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    bias[at[row_node]], own[at[row_node]] = found.bias, found.values
    for i in range(logit_start, N):
        nodes[i]["activation"] = float(own[i])
    scores, influence = _prune_scores(edges, nodes, real_logits, top, logit_start, logit_start - n_layers * T,
                                      node_threshold, max_nodes)
    scores["completeness"] = scores[f"completeness_{completeness.replace('-', '_')}"]
    scores.update(exactness)
    probs = real_logits.float().softmax(-1)
    str_tokens = [str(t) for t in model.to_str_tokens(tokens[0])]
    labels = labels or {}
    for i, node in enumerate(nodes):
        node["token"] = str_tokens[node["position"]] if node["kind"] != "logit" else str(
            model.to_string(torch.tensor([node["feature"]])))
        node["token_id"] = int(node["feature"]) if node["kind"] == "logit" else int(tokens[0, node["position"]])
        if node["kind"] == "logit":
            node["probability"] = float(probs[node["feature"]])
        node["influence"] = float(influence[i])
        node["label"] = labels.get((node["layer"], node["feature"]), "") if node["kind"] == "feature" else ""
    meta = build_meta(model, n_logits=n_logits, node_threshold=node_threshold, max_nodes=max_nodes,
                      max_feature_nodes=max_feature_nodes, zero_positions=zeroed, completeness=completeness)
    # stored in float32 (the check above is on the float64 sums)
    return AttributionGraph(nodes=nodes, edges=edges.float(), bias=bias.float(), values=own.float(),
                            prompt=model.to_string(tokens[0]), tokens=str_tokens, scores=scores, meta=meta)


def logit_inputs(found: Any, probabilities: torch.Tensor) -> dict[str, float]:
    """What feeds the answer logits directly, by node kind: the absolute edges into each logit node
    from token embeddings, features (every active one, expanded or not) and error nodes, as shares of
    all of them, averaged over the logits weighted by their probability.

    Args:
        found: The :class:`~arithinterp.features.attribution.Attribution` of the prompt.
        probabilities (Float[Tensor, "logit"]): Each answer logit's probability.

    Returns:
        ``logit_inputs_embedding``, ``logit_inputs_feature`` and ``logit_inputs_error``, summing to 1.
    """
    n_sources = found.n_sources
    logit_rows = (found.targets >= n_sources).nonzero().squeeze(1)
    sizes = found.rows[logit_rows].abs()  # [logit, source]
    sizes = sizes / sizes.sum(1, keepdim=True).clamp_min(1e-30)
    weight = (probabilities / probabilities.sum()).double()
    kinds = [node["kind"] for node in found.nodes[:n_sources]]
    return {f"logit_inputs_{kind}": float(weight @ sizes[:, torch.tensor([k == kind for k in kinds])].sum(1))
            for kind in ("embedding", "feature", "error")}


def _prune_scores(edges: torch.Tensor, nodes: list, logits: torch.Tensor, top: torch.Tensor, logit_start: int,
                  error_start: int, node_threshold: float, max_nodes: int) -> tuple[dict, torch.Tensor]:
    """Influence of every node on the answer logits, pruning (sets ``node["kept"]``) and the scores."""
    N = edges.shape[0]
    A = edges.abs()
    totals = A.sum(1, keepdim=True)
    A = torch.where(totals > 0, A / totals.clamp_min(1e-30), torch.zeros_like(A))
    w = torch.zeros(N, dtype=torch.float64)
    probs = logits.softmax(-1)[top].double()
    w[logit_start:] = probs / probs.sum()
    # w (A + A² + …): edges only go to later layers, so the series ends after one term per layer
    influence, reach = torch.zeros(N, dtype=torch.float64), w
    while bool(reach.any()):
        reach = reach @ A
        influence += reach
    influence = influence.float()  # [N]
    kinds = [n["kind"] for n in nodes]
    is_feature = torch.tensor([k == "feature" for k in kinds])
    is_error = torch.tensor([k == "error" for k in kinds])
    is_embed = torch.tensor([k == "embedding" for k in kinds])
    # every node but the logits competes for the budget: long prompts have many embedding and error nodes
    is_source = torch.arange(N) < logit_start
    order = torch.argsort(torch.where(is_source, influence, torch.full_like(influence, -1.0)), descending=True)
    total = float(influence[is_source].sum())
    kept = ~is_source
    running, n_kept = 0.0, 0
    budget = max(0, max_nodes - int((~is_source).sum()))
    for i in order[: int(is_source.sum())].tolist():
        if total <= 0 or running >= node_threshold * total or n_kept >= budget:
            break
        kept[i] = True
        running += float(influence[i])
        n_kept += 1
    for i, node in enumerate(nodes):
        node["kept"] = bool(kept[i])
    end_to_end = float(influence[is_embed].sum() + influence[is_error].sum())
    target_weight = influence.clone()
    target_weight[logit_start:] = w[logit_start:].float()
    is_target = is_feature | (torch.arange(N) >= logit_start)
    non_error = 1 - A[:, is_error].sum(1)
    completeness = float((target_weight * non_error)[is_target].sum() / target_weight[is_target].sum())
    # circuit-tracer's: every node, weighted by influence plus the logit weights (nodes with no incoming edges count 1)
    output_influence = influence.double() + w
    all_nodes = float((non_error * output_influence).sum() / output_influence.sum())
    scores = dict(
        replacement=float(influence[is_embed].sum()) / end_to_end if end_to_end > 0 else float("nan"),
        completeness=completeness,
        completeness_features=completeness,
        completeness_all_nodes=all_nodes,
        kept_influence=running / total if total > 0 else 1.0,
        n_kept=int(kept.sum()),
        n_nodes=N,
    )
    return scores, influence
