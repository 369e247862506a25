"""MLP neurons as receivers: exact patching of the edges into a neuron's own input, attribution
of them against it, and a planted neuron whose input only one head writes (with a shuffled control)."""

from __future__ import annotations

import pytest
import torch

import arithinterp as ai
from arithinterp.circuits import EdgeGraph, attribute_edges, patch_neuron_edges
from arithinterp.engine import Read, Write, run
from arithinterp.errors import ArithInterpError


def _pairs(model, n_a=8, n_b=3):
    return ai.tasks.arithmetic(model, op="+", a=range(n_a), b=range(n_b), template="{a}+{b}=").counterfactual(
        vary="a", seed=0)


def _exactness(model, pairs, layer, neuron):
    """Every upstream sender's edge into the neuron carrying the clean output, against the whole
    forward with the neuron's activation patched from the clean run: the largest logit gap."""
    graph = EdgeGraph.of(model)
    n_up = graph.layout.senders_before(layer, "mlp")
    edges = [f"{graph.senders[s].name}->MLP{layer}N{neuron}" for s in range(n_up)]
    got = patch_neuron_edges(model, pairs, neurons={layer: [neuron]}, edges=edges, progress=False)
    assert got["edges"] == edges and got["scores"].shape == (len(pairs), n_up)
    # the sum of every edge carried at once: one set (the engine's neuron inputs take edge weights)
    from arithinterp.circuits.neurons import neuron_inputs
    from arithinterp.engine.edges import EdgeForward, sender_outputs

    idx = torch.arange(len(pairs))
    base, source = pairs.corrupt.unpadded(idx), pairs.clean.unpadded(idx)
    source_send, _, _ = sender_outputs(model, source)
    B, T = base.shape
    inputs = neuron_inputs(model, [(layer, neuron)])
    with torch.inference_mode():
        every = EdgeForward(model).run(base, values=source_send, neurons=inputs,
                                       neuron_weights=lambda _layer: torch.ones(1, B, T, 1, n_up))["logits"][0, :, -1]
        none = EdgeForward(model).run(base, neurons=inputs)["logits"][0, :, -1]
        post = run(model, source, reads=[Read("mlp_post", layer)], logits="none").reads[0]
        patched = run(model, base, writes=[Write("mlp_post", layer, units=[neuron],
                                                               value=post[:, :, [neuron]])]).logits
        plain = run(model, base).logits
    assert patched is not None and plain is not None
    scale = float(plain.abs().max())
    return float((every - patched).abs().max()) / scale, float((none - plain).abs().max()) / scale


def test_every_edge_into_a_neuron_reproduces_patching_its_activation(tiny_model):
    """LayerNorm, ReLU MLP: carrying every upstream sender's clean output into neuron 5 of layer 1
    alone is patching that neuron's activation from the clean run (a whole forward), ≤ 1e-5;
    carrying none is the base run."""
    every, none = _exactness(tiny_model, _pairs(tiny_model), 1, 5)
    assert every <= 1e-5 and none <= 1e-6


def test_neuron_edges_are_exact_in_a_gated_mlp(number_tokenizer, tmp_path):
    """RMSNorm and a SwiGLU MLP (Llama): the neuron's gate and input projections are both recomputed."""
    from hf_families import save_family

    model = ai.load_model(str(save_family("llama", number_tokenizer, tmp_path / "llama")))
    pairs = ai.tasks.arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4)).counterfactual(vary="a", seed=0)[:6]
    every, none = _exactness(model, pairs, 1, 7)
    assert every <= 1e-5 and none <= 1e-6


def test_attribution_of_neuron_receiver_edges_follows_exact_patching(tiny_model):
    """EAP and EAP-IG scores of every edge into layer 1's neurons against exact patching of each
    edge alone (Pearson over the pair-mean scores), and the neuron → neuron edges into a neuron
    add up to its MLP → neuron edge (the MLP's output is the sum of its neurons')."""
    pairs = _pairs(tiny_model)
    exact = patch_neuron_edges(tiny_model, pairs, neurons={1: list(range(0, 128, 8))}, progress=False)
    for method in ("eap", "eap-ig"):
        got = attribute_edges(tiny_model, pairs, method=method, ig_steps=5, progress=False,
                              neurons={0: "all", 1: "all"})
        names, scores = got["neuron_receiver_edges"], got["neuron_receiver_scores"]
        assert scores.shape == (len(pairs), len(names)) and len(set(names)) == len(names)
        col = {n: i for i, n in enumerate(names)}
        est = scores[:, [col[e] for e in exact["edges"]]].mean(0)
        r = float(torch.corrcoef(torch.stack([est, exact["scores"].mean(0)]))[0, 1])
        assert r > 0.9, (method, r)
        for n in (0, 5, 77):
            parts = [i for i, e in enumerate(names) if e.startswith("MLP0N") and e.endswith(f"->MLP1N{n}")]
            assert len(parts) == tiny_model.cfg.d_mlp
            whole = scores[:, col[f"MLP0->MLP1N{n}"]]
            assert (scores[:, parts].sum(1) - whole).abs().max() <= 1e-5 * scores.abs().max()


