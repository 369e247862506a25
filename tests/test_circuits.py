"""Circuits: a planted circuit in a hand-built attention-only model, exact edges, EAP-IG, results."""

from __future__ import annotations

import math
import re

import pytest
import torch

import arithinterp as ai
from arithinterp.circuits import (
    Circuit,
    EdgeGraph,
    attribute_edges,
    edge_faithfulness,
    faithfulness_curve,
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
    graph = EdgeGraph.of(model)
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

    clean, _, _ = sender_outputs(model, pairs.clean.tokens)
    corrupt, _, _ = sender_outputs(model, pairs.corrupt.tokens)
    graph = EdgeGraph.of(model)
    head_b = graph.layout.head_sender(0, 1)
    assert (clean[:, -1, head_b] - corrupt[:, -1, head_b]).abs().max() > 0.5  # B moves the operand
    scores = patch_edges(model, pairs, graph, operand_logit_diff, progress=False)["scores"].mean(0)
    b_edges = [i for i, e in enumerate(graph.edges) if "L0H1" in (e.sender, e.receiver)]
    assert scores[b_edges].abs().max() < 1e-4


def test_every_edge_restores_one_and_no_edge_zero(planted):
    model, pairs = planted
    for positions in (None, ["a", "b", "final"]):
        graph = EdgeGraph.of(model, positions)
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
    circuit = score_edges(model, pairs, method, ig_steps=4, metric=operand_logit_diff, progress=False)
    assert set(top_n(circuit, 2).kept_edges) == PLANTED
    passes = circuit.meta["passes_per_batch"]
    assert passes == (3 if method == "eap" else 2 + 2 * 4)
    assert passes <= 2 * (4 + 1)


@pytest.mark.slow
def test_eap_ig_agrees_with_exact_patching_on_a_random_model(tiny_model):
    prompts = ai.tasks.arithmetic(tiny_model, op="+", a=range(8), b=range(3), template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="a", seed=0)
    exact = patch_edges(tiny_model, pairs, progress=False)["scores"].mean(0)
    ig = attribute_edges(tiny_model, pairs, method="eap-ig", ig_steps=5, progress=False)["scores"].mean(0)
    assert torch.corrcoef(torch.stack([exact, ig]))[0, 1] > 0.9
    shuffled = ig[torch.randperm(len(ig), generator=torch.Generator().manual_seed(0))]
    assert abs(torch.corrcoef(torch.stack([exact, shuffled]))[0, 1]) < 0.5  # the control


def test_faithfulness_curve_minimality_pruning_and_overlap(planted):
    model, pairs = planted
    circuit = score_edges(model, pairs, "eap-ig", ig_steps=3, metric=operand_logit_diff, progress=False)
    curve = faithfulness_curve(model, pairs, circuit, sizes=[0, 1, 2, 5, circuit.n_edges], metric=operand_logit_diff)
    assert curve.faithfulness[0].item() == pytest.approx(0.0, abs=1e-4)
    assert curve.faithfulness[2].item() == pytest.approx(1.0, abs=1e-4)  # the two planted edges suffice
    assert curve.faithfulness[-1].item() == pytest.approx(1.0, abs=1e-4)
    assert curve.smallest(0.9) == 2
    mean_curve = faithfulness_curve(model, pairs, circuit, sizes=[2], ablation="mean", metric=operand_logit_diff)
    assert mean_curve.faithfulness[0].item() == pytest.approx(1.0, abs=1e-4)
    small = top_n(circuit, 2)
    drops = minimality(model, pairs, small, metric=operand_logit_diff)
    assert (drops.loss > 0.99).all()  # each planted edge is necessary
    pruned = prune(model, pairs, top_n(circuit, 6), tau=0.01, metric=operand_logit_diff, progress=False)
    assert set(pruned.kept_edges) == PLANTED
    assert edge_faithfulness(model, pairs, pruned, metric=operand_logit_diff).faithfulness == pytest.approx(1.0, abs=1e-4)
    both = overlap(pruned, top_n(circuit, 3))
    assert both.edges_shared == 2 and both.edge_jaccard == pytest.approx(2 / 3)


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
    curve = faithfulness_curve(model, pairs, circuit, sizes=[0, 3], metric=operand_logit_diff)
    assert curve.plot().layout.xaxis.title.text == "edges kept"


def test_bad_input_is_refused_with_what_is_accepted(planted):
    model, pairs = planted
    with pytest.raises(ArithInterpError, match="accepted"):
        score_edges(model, pairs, "acdc")
    with pytest.raises(ArithInterpError, match="steps"):
        attribute_edges(model, pairs, ig_steps=0)
    with pytest.raises(ArithInterpError, match="unknown position"):
        score_edges(model, pairs, "eap", positions=["c"], metric=operand_logit_diff)
    graph = EdgeGraph.of(model)
    with pytest.raises(ArithInterpError, match="unknown edge"):
        graph.index(["embed->nowhere"])
    with pytest.raises(ArithInterpError, match="n_edges"):
        run_edge_sets(model, pairs, graph, torch.ones(1, 3))
    circuit = score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False)
    with pytest.raises(ArithInterpError, match="0.."):
        top_n(circuit, circuit.n_edges + 1)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "gptj", "gemma2", "gemma3"])
