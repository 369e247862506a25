"""Sweeps: config validation, stable cell ids, resumable Parquet results, executors, figures, CLI."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from arithinterp import sweep as S
from arithinterp.errors import ArithInterpError, ConfigError

TASK = dict(name="add", op="+", a=[0, 100], b=[0, 100], template="{a}+{b}=", limit=60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny randomly initialised add-100-style model folder, loadable by ``load_model(path)``."""
    from safetensors.torch import save_file
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge.sources.native import NativeModel, initialize_native_model

    from arithinterp.models.tokenizers import number_tokenizer, save_and_reload

    out = tmp_path_factory.mktemp("sweep_model") / "add-tiny"
    tokenizer = save_and_reload(number_tokenizer(198), out)
    config = dict(n_layers=2, d_model=32, n_heads=2, d_head=16, d_mlp=64, n_ctx=8, act_fn="relu",
                  normalization_type="LN", positional_embedding_type="standard", d_vocab=len(tokenizer), seed=0,
                  default_prepend_bos=True)
    cfg = TransformerBridgeConfig(**config)
    torch.manual_seed(0)
    net = NativeModel(cfg)
    initialize_native_model(net, cfg)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    (out / "card.json").write_text(json.dumps(dict(name="add-tiny")))
    return out


def config(model_dir, out, analyses=None, **extra):
    return dict(out=str(out), models=[str(model_dir)], tasks=[dict(TASK)],
                analyses=analyses or [dict(name="accuracy")], **extra)


def write_toml(path: Path, model_dir: Path, out: Path) -> Path:
    path.write_text(f"""
out = "{out}"
models = ["{model_dir}"]
[[tasks]]
name = "add"
op = "+"
a = [0, 100]
b = [0, 100]
template = "{{a}}+{{b}}="
limit = 200
[[analyses]]
name = "accuracy"
[[analyses]]
name = "patching"
grid = {{ site = ["resid_pre", "mlp_post"], vary = ["a", "b", "both"] }}
""")
    return path


def tables_equal(left: dict, right: dict) -> None:
    assert sorted(left) == sorted(right)
    for name in left:
        pd.testing.assert_frame_equal(left[name], right[name], check_exact=True)


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate, key, needle",
    [
        (lambda c: c["analyses"].append(dict(name="patchng")), "analyses[1].name", "unknown analysis 'patchng'; accepted: 'accuracy', 'patching'"),
        (lambda c: c["models"].append("zoo:add-1000"), "models[1]", "'zoo:add-100'"),
        (lambda c: c["tasks"][0].update(limit="many"), "tasks[0].limit", "expected int"),
        (lambda c: c["tasks"][0].update(lmit=5), "tasks[0].lmit", "unknown key 'lmit'; accepted: 'name', 'op'"),
        (lambda c: c.update(executr="ray"), "executr", "accepted: 'out', 'models'"),
        (lambda c: c["analyses"].append(dict(name="patching", grid=dict(site=["resid"]))), "analyses[1].grid.site[0]",
         "'resid' is not accepted; accepted: 'resid_pre', 'resid_mid'"),
        (lambda c: c["analyses"].append(dict(name="patching", grid=dict(sit=["resid_pre"]))), "analyses[1].grid.sit",
         "unknown parameter 'sit' of analysis 'patching'; accepted: 'site', 'metric'"),
        (lambda c: c["analyses"].append(dict(name="patching")), "analyses[1].params.site", "needs parameter 'site'"),
        (lambda c: c["analyses"].append(dict(name="patching", params=dict(site="resid_pre", normalize=1))),
         "analyses[1].params.normalize", "expected bool"),
        (lambda c: c["tasks"][0].update(op="^"), "tasks[0].op", "accepted: '+', '-'"),
        (lambda c: c["tasks"][0].update(a=[5, 2]), "tasks[0].a", "empty"),
        (lambda c: c.update(executor="dask"), "executor", "accepted: 'local', 'processes', 'ray'"),
        (lambda c: c["models"].append("./no/such/model"), "models[1]", "no such file or directory"),
        (lambda c: c.update(out=""), "out", "empty path"),  # not the config's own folder
    ],
)
def test_bad_config_fails_before_any_job_naming_key_and_accepted(model_dir, tmp_path, mutate, key, needle):
    calls = []
    S.register_analysis("spy", lambda model, prompts: calls.append(1) or pd.DataFrame([dict(x=1)]), overwrite=True)
    cfg = config(model_dir, tmp_path / "out", analyses=[dict(name="spy")])
    mutate(cfg)
    with pytest.raises(ConfigError) as info:
        S.run_sweep(cfg, progress=False)
    message = str(info.value)
    assert message.startswith(f"{key}:"), message
    assert needle in message
    assert calls == [] and not (tmp_path / "out").exists()  # nothing ran, nothing was written


