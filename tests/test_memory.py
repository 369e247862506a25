"""Memory budgets: analyses over many units give the same results in many small chunks as in few
large ones, and refuse a budget that is invalid or too small to hold one unit."""

from __future__ import annotations

import re

import pytest
import torch

import arithinterp as ai
from arithinterp import circuits
from arithinterp import neurons as nn
from arithinterp.engine.budget import memory_budget
from arithinterp.engine.edges import gradient_run_bytes
from arithinterp.errors import ConfigError
from arithinterp.tasks import arithmetic


@pytest.fixture(scope="module")
def zoo():
    model = ai.load_model("zoo:add-100")
    prompts = arithmetic(model, op="+", a=range(20), b=range(20), template="{a}+{b}=")
    return model, prompts


@pytest.fixture(scope="module")
def llama(number_tokenizer, tmp_path_factory):
    from hf_families import save_family

    model = ai.load_model(str(save_family("llama", number_tokenizer, tmp_path_factory.mktemp("llama") / "llama")))
    prompts = arithmetic(model, a=range(10, 40, 2), b=range(5, 30, 2), few_shot=1)
    return model, prompts


def _count_chunks(monkeypatch) -> list:
    """Record the (start, stop) row range of every chunk of neuron maps the classification reads."""
    from arithinterp.neurons import neuron_maps

    seen: list = []
    original = neuron_maps.MapRows.__call__

    def spy(self, start, stop):
        seen.append((start, stop))
        return original(self, start, stop)

    monkeypatch.setattr(neuron_maps.MapRows, "__call__", spy)
    return seen


