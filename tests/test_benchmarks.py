"""Smoke runs of the benchmark scripts: they run and print their tables (numbers go to docs)."""

import contextlib
import io
import os
import runpy
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # each runs a whole benchmark script

ROOT = Path(__file__).parent.parent


def run(script, *args):
    """What ``python benchmarks/<script> <args>`` prints. The script runs here, as ``__main__`` with those
    arguments, sparing a fresh interpreter's seconds of imports (the scripts that measure memory in a
    fresh process per measurement are given ``--in-process``) — what it changes for this process
    (``sys.path``, ``sys.argv``, the modules it imports from ``benchmarks/``, torch's random state and
    threads, the working directory) is put back after."""
    path = ROOT / "benchmarks" / script
    modules, saved_path, saved_argv, cwd = set(sys.modules), list(sys.path), list(sys.argv), os.getcwd()
    rng, threads, out = torch.get_rng_state(), torch.get_num_threads(), io.StringIO()
    try:
        os.chdir(ROOT)
        sys.argv = [str(path), *args]
        sys.path.insert(0, str(path.parent))  # as `python <script>` puts the script's folder first
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    finally:
        os.chdir(cwd)
        sys.argv, sys.path[:] = saved_argv, saved_path
        for name in set(sys.modules) - modules:  # e.g. `patching`, which circuits.py imports from benchmarks/
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(path.parent)):
                del sys.modules[name]
        torch.set_rng_state(rng)
        torch.set_num_threads(threads)
    return out.getvalue()


def test_collect_benchmark_smoke():
    out = run("collect.py", "--runs", "1", "--prompts", "200", "--in-process")
    assert "| `collect` (batch auto)" in out and "run_with_cache" in out


def test_big_vocab_benchmark_smoke():
    out = run("big_vocab.py", "--model", "zoo:add-100", "--few-shot", "0", "--prompts", "60", "--patch-prompts", "30",
              "--runs", "1", "--peaks", "probes", "patch_test", "--in-process")
    assert "last / before last:" in out and "patch_test:" in out and "probes:" in out and "before_last:" not in out


def test_read_columns_benchmark_smoke():
    out = run("read_columns.py", "--model", "zoo:add-100", "--few-shot", "0", "--pairs", "6", "--ranked", "12",
              "--runs", "1", "--sites", "mlp_out")
    assert "| `mlp_out` sweep, 6 pairs" in out and "| neuron ranking (attribution), 12 pairs" in out


def test_zoo_load_benchmark_smoke():
    from arithinterp.models.zoo import ZOO

    out = run("zoo_load.py", "--runs", "1")
    assert out.count("| `zoo:") == len(ZOO) and "total shipped checkpoint size" in out


def test_patching_benchmark_smoke():
    """The quick run covers the zoo, a native few-shot model and a Llama-family folder: every setup
    sweeps cells, times both implementations, and the two give the same numbers."""
    out = run("patching.py", "--quick")
    lines = [line for line in out.splitlines() if line.startswith("| ") and "×" in line and "setup" not in line]
    assert any("Llama 4L d256" in line for line in lines) and any("zoo:add-100" in line for line in lines)
    for line in lines:  # setup | device | site | pairs × tokens | cells (run) | TL | ours | speed-up | … | max diff
        cells = [cell.strip() for cell in line.strip(" |").split("|")]
        assert int(cells[4].split()[0]) > 0 and float(cells[7].strip("*×")) > 0, line
        assert float(cells[-1]) <= 1e-4, line


def test_null_calibration_benchmark_smoke():
    out = run("null_calibration.py", "--neurons", "60", "--no-zoo", "--grids", "10")
    assert out.count("| Gaussian noise |") == 2 and out.count("| one heuristic per neuron |") == 4


def test_detector_benchmark_smoke():
    out = run("detector.py", "--fit", "200", "--test", "120", "--seeds", "11", "--no-repair")
    assert "| 11 | 120 (" in out and "mean ± sd" in out and "baseline warnings" in out


