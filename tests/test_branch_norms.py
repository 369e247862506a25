"""Edges through norms on the branches (Gemma 2 and Gemma 3), with the norms' scales frozen.

Gemma 2 and 3 norm each attention and MLP output before adding it to the residual stream. With
the norm's denominator held at the base run's value the norm is linear, each head's output is a
term of the stream, and an edge is patched as anywhere else. Exact edges are checked against a
reference written here by hand (hooks and the norm's formula, ``x ⊙ (1 + w) / f``), EAP-IG against
exact edges, and the choice of ``score_edges(method="auto")`` against its cost estimate.
"""

from __future__ import annotations

import pytest
import torch
from hf_families import save_family

import arithinterp as ai
from arithinterp.circuits import EdgeGraph, attribute_edges, patch_edges, score_edges
from arithinterp.errors import ArithInterpError
from arithinterp.tasks import arithmetic

FAMILIES = ["gemma2", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def gemma(request, number_tokenizer, tmp_path_factory):
    model = ai.load_model(str(save_family(request.param, number_tokenizer, tmp_path_factory.mktemp(request.param))))
    return request.param, model


def _pairs(model, seed: int = 0, n: int = 6):
    """Two-shot pairs varying ``a``, every prompt the same length (the reference runs them unpadded)."""
    pairs = arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=2).counterfactual(vary="a", seed=seed)[:n]
    assert pairs.clean.lengths.unique().numel() == 1 and pairs.corrupt.lengths.unique().numel() == 1
    return pairs


def answer_logit_diff(logits, pairs):
    """The clean answer's first token's logit minus the corrupt one's."""
    rows = torch.arange(len(pairs))
    good, bad = pairs.clean.answer_tokens[:, 0].to(logits.device), pairs.corrupt.answer_tokens[:, 0].to(logits.device)
    return logits[rows, good] - logits[rows, bad]


def _reference(model, pairs) -> dict:
    """Every edge's exact score (denoising: the corrupt run with one edge carrying the clean run's
    sender output), written out here: the senders from the two cached runs, each branch norm
    replaced by ``x ⊙ (1 + w) / f`` with ``f`` the corrupt run's denominator, and the edge's
    ``δ = clean − corrupt`` sender output added to its receiver's input alone."""
    base, source = pairs.corrupt.tokens, pairs.clean.tokens
    cfg, blocks = model.cfg, model.blocks
    H, d_head, n_layers = cfg.n_heads, cfg.d_head, cfg.n_layers
    with torch.no_grad():
        _, base_cache = model.run_with_cache(base)
        _, source_cache = model.run_with_cache(source)

    def gain(layer, name):
        return 1.0 + getattr(blocks[layer], name).original_component.weight.detach().float()

    def senders(cache) -> dict:
        out = {"embed": cache["blocks.0.hook_resid_pre"].float()}
        for layer in range(n_layers):
            z = cache[f"blocks.{layer}.attn.hook_z"].reshape(*base.shape, H, d_head).float()
            w_o = blocks[layer].attn.o.original_component.weight.detach().float()  # [d_model, H·d_head]
            f = cache[f"blocks.{layer}.ln1_post.hook_scale"].float()
            for h in range(H):
                out[f"L{layer}H{h}"] = z[:, :, h] @ w_o[:, h * d_head:(h + 1) * d_head].T * gain(layer, "ln1_post") / f
            out[f"MLP{layer}"] = cache[f"blocks.{layer}.ln2_post.hook_out"].float()
        return out

    base_send, source_send = senders(base_cache), senders(source_cache)

    def frozen_norms() -> list:
        hooks, kept = [], {}
        for layer in range(n_layers):
            for name in ("ln1_post", "ln2_post"):
                f = base_cache[f"blocks.{layer}.{name}.hook_scale"].float()

                def keep(act, hook, key=(layer, name)):
                    kept[key] = act
                    return act

                def frozen(act, hook, key=(layer, name), f=f):
                    return (kept[key].float() * gain(*key) / f).to(act.dtype)

                hooks += [(f"blocks.{layer}.{name}.hook_in", keep), (f"blocks.{layer}.{name}.hook_out", frozen)]
        return hooks

    def receiver_hooks(receiver: str, channel: str, delta: torch.Tensor) -> list:
        if channel == "logits":
            return [("ln_final.hook_in", lambda act, hook: act + delta.to(act.dtype))]
        layer = int(receiver[3:] if channel == "mlp" else receiver[1:].split("H")[0])
        if channel == "mlp":
            return [(f"blocks.{layer}.ln2.hook_in", lambda act, hook: act + delta.to(act.dtype))]
        head = int(receiver.split("H")[1])
        if channel != "q":  # a shared key/value input is named after its group's first query head
            head //= H // int(cfg.n_key_value_heads)
        kept = {}

        def keep(act, hook):
            kept["x"] = act
            return act

        def project(act, hook):
            w = getattr(blocks[layer].attn, channel).original_component.weight.detach().float()  # [out, d_model]
            normed = blocks[layer].ln1.original_component(kept["x"] + delta.to(kept["x"].dtype)).float()
            new = normed @ w[head * d_head:(head + 1) * d_head].T
            out = act.reshape(*act.shape[:2], -1, d_head).clone()  # [B, T, heads, d_head] (the hook may split them)
            out[:, :, head] = new.to(act.dtype)
            return out.reshape(act.shape)

        return [(f"blocks.{layer}.ln1.hook_in", keep), (f"blocks.{layer}.attn.{channel}.hook_out", project)]

    def metric(hooks) -> torch.Tensor:
        with torch.no_grad():
            logits = model.run_with_hooks(base, fwd_hooks=frozen_norms() + hooks)
        return answer_logit_diff(logits[:, -1].float(), pairs)

    unpatched = metric([])
    scores = {}
    for edge in EdgeGraph.of(model).edges:
        delta = source_send[edge.sender] - base_send[edge.sender]
        scores[edge.name] = metric(receiver_hooks(edge.receiver, edge.channel, delta)) - unpatched
    return scores


