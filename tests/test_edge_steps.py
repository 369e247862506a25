"""Exact edge runs through the block stepper equal whole forwards (``engine="hooks"``), set for set.

The stepped path starts each stack of edge sets at the layer of its first changed receiver and the
first position where one of its edges carries a value other than the base run's; the whole forward
is the reference. Both run on the zoo model (TransformerLens-native attention) and on random-weight
Llama (rotary, grouped-query attention, RMSNorm), GPT-NeoX (parallel attention and MLP, partial
rotary), Gemma 2 and Gemma 3 (norms on the attention and MLP outputs, frozen at the base run's
scales; Gemma 3's QK-norm and two rotary bases) folders with few-shot prompts, whose shared prefix
the stepped path reuses.
"""

from __future__ import annotations

import pytest
import torch
from hf_families import save_family

import arithinterp as ai
from arithinterp.circuits import (
    EdgeGraph,
    faithfulness_curve,
    minimality,
    patch_edges,
    prune,
    run_edge_sets,
    score_edges,
    top_n,
)
from arithinterp.errors import ArithInterpError, ConfigError
from arithinterp.tasks import arithmetic

TOL = 1e-5  # relative to the largest score (float32 forwards summed in another order)


def _gap(fast: torch.Tensor, slow: torch.Tensor) -> float:
    return float((fast - slow).abs().max() / slow.abs().max().clamp_min(1.0))


