"""Every reader, fed damaged, truncated, wrong-typed and hostile files: it returns what the file holds or
raises an ``ArithInterpError`` — never another exception, never a silently wrong object.

For each format (a saved result, circuit-tracer's transcoders and graph ``.pt``, SAELens's folders,
pyvene's saves, circuit-tracer's graph index) a pristine file is written once; hypothesis then damages
a copy: bytes cut, flipped or replaced; a JSON / YAML field deleted or given a hostile value (wrong type,
negative, huge, NaN, a path, a list for a mapping); a tensor made NaN, infinite, integer, reshaped,
emptied or dropped; a pickle swapped for one of other content or one that would run code. A read that
succeeds must give an object that keeps the format's invariants (finite weights of consistent shapes,
indices in range; a sealed result equal to the one saved). Examples are few per reader and
derandomised, so the file runs in seconds and a failure repeats.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from arithinterp.errors import ArithInterpError

EXAMPLES = int(os.environ.get("ARITHINTERP_FUZZ_EXAMPLES", "40"))  # more for a deeper run by hand
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HOSTILE: list[Any] = [None, -1, 0, 1, 2.5, 10**12, -(10**12), math.nan, math.inf, "", "x", "../../etc/passwd",
                      "blocks.99.hook_mlp_out", True, [], [1, 2], [[0, "x"]], {}, {"a": 1}, "9" * 400]


RAN: list[str] = []  # what a hostile pickle ran (it must stay empty)


def _ran() -> None:
    RAN.append("code from a file ran")


class Payload:
    """A pickle that would run code when read with ``weights_only=False``."""

    def __reduce__(self):
        return (_ran, ())


# --- damage ---------------------------------------------------------------------------------------


def _bytes_damage(data: st.DataObject, file: Path) -> None:
    raw = file.read_bytes()
    how = data.draw(st.sampled_from(["truncate", "flip", "empty", "garbage", "append"]))
    if how == "truncate":
        file.write_bytes(raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))])
    elif how == "flip" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        file.write_bytes(raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1:])
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "garbage":
        file.write_bytes(data.draw(st.binary(min_size=1, max_size=64)))
    else:
        file.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=16)))


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside parsed JSON."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value[:4]):
            out += _paths(item, (*prefix, i))
    return out


def _json_damage(data: st.DataObject, file: Path, loads: Callable = json.loads) -> None:
    doc = loads(file.read_text())
    path = data.draw(st.sampled_from(_paths(doc)))
    how = data.draw(st.sampled_from(["replace", "delete", "wrap"]))
    if not path or how == "wrap":
        doc = [doc] if how == "wrap" else data.draw(st.sampled_from(HOSTILE))
    else:
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if how == "delete" and isinstance(parent, dict):
            parent.pop(path[-1])
        else:
            parent[path[-1]] = data.draw(st.sampled_from(HOSTILE))
    file.write_text(json.dumps(doc))  # JSON is YAML: the circuit-tracer config is read back the same way


def _tensor_damage(data: st.DataObject, file: Path) -> None:
    tensors = load_file(str(file))
    name = data.draw(st.sampled_from(sorted(tensors)))
    value = tensors[name]
    how = data.draw(st.sampled_from(["nan", "inf", "int", "short", "transpose", "empty", "bool", "drop", "huge"]))
    if how == "drop":
        tensors.pop(name)
    else:
        changed = {"nan": lambda v: torch.full_like(v.float(), math.nan),
                   "inf": lambda v: torch.full_like(v.float(), -math.inf),
                   "int": lambda v: v.long(), "short": lambda v: v[:-1] if v.ndim else v.reshape(1),
                   "transpose": lambda v: v.T if v.ndim == 2 else v.flip(0), "empty": lambda v: v.reshape(-1)[:0],
                   "bool": lambda v: v != 0, "huge": lambda v: torch.full_like(v.float(), 3e38) * 10}[how](value)
        tensors[name] = changed.contiguous()
    save_file(tensors, str(file))


def _damage(data: st.DataObject, folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    file = data.draw(st.sampled_from(files))
    kinds = ["bytes", "delete"]
    if file.suffix in (".json", ".yaml"):
        kinds += ["json", "json", "json"]
    if file.suffix == ".safetensors":
        kinds += ["tensor", "tensor", "tensor"]
    if file.suffix in (".bin", ".pt"):
        kinds += ["pickle", "pickle"]
    kind = data.draw(st.sampled_from(kinds))
    if kind == "bytes":
        _bytes_damage(data, file)
    elif kind == "delete":
        file.unlink()
    elif kind == "json":
        _json_damage(data, file)
    elif kind == "tensor":
        _tensor_damage(data, file)
    else:
        content = data.draw(st.sampled_from([
            Payload(), [1, 2], {"rotate_layer.parametrizations.weight.original": torch.full((64, 2), math.nan)},
            {"adjacency_matrix": torch.zeros(3)}, torch.zeros(2), "text",
        ]))
        torch.save(content, file, pickle_module=pickle)


def _copy(pristine: Path) -> Path:
    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    target = work / pristine.name
    (shutil.copytree if pristine.is_dir() else shutil.copy)(pristine, target)
    return target


def _read_or_refuse(read: Callable[[Path], Any], path: Path, check: Callable[[Any], None]) -> str:
    """Read a damaged copy: refused with an ArithInterpError, or read and checked; no code in it ran."""
    try:
        value = read(path)
    except ArithInterpError:
        return "refused"
    finally:
        assert not RAN, "a file read ran code"
    check(value)
    return "read"


# --- pristine files, once --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tiny_model, tmp_path_factory):
    from arithinterp import causal, features, patching
    from arithinterp.tasks import arithmetic

    root = tmp_path_factory.mktemp("pristine")
    prompts = arithmetic(tiny_model, "+", range(10, 22), range(20, 32))
    transcoders = features.train_transcoders(tiny_model, prompts, n_features=16, k=2, steps=3, batch_size=64,
                                             progress=False)
    das = causal.das(tiny_model, causal.interchange_dataset(prompts, "sum_mod_10", n=60, seed=0), "resid_post", 0, 2,
                     positions="final", steps=3, baselines=(), progress=False)
    graph = features.attribution_graph(tiny_model, prompts[:1], transcoders, n_logits=2, max_nodes=10,
                                       progress=False)
    patch = patching.activation_patching(tiny_model, prompts.counterfactual(vary="a", seed=0)[:4], "resid_pre",
                                         progress=False)
    from test_file_cases import _graph_pt

    _graph_pt(graph, root / "graph.pt")
    features.write_circuit_tracer_graph(graph, root / "index" / "g.json")
    return dict(patch=(patch, patch.save(root / "patch")), das=(das, das.save(root / "das")),
                transcoders=(transcoders, transcoders.save(root / "transcoders")),
                circuit_tracer=features.write_circuit_tracer_transcoders(transcoders, root / "ct"),
                saelens=features.write_saelens(transcoders, root / "saelens"),
                pyvene=causal.write_pyvene(das, root / "pyvene"), graph=root / "graph.pt", index=root / "index",
                graph_object=graph, model=tiny_model)


def _finite_transcoders(tc) -> None:
    for name in ("W_enc", "W_dec", "b_enc", "b_dec", "W_skip"):
        assert torch.isfinite(getattr(tc, name)).all(), f"non-finite {name} read"
    assert tc.W_enc.shape[-1] == tc.W_dec.shape[-2] == tc.b_enc.shape[-1] and len(set(tc.layers)) == len(tc.layers)
    assert tc.activation not in ("topk", "topk-signed") or 1 <= tc.k <= tc.n_features


# --- the readers ------------------------------------------------------------------------------------


def _equal(a: Any, b: Any) -> bool:
    """Equal in value and kind (NaN equals NaN; tensors in dtype, shape and values)."""
    import dataclasses

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a.nan_to_num(), b.nan_to_num()) if a.is_floating_point() else torch.equal(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_equal(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a) if f.compare)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("kind", ["patch", "das", "transcoders"])
def test_a_damaged_saved_result_is_refused_or_read_unchanged(kind, pristine):
    """Sealed, any change is refused (or the folder reads as saved); asked to read it unsealed, the
    invariants of the type are kept (load checks them) and a warning says so."""
    import warnings

    result, folder = pristine[kind]

    @FUZZ
    @given(st.data())
    def run(data):
        copy = _copy(folder)
        _damage(data, copy)
        unsealed = data.draw(st.booleans())
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            outcome = _read_or_refuse(lambda path: type(result).load(path, unsealed=unsealed), copy,
                                      lambda back: None if unsealed else _equal(back, result) or pytest.fail(
                                          "a damaged sealed folder read as another result"))
        assert outcome in ("read", "refused")

    run()


def test_damaged_circuit_tracer_transcoders_are_refused_or_read_finite(pristine):
    from arithinterp.features import read_circuit_tracer_transcoders

    @FUZZ
    @given(st.data())
    def run(data):
        copy = _copy(pristine["circuit_tracer"])
        _damage(data, copy)
        _read_or_refuse(read_circuit_tracer_transcoders, copy, _finite_transcoders)

    run()


def test_damaged_saelens_folders_are_refused_or_read_finite(pristine):
    from arithinterp.features import read_saelens

    @FUZZ
    @given(st.data())
    def run(data):
        copy = _copy(pristine["saelens"])
        _damage(data, copy)
        _read_or_refuse(read_saelens, copy, _finite_transcoders)

    run()


def test_damaged_pyvene_saves_are_refused_or_read_orthonormal(pristine):
    from arithinterp import causal

    def check(read):
        intervention, where = read
        basis = intervention.basis()
        assert torch.isfinite(basis).all() and where.layer >= 0
        gram = basis.transpose(-1, -2) @ basis
        assert torch.allclose(gram, torch.eye(basis.shape[-1]).expand_as(gram), atol=1e-3)

    @FUZZ
    @given(st.data())
    def run(data):
        copy = _copy(pristine["pyvene"])
        _damage(data, copy)
        _read_or_refuse(causal.read_pyvene, copy, check)

    run()


def test_damaged_graph_files_are_refused_or_read_in_range(pristine):
    from arithinterp.features import read_circuit_tracer_graph

    model = pristine["model"]

    def check(graph):
        assert torch.isfinite(graph.edges).all()
        assert all(0 <= n["position"] < len(graph.tokens) for n in graph.nodes)
        assert all(0 <= n["token_id"] < int(model.cfg.d_vocab) for n in graph.nodes)

    @FUZZ
    @given(st.data())
    def run(data):
        copy = _copy(pristine["graph"])
        if data.draw(st.booleans()):
            _damage(data, copy.parent)
        else:  # a hostile dict: the graph's keys with hostile values
            content = {key: data.draw(st.sampled_from(HOSTILE + [torch.zeros(3), torch.full((2, 2), math.nan)]))
                       for key in data.draw(st.lists(st.sampled_from(
                           ["adjacency_matrix", "active_features", "selected_features", "activation_values",
                            "logit_targets", "logit_probabilities", "input_tokens", "cfg"]), unique=True))}
            torch.save(content, copy)
        if copy.exists():
            _read_or_refuse(lambda path: read_circuit_tracer_graph(path, model), copy, check)

    run()


def test_a_damaged_graph_index_is_refused_and_left_as_it_was(pristine):
    """The viewer's index beside a graph is merged when another graph is written: a damaged one is
    refused, and nothing is written."""
    from arithinterp.features.graph_files import write_circuit_tracer_graph

    @settings(max_examples=15, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.data())
    def run(data):
        copy = _copy(pristine["index"])
        index = copy / "graph-metadata.json"
        if data.draw(st.booleans()):
            _bytes_damage(data, index)
        else:
            _json_damage(data, index)
        before = index.read_bytes()
        try:
            write_circuit_tracer_graph(pristine["graph_object"], copy / "h.json")
        except ArithInterpError:
            assert index.read_bytes() == before and not (copy / "h.json").exists()
            return
        assert [g["slug"] for g in json.loads(index.read_text())["graphs"]][-1] == "h"

    run()
