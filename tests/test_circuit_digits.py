"""Circuits per answer digit: teacher-forced digit pairs, digit-column counterfactuals, edge scores
per answer token on zoo:add-3digit (planted digit columns, exact references) and a random Llama
folder whose tokenizer splits numbers into digits."""

from __future__ import annotations

import pytest
import torch

import arithinterp as ai
from arithinterp import circuits, patching
from arithinterp.circuits import DigitCircuits, EdgeGraph, digit_circuits, run_edge_sets
from arithinterp.errors import ArithInterpError
from arithinterp.tasks import arithmetic


@pytest.fixture(scope="module")
def zoo():
    from arithinterp.models.zoo import get_entry, held_out_prompts

    model = ai.load_model("zoo:add-3digit")
    prompts = held_out_prompts(model, get_entry("add-3digit"), limit=24, seed=0).correct_only(model)
    return model, prompts


def _logit_diff(logits, clean_tok, corrupt_tok):
    return logits.gather(-1, clean_tok[:, None])[:, 0] - logits.gather(-1, corrupt_tok[:, None])[:, 0]


def test_digit_pairs_feed_the_answer_and_score_the_token_it_emits(zoo):
    model, prompts = zoo
    pairs = patching.vary_digit(prompts, "units", "a", seed=0)
    T = pairs.clean.tokens.shape[1]
    for k in range(4):
        for feed in ("own", "clean"):
            fed = patching.digit_pairs(pairs, k, feed)
            assert fed.clean.tokens.shape == fed.corrupt.tokens.shape == (len(pairs), T + k)
            assert torch.equal(fed.clean.tokens[:, T:], pairs.clean.answer_tokens[:, :k])
            source = pairs.clean if feed == "clean" else pairs.corrupt
            assert torch.equal(fed.corrupt.tokens[:, T:], source.answer_tokens[:, :k])
            assert torch.equal(fed.clean_answer_token, pairs.clean.answer_tokens[:, k])
            assert torch.equal(fed.corrupt_answer_token, pairs.corrupt.answer_tokens[:, k])
            assert torch.equal(fed.clean.positions["a"], pairs.clean.positions["a"])  # earlier labels kept
            assert int(fed.clean.positions["emit"][0]) == T + k - 1
            # the model's argmax at the new last position is the answer token it emits there
            with torch.inference_mode():
                emitted = model(fed.clean.tokens)[:, -1].argmax(-1)
            assert torch.equal(emitted, fed.clean_answer_token)
    fed = patching.digit_pairs(pairs, 1)
    same = pairs.clean.answer_tokens[:, 1] == pairs.corrupt.answer_tokens[:, 1]
    assert fed.meta["same_answer_token"] == int(same.sum())


def test_vary_digit_changes_one_column_only(zoo):
    _, prompts = zoo
    for column, place in enumerate(("units", "tens", "hundreds")):
        pairs = patching.vary_digit(prompts, place, "b", seed=3)
        diff = pairs.corrupt.b - pairs.clean.b
        assert torch.equal(pairs.corrupt.a, pairs.clean.a)
        assert (diff != 0).all() and (diff % 10**column == 0).all() and (diff.abs() < 10 ** (column + 1)).all()
        assert (pairs.corrupt.b >= 100).all()  # a leading digit never becomes 0
        assert pairs.vary == f"b_{place}" and pairs.meta["kept"] == len(prompts)
    both = patching.vary_digit(prompts, "tens", "both", seed=0)
    assert ((both.corrupt.a - both.clean.a) != 0).all() and ((both.corrupt.b - both.clean.b) != 0).all()
    again, other = patching.vary_digit(prompts, "tens", seed=5), patching.vary_digit(prompts, "tens", seed=6)
    assert torch.equal(again.corrupt.a, patching.vary_digit(prompts, "tens", seed=5).corrupt.a)  # seeded
    assert not torch.equal(again.corrupt.a, other.corrupt.a)