@pytest.mark.slow
def test_detector_slices_benchmark_smoke():
    """The report's construction on disjoint slices: earlier and current defaults side by side."""
    out = run("detector.py", "--slices", "1", "--size", "200")
    rows = [line for line in out.splitlines() if line.startswith("| 0 |")]
    assert len(rows) == 2 and sum("| earlier |" in row for row in rows) == 1
    assert "- current: balanced accuracy mean" in out


def test_evaluate_benchmark_smoke():
    out = run("evaluate.py", "--prompts", "20", "--layers", "2", "--d-model", "64", "--heads", "4", "--kv-heads", "2",
              "--d-mlp", "128", "--vocab", "500", "--in-process")
    assert "| `evaluate` |" in out and "evaluate / (3 × one forward)" in out and "decode path 'cached'" in out


def test_circuits_benchmark_smoke():
    """The quick run scores every edge of zoo:add-100 three ways and EAP-IG tracks exact patching."""
    out = run("circuits.py", "--quick")
    row = next(line for line in out.splitlines() if line.startswith("| eap-ig"))
    assert float(row.split("|")[2]) > 0.8 and int(row.rstrip(" |").rsplit("|", 1)[1]) <= 2 * (5 + 1)


def test_post_norms_benchmark_smoke():
    """Gemma 2 and 3 folders: EAP-IG tracks exact edges through the frozen branch norms, and auto patches exactly."""
    out = run("post_norms.py", "--quick")
    rows = sorted({line for line in out.splitlines() if line.startswith("| Gemma")})  # printed as they come, then all
    assert len(rows) == 2
    for row in rows:
        cells = [cell.strip() for cell in row.strip(" |").split("|")]
        assert float(cells[4].split("/")[0]) > 0.7 and cells[-1] == "exact"


def test_neuron_receivers_benchmark_smoke():
    """Edges into neurons of zoo:add-100: attribution against exact patching, and the exact path exact."""
    out = run("circuits.py", "--neurons", "--models", "add-100", "--zoo-pairs", "4", "--neuron-step", "64")
    row = next(line for line in out.splitlines() if line.startswith("| zoo:add-100"))
    assert int(row.split("|")[2].replace(",", "")) == 80 and float(row.rstrip(" |").rsplit("|", 1)[1]) <= 1e-5


def test_detector_speed_benchmark_smoke():
    """Both solvers and the tightly converged reference on a small sample: a time row and score rows."""
    out = run("detector.py", "--speed", "--fit", "120", "--seeds", "11", "--runs", "1")
    assert "| **median** |" in out and out.count("| 11 | reference |") == 1 and out.count("| 11 | batched |") == 1


@pytest.mark.slow
def test_exact_edges_benchmark_smoke():
    """Whole forwards against the stepped default on the Llama setup and the zoo: the same scores."""
    out = run("circuits.py", "--exact", "--runs", "1", "--speed-pairs", "2", "--few-shot", "1", "--zoo-pairs", "4",
              "--exact-width", "64")
    # each row is printed as it comes, then in the whole table
    rows = {line for line in out.splitlines() if line.startswith("| ") and "×" in line}
    assert len(rows) == 4 and any("823 edges" in row for row in rows) and any("zoo:add-3digit" in row for row in rows)
    for row in rows:  # the largest score difference, the last column
        assert float(row.rstrip(" |").rsplit("|", 1)[1]) <= 1e-4, row


def test_memory_benchmark_smoke():
    """A tiny Llama: every neuron of both layers classified, each layer's top-k, and EAP-IG over every edge."""
    out = run("memory.py", "--layers", "2", "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--d-mlp", "128",
              "--vocab", "500", "--side", "6", "--top-side", "6", "--pairs", "4", "--top-k", "10",
              "--only", "classify-all", "classify-top", "eap-ig", "--in-process")
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "after" in line}
    assert "256 neurons" in rows["classify-all"] and "20 neurons" in rows["classify-top"]
    assert "GiB" in rows["classify-all"].rsplit("budget", 1)[1] and "edges, 1 batch(es)" in rows["eap-ig"]


