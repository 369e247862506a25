"""Files in and out, case by case: each input that once lost work, read silently wrong or ended in a raw
traceback, now refused with an ``ArithInterpError`` naming the file and the field (or read right).

Lost work (the writers), silent-wrong and damaged reads (circuit-tracer's graph ``.pt`` and
transcoders, SAELens, pyvene), saved results edited by hand or unsealed, results used on another
model than the one they were made on, and sizes that cannot fit refused before the work.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from arithinterp.errors import ArithInterpError, ConfigError, FormatError, ModelMismatchError, ResultFileError


@pytest.fixture(scope="module")
def prompts(tiny_model):
    from arithinterp.tasks import arithmetic

    return arithmetic(tiny_model, "+", range(10, 22), range(20, 32))


@pytest.fixture(scope="module")
def transcoders(tiny_model, prompts):
    from arithinterp.features import train_transcoders

    return train_transcoders(tiny_model, prompts, n_features=16, k=2, steps=3, batch_size=64, progress=False)


@pytest.fixture(scope="module")
def graph(tiny_model, prompts, transcoders):
    from arithinterp import features

    return features.attribution_graph(tiny_model, prompts[:1], transcoders, n_logits=2, max_nodes=10, progress=False)


@pytest.fixture(scope="module")
def dataset(prompts):
    from arithinterp import causal

    return causal.interchange_dataset(prompts, "sum_mod_10", n=60, seed=0)


@pytest.fixture(scope="module")
def das(tiny_model, dataset):
    from arithinterp import causal

    return causal.das(tiny_model, dataset, "resid_post", 0, 2, positions="final", steps=3, baselines=(),
                      progress=False)


@pytest.fixture(scope="module")
def other_model(number_tokenizer):
    """A model of the tiny model's shape and vocabulary with other weights."""
    from conftest import tiny_bridge

    return tiny_bridge(number_tokenizer, seed=7)


# --- lost work ----------------------------------------------------------------------------------------


def _writers(graph, transcoders, das):
    from arithinterp import causal, features

    return {
        "graph": (lambda p, **kw: features.write_circuit_tracer_graph(graph, p / "mine.json", **kw), "mine.json"),
        "pyvene": (lambda p, **kw: causal.write_pyvene(das, p / "d", **kw), "d"),
        "circuit-tracer": (lambda p, **kw: features.write_circuit_tracer_transcoders(transcoders, p / "d", **kw), "d"),
        "saelens": (lambda p, **kw: features.write_saelens(transcoders, p / "d", **kw), "d"),
    }


@pytest.mark.parametrize("kind", ["graph", "pyvene", "circuit-tracer", "saelens"])
def test_an_interop_writer_does_not_replace_what_is_there(kind, graph, transcoders, das, tmp_path):
    write, name = _writers(graph, transcoders, das)[kind]
    target = tmp_path / name
    if name.endswith(".json"):
        target.write_text("my graph")
    else:
        target.mkdir()
        (target / "config.json").write_text("my config")  # a name the writer writes too
    with pytest.raises(ConfigError, match=r"already (exists|holds files); pass overwrite=True"):
        write(tmp_path)
    assert (target.read_text() if name.endswith(".json") else (target / "config.json").read_text()).startswith("my")
    write(tmp_path, overwrite=True)


@pytest.mark.parametrize("kind", ["graph", "pyvene", "circuit-tracer", "saelens"])
def test_an_interop_writer_does_not_follow_a_link_out_of_its_folder(kind, graph, transcoders, das, tmp_path):
    write, name = _writers(graph, transcoders, das)[kind]
    outside = tmp_path / "elsewhere"
    if name.endswith(".json"):
        outside.write_text("someone's file")
    else:
        outside.mkdir()
        (outside / "config.json").write_text("someone's file")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / name).symlink_to(outside)
    with pytest.raises(ConfigError, match="symbolic link .* outside the folder"):
        write(tmp_path / "out", overwrite=True)
    assert (outside.read_text() if name.endswith(".json") else (outside / "config.json").read_text()) == \
        "someone's file"