BAD_CELLS = [  # (analysis entry, what the message names: the parameter and value, then what is accepted)
    (dict(name="probes", params=dict(target="a"), grid=dict(cv=[5, 0])), "cv=0 is not accepted",
     "cv must be an integer number of folds >= 2, got 0"),
    (dict(name="probes", params=dict(target="a", cv=1)), "cv=1 is not accepted", "folds >= 2, got 1"),
    (dict(name="probes", params=dict(target="a", layers=[99])), "layers=[99] is not accepted",
     "layer 99 is out of range for a 2-layer model; accepted: 0..1"),
    (dict(name="patching", params=dict(site="resid_pre", positions=["fnal"])), "positions=['fnal'] is not accepted",
     "unknown position 'fnal'; accepted: 'final'"),
    (dict(name="ablation", params=dict(components="attn0,mlp7")), "components='attn0,mlp7' is not accepted",
     "out of range"),
]


@pytest.mark.parametrize("analysis, bad, accepted_words", BAD_CELLS)
def test_a_bad_cell_refuses_the_sweep_before_any_cell_runs(model_dir, tmp_path, analysis, bad, accepted_words):
    """Parameters the model or prompts cannot take are refused up front, not when their cell runs:
    the cells before it (the spy's) never run, and nothing is written."""
    calls = []
    S.register_analysis("spy", lambda model, prompts: calls.append(1) or pd.DataFrame([dict(x=1)]), overwrite=True)
    cfg = config(model_dir, tmp_path / "out", analyses=[dict(name="spy"), analysis])
    with pytest.raises(ConfigError) as info:
        S.run_sweep(cfg, progress=False)
    message = str(info.value)
    assert message.startswith("cell ") and f"({analysis['name']}, model '{model_dir}', task 'add', params {{" in message
    assert f"): {bad}: " in message and accepted_words in message, message
    assert calls == [] and not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_a_bad_cell_makes_the_commands_exit_2_before_any_cell_runs(model_dir, tmp_path, capsys):
    from arithinterp.cli import main

    path = write_toml(tmp_path / "s.toml", model_dir, tmp_path / "out")
    path.write_text(path.read_text() + '[[analyses]]\nname = "probes"\nparams = { target = "a", layers = [99] }\n')
    for command, name in ((main, ["sweep"]), (S.main, [])):  # arithinterp sweep, python -m arithinterp.sweep
        for flags in ([], ["--dry-run"]):
            assert command([*name, str(path), "--no-progress", "--json", *flags]) == 2
            error = json.loads(capsys.readouterr().out)["error"]
            assert error.startswith("cell ") and "(probes, model" in error, error
            assert "layers=[99] is not accepted: layer 99 is out of range for a 2-layer model" in error
            assert not (tmp_path / "out").exists()


def test_cells_are_checked_with_the_analysis_functions_signature(model_dir, tmp_path):
    S.register_analysis("narrow", lambda model, prompts: pd.DataFrame([dict(x=1)]), dict(k=int), overwrite=True)
    with pytest.raises(ConfigError, match=r"\(narrow, .*the analysis function takes \(model, prompts\), not these "
                       r"parameters: got an unexpected keyword argument 'k'"):
        S.run_sweep(config(model_dir, tmp_path / "out", [dict(name="narrow", params=dict(k=1))]), progress=False)
    assert not (tmp_path / "out").exists()