@pytest.mark.slow
def test_varying_one_column_moves_its_answer_digit_and_not_the_far_ones(zoo):
    """The planted property of digit addition: the units answer digit reads the units column (and
    only carries leave it), the hundreds column never reaches the units digit. Scored with the
    clean digit's log-probability, so an unchanged digit is not zero by definition."""
    model, prompts = zoo
    mass = {}
    for place in ("units", "hundreds"):
        pairs = patching.vary_digit(prompts, place, "a", seed=0)[:16]
        result = digit_circuits(model, pairs, "eap-ig", metric="logprob", ig_steps=4, progress=False)
        assert result.answer_tokens == [0, 1, 2, 3] and result.scores.shape == (4, EdgeGraph.of(model).n_edges)
        assert result.meta["answer_places"] == ["thousands", "hundreds", "tens", "units"]
        mass[place] = result.scores.abs().sum(1)  # [4]: answer[0] .. answer[3]
    units, hundreds = 3, 1  # the answer tokens that write those digits
    assert mass["units"][units] > 50 * mass["units"][hundreds]  # units column -> units digit, not hundreds
    assert mass["hundreds"][hundreds] > 50 * mass["hundreds"][units]  # the control: hundreds -> hundreds digit
    assert int(mass["units"].argmax()) == units and int(mass["hundreds"].argmax()) == hundreds


@pytest.mark.slow
def test_exact_digit_edges_equal_hand_patched_paths(zoo):
    """Exact scores against references built by hand with hooks on the teacher-forced tokens: a
    last-layer head's direct path into the logits, and every outgoing edge of a layer-0 head
    together (= patching the head's output)."""
    model, prompts = zoo
    pairs = patching.vary_digit(prompts, "hundreds", "a", seed=0)[:6]
    result = digit_circuits(model, pairs, "exact", answer_tokens=[0, 1], progress=False)
    graph = EdgeGraph.of(model)
    last = model.cfg.n_layers - 1
    for k in (0, 1):
        fed = patching.digit_pairs(pairs, k)
        clean, corrupt = fed.clean.tokens, fed.corrupt.tokens
        ct, rt = fed.clean_answer_token, fed.corrupt_answer_token
        with torch.inference_mode():
            _, cache_c = model.run_with_cache(clean)
            _, cache_r = model.run_with_cache(corrupt)
            base = _logit_diff(model(corrupt)[:, -1], ct, rt)
            for h in range(model.cfg.n_heads):
                z = f"blocks.{last}.attn.hook_z"
                delta = (cache_c[z][:, :, h] - cache_r[z][:, :, h]) @ model.W_O[last, h]
                hook = (f"blocks.{last}.hook_out", lambda x, hook, delta=delta: x + delta)  # the direct path only
                hooked = model.run_with_hooks(corrupt, fwd_hooks=[hook])
                reference = _logit_diff(hooked[:, -1], ct, rt) - base
                got = result.pair_scores[result.answer_tokens.index(k), :, result.edges.index(f"L{last}H{h}->logits")]
                assert (got - reference).abs().max() <= 1e-5 * max(1.0, float(reference.abs().max()))

            def patch_head(z, hook, h=3):
                z = z.clone()
                z[:, :, h] = cache_c["blocks.0.attn.hook_z"][:, :, h]
                return z

            node = _logit_diff(model.run_with_hooks(corrupt, fwd_hooks=[("blocks.0.attn.hook_z", patch_head)])[:, -1],
                               ct, rt) - base
        outgoing = torch.tensor([[float(e.sender == "L0H3") for e in graph.edges]])
        together = run_edge_sets(model, fed, graph, outgoing)["values"][:, 0] - base
        assert (together - node).abs().max() <= 1e-5 * max(1.0, float(node.abs().max()))
        assert node.abs().max() > 0.1  # L0H3 carries the hundreds column: the check is not comparing zeros