@pytest.mark.parametrize("overwrite", ["no", 1, "False", None])
def test_write_report_overwrite_is_strictly_a_bool(overwrite, tmp_path):
    from arithinterp.report import write_report

    page = tmp_path / "r.html"
    page.write_text("the old page")
    with pytest.raises(ConfigError, match="overwrite"):
        write_report("zoo:add-100", out=page, overwrite=overwrite, progress=False)
    assert page.read_text() == "the old page"


def test_an_interrupted_report_keeps_the_page_it_would_replace(tiny_model, tmp_path, monkeypatch):
    """With overwrite, the page in progress is written beside the old one, which it replaces only at the end."""
    import arithinterp.report as report

    page = tmp_path / "r.html"
    page.write_text("the old page")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "_run_stage", interrupted)
    with pytest.raises(KeyboardInterrupt):
        report.write_report(tiny_model, out=page, stages=["accuracy"], limit=10, budget=5, progress=False,
                            overwrite=True)
    assert page.read_text() == "the old page"
    side = tmp_path / "r.in-progress.html"
    assert "Interrupted" in side.read_text() and "keeps the previous page" in side.read_text()
    monkeypatch.undo()
    report.write_report(tiny_model, out=page, stages=["accuracy"], limit=10, budget=5, progress=False,
                        overwrite=True)
    assert "<html" in page.read_text() and not side.exists()


# --- circuit-tracer transcoders and SAELens: silent-wrong reads ----------------------------------------


def _circuit_tracer_folder(transcoders, folder, **config):
    from arithinterp.features import write_circuit_tracer_transcoders

    write_circuit_tracer_transcoders(transcoders, folder)
    if config:
        stored = json.loads((folder / "config.yaml").read_text())
        (folder / "config.yaml").write_text(json.dumps({**stored, **config}))
    return folder


@pytest.mark.parametrize("change, match", [
    (lambda w: w.fill_(math.nan), r"'W_enc' holds \d+ non-finite value"),
    (lambda w: w.fill_(math.inf), r"'W_enc' holds \d+ non-finite value"),
    (lambda w: w.long(), r"'W_enc' should be floating point \(weights\), got torch.int64"),
    (lambda w: w[:, :-1], r"'W_enc' should have shape"),
], ids=["nan", "inf", "int64", "short"])
def test_circuit_tracer_weights_that_are_not_finite_floats_are_refused(change, match, transcoders, tmp_path):
    from arithinterp.features import read_circuit_tracer_transcoders

    folder = _circuit_tracer_folder(transcoders, tmp_path / "ct")
    tensors = load_file(str(folder / "layer_1.safetensors"))
    tensors["W_enc"] = change(tensors["W_enc"].clone()).contiguous()
    save_file(tensors, str(folder / "layer_1.safetensors"))
    with pytest.raises(FormatError, match=rf"layer_1\.safetensors: {match}"):
        read_circuit_tracer_transcoders(folder)


@pytest.mark.parametrize("k", [-5, 0, 100000, 2.5, "2"])
def test_a_topk_k_outside_one_to_the_features_is_refused(k, tiny_model, transcoders, tmp_path):
    from arithinterp.features import read_circuit_tracer_transcoders

    folder = _circuit_tracer_folder(transcoders, tmp_path / "ct", k=k)
    for model in (None, tiny_model):  # with a model it was a RuntimeError in the forward
        with pytest.raises(FormatError, match=r"config\.yaml"):
            read_circuit_tracer_transcoders(folder, model)
    with pytest.raises(ConfigError, match=r"k: a TopK set needs k from 1 to its 16 features|k=\S+ is not accepted"):
        read_circuit_tracer_transcoders(_circuit_tracer_folder(transcoders, tmp_path / "ok"), k=k)


def _saelens(transcoders, folder, change_cfg=None, change_weights=None):
    from arithinterp.features import write_saelens

    write_saelens(transcoders, folder)
    layer = folder / "layer_0"
    if change_cfg is not None:
        cfg = json.loads((layer / "cfg.json").read_text())
        (layer / "cfg.json").write_text(json.dumps(change_cfg(cfg)))
    if change_weights is not None:
        tensors = load_file(str(layer / "sae_weights.safetensors"))
        change_weights(tensors)
        save_file(tensors, str(layer / "sae_weights.safetensors"))
    return folder