def test_a_registered_check_refuses_cells_before_any_runs(model_dir, tmp_path):
    from arithinterp.sites import check_layers

    def check(model, prompts, layer: int = 0):
        with S.checking("layer", layer):
            check_layers(model, "resid_post", [layer])

    calls = []
    S.register_analysis("at_layer", lambda model, prompts, layer=0: calls.append(layer) or pd.DataFrame([dict(x=1)]),
                        dict(layer=int), check=check, overwrite=True)
    with pytest.raises(ConfigError, match=r"\(at_layer, .*\): layer=2 is not accepted: layer 2 is out of range"):
        S.run_sweep(config(model_dir, tmp_path / "out", [dict(name="at_layer", grid=dict(layer=[0, 1, 2]))]),
                    progress=False)
    assert calls == [] and not (tmp_path / "out").exists()
    run = S.run_sweep(config(model_dir, tmp_path / "out", [dict(name="at_layer", grid=dict(layer=[0, 1]))]),
                      progress=False)
    assert run.counts()["done"] == 2 and sorted(calls) == [0, 1]


def test_yaml_and_toml_configs_are_the_same_sweep(model_dir, tmp_path):
    toml_path = write_toml(tmp_path / "s.toml", model_dir, tmp_path / "out")
    yaml_path = tmp_path / "s.yaml"
    import yaml

    yaml_path.write_text(yaml.safe_dump(S.read_config_file(toml_path)))
    from_toml, from_yaml = S.load_config(toml_path), S.load_config(yaml_path)
    assert from_toml.digest() == from_yaml.digest()
    assert [c.id for c in S.plan(from_toml)] == [c.id for c in S.plan(from_yaml)]
    json_path = tmp_path / "s.json"
    json_path.write_text("{}")
    with pytest.raises(ConfigError, match="accepted: '.toml', '.yaml', '.yml'"):
        S.read_config_file(json_path)