def test_edge_runs_are_exact_on_hugging_face_families(family, number_tokenizer, tmp_path):
    """Joint-QKV (GPT-2), rotary with grouped-query attention and RMSNorm (Llama), parallel blocks
    sharing one norm (GPT-J), norms on the attention and MLP outputs with their scales frozen
    (Gemma 2; Gemma 3 with QK-norm and two rotary bases): every edge carrying the source output
    reproduces the source run, no edge the base run, and EAP-IG follows exact patching."""
    from hf_families import save_family

    model = ai.load_model(str(save_family(family, number_tokenizer, tmp_path / family)))
    pairs = ai.tasks.arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=1).counterfactual(vary="a", seed=0)[:6]
    graph = EdgeGraph.of(model)
    got = run_edge_sets(model, pairs, graph, torch.stack([torch.ones(graph.n_edges), torch.zeros(graph.n_edges)]))
    gap = (got["clean"] - got["corrupt"]).abs().mean()
    assert (got["values"][:, 0] - got["clean"]).abs().max() < 1e-4 * gap
    assert (got["values"][:, 1] - got["corrupt"]).abs().max() < 1e-4 * gap
    exact = patch_edges(model, pairs, graph, progress=False)["scores"].mean(0)
    ig = attribute_edges(model, pairs, graph, method="eap-ig", ig_steps=5, progress=False)["scores"].mean(0)
    assert torch.corrcoef(torch.stack([exact, ig]))[0, 1] > 0.7


@pytest.mark.slow
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
    assert len(section.figures) == 1 and len(section.views) == 1 and section.sample.startswith("40 counterfactual pairs")
    assert section.views[0].data["slider"]["default"] == int(found.group(1))  # the page opens on the circuit found
    with pytest.raises(NotEnoughData):
        circuits_stage(Context(model, "zoo:add-100", prompts, prompts, None, pairs[:10]))


# --- faithfulness with intervals, and only when there is something to be a fraction of ---------------------


def _curve(sizes, values, low=None, high=None, note=None):
    """A FaithfulnessCurveResult with the given curve (what ``faithfulness_curve`` returns, minus the runs)."""
    from arithinterp.circuits import FaithfulnessCurveResult

    values = torch.tensor(values)
    distinguishable = note is None
    return FaithfulnessCurveResult(
        sizes=torch.tensor(sizes), faithfulness=values, ci_low=values if low is None else torch.tensor(low),
        ci_high=values if high is None else torch.tensor(high), metric_circuit=values, metric_full=1.0, metric_empty=0.0,
        n_edges=max(sizes), ablation="resample", method="eap-ig",
        meta=dict(denominator=dict(distinguishable=distinguishable), note=note, confidence=0.95))


def test_smallest_requires_the_curve_to_stay_above_the_target_not_its_first_crossing():
    # the curve of a real model: 0.88 at 256 edges, 1.02 at 1,024, 0.85 at 4,096, 0.97 at 16,384
    curve = _curve([0, 256, 1024, 4096, 16384, 70651], [0.0, 0.88, 1.02, 0.85, 0.97, 1.0],
                   low=[0.0, 0.80, 0.93, 0.78, 0.91, 1.0], high=[0.0, 0.95, 1.10, 0.93, 1.03, 1.0])
    assert curve.smallest(0.9) == 16384  # not 1,024, where it first crosses
    assert curve.smallest(0.8) == 256
    assert curve.smallest_interval(0.9) == (256, 16384)  # upper bounds stay above from 256, lower from 16,384
    assert curve.smallest_interval(0.95) == (16384, 70651)  # 0.93 at 4,096 may not reach 0.95
    assert curve.smallest(1.01) is None  # the curve does not end above the target
    assert _curve([0, 4, 8], [0.0, 0.95, 0.99]).smallest(0.9) == 4  # a rising curve: the first crossing
    with pytest.raises(ArithInterpError, match="target must be a finite number"):
        curve.smallest(float("nan"))


