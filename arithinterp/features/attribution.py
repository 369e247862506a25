"""Direct effects in a prompt's local replacement model: the computing under an attribution graph.

The *local replacement model* of a prompt is the model with every MLP replaced by its transcoder
plus an *error node* (the MLP's true output minus the transcoder's, held constant), attention
patterns and norm divisors frozen at their values on the prompt. It reproduces the model's
activations on that prompt exactly, and it is linear in its *sources*: token embeddings, the
active features' activations and the error nodes. So the direct effect of a source on a *target*
(an active feature's pre-activation, or a demeaned answer logit) is the target's gradient at the
place the source writes, times what it writes; those effects plus the all-off value (the *bias*:
positional embeddings, norm and layer biases) add up to the target's value.

:func:`attribute` runs the replacement model with gradients, then one batched backward per
batch of at most ``batch_size`` targets (``torch.autograd.grad`` with ``is_grads_batched``: the
forward is shared). Only the linear paths are in that backward: the frozen patterns cut the
queries and keys out of it, and the real MLPs, whose outputs the transcoders' replace, are not run.
A backward costs its rows × the layers below its deepest target × the positions it runs over, so
the targets are taken in layer order and cut into the batches that cost least
(:func:`cheapest_batches`), and a target early in the prompt runs on a forward of a prefix of it
(:class:`_LiveRuns`: attention is causal). The answer logits are expanded first; then, as
circuit-tracer does (``max_feature_nodes``), the features in order of their influence on the answer
through the edges known so far, until ``max_feature_nodes`` are expanded (all of them with ``None``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, Optional

import torch
from transformer_lens.model_bridge.generalized_components import GatedMLPBridge, JointGateUpMLPBridge, MLPBridge

from arithinterp import sites as site_lib
from arithinterp.engine import Read, Write, run
from arithinterp.features.transcoder import Transcoders
from arithinterp.progress import progress_bar

# Targets per batched backward: at most BACKWARD_ROWS, and fewer where their gradients would pass
# BACKWARD_BYTES. More rows were slower on CPU (the 4-layer Llama's 8-shot graph, every feature,
# one thread: 2.9 s at 32 rows, 3.0 s at 64, 3.6 s at 128, 4.5 s at 291).
BACKWARD_ROWS = 32
BACKWARD_BYTES = 64 * 2**20
# Batches expanded between updates of the features' influence (circuit-tracer's ``update_interval``).
# Taken in layer order, the batches of one update each hold targets of few layers, and a batched
# backward runs only through the layers below its deepest target.
UPDATE_INTERVAL = 4
# Prefix runs for the backwards of targets early in the prompt (quarters of it; :class:`_LiveRuns`).
PREFIXES = 4
# A batched backward's cost beyond its rows' (layers × positions × rows), in those units: per layer
# and position as much as CALL_ROWS more rows, and CALL_COST per call (measured on Gemma 3 270M, one
# thread: 3.3 ms a call, 49 µs per layer and position, 17.5 µs per row, layer and position).
CALL_ROWS = 3
CALL_COST = 200


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Every source's direct effect on each expanded target of one prompt.

    Attributes:
        nodes: One dict per possible node, in order: embeddings (one per position), active features
            (by layer, then position), error nodes (by layer, then position), answer logits; each
            with ``kind``, ``layer``, ``position``, ``feature`` (the token id for logits) and
            ``activation`` (a feature's activation, an error node's norm).
        n_sources: The nodes before the logits (every node but the logits is a source).
        rows (Float[Tensor, "target source"]): ``rows[r, s]`` the direct effect of source ``s`` on
            target ``targets[r]``, float64.
        targets (Int[Tensor, "target"]): The node of each row: the logits, then the expanded features.
        bias (Float[Tensor, "target"]): Each target's value with every source off.
        values (Float[Tensor, "target"]): Each target's own value on the prompt.
        logits (Float[Tensor, "vocab"]): The model's final-position logits.
    """

    nodes: list
    n_sources: int
    rows: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor
    values: torch.Tensor
    logits: torch.Tensor


