"""Every file the package writes goes through one guarded writer, and every public function that writes
keeps its guarantees.

* The package's source is parsed: a raw write (``write_text``, ``save_file``, ``torch.save``,
  ``to_parquet``, ``open(..., "w")``, ``os.replace``, ...) anywhere but in ``arithinterp/outputs.py``
  fails, unless it fills the temporary path the writer hands out (inside a ``lambda`` given to
  ``write_file``) or is one of :data:`RAW_WRITES`, each with its reason.
* Every public function or method that calls the writer is registered (``outputs.writes``) or listed in
  :data:`NOT_REGISTERED` with its reason, so a new writer cannot skip the checks below.
* Every registered writer (:data:`WRITERS`, a builder for each, so a new one fails here until it has
  one): ``overwrite`` other than ``True`` / ``False`` is refused; a fresh path is written; an occupied
  one is refused and left as it was; a symbolic link out of its folder is refused and its target left
  alone; with ``overwrite=True`` the path is replaced, and a write that fails part way (the disk
  fills, the final rename fails) leaves the old content, and no temporary file, behind.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import arithinterp
from arithinterp.errors import ArithInterpError, ConfigError

PACKAGE = Path(arithinterp.__file__).parent

# --- one writer --------------------------------------------------------------------------------------

#: Calls that put bytes on disk (attribute or function names).
PRIMITIVES = {"write_text", "write_bytes", "save_file", "to_parquet", "write_html", "write_image", "open_memmap",
              "save_pretrained", "savez", "to_csv", "replace", "rename", "move", "copy", "copyfile", "copytree",
              "symlink_to", "mkstemp", "mkdtemp"}
#: (module, function) -> why a raw write there is the writer's business already.
RAW_WRITES = {
    ("arithinterp.outputs", "*"): "the writer itself",
    ("arithinterp.activations", "_allocate"): "memory-maps the store's files inside the folder write_folder hands out",
    ("arithinterp.models.tokenizers", "save_and_reload"): "saves a tokenizer into a folder its caller is writing "
                                                          "(the zoo trainer's write_folder, a test's temp folder)",
    ("arithinterp.sweep.runner", "_driver_lock"): "creates the sweep's lock file exclusively (O_EXCL: never "
                                                  "through a link, never over a file)",
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _writes_raw(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
    if name in ("replace", "rename", "move", "copy") and owner not in ("os", "shutil"):
        return False  # str.replace, dataclasses.replace, Path.rename below
    if name == "save" and owner == "torch":
        return True
    if name == "open" and owner in ("", "os"):
        modes = [a for a in call.args[1:2]] + [k.value for k in call.keywords if k.arg in ("mode", "flags")]
        return any(isinstance(m, ast.Constant) and isinstance(m.value, str) and set(m.value) & set("wax+")
                   for m in modes) or owner == "os"
    return name in PRIMITIVES


def raw_writes() -> list[str]:
    """``module.function:line call`` of every raw write outside the writer and its lambdas."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        tree = ast.parse(path.read_text())
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _writes_raw(node)):
                continue
            where, up, in_writer_lambda = "<module>", parents.get(node), False
            while up is not None:
                if isinstance(up, ast.Lambda) and isinstance(parents.get(up), ast.Call):
                    caller = parents[up].func
                    in_writer_lambda |= getattr(caller, "id", getattr(caller, "attr", "")) in (
                        "write_file", "write_figure")
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)) and where == "<module>":
                    where = up.name
                up = parents.get(up)
            if in_writer_lambda or (module, "*") in RAW_WRITES or (module, where) in RAW_WRITES:
                continue
            found.append(f"{module}.{where}:{node.lineno} {ast.unparse(node.func)}")
    return found


def test_every_file_is_written_by_the_guarded_writer():
    assert not raw_writes(), ("these write files around arithinterp.outputs (use write_file / write_folder / "
                              "write_figure, or list them in RAW_WRITES with the reason): " + "; ".join(raw_writes()))


def test_the_raw_write_scan_finds_a_raw_write():
    tree = ast.parse("def f(p):\n    p.write_text('x')\n    open(p, 'w')\n    torch.save({}, p)\n")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert sum(_writes_raw(c) for c in calls) == 3


