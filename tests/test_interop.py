"""Other tools' formats: circuit-tracer's transcoders and graphs, SAELens's transcoders and SAEs,
pyvene's rotated-space interventions. Fixtures are written here from the formats as those tools
document and save them; none of the tools is needed (benchmarks/peers.md runs them for real)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import save_file

from arithinterp import causal
from arithinterp.errors import AnalysisError, ConfigError, FormatError, ResultFileError
from arithinterp.features.graph import prompt_graph
from arithinterp.features import (
    load_transcoders, read_circuit_tracer_graph, read_circuit_tracer_transcoders, read_saelens,
    transcoder_fvu, write_circuit_tracer_graph, write_circuit_tracer_transcoders, write_saelens,
)
from arithinterp.features.graph_files import cantor_pairing, circuit_tracer_order
from arithinterp.models import load_model
from arithinterp.models.zoo import task_prompts


@pytest.fixture(scope="module")
def zoo():
    return load_model("zoo:add-100"), load_transcoders("zoo:add-100")


def _inputs(model, n: int = 64) -> torch.Tensor:
    return torch.randn(n, int(model.cfg.d_model), generator=torch.Generator().manual_seed(0))


def test_transcoders_round_trip_both_layouts_with_identical_outputs(zoo, tmp_path):
    model, tc = zoo
    x = _inputs(model)
    ct = read_circuit_tracer_transcoders(write_circuit_tracer_transcoders(tc, tmp_path / "ct"), model)
    sl = read_saelens(write_saelens(tc, tmp_path / "sl"), model)
    for back in (ct, sl):
        assert back.activation == "topk" and back.k == tc.k
        for layer in tc.layers:
            assert torch.equal(back(layer, x), tc(layer, x))
    # the checked FVU is the one the set was trained to
    fvu = transcoder_fvu(model, ct)
    for layer, row in zip(tc.layers, tc.metrics["layers"]):
        assert fvu[layer] == pytest.approx(row["fvu"], abs=0.01)


def test_circuit_tracer_layout_follows_its_conventions(zoo, tmp_path):
    # written by hand as circuit-tracer saves a JumpReLU set: W_enc [F, d] and W_skip applied as x @ W.T
    model, _ = zoo
    d, F = int(model.cfg.d_model), 32
    g = torch.Generator().manual_seed(1)
    files = []
    for layer in range(2):
        t = {"W_enc": torch.randn(F, d, generator=g), "W_dec": torch.randn(F, d, generator=g),
             "b_enc": torch.randn(F, generator=g), "b_dec": torch.randn(d, generator=g),
             "W_skip": torch.randn(d, d, generator=g), "activation_function.threshold": torch.rand(F, generator=g)}
        save_file(t, str(tmp_path / f"layer_{layer}.safetensors"))
        files.append(t)
    got = read_circuit_tracer_transcoders(tmp_path, feature_input_hook="mlp.hook_in",
                                          feature_output_hook="hook_mlp_out")
    assert got.activation == "jumprelu" and (got.input_site, got.output_site) == ("mlp_in", "mlp_out")
    x = _inputs(model)
    for layer, t in enumerate(files):
        pre = x @ t["W_enc"].T + t["b_enc"]
        acts = pre * (pre > t["activation_function.threshold"])
        want = acts @ t["W_dec"] + t["b_dec"] + x @ t["W_skip"].T
        assert torch.allclose(got(layer, x), want, atol=1e-4)
    with pytest.raises(FormatError, match="feature_input_hook"):
        read_circuit_tracer_transcoders(tmp_path)


def test_a_mismatched_hook_point_or_convention_is_named(zoo, tmp_path):
    model, tc = zoo
    folder = write_circuit_tracer_transcoders(tc, tmp_path / "ct")
    config = json.loads((folder / "config.yaml").read_text())
    (folder / "config.yaml").write_text(json.dumps(dict(config, feature_input_hook="hook_resid_mid")))
    with pytest.raises(AnalysisError, match=r"layer 0.*hook_resid_mid.*reading mlp_in"):
        read_circuit_tracer_transcoders(folder, model)
    # a skip matrix saved without circuit-tracer's transpose
    (folder / "config.yaml").write_text(json.dumps(config))
    for layer in tc.layers:
        save_file({"W_enc": tc.W_enc[layer].T.contiguous(), "W_dec": tc.W_dec[layer], "b_enc": tc.b_enc[layer],
                   "b_dec": tc.b_dec[layer], "W_skip": tc.W_skip[layer].contiguous()},
                  str(folder / f"layer_{layer}.safetensors"))
    with pytest.raises(AnalysisError, match="W_skip transposed"):
        read_circuit_tracer_transcoders(folder, model)
    with pytest.raises(ConfigError, match="has no site"):
        read_circuit_tracer_transcoders(folder, feature_input_hook="attn.hook_q", feature_output_hook="hook_mlp_out")


def _saelens(folder, cfg: dict, tensors: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "sae_weights.safetensors"))


def test_saelens_sae_and_jumprelu_transcoder_follow_its_formulas(tmp_path):
    d, F = 16, 24
    g = torch.Generator().manual_seed(2)
    W_enc, b_enc, W_dec, b_dec = (torch.randn(d, F, generator=g), torch.randn(F, generator=g),
                                  torch.randn(F, d, generator=g), torch.randn(d, generator=g))
    # a standard SAE subtracts b_dec from its input first (apply_b_dec_to_input)
    _saelens(tmp_path / "sae", dict(architecture="standard", d_in=d, d_sae=F, apply_b_dec_to_input=True,
                                    metadata=dict(hook_name="blocks.1.hook_resid_post", sae_lens_version="6.0.0")),
             dict(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec))
    sae = read_saelens(tmp_path / "sae")
    x = torch.randn(8, d, generator=g)
    assert (sae.input_site, sae.output_site, sae.layers) == ("resid_post", "resid_post", [1])
    assert torch.allclose(sae(1, x), torch.relu((x - b_dec) @ W_enc + b_enc) @ W_dec + b_dec, atol=1e-4)
    # SAELens's JumpReLU is ReLU(pre)·[pre > t]: a negative threshold acts as 0
    threshold = torch.linspace(-1, 1, F)
    W_skip = torch.randn(d, d, generator=g)
    _saelens(tmp_path / "tc", dict(architecture="jumprelu_skip_transcoder", d_in=d, d_out=d, d_sae=F,
                                   apply_b_dec_to_input=False,
                                   metadata=dict(hook_name="blocks.0.ln2.hook_normalized",
                                                 hook_name_out="blocks.0.hook_mlp_out")),
             dict(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec, threshold=threshold, W_skip=W_skip))
    tc = read_saelens(tmp_path / "tc")
    pre = x @ W_enc + b_enc
    want = (torch.relu(pre) * (pre > threshold)) @ W_dec + b_dec + x @ W_skip.T
    assert (tc.input_site, tc.output_site, tc.activation) == ("mlp_in", "mlp_out", "jumprelu")
    assert torch.allclose(tc(0, x), want, atol=1e-4)
    _saelens(tmp_path / "norm", dict(architecture="standard", d_in=d, d_sae=F, normalize_activations="layer_norm",
                                     metadata=dict(hook_name="blocks.0.hook_resid_pre")),
             dict(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec))
    with pytest.raises(FormatError, match="normalize_activations"):
        read_saelens(tmp_path / "norm")


def test_saelens_layout_names_the_architecture_and_hooks(zoo, tmp_path):
    _, tc = zoo
    cfg = json.loads((write_saelens(tc, tmp_path) / "layer_1" / "cfg.json").read_text())
    assert cfg["architecture"] == "topk_skip_transcoder" and cfg["k"] == tc.k and cfg["d_out"] == cfg["d_in"]
    assert cfg["metadata"]["hook_name"] == "blocks.1.mlp.hook_in"
    assert cfg["metadata"]["hook_name_out"] == "blocks.1.hook_mlp_out"
    assert cfg["apply_b_dec_to_input"] is False


# ---- graphs --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph(zoo):
    model, tc = zoo
    return prompt_graph(model, "36+59=", tc, n_logits=3, zero_positions=(0,), progress=False)


def test_zero_positions_hold_position_0_constant_and_stay_exact(zoo, graph):
    model, tc = zoo
    assert not any(n["kind"] == "feature" and n["position"] == 0 for n in graph.nodes)
    assert all(n["activation"] == 0.0 for n in graph.nodes if n["kind"] == "error" and n["position"] == 0)
    assert graph.scores["max_abs_error"] < 1e-4 and graph.scores["max_rel_error_logits"] < 1e-4
    plain = prompt_graph(model, "36+59=", tc, n_logits=3, progress=False)
    assert any(n["kind"] == "feature" and n["position"] == 0 for n in plain.nodes)
    both = prompt_graph(model, "36+59=", tc, n_logits=3, completeness="all-nodes", progress=False)
    assert both.scores["completeness"] == both.scores["completeness_all_nodes"]
    # embedding and error nodes count as complete there: the average over every node is higher
    assert both.scores["completeness_all_nodes"] > both.scores["completeness_features"]
    with pytest.raises(ConfigError, match="completeness"):
        prompt_graph(model, "36+59=", tc, completeness="every", progress=False)


def test_graph_json_has_circuit_tracers_nodes_and_links(graph, tmp_path):
    path = write_circuit_tracer_graph(graph, tmp_path / "g.json")
    doc = json.loads(path.read_text())
    assert set(doc) == {"metadata", "qParams", "nodes", "links"}
    assert doc["metadata"]["slug"] == "g" and doc["metadata"]["prompt_tokens"] == graph.tokens
    ids = {n["node_id"] for n in doc["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in doc["links"])
    kinds = {n["feature_type"] for n in doc["nodes"]}
    assert {"embedding", "logit", "cross layer transcoder"} <= kinds
    # every embedding and logit is written; logits by token id at the last position, the first is the target
    logits = [n for n in doc["nodes"] if n["feature_type"] == "logit"]
    assert [n["feature"] for n in logits] == [n["token_id"] for n in graph.nodes if n["kind"] == "logit"]
    assert logits[0]["is_target_logit"] and logits[0]["node_id"] == f"3_{logits[0]['feature']}_4"
    assert sum(n["feature_type"] == "embedding" for n in doc["nodes"]) == len(graph.tokens)
    for n in doc["nodes"]:
        if n["feature_type"] == "cross layer transcoder":
            layer, feature, pos = map(int, n["node_id"].split("_"))
            assert n["feature"] == cantor_pairing(layer, feature) and n["ctx_idx"] == pos
    index = json.loads((tmp_path / "graph-metadata.json").read_text())
    assert [g["slug"] for g in index["graphs"]] == ["g"]


def _circuit_tracer_pickle(graph, path) -> None:
    """A .pt as circuit-tracer's Graph.to_pt writes it: its two classes under their own module names."""
    names = ["circuit_tracer", "circuit_tracer.attribution", "circuit_tracer.attribution.targets",
             "circuit_tracer.utils", "circuit_tracer.utils.tl_nnsight_mapping"]
    modules = {name: types.ModuleType(name) for name in names}

    class LogitTarget(NamedTuple):
        token_str: str
        vocab_idx: int

    @dataclasses.dataclass
    class UnifiedConfig:
        n_layers: int
        d_model: int
        tokenizer_name: str
        model_name: str
        dtype: Any = None

    for cls, module in ((LogitTarget, names[2]), (UnifiedConfig, names[4])):
        cls.__module__, cls.__qualname__ = module, cls.__name__
        setattr(modules[module], cls.__name__, cls)
    order = circuit_tracer_order(graph)
    nodes = [graph.nodes[i] for i in order.tolist()]
    features = [n for n in nodes if n["kind"] == "feature"]
    logits = [n for n in nodes if n["kind"] == "logit"]
    saved = dict(sys.modules)
    sys.modules.update(modules)
    try:
        torch.save(dict(
            input_string=graph.prompt, adjacency_matrix=graph.edges[order][:, order],
            cfg=UnifiedConfig(2, 128, "tok", "add-100", torch.float32),
            active_features=torch.tensor([[n["layer"], n["position"], n["feature"]] for n in features]),
            logit_targets=[LogitTarget(n["token"], n["token_id"]) for n in logits],
            logit_probabilities=torch.tensor([n["probability"] for n in logits]), vocab_size=209,
            input_tokens=torch.tensor([n["token_id"] for n in nodes if n["kind"] == "embedding"]),
            selected_features=torch.arange(len(features)),
            activation_values=torch.tensor([n["activation"] for n in features]), scan="test"), path)
    finally:
        sys.modules.clear()
        sys.modules.update(saved)


