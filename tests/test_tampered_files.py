"""Saved folders changed by hand after saving are refused at load, not read silently wrong: a ``meta``
emptied (it would read as an import that records no model, so the model check would be skipped) and
a weight edited in the tensor file (a square ``W_skip`` saved transposed shows nothing in its shape).
Folders that were never sealed (an earlier version's, another program's) load only when asked
(``unsealed=True``, with a warning); a saved import from SAELens / circuit-tracer files is sealed with
no fingerprint, and the shipped transcoders are sealed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from arithinterp.errors import ResultFileError
from arithinterp.results import DIGEST_KEY, JSON_FILE, TENSOR_FILE, UnsealedResultWarning


@pytest.fixture(scope="module")
def transcoders(tiny_model):
    from arithinterp.features import train_transcoders
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny_model, "+", range(10, 16), range(20, 26))
    return train_transcoders(tiny_model, prompts, n_features=16, k=2, steps=3, batch_size=64, progress=False)


@pytest.fixture(scope="module")
def subspace(tiny_model):
    from arithinterp import causal
    from arithinterp.tasks import arithmetic

    dataset = causal.interchange_dataset(arithmetic(tiny_model, "+", range(10, 22), range(20, 32)), "sum_mod_10",
                                         n=60, seed=0)
    return causal.das(tiny_model, dataset, "resid_post", 0, 2, positions="final", steps=3, baselines=(),
                      progress=False)


def _edit_meta(folder, change) -> None:
    stored = json.loads((folder / JSON_FILE).read_text())
    change(stored["fields"])
    (folder / JSON_FILE).write_text(json.dumps(stored, indent=1))


def _edit_tensor(folder, name: str, change, keep_header: bool) -> None:
    """Re-save one tensor changed, as by hand: with safetensors' ``save_file``, with or without the
    header metadata the file had."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    file = folder / TENSOR_FILE
    with safe_open(str(file), framework="pt") as handle:
        header = handle.metadata()
    tensors = load_file(str(file))
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, str(file), metadata=header if keep_header else None)


def _transposed_skip(skip: torch.Tensor) -> torch.Tensor:
    return skip.transpose(-1, -2)


def _flipped_column(basis: torch.Tensor) -> torch.Tensor:
    return torch.cat([-basis[..., :1], basis[..., 1:]], dim=-1)


def _cases(transcoders, subspace):
    from arithinterp.causal import DASResult
    from arithinterp.features import Transcoders

    return {"transcoders": (Transcoders, transcoders, "W_skip", _transposed_skip),
            "das": (DASResult, subspace, "basis", _flipped_column)}


@pytest.mark.parametrize("kind", ["transcoders", "das"])
def test_an_untouched_folder_loads_the_same(kind, transcoders, subspace, tmp_path):
    cls, result, name, _ = _cases(transcoders, subspace)[kind]
    loaded = cls.load(result.save(tmp_path / kind))
    assert torch.equal(getattr(loaded, name), getattr(result, name)) and loaded.meta == result.meta
    assert len(json.loads((tmp_path / kind / JSON_FILE).read_text())[DIGEST_KEY]) == 64


@pytest.mark.parametrize("kind", ["transcoders", "das"])
def test_an_emptied_meta_is_refused_not_read_as_an_import(kind, transcoders, subspace, tmp_path):
    """With ``meta`` emptied the folder looks like an import from another tool, which names no model:
    the fingerprint check would be skipped and the part used on any model of its shape."""
    cls, result, _, _ = _cases(transcoders, subspace)[kind]
    folder = result.save(tmp_path / kind)
    _edit_meta(folder, lambda fields: fields.__setitem__("meta", {}))
    with pytest.raises(ResultFileError, match=rf"{JSON_FILE}: the folder's metadata was removed or edited after "
                                              rf"saving: {TENSOR_FILE} was saved for the model whose weight "
                                              r"fingerprint is [0-9a-f]{16}, but field 'meta' has no fingerprint"):
        cls.load(folder)


def test_a_fingerprint_replaced_by_hand_is_refused(transcoders, tmp_path):
    from arithinterp.features import Transcoders

    folder = transcoders.save(tmp_path / "tc")
    _edit_meta(folder, lambda fields: fields["meta"].__setitem__("fingerprint", "0123456789abcdef"))
    with pytest.raises(ResultFileError, match=r"field 'meta' holds the fingerprint 0123456789abcdef"):
        Transcoders.load(folder)