#: Public functions that call the writer but are not registered writers, and why.
NOT_REGISTERED = {
    "arithinterp.sweep.storage.write_cell": "the sweep's own resumable folder (run_sweep refuses a folder of others)",
    "arithinterp.sweep.storage.write_manifest": "the sweep's own resumable folder",
    "arithinterp.report.html.Page.write": "the page of a run of write_report (registered), rewritten as it goes",
    "arithinterp.report.html.Page.finish": "the page of a run of write_report (registered), at its end",
}
_WRITER_CALLS = {"write_file", "write_folder", "write_figure"}


def calls_to_the_writer() -> set[str]:
    """Qualified names of the public functions and methods that call the writer directly."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        if module == "arithinterp.outputs":
            continue
        tree = ast.parse(path.read_text())

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    calls = {getattr(n.func, "id", getattr(n.func, "attr", "")) for n in ast.walk(child)
                             if isinstance(n, ast.Call)}
                    if calls & _WRITER_CALLS and not child.name.startswith("_") and "._" not in prefix:
                        found.add(f"{module}.{prefix}{child.name}")

        visit(tree, "")
    return found


def test_every_public_function_that_writes_is_registered():
    from arithinterp import outputs

    importlib_all()
    unregistered = sorted(calls_to_the_writer() - set(outputs.WRITERS) - set(NOT_REGISTERED))
    assert not unregistered, f"register these with arithinterp.outputs.writes (or say why not): {unregistered}"


def importlib_all() -> None:
    """Import every module that registers a writer (the registry fills as they load)."""
    import importlib

    for path in sorted(PACKAGE.rglob("*.py")):
        if "@writes" in path.read_text() or "writes(" in path.read_text():
            importlib.import_module(_module(path))


# --- every writer keeps the guarantees ------------------------------------------------------------


@dataclasses.dataclass
class Writer:
    """How to call one writer: ``call(path, overwrite)`` writes ``path`` (a file, or a folder when
    ``folder``); ``target(path)`` is the file or folder the checks look at (default ``path``)."""

    call: Callable[[Path, Any], Any]
    folder: bool
    target: Callable[[Path], Path] = lambda path: path


class Inputs:
    """Small real inputs for the writers, built once per session on the tiny model."""

    def __init__(self, model, llama_folder, tmp_path_factory):
        self.model, self.llama_folder, self.tmp = model, llama_folder, tmp_path_factory

    @cached_property
    def prompts(self):
        from arithinterp.tasks import arithmetic

        return arithmetic(self.model, "+", range(10, 22), range(20, 32))

    @cached_property
    def result(self):
        from arithinterp import patching

        return patching.ablate(self.model, self.prompts[:12], ["attn0"])

    @cached_property
    def table(self):
        from arithinterp import neurons

        return neurons.classify(self.model, self.prompts, top_k=2)

    @cached_property
    def transcoders(self):
        from arithinterp.features import train_transcoders

        return train_transcoders(self.model, self.prompts, n_features=16, k=2, steps=3, batch_size=64, progress=False)

    @cached_property
    def graph(self):
        from arithinterp import features

        return features.attribution_graph(self.model, self.prompts[:1], self.transcoders, n_logits=2, max_nodes=10,
                                          progress=False)

    @cached_property
    def das(self):
        from arithinterp import causal

        dataset = causal.interchange_dataset(self.prompts, "sum_mod_10", n=60, seed=0)
        return causal.das(self.model, dataset, "resid_post", 0, 2, positions="final", steps=3, baselines=(),
                          progress=False)

    @cached_property
    def sweep(self):
        from arithinterp import sweep

        task = dict(name="add", op="+", a=[0, 10], b=[0, 10], template="{a}+{b}=", limit=20)
        out = self.tmp.mktemp("writer_sweep") / "out"
        sweep.run_sweep(dict(out=str(out), models=[str(self.llama_folder("number"))], tasks=[task],
                             analyses=[dict(name="accuracy")]), progress=False)
        return out


def _trained_set(inputs: Inputs, monkeypatch) -> None:
    """The transcoder trainers' training replaced by the small set (their files are what is checked)."""
    from arithinterp.features import training

    monkeypatch.setattr(training, "train_transcoders", lambda *args, **kwargs: inputs.transcoders)