def test_faithfulness_sizes_are_sorted_so_smallest_is_right(planted):
    model, pairs = planted
    circuit = score_edges(model, pairs, "eap-ig", ig_steps=3, metric=operand_logit_diff, progress=False)
    n = circuit.n_edges
    curve = faithfulness_curve(model, pairs, circuit, sizes=[n, 0, 2], metric=operand_logit_diff)
    assert curve.sizes.tolist() == [0, 2, n]
    assert curve.faithfulness.tolist() == pytest.approx([0.0, 1.0, 1.0], abs=1e-4)
    assert curve.smallest(0.9) == 2  # in the order given, size n would have been the first to reach it


def test_interval_covers_the_planted_faithfulness_and_not_a_shifted_one():
    """Pairs with a planted faithfulness f(k) and pair-to-pair noise: the 95% bootstrap intervals
    over pairs cover f(k) in about 95% of draws; a curve shifted by 0.3 (the control) almost never."""
    from arithinterp.circuits.evaluation import _fractions

    generator = torch.Generator().manual_seed(0)
    f = torch.tensor([0.0, 0.3, 0.8, 0.95, 1.0])
    covered, shifted, draws = torch.zeros(5), torch.zeros(5), 200
    for seed in range(draws):
        none = torch.randn(30, generator=generator)
        gap = 2 + 0.8 * torch.randn(30, generator=generator)  # every edge minus none, per pair
        pair = none[:, None] + f * gap[:, None] + 0.5 * torch.randn(30, 5, generator=generator)
        got = _fractions(dict(pair=pair, clean=none + gap, none=none), seed=seed)
        assert got["note"] is None and got["denominator"]["distinguishable"]
        covered += ((got["low"] <= f) & (f <= got["high"])).float()
        shifted += ((got["low"] <= f + 0.3) & (f + 0.3 <= got["high"])).float()
    assert ((covered / draws) > 0.88).all() and ((covered / draws) < 0.995).all()
    assert ((shifted / draws) < 0.1).all()


@pytest.fixture(scope="module")
def zoo_pairs():
    model = ai.load_model("zoo:add-100")
    pairs = ai.tasks.arithmetic(model, a=range(10, 30), b=range(20, 40)).counterfactual(vary="a", seed=0)
    return model, pairs


@pytest.mark.slow
def test_faithfulness_from_noisy_pairs_gives_smallest_with_its_interval(zoo_pairs):
    model, pairs = zoo_pairs
    many, few = pairs[:48], pairs[:12]
    circuit = score_edges(model, many, "eap-ig", ig_steps=3, progress=False)
    sizes = [0, 4, 8, 16, 24, 32, 48, 64, circuit.n_edges]
    curve = faithfulness_curve(model, many, circuit, sizes=sizes)
    assert curve.reported and curve.meta["denominator"]["ci_low"] > 0
    inner = slice(1, -1)
    assert (curve.ci_low <= curve.faithfulness + 1e-6).all() and (curve.faithfulness <= curve.ci_high + 1e-6).all()
    assert (curve.ci_high - curve.ci_low)[inner].max() > 0.01  # pairs differ: the interval has width
    assert curve.faithfulness[0].item() == pytest.approx(0.0, abs=1e-4)
    assert curve.faithfulness[-1].item() == pytest.approx(1.0, abs=1e-4)
    target = 0.8
    size = curve.smallest(target)
    low, high = curve.smallest_interval(target)
    assert size is not None and low is not None and high is not None
    assert low <= size <= high
    kept = curve.sizes >= size
    assert (curve.faithfulness[kept] >= target).all() and not bool(curve.faithfulness[curve.sizes == sizes[sizes.index(size) - 1]]
                                                              >= target)
    # fewer pairs, wider intervals; the same seed, the same intervals
    narrow = (curve.ci_high - curve.ci_low)[inner].mean()
    wide = faithfulness_curve(model, few, circuit, sizes=sizes)
    assert (wide.ci_high - wide.ci_low)[inner].mean() > 1.3 * narrow
    again = faithfulness_curve(model, many, circuit, sizes=sizes)
    assert torch.equal(again.ci_low, curve.ci_low) and torch.equal(again.ci_high, curve.ci_high)
    frame = curve.to_frame()
    assert {"ci_low", "ci_high", "note"} <= set(frame.columns) and (frame["note"] == "").all()
    fig = curve.plot()
    assert any(trace.fill == "toself" for trace in fig.data)  # the interval band
    assert "95% CI" in fig.data[1].hovertemplate


