"""Saved results: a damaged folder is refused naming the file and the field, a newer format is
refused, and a folder holding another result is not overwritten by accident."""

from __future__ import annotations

import json

import pytest
import torch

from arithinterp.errors import ArithInterpError, ResultFileError


@pytest.fixture(scope="module")
def circuit(tiny_model):
    from arithinterp import circuits
    from arithinterp.tasks import arithmetic

    pairs = arithmetic(tiny_model, "+", range(10, 16), range(20, 26)).counterfactual(vary="a", seed=0)[:6]
    return circuits.score_edges(tiny_model, pairs, "eap", progress=False)


@pytest.fixture()
def saved(circuit, tmp_path):
    return circuit.save(tmp_path / "circuit")


def _edit_json(folder, change):
    stored = json.loads((folder / "result.json").read_text())
    change(stored)
    (folder / "result.json").write_text(json.dumps(stored))


def test_intact_folder_loads_the_same_circuit(circuit, saved):
    from arithinterp.circuits import Circuit

    loaded = Circuit.load(saved)
    assert loaded.edges == circuit.edges and torch.equal(loaded.scores, circuit.scores)
    from arithinterp.results import FORMAT_VERSION

    assert json.loads((saved / "result.json").read_text())["format"] == FORMAT_VERSION == 1


def _drop(key):
    return lambda stored: stored["fields"].pop(key)


def _drop_meta(key):
    return lambda stored: stored["fields"]["meta"].pop(key)


def _shorten(key):
    return lambda stored: stored["fields"].__setitem__(key, stored["fields"][key][:-1])


