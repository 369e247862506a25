"""Attribution graphs over transcoder features for one prompt (Ameisen et al. 2025, "Circuit Tracing").

The *local replacement model* of a prompt is the model with every MLP replaced by its transcoder
plus an *error node* (the MLP's true output minus the transcoder's, held constant), attention
patterns and norm divisors frozen at their values on the prompt. It reproduces the model's
activations on that prompt exactly, and it is linear in its *sources*: token embeddings, the
active features' activations and the error nodes. So the direct effect of a source on a target
(an active feature's pre-activation, or a demeaned answer logit) is what the target moves when
that source alone is switched on from a state where every source is off; those effects plus the
all-off value (the *bias*: positional embeddings, norm and layer biases) add up to the target's
value. Each source before the last layer is one row of a batched forward through the engine,
switched on at :data:`PROBE` × its value; the last layer's features and error nodes, which reach
only the logits, get their edges from one backward per answer logit. Sums are in float64.

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
from tqdm.auto import tqdm

from arithinterp import sites as site_lib
from arithinterp.engine import Read, Write, run
from arithinterp.engine.decode import batch_size_for
from arithinterp.checks import check_belongs, prompt_tokens
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.features.transcoder import Transcoders
from arithinterp.results import Result, build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import HookedModel, IndexList, PositiveInt, PositiveProbability, checked

KINDS = ("embedding", "feature", "error", "logit")
COMPLETENESS = ("features", "all-nodes")
# A source is switched on at PROBE times its value: the frozen replacement model is affine, so the
# effect is (row − bias) / PROBE, and float32 rounding of the bias is divided by PROBE (a power of 2).
PROBE = 4096.0


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
            same for the answer logits).
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
    _saved_names = ("Graph",)  # the type name in folders written under the name circuits' layout shares

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
        from arithinterp.viz.features import plot_attribution_graph

        return plot_attribution_graph(self, **kwargs)

    def to_circuit_tracer(self, path: Union[str, Any], *, slug: Optional[str] = None, scan: Optional[str] = None,
                          node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Any:
        """Write the graph JSON circuit-tracer's ``create_graph_files`` writes (its viewer and
        Neuronpedia read it), pruned as circuit-tracer prunes; see
        :func:`arithinterp.features.graph_files.write_circuit_tracer_graph`. Returns the file's path."""
        from arithinterp.features.graph_files import write_circuit_tracer_graph

        return write_circuit_tracer_graph(self, path, slug=slug, scan=scan, node_threshold=node_threshold,
                                          edge_threshold=edge_threshold)


def _frozen(model: Any, tokens: torch.Tensor, transcoders: Transcoders) -> dict[str, Any]:
    """What the local replacement model freezes: patterns, norm divisors, MLP inputs and outputs."""
    n_layers = site_lib.n_layers(model)
    hooks = set(getattr(model, "hook_dict", {}))
    frozen_sites = [("pattern", layer) for layer in range(n_layers)]
    # the branch norms (Gemma 2 / 3) too: an attention output's norm divides it by its own rms
    frozen_sites += [(site, layer) for layer in range(n_layers)
                     for site in ("ln1_scale", "ln1_post_scale", "ln2_scale", "ln2_post_scale")
                     if site_lib.hook_name(site, layer) in hooks]
    if site_lib.hook_name("ln_final_scale") in hooks:
        frozen_sites.append(("ln_final_scale", 0))
    reads = [Read(site, layer) for site, layer in frozen_sites]
    reads += [Read(site, layer) for layer in range(n_layers) for site in ("mlp_in", "mlp_out")]
    out = run(model, tokens, reads=reads)  # the final position's logits alone
    got = dict(zip([(r.site, r.layer) for r in reads], out.reads))
    return dict(frozen={key: got[key] for key in frozen_sites}, got=got, logits=out.logits)


@checked
def attribution_graph(model: HookedModel, prompts: PromptSet, transcoders: Transcoders, *,
                      n_logits: PositiveInt = 1, node_threshold: PositiveProbability = 0.8,
                      max_nodes: PositiveInt = 100, batch_size: Optional[PositiveInt] = None,
                      labels: Optional[dict] = None, zero_positions: IndexList = (),
                      completeness: Literal["features", "all-nodes"] = "features",
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
                        max_nodes=max_nodes, batch_size=batch_size, labels=labels, zero_positions=zero_positions,
                        completeness=completeness, progress=progress)