@pytest.mark.parametrize("change_cfg, change_weights, match", [
    (lambda c: {**c, "d_in": 7}, None, r"'W_enc' should have shape \[7, 16\]"),
    (lambda c: {**c, "d_sae": -1}, None, r"field 'd_sae' holds -1"),
    (lambda c: {**c, "d_sae": "16"}, None, r"field 'd_sae' holds '16'"),
    (lambda c: [c], None, r"cfg\.json: expected SAELens's cfg\.json \(a mapping of fields\), got list"),
    (lambda c: {**c, "k": 0}, None, r"field 'k' holds 0"),
    (lambda c: {**c, "architecture": "gated"}, None, r"field 'architecture' holds 'gated'"),
    (None, lambda t: t["b_dec"].fill_(math.nan), r"'b_dec' holds \d+ non-finite"),
    (None, lambda t: t.pop("W_dec"), r"has no 'W_dec'"),
], ids=["d_in", "d_sae", "d_sae-string", "list", "k", "architecture", "nan", "missing"])
def test_saelens_files_that_break_their_schema_are_refused(change_cfg, change_weights, match, transcoders,
                                                           tmp_path):
    from arithinterp.features import read_saelens

    folder = _saelens(transcoders, tmp_path / "sl", change_cfg, change_weights)
    with pytest.raises(FormatError, match=match):
        read_saelens(folder)


def test_transcoders_read_with_a_model_are_tied_to_it(tiny_model, other_model, transcoders, tmp_path, prompts):
    from arithinterp.features import read_saelens

    read = read_saelens(_saelens(transcoders, tmp_path / "sl"), tiny_model, prompts=prompts, max_fvu=1e9)
    assert len(read.meta["fingerprint"]) == 16
    with pytest.raises(ModelMismatchError, match="fingerprint"):
        read.check_model(other_model)


# --- circuit-tracer graphs -------------------------------------------------------------------------


def _graph_pt(graph, path, config: Any = None, **changes) -> None:
    """A .pt as circuit-tracer's Graph.to_pt writes it (its two classes under their module names), with
    ``changes`` made to the dict and ``config`` the fields of its config."""
    from arithinterp.features.graph_files import circuit_tracer_order

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
        d_vocab: int
        model_name: str

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
        content = dict(
            input_string=graph.prompt, adjacency_matrix=graph.edges[order][:, order],
            cfg=UnifiedConfig(**(config or dict(n_layers=2, d_model=64, d_vocab=209, model_name="tiny"))),
            active_features=torch.tensor([[n["layer"], n["position"], n["feature"]] for n in features]),
            logit_targets=[LogitTarget(n["token"], n["token_id"]) for n in logits],
            logit_probabilities=torch.tensor([n["probability"] for n in logits]), vocab_size=209,
            input_tokens=torch.tensor([n["token_id"] for n in nodes if n["kind"] == "embedding"]),
            selected_features=torch.arange(len(features)),
            activation_values=torch.tensor([n["activation"] for n in features]), scan="test")
        for key, change in changes.items():
            content[key] = change(content[key]) if callable(change) else change
        torch.save(content, path)
    finally:
        sys.modules.clear()
        sys.modules.update(saved)


def _set(column: int, value: int):
    def change(active: torch.Tensor) -> torch.Tensor:
        active = active.clone()
        active[0, column] = value
        return active

    return change


def test_an_intact_graph_file_reads_back(tiny_model, graph, tmp_path):
    from arithinterp.features import read_circuit_tracer_graph

    _graph_pt(graph, tmp_path / "g.pt")
    back = read_circuit_tracer_graph(tmp_path / "g.pt", tiny_model)
    assert torch.equal(back.edges, graph.edges) and back.tokens == graph.tokens
    assert back.meta["fingerprint"] == graph.meta["fingerprint"]