@pytest.mark.parametrize("keep_header", [False, True], ids=["plain-save_file", "header-copied"])
@pytest.mark.parametrize("kind", ["transcoders", "das"])
def test_a_weight_edited_by_hand_is_refused(kind, keep_header, transcoders, subspace, tmp_path):
    """A square ``W_skip`` saved transposed (a DAS basis with a column's sign flipped) has the shape,
    dtype and meta of the saved one: only the digest of the file shows it."""
    cls, result, name, change = _cases(transcoders, subspace)[kind]
    assert not torch.equal(change(getattr(result, name)), getattr(result, name))  # the edit changes something
    folder = result.save(tmp_path / kind)
    _edit_tensor(folder, name, change, keep_header)
    with pytest.raises(ResultFileError, match=rf"{TENSOR_FILE} was changed after saving: its bytes are not the "
                                              rf"ones whose sha256 {JSON_FILE} records"):
        cls.load(folder)


def test_a_saved_import_records_no_model_and_loads(transcoders, tmp_path):
    """Transcoders read from SAELens files name no model; saved, their seal records none, and they load."""
    from arithinterp.features import Transcoders
    from arithinterp.features.transcoder_files import read_saelens, write_saelens

    imported = read_saelens(write_saelens(transcoders, tmp_path / "saelens"))
    assert "fingerprint" not in imported.meta
    loaded = Transcoders.load(imported.save(tmp_path / "saved"))
    assert torch.equal(loaded.W_skip, imported.W_skip) and loaded.meta == imported.meta


@pytest.mark.parametrize("kind", ["transcoders", "das"])
def test_an_unsealed_folder_without_a_fingerprint_loads_when_asked(kind, transcoders, subspace, tmp_path):
    """A folder made by another program (no header marker, no digest, a meta that names no model): nothing
    proves its files belong together, so it is refused unless asked for, and then loads with a warning."""
    from safetensors.torch import load_file, save_file

    cls, result, name, _ = _cases(transcoders, subspace)[kind]
    folder = dataclasses.replace(result, meta={"source": "saelens"}).save(tmp_path / kind)
    save_file(load_file(str(folder / TENSOR_FILE)), str(folder / TENSOR_FILE))  # no header metadata
    stored = json.loads((folder / JSON_FILE).read_text())
    stored.pop(DIGEST_KEY)
    (folder / JSON_FILE).write_text(json.dumps(stored))
    with pytest.raises(ResultFileError, match=r"is not sealed: .*\.load\(path, unsealed=True\)"):
        cls.load(folder)
    with pytest.warns(UnsealedResultWarning, match="is not sealed"):
        loaded = cls.load(folder, unsealed=True)
    assert torch.equal(getattr(loaded, name), getattr(result, name)) and loaded.meta == {"source": "saelens"}


def test_a_folder_saved_before_the_seal_loads_when_asked_and_is_sealed_by_saving_again(transcoders, tmp_path):
    """Folders saved before the seal existed carry neither the digest nor the header marker."""
    from safetensors.torch import load_file, save_file

    from arithinterp.features import Transcoders

    folder = transcoders.save(tmp_path / "tc")
    save_file(load_file(str(folder / TENSOR_FILE)), str(folder / TENSOR_FILE))
    stored = json.loads((folder / JSON_FILE).read_text())
    stored.pop(DIGEST_KEY)
    (folder / JSON_FILE).write_text(json.dumps(stored))
    with pytest.warns(UnsealedResultWarning):
        old = Transcoders.load(folder, unsealed=True)
    assert old.meta == transcoders.meta
    old.save(folder, overwrite=True)
    assert Transcoders.load(folder).meta == transcoders.meta  # sealed now: no warning, no refusal


@pytest.mark.parametrize("name", ["add-100", "add-3digit"])
def test_the_shipped_transcoders_are_sealed_and_load(name):
    from arithinterp.features import load_transcoders
    from arithinterp.features.shipped import WEIGHTS_DIR

    assert DIGEST_KEY in json.loads((WEIGHTS_DIR / name / JSON_FILE).read_text())
    assert len(load_transcoders(f"zoo:{name}").meta["fingerprint"]) == 16
