"""MLP neurons as nodes of the edge-attribution graph: senders and receivers.

An MLP's output is the sum of its neurons' outputs, ``post_n · W_out[n]`` (plus a bias that is
the same in every run), so each neuron is a sender of its own: the edge ``MLP{l}N{n} → r`` is the
neuron's output carried into receiver ``r``, and the MLP's edge ``MLP{l} → r`` is the sum of its
neurons' edges. Attribution (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024) scores it with the
gradient at ``r``'s input that :func:`~arithinterp.circuits.edges.attribute_edges` already takes:

    score(MLP{l}N{n} → r, p) = Σ_t∈p (source − base)post_n[t] · (W_out[n] · ∂metric/∂input_r[t]).

The neurons' activations (``mlp_post``) are read by the engine (:func:`arithinterp.engine.run`).
With a norm on the MLP's output (Gemma 2 and 3), frozen at each run's own denominator ``f`` as the
edge engine freezes it (:mod:`arithinterp.engine.branch_norms`), a neuron's output in a run is
``post_n / f · (W_out[n] ⊙ g)``, so ``(source − base)post_n`` above reads
``post_n / f`` of the source run minus that of the base run, and ``W_out[n]`` reads ``W_out[n] ⊙ g``.

A neuron is also a receiver: its pre-activation (and gate) reads ``ln2`` of the MLP's input, the
sum of the upstream senders' outputs, so the edge ``s → MLP{l}N{n}`` changes that neuron's own
copy of the input (:mod:`arithinterp.engine.neuron_inputs`). Attribution scores it with the
gradient at that copy, ``g_n``; :func:`patch_neuron_edges` patches it exactly:

    score(s → MLP{l}N{n}, p) = Σ_t∈p (source − base)_s[t] · g_n[t]
    score(MLP{k}N{m} → MLP{l}N{n}, p) = Σ_t∈p (source − base)post_m[t] · (W_out[m] · g_n[t])   (k < l)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence, Union


import torch

from arithinterp.checks import check_belongs, check_choice, check_pairs
from arithinterp.engine import Read
from arithinterp.engine import run as engine_run
from arithinterp.engine.branch_norms import BranchNorms
from arithinterp.engine.budget import chunk_for, memory_budget
from arithinterp.engine.edges import EdgeForward, edge_run_bytes, sender_outputs
from arithinterp.engine.neuron_inputs import NeuronInputs
from arithinterp.errors import AnalysisError, SiteError
from arithinterp.metrics import DIRECTIONS, metric_context, metric_fn
from arithinterp.progress import progress_bar
from arithinterp.types import ByteSize, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.circuits.graph import EdgeGraph
    from arithinterp.tasks import PromptPairs
    from arithinterp.types import HookedModel


def check_neurons(model: HookedModel, graph: EdgeGraph,
                  neurons: Mapping[int, Union[str, Sequence[int]]]) -> list[tuple[int, int]]:
    """``{layer: neuron ids or "all"}`` as a sorted list of ``(layer, neuron)`` senders."""
    if not isinstance(neurons, Mapping) or not neurons:
        raise AnalysisError("neurons must be a non-empty dict {layer: [neuron ids] or 'all'}, "
                            f"e.g. {{0: [3, 17]}}; got {neurons!r}")
    if not graph.layout.has_mlp:
        raise SiteError("this model has no MLPs, so it has no neurons to score")
    d_mlp = int(model.cfg.d_mlp)
    out = []
    for layer, ids in neurons.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < graph.layout.n_layers:
            raise SiteError(f"neuron layer {layer!r} is not a layer of this model; accepted: "
                            f"0..{graph.layout.n_layers - 1}")
        chosen = list(range(d_mlp)) if ids == "all" else list(ids) if isinstance(ids, (list, tuple, range)) else None
        if chosen is None or not chosen:
            raise AnalysisError(f"neurons[{layer}] must be 'all' or a non-empty list of neuron ids, got {ids!r}")
        for n in chosen:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < d_mlp:
                raise SiteError(f"neuron {n!r} of layer {layer} does not exist; accepted: 0..{d_mlp - 1}")
        if len(set(chosen)) != len(chosen):
            raise AnalysisError(f"neurons[{layer}] names a neuron more than once: {chosen}")
        out += [(layer, n) for n in chosen]
    return sorted(out)


def neuron_edges(graph: EdgeGraph, senders: Sequence[tuple[int, int]]) -> tuple[list[str], torch.Tensor]:
    """Names of every neuron edge and its index ``[E, 3]`` (position, receiver, neuron sender):
    each neuron into every receiver downstream of its MLP, at every position of ``graph``."""
    L = graph.layout
    names, rows = [], []
    for p, label in enumerate(graph.positions):
        for r, (node, channel, _unit) in enumerate(graph.receivers):
            n_up = L.senders_before(node.layer, channel)
            target = f"{node.name}.{channel}" if channel in ("q", "k", "v") else node.name
            for k, (layer, n) in enumerate(senders):
                if L.mlp_sender(layer) < n_up:
                    rows.append((p, r, k))
                    names.append(f"MLP{layer}N{n}->{target}" + ("" if label is None else f"@{label}"))
    return names, torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


def _w_out(model: HookedModel, layer: int) -> torch.Tensor:
    """The MLP's output weight ``[d_mlp, d_model]``."""
    try:
        return model.blocks[layer].mlp.W_out.detach().float()
    except AttributeError:
        return model.W_out[layer].detach().float()