@pytest.mark.parametrize("config, changes, match", [
    (dict(n_layers=5, d_model=64, d_vocab=209, model_name="tiny"), {}, r"adjacency_matrix' should have shape"),
    (None, dict(active_features=_set(0, 99)), r"active_features \(layer\)' holds 99, outside the file's 2 layers"),
    (None, dict(active_features=_set(2, 10**9)), r"active_features \(feature\)' holds 1000000000"),
    (None, dict(active_features=_set(1, 40)), r"active_features \(position\)' holds 40, outside the prompt"),
    (None, dict(input_tokens=lambda t: torch.cat([t[:-1], torch.tensor([10**6])])), r"'input_tokens' holds 1000000"),
    (None, dict(logit_probabilities=lambda p: p[:-1]), r"'logit_probabilities' should have shape"),
    (None, dict(logit_probabilities=lambda p: p + 2), r"logit_probabilities' holds numbers outside \[0, 1\]"),
    (None, dict(adjacency_matrix=lambda a: a.fill_(math.nan)), r"'adjacency_matrix' holds \d+ non-finite"),
    (None, dict(adjacency_matrix=lambda a: a.long()), r"'adjacency_matrix' should be floating point"),
    (None, dict(selected_features=torch.tensor([10**6])), r"'selected_features' holds 1000000"),
    (None, dict(cfg=7), r"expected circuit-tracer's model config \(a mapping of fields\), got int"),
    (None, dict(logit_targets=[("x", "y")]), r"'logit_targets\[0\]' holds"),
    (None, dict(input_string=5), r"field 'input_string' holds 5"),
], ids=["n_layers", "layer", "feature", "position", "token", "probabilities-short", "probabilities-range", "nan",
        "int-adjacency", "selected", "cfg-int", "targets", "string"])
def test_a_graph_file_that_breaks_its_schema_is_refused(config, changes, match, tiny_model, graph, tmp_path):
    from arithinterp.features import read_circuit_tracer_graph

    _graph_pt(graph, tmp_path / "g.pt", config, **changes)
    with pytest.raises(FormatError, match=match):
        read_circuit_tracer_graph(tmp_path / "g.pt", tiny_model)


def test_a_graph_made_on_another_model_is_refused(tiny_digit_model, graph, tmp_path):
    from arithinterp.features import read_circuit_tracer_graph

    _graph_pt(graph, tmp_path / "g.pt")
    with pytest.raises(FormatError, match="made on another model: d_vocab 209 vs"):
        read_circuit_tracer_graph(tmp_path / "g.pt", tiny_digit_model)


def test_feature_indices_are_checked_against_the_transcoders_given(tiny_model, graph, transcoders, tmp_path):
    from arithinterp.features import read_circuit_tracer_graph

    _graph_pt(graph, tmp_path / "g.pt", active_features=_set(2, 16))
    with pytest.raises(FormatError, match=r"holds 16, outside the transcoders' 16 features"):
        read_circuit_tracer_graph(tmp_path / "g.pt", tiny_model, transcoders=transcoders)


def test_a_graph_config_given_as_a_dict_is_read(tiny_model, graph, tmp_path):
    from arithinterp.features import read_circuit_tracer_graph

    _graph_pt(graph, tmp_path / "g.pt", cfg=dict(n_layers=2, d_model=64, model_name="tiny"))
    assert torch.equal(read_circuit_tracer_graph(tmp_path / "g.pt", tiny_model).edges, graph.edges)


# --- pyvene -----------------------------------------------------------------------------------------


def _edit(file, change) -> None:
    file.write_text(json.dumps(change(json.loads(file.read_text()))))


def _unsealed(folder, spoil) -> None:
    """Damage the folder's first ``.bin`` as in a folder that records no digests (pyvene's own)."""
    _edit(folder / "arithinterp_site.json", lambda m: {k: v for k, v in m.items() if k != "sha256"})
    spoil(next(folder.glob("*.bin")))


