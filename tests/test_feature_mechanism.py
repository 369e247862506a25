"""The mechanism tools on transcoders: planned training on any model, the cache that finds them again,
operand plots labelling a graph's features, labelled supernodes, and the swap test that checks
labels by intervention, each beside a control."""

from __future__ import annotations

import json

import pytest
import torch

from arithinterp.errors import ConfigError, ModelFileError


@pytest.fixture(scope="module")
def add3():
    """zoo:add-3digit, its shipped transcoders and their operand plots over a 40 × 40 sample of the grid."""
    from arithinterp import load_model
    from arithinterp.features import load_transcoders
    from arithinterp.features.operand_plots import operand_plots
    from arithinterp.tasks import prompts_for_pairs

    model, tc = load_model("zoo:add-3digit"), load_transcoders("zoo:add-3digit")
    g = torch.Generator().manual_seed(0)
    a = sorted(torch.randperm(900, generator=g)[:40].add(100).tolist())
    b = sorted(torch.randperm(900, generator=g)[:40].add(100).tolist())
    grid = prompts_for_pairs(model, "+", [x for x in a for _ in b], [y for _ in a for y in b], "{a}+{b}=",
                             answer_digits=4)
    return model, tc, operand_plots(model, grid, tc, progress=False)


def test_plans_hold_out_a_block_of_operands_and_the_prefixes(tiny_digit_model):
    from arithinterp.features.plan import plan_prompts, plan_transcoders

    plan = plan_transcoders(tiny_digit_model, operands="0-19", few_shot=2)
    assert plan == plan_transcoders(tiny_digit_model, operands="0-19", few_shot=2)  # from the shape and task alone
    assert plan.held_out_a == (8, 12) and plan.held_out_b == (4, 8)
    assert not set(plan.train_prefixes) & set(plan.held_out_prefixes)
    train, held = plan_prompts(tiny_digit_model, plan)
    def in_block(p):
        return (plan.held_out_a[0] <= p.a) & (p.a < plan.held_out_a[1]) & (
            plan.held_out_b[0] <= p.b) & (p.b < plan.held_out_b[1])
    assert not bool(in_block(train).any()) and bool(in_block(held).all())
    assert len(set(train.texts)) == len(train) and len(held) == plan.n_held_out
    assert {t.rsplit("\n", 1)[0] for t in train.texts}.isdisjoint({t.rsplit("\n", 1)[0] for t in held.texts})
    with pytest.raises(ConfigError, match="at least 10 values"):
        plan_transcoders(tiny_digit_model, operands="1,2,3")


@pytest.mark.slow
def test_train_transcoders_command_caches_them_where_the_graph_finds_them(llama_folder, tmp_path, monkeypatch,
                                                                         capsys):
    """Any model the toolkit loads: trained with its plan, cached by fingerprint with a card and operand
    plots, found again by the graph command; a second run into the same folder is refused."""
    from arithinterp import load_model
    from arithinterp.cli import main
    from arithinterp.features.cache import cache_folder, find_operand_plots, find_transcoders

    monkeypatch.setenv("ARITHINTERP_CACHE", str(tmp_path))
    folder = str(llama_folder("digit"))
    command = ["train-transcoders", folder, "--operands", "0-19", "--few-shot", "1", "--steps", "10",
               "--prompts", "60", "--no-progress", "--json"]
    assert main(command) == 0
    card = json.loads(capsys.readouterr().out)
    model = load_model(folder)
    assert card["out"] == str(cache_folder(model)) and card["plan"]["held_out_a"] == [8, 12]
    assert 0 <= card["replacement"]["agreement"] <= 1 and card["replacement"]["n_positions"] > 0
    assert find_transcoders(model) is not None and find_operand_plots(model) is not None
    assert main(["graph", folder, "1\n3+4=", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scores"]["n_active_features"] > 0
    assert main(command) == 2  # the cache folder holds them: refused without --overwrite
    assert "--overwrite" in capsys.readouterr().err


def test_cache_is_per_fingerprint_and_says_how_to_make_missing_ones(tiny_model, tmp_path, monkeypatch):
    from arithinterp.features.cache import cache_folder, find_transcoders, require_transcoders

    monkeypatch.setenv("ARITHINTERP_CACHE", str(tmp_path))
    assert cache_folder(tiny_model).parent == tmp_path / "transcoders"
    assert find_transcoders(tiny_model) is None
    with pytest.raises(ModelFileError, match="arithinterp train-transcoders"):
        require_transcoders(tiny_model)


def test_graph_scores_say_what_feeds_the_answer_logit():
    from arithinterp import load_model
    from arithinterp.features import attribution_graph
    from arithinterp.tasks import prompts_for_pairs

    model = load_model("zoo:add-100")
    graph = attribution_graph(model, prompts_for_pairs(model, "+", [47], [38], "{a}+{b}="), progress=False)
    shares = [graph.scores[f"logit_inputs_{kind}"] for kind in ("embedding", "feature", "error")]
    assert abs(sum(shares) - 1) < 1e-6 and 0.5 < shares[1] < 0.9  # the shipped transcoders: features carry most


@pytest.mark.slow
def test_supernodes_hold_the_graphs_influence_under_labels_and_shuffled_plots_do_not(add3):
    from arithinterp.features import attribution_graph
    from arithinterp.features.supernodes import label_graph, labelled_share, supernodes
    from arithinterp.tasks import prompts_for_pairs

    model, tc, plots = add3
    prompt = prompts_for_pairs(model, "+", [536], [259], "{a}+{b}=", answer_digits=4)
    graph = attribution_graph(model, prompt, tc, progress=False)
    labels = label_graph(graph, plots, prompt)
    groups = supernodes(graph, labels, prompt, plots)
    assert labelled_share(groups) >= 0.5 and labelled_share(groups, direct=True) <= labelled_share(groups)
    assert len({g.name for g in groups}) == len(groups)  # the viewer draws each under its own name
    assert sorted(i for g in groups for i in g.members) == sorted(
        i for i, n in enumerate(graph.nodes) if n["kind"] == "feature" and n["kept"])  # each kept feature once
    shuffled = torch.randperm(len(plots.a), generator=torch.Generator().manual_seed(1))
    import dataclasses

    null = dataclasses.replace(plots, values=plots.values[shuffled], features=plots.features[shuffled])
    assert labelled_share(supernodes(graph, label_graph(graph, null, prompt), prompt, null)) < 0.25


@pytest.mark.slow
def test_swapping_labelled_supernodes_moves_the_answer_as_labelled_and_random_features_do_not(add3):
    from arithinterp.features.steering import swap_test
    from arithinterp.tasks import prompts_for_pairs

    model, tc, plots = add3
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(100, 1000, (24,), generator=g).tolist() for _ in range(2))
    result = swap_test(model, prompts_for_pairs(model, "+", a, b, "{a}+{b}=", answer_digits=4), tc, plots,
                       role="final", n_random=3, progress=False)
    assert result.as_predicted >= 0.4 and result.as_predicted_control <= 0.15
    assert result.to_frame()["as_predicted"].mean() == pytest.approx(result.as_predicted)