@pytest.mark.slow
def test_eap_ig_tracks_exact_patching_on_every_digit_the_pairs_move(zoo):
    model, prompts = zoo
    pairs = patching.vary_digit(prompts, "tens", "a", seed=0)[:12]
    exact = digit_circuits(model, pairs, "exact", answer_tokens=[1, 2], progress=False)
    ig = digit_circuits(model, pairs, "eap-ig", answer_tokens=[1, 2], ig_steps=5, progress=False)
    table = ig.agreement(exact)
    assert list(table.answer_token) == [1, 2] and (table.pearson > 0.9).all()
    generator = torch.Generator().manual_seed(0)
    shuffled = ig.scores[1][torch.randperm(ig.scores.shape[1], generator=generator)]
    assert abs(float(torch.corrcoef(torch.stack([shuffled, exact.scores[1]]))[0, 1])) < 0.5  # the control
    assert float(exact.gap[1]) > 1.0  # the tens digit changes with the tens column


def test_a_digit_circuit_is_a_circuit_that_extracts_and_is_faithful(zoo):
    model, prompts = zoo
    pairs = patching.vary_digit(prompts, "units", "a", seed=0)[:8]
    result = digit_circuits(model, pairs, "eap-ig", answer_tokens=[3], ig_steps=3, progress=False)
    circuit = circuits.top_n(result.circuit(3), 20)
    assert circuit.n_kept == 20 and circuit.meta["answer_token"] == 3
    fed = patching.digit_pairs(pairs, 3)
    curve = circuits.faithfulness_curve(model, fed, result.circuit(3), sizes=[0, 20, circuit.n_edges])
    assert float(curve.faithfulness[-1]) == pytest.approx(1.0, abs=1e-5) and float(curve.faithfulness[1]) > 0.5
    names, per_sender = result.sender_scores()
    assert per_sender.shape == (len(names), 1)
    assert float(per_sender.sum()) == pytest.approx(float(result.scores.sum()), rel=1e-5)


def test_positional_digit_edges_sit_where_the_tokens_differ(zoo):
    """Varying a's tens digit: nothing before it changes (causal attention), so every edge at a's
    hundreds digit scores exactly 0, while the edges at the tens digit and at the emitting position
    carry the effect; the fed answer positions are labelled as the emitted token sees them."""
    model, prompts = zoo
    pairs = patching.vary_digit(prompts, "tens", "a", seed=0)[:6]
    positions = ["a[0]", "a[1]", "answer[0]", "emit"]
    result = digit_circuits(model, pairs, "eap", answer_tokens=[2], positions=positions, progress=False)
    size = result.scores[0].abs()
    mass = {p: float(size[[q == p for q in result.positions]].sum()) for p in positions}
    assert mass["a[0]"] == 0.0 and mass["a[1]"] > 1.0 and mass["emit"] > 1.0
    flat = digit_circuits(model, pairs, "eap", answer_tokens=[2], progress=False)
    every = ["final-8"] + [f"a[{i}]" for i in range(3)] + ["final-4", "b[0]", "b[1]", "b", "final", "answer[0]", "emit"]
    positional = digit_circuits(model, pairs, "eap", answer_tokens=[2], positions=every, progress=False)
    # EAP is linear: a position-free edge is the sum of its edges over every position
    index = {name: i for i, name in enumerate(flat.edges)}
    summed = torch.zeros(len(flat.edges))
    for name, score in zip(positional.edges, positional.scores[0].tolist()):
        summed[index[name.rsplit("@", 1)[0]]] += score
    assert torch.allclose(summed, flat.scores[0], atol=1e-4) and float(summed.abs().max()) > 1.0