def _alternating(logits, pairs):
    """The operand logit difference with its sign flipped on pairs whose ``b`` is odd: every pair
    has an effect of ±10, the mean over pairs none."""
    b = torch.tensor([int(t) for t in pairs.clean.b]).to(logits.device)
    return operand_logit_diff(logits, pairs) * (1 - 2 * (b % 2)).to(logits.dtype)


@pytest.mark.parametrize("case", ["no effect", "effects that cancel"])
def test_no_fraction_when_every_edge_and_no_edge_are_indistinguishable(planted, number_tokenizer, case):
    """Head A copies ``a``: pairs varying ``b`` change nothing the logits read (no effect), and a
    metric whose sign follows ``b`` has per-pair effects of ±10 that average to 0. Either way the
    curve, the kept edges' faithfulness and minimality give no fraction and say why; prune refuses."""
    model, a_pairs = planted
    if case == "no effect":
        prompts = ai.tasks.arithmetic(model, op="+", a=range(10), b=range(4), template="{a}+{b}=")
        pairs, metric = prompts.counterfactual(vary="b", seed=0), "logit_diff"
    else:
        pairs, metric = a_pairs, _alternating
    circuit = score_edges(model, a_pairs, "eap-ig", ig_steps=3, metric=operand_logit_diff, progress=False)
    curve = faithfulness_curve(model, pairs, circuit, sizes=[0, 2, circuit.n_edges], metric=metric)
    assert not curve.reported and torch.isnan(curve.faithfulness).all() and torch.isnan(curve.ci_low).all()
    den = curve.meta["denominator"]
    assert den["ci_low"] <= 0 <= den["ci_high"] and not den["distinguishable"]
    assert "faithfulness not reported" in curve.note and "includes 0" in curve.note
    assert (curve.to_frame()["note"] == curve.note).all()
    assert not torch.isnan(curve.metric_circuit).any()  # the mean metric is still given
    with pytest.warns(RuntimeWarning, match="not reported"):
        assert curve.smallest(0.9) is None
    with pytest.warns(RuntimeWarning, match="not reported"):
        assert curve.smallest_interval(0.9) == (None, None)
    assert "not reported" in curve.plot().layout.title.text
    small = top_n(circuit, 2)
    kept = edge_faithfulness(model, pairs, small, metric=metric)
    assert not kept.reported and math.isnan(kept.faithfulness) and "includes 0" in kept.note
    assert kept.to_frame()["note"].tolist() == [kept.note] and not math.isnan(kept.metric_circuit)
    drops = minimality(model, pairs, small, metric=metric)
    assert not drops.reported and torch.isnan(drops.loss).all() and "includes 0" in drops.meta["note"]
    with pytest.raises(ArithInterpError, match="faithfulness is undefined.*includes 0"):
        prune(model, pairs, small, metric=metric, progress=False)
    # the control: the same circuit on pairs varying a, with the plain metric, is a fraction
    assert faithfulness_curve(model, a_pairs, circuit, sizes=[2], metric=operand_logit_diff).reported


# --- inputs that used to be accepted and give a silently wrong answer --------------------------------------


@pytest.mark.parametrize("batch_cells", [-1, 0, 1.5, True, "2"])
def test_batch_cells_must_be_a_positive_integer(planted, batch_cells):
    model, pairs = planted
    circuit = score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False)
    with pytest.raises(ArithInterpError, match=r"batch_cells=.* is not accepted .*batch_cells accepts a positive int .* or None"):
        faithfulness_curve(model, pairs, circuit, sizes=[0, 2], metric=operand_logit_diff, batch_cells=batch_cells)
    with pytest.raises(ArithInterpError, match=r"batch_cells=.* is not accepted .*batch_cells accepts a positive int .* or None"):
        minimality(model, pairs, top_n(circuit, 2), metric=operand_logit_diff, batch_cells=batch_cells)