@pytest.mark.parametrize("damage, match", [
    (lambda f: (f / "config.json").write_text("{"), r"config\.json is damaged or truncated"),
    (lambda f: _edit(f / "config.json", lambda c: {**c, "sorted_keys": "abc"}), r"field 'sorted_keys' holds"),
    (lambda f: _edit(f / "config.json", lambda c: {**c, "sorted_keys": ["../../x"]}), r"field 'sorted_keys\[0\]'"),
    (lambda f: _edit(f / "config.json", lambda c: [c]), r"got list"),
    (lambda f: _edit(f / "config.json", lambda c: {**c, "representations": [[0, "x", "pos", 1, 0]]}),
     r"low_rank_dimension' holds 0"),
    (lambda f: _unsealed(f, lambda b: b.write_bytes(b"\x80\x04not a pickle")), r"loads safely \(UnpicklingError"),
    (lambda f: _unsealed(f, lambda b: torch.save({"x": torch.zeros(2)}, b)), r"not a LowRankRotatedSpaceIntervention"),
    (lambda f: _unsealed(f, lambda b: torch.save({"rotate_layer.parametrizations.weight.original": torch.zeros(
        64, 2).long()}, b)), r"should be floating point"),
    (lambda f: next(f.glob("*.bin")).write_bytes(b"\x80\x04not a pickle"), r"field 'sha256' records .*changed"),
    (lambda f: _edit(f / "arithinterp_site.json", lambda m: {k: v for k, v in m.items() if k != "fingerprint"}),
     r"field 'fingerprint' is missing"),
    (lambda f: _edit(f / "arithinterp_site.json", lambda m: {**m, "layer": -1}), r"field 'layer' holds -1"),
    (lambda f: _edit(f / "arithinterp_site.json", lambda m: {**m, "site": "bogus"}), r"field 'site' holds 'bogus'"),
], ids=["truncated", "keys-string", "keys-path", "list", "rank-0", "not-pickle", "other-state", "int-weight",
        "sealed", "no-fingerprint", "layer", "site"])
def test_a_pyvene_folder_that_breaks_its_schema_is_refused(damage, match, das, tmp_path):
    from arithinterp import causal

    folder = causal.write_pyvene(das, tmp_path / "d")
    damage(folder)
    with pytest.raises(FormatError, match=match):
        causal.read_pyvene(folder)


def test_a_pyvene_weight_replaced_by_hand_is_refused(das, tmp_path):
    """A rotation edited consistently in shape and dtype: only the digests the site file keeps show it."""
    from arithinterp import causal
    from arithinterp.causal.subspace_files import pyvene_state

    folder = causal.write_pyvene(das, tmp_path / "d")
    bin_file = next(folder.glob("*.bin"))
    torch.save(pyvene_state(causal.orthonormal(torch.randn(64, 2, generator=torch.Generator().manual_seed(1)))),
               bin_file)
    with pytest.raises(FormatError, match=r"field 'sha256' records .*was changed after it was written"):
        causal.read_pyvene(folder)


def test_a_subspace_is_scored_only_on_its_model_and_site(tiny_model, other_model, das, dataset, tmp_path):
    from arithinterp import causal

    intervention, where = causal.read_pyvene(causal.write_pyvene(das, tmp_path / "d"))
    with pytest.raises(ModelMismatchError, match="fingerprint"):
        causal.score_subspace(other_model, dataset, intervention, where)
    wide = dataclasses.replace(where, site="mlp_post")  # 128 wide, the subspace 64
    with pytest.raises(ModelMismatchError, match="the subspace is 64 wide, but mlp_post at layer 0 of this model is"):
        causal.score_subspace(tiny_model, dataset, intervention, wide)
    for rows in ([10**6], [], [0, 0]):
        with pytest.raises(ConfigError, match="rows"):
            causal.score_subspace(tiny_model, dataset, intervention, where, rows=rows)
    assert 0 <= causal.score_subspace(tiny_model, dataset, intervention, where, rows=[0, 1, 2])["iia"] <= 1


# --- saved results --------------------------------------------------------------------------------


def _edit_result(folder, change) -> None:
    stored = json.loads((folder / "result.json").read_text())
    change(stored["fields"])
    (folder / "result.json").write_text(json.dumps(stored))


@pytest.fixture(scope="module")
def patch_result(tiny_model, prompts):
    from arithinterp import patching

    return patching.activation_patching(tiny_model, prompts.counterfactual(vary="a", seed=0)[:6], "resid_pre",
                                        progress=False)


@pytest.fixture(scope="module")
def circuit(tiny_model, prompts):
    from arithinterp import circuits

    return circuits.top_n(circuits.score_edges(tiny_model, prompts.counterfactual(vary="a", seed=0)[:6], "eap",
                                               progress=False), 5)