def test_causal_benchmark_smoke():
    out = run("causal.py", "planted", "--steps", "20")
    assert "principal-angle cosines DAS" in out and "| das | 2 |" in out and "| random | 2 |" in out


@pytest.mark.slow
def test_ablations_benchmark_smoke():
    """The quick run times digit ablation, neuron ablation and native decoding both ways, with the same results."""
    out = run("ablations.py", "--quick")
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert {row.split("|")[1].strip() for row in rows} == {
        "`patching.digit_ablation` (mean)", "`neurons.importance` (mean-ablation)", "`neurons.ablate_heuristic`",
        "`neurons.ablate_for_prompt`", "`PromptSet.evaluate`"}
    for row in rows:  # max diff: the stepped and whole-forward paths give the same numbers
        assert float(row.split("|")[6]) <= 1e-4, row


def test_prompts_benchmark_smoke():
    """Prompt sets built three ways hold the same tokens, and the table says so for every setup."""
    out = run("prompts.py", "--runs", "1", "--side", "12", "--models", "add-3digit")
    rows = [line for line in out.splitlines() if line.startswith("| `zoo:")]
    assert len(rows) == 2 and all(row.rstrip(" |").endswith("yes") for row in rows), rows


def test_viewer_benchmark_smoke():
    out = run("viewer.py", "--smoke", "--runs", "1", "--moves", "2")
    assert "| synthetic graph, 8 tokens, 4 layers, 60 features | 101 |" in out
    assert "| synthetic circuit, 4 layers |" in out and "browser CPU ms per move" in out


def test_report_determinism_compares_every_number_and_leaves_timings_out():
    """The determinism check's comparison of two pages: the same findings with other timings are
    identical; a number changed in a finding, a sample line, a figure's data or a viewer's document
    is a difference; a stage that applies and did not run is named."""
    import importlib.util

    import plotly.graph_objects as go

    from arithinterp.report.html import render
    from arithinterp.report.stage import Section

    spec = importlib.util.spec_from_file_location("report_determinism", ROOT / "benchmarks" / "report_determinism.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    class View:  # a viewer as a section embeds it
        def __init__(self, data: str):
            self.data = data

        def iframe(self) -> str:
            return (f"<iframe class='graph-view' title=\"circuit\" sandbox='allow-scripts' "
                    f"srcdoc=\"{self.data}\"></iframe>")

    def page(restores=0.93, pairs=30, y=(1.0, 2.0), edges="[1, 2]", seconds=4.2, state="done: 4.2 s; 30 pairs"):
        section = Section("Activation patching", findings=[f"restores {restores}"], sample=f"{pairs} pairs",
                          figures=[go.Figure(go.Scatter(y=list(y)))], views=[View(edges)], seconds=seconds)
        meta = dict(model="zoo:add-100", seed=0, estimate=f"{seconds} s", seconds=seconds)
        return render("t", meta, [section], [("Evaluating the task", "done"), ("Activation patching", state),
                                              ("Which head computes which answer digit", "not run: 0.0 s")])

    quiet = page()
    assert script.differences(quiet, page(seconds=99.0, state="done: 99 s; 30 pairs")) == []
    assert len(script.findings(quiet)) == 7  # the task's two fields, the title, sample, finding, figure, viewer
    for changed in (page(restores=0.94), page(pairs=31), page(y=(1.0, 2.5)), page(edges="[1, 3]")):
        assert len(script.differences(quiet, changed)) == 2, script.differences(quiet, changed)  # one line out, one in
    assert script.unrun(quiet) == []  # per-digit heads do not apply: not counted
    assert script.unrun(page(state="skipped (over budget)")) == ["Activation patching (skipped (over budget))"]