def _same_table(a, b) -> None:
    assert a.names == b.names
    assert torch.equal(a.layer, b.layer) and torch.equal(a.neuron, b.neuron)
    for name in ("scores", "bottom_scores", "p_values", "q_values"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and torch.allclose(x, y, atol=1e-5, equal_nan=True), name
    assert torch.equal(a.labels, b.labels)
    assert a.meta["control"] == b.meta["control"]


@pytest.mark.slow
@pytest.mark.parametrize("which, budget", [("zoo", 24e6), ("llama", 12e6)])
def test_classify_in_many_small_chunks_equals_the_default(which, budget, request, monkeypatch):
    """Every neuron of every layer: a budget that forces a chunk of 128 neurons at a time (and small
    forward batches) gives the default's table; the planted-free real maps still get labels."""
    model, prompts = request.getfixturevalue(which)
    seen = _count_chunks(monkeypatch)
    default = nn.classify(model, prompts, top_k=None, bottom=True)
    assert len(seen) == 1  # the default budget holds every neuron of these small models at once
    seen.clear()
    small = nn.classify(model, prompts, top_k=None, bottom=True, max_memory=budget)
    n = default.scores.shape[0]
    assert n == model.cfg.n_layers * model.cfg.d_mlp
    assert len(seen) >= 2 and all((stop - start) % 128 == 0 or stop == n for start, stop in seen)
    _same_table(default, small)
    forced = nn.classify(model, prompts, top_k=None, bottom=True, batch_size=7)  # explicit batch override
    _same_table(default, forced)


def test_classify_top_k_through_importance_is_chunk_independent(zoo):
    model, prompts = zoo
    pairs = prompts.counterfactual(vary="a", seed=0)[::3]
    default = nn.classify(model, prompts, top_k=40, pairs=pairs)
    small = nn.classify(model, prompts, top_k=40, pairs=pairs, max_memory=24e6)
    assert torch.allclose(default.importance, small.importance, atol=1e-5)
    _same_table(default, small)


@pytest.mark.parametrize("method", ["attribution", "patching", "mean-ablation"])
def test_importance_with_a_tiny_budget_equals_the_default(llama, method):
    """Running mean + std over batches of 1-2 prompts equals the statistics of the whole grid."""
    model, prompts = llama
    pairs = prompts.counterfactual(vary="a", seed=0)[:10]
    default = nn.importance(model, pairs, method=method, top_k=None)
    small = nn.importance(model, pairs, method=method, top_k=None, batch_size=2 if method != "attribution" else None,
                          max_memory=4e5 if method == "attribution" else None)
    assert torch.allclose(default.scores, small.scores, atol=1e-5)
    assert float(default.scores.max()) > 0  # not vacuous: the scores are not all zero


@pytest.mark.slow
def test_map_rows_read_in_several_passes_equal_one_pass(llama):
    """Activations kept for a group of neurons at a time (here 100 rows per pass over the prompts)
    give the maps of one pass over every neuron."""
    from arithinterp.neurons.neuron_maps import MapRows

    model, prompts = llama
    n = model.cfg.n_layers * model.cfg.d_mlp
    layer = torch.arange(model.cfg.n_layers).repeat_interleave(model.cfg.d_mlp)
    neuron = torch.arange(model.cfg.d_mlp).repeat(model.cfg.n_layers)
    whole = MapRows(model, prompts, layer, neuron, None, 10**9, buffer_share=1.0)(0, n)
    parts = MapRows(model, prompts, layer, neuron, None, 100 * 4 * len(prompts), buffer_share=1.0)
    pieces = [parts(start, min(start + 64, n)) for start in range(0, n, 64)]
    for i in range(2):
        assert torch.allclose(torch.cat([p[i] for p in pieces]), whole[i], atol=1e-6, equal_nan=True)
    assert int(torch.isnan(whole[0][0]).sum()) == int((~parts.present).sum())


def test_maps_and_mean_activation_need_no_full_activation_grid(llama):
    model, prompts = llama
    layer, neuron = torch.tensor([0, 1, 1]), torch.tensor([3, 0, 7])
    default = nn.maps(model, prompts, neurons=(layer, neuron))
    small = nn.maps(model, prompts, neurons=(layer, neuron), max_memory=2e5)
    assert torch.allclose(default.k_maps, small.k_maps, atol=1e-6, equal_nan=True)
    assert torch.allclose(default.kv_maps, small.kv_maps, atol=1e-6, equal_nan=True)
    from arithinterp.neurons.final_reads import final_activations, mean_final_activation

    full = final_activations(model, prompts, [0, 1])
    mean = mean_final_activation(model, prompts, [0, 1], 5)
    assert torch.allclose(mean, full.mean(0), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["zoo", "llama"])
def test_eap_ig_one_pair_per_batch_equals_the_default(which, request):
    model, prompts = request.getfixturevalue(which)
    pairs = prompts.counterfactual(vary="a", seed=0)[:8]
    default = circuits.score_edges(model, pairs, "eap-ig", progress=False)
    one = gradient_run_bytes(model, int(pairs.clean.tokens.shape[1]))
    small = circuits.score_edges(model, pairs, "eap-ig", max_memory=1.5 * one, progress=False)
    assert default.meta["batches"] == 1 and small.meta["batches"] == len(pairs)
    assert torch.allclose(default.pair_scores, small.pair_scores, atol=1e-5)
    assert float(default.scores.abs().max()) > 1e-3


@pytest.mark.parametrize("ablation", ["resample", "mean"])
def test_edge_set_runs_in_small_stacks_equal_the_default(llama, ablation):
    """The exact edge ablations behind the faithfulness curve: one pair and one edge set per
    forward (a budget that holds no more) give the same metrics as the default."""
    model, prompts = llama
    pairs = prompts.counterfactual(vary="a", seed=0)[:6]
    graph = circuits.EdgeGraph.of(model)
    generator = torch.Generator().manual_seed(0)
    sets = (torch.rand(5, graph.n_edges, generator=generator) < 0.3).float()
    values = "corrupt" if ablation == "resample" else "mean"
    default = circuits.run_edge_sets(model, pairs, graph, sets, base="clean", values=values)
    small = circuits.run_edge_sets(model, pairs, graph, sets, base="clean", values=values, max_memory=5e5)
    assert default["forwards"] < small["forwards"]  # many more, smaller forwards
    assert small["batch_size"] < len(pairs)
    assert torch.allclose(default["values"], small["values"], atol=1e-5)
    assert float((default["values"] - default["clean"][:, None]).abs().max()) > 1e-3  # the sets change the metric


def test_the_runs_kept_between_calls_fit_the_memory_budget(llama):
    """Pruning reuses the unpatched runs over its visits: only as many pairs' as fit ``max_memory``
    are kept (the others run again), and the metrics are the same either way."""
    model, prompts = llama
    pairs = prompts.counterfactual(vary="a", seed=0)[:6]
    graph = circuits.EdgeGraph.of(model)
    sets = (torch.rand(3, graph.n_edges, generator=torch.Generator().manual_seed(0)) < 0.3).float()
    every: dict = {}
    circuits.run_edge_sets(model, pairs, graph, sets, base="clean", batch_size=1, _runs=every)
    assert sum(isinstance(key, tuple) for key in every) == len(pairs)  # the default budget holds them all
    budget = 2.5 * every["bytes"] / len(pairs)  # two pairs' runs (batches of one pair)
    kept: dict = {}
    first = circuits.run_edge_sets(model, pairs, graph, sets, base="clean", max_memory=budget, batch_size=1, _runs=kept)
    batches = [key for key in kept if isinstance(key, tuple)]
    assert len(batches) == 2 and kept["bytes"] <= budget
    again = circuits.run_edge_sets(model, pairs, graph, sets, base="clean", max_memory=budget, batch_size=1, _runs=kept)
    assert again["forwards"] == first["forwards"] - len(batches)  # the kept runs are not run again
    assert torch.equal(first["values"], again["values"])


def test_held_bytes_counts_each_storage_once():
    from arithinterp.engine.budget import held_bytes

    x = torch.zeros(10, 4)  # 160 bytes
    assert held_bytes(x, x[:5], [x[5:], {"y": torch.zeros(3, dtype=torch.float64)}], (None, "text")) == 160 + 24


def test_exact_patching_builds_its_edge_sets_in_blocks(llama):
    model, prompts = llama
    pairs = prompts.counterfactual(vary="a", seed=0)[:3]
    graph = circuits.EdgeGraph.of(model)
    edges = list(range(0, graph.n_edges, 7))
    default = circuits.patch_edges(model, pairs, graph, edges=edges, progress=False)
    small = circuits.patch_edges(model, pairs, graph, edges=edges, max_memory=4 * 4 * graph.n_edges * 5,
                                 batch_size=1, batch_cells=3, progress=False)
    assert torch.allclose(default["scores"], small["scores"], atol=1e-5, equal_nan=True)
    assert int(torch.isfinite(small["scores"][0]).sum()) == len(edges)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "lots", True])