def test_a_field_edited_in_a_sealed_folder_is_refused_naming_it(patch_result, tmp_path):
    from arithinterp.patching import PatchResult

    folder = patch_result.save(tmp_path / "p")
    _edit_result(folder, lambda fields: fields.__setitem__("metric", "prob"))  # legal, but not what was saved
    with pytest.raises(ResultFileError, match=r"field\(s\) 'metric' are not what tensors\.safetensors was sealed with"):
        PatchResult.load(folder)


@pytest.mark.parametrize("kind, change, match", [
    ("patch", lambda f: f.__setitem__("axes", ["layer"]), r"field 'axes' should be the names of the cell axes"),
    ("patch", lambda f: f.__setitem__("site", "bogus"), r"field 'site' holds 'bogus'"),
    ("das", lambda f: f.__setitem__("iia", math.nan), r"field 'iia' should hold a number in \[0, 1\] \(not NaN\)"),
    ("circuit", lambda f: f.__setitem__("nodes", f["nodes"][:-1]), r"field 'nodes' should be every node a kept edge"),
], ids=["axes", "site", "iia", "node-short"])
def test_an_illegal_edit_is_refused_even_in_an_unsealed_folder(kind, change, match, patch_result, das, circuit,
                                                                tmp_path):
    """The issue's edits: a PatchResult whose axes say 1 cell axis (to_frame gave 2 rows of 10), a bogus
    site, a NaN IIA, a circuit a node short. Refused by the invariants before the seal is looked at."""
    result = {"patch": patch_result, "das": das, "circuit": circuit}[kind]
    folder = result.save(tmp_path / kind)
    _edit_result(folder, change)
    for unsealed in (False, True):
        with pytest.raises(ResultFileError, match=match):
            type(result).load(folder, unsealed=unsealed)


def test_an_unsealed_folder_with_another_results_tensors_is_refused(patch_result, tiny_model, prompts, tmp_path):
    """Tensors swapped in from another result of the same shape load silently in an unsealed folder:
    unsealed folders are refused unless asked for."""
    from arithinterp import patching

    other = patching.activation_patching(tiny_model, prompts.counterfactual(vary="b", seed=1)[:6], "resid_pre",
                                         progress=False)
    a, b = patch_result.save(tmp_path / "a"), other.save(tmp_path / "b")
    (a / "tensors.safetensors").write_bytes((b / "tensors.safetensors").read_bytes())
    with pytest.raises(ResultFileError, match="tensors.safetensors was changed after saving"):
        patching.PatchResult.load(a)
    stored = json.loads((a / "result.json").read_text())
    stored.pop("tensors_sha256")
    (a / "result.json").write_text(json.dumps(stored))
    save_file(load_file(str(a / "tensors.safetensors")), str(a / "tensors.safetensors"))  # no seal at all
    with pytest.raises(ResultFileError, match="is not sealed"):
        patching.PatchResult.load(a)


# --- results tied to their model ---------------------------------------------------------------------


def test_a_helix_fit_is_patch_tested_only_on_its_model(tiny_model, other_model, prompts):
    from arithinterp import helix
    from arithinterp.activations import collect

    acts = collect(tiny_model, prompts, sites=["resid_pre"], layers=[0], positions=["a"], progress=False)
    fit = helix.fit(acts, "a", (2, 5), n_pca=8, layer=0)
    assert fit.meta["fingerprint"] == acts.meta["fingerprint"]
    pairs = prompts.counterfactual(vary="a", seed=0)[:20]
    with pytest.raises(ModelMismatchError, match="fingerprint"):
        helix.patch_test(other_model, pairs, fit, n_boot=100)
    control = fit.on_model(other_model)  # a deliberate control: the fit applied to other weights
    assert control.meta["made_on_fingerprint"] == fit.meta["fingerprint"]
    assert helix.patch_test(other_model, pairs, control, n_boot=100).meta["fingerprint"] != fit.meta["fingerprint"]