@pytest.mark.parametrize("engine", ["auto", "hooks"])
def test_exact_edges_equal_a_reference_written_by_hand(gemma, engine):
    """Both engines, every edge alone, against the hand-written reference with frozen scales (≤ 1e-4)."""
    _, model = gemma
    pairs = _pairs(model)
    graph = EdgeGraph.of(model)
    reference = _reference(model, pairs)
    got = patch_edges(model, pairs, graph, answer_logit_diff, engine=engine, progress=False)
    expected = torch.stack([reference[e.name] for e in graph.edges], dim=1)  # [N, n_edges]
    assert expected.abs().max() > 0.1  # edges that matter: not a comparison of zeros
    assert float((got["scores"] - expected).abs().max()) <= 1e-4


def test_every_edge_carries_the_source_run_and_no_edge_the_base_run(gemma):
    """The clean run's senders along every edge (into the frozen-scale corrupt run) give the clean
    run's logits: each receiver's input is the clean run's, and so is each norm's denominator."""
    _, model = gemma
    pairs = _pairs(model)
    graph = EdgeGraph.of(model)
    for engine in ("auto", "hooks"):
        got = ai.circuits.run_edge_sets(model, pairs, graph, torch.stack([torch.ones(graph.n_edges),
                                                                          torch.zeros(graph.n_edges)]), engine=engine)
        gap = (got["clean"] - got["corrupt"]).abs().mean()
        assert gap > 0.1
        assert (got["values"][:, 0] - got["clean"]).abs().max() < 1e-4 * gap
        assert (got["values"][:, 1] - got["corrupt"]).abs().max() < 1e-6 * gap


def test_eap_ig_follows_exact_edges_on_held_out_pairs(gemma):
    """EAP-IG's gradients run through the norms frozen at the base run, as the exact edges are defined:
    Pearson correlation with exact patching on pairs of other operands than the development pairs
    (measured 0.97 on Gemma 2 and 0.91 on Gemma 3 here; 0.75-0.95 with other random weights), and a
    shuffled control."""
    _, model = gemma
    pairs = arithmetic(model, a=range(60, 99, 3), b=range(40, 80, 5), few_shot=2).counterfactual(vary="a", seed=1)[:12]
    graph = EdgeGraph.of(model)
    exact = patch_edges(model, pairs, graph, progress=False)["scores"].mean(0)
    ig = attribute_edges(model, pairs, graph, method="eap-ig", ig_steps=5, progress=False)["scores"].mean(0)
    assert float(torch.corrcoef(torch.stack([exact, ig]))[0, 1]) > 0.7
    shuffled = ig[torch.randperm(len(ig), generator=torch.Generator().manual_seed(0))]
    assert abs(float(torch.corrcoef(torch.stack([exact, shuffled]))[0, 1])) < 0.5


def test_a_stream_that_is_not_a_sum_of_senders_is_still_refused(gemma):
    """A block whose output is scaled (1.5 × what it adds up to) is not a sum of senders even with the
    norms' scales frozen: both engines refuse it."""
    _, model = gemma
    pairs = _pairs(model, n=4)

    def scaled(module, args, output):
        return (output[0] * 1.5, *output[1:]) if isinstance(output, tuple) else output * 1.5

    handle = model.blocks[0].original_component.register_forward_hook(scaled)
    try:
        for engine in ("auto", "hooks"):
            with pytest.raises(ArithInterpError, match="not the sum of the embeddings, head and MLP outputs"):
                patch_edges(model, pairs, engine=engine, progress=False)
    finally:
        handle.remove()
    assert patch_edges(model, pairs, progress=False)["scores"].isfinite().all()  # unscaled: edges again


def test_a_branch_norm_that_is_not_an_rms_norm_is_refused(gemma):
    """A LayerNorm (centring, with a bias) on the attention output is not linear with its scale frozen."""
    from arithinterp.engine.branch_norms import BranchNorms

    _, model = gemma
    norm = model.blocks[1].ln1_post
    original = norm.original_component
    layer_norm = torch.nn.LayerNorm(model.cfg.d_model)
    with torch.no_grad():
        layer_norm.bias.fill_(0.5)
    norm.set_original_component(layer_norm)
    try:
        with pytest.raises(ArithInterpError, match=r"blocks\.1\.ln1_post \(LayerNorm\) is not one"):
            BranchNorms.of(model)
    finally:
        norm.set_original_component(original)
    assert BranchNorms.of(model) is not None