def test_batch_cells_larger_than_the_sets_runs_them_all(planted):
    model, pairs = planted
    circuit = score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False)
    one = faithfulness_curve(model, pairs, circuit, sizes=[0, 1, 2], metric=operand_logit_diff, batch_cells=1)
    many = faithfulness_curve(model, pairs, circuit, sizes=[0, 1, 2], metric=operand_logit_diff, batch_cells=10**6)
    assert torch.allclose(one.faithfulness, many.faithfulness, atol=1e-5) and one.sizes.tolist() == many.sizes.tolist()


DECLARED_SIZES = r"sizes accepts a list of non-negative ints"  # the signature's words (no circuit needed)


@pytest.mark.parametrize("sizes,match", [
    (5, r"sizes=5 is not accepted"), ("ab", r"sizes='ab' is not accepted"), ([None], r"sizes=\[None\] \(item \[0\]"),
    ([0, 2.7], r"sizes=\[0, 2\.7\] \(item \[1\]: 2\.7\)"), ([-1], r"sizes=\[-1\] \(item \[0\]: -1\)"),
    ([True], r"sizes=\[True\]"), ([], "sizes is empty"), ([2, 2], r"sizes \[2\] appear more than once"),
    ("too many", r"sizes='too many' is not accepted"),
])
def test_bad_sizes_are_refused_with_what_is_accepted(planted, sizes, match):
    model, pairs = planted
    circuit = score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False)
    with pytest.raises(ArithInterpError, match=match) as info:
        faithfulness_curve(model, pairs, circuit, sizes=sizes, metric=operand_logit_diff)
    said = str(info.value)
    assert f"0..{circuit.n_edges}" in said or "once" in said or DECLARED_SIZES in said
    with pytest.raises(ArithInterpError, match=rf"sizes\[0\] = {circuit.n_edges + 1}"):
        faithfulness_curve(model, pairs, circuit, sizes=[circuit.n_edges + 1], metric=operand_logit_diff)


def test_sizes_accept_numpy_and_torch_integers(planted):
    import numpy as np

    model, pairs = planted
    circuit = score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False)
    for sizes in (np.array([0, 2]), torch.tensor([0, 2]), [np.int64(0), np.int64(2)], range(0, 3, 2)):
        assert faithfulness_curve(model, pairs, circuit, sizes=sizes, metric=operand_logit_diff).sizes.tolist() == [0, 2]


@pytest.mark.parametrize("value", [float("nan"), True, -0.5, float("inf"), "0.1", None])
def test_threshold_refuses_what_is_not_a_finite_non_negative_number(planted, value):
    model, pairs = planted
    circuit = score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False)
    with pytest.raises(ArithInterpError, match=r"threshold: value=.* is not accepted .*value accepts a finite number >= 0"):
        threshold(circuit, value)
    with pytest.raises(ArithInterpError, match="n=True is not accepted"):
        top_n(circuit, True)


@pytest.mark.parametrize("tau", [-0.1, 1.5, float("inf"), float("nan"), True])
def test_prune_refuses_tau_outside_zero_to_one(planted, tau):
    model, pairs = planted
    circuit = score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False)
    with pytest.raises(ArithInterpError, match=r"prune: tau=.* is not accepted .*tau accepts a number in \[0, 1\]"):
        prune(model, pairs, top_n(circuit, 3), tau=tau, metric=operand_logit_diff, progress=False)


def test_repeated_positions_are_refused(planted):
    model, pairs = planted
    with pytest.raises(ArithInterpError, match=r"positions \['a'\] appear more than once"):
        score_edges(model, pairs, "eap", positions=["a", "a"], metric=operand_logit_diff, progress=False)
    assert EdgeGraph.of(model, "final").positions == ["final"]  # a string is one position, never its letters


