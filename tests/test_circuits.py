"""Circuits: a planted circuit in a hand-built attention-only model, exact edges, EAP-IG, results."""

from __future__ import annotations

import re

import pytest
import torch

import arithinterp as ai
from arithinterp.circuits import (
    Circuit,
    Graph,
    attribute_edges,
    circuit_faithfulness,
    faithfulness,
    minimality,
    overlap,
    patch_edges,
    prune,
    run_edge_sets,
    score_edges,
    threshold,
    top_n,
)
from arithinterp.errors import ArithInterpError

PLANTED = {"embed->L0H0.v", "L0H0->logits"}


def _planted_model(tokenizer):
    """One layer, two heads, no norms, d_model 32. Dims 0..9: the number 0..9 (one-hot), dims
    10..17: the position, dims 20..29: a side channel the unembedding ignores. Head 0 (A) attends
    from the final position (4) to the first operand (1) and copies it into dims 0..9, which the
    unembedding reads; head 1 (B) attends to the same operand and copies it into the side channel,
    so it carries the operand but does nothing useful."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(d_model=32, d_head=16, n_heads=2, n_layers=1, n_ctx=8, d_vocab=len(tokenizer), attn_only=True,
                                  normalization_type=None, seed=0, act_fn="relu", positional_embedding_type="standard")
    model = TransformerBridge.boot_native(cfg, tokenizer=tokenizer).eval()
    number = [tokenizer.convert_tokens_to_ids(str(n)) for n in range(10)]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.original_component.weight[number, torch.arange(10)] = 1.0
        model.pos_embed.original_component.weight[torch.arange(8), 10 + torch.arange(8)] = 1.0
        attn = model.blocks[0].attn
        q, k, v, o = (getattr(attn, n).original_component.weight for n in "qkvo")  # [out, in]
        q[0, 14], k[0, 11] = 10.0, 10.0  # head A: query at position 4, key at position 1
        q[16, 14], k[16, 11] = 10.0, 10.0  # head B: the same pattern
        v[torch.arange(10), torch.arange(10)] = 1.0  # head A's value: the number
        v[16 + torch.arange(10), torch.arange(10)] = 1.0  # head B's value: the number
        o[torch.arange(10), torch.arange(10)] = 1.0  # head A writes the number back
        o[20 + torch.arange(10), 16 + torch.arange(10)] = 1.0  # head B writes the side channel
        model.unembed.original_component.weight[number, torch.arange(10)] = 10.0
    return model


def operand_logit_diff(logits, pairs):
    """Logit of the clean first operand minus the corrupt one (what head A copies)."""
    rows = torch.arange(len(pairs))
    pos = pairs.clean.positions["a"]
    good, bad = pairs.clean.tokens[rows, pos], pairs.corrupt.tokens[rows, pos]
    return logits.gather(-1, good[:, None].to(logits.device))[:, 0] - logits.gather(-1, bad[:, None].to(logits.device))[:, 0]


@pytest.fixture(scope="module")
def planted(number_tokenizer):
    model = _planted_model(number_tokenizer)
    prompts = ai.tasks.arithmetic(model, op="+", a=range(10), b=range(4), template="{a}+{b}=")
    return model, prompts.counterfactual(vary="a", seed=0)


def test_planted_model_copies_the_operand(planted):
    model, pairs = planted
    logits = model(pairs.clean.tokens)[:, -1]
    assert torch.equal(logits[:, :].argmax(-1), pairs.clean.tokens[:, 1])


def test_path_patching_recovers_exactly_the_planted_edges(planted):
    model, pairs = planted
    graph = Graph.of(model)
    got = patch_edges(model, pairs, graph, operand_logit_diff, progress=False)
    gap = (got["clean"] - got["corrupt"]).mean()
    scores = got["scores"].mean(0)
    found = {graph.edges[i].name for i in torch.nonzero(scores.abs() > 1e-3 * gap).flatten().tolist()}
    assert found == PLANTED
    for name in PLANTED:  # each planted edge alone restores the whole effect
        assert scores[graph.index([name])].item() == pytest.approx(float(gap), rel=1e-4)


def test_control_head_carries_the_operand_but_no_edge_of_it_matters(planted):
    model, pairs = planted
    from arithinterp.engine.edges import sender_outputs

    clean, _ = sender_outputs(model, pairs.clean.tokens)
    corrupt, _ = sender_outputs(model, pairs.corrupt.tokens)
    graph = Graph.of(model)
    head_b = graph.layout.head_sender(0, 1)
    assert (clean[:, -1, head_b] - corrupt[:, -1, head_b]).abs().max() > 0.5  # B moves the operand
    scores = patch_edges(model, pairs, graph, operand_logit_diff, progress=False)["scores"].mean(0)
    b_edges = [i for i, e in enumerate(graph.edges) if "L0H1" in (e.sender, e.receiver)]
    assert scores[b_edges].abs().max() < 1e-4


def test_every_edge_restores_one_and_no_edge_zero(planted):
    model, pairs = planted
    for positions in (None, ["a", "b", "final"]):
        graph = Graph.of(model, positions)
        sets = torch.stack([torch.ones(graph.n_edges), torch.zeros(graph.n_edges)])
        got = run_edge_sets(model, pairs, graph, sets, operand_logit_diff)
        norm = (got["values"].mean(0) - got["corrupt"].mean()) / (got["clean"].mean() - got["corrupt"].mean())
        assert norm[0].item() == pytest.approx(1.0, abs=1e-4)
        assert norm[1].item() == pytest.approx(0.0, abs=1e-4)


def test_positional_edges_find_the_operand_and_final_positions(planted):
    model, pairs = planted
    circuit = score_edges(model, pairs, "exact", positions=["a", "b", "final"], metric=operand_logit_diff, progress=False)
    kept = threshold(circuit, 1e-3 * float(circuit.scores.abs().max()))
    assert set(kept.kept_edges) == {"embed->L0H0.v@a", "L0H0->logits@final"}
    assert kept.nodes == ["embed", "L0H0", "logits"]


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_attribution_ranks_the_planted_edges_first(planted, method):
    model, pairs = planted
    circuit = score_edges(model, pairs, method, steps=4, metric=operand_logit_diff, progress=False)
    assert set(top_n(circuit, 2).kept_edges) == PLANTED
    passes = circuit.meta["passes_per_batch"]
    assert passes == (3 if method == "eap" else 2 + 2 * 4)
    assert passes <= 2 * (4 + 1)


def test_eap_ig_agrees_with_exact_patching_on_a_random_model(tiny_model):
    prompts = ai.tasks.arithmetic(tiny_model, op="+", a=range(8), b=range(3), template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="a", seed=0)
    exact = patch_edges(tiny_model, pairs, progress=False)["scores"].mean(0)
    ig = attribute_edges(tiny_model, pairs, method="eap-ig", steps=5, progress=False)["scores"].mean(0)
    assert torch.corrcoef(torch.stack([exact, ig]))[0, 1] > 0.9
    shuffled = ig[torch.randperm(len(ig), generator=torch.Generator().manual_seed(0))]
    assert abs(torch.corrcoef(torch.stack([exact, shuffled]))[0, 1]) < 0.5  # the control


def test_faithfulness_curve_minimality_pruning_and_overlap(planted):
    model, pairs = planted
    circuit = score_edges(model, pairs, "eap-ig", steps=3, metric=operand_logit_diff, progress=False)
    curve = faithfulness(model, pairs, circuit, sizes=[0, 1, 2, 5, circuit.n_edges], metric=operand_logit_diff)
    assert curve.values[0].item() == pytest.approx(0.0, abs=1e-4)
    assert curve.values[2].item() == pytest.approx(1.0, abs=1e-4)  # the two planted edges suffice
    assert curve.values[-1].item() == pytest.approx(1.0, abs=1e-4)
    assert curve.smallest(0.9) == 2
    mean_curve = faithfulness(model, pairs, circuit, sizes=[2], ablation="mean", metric=operand_logit_diff)
    assert mean_curve.values[0].item() == pytest.approx(1.0, abs=1e-4)
    small = top_n(circuit, 2)
    drops = minimality(model, pairs, small, metric=operand_logit_diff)
    assert (drops["loss"] > 0.99).all()  # each planted edge is necessary
    pruned = prune(model, pairs, top_n(circuit, 6), tau=0.01, metric=operand_logit_diff, progress=False)
    assert set(pruned.kept_edges) == PLANTED
    assert circuit_faithfulness(model, pairs, pruned, metric=operand_logit_diff) == pytest.approx(1.0, abs=1e-4)
    both = overlap(pruned, top_n(circuit, 3))
    assert both["edges_shared"] == 2 and both["edge_jaccard"] == pytest.approx(2 / 3)


def test_circuit_result_round_trips_and_plots(planted, tmp_path):
    model, pairs = planted
    circuit = top_n(score_edges(model, pairs, "eap", positions=["a", "final"], metric=operand_logit_diff, progress=False), 3)
    frame = circuit.to_frame()
    assert len(frame) == circuit.n_edges and frame["kept"].sum() == 3
    loaded = Circuit.load(circuit.save(tmp_path / "c"))
    assert loaded.kept_edges == circuit.kept_edges and torch.equal(loaded.scores, circuit.scores)
    assert loaded.graph().n_edges == circuit.n_edges
    fig = loaded.plot()
    hover = " ".join(str(t) for trace in fig.data for t in (trace.text or []))
    assert "embed->L0H0.v@a" in hover and "score" in hover
    curve = faithfulness(model, pairs, circuit, sizes=[0, 3], metric=operand_logit_diff)
    assert curve.plot().layout.xaxis.title.text == "edges kept"


def test_bad_input_is_refused_with_what_is_accepted(planted):
    model, pairs = planted
    with pytest.raises(ArithInterpError, match="accepted"):
        score_edges(model, pairs, "acdc")
    with pytest.raises(ArithInterpError, match="steps"):
        attribute_edges(model, pairs, steps=0)
    with pytest.raises(ArithInterpError, match="unknown position"):
        score_edges(model, pairs, "eap", positions=["c"], metric=operand_logit_diff)
    graph = Graph.of(model)
    with pytest.raises(ArithInterpError, match="unknown edge"):
        graph.index(["embed->nowhere"])
    with pytest.raises(ArithInterpError, match="n_edges"):
        run_edge_sets(model, pairs, graph, torch.ones(1, 3))
    circuit = score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False)
    with pytest.raises(ArithInterpError, match="0.."):
        top_n(circuit, circuit.n_edges + 1)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gptj"])
def test_edge_runs_are_exact_on_hugging_face_families(family, number_tokenizer, tmp_path):
    """Joint-QKV (GPT-2), rotary with grouped-query attention and RMSNorm (Llama), parallel blocks
    sharing one norm (GPT-J): every edge carrying the source output reproduces the source run,
    no edge the base run, and EAP-IG follows exact patching."""
    from hf_families import save_family

    model = ai.load_model(str(save_family(family, number_tokenizer, tmp_path / family)))
    pairs = ai.tasks.arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=1).counterfactual(vary="a", seed=0)[:6]
    graph = Graph.of(model)
    got = run_edge_sets(model, pairs, graph, torch.stack([torch.ones(graph.n_edges), torch.zeros(graph.n_edges)]))
    gap = (got["clean"] - got["corrupt"]).abs().mean()
    assert (got["values"][:, 0] - got["clean"]).abs().max() < 1e-4 * gap
    assert (got["values"][:, 1] - got["corrupt"]).abs().max() < 1e-4 * gap
    exact = patch_edges(model, pairs, graph, progress=False)["scores"].mean(0)
    ig = attribute_edges(model, pairs, graph, method="eap-ig", steps=5, progress=False)["scores"].mean(0)
    assert torch.corrcoef(torch.stack([exact, ig]))[0, 1] > 0.7


def test_report_stage_finds_a_small_faithful_circuit_on_the_zoo_model():
    from arithinterp.models.zoo import ZOO, zoo_prompts
    from arithinterp.report import Context, NotEnoughData, circuits_stage

    model = ai.load_model("zoo:add-100")
    grid = [(a, b) for a in range(0, 100, 7) for b in range(3, 100, 11)]
    prompts = zoo_prompts(model, ZOO["add-100"], [a for a, _ in grid], [b for _, b in grid])
    prompts = prompts[prompts.evaluate(model).correct]
    pairs = prompts.counterfactual(vary="a", seed=0, distinct_first_token=True)
    ctx = Context(model, "zoo:add-100", prompts, prompts, None, pairs, n_pairs=40)
    section = circuits_stage(ctx)
    found = re.search(r"The (\d+) top edges \(([\d.]+)% of all\) restore 0.9", " ".join(section.findings))
    assert found and 0 < int(found.group(1)) < 110
    assert len(section.figures) == 2 and section.sample.startswith("40 counterfactual pairs")
    with pytest.raises(NotEnoughData):
        circuits_stage(Context(model, "zoo:add-100", prompts, prompts, None, pairs[:10]))


def test_a_residual_stream_that_is_not_a_sum_of_senders_is_refused(number_tokenizer, tmp_path):
    """Gemma-2 norms attention and MLP outputs before adding them: its graph would be wrong."""
    from hf_families import save_family

    model = ai.load_model(str(save_family("gemma2", number_tokenizer, tmp_path / "gemma2")))
    pairs = ai.tasks.arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=1).counterfactual(vary="a", seed=0)[:4]
    with pytest.raises(ArithInterpError, match="not the sum of the embeddings, head and MLP outputs"):
        patch_edges(model, pairs, progress=False)