def test_toml_configs_have_their_reader_on_every_supported_python():
    """``requires-python`` admits 3.10, whose standard library has no TOML reader: the package
    declares ``tomli`` there (and only there)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the dependency under test
        import tomli as tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    oldest = min(v for v in ("3.8", "3.9", "3.10", "3.11", "3.12") if v in SpecifierSet(project["requires-python"]))
    assert oldest == "3.10"

    def required(python: str) -> set:
        needs = [Requirement(line) for line in project["dependencies"]]
        return {r.name for r in needs if r.marker is None or r.marker.evaluate({"python_version": python})}

    assert "tomli" in required("3.10")
    assert "tomli" not in required("3.11") and "tomli" not in required("3.13")


def test_example_config_validates():
    example = Path(__file__).parent.parent / "examples" / "sweep.toml"
    cfg = S.load_config(example)
    cells = S.plan(cfg)
    assert {c.analysis for c in cells} >= {"accuracy", "patching"}
    assert len({c.id for c in cells}) == len(cells)
    # the example says what its cells record: `ablation`, the one name for it (never `mode`)
    assert {c.params["ablation"] for c in cells if c.analysis == "ablation"} == {"mean", "zero"}
    assert not any("mode" in c.params for c in cells)


def test_from_zoo_tasks_take_each_models_own_task(model_dir):
    cfg = dict(out="x", models=["zoo:add-100"], tasks=[dict(name="own", from_zoo=True, limit=50)],
               analyses=[dict(name="accuracy")])
    (cell,) = S.plan(cfg)
    assert (cell.task["op"], cell.task["a"], cell.task["b"], cell.task["template"]) == ("+", [0, 100], [0, 100], "{a}+{b}=")
    assert cell.task["limit"] == 50
    cfg["models"].append(str(model_dir))
    with pytest.raises(ConfigError, match=r"^tasks\[0\]\.from_zoo: model .* is not a zoo model"):
        S.load_config(cfg)
    cfg = dict(cfg, models=["zoo:add-100"], tasks=[dict(name="own", from_zoo=True, template="{a} {b} =")])
    with pytest.raises(ConfigError, match=r"^tasks\[0\]\.template: a task with from_zoo"):
        S.load_config(cfg)


def test_cell_ids_are_stable_hashes_of_the_full_spec(model_dir, tmp_path):
    analyses = [dict(name="patching", grid=dict(site=["resid_pre", "attn_out"], vary=["a", "b"])), dict(name="accuracy")]
    cells = S.plan(config(model_dir, tmp_path, analyses))
    assert len(cells) == 5 and len({c.id for c in cells}) == 5
    # the same spec written in another order gives the same ids; any changed value gives new ones
    reordered = [dict(name="accuracy"), dict(name="patching", grid=dict(vary=["b", "a"], site=["attn_out", "resid_pre"]))]
    assert {c.id for c in S.plan(config(model_dir, tmp_path, reordered))} == {c.id for c in cells}
    defaults_spelled_out = [dict(name="patching", grid=dict(site=["resid_pre"]), params=dict(metric="logit_diff", seed=0, vary="a"))]
    assert S.plan(config(model_dir, tmp_path, defaults_spelled_out))[0].id == cells[0].id
    other = config(model_dir, tmp_path, analyses)
    other["tasks"][0]["limit"] = 61
    assert not {c.id for c in S.plan(other)} & {c.id for c in cells}
    assert cells[0].spec["params"]["metric"] == "logit_diff"  # defaults are part of the spec
    S.register_analysis("scaled", lambda model, prompts, scale=1.0: None, dict(scale=float), overwrite=True)
    as_int, as_float = (S.plan(config(model_dir, tmp_path, [dict(name="scaled", params=dict(scale=v))]))[0] for v in (1, 1.0))
    assert as_int.id == as_float.id and as_int.params["scale"] == 1.0


# --- running locally -----------------------------------------------------------------------------


@pytest.mark.slow
def test_local_sweep_writes_cells_manifest_and_tables_then_skips_them(model_dir, tmp_path):
    from arithinterp import patching
    from arithinterp.models import load_model

    analyses = [dict(name="accuracy"), dict(name="patching", grid=dict(site=["resid_pre", "attn_out"]))]
    run = S.run_sweep(config(model_dir, tmp_path / "out", analyses), progress=False)
    assert run.counts() == dict(total=3, done=3, skipped=0, failed=0, pending=0), run.summary()
    out = Path(run.out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config_hash"] == S.load_config(config(model_dir, out, analyses)).digest()
    assert set(manifest["versions"]) >= {"arithinterp", "torch", "transformer_lens"}
    for cell in S.plan(config(model_dir, out, analyses)):
        entry = manifest["cells"][cell.id]
        assert entry["status"] == "done" and entry["seconds"] > 0 and entry["rows"] >= 1
        assert (out / "results" / cell.analysis / f"{cell.id}.parquet").is_file()

    # the tables are the analyses' own results, with the cell's identity in front
    model = load_model(str(model_dir))
    prompts = S.build_prompts(model, S.plan(config(model_dir, out, analyses))[0].task)
    assert len(prompts) == 60
    tables = S.load_results(out)
    accuracy = tables["accuracy"]
    assert accuracy.loc[0, "accuracy"] == pytest.approx(prompts.evaluate(model).accuracy)
    assert accuracy.loc[0, "n_prompts"] == 60 and accuracy.loc[0, "task"] == "add"
    direct = patching.activation_patching(model, prompts.counterfactual(vary="a", seed=0), site="attn_out", progress=False).to_frame()
    swept = tables["patching"][tables["patching"]["site"] == "attn_out"].reset_index(drop=True)
    assert len(swept) == len(direct)
    torch.testing.assert_close(torch.tensor(swept["mean"].values), torch.tensor(direct["mean"].values), atol=1e-6, rtol=0)
    assert set(tables["patching"]["site"]) == {"resid_pre", "attn_out"}

    # re-running skips every finished cell and leaves the files alone
    stamps = {p: p.stat().st_mtime_ns for p in (out / "results").rglob("*.parquet")}
    again = S.run_sweep(config(model_dir, out, analyses), progress=False)
    assert again.counts() == dict(total=3, done=0, skipped=3, failed=0, pending=0)
    assert {p: p.stat().st_mtime_ns for p in (out / "results").rglob("*.parquet")} == stamps
    summary = again.summary()
    assert summary["skipped"] == 3 and [r["analysis"] for r in summary["analyses"]] == ["accuracy", "patching"]


@pytest.mark.slow
def test_every_random_choice_is_seeded_from_the_cell_spec(model_dir, tmp_path):
    """An analysis that draws unseeded random numbers still gives the same table on every run,
    and different draws in cells that differ (the sweep seeds each cell from its spec)."""

    def draw(model, prompts, scale: float = 1.0, seed: int = 0):
        return pd.DataFrame(dict(value=(torch.rand(4) * scale).tolist(), mean_a=float(prompts.a.float().mean())))

    S.register_analysis("draw", draw, dict(scale=float, seed=S.Param(int, 0)), overwrite=True)
    analyses = [dict(name="draw", grid=dict(seed=[0, 1], scale=[1.0, 2.0]))]
    first = S.run_sweep(config(model_dir, tmp_path / "a", analyses), progress=False)
    torch.rand(100)  # disturb the global generator between runs
    second = S.run_sweep(config(model_dir, tmp_path / "b", analyses), progress=False)
    tables_equal(first.results(), second.results())
    table = first.results("draw")
    per_cell = table.groupby("cell")["value"].apply(tuple)
    assert per_cell.nunique() == 4  # each cell has its own draw
    # the planted value reaches the table unchanged: the task's prompts are the seeded subsample
    assert table["mean_a"].nunique() == 1 and 0 < table["mean_a"].iloc[0] < 99


def test_failed_cells_are_recorded_and_retried(model_dir, tmp_path):
    def fragile(model, prompts, k: int = 0):
        if k == 2:
            raise ValueError("k=2 is broken")
        return pd.DataFrame([dict(k2=k * k)])

    S.register_analysis("fragile", fragile, dict(k=int), overwrite=True)
    analyses = [dict(name="fragile", grid=dict(k=[1, 2, 3]))]
    run = S.run_sweep(config(model_dir, tmp_path / "out", analyses), progress=False)
    assert run.counts()["done"] == 2 and run.counts()["failed"] == 1
    summary = run.summary()
    assert "k=2 is broken" in summary["errors"][0]["error"]
    manifest = S.read_manifest(run.out)
    assert sorted(e["status"] for e in manifest["cells"].values()) == ["done", "done", "failed"]

    S.register_analysis("fragile", lambda model, prompts, k=0: pd.DataFrame([dict(k2=k * k)]), dict(k=int), overwrite=True)
    retry = S.run_sweep(config(model_dir, tmp_path / "out", analyses), progress=False)
    assert retry.counts() == dict(total=3, done=1, skipped=2, failed=0, pending=0)
    assert S.load_results(run.out, "fragile")["k2"].tolist() == [1, 4, 9]


def test_register_analysis_rejects_bad_input():
    with pytest.raises(ConfigError, match="already registered"):
        S.register_analysis("accuracy", lambda m, p: None)
    with pytest.raises(ConfigError, match="letters, digits"):
        S.register_analysis("bad name/", lambda m, p: None)
    with pytest.raises(ConfigError, match="callable"):
        S.register_analysis("notfn", 3)
    with pytest.raises(ConfigError, match="expected a Param"):
        S.register_analysis("badschema", lambda m, p: None, dict(k=3))
    with pytest.raises(ConfigError, match="check must be callable"):
        S.register_analysis("badcheck", lambda m, p: None, check="layers")  # pyright: ignore[reportArgumentType]


def test_accepted_values_are_the_analysis_modules_own(monkeypatch):
    """The built-in analyses accept what the analysis modules define, read from them directly: a
    constant that is renamed or removed is an error, not a silently stale copy."""
    from arithinterp import patching, probes, tasks

    own = {("patching", "site"): patching.PATCHING_SITES, ("patching", "metric"): patching.METRICS,
           ("patching", "vary"): tasks.VARY, ("patching", "direction"): patching.DIRECTIONS,
           ("ablation", "ablation"): patching.COMPONENT_ABLATIONS, ("probes", "kind"): probes.PROBE_KINDS}
    for (analysis, name), values in own.items():
        param = S.ANALYSES[analysis].params[name]
        assert tuple(param.choices()) == tuple(values)
    metric = S.ANALYSES["patching"].params["metric"]
    monkeypatch.setattr(patching, "METRICS", (*patching.METRICS, "new_metric"))
    assert metric.check("new_metric", "metric") == "new_metric"
    monkeypatch.delattr(patching, "METRICS")
    with pytest.raises(ImportError, match="METRICS"):
        metric.check("prob", "metric")


# --- figures and CLI -----------------------------------------------------------------------------


def test_plots_and_cli(model_dir, tmp_path):
    config_path = write_toml(tmp_path / "s.toml", model_dir, tmp_path / "out")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    S.add_cli(sub)
    for action in sub.choices["sweep"]._actions:
        assert action.help, action.dest  # every flag says what it does

    plan = S.run_cli(parser.parse_args(["sweep", str(config_path), "--dry-run"]))
    assert plan["cells"] == 7 and plan["to_run"] == 7 and not (tmp_path / "out").exists()

    analyses = [dict(name="accuracy"), dict(name="patching", grid=dict(site=["resid_pre"], vary=["a", "b"]))]
    S.run_sweep(config(model_dir, tmp_path / "out", analyses), progress=False)
    summary = S.run_cli(parser.parse_args(["sweep", "--plot", str(tmp_path / "out")]))
    files = sorted(Path(f).name for f in summary["figures"])
    assert files == ["accuracy.html", "patching.html"]
    json.dumps(summary)
    figs = S.figures(tmp_path / "out")
    heat = figs["patching"][0].data[0]
    assert heat.type == "heatmap" and list(heat.y) == ["L0", "L1"] and heat.x[0].endswith(": <bos>")
    assert [fig.layout.title.text.split("<br>")[0] for fig in figs["patching"]] == [
        "Exact patching of resid_pre (denoise) · vary=a", "Exact patching of resid_pre (denoise) · vary=b"]
    assert "colour: fraction of the clean–corrupt gap" in figs["patching"][0].layout.title.text
    assert figs["accuracy"][0].data[0].type == "bar"
    folder = tmp_path / "out" / "figures"
    html = (folder / "patching.html").read_text()
    assert html.count("Plotly.newPlot") == 2 and "<script src='plotly.min.js'>" in html
    assert (folder / "plotly.min.js").stat().st_size > 1_000_000  # the library, once, beside the pages
    assert max((folder / name).stat().st_size for name in files) < 300_000

    with pytest.raises(ConfigError, match="give a sweep config file"):
        S.run_cli(parser.parse_args(["sweep"]))
    listed = S.run_cli(parser.parse_args(["sweep", "--list"]))
    assert set(listed) >= {"accuracy", "patching", "ablation", "probes"}
    assert "  site (str, required): site to patch; accepted: resid_pre," in listed["patching"]
    rows = S.run_cli(parser.parse_args(["sweep", "--list", "--json"]))["parameters"]
    assert {(r["analysis"], r["parameter"], r["default"]) for r in rows} >= {("patching", "per_position", "True"),
                                                                         ("probes", "cv", "5")}


def _patching_table(per_position: bool, normalize: bool = False):
    """A combined ``patching`` table of one attn_z cell, as the sweep stores it (heads as floats)."""
    import pandas as pd

    rows = []
    for layer in (0, 1):
        for head in (0.0, 1.0, 2.0):
            for position in (["0", "1"] if per_position else [None]):
                value = 10.0 * layer + head + (1.0 if position == "1" else 0.0)
                rows.append(dict(cell="c1", model="m", task="t", analysis="patching", site="attn_z", metric="logit_diff",
                                 method="exact", direction="denoise", normalize=normalize, per_position=per_position,
                                 layer=layer, head=head, position=position, token=position and f"t{position}",
                                 mean=value, ci_low=value - 1, ci_high=value + 1, clean_baseline=12.0,
                                 corrupt_baseline=-8.0))
    frame = pd.DataFrame(rows)
    frame.attrs["cell_columns"] = ["model", "task", "per_position", "normalize"]
    return frame


def test_sweep_patching_figures_show_the_gap_fraction_on_integer_heads_under_honest_titles():
    from arithinterp.viz.sweep import plot_sweep_patching

    at_once = plot_sweep_patching(_patching_table(per_position=False))[0]
    heat = at_once.data[0]
    assert list(heat.x) == ["0", "1", "2"] and list(heat.y) == ["L0", "L1"]  # heads 0, 1, 2, never 0.0
    assert heat.z[1][2] == pytest.approx(1.0)  # L1 H2 scores 12, the clean run's metric: the whole gap
    assert heat.z[0][0] == pytest.approx(8.0 / 20.0)  # (0 - -8) / (12 - -8)
    title = at_once.layout.title.text
    assert "every position at once" in title and "mean over positions" not in title
    assert "fraction of the clean–corrupt gap (clean 12, corrupt -8 logit_diff)" in title
    raw = plot_sweep_patching(_patching_table(per_position=False), normalize=False)[0]
    assert raw.data[0].z[1][2] == pytest.approx(12.0) and "raw logit_diff" in raw.layout.title.text
    per_position = plot_sweep_patching(_patching_table(per_position=True))[0].data[0]
    assert list(per_position.y)[:3] == ["L0 H0", "L0 H1", "L0 H2"] and list(per_position.x) == ["0: t0", "1: t1"]
    assert per_position.z[0][1] - per_position.z[0][0] == pytest.approx(1.0 / 20.0)  # no average over positions
    done = plot_sweep_patching(_patching_table(per_position=False, normalize=True))[0]
    assert done.data[0].z[1][2] == pytest.approx(12.0) and "normalised per pair" in done.layout.title.text


# --- killed and resumed; Ray -------------------------------------------------------------------------


def _sweep_process(config_path: Path, out: Path, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "arithinterp.sweep", str(config_path), "--out", str(out),
                             "--no-progress", "--json", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """An uninterrupted local run in a fresh process, like the runs it is compared with (in the test
    process the thread count and reduction order can differ in the last digits): (config path, its tables)."""
    root = tmp_path_factory.mktemp("sweep_reference")
    config_path = write_toml(root / "sweep.toml", model_dir, root / "unused")
    process = _sweep_process(config_path, root / "out")
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["done"] == summary["total"] == 7
    return config_path, S.load_results(root / "out")


@pytest.mark.slow
def test_killed_sweep_resumes_to_the_uninterrupted_results(reference, tmp_path):
    """Killed with SIGKILL mid-run (local executor), resumed on a process pool: the tables equal
    the uninterrupted local run's row for row, which also shows the pool matches the local executor."""
    config_path, expected = reference
    out = tmp_path / "out"
    process = _sweep_process(config_path, out)
    deadline = time.monotonic() + 300
    while not list((out / "results").rglob("*.parquet")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished = len(list((out / "results").rglob("*.parquet")))
    assert 1 <= finished < 7, "the kill must land mid-run"
    # what a kill in the middle of a write leaves behind: a temp file next to the results
    stale = out / "results" / "patching" / ".deadbeef.parquet.x1y2z3.tmp"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"half a table")

    # resumed from here: the cells run in the pool's one fresh process, as in the reference's
    run = S.run_sweep(config_path, out=out, executor="processes", workers=1, progress=False)
    assert run.counts() == dict(total=7, done=7 - finished, skipped=finished, failed=0, pending=0), run.summary()
    assert not stale.exists()
    tables_equal(S.load_results(out), expected)  # row for row, bit for bit