def test_overlap_refuses_a_position_free_and_a_per_position_circuit(planted):
    model, pairs = planted
    free = top_n(score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False), 3)
    per = top_n(score_edges(model, pairs, "eap", positions=["a", "final"], metric=operand_logit_diff, progress=False), 3)
    with pytest.raises(ArithInterpError, match="different graphs: one is position-free"):
        overlap(free, per)
    def planted_at(positions):
        exact = score_edges(model, pairs, "exact", positions=positions, metric=operand_logit_diff, progress=False)
        return threshold(exact, 1e-3 * float(exact.scores.abs().max()))

    with pytest.warns(RuntimeWarning, match="different positions"):
        both = overlap(planted_at(["a", "final"]), planted_at(["a", "b", "final"]))
    assert both.shared_edges == ["L0H0->logits@final", "embed->L0H0.v@a"]


@pytest.mark.parametrize("field", ["scores", "pair_scores", "kept", "senders", "edges"])
def test_a_damaged_saved_circuit_is_refused_naming_the_file_and_field(planted, tmp_path, field):
    import dataclasses

    from arithinterp.errors import ResultFileError

    model, pairs = planted
    circuit = score_edges(model, pairs, "eap", metric=operand_logit_diff, progress=False)
    value = getattr(circuit, field)
    short = value[..., :-3] if isinstance(value, torch.Tensor) else value[:-3]
    path = dataclasses.replace(circuit, **{field: short}).save(tmp_path / field)
    with pytest.raises(ResultFileError) as info:
        Circuit.load(path)
    message = str(info.value)
    assert str(path) in message and ("result.json" in message or "tensors.safetensors" in message)
    assert field in message or field == "edges" and "edges" in message


def test_report_stage_prints_no_fraction_when_nothing_is_restored(planted):
    """Pairs varying ``b``, which the planted model ignores: the circuits stage states why there
    is no fraction and prints none."""
    from arithinterp.report import Context, circuits_stage

    model, _ = planted
    prompts = ai.tasks.arithmetic(model, op="+", a=range(10), b=range(4), template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="b", seed=0)
    section = circuits_stage(Context(model, "planted", prompts, prompts, None, pairs, n_pairs=len(pairs)))
    text = " ".join(section.findings)
    assert text.startswith("No signal above the control") and "faithfulness not reported" in text and "includes 0" in text
    assert "restore 0.9" not in text and "top edges" not in text
    assert len(section.figures) == 1 and "not reported" in section.figures[0].layout.title.text


# --- EAP-IG on activations ------------------------------------------------------------------------


def test_eap_ig_on_activations_ranks_the_planted_edges_first(planted):
    model, pairs = planted
    circuit = score_edges(model, pairs, "eap-ig-activations", ig_steps=4, metric=operand_logit_diff, progress=False)
    assert set(top_n(circuit, 2).kept_edges) == PLANTED
    assert circuit.method == "eap-ig-activations" and circuit.meta["ig_steps"] == 4
    # one layer: the embeddings and the heads are the sender groups; the base run's gradient is shared
    assert circuit.meta["passes_per_batch"] == 2 + 2 * (1 + 3 * 2)


def test_eap_ig_on_activations_at_one_step_is_eap(tiny_model):
    prompts = ai.tasks.arithmetic(tiny_model, op="+", a=range(8), b=range(3), template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="a", seed=0)
    eap = attribute_edges(tiny_model, pairs, method="eap", progress=False)["scores"]
    one = attribute_edges(tiny_model, pairs, method="eap-ig-activations", ig_steps=1, progress=False)["scores"]
    assert (one - eap).abs().max() <= 1e-5 * eap.abs().max()
    five = attribute_edges(tiny_model, pairs, method="eap-ig-activations", ig_steps=5, progress=False)["scores"]
    assert (five - eap).abs().max() > 1e-3 * eap.abs().max()  # more steps do move away from the base gradient


def test_eap_ig_on_activations_tracks_exact_patching_on_the_zoo():
    """On zoo:add-100 integrating over the senders' outputs follows exact edge patching at least as
    closely as integrating over the input does (measured: Pearson 0.989 against 0.971 on 40 pairs)."""
    from arithinterp.models.zoo import ZOO, zoo_prompts

    model = ai.load_model("zoo:add-100")
    pairs = zoo_prompts(model, ZOO["add-100"]).correct_only(model).counterfactual(vary="a", seed=0)[:24]
    exact = patch_edges(model, pairs, progress=False)["scores"].mean(0)
    r, scores = {}, torch.empty(0)
    for method in ("eap-ig", "eap-ig-activations"):
        scores = attribute_edges(model, pairs, method=method, ig_steps=5, progress=False)["scores"].mean(0)
        r[method] = float(torch.corrcoef(torch.stack([exact, scores]))[0, 1])
    assert r["eap-ig-activations"] > 0.95 and r["eap-ig-activations"] >= r["eap-ig"] - 0.01
    shuffled = scores[torch.randperm(len(scores), generator=torch.Generator().manual_seed(0))]
    assert abs(float(torch.corrcoef(torch.stack([exact, shuffled]))[0, 1])) < 0.5  # the control


