"""EAP-IG on activations: integrated gradients over the senders' outputs (Hanna et al. 2024).

:func:`arithinterp.circuits.edges.attribute_edges` with ``method="eap-ig"`` interpolates the
*input* (the embeddings) from the base to the source prompt and averages the gradient at every
receiver over those runs. The second variant of Hanna, Pezzelle & Belinkov 2024 ("Have Faith in
Faithfulness", after the activation IG of Marks et al. 2024) interpolates the *activations* at
the senders instead: for one group of senders at a time (the embeddings, the heads of a layer,
an MLP — none of a group is downstream of another), their outputs go from the base run's to the
source run's while everything upstream stays the base run, and the gradient at each receiver is
averaged over ``steps`` points ``α = k / steps`` (k = 0 … steps − 1, the left Riemann sum, so one
step is the base run's gradient: EAP). An edge ``s → r`` is scored with the gradient of the runs
that interpolate ``s``'s group:

    score(s → r, p) = Σ_d (source_s − base_s)[p, d] · mean_k ∂metric/∂input_r[p, d] (α_k at s's group).

The interpolation is run through the engine's edge forward: adding ``α (source_s − base_s)`` to
every receiver downstream of ``s`` is, the residual stream being a sum, the model with ``s``'s
output interpolated (the senders of a group read only upstream senders, which are unchanged).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from arithinterp.engine.edges import EdgeForward, Layout, sender_outputs
from arithinterp.errors import AnalysisError
from arithinterp.metrics import metric_context

if TYPE_CHECKING:
    from arithinterp.circuits.graph import EdgeGraph


def sender_groups(layout: Layout) -> list[list[int]]:
    """Senders interpolated together (indices into the sender axis): the embeddings, then per
    layer its heads and its MLP (with the heads in parallel attention/MLP blocks, where the MLP
    does not read them)."""
    groups = [[0]]
    for layer in range(layout.n_layers):
        heads = [layout.head_sender(layer, h) for h in range(layout.n_heads)]
        if not layout.has_mlp:
            groups.append(heads)
        elif layout.parallel:
            groups.append(heads + [layout.mlp_sender(layer)])
        else:
            groups += [heads, [layout.mlp_sender(layer)]]
    return groups


def activation_ig_batch(model, engine: EdgeForward, graph: EdgeGraph, receivers: list, fn: Callable,
                        pairs_batch, direction: str, base_tokens: torch.Tensor, source_tokens: torch.Tensor,
                        onehot: torch.Tensor, steps: int, keep: Sequence[int] = ()
                        ) -> tuple[torch.Tensor, int, dict, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """Edge scores ``[B, P, R, S]`` of one batch (dense layout), the passes it took, the
    averaged receiver gradients ``[B, T, R, d]`` of the groups holding the senders in ``keep``
    (by sender index; the MLPs whose neurons are scored too) and the base and source runs'
    branch-norm denominators ``[B, T, n_layers, 2]`` (None without branch norms; every gradient
    run divides by the base run's, frozen).

    The base run's gradient (α = 0) is the same for every group, so it runs once: 2 forwards for
    the sender outputs, then ``1 + (steps − 1) · n_groups`` gradient runs (a forward and a
    backward each).
    """
    L = graph.layout
    source_send, source_logits, source_scales = sender_outputs(model, source_tokens)
    base_send, base_logits, base_scales = sender_outputs(model, base_tokens)
    passes = 2
    diff = (source_send - base_send).float()  # [B, T, S, d]
    ctx = metric_context(pairs_batch, direction, base_logits, source_logits, device=base_logits.device)
    B, T = base_tokens.shape

    def gradient(group: Union[list, None], alpha: float) -> torch.Tensor:
        """Gradient of the summed metric at every receiver input ``[B, T, R, d]``."""
        chosen = torch.zeros(L.n_senders, device=base_send.device)
        if group is not None:
            chosen[group] = alpha

        def weights(layer, channel):
            if group is None:
                return None
            n_up = L.senders_before(layer, channel)
            w = chosen[:n_up]
            if not bool(w.any()):
                return None
            return w.expand(1, B, T, L.units(channel) if channel != "logits" else 1, n_up)

        with torch.enable_grad():
            got = engine.run(base_tokens, probe=True, values=source_send, weights=weights, scales=base_scales)
            value = fn(got["logits"][0, :, -1].float(), ctx)
            if not value.requires_grad:
                raise AnalysisError("the metric does not depend on the logits; nothing to differentiate")
            grads = torch.autograd.grad(value.sum(), [got["probes"][k] for k in receivers])
        return torch.cat([x.float() for x in grads], dim=2)

    base_grad = gradient(None, 0.0)
    passes += 2
    per = torch.zeros(B, onehot.shape[0], L.n_receivers, L.n_senders, device=base_grad.device)
    kept: dict = {}
    for group in sender_groups(L):
        total = base_grad.clone()
        for k in range(1, steps):
            total += gradient(group, k / steps)
            passes += 2
        per[..., group] = torch.einsum("btrd,btsd,pbt->bprs", total / steps, diff[:, :, group], onehot)
        kept.update({s: total / steps for s in group if s in keep})
    scales = None if base_scales is None or source_scales is None else (base_scales, source_scales)
    return per, passes, kept, scales