def _planned(inputs: Inputs, monkeypatch) -> Writer:
    import dataclasses

    from arithinterp.features.plan import plan_transcoders, train_planned

    _trained_set(inputs, monkeypatch)
    plan = dataclasses.replace(plan_transcoders(inputs.model, operands="10-29", few_shot=0), n_train=20,
                               n_held_out=4)
    return Writer(lambda p, o: train_planned(inputs.model, plan, p, overwrite=o, progress=False), folder=True)


def _train(inputs: Inputs, monkeypatch) -> Writer:
    from families import modadd_entry

    from arithinterp.models import zoo
    from arithinterp.models.train import train

    monkeypatch.setitem(zoo.ZOO, "modadd-5-writer", modadd_entry("modadd-5-writer", 5, 16, steps=2, every=1,
                                                                 purpose="writer test"))
    return Writer(lambda p, o: train("modadd-5-writer", out=p, steps=2, progress=False, overwrite=o), folder=True)


def _report(inputs: Inputs, monkeypatch) -> Writer:
    from arithinterp.report import write_report

    return Writer(lambda p, o: write_report(inputs.model, out=p, stages=["accuracy"], limit=10, budget=5,
                                            progress=False, overwrite=o), folder=False)


BUILDERS: dict[str, Callable[[Inputs, Any], Writer]] = {
    "arithinterp.outputs.write_file": lambda i, mp: Writer(lambda p, o: __import__("arithinterp.outputs").outputs
                                                           .write_file(p, "new content", overwrite=o), folder=False),
    "arithinterp.outputs.write_figure": lambda i, mp: Writer(
        lambda p, o: __import__("arithinterp.outputs").outputs.write_figure(i.result.plot(), p, overwrite=o),
        folder=False),
    "arithinterp.results.Result.save": lambda i, mp: Writer(lambda p, o: i.result.save(p, overwrite=o), folder=True),
    "arithinterp.neurons.table.HeuristicTable.save": lambda i, mp: Writer(lambda p, o: i.table.save(p, overwrite=o),
                                                                         folder=True),
    "arithinterp.activations.collect": lambda i, mp: Writer(
        lambda p, o: arithinterp.activations.collect(i.model, i.prompts[:8], store=p, overwrite=o, progress=False),
        folder=True),
    "arithinterp.features.graph_files.write_circuit_tracer_graph": lambda i, mp: Writer(
        lambda p, o: arithinterp.features.write_circuit_tracer_graph(i.graph, p.with_suffix(".json"), overwrite=o),
        folder=False, target=lambda p: p.with_suffix(".json")),
    "arithinterp.features.transcoder_files.write_circuit_tracer_transcoders": lambda i, mp: Writer(
        lambda p, o: arithinterp.features.write_circuit_tracer_transcoders(i.transcoders, p, overwrite=o),
        folder=True),
    "arithinterp.features.transcoder_files.write_saelens": lambda i, mp: Writer(
        lambda p, o: arithinterp.features.write_saelens(i.transcoders, p, overwrite=o), folder=True),
    "arithinterp.causal.subspace_files.write_pyvene": lambda i, mp: Writer(
        lambda p, o: arithinterp.causal.write_pyvene(i.das, p, overwrite=o), folder=True),
    "arithinterp.sweep.plots.plot_sweep": lambda i, mp: Writer(
        lambda p, o: arithinterp.sweep.plot_sweep(i.sweep, p, overwrite=o), folder=True),
    "arithinterp.results.write_sealed": lambda i, mp: Writer(
        lambda p, o: arithinterp.results.write_sealed(p, "Sealed", {"meta": {}}, {"t": torch.zeros(2)}, {},
                                                      overwrite=o), folder=True),
    "arithinterp.viz.graph_view.page.GraphView.to_html": lambda i, mp: Writer(
        lambda p, o: i.graph.show().to_html(p.with_suffix(".html"), overwrite=o), folder=False,
        target=lambda p: p.with_suffix(".html")),
    "arithinterp.features.plan.train_planned": _planned,
    "arithinterp.models.train.train": _train,
    "arithinterp.report.write_report": _report,
}
SLOW = {"arithinterp.sweep.plots.plot_sweep", "arithinterp.models.train.train", "arithinterp.report.write_report",
        "arithinterp.neurons.table.HeuristicTable.save"}