@checked
def prompt_graph(model: HookedModel, prompt: Union[str, torch.Tensor], transcoders: Transcoders, *,
                 n_logits: PositiveInt = 1, node_threshold: PositiveProbability = 0.8,
                 max_nodes: PositiveInt = 100, batch_size: Optional[PositiveInt] = None,
                 labels: Optional[dict] = None, zero_positions: IndexList = (),
                 completeness: Literal["features", "all-nodes"] = "features",
                 progress: bool = True) -> AttributionGraph:
    """The attribution graph of one prompt given as text or token ids: the path under
    :func:`attribution_graph` for any text (a prompt that is not an arithmetic problem, one of
    circuit-tracer's). The prompt is analysed exactly as given, never cut.

    Args:
        model: The hooked model.
        prompt: A string, or token ids ``[pos]`` / ``[1, pos]``.
        transcoders: Transcoders from ``mlp_in`` to ``mlp_out`` for every layer.
        n_logits: The answer tokens (most probable first) that are the graph's outputs.
        node_threshold: Nodes are kept in order of influence until they hold this share of the total.
        max_nodes: The most nodes kept, the logits included.
        batch_size: Sources per batched forward (default: what the engine's budget allows).
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
    state = _frozen(model, tokens, transcoders)
    got, real_logits = state["got"], state["logits"][0]
    acts = [transcoders.encode(layer, got[("mlp_in", layer)][0]) for layer in range(n_layers)]  # [T, F]
    for a in acts:
        a[zeroed] = 0.0
    errors = [got[("mlp_out", layer)][0] - transcoders.decode(layer, acts[layer], got[("mlp_in", layer)][0])
              for layer in range(n_layers)]
    # zeroed positions: what their features and error write is held constant (part of the bias)
    held = [torch.zeros_like(e) for e in errors]
    for e, h in zip(errors, held):
        h[zeroed] = e[zeroed]
        e[zeroed] = 0.0
    active = [a.nonzero() for a in acts]  # [n_l, 2] (position, feature)
    top = real_logits.topk(n_logits).indices
    str_tokens = [str(t) for t in model.to_str_tokens(tokens[0])]

    # nodes: embeddings, features (by layer), errors (by layer), logits
    nodes: list[dict] = [dict(kind="embedding", layer=-1, position=p, feature=-1, activation=0.0) for p in range(T)]
    feature_start = []
    for layer in range(n_layers):
        feature_start.append(len(nodes))
        for p, f in active[layer].tolist():
            nodes.append(dict(kind="feature", layer=layer, position=p, feature=f, activation=float(acts[layer][p, f])))
    error_start = len(nodes)
    for layer in range(n_layers):
        for p in range(T):
            nodes.append(dict(kind="error", layer=layer, position=p, feature=-1,
                              activation=float(errors[layer][p].norm())))
    logit_start = len(nodes)
    for token in top.tolist():
        nodes.append(dict(kind="logit", layer=n_layers, position=T - 1, feature=int(token), activation=0.0))
    N = len(nodes)
    # the last layer's features and error nodes reach only the logits: one backward per logit gives their
    # effects; every other source gets a row of its own (0 = every source off, then one source on per row)
    last = n_layers - 1
    is_last = torch.zeros(logit_start, dtype=torch.bool)
    is_last[feature_start[last]:error_start] = True
    is_last[error_start + last * T:] = True
    on_all = torch.cat([torch.tensor([-1]), (~is_last).nonzero().squeeze(1)])
    size = batch_size or max(1, batch_size_for(model, T, plain=True))
    values = torch.zeros(len(on_all), N, dtype=torch.float64)  # each row's value of every target node
    frozen = state["frozen"]
    plans = [_plan(transcoders, layer, active[layer], acts[layer], T) for layer in range(n_layers)]
    for start in tqdm(range(0, len(on_all), size), desc="graph rows", disable=None if progress else True):
        on = on_all[start : start + size]
        values[start : start + len(on)] = _rows(model, tokens, frozen, plans, transcoders, errors, on, feature_start,
                                                error_start, T, top, held=held)
    bias = values[0]
    effects = torch.zeros(logit_start, N, dtype=torch.float64)  # [sources, N]: each source's direct effects
    effects[on_all[1:]] = (values[1:] - bias) / PROBE
    effects[is_last, logit_start:] = _last_layer_effects(model, tokens, frozen, plans[last], errors[last], top).T
    edges = torch.zeros(N, N, dtype=torch.float64)
    edges[:, :logit_start] = effects.T
    is_target = torch.zeros(N, dtype=torch.bool)
    is_target[feature_start[0]:error_start] = True
    is_target[logit_start:] = True
    edges[~is_target] = 0.0  # embeddings and errors have no incoming edges
    # a source reaches only later layers at the same or later positions; elsewhere its effect is zero
    # by construction, and anything there is rounding (rows run in batches of different sizes)
    layer_of = torch.tensor([n["layer"] for n in nodes])
    position_of = torch.tensor([n["position"] for n in nodes])
    edges[(layer_of[None, :] >= layer_of[:, None]) | (position_of[None, :] > position_of[:, None])] = 0.0
    # exactness: the model's own pre-activations and demeaned logits against edges + bias
    own = torch.zeros(N, dtype=torch.float64)
    for layer in range(n_layers):
        pre = transcoders.pre(layer, got[("mlp_in", layer)][0])
        p, f = active[layer].T
        own[feature_start[layer] : feature_start[layer] + len(p)] = pre[p, f]
    own[logit_start:] = (real_logits - real_logits.mean())[top]
    check = (edges.sum(1) + bias) - own
    is_feature_target = torch.zeros(N, dtype=torch.bool)
    is_feature_target[feature_start[0]:error_start] = True
    for i, node in enumerate(nodes):
        if node["kind"] == "logit":
            node["activation"] = float(own[i])
    scores, influence = _prune_scores(edges, nodes, real_logits, top, logit_start, error_start, node_threshold,
                                      max_nodes)
    scores["completeness"] = scores[f"completeness_{completeness.replace('-', '_')}"]
    probs = real_logits.float().softmax(-1)
    labels = labels or {}
    for i, node in enumerate(nodes):
        node["token"] = str_tokens[node["position"]] if node["kind"] != "logit" else str(
            model.to_string(torch.tensor([node["feature"]])))
        node["token_id"] = int(node["feature"]) if node["kind"] == "logit" else int(tokens[0, node["position"]])
        if node["kind"] == "logit":
            node["probability"] = float(probs[node["feature"]])
        node["influence"] = float(influence[i])
        node["label"] = labels.get((node["layer"], node["feature"]), "") if node["kind"] == "feature" else ""
    # features' pre-activations (the paper's exactness check) and, separately, the answer logits; sums in float64
    scores["max_abs_error"] = float(check[is_feature_target].abs().max()) if bool(is_feature_target.any()) else 0.0
    scores["max_abs_error_logits"] = float(check[logit_start:].abs().max())
    scores["max_rel_error_logits"] = float((check[logit_start:].abs() / own[logit_start:].abs().clamp_min(1e-6)).max())
    scores["n_active_features"] = int(error_start - feature_start[0])
    meta = build_meta(model, n_logits=n_logits, node_threshold=node_threshold, max_nodes=max_nodes,
                      zero_positions=zeroed, completeness=completeness)
    # stored in float32 (the check above is on the float64 sums)
    return AttributionGraph(nodes=nodes, edges=edges.float(), bias=bias.float(), values=own.float(),
                 prompt=model.to_string(tokens[0]), tokens=str_tokens, scores=scores, meta=meta)


def _last_layer_effects(model: Any, tokens: torch.Tensor, frozen: dict, plan: tuple, errors: torch.Tensor,
                        top: torch.Tensor) -> torch.Tensor:
    """Direct effects ``[n_top, n_active + T]`` of the last layer's active features and error nodes
    on the demeaned answer logits, from the gradient of each logit at that layer's MLP output (the
    frozen model after it is linear, so the gradient is the same with every source on or off)."""
    n = len(top)
    interventions = [Write(site, layer, value=value.expand(n, *value.shape[1:]))
                     for (site, layer), value in frozen.items()]
    last = site_lib.n_layers(model) - 1

    def metric(final: torch.Tensor) -> torch.Tensor:  # row i: the demeaned logit of answer token top[i]
        return (final - final.mean(-1, keepdim=True))[torch.arange(n), top]

    out = run(model, tokens.expand(n, -1), interventions, [Read("mlp_out", last)], logits="final", metric=metric)
    assert out.grads is not None and out.grads[0] is not None
    grad = out.grads[0].double()  # [n, T, d]
    _, _, positions, _, writes = plan
    features = (grad[:, positions] * writes.double()[None]).sum(-1)
    return torch.cat([features, (grad * errors.double()[None]).sum(-1)], 1)


def _plan(transcoders: Transcoders, layer: int, active: torch.Tensor, acts: torch.Tensor, T: int) -> tuple:
    """What a layer's rows need, once per graph: the active features' encoder columns padded per
    position (``W_pad [T, d, k]``, ``b_pad [T, k]``), each active feature's ``positions`` and ``slots``
    in that padding, and what each writes when on (``writes [n_active, d]``: activation × decoder row)."""
    i = transcoders.index(layer)
    positions, features = active.T
    counts = torch.bincount(positions, minlength=T)
    first = torch.cumsum(counts, 0) - counts
    slots = torch.arange(len(positions)) - first[positions]  # nonzero() lists features position by position
    width = max(1, int(counts.max()) if len(counts) else 1)
    W_pad = torch.zeros(T, transcoders.W_enc.shape[1], width, dtype=transcoders.W_enc.dtype)
    b_pad = torch.zeros(T, width, dtype=transcoders.b_enc.dtype)
    W_pad[positions, :, slots] = transcoders.W_enc[i][:, features].T
    b_pad[positions, slots] = transcoders.b_enc[i][features]
    writes = acts[positions, features][:, None] * transcoders.W_dec[i][features]
    return W_pad, b_pad, positions, slots, writes


def _rows(model: Any, tokens: torch.Tensor, frozen: dict, plans: list, transcoders: Transcoders, errors: list,
          on: torch.Tensor, feature_start: list, error_start: int, T: int, top: torch.Tensor,
          held: Optional[list] = None) -> torch.Tensor:
    """Target values ``[r, N]`` of the frozen replacement model with, in row ``i``, only source
    ``on[i]`` switched on (``-1``: none). Targets: active features' pre-activations, demeaned logits."""
    r = len(on)
    n_layers = len(plans)
    embed_on = torch.zeros(r, T)
    rows_with = (on >= 0) & (on < T)
    embed_on[rows_with, on[rows_with]] = PROBE
    interventions = [Write(site, layer, value=value.expand(r, *value.shape[1:]))
                     for (site, layer), value in frozen.items()]
    interventions.append(Write("embed", 0, value=lambda e: e * embed_on[..., None].to(e.dtype)))
    pres: list = [None] * n_layers
    rows = torch.arange(r)
    for layer in range(n_layers):
        start = feature_start[layer]
        which = (on >= start) & (on < start + len(plans[layer][2]))
        feature_rows, feature_local = rows[which], on[which] - start
        first_error = error_start + layer * T
        which = (on >= first_error) & (on < first_error + T)
        error_rows, error_positions = rows[which], on[which] - first_error

        def value(x: torch.Tensor, layer: int = layer, plan: tuple = plans[layer],
                  on_rows: tuple = (feature_rows, feature_local, error_rows, error_positions)) -> torch.Tensor:
            W_pad, b_pad, positions, slots, writes = plan
            feature_rows, feature_local, error_rows, error_positions = on_rows
            # the active features' pre-activations only, position by position: [r, n_active]
            pre = torch.einsum("rtd,tdk->rtk", x, W_pad.to(x.dtype)) + b_pad.to(x.dtype)
            pres[layer] = pre[:, positions, slots]
            out = transcoders.linear(layer, x).clone()  # every feature and error off, then each row's one source
            if held is not None:
                out += held[layer].to(out.dtype)
            out[feature_rows, positions[feature_local]] += PROBE * writes[feature_local].to(out.dtype)
            out[error_rows, error_positions] += PROBE * errors[layer][error_positions].to(out.dtype)
            return out

        interventions.append(Write("mlp_out", layer, value=value, input_site="mlp_in"))
    logits = run(model, tokens.expand(r, -1), interventions, logits="final").logits
    assert logits is not None
    demeaned = (logits - logits.mean(-1, keepdim=True))[:, top]
    n_nodes = error_start + n_layers * T + len(top)
    out = torch.zeros(r, n_nodes, dtype=torch.float64)
    for layer in range(n_layers):
        out[:, feature_start[layer] : feature_start[layer] + pres[layer].shape[1]] = pres[layer].float()
    out[:, n_nodes - len(top):] = demeaned
    return out


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