@pytest.mark.parametrize("damage, match", [
    ("no_tensors", r"tensors\.safetensors is missing"),
    ("truncated_tensors", r"tensors\.safetensors is damaged, truncated or not a safetensors file"),
    ("empty_tensors", r"tensors\.safetensors is damaged, truncated or not a safetensors file"),
    ("truncated_json", r"result\.json is damaged or truncated: it cannot be read as JSON"),
    ("not_json", r"result\.json is damaged or truncated: it cannot be read as JSON"),
    ("no_type", r"result\.json has no 'type' field"),
    ("no_fields", r"result\.json has no 'fields' object"),
    ("no_edges", r"result\.json has no field 'edges', which a Circuit needs"),
    ("no_layout", r"result\.json: field 'meta' has no 'layout', which a Circuit needs"),
    ("short_senders", r"'scores' and 'senders' share the 'edge' axis but have (\d+) and (?!\1)\d+ along it"),
    ("edges_not_a_list", r"result\.json: field 'edges' should be a list, got str"),
    ("newer_format", r"result format 2, newer than this arithinterp reads \(format 1\); upgrade arithinterp"),
    ("bad_format", r"result\.json: field 'format' holds 'one': Input should be a valid integer"),
    ("no_scores", r"tensors\.safetensors has no field 'scores', which a Circuit needs"),
])
def test_damaged_folder_is_refused_naming_file_and_field(saved, damage, match):
    from safetensors.torch import load_file, save_file

    from arithinterp.circuits import Circuit

    tensors, text = saved / "tensors.safetensors", (saved / "result.json").read_text()
    if damage == "no_tensors":
        tensors.unlink()
    elif damage == "truncated_tensors":
        tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    elif damage == "empty_tensors":
        tensors.write_bytes(b"")
    elif damage == "truncated_json":
        (saved / "result.json").write_text(text[: len(text) // 2])
    elif damage == "not_json":
        (saved / "result.json").write_bytes(b"\x89PNG\r\n")
    elif damage == "no_type":
        _edit_json(saved, lambda stored: stored.pop("type"))
    elif damage == "no_fields":
        _edit_json(saved, lambda stored: stored.pop("fields"))
    elif damage == "no_edges":
        _edit_json(saved, _drop("edges"))
    elif damage == "no_layout":
        _edit_json(saved, _drop_meta("layout"))
    elif damage == "short_senders":
        _edit_json(saved, _shorten("senders"))
    elif damage == "edges_not_a_list":
        _edit_json(saved, lambda stored: stored["fields"].__setitem__("edges", "e0,e1"))
    elif damage == "newer_format":
        _edit_json(saved, lambda stored: stored.__setitem__("format", 2))
    elif damage == "bad_format":
        _edit_json(saved, lambda stored: stored.__setitem__("format", "one"))
    elif damage == "no_scores":
        save_file({k: v for k, v in load_file(str(tensors)).items() if k != "scores"}, str(tensors))
    with pytest.raises(ResultFileError, match=match) as error:
        Circuit.load(saved)
    assert str(saved) in str(error.value) and isinstance(error.value, ArithInterpError)


def test_a_result_saved_without_a_format_reads_as_format_1(circuit, saved):
    from arithinterp.circuits import Circuit

    _edit_json(saved, lambda stored: stored.pop("format"))
    assert Circuit.load(saved).edges == circuit.edges


def test_a_folder_from_an_older_version_without_a_field_says_what_to_do(circuit, saved):
    """A folder an earlier arithinterp saved before a field the class now needs existed: the error
    names the version that saved it and what to do (recompute, or load it with that version)."""
    from arithinterp import __version__
    from arithinterp.circuits import Circuit

    def older(stored):
        stored.pop("format")  # saved before the format was written, too
        stored["fields"].pop("channels")
        stored["fields"]["meta"]["arithinterp_version"] = "0.0.1"

    _edit_json(saved, older)
    advice = (rf"the result was saved by arithinterp 0\.0\.1, before this version \({__version__}\) added the field: "
              r"recompute it with this version, or load it with arithinterp 0\.0\.1")
    with pytest.raises(ResultFileError, match="has no field 'channels', which a Circuit needs; " + advice):
        Circuit.load(saved)


def test_a_folder_from_a_newer_version_without_a_field_says_to_load_it_there(saved):
    from arithinterp.circuits import Circuit

    def newer(stored):
        stored["fields"].pop("channels")
        stored["fields"]["meta"]["arithinterp_version"] = "99.0.0"

    _edit_json(saved, newer)
    with pytest.raises(ResultFileError, match=r"the result was saved by arithinterp 99\.0\.0, newer than this version "
                                              r"\(.*\): load it with arithinterp 99\.0\.0 or later"):
        Circuit.load(saved)


def test_a_field_missing_from_a_folder_of_this_version_is_damage(saved):
    from arithinterp.circuits import Circuit

    _edit_json(saved, _drop("channels"))
    with pytest.raises(ResultFileError, match="has no field 'channels', which a Circuit needs; the file is damaged"):
        Circuit.load(saved)


def test_saving_over_a_different_result_needs_overwrite(circuit, saved):
    from arithinterp.circuits import Circuit, top_n

    smaller = top_n(circuit, 3)
    with pytest.raises(ResultFileError, match=r"already holds a saved Circuit that differs from this Circuit; "
                                              r"pass overwrite=True to replace it"):
        smaller.save(saved)
    assert Circuit.load(saved).n_kept == circuit.n_kept  # the first result is untouched
    circuit.save(saved)  # the same result again: harmless
    smaller.save(saved, overwrite=True)
    assert Circuit.load(saved).n_kept == 3


def test_saving_over_a_damaged_result_needs_overwrite(circuit, saved):
    (saved / "result.json").write_text("{")
    with pytest.raises(ResultFileError, match="already holds a saved result that differs"):
        circuit.save(saved)


def test_a_patch_result_with_a_layer_list_of_the_wrong_length_is_refused(tiny_model, tmp_path):
    from arithinterp import patching
    from arithinterp.tasks import arithmetic

    pairs = arithmetic(tiny_model, "+", range(10, 16), range(20, 26)).counterfactual(vary="a", seed=0)[:6]
    folder = patching.activation_patching(tiny_model, pairs, "resid_pre", progress=False).save(tmp_path / "p")
    assert patching.PatchResult.load(folder).layers == [0, 1]
    _edit_json(folder, lambda stored: stored["fields"].__setitem__("layers", [0, 1, 2]))
    with pytest.raises(ResultFileError, match=r"'values' and 'layers' share the 'layer' axis but have 2 and 3 "
                                              r"along it"):
        patching.PatchResult.load(folder)


@pytest.mark.parametrize("fingerprint", [None, "x", 7])
def test_a_damaged_fingerprint_is_refused_not_read_as_none_recorded(saved, fingerprint):
    """A fingerprint of None would skip the model check, so a circuit (or transcoders) from another model
    would be used without a word; a damaged one is refused at load."""
    from arithinterp.circuits import Circuit

    _edit_json(saved, lambda stored: stored["fields"]["meta"].__setitem__("fingerprint", fingerprint))
    with pytest.raises(ResultFileError, match=r"meta 'fingerprint' holds .*the file is damaged"):
        Circuit.load(saved)


def test_a_deleted_fingerprint_is_refused_where_the_model_is_named(saved):
    """Deleting the fingerprint of a part made on a named model skipped the model check as well."""
    from arithinterp.circuits import Circuit

    _edit_json(saved, lambda stored: stored["fields"]["meta"].pop("fingerprint"))
    with pytest.raises(ResultFileError, match=r"names the model .* but not that model's weight fingerprint"):
        Circuit.load(saved)


def test_transcoder_weights_saved_as_integers_are_refused(tiny_model, tmp_path):
    """Integer weights loaded silently and gave wrong features (or a raw dtype error in the forward)."""
    from safetensors.torch import load_file, save_file

    from arithinterp.features import Transcoders, train_transcoders
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny_model, "+", range(10, 14), range(20, 24))
    folder = train_transcoders(tiny_model, prompts, n_features=8, k=2, steps=2, batch_size=16,
                               progress=False).save(tmp_path / "tc")
    tensors = load_file(str(folder / "tensors.safetensors"))
    tensors["W_enc"] = tensors["W_enc"].long()
    save_file(tensors, str(folder / "tensors.safetensors"))
    with pytest.raises(ResultFileError, match=r"field 'W_enc' should hold a floating-point tensor"):
        Transcoders.load(folder)