@pytest.mark.parametrize("method", ["eap", "eap-ig", "eap-ig-activations"])
def test_neuron_edges_add_up_to_their_mlp_edge_through_the_frozen_norm(gemma, method):
    """A neuron's output through the MLP's norm is ``post_n / f · (W_out[n] ⊙ g)``: a layer's neuron
    edges into a receiver add up to its MLP's edge."""
    _, model = gemma
    pairs = _pairs(model, n=4)
    graph = EdgeGraph.of(model)
    got = attribute_edges(model, pairs, graph, method=method, ig_steps=2, progress=False, neurons={0: "all"})
    names, per_neuron = got["neuron_edges"], got["neuron_scores"]
    checked = 0
    for i, edge in enumerate(graph.edges):
        if edge.sender == "MLP0":
            target = edge.name.split("->")[1]
            cols = [j for j, n in enumerate(names) if n.startswith("MLP0N") and n.split("->")[1] == target]
            assert len(cols) == model.cfg.d_mlp
            gap = (per_neuron[:, cols].sum(1) - got["scores"][:, i]).abs().max()
            assert gap <= 1e-4 * got["scores"].abs().max()
            checked += 1
    assert checked > 0


# --- method="auto" ------------------------------------------------------------------------------------


def test_auto_picks_exact_edges_where_they_cost_about_as_much_as_eap_ig(gemma):
    """Few-shot pairs differing in their last problem, a 2-layer model: each exact edge runs a block or
    two over the last few positions, less than EAP-IG's 17 passes over every position."""
    from arithinterp.circuits.planning import AUTO_RATIO, edge_costs

    _, model = gemma
    pairs = _pairs(model)
    graph = EdgeGraph.of(model)
    costs = edge_costs(model, pairs, graph, steps=5)
    assert costs.stepped and costs.ratio < 1.0
    circuit = score_edges(model, pairs, "auto", progress=False)
    assert circuit.method == "exact" and circuit.meta["method_requested"] == "auto"
    assert circuit.meta["cost_ratio"] == pytest.approx(costs.ratio, abs=1e-3)
    assert circuit.meta["auto_ratio"] == AUTO_RATIO
    exact = patch_edges(model, pairs, graph, progress=False)["scores"]
    assert torch.allclose(circuit.pair_scores, exact, atol=1e-6)


def test_auto_picks_eap_ig_where_every_edge_is_a_whole_forward(gemma):
    """With whole forwards (``engine="hooks"``) every edge costs a forward of every block and
    position: 82 or 68 of them against EAP-IG's 17, so ``auto`` estimates and runs EAP-IG."""
    from arithinterp.circuits.planning import edge_costs

    _, model = gemma
    pairs = _pairs(model)
    graph = EdgeGraph.of(model)
    costs = edge_costs(model, pairs, graph, steps=5, engine="hooks")
    assert not costs.stepped
    assert costs.ratio == pytest.approx((2 + graph.n_edges) / (2 + 3 * 5), rel=1e-6)
    circuit = score_edges(model, pairs, "auto", engine="hooks", progress=False)
    assert circuit.method == "eap-ig" and circuit.meta["ig_steps"] == 5 and circuit.meta["method_requested"] == "auto"
    # more steps make EAP-IG dearer: exact patching again
    many = edge_costs(model, pairs, graph, steps=40, engine="hooks")
    assert many.ratio < 2.0
    with pytest.raises(ArithInterpError, match="method"):
        score_edges(model, pairs, "fastest", progress=False)
    with pytest.raises(ArithInterpError, match="steps"):
        score_edges(model, pairs, "auto", ig_steps=0, progress=False)


def test_attribution_graphs_are_exact_through_the_branch_norms(gemma):
    """An attribution graph freezes each branch norm's divisor with the other norms': edges plus
    bias give every active feature's pre-activation (Gemma 2 and 3), and on Gemma 3 the answer
    logits too. Gemma 2 soft-caps its logits (``tanh``), which no frozen divisor makes linear, so its
    logits are checked to differ: the check would catch a graph that is not exact."""
    from arithinterp.features import attribution_graph, train_transcoders

    family, model = gemma
    prompts = arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 2), few_shot=2)
    transcoders = train_transcoders(model, prompts, n_features=32, k=4, steps=30, batch_size=256, progress=False)
    graph = attribution_graph(model, prompts[:1], transcoders, n_logits=2, progress=False)
    assert graph.scores["n_active_features"] > 40
    assert graph.scores["max_abs_error"] <= 1e-5
    if family == "gemma3":
        assert graph.scores["max_rel_error_logits"] <= 1e-5
    else:
        assert graph.scores["max_rel_error_logits"] > 1e-3