def _random_sets(graph: EdgeGraph, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` random edge sets (each edge in with probability ½), every edge and no edge."""
    sets = (torch.rand(n, graph.n_edges, generator=torch.Generator().manual_seed(seed)) < 0.5).float()
    return torch.cat([sets, torch.ones(1, graph.n_edges), torch.zeros(1, graph.n_edges)])


@pytest.fixture(scope="module")
def zoo():
    from arithinterp.models.zoo import ZOO, zoo_prompts

    model = ai.load_model("zoo:add-100")
    grid = [(a, b) for a in range(3, 100, 9) for b in range(5, 100, 13)]
    prompts = zoo_prompts(model, ZOO["add-100"], [a for a, _ in grid], [b for _, b in grid])
    return model, prompts.counterfactual(vary="a", seed=0)[:10]


@pytest.fixture(scope="module", params=["llama", "gpt_neox", "gemma2", "gemma3"])
def family(request, number_tokenizer, tmp_path_factory):
    model = ai.load_model(str(save_family(request.param, number_tokenizer, tmp_path_factory.mktemp(request.param))))
    pairs = arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=2).counterfactual(vary="a", seed=0)[:6]
    return model, pairs


@pytest.mark.parametrize("positions", [None, ["a", "b", "final"]])
def test_every_edge_alone_equals_whole_forwards_on_the_zoo(zoo, positions):
    model, pairs = zoo
    graph = EdgeGraph.of(model, positions)
    fast = patch_edges(model, pairs, graph, progress=False)
    slow = patch_edges(model, pairs, graph, engine="hooks", progress=False)
    assert fast["engine"][0].startswith("stepped blocks") and slow["engine"] == ["hooks: requested"]
    assert slow["scores"].abs().max() > 1.0  # edges that matter: not a comparison of zeros
    assert _gap(fast["scores"], slow["scores"]) <= TOL
    assert torch.equal(fast["clean"].isnan(), slow["clean"].isnan())
    assert _gap(fast["clean"], slow["clean"]) <= TOL and _gap(fast["corrupt"], slow["corrupt"]) <= TOL


def test_every_edge_alone_equals_whole_forwards_on_hugging_face_families(family):
    model, pairs = family
    graph = EdgeGraph.of(model)
    fast = patch_edges(model, pairs, graph, progress=False)
    slow = patch_edges(model, pairs, graph, engine="hooks", progress=False)
    assert "keys/values reused" in fast["engine"][0]  # the few-shot prefix is computed once
    assert slow["scores"].abs().max() > 0.01
    assert _gap(fast["scores"], slow["scores"]) <= TOL


@pytest.mark.parametrize("values", ["corrupt", "mean"])
@pytest.mark.parametrize("positions", [None, ["a", "b", "final"]])
def test_edge_sets_with_the_rest_ablated_equal_whole_forwards(family, values, positions):
    """Many edges per set (as faithfulness ablates a circuit's complement): each receiver's input
    depends on senders the same run has changed, through every layer."""
    model, pairs = family
    graph = EdgeGraph.of(model, positions)
    sets = _random_sets(graph, 4)
    fast = run_edge_sets(model, pairs, graph, sets, base="clean", values=values)
    slow = run_edge_sets(model, pairs, graph, sets, base="clean", values=values, engine="hooks")
    assert _gap(fast["values"], slow["values"]) <= TOL
    # every edge ablated is the corrupt run (resample); no edge ablated is the clean run
    assert _gap(fast["values"][:, -1], fast["clean"]) <= TOL
    if values == "corrupt":
        assert _gap(fast["values"][:, -2], fast["corrupt"]) <= 1e-4


def test_stacks_of_any_size_give_the_same_numbers(zoo):
    model, pairs = zoo
    graph = EdgeGraph.of(model, ["a", "b", "final"])
    sets = _random_sets(graph, 6, seed=1)
    default = run_edge_sets(model, pairs, graph, sets, base="clean", values="corrupt")
    one = run_edge_sets(model, pairs, graph, sets, base="clean", values="corrupt", batch_cells=1, batch_size=3)
    assert one["forwards"] > default["forwards"]
    assert _gap(one["values"], default["values"]) <= TOL


def test_sets_that_change_nothing_run_no_forward_and_give_the_base_run(zoo):
    """Edges carrying the base run's own outputs change no receiver's input: the sets are not run."""
    model, pairs = zoo
    graph = EdgeGraph.of(model)
    got = run_edge_sets(model, pairs, graph, _random_sets(graph, 3), base="clean", values="clean")
    assert got["forwards"] == len(pairs.clean.length_groups())  # the base runs alone
    assert torch.equal(got["values"], got["clean"][:, None].expand_as(got["values"]))


def test_faithfulness_minimality_and_pruning_equal_whole_forwards(zoo):
    model, pairs = zoo
    circuit = score_edges(model, pairs, "eap", progress=False)
    sizes = [0, 2, 8, 32, circuit.n_edges]
    fast, slow = (faithfulness_curve(model, pairs, circuit, sizes=sizes, engine=e) for e in ("auto", "hooks"))
    assert fast.meta["engine"][0].startswith("stepped blocks")
    assert _gap(fast.metric_circuit, slow.metric_circuit) <= TOL and _gap(fast.faithfulness, slow.faithfulness) <= TOL
    small = top_n(circuit, 5)
    fast_min, slow_min = (minimality(model, pairs, small, engine=e) for e in ("auto", "hooks"))
    assert _gap(fast_min.loss, slow_min.loss) <= TOL
    fast_pruned, slow_pruned = (prune(model, pairs, small, tau=0.02, engine=e, progress=False)
                                for e in ("auto", "hooks"))
    assert fast_pruned.kept_edges == slow_pruned.kept_edges
    assert fast_pruned.meta["faithfulness_after"] == pytest.approx(slow_pruned.meta["faithfulness_after"], abs=1e-5)


def test_faithfulness_takes_a_memory_budget(zoo):
    model, pairs = zoo
    circuit = score_edges(model, pairs, "eap", progress=False)
    sizes = [0, 4, circuit.n_edges]
    default = faithfulness_curve(model, pairs, circuit, sizes=sizes)
    small = faithfulness_curve(model, pairs, circuit, sizes=sizes, max_memory=2e6)
    assert small.meta["forwards"] > default.meta["forwards"]  # smaller batches of pairs
    assert _gap(small.metric_circuit, default.metric_circuit) <= TOL
    with pytest.raises(ConfigError, match="max_memory.* accepts a positive number of bytes"):
        faithfulness_curve(model, pairs, circuit, sizes=sizes, max_memory=-1)


def test_an_unknown_engine_is_refused_with_the_accepted_ones(zoo):
    model, pairs = zoo
    with pytest.raises(ArithInterpError, match="engine.*'auto'.*'stepped'.*'hooks'"):
        patch_edges(model, pairs, engine="forward", progress=False)
    circuit = score_edges(model, pairs, "eap", progress=False)
    with pytest.raises(ArithInterpError, match="engine"):
        faithfulness_curve(model, pairs, circuit, sizes=[0, 4], engine="fast")


@pytest.mark.slow
def test_every_edge_alone_equals_whole_forwards_on_a_deeper_llama(number_tokenizer, tmp_path):
    """Four layers and a 9-shot prefix (the benchmark's shape, narrower): runs resumed mid-model,
    the last block split into keys/values and the read position. Every edge runs stepped; the
    whole-forward reference (one forward per edge) runs the first and last edge into every receiver
    (every head's query, key and value input, every MLP and the logits, at every layer) and every
    seventh edge besides."""
    from families import save_llama

    model = ai.load_model(str(save_llama(tmp_path / "llama4", number_tokenizer, n_layers=4, d_model=64)))
    pairs = arithmetic(model, a=range(100), b=range(100), few_shot=9).counterfactual(vary="a", seed=0)[:6]
    graph = EdgeGraph.of(model)
    receivers = graph.edge_index[:, 1]
    ends = {int(i) for r in receivers.unique() for i in torch.nonzero(receivers == r)[[0, -1], 0]}
    sample = sorted(ends | set(range(0, graph.n_edges, 7)))
    fast = patch_edges(model, pairs, graph, progress=False)
    slow = patch_edges(model, pairs, graph, edges=sample, engine="hooks", progress=False)
    assert not fast["scores"].isnan().any()
    assert _gap(fast["scores"][:, sample], slow["scores"][:, sample]) <= TOL