def test_an_invalid_budget_is_refused_with_what_is_accepted(zoo, bad):
    model, prompts = zoo
    with pytest.raises(ConfigError, match="max_memory.* accepts a positive number of bytes"):
        memory_budget(model, bad)
    with pytest.raises(ConfigError, match="max_memory.* accepts a positive number of bytes"):
        nn.classify(model, prompts, top_k=None, max_memory=bad)


def test_a_budget_too_small_for_one_unit_is_refused_with_the_size_needed(zoo):
    model, prompts = zoo
    pairs = prompts.counterfactual(vary="a", seed=0)[:4]
    with pytest.raises(ConfigError, match=r"max_memory=1000 bytes is too small: one .* needs about \d+ bytes"):
        nn.classify(model, prompts, top_k=None, max_memory=1000)
    with pytest.raises(ConfigError, match=r"too small: one prompt's gradient run at every receiver needs"):
        circuits.score_edges(model, pairs, "eap-ig", max_memory=1000, progress=False)
    graph = circuits.EdgeGraph.of(model)
    with pytest.raises(ConfigError, match=r"too small: one pair's edge run needs"):
        circuits.run_edge_sets(model, pairs, graph, torch.ones(1, graph.n_edges), max_memory=1000)



def test_attribution_patching_in_one_pair_batches_equals_the_default(llama, monkeypatch):
    """``attribute`` sizes its batches from ``max_memory``: a budget too small for one pair is
    refused with the size one needs, and a budget of 1.5 pairs runs one pair per batch with the
    same cells as the default."""
    from arithinterp.patching import attribution

    model, prompts = llama
    pairs = prompts.counterfactual(vary="a", seed=0)[:6]
    kwargs = dict(sites=["resid_pre", "mlp_out"], method="integrated-gradients", ig_steps=2, progress=False)
    with pytest.raises(ConfigError, match=r"max_memory=1000 bytes is too small: one pair's forward and backward") \
            as refused:
        ai.patching.attribute_sites(model, pairs, max_memory=1000, **kwargs)
    one_pair = int(re.search(r"needs about (\d+) bytes", str(refused.value)).group(1))
    default = ai.patching.attribute_sites(model, pairs, **kwargs)
    batches: list = []
    original = attribution.engine_run
    monkeypatch.setattr(attribution, "engine_run", lambda m, tokens, *a, **k: (batches.append(len(tokens)),
                                                                                 original(m, tokens, *a, **k))[1])
    small = ai.patching.attribute_sites(model, pairs, max_memory=1.5 * one_pair, **kwargs)
    assert batches and max(batches) == 1
    for site in kwargs["sites"]:
        assert torch.allclose(default[site].values, small[site].values, atol=1e-5)
    effects = default["resid_pre"].values - default["resid_pre"].corrupt_baseline.reshape(-1, 1, 1)
    assert float(effects.abs().max()) > 0  # not vacuous: the estimated effects are not all zero