def _plant(model, head: int = 2, neuron: int = 5, token: int = 5, shuffle: bool = False):
    """A model without norms in which neuron ``neuron`` of layer 1 reads a direction ``u`` that only
    head ``head`` of layer 0 writes (every other sender's output is projected off ``u``) and writes
    the unembedding of ``token``; with ``shuffle`` it reads ``u`` with its entries permuted."""
    params = dict(model.named_parameters())

    def weight(name):
        return params[name].data

    block = "layers.{}._original_component."
    o0 = weight(block.format(0) + "attn._original_component.o._original_component.weight")
    d_head = model.cfg.d_head
    u = o0[:, head * d_head].clone()
    u = (u - u.mean()) / (u - u.mean()).norm()
    off = torch.eye(len(u)) - torch.outer(u, u)
    with torch.no_grad():
        for name in ("tok_embed._original_component.weight", "pos._original_component.weight"):
            weight(name)[:] = weight(name) @ off
        others = [c for c in range(o0.shape[1]) if not head * d_head <= c < (head + 1) * d_head]
        o0[:, others] = off @ o0[:, others]
        for name in (block.format(0) + "attn._original_component.o._original_component.bias",
                     block.format(0) + "mlp._original_component.fc_out._original_component.weight",
                     block.format(0) + "mlp._original_component.fc_out._original_component.bias",
                     block.format(1) + "attn._original_component.o._original_component.weight",
                     block.format(1) + "attn._original_component.o._original_component.bias"):
            weight(name)[:] = off @ weight(name)
        mlp1 = block.format(1) + "mlp._original_component."
        read = u[torch.randperm(len(u), generator=torch.Generator().manual_seed(0))] if shuffle else u
        weight(mlp1 + "fc_in._original_component.weight")[neuron] = 4 * read
        weight(mlp1 + "fc_in._original_component.bias")[neuron] = 3.0  # on in every run
        unembed = weight("head._original_component.weight")[token]
        weight(mlp1 + "fc_out._original_component.weight")[:, neuron] = 4 * unembed / unembed.norm()
    return model


def test_a_neuron_that_reads_one_head_has_it_as_its_top_sender(number_tokenizer):
    """Planted: the only upstream sender along the neuron's input weights is head L0H2, so L0H2 →
    MLP1N5 is that neuron's top receiver edge by exact patching, EAP and EAP-IG, with all of its
    score. Control: the same neuron reading the direction shuffled — L0H2 keeps a small share."""
    from conftest import tiny_bridge

    def share(model):
        pairs = _pairs(model, 10, 4)
        metric = lambda logits, ctx: logits[:, 5]  # noqa: E731  (the planted neuron's token)
        exact = patch_neuron_edges(model, pairs, neurons={1: [5]}, metric=metric, progress=False)
        out = {"exact": (exact["edges"], exact["scores"].mean(0))}
        for method in ("eap", "eap-ig"):
            got = attribute_edges(model, pairs, method=method, ig_steps=3, metric=metric, progress=False,
                                  neurons={1: [5, 6]})
            keep = [i for i, e in enumerate(got["neuron_receiver_edges"]) if e.endswith("->MLP1N5")]
            names = [got["neuron_receiver_edges"][i] for i in keep]
            out[method] = (names, got["neuron_receiver_scores"][:, keep].mean(0))
        shares = {}
        for method, (names, scores) in out.items():
            top = names[int(scores.abs().argmax())]
            head = scores[names.index("L0H2->MLP1N5")].abs() / scores.abs().sum()
            shares[method] = (top, float(head))
        return shares

    planted = share(_plant(tiny_bridge(number_tokenizer, norm=None)))
    for method, (top, head) in planted.items():
        assert top == "L0H2->MLP1N5" and head > 0.99, (method, top, head)
    control = share(_plant(tiny_bridge(number_tokenizer, norm=None), shuffle=True))
    for method, (_top, head) in control.items():
        assert head < 0.3, (method, head)


def test_neuron_edge_input_is_checked(tiny_model):
    pairs = _pairs(tiny_model, 4, 2)
    with pytest.raises(ArithInterpError, match="named like 'embed->MLP1N3'"):
        patch_neuron_edges(tiny_model, pairs, neurons={1: [3]}, edges=["L0H0->MLP1N4"], progress=False)
    with pytest.raises(ArithInterpError, match="accepted"):
        patch_neuron_edges(tiny_model, pairs, neurons={1: [tiny_model.cfg.d_mlp]}, progress=False)
    with pytest.raises(ArithInterpError, match="accepted"):
        patch_neuron_edges(tiny_model, pairs, neurons={1: [3]}, direction="sideways", progress=False)


def test_neurons_as_senders_only_when_asked(tiny_model):
    pairs = _pairs(tiny_model, 4, 2)
    both = attribute_edges(tiny_model, pairs, method="eap", progress=False, neurons={1: [3, 4]})
    senders = attribute_edges(tiny_model, pairs, method="eap", progress=False, neurons={1: [3, 4]},
                              neuron_receivers=False)
    assert "neuron_receiver_scores" in both and "neuron_receiver_scores" not in senders
    for key in ("neuron_scores", "scores"):  # the recomputed projections are the model's own, to rounding
        assert (both[key] - senders[key]).abs().max() <= 1e-5 * senders[key].abs().max()
    with pytest.raises(ArithInterpError, match="True or False"):
        attribute_edges(tiny_model, pairs, method="eap", progress=False, neurons={1: [3]}, neuron_receivers="yes")  # pyright: ignore[reportArgumentType]