@pytest.mark.slow
def test_multi_token_answers_of_a_digit_split_llama_folder(llama_model):
    model = llama_model("digit")
    prompts = arithmetic(model, a=range(10, 40), b=[13, 24], few_shot=2)  # answers 23..63: two digit tokens
    assert prompts.answer_tokens.shape[1] == 2
    pairs = patching.vary_digit(prompts, "tens", "a", seed=0)
    assert pairs.meta["dropped"] > 0 and pairs.meta["kept"] + pairs.meta["dropped"] == len(prompts)
    assert torch.equal(pairs.clean.n_answer_tokens, pairs.corrupt.n_answer_tokens)  # sums of 3 digits dropped
    pairs = pairs[:6]
    exact = digit_circuits(model, pairs, "exact", progress=False)
    ig = digit_circuits(model, pairs, "eap-ig", ig_steps=3, progress=False)
    graph = EdgeGraph.of(model)
    assert exact.scores.shape == ig.scores.shape == (2, graph.n_edges) and torch.isfinite(ig.pair_scores).all()
    for k in (0, 1):  # every outgoing edge of a head together = patching that head, by another engine
        fed = patching.digit_pairs(pairs, k)
        outgoing = torch.tensor([[float(e.sender == "L0H0") for e in graph.edges]])
        got = run_edge_sets(model, fed, graph, outgoing)
        together = got["values"][:, 0] - got["corrupt"]
        sweep = patching.activation_patching(model, fed, "attn_z", layers=[0], heads=[0], per_position=False,
                                             progress=False)
        node = sweep.values[:, 0, 0] - sweep.corrupt_baseline  # values are the patched metric
        assert (together - node).abs().max() <= 1e-5 * max(1.0, float(node.abs().max()))
        assert torch.allclose(exact.clean[k] - exact.corrupt[k], got["clean"] - got["corrupt"], atol=1e-5)
    assert exact.meta["same_answer_token"] == [0, len(pairs)]  # the units digit never changes with the tens


def test_result_round_trips_frames_and_plots(zoo, tmp_path):
    model, prompts = zoo
    pairs = patching.vary_digit(prompts, "units", "a", seed=0)[:4]
    result = digit_circuits(model, pairs, "eap", answer_tokens=[2, 3], progress=False)
    loaded = DigitCircuits.load(result.save(tmp_path / "digits"))
    assert torch.equal(loaded.scores, result.scores) and loaded.answer_tokens == [2, 3]
    assert torch.equal(loaded.circuit(3).scores, result.circuit(3).scores)
    frame = result.to_frame()
    assert len(frame) == 2 * result.scores.shape[1] and set(frame.answer_token) == {2, 3}
    heat = result.plot().data[0]
    assert list(heat["x"]) == ["answer[2] · tens", "answer[3] · units"] and "L0H0" in list(heat["y"])


def test_bad_input_is_refused_with_what_is_accepted(zoo, llama_model):
    model, prompts = zoo
    pairs = patching.vary_digit(prompts, "units", "a", seed=0)[:4]
    with pytest.raises(ArithInterpError, match=r"answer_token must be an integer in 0\.\.3"):
        patching.digit_pairs(pairs, 4)
    with pytest.raises(ArithInterpError, match="unknown feed 'mine'; accepted"):
        patching.digit_pairs(pairs, 1, feed="mine")
    with pytest.raises(ArithInterpError, match="unknown method"):
        digit_circuits(model, pairs, "acdc")
    with pytest.raises(ArithInterpError, match="distinct answer token"):
        digit_circuits(model, pairs, answer_tokens=[1, 1])
    with pytest.raises(ArithInterpError, match="was not scored; accepted"):
        digit_circuits(model, pairs, "eap", answer_tokens=[0], progress=False).circuit(2)
    with pytest.raises(ArithInterpError, match="has no thousands digit"):
        patching.vary_digit(prompts, "thousands", "a")
    with pytest.raises(ArithInterpError, match="unknown operand"):
        patching.vary_digit(prompts, "units", "c")
    llama = llama_model("digit")
    ragged = arithmetic(llama, a=range(90, 96), b=[4, 13])  # sums 94..108: two or three answer tokens
    ragged_pairs = patching.vary_digit(ragged, "units", "a", seed=0)
    with pytest.raises(ArithInterpError, match="have an answer without token 2"):
        patching.digit_pairs(ragged_pairs, 2)