def _registered() -> list[str]:
    from arithinterp import outputs

    importlib_all()
    return sorted(outputs.WRITERS)


def test_every_registered_writer_has_a_builder():
    missing = sorted(set(_registered()) - set(BUILDERS))
    assert not missing, f"add a builder to BUILDERS in {__file__} for each writer: {missing}"
    assert not set(BUILDERS) - set(_registered()), "a builder for a function that is not a registered writer"


@pytest.fixture(scope="module")
def inputs(tiny_model, llama_folder, tmp_path_factory):
    return Inputs(tiny_model, llama_folder, tmp_path_factory)


def _snapshot(path: Path) -> Any:
    """What is at ``path``: None, the bytes of a file, or a folder's files by relative name."""
    if not os.path.lexists(path):
        return None
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    return path.read_bytes()


def _occupy(path: Path, folder: bool) -> Any:
    if folder:
        path.mkdir(parents=True)
        (path / "keep.txt").write_text("the user's work")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("the user's work")
    return _snapshot(path)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(".tmp") or p.name.endswith(".old"))


def _params():
    return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in sorted(BUILDERS)]


@pytest.mark.parametrize("name", _params())
def test_a_writer_keeps_the_guarantees(name, inputs, tmp_path, monkeypatch):
    writer = BUILDERS[name](inputs, monkeypatch)
    work = tmp_path / "work"
    work.mkdir()

    # overwrite is strictly a bool: anything else is refused before anything is written
    for bad in ("no", 1, None):
        with pytest.raises(ConfigError, match="overwrite"):
            writer.call(work / "bad", bad)
    assert list(work.iterdir()) == []

    # a fresh path is written (and the files it takes are counted, for the failures below)
    from arithinterp import outputs

    fresh, synced = work / "fresh", []
    real_fsync = outputs.os.fsync
    with monkeypatch.context() as patch:
        patch.setattr(outputs.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
        writer.call(fresh, False)
    written = _snapshot(writer.target(fresh))
    assert written, f"{name} wrote nothing at {writer.target(fresh)}"

    # an occupied path is refused and left as it was
    taken = work / "taken"
    before = _occupy(writer.target(taken), writer.folder)
    with pytest.raises(ArithInterpError, match="overwrite"):
        writer.call(taken, False)
    assert _snapshot(writer.target(taken)) == before

    # a symbolic link out of its folder is refused, even with overwrite, and what it points to is untouched
    outside = tmp_path / "outside"
    kept = _occupy(outside, writer.folder)
    link = work / "link"
    writer.target(link).parent.mkdir(parents=True, exist_ok=True)
    writer.target(link).symlink_to(outside, target_is_directory=writer.folder)
    for overwrite in (False, True):
        with pytest.raises(ArithInterpError):
            writer.call(link, overwrite)
        assert _snapshot(outside) == kept and writer.target(link).is_symlink()

    # with overwrite=True a write that fails part way (the disk fills as its k-th file is finished, or
    # its last rename fails) keeps the old content, and leaves no temporary file
    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    for where in [f"file {k}" for k in range(1, min(len(synced), 4) + 1)] + ["rename"]:
        with monkeypatch.context() as patch:
            if where == "rename":
                patch.setattr(outputs.os, "replace", fail)
                patch.setattr(outputs, "_move_into_place", fail)
            else:
                count, k = [], int(where.split()[1])

                def fsync(fd, k=k, count=count):
                    count.append(fd)
                    return fail() if len(count) == k else real_fsync(fd)

                patch.setattr(outputs.os, "fsync", fsync)
            with pytest.raises((OSError, ArithInterpError)):
                writer.call(taken, True)
        assert _snapshot(writer.target(taken)) == before, f"{name}: a failed write ({where}) changed the old content"
        assert not _leftovers(work), f"{name}: a failed write ({where}) left {_leftovers(work)}"

    # and a write that succeeds replaces it
    writer.call(taken, True)
    assert _snapshot(writer.target(taken)) not in (None, before)
    assert not _leftovers(work)
