"""Edge scores: exact edge (path) patching, EAP and EAP-IG, many edges per forward.

* :func:`run_edge_sets` is the exact primitive: for each edge set, the base run with the edges in
  the set carrying a fixed sender output (the source run's, the corrupt run's, or the mean) into
  their receiver's input alone — path patching (Wang et al. 2023) and, with the complement of a
  circuit, ACDC's ablated edges (Conmy et al. 2023). Edge sets are stacked along the batch.
* :func:`patch_edges` scores every edge alone by exact patching (one stacked copy per edge).
* :func:`attribute_edges` scores every edge at once: ``(source − base) sender output ·
  ∂metric/∂receiver input`` (EAP, Syed et al. 2023), with the gradient averaged over ``ig_steps``
  runs whose embeddings are interpolated from the base to the source prompt (EAP-IG, Hanna et al.
  2024): 2 forwards (and one backward) per batch for EAP, 2 + 2·ig_steps for EAP-IG.

One module past 500 lines on purpose: exact patching and EAP / EAP-IG score the same edges through
the same stacked runs, and are compared with each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from arithinterp.checks import check_belongs, check_choice, check_pairs
from arithinterp.circuits.graph import EdgeGraph
from arithinterp.circuits.ig_activations import activation_ig_batch
from arithinterp.circuits.neurons import (
    check_neurons,
    neuron_edges,
    neuron_inputs,
    neuron_post,
    neuron_receiver_edges,
    neuron_receiver_scores,
    neuron_scores,
)
from arithinterp.engine.budget import chunk_for, held_bytes, memory_budget, release_freed_memory
from arithinterp.engine.edge_steps import EdgeEntries, SteppedEdges
from arithinterp.engine.edges import (
    CHANNELS,
    EdgeForward,
    edge_run_bytes,
    gradient_run_bytes,
    sender_bytes,
    sender_outputs,
)
from arithinterp.engine.forward import RunningMean
from arithinterp.engine.neuron_inputs import neuron_input_bytes
from arithinterp.engine.steppers import ENGINES, stepper_for
from arithinterp.errors import AnalysisError
from arithinterp.metrics import DIRECTIONS, metric_context, metric_fn
from arithinterp.progress import progress_bar
from arithinterp.tasks import resolve_positions
from arithinterp.types import ByteSize, IntegrationSteps, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs
    from arithinterp.types import HookedModel

VALUES = ("source", "corrupt", "clean", "mean")
METHODS = ("eap", "eap-ig", "eap-ig-activations")


def _position_onehot(graph: EdgeGraph, pairs, idx: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """``[P, B, T]``: which token of each (unpadded) prompt each position label of the graph is."""
    B = len(idx)
    if graph.positions == [None]:
        return torch.ones(1, B, length)
    labels, pos_index = resolve_positions(pairs, graph.positions)
    graph.check_positions(labels)
    pos = pos_index[:, idx] - offset  # [P, B]
    return (torch.arange(length)[None, None, :] == pos[:, :, None]).float()


def _receivers(graph: EdgeGraph):
    L = graph.layout
    for layer in range(L.n_layers):
        for channel in CHANNELS + (("mlp",) if L.has_mlp else ()):
            yield layer, channel
    yield L.n_layers, "logits"


def _mean_senders(model, prompts, budget: int) -> torch.Tensor:
    """Mean sender outputs ``[T_max, S, d]`` over ``prompts``, right-aligned per position
    (:class:`arithinterp.engine.RunningMean`, the running form of the package's one mean-ablation
    definition), in batches of prompts that fit ``budget`` bytes."""
    T = int(prompts.tokens.shape[1])
    batch = chunk_for(budget, edge_run_bytes(model, T), "prompt's sender outputs")
    mean = RunningMean()
    for group in prompts.length_groups():
        for idx in group.split(batch):
            senders, _, _ = sender_outputs(model, prompts.unpadded(idx))
            mean.add(senders.cpu())
    return mean.value()


def _entries(graph: EdgeGraph, sets: torch.Tensor) -> EdgeEntries:
    """The edges of ``sets [C, n_edges]`` as a list (the engine's sparse form of edge sets)."""
    c, e = torch.nonzero(sets, as_tuple=True)
    p, r, s = graph.edge_index[e].T
    return EdgeEntries(c, p, r, s, sets[c, e])


@checked
def run_edge_sets(
    model: HookedModel,
    pairs: PromptPairs,
    graph: EdgeGraph,
    edge_sets: torch.Tensor,
    metric: Union[str, Callable] = "logit_diff",
    *,
    base: str = "corrupt",
    values: str = "source",
    batch_cells: Optional[PositiveInt] = None,
    batch_size: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    engine: str = "auto",
    progress: bool = True,
    _runs: Optional[dict] = None,
) -> dict:
    """The metric for each edge set, its chosen edges carrying fixed sender outputs. Every other
    edge carries the sender's output in this very run.

    Memory: pairs run in batches of ``batch_size`` and edge sets stacked ``batch_cells`` at a time
    (each a copy of the batch in one forward); both default to what fits in ``max_memory`` bytes
    (:func:`arithinterp.engine.budget.memory_budget`), and only the stacked sets' slice of the
    dense ``[sets, positions, receivers, senders]`` tensor is built at once.

    ``engine``: ``"auto"`` steps the model's own blocks (:mod:`arithinterp.engine.edge_steps`):
    each stack of sets starts at the layer of its first changed receiver and the first position
    where one of its edges carries a value other than the base run's, reusing the base run's
    keys and values before it; where stepping does not reproduce the model's logits, whole
    forwards with a warning. ``"stepped"`` refuses to fall back; ``"hooks"`` runs every stack as
    a whole forward (the reference). ``engine`` in the result names what ran. (``_runs``: a dict
    the caller keeps to reuse the unpatched stepped runs over calls on the same model, pairs and
    arguments, as pruning does: as many batches' as fit ``max_memory``, the others run again.)

    Args:
        model: The hooked model.
        pairs: Clean / corrupt pairs.
        graph: The model's edge graph.
        edge_sets (Float[Tensor, "set edge"]): 1 where the edge carries ``values``.
        metric: The pair metric, or a callable.
        base: The prompts run: ``"corrupt"`` or ``"clean"``.
        values: The fixed sender outputs carried by the chosen edges: ``"source"`` (the other
            prompt of the pair), ``"clean"``, ``"corrupt"``, or ``"mean"`` over the clean prompts.
        batch_cells: Edge sets stacked per forward (default: as many as fit ``max_memory``).
        batch_size: Pairs per batch (default: as many as fit ``max_memory``).
        max_memory: Bytes one stacked forward may use.
        engine: ``"auto"``, ``"stepped"`` or ``"hooks"``, as above.
        progress: Show a progress bar.

    Returns:
        ``values`` ``[pair, set]``, the unpatched metrics ``clean`` and ``corrupt`` ``[pair]``,
        ``forwards`` (the number of stacked forwards) and ``engine`` (what ran).

    Raises:
        ConfigError: An unknown base, values, engine or metric, or counts below 1.
        AnalysisError: Pairs that cannot be patched, or edge sets of another width.
        ModelMismatchError: The pairs were built for another model.
    """
    check_belongs(model, "circuits.run_edge_sets", pairs=pairs)
    check_pairs(pairs)
    check_choice("base", base, ("corrupt", "clean"))
    check_choice("values", values, VALUES)
    check_choice("engine", engine, ENGINES)
    budget = memory_budget(model, max_memory)
    fn = metric_fn(metric)
    sets = torch.as_tensor(edge_sets).float()
    if sets.ndim != 2 or sets.shape[1] != graph.n_edges:
        raise AnalysisError(f"edge_sets must be [n_sets, n_edges = {graph.n_edges}], got shape {tuple(sets.shape)}")
    direction = "denoise" if base == "corrupt" else "noise"
    base_set, other_set = (pairs.corrupt, pairs.clean) if base == "corrupt" else (pairs.clean, pairs.corrupt)
    runs = {} if _runs is None else _runs
    if values == "mean" and "mean" not in runs:
        runs["mean"] = _mean_senders(model, pairs.clean, budget)
    mean = runs.get("mean") if values == "mean" else None
    forward = EdgeForward(model)
    entries = _entries(graph, sets)
    engines: set = set()
    L = graph.layout
    n, C = len(pairs), sets.shape[0]
    out = torch.empty(n, C)
    clean_m, corrupt_m = torch.empty(n), torch.empty(n)
    forwards = 0
    T_max = int(base_set.tokens.shape[1])
    # per pair: both runs' sender outputs (kept while its sets run) and one stacked copy of it
    per_sequence = edge_run_bytes(model, T_max)
    pair_batch = batch_size or chunk_for(budget, per_sequence + 2 * sender_bytes(model, T_max), "pair's edge run",
                                         high=n)
    batches = [b for group in pairs.clean.length_groups() for b in group.split(pair_batch)]
    bar = progress_bar(total=len(batches) * C, desc="edge sets", disable=not progress)
    for idx in batches:
        runner = base_send = other_send = fixed = base_scales = None  # free the last batch's senders first
        base_tokens, other_tokens = base_set.unpadded(idx), other_set.unpadded(idx)
        B, T = base_tokens.shape
        key = (base, tuple(idx.tolist()))
        if key in runs:  # the unpatched runs of an earlier call
            runner, status = runs[key]
        else:
            stepper, status = (None, "hooks: requested") if engine == "hooks" else stepper_for(model, base_tokens,
                                                                                                  engine)
            runner = None if stepper is None else SteppedEdges(model, stepper, base_tokens, other_tokens)
            forwards += runner is not None
            # kept for the next call while the kept runs (both prompts' senders, logits, residual stream,
            # keys and values) fit the memory budget; the rest run again (pruning on many pairs must not
            # hold them all)
            if runner is not None and _runs is not None:
                kept = runs.get("bytes", 0) + held_bytes(runner.run, runner.base_senders, runner.other_senders,
                                                          runner.base_logits, runner.other_logits)
                if kept <= budget:
                    runs[key], runs["bytes"] = (runner, status), kept
        engines.add(status)
        if runner is not None:  # both runs in one stacked forward
            base_send, base_logits = runner.base_senders, runner.base_logits
            other_send, other_logits = runner.other_senders, runner.other_logits
        else:
            base_send, base_logits, base_scales = sender_outputs(model, base_tokens)
            other_send, other_logits, _ = sender_outputs(model, other_tokens)
            forwards += 2
        ctx = metric_context(pairs[idx], direction, base_logits, other_logits, device=base_logits.device)
        m_base, m_other = fn(base_logits, ctx).float().cpu(), fn(other_logits, ctx).float().cpu()
        clean_m[idx], corrupt_m[idx] = (m_other, m_base) if base == "corrupt" else (m_base, m_other)
        if mean is not None:  # values == "mean"
            fixed = mean[-T:][None].expand(B, -1, -1, -1).to(base_send.device)
        elif values == "source" or values != base:
            fixed = other_send
        else:
            fixed = base_send
        onehot = _position_onehot(graph, pairs, idx, base_set.offset(idx), T).to(base_send.device)
        if runner is not None:  # the senders held: both runs', the fixed values and their difference
            room = max(budget - 4 * B * sender_bytes(model, T), 1)
            for ids, logits, ran in runner.sets(entries, C, fixed, onehot, budget=room, batch_cells=batch_cells):
                out[idx[:, None], ids[None, :]] = fn(logits, ctx).T.float().cpu()
                forwards += ran
                bar.update(len(ids))
            continue
        # sets stacked per forward: what the budget leaves beside the senders held (at least one set)
        held = 2 * B * sender_bytes(model, T)
        chunk = batch_cells or max(1, min(C, int((budget - held) // (B * edge_run_bytes(model, T)))))
        for start in range(0, C, chunk):
            part = graph.dense(sets[start:start + chunk]).to(base_send.device)  # [c, P, R, S]
            c = part.shape[0]

            def weights(layer, channel, part=part):
                if channel != "logits":
                    rs = graph.receiver_slice(layer, channel)
                else:
                    rs = slice(L.receiver(layer, "logits"), L.receiver(layer, "logits") + 1)
                n_up = L.senders_before(layer, channel)
                w = part[:, :, rs, :n_up]  # [c, P, U, S_up]
                if not bool(w.any()):
                    return None
                return torch.einsum("cpus,pbt->cbtus", w, onehot)

            with torch.inference_mode():
                logits = forward.run(base_tokens, copies=c, values=fixed, weights=weights,
                                     scales=base_scales)["logits"][:, :, -1].float()
            forwards += 1
            out[idx[:, None], torch.arange(start, start + c)[None, :]] = fn(logits, ctx).T.float().cpu()
            bar.update(c)
    bar.close()
    release_freed_memory()
    return {"values": out, "clean": clean_m, "corrupt": corrupt_m, "forwards": forwards,
            "batch_size": pair_batch, "max_memory": budget, "engine": sorted(engines)}


@checked
def patch_edges(
    model: HookedModel,
    pairs: PromptPairs,
    graph: Optional[EdgeGraph] = None,
    metric: Union[str, Callable] = "logit_diff",
    direction: str = "denoise",
    *,
    edges: Optional[Sequence] = None,
    batch_cells: Optional[PositiveInt] = None,
    batch_size: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    engine: str = "auto",
    progress: bool = True,
) -> dict:
    """Exact path patching of each edge alone (Wang et al. 2023): the base run with the source
    run's sender output carried along that one edge. ``direction="denoise"`` runs the corrupt
    prompt and carries the clean output; ``"noise"`` the reverse. Edges run in blocks whose one-hot
    sets fit a quarter of ``max_memory``; each block is :func:`run_edge_sets` (same memory and
    ``engine`` rules: by default each edge's run starts at its receiver's layer and the first
    position where its sender's output differs between the two prompts).

    Args:
        model: The hooked model.
        pairs: Clean / corrupt pairs.
        graph: The model's edge graph (default ``EdgeGraph.of(model)``).
        metric: The pair metric, or a callable.
        direction: ``"denoise"`` or ``"noise"``.
        edges: The edges to patch, by name or index (default: all).
        batch_cells: As for :func:`run_edge_sets`.
        batch_size: As for :func:`run_edge_sets`.
        max_memory: As for :func:`run_edge_sets`.
        engine: As for :func:`run_edge_sets`.
        progress: Show a progress bar.

    Returns:
        ``scores`` ``[pair, edge]`` (metric after − metric of the base run; edges not patched are
        NaN), ``clean`` / ``corrupt`` ``[pair]``, ``forwards`` and ``engine``.

    Raises:
        ConfigError: An unknown direction, engine or edge.
        ModelMismatchError: The pairs were built for another model.
    """
    check_belongs(model, "circuits.patch_edges", pairs=pairs)
    graph = graph or EdgeGraph.of(model)
    check_choice("direction", direction, DIRECTIONS)
    check_choice("engine", engine, ENGINES)
    chosen = torch.arange(graph.n_edges) if edges is None else graph.index(edges)
    base = "corrupt" if direction == "denoise" else "clean"
    budget = memory_budget(model, max_memory)
    # one-hot edge sets are built a block at a time: all of them at once is [n_edges, n_edges]
    block = max(1, min(len(chosen), budget // (4 * 4 * graph.n_edges)))
    scores = torch.full((len(pairs), graph.n_edges), float("nan"))
    got: dict = {}
    forwards, engines = 0, set()
    for start in progress_bar(range(0, len(chosen), block), desc="patch edges",
                              disable=not progress or len(chosen) <= block):
        ids = chosen[start:start + block]
        sets = torch.zeros(len(ids), graph.n_edges)
        sets[torch.arange(len(ids)), ids] = 1.0
        got = run_edge_sets(model, pairs, graph, sets, metric, base=base, values="source", batch_cells=batch_cells,
                            batch_size=batch_size, max_memory=budget, engine=engine,
                            progress=progress and len(chosen) <= block)
        base_metric = got["corrupt"] if base == "corrupt" else got["clean"]
        scores[:, ids] = got["values"] - base_metric[:, None]
        forwards += got["forwards"]
        engines.update(got["engine"])
    return {"scores": scores, "clean": got["clean"], "corrupt": got["corrupt"], "forwards": forwards,
            "engine": sorted(engines)}


@checked
def attribute_edges(
    model: HookedModel,
    pairs: PromptPairs,
    graph: Optional[EdgeGraph] = None,
    method: str = "eap-ig",
    *,
    ig_steps: IntegrationSteps = 5,
    metric: Union[str, Callable] = "logit_diff",
    direction: str = "denoise",
    batch_size: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    progress: bool = True,
    neurons: Optional[dict] = None,
    neuron_receivers: bool = True,
) -> dict:
    """Every edge's estimated effect in a few forwards and backwards per batch.

    ``score(s → r, p) = Σ_d (source_s − base_s)[p, d] · g_r[p, d]``, where ``g_r`` is the gradient
    of the metric at receiver ``r``'s input: on the base run (``"eap"``, Syed et al. 2023), or
    averaged over ``ig_steps`` runs whose embeddings are interpolated from base to source at the
    midpoints ``(k + ½)/ig_steps`` (``"eap-ig"``, Hanna et al. 2024). Passes per batch: 2 forwards
    for the sender outputs, then one forward and one backward per gradient (EAP: the base run's
    forward is reused for its sender outputs, so 3 passes; EAP-IG: 2 + 2·ig_steps ≤ 2(ig_steps + 1)).

    Memory: one prompt's gradient run holds a probe (and its gradient) at every receiver input
    at every position, hundreds of MB on a 135M-parameter model, so prompts run in batches of
    ``batch_size``, by default as many as fit in ``max_memory`` bytes
    (:func:`arithinterp.engine.budget.memory_budget`); only the ``[pairs, edges]`` scores are kept.

    ``method="eap-ig-activations"`` integrates over each sender group's outputs instead of the
    input (:mod:`arithinterp.circuits.ig_activations`). ``neurons`` (``{layer: [neuron ids] or
    "all"}``) also scores those MLP neurons as senders of their own
    (:mod:`arithinterp.circuits.neurons`): ``neuron_scores [N, n_neuron_edges]`` and
    ``neuron_edges`` (names such as ``MLP0N5->L1H2.q``), two more forwards per batch; with
    ``"eap"`` and ``"eap-ig"`` those neurons are receivers too, scored with the gradient at each
    one's own input (:mod:`arithinterp.engine.neuron_inputs`): ``neuron_receiver_scores [N, E_r]``
    and ``neuron_receiver_edges`` (``L0H2->MLP1N5``, ``MLP0->MLP1N5``, ``MLP0N3->MLP1N5``; exact
    reference: :func:`~arithinterp.circuits.neurons.patch_neuron_edges`). Each receiver neuron
    holds its own copy of the MLP input in the gradient run (``[batch, T, neurons, d_model]``,
    counted in the batch size); ``neuron_receivers=False`` scores the neurons as senders only.

    Args:
        model: The hooked model.
        pairs: Clean / corrupt pairs.
        graph: The model's edge graph (default ``EdgeGraph.of(model)``).
        method: ``"eap"``, ``"eap-ig"`` or ``"eap-ig-activations"``.
        ig_steps: Interpolation steps of the integrated-gradient methods.
        metric: The pair metric, or a callable.
        direction: ``"denoise"`` or ``"noise"``.
        batch_size: Pairs per batch (default: as many as fit ``max_memory``).
        max_memory: Bytes one batch may use.
        progress: Show a progress bar.
        neurons: ``{layer: [neuron ids] or "all"}``: MLP neurons scored as senders (and receivers).
        neuron_receivers: Score those neurons as receivers too.

    Returns:
        ``scores`` ``[pair, edge]``, ``passes`` (forwards + backwards, all batches),
        ``passes_per_batch``, ``batches``, ``batch_size`` and ``max_memory`` (the budget used), and
        with ``neurons`` the neuron edges' scores and names.

    Raises:
        ConfigError: An unknown method, metric or direction, or a batch too large for ``max_memory``.
        AnalysisError: Pairs that cannot be patched, or a graph of another model.
        ModelMismatchError: The pairs were built for another model.
    """
    check_belongs(model, "circuits.attribute_edges", pairs=pairs)
    check_pairs(pairs)
    graph = graph or EdgeGraph.of(model)
    check_choice("method", method, METHODS)
    check_choice("direction", direction, DIRECTIONS)
    if not isinstance(neuron_receivers, bool):
        raise AnalysisError(f"neuron_receivers must be True or False, got {neuron_receivers!r}")
    budget = memory_budget(model, max_memory)
    chosen = [] if neurons is None else check_neurons(model, graph, neurons)
    receiving = neuron_receivers and bool(chosen) and method != "eap-ig-activations"
    if batch_size is None:
        T_max = int(pairs.clean.tokens.shape[1])
        per_prompt = gradient_run_bytes(model, T_max)
        if receiving:  # each receiver neuron's own copy of its MLP's input
            per_prompt += neuron_input_bytes(model, T_max, len(chosen))
        batch_size = chunk_for(budget, per_prompt, "prompt's gradient run at every receiver", high=len(pairs))
    fn = metric_fn(metric)
    engine = EdgeForward(model)
    base_set, source_set = (pairs.corrupt, pairs.clean) if direction == "denoise" else (pairs.clean, pairs.corrupt)
    scores = torch.empty(len(pairs), graph.n_edges)
    batches = [b for group in pairs.clean.length_groups() for b in group.split(batch_size)]
    passes, per_batch = 0, []
    alphas = [None] if method == "eap" else [(k + 0.5) / ig_steps for k in range(ig_steps)]
    senders, neuron_index, neuron_names, neuron_out = [], torch.zeros(0, 3, dtype=torch.long), [], None
    inputs, receiver_names, receiver_index, receiver_out = None, [], torch.zeros(0, 4, dtype=torch.long), None
    if neurons is not None:  # MLP neurons as senders of their own
        senders = chosen
        neuron_names, neuron_index = neuron_edges(graph, senders)
        neuron_out = torch.empty(len(pairs), len(neuron_names))
        if receiving:  # and as receivers: the gradient at each one's own input
            inputs = neuron_inputs(model, senders)
            receiver_names, receiver_index = neuron_receiver_edges(graph, senders, senders)
            receiver_out = torch.empty(len(pairs), len(receiver_names))
    for idx in progress_bar(batches, desc=method, disable=not progress):
        # the last batch's senders, runs and gradients go before this batch's are built, not onto its peak
        source_send = base_send = grad_sum = neuron_grad_sum = g = diff = per = got = grads = wanted = post = None
        base_tokens, source_tokens = base_set.unpadded(idx), source_set.unpadded(idx)
        B, T = base_tokens.shape
        if method == "eap-ig-activations":  # integrated over each sender group's outputs
            onehot = _position_onehot(graph, pairs, idx, base_set.offset(idx), T)
            mlps = sorted({graph.layout.mlp_sender(layer) for layer, _ in senders})
            per, count, kept, both = activation_ig_batch(model, engine, graph, list(_receivers(graph)), fn,
                                                         pairs[idx], direction, base_tokens, source_tokens, onehot,
                                                         ig_steps, keep=mlps)
            scores[idx] = graph.from_dense(per).cpu()
            if neuron_out is not None:
                neuron_out[idx] = neuron_scores(model, graph, senders, neuron_index,
                                                lambda layer: kept[graph.layout.mlp_sender(layer)],
                                                base_tokens, source_tokens, onehot, scales=both)
                count += 2
            passes += count
            per_batch.append(count)
            continue
        count = 0
        source_send, source_logits, source_scales = sender_outputs(model, source_tokens)
        count += 1
        # the base run's senders and logits: run first for EAP-IG; EAP's one gradient run is the base run
        base_logits: Optional[torch.Tensor] = None
        base_scales: Optional[torch.Tensor] = None
        if method == "eap-ig":
            base_send, base_logits, base_scales = sender_outputs(model, base_tokens)
            count += 1
        grad_sum, neuron_grad_sum = None, None
        for alpha in alphas:
            embed = None
            if alpha is not None:
                assert base_send is not None  # EAP-IG ran the base first
                embed = base_send[:, :, 0] + alpha * (source_send[:, :, 0] - base_send[:, :, 0])
            with torch.enable_grad():
                # branch norms divide by the base run's denominators in every run (EAP's one run is the base run)
                got = engine.run(base_tokens, probe=True, embed=embed, read_senders=alpha is None, neurons=inputs,
                                 scales=base_scales)
                logits = got["logits"][0, :, -1].float()
                if alpha is None:
                    base_send, base_logits = got["senders"].detach().float(), logits.detach()
                    base_scales = got["scales"]
                assert base_logits is not None
                ctx = metric_context(pairs[idx], direction, base_logits.detach(), source_logits, device=logits.device)
                value = fn(logits, ctx)
                if not value.requires_grad:
                    raise AnalysisError("the metric does not depend on the logits; nothing to differentiate")
                keys = list(_receivers(graph))
                wanted = [got["probes"][k] for k in keys]
                if inputs is not None:
                    wanted += [got["neuron_probes"][layer] for layer in inputs.layers]
                grads = torch.autograd.grad(value.sum(), wanted)
            count += 2
            g = torch.cat([x.float() for x in grads[: len(keys)]], dim=2)  # [B, T, R, d] in receiver order
            grad_sum = g if grad_sum is None else grad_sum + g
            if inputs is not None:  # [B, T, K, d] at each receiver neuron's own input
                gn = torch.cat([x.float() for x in grads[len(keys):]], dim=2)
                neuron_grad_sum = gn if neuron_grad_sum is None else neuron_grad_sum + gn
        assert grad_sum is not None and base_send is not None  # alphas is never empty
        g = grad_sum / len(alphas)
        diff = (source_send - base_send).float()  # [B, T, S, d]
        onehot = _position_onehot(graph, pairs, idx, base_set.offset(idx), T).to(g.device)
        per = torch.einsum("btrd,btsd,pbt->bprs", g, diff, onehot)  # [B, P, R, S]
        scores[idx] = graph.from_dense(per).cpu()
        if neuron_out is not None:
            layers = sorted({layer for layer, _ in senders})
            post = (neuron_post(model, base_tokens, layers), neuron_post(model, source_tokens, layers))
            both = None if base_scales is None or source_scales is None else (base_scales, source_scales)
            neuron_out[idx] = neuron_scores(model, graph, senders, neuron_index, lambda layer, g=g: g,
                                            base_tokens, source_tokens, onehot, post=post, scales=both)
            count += 2
            if receiver_out is not None and neuron_grad_sum is not None:
                receiver_out[idx] = neuron_receiver_scores(model, senders, senders, receiver_index,
                                                           neuron_grad_sum / len(alphas), diff, onehot, post=post,
                                                           scales=both)
        passes += count
        per_batch.append(count)
    release_freed_memory()  # the gradient runs are done; what runs next should not add to their peak
    out = {"scores": scores, "passes": passes, "passes_per_batch": max(per_batch), "batches": len(batches),
           "batch_size": batch_size, "max_memory": budget}
    if neuron_out is not None:
        out.update(neuron_scores=neuron_out, neuron_edges=neuron_names)
    if receiver_out is not None:
        out.update(neuron_receiver_scores=receiver_out, neuron_receiver_edges=receiver_names)
    return out
