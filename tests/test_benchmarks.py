"""Smoke runs of the benchmark scripts: they run and print their tables (numbers go to docs)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each runs a benchmark script in a subprocess

ROOT = Path(__file__).parent.parent


def run(script, *args):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_collect_benchmark_smoke():
    out = run("collect.py", "--runs", "1", "--prompts", "200")
    assert "| `collect` (batch auto)" in out and "run_with_cache" in out


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
    out = run("detector.py", "--fit", "600", "--test", "300", "--seeds", "11", "--no-repair")
    assert "| 11 | 300 (" in out and "mean ± sd" in out and "baseline warnings" in out


def test_evaluate_benchmark_smoke():
    out = run("evaluate.py", "--prompts", "20", "--layers", "2", "--d-model", "64", "--heads", "4", "--kv-heads", "2",
              "--d-mlp", "128", "--vocab", "500")
    assert "| `evaluate` |" in out and "evaluate / (3 × one forward)" in out and "decode path 'cached'" in out


def test_circuits_benchmark_smoke():
    """The quick run scores every edge of zoo:add-100 three ways and EAP-IG tracks exact patching."""
    out = run("circuits.py", "--quick")
    row = next(line for line in out.splitlines() if line.startswith("| eap-ig"))
    assert float(row.split("|")[2]) > 0.8 and int(row.rstrip(" |").rsplit("|", 1)[1]) <= 2 * (5 + 1)


@pytest.mark.slow
def test_exact_edges_benchmark_smoke():
    """Whole forwards against the stepped default on the Llama setup and the zoo: the same scores."""
    out = run("circuits.py", "--exact", "--runs", "1", "--speed-pairs", "2", "--few-shot", "1", "--zoo-pairs", "4")
    # each row is printed as it comes, then in the whole table
    rows = {line for line in out.splitlines() if line.startswith("| ") and "×" in line}
    assert len(rows) == 4 and any("823 edges" in row for row in rows) and any("zoo:add-3digit" in row for row in rows)
    for row in rows:  # the largest score difference, the last column
        assert float(row.rstrip(" |").rsplit("|", 1)[1]) <= 1e-4, row


def test_memory_benchmark_smoke():
    """A tiny Llama: every neuron of both layers classified, each layer's top-k, and EAP-IG over every edge."""
    out = run("memory.py", "--layers", "2", "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--d-mlp", "128",
              "--vocab", "500", "--side", "6", "--top-side", "6", "--pairs", "4", "--top-k", "10",
              "--only", "classify-all", "classify-top", "eap-ig")
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "after" in line}
    assert "256 neurons" in rows["classify-all"] and "20 neurons" in rows["classify-top"]
    assert "GiB" in rows["classify-all"].rsplit("budget", 1)[1] and "edges, 1 batch(es)" in rows["eap-ig"]


def test_causal_benchmark_smoke():
    out = run("causal.py", "planted", "--steps", "100")
    assert "principal-angle cosines DAS" in out and "| das | 2 |" in out and "| random | 2 |" in out


@pytest.mark.slow
def test_ablations_benchmark_smoke():
    """The quick run times digit ablation, neuron ablation and native decoding both ways, with the same results."""
    out = run("ablations.py", "--quick")
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert {row.split("|")[1].strip() for row in rows} == {
        "`patching.digit_ablation` (mean)", "`neurons.importance` (mean_ablation)", "`neurons.ablate_heuristic`",
        "`neurons.ablate_for_prompt`", "`PromptSet.evaluate`"}
    for row in rows:  # max diff: the stepped and whole-forward paths give the same numbers
        assert float(row.split("|")[6]) <= 1e-4, row