def test_a_circuit_tracer_graph_file_loads_with_equal_edges(zoo, graph, tmp_path):
    model, _ = zoo
    _circuit_tracer_pickle(graph, tmp_path / "g.pt")
    back = read_circuit_tracer_graph(tmp_path / "g.pt", model)
    assert torch.equal(back.edges, graph.edges)
    assert [(n["kind"], n["layer"], n["position"], n["feature"]) for n in back.nodes] == [
        (n["kind"], n["layer"], n["position"], n["feature"]) for n in graph.nodes]
    assert back.tokens == graph.tokens
    assert back.scores["replacement"] == pytest.approx(graph.scores["replacement"], abs=1e-5)
    assert back.scores["completeness"] == pytest.approx(graph.scores["completeness_all_nodes"], abs=1e-5)


def test_a_graph_file_with_other_code_in_it_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("not run",))

    torch.save({"adjacency_matrix": Payload()}, tmp_path / "bad.pt", pickle_module=pickle)
    with pytest.raises(ResultFileError, match="loads safely"):
        read_circuit_tracer_graph(tmp_path / "bad.pt")


# ---- subspaces -----------------------------------------------------------------------------------


def test_a_das_subspace_round_trips_through_pyvenes_format_with_the_same_iia(zoo, tmp_path):
    model, _ = zoo
    prompts = task_prompts(model, "zoo:add-100", limit=600).correct_only(model)
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=300, seed=0)
    fit = causal.das(model, dataset, site="mlp_post", layer=0, positions=["b", "final"], k=2, steps=5,
                     per_position=True, baselines=(), progress=False)
    folder = causal.write_pyvene(fit, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert [r[1] for r in config["representations"]] == ["mlp_activation", "mlp_activation"]
    assert config["sorted_keys"] == [f"layer_0_comp_mlp_activation_unit_pos_nunit_1#{i}" for i in range(2)]
    state = torch.load(folder / f"intkey_{config['sorted_keys'][0]}.bin", weights_only=True)
    assert {"embed_dim", "interchange_dim", "rotate_layer.parametrizations.weight.original"} <= set(state)
    site = json.loads((folder / "arithinterp_site.json").read_text())
    assert site["transformer_lens_hook"] == "blocks.0.mlp.hook_post" and site["positions"] == ["b", "final"]
    intervention, where = causal.read_pyvene(folder)
    assert torch.allclose(intervention.basis(), fit.basis, atol=1e-5)
    assert causal.score_subspace(model, dataset, intervention, where)["iia"] == fit.iia


def test_pyvene_state_holds_the_basis_pyvene_computes():
    from arithinterp.causal.subspace_files import basis_from_state, pyvene_state

    basis = causal.orthonormal(torch.randn(3, 10, generator=torch.Generator().manual_seed(3)))
    state = pyvene_state(basis)
    assert state["rotate_layer.parametrizations.weight.original"].shape == (10, 3)
    assert torch.allclose(basis_from_state(state), basis, atol=1e-6)
    with pytest.raises(ResultFileError, match="LowRankRotatedSpaceIntervention"):
        basis_from_state({"weight": basis})