# --- MLP neurons as senders -----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eap", "eap-ig", "eap-ig-activations"])
def test_neuron_edges_add_up_to_their_mlp_edge(tiny_model, method):
    prompts = ai.tasks.arithmetic(tiny_model, op="+", a=range(8), b=range(3), template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="a", seed=0)
    graph = EdgeGraph.of(tiny_model)
    got = attribute_edges(tiny_model, pairs, graph, method=method, ig_steps=3, progress=False, neurons={0: "all", 1: "all"})
    names, per_neuron = got["neuron_edges"], got["neuron_scores"]
    assert per_neuron.shape == (len(pairs), len(names)) and len(set(names)) == len(names)
    for i, edge in enumerate(graph.edges):
        if edge.sender.startswith("MLP"):
            target = edge.name.split("->")[1]
            cols = [j for j, n in enumerate(names) if n.startswith(edge.sender + "N") and n.split("->")[1] == target]
            assert len(cols) == tiny_model.cfg.d_mlp
            gap = (per_neuron[:, cols].sum(1) - got["scores"][:, i]).abs().max()
            assert gap <= 1e-5 * got["scores"].abs().max()


def test_a_planted_neuron_ranks_top_and_a_silenced_one_scores_zero(number_tokenizer):
    """Neuron 7 of layer 0 is given an output along the unembedding of token 5 (the metric is that
    token's logit): its edge into the logits is the top neuron edge. The control neuron 3 has its
    output weights zeroed: every edge of it scores exactly 0; in the unplanted model neuron 7 is
    nowhere near the top."""
    from conftest import tiny_bridge

    def scores(model):
        prompts = ai.tasks.arithmetic(model, op="+", a=range(10), b=range(4), template="{a}+{b}=")
        pairs = prompts.counterfactual(vary="a", seed=0)
        got = attribute_edges(model, pairs, method="eap-ig", ig_steps=3, metric=lambda logits, ctx: logits[:, 5],
                              progress=False, neurons={0: "all"})
        return got["neuron_edges"], got["neuron_scores"].mean(0)

    before_names, before = scores(tiny_bridge(number_tokenizer))
    model = tiny_bridge(number_tokenizer)
    with torch.no_grad():
        W_out, W_U = model.blocks[0].mlp.W_out, model.W_U
        W_out[7] = 4.0 * W_U[:, 5] / W_U[:, 5].norm()
        W_out[3] = 0.0
    names, planted_scores = scores(model)
    assert names == before_names
    top = names[int(planted_scores.abs().argmax())]
    assert top == "MLP0N7->logits"
    silenced = [j for j, n in enumerate(names) if n.startswith("MLP0N3->")]
    assert silenced and bool((planted_scores[silenced] == 0).all())
    seven = [j for j, n in enumerate(names) if n.startswith("MLP0N7->")]
    assert before[seven].abs().max() < 0.1 * planted_scores.abs().max()  # the control: unplanted, it is no outlier
    with pytest.raises(ArithInterpError, match="accepted"):
        attribute_edges(model, ai.tasks.arithmetic(model, a=range(3), b=range(2)).counterfactual(vary="a", seed=0),
                        neurons={0: [model.cfg.d_mlp]}, progress=False)


def test_curve_sizes_are_no_edge_the_powers_of_two_and_every_edge():
    circuits = ai.circuits
    sizes = circuits.curve_sizes(70_651)
    assert sizes[:3] == [0, 1, 2] and sizes[-2:] == [65_536, 70_651] and len(sizes) == 19
    assert circuits.curve_sizes(8) == [0, 1, 2, 4, 8] and circuits.curve_sizes(0) == [0]
    with pytest.raises(ArithInterpError, match=r"curve_sizes: n_edges=-1 is not accepted .*n_edges accepts a non-negative int"):
        circuits.curve_sizes(-1)