@pytest.mark.slow
def test_ray_executor_matches_local(reference, tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'arithinterp[ray]')")
    config_path, expected = reference
    # one CPU: one worker process imports the package and loads the model (the cells queue on it)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        run = S.run_sweep(config_path, out=tmp_path / "out", executor="ray", num_cpus=1, progress=False)
    finally:
        ray.shutdown()
    assert run.counts() == dict(total=7, done=7, skipped=0, failed=0, pending=0), run.summary()
    assert len({c["worker"] for c in S.read_manifest(run.out)["cells"].values()}) >= 1
    tables_equal(S.load_results(run.out), expected)


def test_one_driver_per_results_directory(model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text(json.dumps(dict(host=os.uname().nodename, pid=os.getpid())))
    with pytest.raises(ConfigError, match="in use by another sweep"):
        S.run_sweep(config(model_dir, out), progress=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / ".lock").write_text(json.dumps(dict(host=os.uname().nodename, pid=int(dead.stdout))))
    assert S.run_sweep(config(model_dir, out), progress=False).counts()["done"] == 1  # a dead driver's lock is taken over
    assert not (out / ".lock").exists()
    with pytest.raises(ConfigError, match="cannot be sent to worker processes"):
        S.register_analysis("local_fn", lambda model, prompts: pd.DataFrame([dict(x=1)]), overwrite=True)
        S.run_sweep(config(model_dir, out, [dict(name="local_fn")]), executor="processes", progress=False)


def test_missing_ray_is_a_clear_error(model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail
    with pytest.raises(ArithInterpError, match=r"pip install 'arithinterp\[ray\]'"):
        S.run_sweep(config(model_dir, tmp_path / "out"), executor="ray", progress=False)
    assert not (tmp_path / "out").exists()


def test_accuracy_reads_the_whole_sample_of_a_correct_only_task(model_dir, tmp_path):
    """On only the correctly answered prompts accuracy was 1.0 by construction, whatever the model."""
    from arithinterp.models import load_model

    task = dict(TASK, correct_only=True)
    run = S.run_sweep(dict(config(model_dir, tmp_path / "out"), tasks=[task]), progress=False)
    assert run.counts()["done"] == 1, run.summary()
    row = S.load_results(run.out)["accuracy"].iloc[0]
    prompts = S.build_prompts(load_model(str(model_dir)), dict(S.plan(config(model_dir, tmp_path / "out"))[0].task,
                                                                correct_only=False))
    assert row["n_prompts"] == len(prompts) == 60
    assert row["accuracy"] == pytest.approx(prompts.evaluate(load_model(str(model_dir))).accuracy)
    assert row["accuracy"] < 1  # a random model: not 1 by construction


def test_an_analysis_registered_whole_sample_reads_every_prompt_of_a_correct_only_task(model_dir, tmp_path):
    count = lambda model, prompts: pd.DataFrame([dict(n=len(prompts))])  # noqa: E731
    S.register_analysis("count_all", count, whole_sample=True, overwrite=True)
    S.register_analysis("count_kept", count, overwrite=True)
    try:
        analyses = [dict(name="count_all"), dict(name="count_kept")]
        run = S.run_sweep(dict(config(model_dir, tmp_path / "out", analyses), tasks=[dict(TASK, correct_only=True)]),
                          progress=False)
        tables = S.load_results(run.out)
        assert tables["count_all"]["n"].item() == 60 > tables["count_kept"]["n"].item()
        with pytest.raises(ConfigError, match="whole_sample must be True or False"):
            S.register_analysis("count_all", count, whole_sample="yes", overwrite=True)
    finally:
        S.ANALYSES.pop("count_all", None)
        S.ANALYSES.pop("count_kept", None)


@pytest.mark.parametrize("override", [dict(address="ray://head:10001"), dict(num_gpus=1)])
def test_a_ray_request_with_another_executor_is_refused_not_ignored(model_dir, tmp_path, override):
    """--address ray://... on the local executor ran locally without a word."""
    with pytest.raises(ConfigError, match=f"{next(iter(override))}=.* is a request to Ray, but the executor is 'local'"):
        S.load_config(config(model_dir, tmp_path / "out"), **override)
    assert S.load_config(config(model_dir, tmp_path / "out", executor="ray"), **override).executor == "ray"


def test_huge_workers_and_num_cpus_start_only_what_the_jobs_use(model_dir, tmp_path):
    """--workers 99999999999999999999 overflowed a C int; --num-cpus 1e300 overflowed torch's thread count."""
    run = S.run_sweep(config(model_dir, tmp_path / "out"), executor="processes", workers=10**20, num_cpus=1e300,
                      progress=False)
    assert run.counts()["done"] == 1, run.summary()