def test_a_probe_result_records_its_model(tiny_model, prompts):
    from arithinterp import probes
    from arithinterp.activations import collect

    acts = collect(tiny_model, prompts, sites=["resid_pre"], layers=[0], positions=["a"], progress=False)
    result = probes.probe_layers(acts, "a_units", cv=3, progress=False)
    assert result.meta["fingerprint"] == acts.meta["fingerprint"] and result.meta["model"]


def test_another_models_importance_is_refused_by_classify(tiny_model, other_model, prompts):
    from arithinterp import neurons

    pairs = prompts.counterfactual(vary="a", seed=0)[:8]
    importance = neurons.importance(other_model, pairs, top_k=4)
    with pytest.raises(ModelMismatchError, match="importance_scores came from another model"):
        neurons.classify(tiny_model, prompts, pairs=pairs, importance_scores=importance)


# --- at the door ----------------------------------------------------------------------------------


@pytest.fixture()
def no_model_loads(monkeypatch):
    import arithinterp.models as models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad argument was refused")

    monkeypatch.setattr(models, "load_model", refuse)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seed="x"), "seed='x' is not accepted"),
    (dict(out=5), "out=5 is not accepted"),
    (dict(limit=3), "limit=3 is not accepted"),
    (dict(few_shot=-1), "few_shot=-1 is not accepted"),
    (dict(stages="accuracy"), "stages='accuracy' is not accepted"),
    (dict(template="{a}+{c}="), r"unknown field \{c\}"),
    (dict(template="{a}+{a}="), r"'\{a\}' and '\{b\}' once each"),
    (dict(operands="0-100000"), "operand pairs"),
    (dict(max_memory="lots"), "max_memory='lots' is not accepted"),
])
def test_write_report_refuses_bad_arguments_before_the_model_loads(kwargs, match, no_model_loads, tmp_path):
    from arithinterp.report import write_report

    with pytest.raises(ArithInterpError, match=match):
        write_report("zoo:add-100", **{"out": tmp_path / "r.html", "progress": False, **kwargs})
    assert not (tmp_path / "r.html").exists()


def test_a_few_shot_prefix_longer_than_the_context_is_refused_from_one_prompt(tiny_model, tmp_path, monkeypatch):
    """few_shot=1000 was refused after the whole prompt set was built (56 s): now from the first prompt."""
    from arithinterp.report import evaluation, write_report
    from arithinterp.tasks import generators

    built = []
    made = generators.prompts_for_pairs

    def counted(model, op, a, b, *args, **kwargs):
        built.append(len(a))
        return made(model, op, a, b, *args, **kwargs)

    monkeypatch.setattr(generators, "prompts_for_pairs", counted)
    monkeypatch.setattr("arithinterp.tasks.prompts_for_pairs", counted)
    with pytest.raises(ArithInterpError, match="more than the model's context of 32 tokens"):
        write_report(tiny_model, out=tmp_path / "r.html", few_shot=1000, progress=False)
    assert built == [1] and evaluation.MAX_OPERAND_PAIRS == 2**24


def test_sizes_that_cannot_fit_are_refused_before_the_work(tiny_model):
    from arithinterp import fourier
    from arithinterp.errors import TokenizationError

    with pytest.raises(ConfigError, match=r"a Fourier basis over 10,000,000 numbers takes"):
        fourier.fourier_basis(10**7)
    with pytest.raises(ConfigError, match=r"a Fourier basis over 1,000,000 numbers"):
        fourier.embedding_spectrum(tiny_model, numbers=10**6)
    with pytest.raises(TokenizationError, match=r"300 numbers cannot each be a single token of a vocabulary of 20"):
        fourier.embedding_spectrum(tiny_model, numbers=300)


@pytest.mark.slow
@pytest.mark.parametrize("after", [0.5, 1.5, 4.0])
def test_ctrl_c_at_any_moment_of_the_command_ends_with_one_line(after, tmp_path):
    import os
    import signal
    import subprocess
    import time

    command = [sys.executable, "-c", "import sys; from arithinterp.cli import main; sys.exit(main())", "report",
               "--out", str(tmp_path / "r.html"), "--limit", "200", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    time.sleep(after)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert "Traceback" not in err, err
    assert process.returncode == 130 and err.strip().splitlines()[-1].endswith("interrupted"), (process.returncode,
                                                                                                  err)