def frozen_state(model: Any, tokens: torch.Tensor) -> dict[str, Any]:
    """What the local replacement model freezes (``frozen``: patterns and norm divisors), and from
    the clean run (``got``) the embeddings and each layer's MLP input and output, and its final logits."""
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
    reads += [Read("embed", 0)] + [Read(site, layer) for layer in range(n_layers) for site in ("mlp_in", "mlp_out")]
    out = run(model, tokens, reads=reads)  # the final position's logits alone
    got = dict(zip([(r.site, r.layer) for r in reads], out.reads))
    return dict(frozen={key: got[key] for key in frozen_sites}, got=got, logits=out.logits)


def attribute(model: Any, tokens: torch.Tensor, transcoders: Transcoders, *, n_logits: int,
              zero_positions: list, max_feature_nodes: Optional[int], batch_size: Optional[int],
              progress: bool) -> Attribution:
    """The direct effects of every source on the answer logits and on up to ``max_feature_nodes``
    features chosen by influence (checked arguments: see :func:`~arithinterp.features.graph.prompt_graph`).

    Args:
        model: The hooked model.
        tokens (Int[Tensor, "1 pos"]): The prompt.
        transcoders: Transcoders from ``mlp_in`` to ``mlp_out`` for every layer.
        n_logits: The answer tokens (most probable first) that are targets.
        zero_positions: Positions whose features and error nodes are held constant (in the bias).
        max_feature_nodes: The most features expanded; ``None``: all.
        batch_size: Targets per batched backward (default: :data:`BACKWARD_ROWS`, fewer where
            :data:`BACKWARD_BYTES` of gradients would not hold them).
        progress: Show a progress bar.

    Returns:
        The :class:`Attribution`.
    """
    n_layers, T, d = site_lib.n_layers(model), int(tokens.shape[1]), int(model.cfg.d_model)
    state = frozen_state(model, tokens)
    got, real_logits = state["got"], state["logits"][0]
    mlp_in = [got[("mlp_in", layer)] for layer in range(n_layers)]
    acts = [transcoders.encode(layer, x[0]) for layer, x in enumerate(mlp_in)]  # [T, F]
    for a in acts:
        a[zero_positions] = 0.0
    errors = [got[("mlp_out", layer)][0] - transcoders.decode(layer, acts[layer], mlp_in[layer][0])
              for layer in range(n_layers)]
    # zeroed positions: what their features and error write is held constant (part of the bias)
    held = [torch.zeros_like(e) for e in errors]
    for e, h in zip(errors, held):
        h[zero_positions] = e[zero_positions]
        e[zero_positions] = 0.0
    active = [a.nonzero() for a in acts]  # [n_l, 2] (position, feature)
    top = real_logits.topk(n_logits).indices

    nodes: list[dict] = [dict(kind="embedding", layer=-1, position=p, feature=-1, activation=0.0) for p in range(T)]
    for layer, (where, a) in enumerate(zip(active, acts)):
        values = a[where[:, 0], where[:, 1]].tolist()
        nodes += [dict(kind="feature", layer=layer, position=p, feature=f, activation=v)
                  for (p, f), v in zip(where.tolist(), values)]
    for layer in range(n_layers):
        nodes += [dict(kind="error", layer=layer, position=p, feature=-1, activation=v)
                  for p, v in enumerate(errors[layer].norm(dim=-1).tolist())]
    n_sources = len(nodes)
    for token in top.tolist():
        nodes.append(dict(kind="logit", layer=n_layers, position=T - 1, feature=int(token), activation=0.0))
    targets = _Targets(nodes, n_sources, transcoders)

    # forwards with gradients (everything as on the prompt), then each batch of targets is one backward
    constants = [got[("mlp_out", layer)] - transcoders.linear(layer, x) for layer, x in enumerate(mlp_in)]
    live = _LiveRuns(model, tokens, state["frozen"], transcoders, constants, dtype=got[("embed", 0)].dtype)
    sources = _Sources(transcoders, got[("embed", 0)][0], active, acts, errors)
    size = batch_size or max(1, min(BACKWARD_ROWS, BACKWARD_BYTES // ((n_layers + 1) * T * d * 4)))
    is_feature = torch.tensor([n["kind"] == "feature" for n in nodes[:n_sources]])
    n_active = int(is_feature.sum())
    n_expanded = n_active if max_feature_nodes is None else min(max_feature_nodes, n_active)
    rows = torch.zeros(n_logits + n_expanded, n_sources, dtype=torch.float64)
    choosing = n_expanded < n_active
    normalised = torch.zeros(len(rows) if choosing else 0, n_sources)  # |rows| summing to 1 per target: for choosing
    row_node = torch.full((len(rows),), -1, dtype=torch.long)
    filled = 0
    bar = progress_bar(total=len(rows), desc="graph rows", disable=None if progress else True)

    def expand(ids: torch.Tensor) -> None:  # ids in node order: by layer, then position
        nonlocal filled
        lengths = [live.length(p) for p in targets.position[ids].tolist()]
        for start, stop in cheapest_batches(targets.layer[ids].tolist(), lengths, size):
            part = ids[start:stop]
            probes, run_in, run_logits = live.run(max(lengths[start:stop]))
            value = targets.values(part, run_in, run_logits)
            grads = torch.autograd.grad(value, probes, grad_outputs=torch.eye(len(part), dtype=value.dtype),
                                        retain_graph=True, is_grads_batched=True, allow_unused=True)
            effects = rows[filled : filled + len(part)]
            sources.effects(grads, out=effects)
            if choosing:
                size_of = effects.abs()
                normalised[filled : filled + len(part)] = size_of / size_of.sum(1, keepdim=True).clamp_min(1e-30)
            row_node[filled : filled + len(part)] = part
            filled += len(part)
            bar.update(len(part))

    expand(torch.arange(n_sources, len(nodes)))
    pending = is_feature.clone()
    probs = real_logits.float().softmax(-1)[top].double()
    while filled < len(rows):
        if not choosing:  # every feature
            chosen = pending.nonzero().squeeze(1)[: len(rows) - filled]
        else:  # the most influential features not yet expanded, through the edges known so far
            influence = partial_influence(normalised[:filled], row_node[:filled], probs / probs.sum())
            chosen = influence.masked_fill(~pending, -1.0).topk(min(UPDATE_INTERVAL * size, len(rows) - filled))
            chosen = chosen.indices.sort().values  # by layer: a batch's backward stops at its deepest target
        pending[chosen] = False
        expand(chosen)
    bar.close()

    bias_in, bias_logits = replacement_run(model, tokens, state["frozen"], transcoders, held, embed=False)
    return Attribution(nodes=nodes, n_sources=n_sources, rows=rows, targets=row_node,
                       bias=targets.values(row_node, bias_in, bias_logits).double(),
                       values=targets.values(row_node, mlp_in, real_logits[None]).double(), logits=real_logits)


def replacement_run(model: Any, tokens: torch.Tensor, frozen: dict, transcoders: Transcoders, constants: list,
                    *, embed: bool = True, probes: Optional[list] = None,
                    logits: bool = True) -> tuple[list, Optional[torch.Tensor]]:
    """One forward of the local replacement model: patterns and norm divisors ``frozen``, each MLP's
    output its transcoder's linear part plus ``constants[layer]`` ``[1, T, d]`` (what its features
    and error node write, held), the embeddings kept or (``embed=False``) switched off.

    With ``probes`` (one zero tensor ``[1, T, d]`` that requires grad per layer, then one for the
    embeddings), each is added to its MLP output or to the embeddings and the forward keeps its
    autograd graph: a probe's gradient is what a unit written there does to a target.

    Returns:
        ``(mlp_in, logits)``: each layer's MLP input ``[1, T, d]`` and the final position's logits
        ``[1, V]`` (None with ``logits=False``: the forward stops before the unembedding).
    """
    n_layers = len(constants)
    mlp_in: list = [None] * n_layers
    writes = [Write(site, layer, value=value) for (site, layer), value in frozen.items()]

    def embedding(e: torch.Tensor) -> torch.Tensor:
        e = e if embed else torch.zeros_like(e)
        return e if probes is None else e + probes[n_layers].to(e.dtype)

    writes.append(Write("embed", 0, value=embedding))
    for layer in range(n_layers):

        def output(x: torch.Tensor, layer: int = layer) -> torch.Tensor:
            mlp_in[layer] = x
            out = transcoders.linear(layer, x) + constants[layer].to(x.dtype)
            return out if probes is None else out + probes[layer].to(out.dtype)

        writes.append(Write("mlp_out", layer, value=output, input_site="mlp_in"))
        # a real MLP that still runs (see _real_mlps_skipped) sees a detached copy of its input: its
        # output is replaced, and it stays out of the backward
        writes.append(Write("mlp_in", layer, value=torch.Tensor.detach))
    with _real_mlps_skipped(model):
        out = run(model, tokens, writes, logits="final" if logits else "none", train=probes is not None)
    return mlp_in, out.logits


@contextlib.contextmanager
def _real_mlps_skipped(model: Any) -> Iterator[None]:
    """While the replacement model runs, each real MLP returns zeros at once: its output is replaced
    (by the transcoder's plus the held error), and computing it would be most of a block's work.
    Only an MLP that maps its input to its output alone is skipped (not a mixture of experts, not
    an MLP that adds the residual itself, as BLOOM's does); any other runs as usual."""
    skipped = []
    for block in getattr(model, "blocks", []):
        mlp = getattr(block, "mlp", None)
        module = getattr(mlp, "original_component", None)
        if type(mlp) in _PLAIN_MLPS and isinstance(module, torch.nn.Module) and "forward" not in vars(module):
            module.forward = _zeros  # an instance attribute: nn.Module's call runs it
            skipped.append(module)
    try:
        yield
    finally:
        for module in skipped:
            del module.forward


_PLAIN_MLPS = (MLPBridge, GatedMLPBridge, JointGateUpMLPBridge)


def _zeros(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """An MLP's output ``[..., d]`` (the size of its input) left at zero."""
    return torch.zeros_like(x)


class _LiveRuns:
    """Forwards of the replacement model with gradients, kept for the batched backwards: on the
    whole prompt (the logits' targets read its logits) and, built when first needed, on prefixes
    of it. A target at position ``p`` depends on positions ``0..p`` alone (attention is causal,
    its patterns frozen), so its backward runs on the shortest prefix that holds ``p``: a
    quarter, half, three quarters or all of the prompt (:data:`PREFIXES`); the gradients are the
    same, the work falls with the length."""

    def __init__(self, model: Any, tokens: torch.Tensor, frozen: dict, transcoders: Transcoders, constants: list,
                 dtype: torch.dtype):
        T = int(tokens.shape[1])
        self.T = T
        self.lengths = sorted({-(-T * k // PREFIXES) for k in range(1, PREFIXES + 1)})
        self.model, self.tokens, self.frozen = model, tokens, frozen
        self.transcoders, self.constants = transcoders, constants
        self.dtype = dtype
        self.runs: dict[int, tuple] = {}

    def length(self, position: int) -> int:
        """The length of the shortest prefix run that holds ``position``."""
        return next(n for n in self.lengths if n > position)

    def run(self, length: int) -> tuple[list, list, Optional[torch.Tensor]]:
        """``(probes, mlp_in, logits)`` of the run on the first ``length`` positions (a length of
        :meth:`length`): its probes ``[1, length, d]`` (one per layer, then the embeddings'), each
        layer's MLP input, and the final logits (None on a prefix: logit targets read the whole prompt)."""
        if length not in self.runs:
            d = int(self.constants[0].shape[-1])
            probes = [torch.zeros(1, length, d, dtype=self.dtype, requires_grad=True)
                      for _ in range(len(self.constants) + 1)]
            frozen = {key: value[..., :length, :length] if key[0] == "pattern" else value[:, :length]
                      for key, value in self.frozen.items()}  # patterns [1, H, T, T], divisors [1, T, 1]
            mlp_in, logits = replacement_run(self.model, self.tokens[:, :length], frozen, self.transcoders,
                                             [c[:, :length] for c in self.constants], probes=probes,
                                             logits=length == self.T)
            self.runs[length] = (probes, mlp_in, logits)
        return self.runs[length]


class _Targets:
    """Reads targets' values from a replacement run: a feature's pre-activation, a logit's demeaned value."""

    def __init__(self, nodes: list, n_sources: int, transcoders: Transcoders):
        self.n_sources = n_sources
        self.layer = torch.tensor([n["layer"] for n in nodes])
        self.position = torch.tensor([n["position"] for n in nodes])
        self.feature = torch.tensor([n["feature"] for n in nodes])
        self.transcoders = transcoders

    def values(self, ids: torch.Tensor, mlp_in: list, logits: Optional[torch.Tensor]) -> torch.Tensor:
        """The values ``[len(ids)]`` of target nodes ``ids``, from each layer's MLP input
        ``[1, T, d]`` and the final logits ``[1, V]`` (differentiable when they are; None from a
        prefix run, which holds no logit targets)."""
        parts, order = [], []
        is_logit = ids >= self.n_sources
        if bool(is_logit.any()):
            assert logits is not None, "logit targets are read from a run of the whole prompt"
            order.append(is_logit.nonzero().squeeze(1))
            parts.append((logits[0] - logits[0].mean())[self.feature[ids[is_logit]]])
        for layer in self.layer[ids[~is_logit]].unique().tolist():
            where = ((~is_logit) & (self.layer[ids] == layer)).nonzero().squeeze(1)
            i, p, f = self.transcoders.index(layer), self.position[ids[where]], self.feature[ids[where]]
            x, W, b = mlp_in[layer][0, p], self.transcoders.W_enc[i][:, f].T, self.transcoders.b_enc[i][f]
            order.append(where)
            parts.append((x * W.to(x.dtype)).sum(-1) + b.to(x.dtype))
        dtype = functools.reduce(torch.promote_types, [part.dtype for part in parts])
        return torch.cat([part.to(dtype) for part in parts])[torch.cat(order).argsort()]


class _Sources:
    """What each source writes (token embeddings, active features' activation × decoder row, padded
    per position, error nodes), turning gradients into direct effects (in the gradients' precision:
    a product over ``d_model`` rounds at float32's relative 1e-7, far below the graph's tolerance)."""

    def __init__(self, transcoders: Transcoders, embeddings: torch.Tensor, active: list, acts: list, errors: list):
        self.embeddings = embeddings
        self.errors = errors
        T = len(embeddings)
        self.plans = []
        start = T  # the columns: embeddings, features by layer, errors by layer
        for layer, (where, a) in enumerate(zip(active, acts)):
            positions, features = where.T.contiguous()
            counts = torch.bincount(positions, minlength=T)
            slots = torch.arange(len(positions)) - (torch.cumsum(counts, 0) - counts)[positions]
            writes = torch.zeros(T, max(1, int(counts.max())), embeddings.shape[-1], dtype=embeddings.dtype)
            i = transcoders.index(layer)
            written = a[positions, features][:, None] * transcoders.W_dec[i][features]
            writes[positions, slots] = written.to(writes.dtype)
            self.plans.append((writes, positions, slots, start))
            start += len(positions)
        self.error_start = start
        self.n_sources = start + len(errors) * T

    def effects(self, grads: tuple, out: torch.Tensor) -> None:
        """Direct effects into ``out [B, n_sources]`` (float64, zeros: embeddings, features by layer,
        errors by layer) from the gradients at each MLP output, then at the embeddings
        (``[B, 1, P, d]`` each, of a run on the first ``P`` positions; None where the targets do not
        reach: their sources' effects stay 0)."""
        T = len(self.embeddings)
        for layer, (writes, positions, slots, start) in enumerate(self.plans):
            g = grads[layer]
            if g is None:
                continue
            g = g[:, 0]
            P = g.shape[1]  # the gradients of a prefix run: the sources after it have no effect
            n = int(torch.searchsorted(positions, P))  # the layer's active features, by position
            at = torch.einsum("btd,tkd->btk", g, writes[:P].to(g.dtype))
            out[:, start : start + n] = at[:, positions[:n], slots[:n]]
            error = self.error_start + layer * T
            out[:, error : error + P] = (g * self.errors[layer][:P].to(g.dtype)).sum(-1)
        g = grads[len(self.plans)]
        if g is not None:
            P = g.shape[2]
            out[:, :P] = (g[:, 0] * self.embeddings[:P].to(g.dtype)).sum(-1)


def partial_influence(weights: torch.Tensor, targets: torch.Tensor, logit_weight: torch.Tensor) -> torch.Tensor:
    """Each source's influence ``[n_sources]`` on the answer through the rows known so far:
    ``w (A + A² + …)`` with ``A`` the absolute direct effects normalised to sum 1 per target
    (``weights [R, n_sources]``, into nodes ``targets``, the logits' rows first) and ``w`` the logit
    rows' weights.

    The series runs over the rows alone: with ``r = w + w A_rr + w A_rr² + …`` (``A_rr [R, R]``
    the rows' targets' effects on each other), the influence is ``r A``: one product with the
    whole of ``A`` instead of one per term."""
    n_logits = len(logit_weight)
    among = weights[:, targets[n_logits:]]  # [R, R - n_logits]: the effects on each row of the expanded features
    reach = torch.zeros(len(weights), dtype=weights.dtype)
    reach[:n_logits] = logit_weight.to(weights.dtype)
    total = torch.zeros_like(reach)
    for _ in range(len(weights)):  # edges reach earlier layers only: one step per layer, then nothing is left
        if not bool(reach.any()):
            break
        total += reach
        reach = torch.cat([torch.zeros(n_logits, dtype=reach.dtype), reach @ among])
    return total @ weights


def cheapest_batches(depths: list[int], lengths: list[int], size: int) -> list[tuple[int, int]]:
    """Consecutive batches ``(start, stop)`` of at most ``size`` targets, sorted by layer (``depths``
    ascending), that cost the least backward: a batch runs on the prefix its longest target needs
    (``lengths``), through the layers up to its deepest target's, for each row and, about as much as
    :data:`CALL_ROWS` more rows, for the batch as a whole; each call costs :data:`CALL_COST` more.
    A few deep targets are then not batched with many shallow ones, nor many shallow ones cut into
    small batches."""
    n = len(depths)
    best = [0.0] + [float("inf")] * n  # best[j]: the least cost of the first j targets
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        deepest, longest = depths[j - 1] + 1, 0
        for i in range(j - 1, max(0, j - size) - 1, -1):  # the batch i..j-1
            longest = max(longest, lengths[i])
            cost = best[i] + CALL_COST + deepest * longest * (j - i + CALL_ROWS)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    batches = []
    while n:
        batches.append((cut[n], n))
        n = cut[n]
    return batches[::-1]
