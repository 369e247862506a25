"""Feature circuits: transcoders recover a planted MLP feature, the replacement model, the engine's
input-site interventions, saving and loading, and the shipped zoo transcoders."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_bridge

from arithinterp.engine import Read, Write, run
from arithinterp.errors import ConfigError, ModelSpecError, SiteError
from arithinterp.features import Transcoders, load_transcoders, train_transcoders
from arithinterp.features.replacement import replacement_logits
from arithinterp.features.rows import answer_sequences
from arithinterp.features.training import mlp_activations
from arithinterp.tasks import prompts_for_pairs


def planted_model(tokenizer, digit: int, seed: int = 0):
    """A one-layer model without norms whose MLP computes one feature, ``[t ≡ digit (mod 10)]`` of
    each number token ``t``, written along a fixed unit direction ``v``; attention writes nothing.

    The indicator is the AND of two embedding coordinates (``e0`` marks residues ``digit - 1`` and
    ``digit``, ``e1`` marks ``digit`` and ``digit + 1``), so it is not an affine function of the
    MLP input and the transcoder's linear skip cannot absorb it. Returns the model and ``v``.
    """
    model = tiny_bridge(tokenizer, n_layers=1, norm=None, seed=seed)
    params = dict(model.named_parameters())

    def find(*parts: str) -> torch.nn.Parameter:
        return next(p for k, p in params.items() if all(part in k for part in parts))

    embed, pos = find("tok_embed"), find("pos.")
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(embed.shape[1], generator=g)
    v = v / v.norm()
    with torch.no_grad():
        for p in (find("attn", ".o.", "weight"), find("attn", ".o.", "bias"), find("fc_in", "weight"),
                  find("fc_in", "bias"), find("fc_out", "weight"), find("fc_out", "bias")):
            p.zero_()
        pos[:, :2] = 0.0
        embed[:, :2] = 0.0
        for token in range(embed.shape[0]):
            text = tokenizer.convert_ids_to_tokens(token)
            if text.isdigit():
                r = int(text) % 10
                embed[token, 0] = float(r in ((digit - 1) % 10, digit))
                embed[token, 1] = float(r in (digit, (digit + 1) % 10))
        find("fc_in", "weight")[0, :2] = 10.0
        find("fc_in", "bias")[0] = -15.0  # relu(10 e0 + 10 e1 - 15): 5 where both are 1, else 0
        find("fc_out", "weight")[:, 0] = v
    return model, v


def full_tokens(prompts):
    """Prompts of one length with all but their last answer token fed: ``(tokens, valid, n_answer)``."""
    (group,) = answer_sequences(prompts)
    tokens = group.tokens[group.prompts.argsort()]
    return tokens, torch.ones_like(tokens, dtype=torch.bool), int(group.n_answer[0])

def _selectivity(model, transcoders: Transcoders, tokens, valid, digit: int):
    """Per feature: correlation of its activation with ``[token mod 10 == digit]`` over number positions."""
    ins, _ = mlp_activations(model, tokens, [0])
    x = ins[0][valid]
    text = model.tokenizer.convert_ids_to_tokens(tokens[valid].tolist())
    number = torch.tensor([t.isdigit() for t in text])
    target = torch.tensor([t.isdigit() and int(t) % 10 == digit for t in text]).float()[number]
    acts = transcoders.encode(0, x[number])
    acts, target = acts - acts.mean(0), target - target.mean()
    return (acts * target[:, None]).sum(0) / (acts.norm(dim=0) * target.norm()).clamp_min(1e-12)


@pytest.fixture(scope="module")
def planted(number_tokenizer):
    a = torch.arange(100).repeat_interleave(20)
    b = torch.randint(0, 100, (2000,), generator=torch.Generator().manual_seed(1))
    out = {}
    for kind, digit in (("planted", 6), ("control", 3)):
        model, v = planted_model(number_tokenizer, digit)
        prompts = prompts_for_pairs(model, "+", a.tolist(), b.tolist(), "{a}+{b}=")
        # no skip: a linear skip takes over the affine part of the planted AND, splitting the feature
        tc = train_transcoders(model, prompts, n_features=32, k=4, steps=300, batch_size=512, skip=False, seed=0,
                               encoder_scale=1.0, resample_until=0.8, progress=False)
        tokens, valid, _ = full_tokens(prompts)
        out[kind] = (model, v, tc, tokens, valid)
    return out


@pytest.mark.slow
def test_transcoder_recovers_the_planted_feature(planted):
    model, v, tc, tokens, valid = planted["planted"]
    corr = _selectivity(model, tc, tokens, valid, 6)
    best = int(corr.argmax())
    assert float(corr[best]) >= 0.8
    cosine = torch.nn.functional.cosine_similarity(tc.W_dec[0, best], v, dim=0)
    assert float(cosine) >= 0.9
    assert tc.metrics["layers"][0]["fvu"] <= 0.05
    assert torch.equal(tc.W_skip, torch.zeros_like(tc.W_skip))


@pytest.mark.slow
def test_no_feature_for_a_digit_the_mlp_does_not_compute(planted):
    # control: the same model built around "ends in 3"; no feature tracks "ends in 6"
    model, _, tc, tokens, valid = planted["control"]
    assert float(_selectivity(model, tc, tokens, valid, 6).max()) < 0.5
    assert float(_selectivity(model, tc, tokens, valid, 3).max()) >= 0.8


def test_input_site_intervention_sees_that_site(tiny_model):
    tokens = torch.randint(3, 100, (4, 6), generator=torch.Generator().manual_seed(0))
    seen = []

    def keep_and_zero(x):
        seen.append(x.clone())
        return torch.zeros_like(x)

    out = run(tiny_model, tokens, [Write("mlp_out", 1, value=keep_and_zero, input_site="mlp_in")],
              reads=[Read("mlp_in", 1), Read("mlp_out", 1)])
    assert torch.allclose(seen[0], out.reads[0])
    assert float(out.reads[1].abs().max()) == 0.0
    zeroed = run(tiny_model, tokens, [Write("mlp_out", 1, value=0.0)]).logits
    assert out.logits is not None and zeroed is not None
    assert torch.allclose(out.logits, zeroed, atol=1e-5)


def test_input_site_intervention_refuses_units_and_constant_values(tiny_model):
    tokens = torch.randint(3, 100, (2, 5))
    with pytest.raises(SiteError, match="function value"):
        run(tiny_model, tokens, [Write("mlp_out", 0, value=1.0, input_site="mlp_in")])
    with pytest.raises(SiteError, match="unknown site"):
        run(tiny_model, tokens, [Write("mlp_out", 0, value=lambda x: x, input_site="mlp_nowhere")])


@pytest.mark.slow
def test_feature_edits_move_the_replacement_logits(planted, tmp_path):
    model, _, tc, tokens, _ = planted["planted"]
    batch = tokens[:16]
    base = replacement_logits(model, tc, batch)
    same = replacement_logits(model, tc, batch, edits={0: lambda acts: acts})
    zero = replacement_logits(model, tc, batch, edits={0: torch.zeros_like})
    assert torch.allclose(base, same)
    assert float((base - zero).abs().max()) > 1e-3
    loaded = Transcoders.load(tc.save(tmp_path / "tc"))
    assert torch.equal(loaded.W_dec, tc.W_dec) and loaded.metrics == tc.metrics
    frame = loaded.to_frame()
    assert list(frame["layer"]) == [0] and {"fvu", "l0", "dead_fraction", "replacement_agreement"} <= set(frame)
    assert len(loaded.plot().data) == 2


@pytest.mark.slow
def test_bad_arguments_say_what_is_accepted(planted):
    model, _, tc, _, _ = planted["planted"]
    prompts = prompts_for_pairs(model, "+", [1, 2, 3], [4, 5, 6], "{a}+{b}=")
    with pytest.raises(ConfigError, match="k=8 exceeds n_features=4"):
        train_transcoders(model, prompts, n_features=4, k=8, progress=False)
    with pytest.raises(ConfigError, match="held_out"):
        train_transcoders(model, prompts, held_out=1.5, progress=False)
    with pytest.raises(SiteError, match="no transcoder for layer 3"):
        tc.interventions(layers=[3])
    with pytest.raises(ModelSpecError, match="transcoders ship for"):
        load_transcoders("zoo:modadd-113")


@pytest.mark.parametrize("name", ["add-100", "add-3digit"])
def test_shipped_transcoders_replace_the_zoo_mlps(name):
    from arithinterp.features.replacement import replacement_metrics
    from arithinterp.models import load_model
    from arithinterp.models.zoo import get_entry, held_out_prompts

    model = load_model(f"zoo:{name}")
    tc = load_transcoders(f"zoo:{name}")
    card = tc.metrics  # measured on the recipe's held-out prompts when they were made
    assert all(row["l0"] <= 32 and row["fvu"] <= 0.10 and row["dead_fraction"] < 0.05 for row in card["layers"])
    prompts = held_out_prompts(model, get_entry(name), limit=200, seed=1)
    measured = replacement_metrics(model, prompts, tc)
    assert measured.agreement >= 0.95 and measured.n_positions == measured.kls.numel()


def _planted_with_transcoders(tokenizer, digit: int):
    """The planted model with its feature ``v`` wired to the ``6`` logit, and transcoders trained on it."""
    model, v = planted_model(tokenizer, digit)
    head = next(p for k, p in model.named_parameters() if k.startswith("head"))
    six = tokenizer.convert_tokens_to_ids("6")
    with torch.no_grad():
        head[six] += 10 * v
    a = torch.arange(100).repeat_interleave(20)
    b = torch.randint(0, 100, (2000,), generator=torch.Generator().manual_seed(1))
    prompts = prompts_for_pairs(model, "+", a.tolist(), b.tolist(), "{a}+{b}=")
    tc = train_transcoders(model, prompts, n_features=32, k=4, steps=300, batch_size=512, skip=False, seed=0,
                           encoder_scale=1.0, resample_until=0.8, progress=False)
    return model, v, six, tc


def _graph_through_planted(tokenizer, digit: int):
    """The graph of ``59+36`` (last token ``36``) on a planted model whose unembedding reads ``v`` as
    the token ``6`` (planted: the MLP writes ``5 v`` there, worth 50 on that logit); returns the graph
    and the net direct effect on the ``6`` logit of the features writing along ``v`` (0 when ``6`` is
    not among the graph's answer logits)."""
    from arithinterp.features.graph import prompt_graph

    model, v, six, tc = _planted_with_transcoders(tokenizer, digit)
    graph = prompt_graph(model, "59+36", tc, n_logits=3)
    edges = graph.to_frame()
    edges = edges[(edges["source_kind"] == "feature") & (edges["target_kind"] == "logit")
                  & (edges["target_feature"] == six)]
    aligned = torch.nn.functional.cosine_similarity(tc.W_dec[0, list(edges["source_feature"])], v[None], dim=1)
    weights = torch.tensor(edges["weight"].to_numpy())
    return graph, float(weights[aligned >= 0.9].sum())


@pytest.mark.slow
def test_graph_routes_the_answer_through_the_planted_feature(number_tokenizer, tmp_path):
    graph, effect = _graph_through_planted(number_tokenizer, 6)
    assert graph.scores["max_abs_error"] <= 1e-4  # edges + bias = each target's own value
    assert effect >= 25, effect
    assert graph.node_frame().query("kind == 'logit'")["token"].tolist()[0] == "6"
    loaded = type(graph).load(graph.save(tmp_path / "graph"))
    assert torch.equal(loaded.edges, graph.edges) and loaded.scores == graph.scores
    assert len(loaded.plot().data) > 2


@pytest.mark.slow
def test_graph_of_a_model_without_the_feature_does_not(number_tokenizer):
    # control: the MLP computes "ends in 3", which 36 does not: nothing is written along v at the last token
    graph, effect = _graph_through_planted(number_tokenizer, 3)
    assert graph.scores["max_abs_error"] <= 1e-4
    assert abs(effect) < 5, effect


def test_graph_edges_are_exact_on_a_two_layer_model_with_norms(tiny_model):
    from arithinterp.features.graph import prompt_graph

    a = torch.arange(100).repeat_interleave(5)
    b = torch.randint(0, 100, (500,), generator=torch.Generator().manual_seed(1))
    prompts = prompts_for_pairs(tiny_model, "+", a.tolist(), b.tolist(), "{a}+{b}=")
    tc = train_transcoders(tiny_model, prompts, n_features=32, k=4, steps=30, batch_size=256, progress=False)
    graph = prompt_graph(tiny_model, "36+59=", tc, n_logits=2, max_nodes=30)
    assert graph.scores["max_abs_error"] <= 1e-5 and graph.scores["max_rel_error_logits"] <= 1e-5
    assert graph.scores["n_kept"] <= 30 and 0 < graph.scores["completeness"] <= 1
    # finite differences: switching one layer-0 feature off moves a layer-1 target by its edge weight
    frame = graph.to_frame()
    edge = frame[(frame["source_kind"] == "feature") & (frame["target_kind"] == "feature")].iloc[0]
    nodes = graph.node_frame()
    src, tgt = nodes.iloc[int(edge["source"])], nodes.iloc[int(edge["target"])]
    tokens = tiny_model.to_tokens("36+59=")
    x0 = run(tiny_model, tokens, reads=[Read("mlp_in", 0)]).reads[0]
    eps = 1e-3

    def nudge(acts):
        acts = acts.clone()
        acts[0, int(src["position"]), int(src["feature"])] *= 1 - eps
        return acts

    del x0
    from arithinterp.features.attribution import frozen_state

    state = frozen_state(tiny_model, tokens)
    frozen = [Write(site, layer, value=value) for (site, layer), value in state["frozen"].items()]
    reads = [Read("mlp_in", 1)]
    errors = state["got"][("mlp_out", 0)] - tc(0, state["got"][("mlp_in", 0)])

    def layer0(edit):
        def value(x):
            acts = edit(tc.encode(0, x))
            return tc.decode(0, acts, x) + errors
        return Write("mlp_out", 0, value=value, input_site="mlp_in")

    base = run(tiny_model, tokens, [*frozen, layer0(lambda a: a)], reads=reads).reads[0]
    moved = run(tiny_model, tokens, [*frozen, layer0(nudge)], reads=reads).reads[0]
    pre = [tc.pre(1, base)[0, int(tgt["position"]), int(tgt["feature"])],
           tc.pre(1, moved)[0, int(tgt["position"]), int(tgt["feature"])]]
    assert float(pre[0] - pre[1]) / eps == pytest.approx(float(edge["weight"]), rel=1e-2, abs=1e-3)


@pytest.mark.slow
def test_zeroing_the_planted_feature_removes_the_answer_and_a_random_feature_does_not(number_tokenizer):
    from arithinterp.features.interventions import intervened_logits as intervene

    model, v, six, tc = _planted_with_transcoders(number_tokenizer, 6)
    tokens = model.to_tokens("59+36")
    real = run(model, tokens).logits
    assert real is not None
    cosine = torch.nn.functional.cosine_similarity(tc.W_dec[0], v[None], dim=1).abs()  # along v, either sign
    acts = tc.encode(0, run(model, tokens, reads=[Read("mlp_in", 0)]).reads[0])[0]  # [T, F]
    carriers = [f for f in range(tc.n_features) if cosine[f] >= 0.9 and acts[-1, f] > 0]
    others = [f for f in range(tc.n_features) if cosine[f] < 0.5 and bool((acts[:, f] > 0).any())]
    assert carriers and others  # the control zeroes features active in the prompt that write across v
    unchanged = intervene(model, tokens, tc, 0, carriers, scale=1.0)
    zeroed = intervene(model, tokens, tc, 0, carriers, scale=0.0)
    control = intervene(model, tokens, tc, 0, others, scale=0.0)
    assert torch.allclose(unchanged, real, atol=1e-5)  # the error term stays: no change, no effect
    assert float(real[0, six] - zeroed[0, six]) >= 25  # the planted 5 v is worth 50 on that logit
    assert abs(float(real[0, six] - control[0, six])) < 5


@pytest.mark.slow
def test_labels_name_the_planted_feature_and_not_shuffled_maps(planted):
    from arithinterp.features.labels import label_features
    from arithinterp.tasks import arithmetic

    model, v, tc, _, _ = planted["planted"]
    prompts = arithmetic(model, "+", range(100), range(100), "{a}+{b}=")
    aligned = torch.nn.functional.cosine_similarity(tc.W_dec[0], v[None], dim=1) >= 0.9
    features = aligned.nonzero().squeeze(1).tolist()
    table = label_features(model, prompts, tc, 0, features, positions=-2)  # at b
    frame = table.to_frame(labelled_only=True)
    assert "b mod 10 = 6" in set(frame["heuristic"])
    assert table.meta["control"]["shuffled"]["labelled"] == 0  # the same maps, cells shuffled: no label


def test_lookup_table_family_marks_one_residue_pair():
    from arithinterp.features.labels import LOOKUP_FAMILY, lookup_registry
    from arithinterp.neurons.heuristics import build_heuristics

    heuristics = build_heuristics(range(100), range(100), "+", registry=lookup_registry(), families=[LOOKUP_FAMILY])
    assert len(heuristics.names) == 100 and "a mod 10 = 6 and b mod 10 = 9" in heuristics.names


def test_graph_command_prints_the_scores(capsys, tmp_path):
    import json

    from arithinterp.cli import main

    assert main(["graph", "zoo:add-100", "36+59=", "--json", "--out", str(tmp_path / "g")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["scores"]["max_abs_error"] <= 1e-4 and summary["scores"]["n_kept"] <= 100
    assert summary["top_features"] and (tmp_path / "g" / "result.json").exists()
    assert main(["graph", "zoo:modadd-113", "1 2 =", "--json"]) == 2  # no transcoders ship for it


def test_report_stage_shows_the_shipped_transcoders_and_a_graph(tmp_path):
    import html
    import re

    from arithinterp.report import write_report

    out = write_report("zoo:add-100", out=tmp_path / "r.html", stages=["features"], limit=200, progress=False)
    text = html.unescape(out.read_text())
    agreement = re.search(r"Transcoders \(shipped;.*?keeps the model's top token at (\d\.\d+) of", text)
    assert agreement and float(agreement.group(1)) >= 0.9
    shares = re.search(r"Attribution graph of '\d+\+\d+=' .*?come (\d+)% from features, (\d+)% from token "
                       r"embeddings and (\d+)% from error nodes", text)
    assert shares and abs(sum(int(g) for g in shares.groups()) - 100) <= 2  # shares of one whole
    assert re.search(r"Supernodes .*?labelled ones hold \d+% of the kept features' influence", text)
    assert re.search(r"Swap test on \d+ problems .*?: (the labels predict the answer's change|no signal above the "
                     r"control)\.", text)
    assert text.count("class='figure'") == 1 and text.count("class='viewer'") == 1
    # the graph's interactive page, inline, with the kept features' operand plots
    assert '"kind":"graph"' in text and '"grids":[{"title":"L' in text


def test_report_stage_says_why_it_is_not_run_without_transcoders(tiny_model, tmp_path, monkeypatch):
    from arithinterp.errors import ModelSpecError
    from arithinterp.report import Context, features_stage

    monkeypatch.setenv("ARITHINTERP_CACHE", str(tmp_path))  # nothing cached
    with pytest.raises(ModelSpecError, match=r"no transcoders ship or are cached for tiny; `arithinterp "
                                             r"train-transcoders tiny` makes them \(into " + str(tmp_path)):
        features_stage(Context(tiny_model, "tiny", None, None, None, None))


def test_operand_grid_plot_shows_where_the_planted_feature_fires(planted):
    from arithinterp.features import feature_grids
    from arithinterp.tasks import arithmetic

    model, v, tc, _, _ = planted["planted"]
    prompts = arithmetic(model, "+", range(20), range(20), "{a}+{b}=")
    aligned = torch.nn.functional.cosine_similarity(tc.W_dec[0], v[None], dim=1)
    best, other = int(aligned.argmax()), int(aligned.abs().argmin())
    grids = feature_grids(model, prompts, tc, 0, [best, other], positions=-2, labels=["b ends in 6", ""])
    fig = grids.plot()
    assert len(fig.data) == 2 and fig.layout.annotations[0].text == f"L0 f{best}: b ends in 6"
    z = torch.tensor(fig.data[0].z)  # rows a, columns b = 0..19, read at b's own token
    assert int(z.mean(0).argmax()) % 10 == 6  # strongest where b ends in 6
    assert float(z.std(0).max()) < 1e-5  # and the same for every a: attention writes nothing in this model
    with pytest.raises(ConfigError, match="one label per feature"):
        feature_grids(model, prompts, tc, 0, [best], labels=["a", "b"])


def test_last_layer_edges_match_finite_differences(tiny_model):
    """A last-layer feature → logit edge is what switching that feature off in the frozen model
    (linear there, so no step size to pick) moves the demeaned logit by."""
    from arithinterp.features.attribution import frozen_state
    from arithinterp.features.graph import prompt_graph

    a = torch.arange(100).repeat_interleave(5)
    b = torch.randint(0, 100, (500,), generator=torch.Generator().manual_seed(1))
    prompts = prompts_for_pairs(tiny_model, "+", a.tolist(), b.tolist(), "{a}+{b}=")
    tc = train_transcoders(tiny_model, prompts, n_features=32, k=4, steps=30, batch_size=256, progress=False)
    graph = prompt_graph(tiny_model, "36+59=", tc, n_logits=1, progress=False)
    frame = graph.to_frame()
    last = frame[(frame["source_kind"] == "feature") & (frame["source_layer"] == 1) & (frame["target_kind"] == "logit")]
    assert len(last) > 0
    edge = last.loc[last["weight"].abs().idxmax()]
    src = graph.node_frame().iloc[int(edge["source"])]
    tokens = tiny_model.to_tokens("36+59=")
    state = frozen_state(tiny_model, tokens)
    frozen = [Write(site, layer, value=value) for (site, layer), value in state["frozen"].items()]
    errors = [state["got"][("mlp_out", layer)] - tc(layer, state["got"][("mlp_in", layer)]) for layer in (0, 1)]
    acts0 = tc.encode(0, state["got"][("mlp_in", 0)])  # layer 0 held at its own activations

    def replaced(scale: float):
        def value0(x):
            return tc.decode(0, acts0, x) + errors[0]

        def value1(x):
            acts = tc.encode(1, x).clone()
            acts[0, int(src["position"]), int(src["feature"])] *= scale
            return tc.decode(1, acts, x) + errors[1]

        out = run(tiny_model, tokens, [*frozen, Write("mlp_out", 0, value=value0, input_site="mlp_in"),
                                       Write("mlp_out", 1, value=value1, input_site="mlp_in")]).logits
        assert out is not None
        return float((out[0] - out[0].mean())[int(edge["target_feature"])])

    assert replaced(1.0) - replaced(0.0) == pytest.approx(float(edge["weight"]), rel=1e-2, abs=1e-4)


def test_a_capped_graph_expands_the_features_the_full_graph_finds_most_influential():
    """With ``max_feature_nodes`` the features are expanded in order of their influence through the
    edges known so far: the 20 chosen of add-3digit's 274 hold nearly what the 20 most influential
    of the full graph hold, far more than 20 drawn at random, and their rows are the full graph's."""
    from arithinterp.features.graph import prompt_graph
    from arithinterp.models import load_model

    model = load_model("zoo:add-3digit")
    tc = load_transcoders("zoo:add-3digit")
    full = prompt_graph(model, "136+259=", tc, n_logits=2, max_feature_nodes=None, progress=False)
    capped = prompt_graph(model, "136+259=", tc, n_logits=2, max_feature_nodes=20, progress=False)
    assert capped.scores["n_expanded_features"] == 20 and capped.scores["n_active_features"] == 274
    assert capped.scores["max_abs_error"] <= 1e-5 and capped.scores["max_rel_error_logits"] <= 1e-5
    assert capped.scores["max_error_of_terms"] <= 1e-4  # the stated tolerance: float32 rounding of the terms

    def key(frame):
        return list(zip(frame["layer"], frame["position"], frame["feature"]))

    nodes = full.node_frame()
    features = nodes[nodes["kind"] == "feature"]
    influence = dict(zip(key(features), features["influence"]))
    total = sum(influence.values())
    chosen = capped.node_frame().query("kind == 'feature'")
    share = sum(influence[k] for k in key(chosen)) / total
    best = features["influence"].nlargest(20).sum() / total
    drawn = torch.randperm(len(features), generator=torch.Generator().manual_seed(0))[:20]
    at_random = features["influence"].to_numpy()[drawn.numpy()].sum() / total
    assert share >= 0.95 * best and share > 3 * at_random, (share, best, at_random)
    # a chosen feature's incoming edges from the sources both graphs hold are the full graph's
    full_index = {k: i for i, k in enumerate(key(nodes))}
    capped_nodes = capped.node_frame()
    columns = [full_index[k] for k in key(capped_nodes) if k in full_index]
    both = [i for i, k in enumerate(key(capped_nodes)) if k in full_index]
    target = int(chosen.index[0])
    assert torch.allclose(capped.edges[target, both], full.edges[full_index[key(chosen)[0]], columns], atol=1e-5)


def test_graph_rows_equal_one_backward_per_target_through_the_real_model(monkeypatch):
    """The shortcuts of the graph's backwards (prefix runs for early targets, batches cut by layer,
    the real MLPs skipped where their outputs are replaced) change no edge: every row equals the
    backward of its target alone, on the whole prompt, with the real MLPs run; the model is as
    before afterwards."""
    import contextlib

    from arithinterp.features import attribution
    from arithinterp.models import load_model

    model, tc = load_model("zoo:add-3digit"), load_transcoders("zoo:add-3digit")
    tokens = model.to_tokens("17+5=22\n136+259=")
    before = run(model, tokens).logits
    kwargs = dict(n_logits=2, zero_positions=[0], max_feature_nodes=60, progress=False)
    fast = attribution.attribute(model, tokens, tc, batch_size=None, **kwargs)
    assert torch.equal(run(model, tokens).logits, before)
    with monkeypatch.context() as m:
        m.setattr(attribution, "PREFIXES", 1)
        m.setattr(attribution, "_real_mlps_skipped", lambda model: contextlib.nullcontext())
        plain = attribution.attribute(model, tokens, tc, batch_size=1, **kwargs)
    # (one target per backward also chooses by influence more often: the rows of the targets both hold)
    common = sorted(set(fast.targets.tolist()) & set(plain.targets.tolist()))
    assert tokens.shape[1] >= 12 and len(fast.targets) == 62 and len(common) >= 40
    fast_at = {t: i for i, t in enumerate(fast.targets.tolist())}
    plain_at = {t: i for i, t in enumerate(plain.targets.tolist())}
    rows = fast.rows[[fast_at[t] for t in common]], plain.rows[[plain_at[t] for t in common]]
    assert (rows[0] - rows[1]).abs().max() <= 1e-5 * rows[1].abs().max()
    assert torch.allclose(fast.bias[[fast_at[t] for t in common]], plain.bias[[plain_at[t] for t in common]],
                          rtol=1e-5, atol=1e-6)


def test_a_float64_models_graph_is_exact_to_float64_rounding():
    """What the exactness check leaves on a float32 model is rounding: the same model in float64
    (gradients, targets and bias in its precision) gives edges + bias = each value to 1e-12."""
    from arithinterp.features.graph import prompt_graph
    from arithinterp.models import load_model

    tc = load_transcoders("zoo:add-3digit")
    scores = [prompt_graph(load_model("zoo:add-3digit", dtype=dtype), "136+259=", tc, n_logits=2,
                           progress=False).scores for dtype in ("float32", "float64")]
    assert 1e-8 < scores[0]["max_abs_error"] <= 1e-5
    assert scores[1]["max_abs_error"] <= 1e-12 and scores[1]["max_abs_error_logits"] <= 1e-12
    assert scores[0]["max_error_of_terms"] <= 1e-4 and scores[1]["max_error_of_terms"] <= 1e-12


def test_path_labels_sort_into_last_digit_and_magnitude():
    from arithinterp.features.labels import LOOKUP_FAMILY
    from arithinterp.features.paths import LAST_DIGIT, MAGNITUDE, path_of

    assert path_of("a mod 10 = 6", "operand mod") == LAST_DIGIT
    assert path_of("a,b mod 5 = 4", "operand mod") == LAST_DIGIT  # mod 5 is decided by the last digit
    assert path_of("a mod 3 = 1", "operand mod") is None  # mod 3 is not
    assert path_of("result mod 10 = 5", "result mod") == LAST_DIGIT
    assert path_of("a mod 10 = 6 and b mod 10 = 9", LOOKUP_FAMILY) == LAST_DIGIT
    assert path_of("result ~ ..5", "digit pattern") == LAST_DIGIT
    assert path_of("result ~ 09.", "digit pattern") == MAGNITUDE
    assert path_of("result ~ .92", "digit pattern") is None  # tens and units: neither path alone
    assert path_of("a in [0, 50)", "operand range") == MAGNITUDE
    assert path_of("result = 95", "value") is None


def test_zeroing_the_planted_path_removes_more_of_the_answer_than_random_features(number_tokenizer, tmp_path):
    from arithinterp.features import PathAblationResult, graph_sample, path_ablation
    from arithinterp.features.graph import prompt_graph
    from arithinterp.features.paths import path_ablation_tokens
    from arithinterp.features.sample import GraphSample
    from arithinterp.tasks import arithmetic

    model, v, six, tc = _planted_with_transcoders(number_tokenizer, 6)
    cosine = torch.nn.functional.cosine_similarity(tc.W_dec[0], v[None], dim=1).abs()
    carriers = [f for f in range(tc.n_features) if cosine[f] >= 0.9]
    texts = [f"{a}+{b}" for a, b in zip(range(10, 40), range(6, 100, 10))]  # b ends in 6: the feature fires
    tokens = torch.cat([model.to_tokens(t) for t in texts])
    answers = torch.full((len(texts),), six)
    result = path_ablation_tokens(model, tc, tokens, answers, {"planted": {0: carriers}}, n_random=3)
    frame = result.to_frame().set_index("arm")
    planted_left = frame.loc["zero planted", "share"]
    random_left = frame.loc["random, as many as planted", "share"]
    assert frame.loc["none", "share"] == pytest.approx(1.0)
    assert planted_left < 0.6 and random_left > 0.9  # the planted 5 v is most of the "6" logit
    assert frame.loc["zero planted", "share_high"] < frame.loc["random, as many as planted", "share_low"]
    loaded = PathAblationResult.load(result.save(tmp_path / "paths"))
    assert torch.equal(loaded.logits, result.logits) and len(loaded.plot().data) == 1
    with pytest.raises(ConfigError, match="non-empty"):
        path_ablation_tokens(model, tc, tokens, answers, {"planted": {0: []}})
    with pytest.raises(ConfigError, match="positions must be"):
        path_ablation_tokens(model, tc, tokens, answers, {"planted": {0: carriers}}, positions=[99])
    # the prompt-set path reads each prompt's own answer: its zeroed arm is the tensor path's, answer for answer
    sums = arithmetic(model, "+", range(10, 14), [16, 26], "{a}+{b}=")
    own = path_ablation(model, sums, tc, {"planted": {0: carriers}}, n_random=2)
    same = path_ablation_tokens(model, tc, sums.tokens, sums.answer_tokens[:, 0], {"planted": {0: carriers}},
                                n_random=2)
    assert torch.allclose(own.logits, same.logits) and own.arms == same.arms
    # the same prompts' graphs: the features kept at the last position are the carriers (each number
    # token has carriers of its own, so no one feature is kept in every graph)
    kept, along_influence, other_influence = 0, 0.0, 0.0
    for text in texts[:6]:
        nodes = prompt_graph(model, text, tc, n_logits=3, progress=False).node_frame()
        last = nodes[(nodes["kind"] == "feature") & (nodes["position"] == nodes["position"].max()) & nodes["kept"]]
        along = last["feature"].isin(carriers).to_numpy()
        kept += int(along.sum())
        along_influence += float(last["influence"].to_numpy()[along].sum())
        other_influence += float(last["influence"].to_numpy()[~along].sum())
    assert kept >= 6 and along_influence > 5 * other_influence
    sample = graph_sample(model, sums, tc, n_logits=3, progress=False)
    assert sample.meta["n_done"] == len(sums) and sample.prompts == list(sums.texts)
    assert GraphSample.load(sample.save(tmp_path / "sample")).features == sample.features
    with pytest.raises(ConfigError, match="prompts is empty"):
        graph_sample(model, sums[[]], tc)


def test_a_ridge_skip_stays_small_off_the_inputs_few_directions():
    """Inputs spanning 4 of 32 directions (a narrow task's few thousand distinct rows): the plain
    least-squares skip gives huge gains along the others, so an input drifted 5% off them (as the
    replacement model's are, once earlier MLPs are replaced) moves the output by about its own size;
    the ridge skip moves it by less than 5%."""
    from arithinterp.features.training import _fit_layer

    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 32, generator=generator)).Q
    # the other 28 directions hold noise 3e-4: well above where least squares truncates a direction as
    # rank-deficient (about 1e-4 here, so noise there flips from huge gains to none with rounding)
    x = torch.randn(2000, 4, generator=generator) @ basis[:, :4].T + 3e-4 * torch.randn(2000, 32, generator=generator)
    W = torch.randn(32, 32, generator=generator) / 32**0.5
    y = torch.relu(x @ W) + 0.5 * x @ W
    drift = 0.05 * x.norm(dim=1, keepdim=True) * torch.nn.functional.normalize(
        torch.randn(2000, 28, generator=generator) @ basis[:, 4:].T, dim=1)
    errors = {}
    for ridge in (0.0, 1e-3):
        t = _fit_layer(x, y, 16, 4, 50, 256, 1e-3, True, torch.Generator().manual_seed(1), False, "", skip_ridge=ridge,
                       train_skip=False)
        moved = drift @ t["W_skip"]  # what the skip adds to the output for the drift
        errors[ridge] = float((moved.norm(dim=1) / y.norm(dim=1)).median())
    assert errors[0.0] > 0.5 and errors[1e-3] < 0.05, errors


def test_distinct_rows_train_each_shared_prefix_row_once(tiny_model):
    prompts = prompts_for_pairs(tiny_model, "+", list(range(10, 40)), list(range(40, 70)), "{a}+{b}=", few_shot=2)
    kwargs = dict(layers=[0], n_features=16, k=4, steps=5, batch_size=64, progress=False)
    every = train_transcoders(tiny_model, prompts, **kwargs)
    once = train_transcoders(tiny_model, prompts, distinct=True, **kwargs)
    per_prompt = int(prompts.lengths[0])
    prefix = per_prompt - 4  # the two-shot prefix (and <bos>) repeats; a, '+', b, '=' are the prompt's own
    n_train = every.meta["train_rows"] // per_prompt
    assert once.meta["train_rows"] == every.meta["train_rows"] - (n_train - 1) * prefix
    row = once.metrics["layers"][0]
    assert 0 <= row["fvu_after_first"] and row["fvu"] != row["fvu_after_first"]


def test_sequential_training_fits_each_layer_on_the_replacement_models_inputs(tiny_model, monkeypatch):
    """With ``sequential``, layer 1's transcoder is fitted on the MLP inputs of the model whose layer 0 is
    replaced by its transcoder, to the real MLP's outputs there; trained alone, on the real model's inputs."""
    from arithinterp.features import training

    prompts = prompts_for_pairs(tiny_model, "+", list(range(20)) * 3, list(range(60)), "{a}+{b}=")
    tokens, valid, _ = full_tokens(prompts)
    fits = []
    fit_layer = training._fit_layer
    monkeypatch.setattr(training, "_fit_layer", lambda x, y, *args, **kwargs: fits.append((x, y)) or fit_layer(
        x, y, *args, **kwargs))

    def distances(rows, table):  # exact (the matrix-product form cancels to ~1e-3 on equal rows)
        return torch.cdist(rows, table, compute_mode="donot_use_mm_for_euclid_dist")

    for sequential in (True, False):
        fits.clear()
        tc = train_transcoders(tiny_model, prompts, n_features=16, k=2, steps=20, batch_size=64, seed=0,
                               sequential=sequential, progress=False)
        assert tc.meta["sequential"] is sequential and len(fits) == 2
        replaced_in, replaced_out = mlp_activations(tiny_model, tokens, [1], writes=tc.interventions(layers=[0]))
        real_in, _ = mlp_activations(tiny_model, tokens, [1])
        x, y = fits[1]
        on_replaced = distances(x, replaced_in[0][valid]).min(1).values
        on_real = distances(x, real_in[0][valid]).min(1).values
        if sequential:
            assert on_replaced.max() < 1e-5 and on_real.max() > 1e-3
            match = distances(x, replaced_in[0][valid]).argmin(1)
            assert torch.allclose(y, replaced_out[0][valid][match], atol=1e-5)
        else:
            assert on_real.max() < 1e-5 and on_replaced.max() > 1e-3


@pytest.mark.slow
def test_operand_plots_label_the_planted_feature_at_its_role_and_nothing_in_the_control(planted):
    """Operand plots read every layer and role at once; labelled from them, the planted feature is
    "b mod 10 = 6" at b's token, and the control model built around "ends in 3" has no such label."""
    from arithinterp.features.operand_plots import label_plots, operand_plots
    from arithinterp.tasks import arithmetic

    found = {}
    for kind in ("planted", "control"):
        model, v, tc, _, _ = planted[kind]
        grid = arithmetic(model, "+", range(0, 100, 2), range(100), "{a}+{b}=")
        plots = operand_plots(model, grid, tc, roles=["a", "b", "final"], progress=False)
        assert plots.values.shape == (len(grid), 3, 1, tc.k)
        map_, a_values, b_values = plots.grid(0, 0, "b")
        assert map_.shape == (50, 100) and b_values == list(range(100))
        table = label_plots(plots, 0, "b").to_frame()
        found[kind] = set(table[table["label"]]["heuristic"])
    assert "b mod 10 = 6" in found["planted"]
    assert "b mod 10 = 6" not in found["control"] and "b mod 10 = 3" in found["control"]


def test_layer_by_layer_reads_equal_whole_forwards(tiny_model, llama_model):
    from arithinterp.engine.layerwise import LayerByLayer

    for model in (tiny_model, llama_model("digit")):
        tokens = torch.randint(3, 12, (5, 7), generator=torch.Generator().manual_seed(0))
        half = [Write("mlp_out", 0, value=lambda x: 0.5 * x, input_site="mlp_in")]
        reads = [Read("mlp_in", 1), Read("mlp_out", 1)]
        whole = run(model, tokens, half, reads=[*reads, Read("resid_post", 1)], logits="none").reads
        walker = LayerByLayer(model, tokens, batch_size=2)
        walker.step(half)
        stepped = walker.step(reads=reads)
        for a, b in zip([*stepped, walker.hidden], whole):
            assert torch.allclose(a, b, atol=1e-5)
        with pytest.raises(Exception, match="blocks have run|not inside it"):
            walker.step(reads=[Read("mlp_in", 0)])
