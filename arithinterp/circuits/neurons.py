"""MLP neurons as senders of the edge-attribution graph.

An MLP's output is the sum of its neurons' outputs, ``post_n · W_out[n]`` (plus a bias that is
the same in every run), so each neuron is a sender of its own: the edge ``MLP{l}N{n} → r`` is the
neuron's output carried into receiver ``r``, and the MLP's edge ``MLP{l} → r`` is the sum of its
neurons' edges. Attribution (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024) scores it with the
gradient at ``r``'s input that :func:`~arithinterp.circuits.edges.attribute_edges` already takes:

    score(MLP{l}N{n} → r, p) = Σ_t∈p (source − base)post_n[t] · (W_out[n] · ∂metric/∂input_r[t]).

The neurons' activations (``mlp_post``) are read by the engine (:func:`arithinterp.engine.run`).
Receivers stay whole components (a neuron's own input is not a tensor of the model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence, Union

import torch

from arithinterp.engine import Read
from arithinterp.engine import run as engine_run
from arithinterp.errors import AnalysisError, SiteError

if TYPE_CHECKING:
    from arithinterp.circuits.graph import Graph
    from arithinterp.types import HookedModel


def check_neurons(model: HookedModel, graph: Graph,
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


def neuron_edges(graph: Graph, senders: Sequence[tuple[int, int]]) -> tuple[list[str], torch.Tensor]:
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


def neuron_scores(model: HookedModel, graph: Graph, senders: Sequence[tuple[int, int]], index: torch.Tensor,
                  gradient: Callable[[int], torch.Tensor], base_tokens: torch.Tensor, source_tokens: torch.Tensor,
                  onehot: torch.Tensor, post: Optional[tuple[dict, dict]] = None) -> torch.Tensor:
    """Scores ``[B, E]`` of one batch's neuron edges (``index`` from :func:`neuron_edges`).

    ``gradient(layer)`` is the (averaged) gradient at every receiver input ``[B, T, R, d]`` that
    scores the senders of that layer's MLP; ``onehot [P, B, T]`` the graph's positions.
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
        diff = (source[layer] - base[layer])[..., ids].to(g.device)  # [B, T, n]
        along = torch.einsum("btrd,nd->btrn", g, _w_out(model, layer)[ids].to(g.device))  # W_out[n] · grad
        per = torch.einsum("btn,btrn,pbt->bprn", diff, along, onehot.to(g.device))  # [B, P, R, n]
        local = torch.full((len(senders),), -1, dtype=torch.long)
        local[torch.tensor(ks)] = torch.arange(len(ks))
        rows = torch.nonzero(local[index[:, 2]] >= 0).flatten()
        p, r, k = index[rows].T
        out[:, rows] = per[:, p, r, local[k]].cpu()
    return out