def neuron_post(model: HookedModel, tokens: torch.Tensor, layers: Sequence[int]) -> dict:
    """``{layer: mlp_post [B, T, d_mlp]}`` of one forward (read by the engine)."""
    with torch.inference_mode():
        out = engine_run(model, tokens, reads=[Read("mlp_post", layer) for layer in layers], logits="none")
    return {layer: x.float() for layer, x in zip(layers, out.reads)}


def _neuron_change(model: HookedModel, layer: int, ids: torch.Tensor, base: torch.Tensor, source: torch.Tensor,
                   scales: Optional[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The neurons ``ids`` of ``layer`` as senders: ``(change [B, T, n], direction [n, d_model])``, whose
    product is each neuron's source − base output. ``base`` / ``source``: ``mlp_post [B, T, d_mlp]``;
    ``scales``: both runs' branch-norm denominators ``[B, T, n_layers, 2]`` (None: no branch norms)."""
    direction = _w_out(model, layer)[ids]
    norms = None if scales is None else BranchNorms.of(model)
    if scales is None or norms is None or not norms.has(layer, "mlp"):
        return (source - base)[..., ids], direction
    f_base, f_source = (s[:, :, layer, 1, None].to(base.device) for s in scales)
    return (source[..., ids] / f_source - base[..., ids] / f_base), direction * norms.gain[layer, "mlp"]


def neuron_scores(model: HookedModel, graph: EdgeGraph, senders: Sequence[tuple[int, int]], index: torch.Tensor,
                  gradient: Callable[[int], torch.Tensor], base_tokens: torch.Tensor, source_tokens: torch.Tensor,
                  onehot: torch.Tensor, post: Optional[tuple[dict, dict]] = None,
                  scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Scores ``[B, E]`` of one batch's neuron edges (``index`` from :func:`neuron_edges`).

    ``gradient(layer)`` is the (averaged) gradient at every receiver input ``[B, T, R, d]`` that
    scores the senders of that layer's MLP; ``onehot [P, B, T]`` the graph's positions;
    ``scales`` the base and source runs' branch-norm denominators ``[B, T, n_layers, 2]`` (from
    :func:`~arithinterp.engine.edges.sender_outputs`; required on a model with branch norms).
    """
    layers = sorted({layer for layer, _ in senders})
    base, source = post if post is not None else (neuron_post(model, base_tokens, layers),
                                                  neuron_post(model, source_tokens, layers))
    B = base_tokens.shape[0]
    out = torch.zeros(B, len(index))
    for layer in layers:
        ks = [k for k, (l, _) in enumerate(senders) if l == layer]
        ids = torch.tensor([senders[k][1] for k in ks])
        g = gradient(layer)
        change, direction = _neuron_change(model, layer, ids, base[layer], source[layer], scales)
        diff = change.to(g.device)  # [B, T, n]
        along = torch.einsum("btrd,nd->btrn", g, direction.to(g.device))  # W_out[n] · grad
        per = torch.einsum("btn,btrn,pbt->bprn", diff, along, onehot.to(g.device))  # [B, P, R, n]
        local = torch.full((len(senders),), -1, dtype=torch.long)
        local[torch.tensor(ks)] = torch.arange(len(ks))
        rows = torch.nonzero(local[index[:, 2]] >= 0).flatten()
        p, r, k = index[rows].T
        out[:, rows] = per[:, p, r, local[k]].cpu()
    return out


# --- neurons as receivers --------------------------------------------------------------------------


def neuron_inputs(model: HookedModel, receivers: Sequence[tuple[int, int]]) -> NeuronInputs:
    """The engine's view of the receiver neurons ``[(layer, neuron)]`` (in that sorted order)."""
    by_layer: dict = {}
    for layer, n in receivers:
        by_layer.setdefault(layer, []).append(n)
    return NeuronInputs(model, by_layer)


def neuron_receiver_edges(graph: EdgeGraph, receivers: Sequence[tuple[int, int]],
                          senders: Sequence[tuple[int, int]] = ()) -> tuple[list[str], torch.Tensor]:
    """Names of every edge into a receiver neuron and its index ``[E, 4]`` (position, receiver
    neuron, graph sender or −1, neuron sender or −1): from each sender of ``graph`` upstream of the
    neuron's MLP (embeddings, heads, earlier MLPs) and from each neuron of ``senders`` in an
    earlier MLP, at every position of ``graph``."""
    L = graph.layout
    names, rows = [], []
    for p, label in enumerate(graph.positions):
        at = "" if label is None else f"@{label}"
        for k, (layer, n) in enumerate(receivers):
            n_up = L.senders_before(layer, "mlp")
            for s in range(n_up):
                rows.append((p, k, s, -1))
                names.append(f"{graph.senders[s].name}->MLP{layer}N{n}{at}")
            for j, (sl, sn) in enumerate(senders):
                if L.mlp_sender(sl) < n_up:
                    rows.append((p, k, -1, j))
                    names.append(f"MLP{sl}N{sn}->MLP{layer}N{n}{at}")
    return names, torch.tensor(rows, dtype=torch.long).reshape(-1, 4)


def neuron_receiver_scores(model: HookedModel, receivers: Sequence[tuple[int, int]],
                           senders: Sequence[tuple[int, int]], index: torch.Tensor, gradient: torch.Tensor,
                           diff: torch.Tensor, onehot: torch.Tensor, post: Optional[tuple[dict, dict]] = None,
                           scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Scores ``[B, E]`` of one batch's edges into receiver neurons (``index`` from
    :func:`neuron_receiver_edges`): ``gradient`` ``[B, T, K, d]`` at each receiver neuron's input,
    ``diff`` ``[B, T, S, d]`` the graph senders' source − base outputs, ``onehot`` ``[P, B, T]``,
    ``post`` the base and source ``mlp_post`` of the sender neurons' layers, ``scales`` both runs'
    branch-norm denominators (as in :func:`neuron_scores`)."""
    g = gradient.float()
    onehot = onehot.to(g.device)
    per = torch.einsum("btkd,btsd,pbt->bpks", g, diff.float().to(g.device), onehot)  # [B, P, K, S]
    out = torch.zeros(g.shape[0], len(index))
    rows = torch.nonzero(index[:, 2] >= 0).flatten()
    p, k, s = index[rows, 0], index[rows, 1], index[rows, 2]
    out[:, rows] = per[:, p, k, s].cpu()
    if senders and bool((index[:, 3] >= 0).any()):
        assert post is not None, "neuron senders need their activations"
        base, source = post
        for layer in sorted({sl for sl, _ in senders}):
            js = [j for j, (sl, _) in enumerate(senders) if sl == layer]
            ids = torch.tensor([senders[j][1] for j in js])
            change, direction = _neuron_change(model, layer, ids, base[layer], source[layer], scales)
            change = change.to(g.device)  # [B, T, m]
            along = torch.einsum("btkd,md->btkm", g, direction.to(g.device))
            per_n = torch.einsum("btm,btkm,pbt->bpkm", change, along, onehot)  # [B, P, K, m]
            local = torch.full((len(senders),), -1, dtype=torch.long)
            local[torch.tensor(js)] = torch.arange(len(js))
            rows = torch.nonzero((index[:, 3] >= 0) & (local[index[:, 3].clamp_min(0)] >= 0)).flatten()
            p, k, j = index[rows, 0], index[rows, 1], index[rows, 3]
            out[:, rows] = per_n[:, p, k, local[j]].cpu()
    return out


@checked
def patch_neuron_edges(
    model: HookedModel,
    pairs: PromptPairs,
    graph: Optional[EdgeGraph] = None,
    metric: Union[str, Callable] = "logit_diff",
    direction: str = "denoise",
    *,
    neurons: Mapping[int, Union[str, Sequence[int]]],
    edges: Optional[Sequence[str]] = None,
    batch_cells: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    progress: bool = True,
) -> dict:
    """Exact path patching of each edge into an MLP neuron alone (Wang et al. 2023): the base run
    with the source run's sender output carried into that one neuron's own input, every other
    neuron and receiver reading the base run's stream. The reference that attribution of neuron
    receiver edges (:func:`~arithinterp.circuits.edges.attribute_edges` with ``neurons``) is
    checked against.

    ``neurons`` ``{layer: [ids] or "all"}`` names the receiver neurons; edges come from every
    sender of ``graph`` upstream of their MLP (embeddings, heads, earlier MLPs), at each of the
    graph's positions; ``edges`` picks some by name (``"L0H1->MLP1N5"``). ``direction="denoise"``
    runs the corrupt prompt and carries the clean run's output. Whole forwards, each edge one
    stacked copy of the batch (``batch_cells`` per forward, by default what ``max_memory`` allows).

    Args:
        model: The hooked model.
        pairs: Clean / corrupt pairs.
        neurons: ``{layer: [ids] or "all"}``, the receiver neurons.
        graph: The model's edge graph (default ``EdgeGraph.of(model)``).
        metric: The pair metric, or a callable.
        direction: ``"denoise"`` or ``"noise"``.
        edges: Edges to patch, by name (default: every edge into the neurons).
        batch_cells: Edges stacked per forward (default: as many as fit ``max_memory``).
        max_memory: Bytes one stacked forward may use.
        progress: Show a progress bar.

    Returns:
        ``scores`` ``[pair, edge]`` (metric after − metric of the base run), ``edges`` (names),
        ``clean`` / ``corrupt`` ``[pair]`` and ``forwards``.

    Raises:
        ConfigError: An unknown direction or metric.
        AnalysisError: An unknown edge name.
        SiteError: A layer or neuron out of range.
        ModelMismatchError: The pairs were built for another model.
    """
    from arithinterp.circuits.graph import EdgeGraph
    from arithinterp.tasks import resolve_positions

    check_belongs(model, "circuits.patch_neuron_edges", pairs=pairs)
    check_pairs(pairs)
    check_choice("direction", direction, DIRECTIONS)
    graph = graph or EdgeGraph.of(model)
    receivers = check_neurons(model, graph, neurons)
    names, index = neuron_receiver_edges(graph, receivers)
    chosen = torch.arange(len(names))
    if edges is not None:
        where = {name: i for i, name in enumerate(names)}
        unknown = [e for e in edges if e not in where]
        if unknown or not edges:
            raise AnalysisError(f"unknown neuron edges {unknown[:3]}; edges into these neurons are named like "
                                f"{names[0]!r} (every sender of the graph upstream of the neuron's MLP)")
        chosen = torch.tensor([where[e] for e in edges])
    fn = metric_fn(metric)
    budget = memory_budget(model, max_memory)
    forward = EdgeForward(model)
    inputs = neuron_inputs(model, receivers)
    L = graph.layout
    base_set, source_set = (pairs.corrupt, pairs.clean) if direction == "denoise" else (pairs.clean, pairs.corrupt)
    scores = torch.empty(len(pairs), len(chosen))
    clean_m, corrupt_m = torch.empty(len(pairs)), torch.empty(len(pairs))
    T_max = int(base_set.tokens.shape[1])
    batch = chunk_for(budget, 3 * edge_run_bytes(model, T_max), "pair's neuron edge run", high=len(pairs))
    batches = [b for group in pairs.clean.length_groups() for b in group.split(batch)]
    forwards = 0
    offsets = torch.cumsum(torch.tensor([0] + [inputs.units(layer) for layer in inputs.layers]), 0)
    pos_index = None
    if graph.positions != [None]:
        labels, pos_index = resolve_positions(pairs, graph.positions)
        graph.check_positions(labels)
    bar = progress_bar(total=len(batches) * len(chosen), desc="neuron edges", disable=not progress)
    for idx in batches:
        base_tokens, source_tokens = base_set.unpadded(idx), source_set.unpadded(idx)
        B, T = base_tokens.shape
        base_send, base_logits, base_scales = sender_outputs(model, base_tokens)
        source_send, source_logits, _ = sender_outputs(model, source_tokens)
        forwards += 2
        ctx = metric_context(pairs[idx], direction, base_logits, source_logits, device=base_logits.device)
        m_base, m_source = fn(base_logits, ctx).float().cpu(), fn(source_logits, ctx).float().cpu()
        clean_m[idx], corrupt_m[idx] = (m_source, m_base) if direction == "denoise" else (m_base, m_source)
        if pos_index is None:
            onehot = torch.ones(1, B, T)
        else:
            pos = pos_index[:, idx] - base_set.offset(idx)
            onehot = (torch.arange(T)[None, None, :] == pos[:, :, None]).float()
        chunk = batch_cells or max(1, min(len(chosen), int(budget // (B * edge_run_bytes(model, T)))))
        for start in range(0, len(chosen), chunk):
            ids = chosen[start:start + chunk]
            c = len(ids)
            dense = torch.zeros(c, len(graph.positions), len(receivers), L.n_senders)
            p, k, s = index[ids, 0], index[ids, 1], index[ids, 2]
            dense[torch.arange(c), p, k, s] = 1.0

            def weights(layer, dense=dense):
                k0, k1 = int(offsets[inputs.layers.index(layer)]), int(offsets[inputs.layers.index(layer) + 1])
                w = dense[:, :, k0:k1, : L.senders_before(layer, "mlp")]  # [c, P, u, S_up]
                if not bool(w.any()):
                    return None
                return torch.einsum("cpus,pbt->cbtus", w, onehot).to(base_send.device)

            with torch.inference_mode():
                logits = forward.run(base_tokens, copies=c, values=source_send, neurons=inputs, scales=base_scales,
                                     neuron_weights=weights)["logits"][:, :, -1].float()
            forwards += 1
            scores[idx[:, None], torch.arange(start, start + c)[None, :]] = (fn(logits, ctx).T.float().cpu()
                                                                            - m_base[:, None])
            bar.update(c)
    bar.close()
    return {"scores": scores, "edges": [names[int(i)] for i in chosen], "clean": clean_m, "corrupt": corrupt_m,
            "forwards": forwards}
