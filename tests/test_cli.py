import json

import pytest

from arithinterp.cli import build_parser, main


def test_info_lists_the_zoo(capsys):
    assert main(["info", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {row["name"] for row in summary["zoo"]} >= {"modadd-113", "add-100", "add-3digit", "add-3digit-weak"}


def test_info_bad_model_exits_2_with_message(capsys):
    assert main(["info", "zoo:nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown zoo model 'nope'" in err and "add-100" in err


def test_every_subcommand_documents_every_flag():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.option_strings or action.dest} has no help text"


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, check",
    [
        (["patch", "--site", "resid_pre", "--normalize"], lambda s: 0.99 <= s["best_cell_mean"] <= 1.01),
        (["probe", "--target", "a_units", "--positions", "a", "--cv", "3"], lambda s: s["best"]["score"] > 0.8),
        (["fourier"], lambda s: 0 <= s["key_fraction"] <= 1),
        (["helix"], lambda s: abs(s["fraction_of_layer_patch"]["layer patch"] - 1) < 1e-6),
        # multi-token answers: pairs differ in the scored first answer token, and a fraction that cannot be
        # taken (the layer patch's effect is not distinguishable from 0) is missing with the reason, not a bare NaN
        (["helix", "zoo:add-3digit"], lambda s: s["fraction_of_layer_patch"]["helix"] is None
         and "not distinguishable from zero" in s["note"]),
        (["neurons", "--top-k", "10"], lambda s: s["neurons"] == 20),
        (["ablate", "--components", "mlp0"], lambda s: s["accuracy_before"] == 1.0 and s["accuracy_after"] < 0.5),
        (["ablate", "zoo:add-3digit", "--components", "L0H0@answer[2]", "--full-answer"],
         lambda s: s["token_accuracy_after"][:3] == [1.0, 1.0, 1.0] and s["token_accuracy_after"][3] < 0.6),
        (["circuit", "--method", "eap"], lambda s: s["faithfulness"] >= 0.9 and 0 < s["kept"] < s["edges"]),
        (["digits"], lambda s: s["largest_drop"]["head"].startswith("L0") and s["largest_drop"]["drop"] > 0.4),
    ],
    ids=lambda v: " ".join(v[:2]) if isinstance(v, list) else "",
)
def test_analysis_commands_write_results_and_figures(command, check, tmp_path, capsys):
    out, figure = tmp_path / "result", tmp_path / "figure.html"
    args = [*command, "--limit", "200", "--no-progress", "--json", "--out", str(out), "--figure", str(figure)]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert check(summary), summary
    assert (out / "result.json").exists() and figure.stat().st_size > 10_000


def test_analysis_command_bad_site_exits_2(capsys):
    assert main(["patch", "--site", "resid_psot", "--limit", "50", "--no-progress"]) == 2
    assert "resid_pre" in capsys.readouterr().err


def test_both_command_lines_print_through_one_summary_printer_and_error_reporter(capsys):
    from arithinterp import cli, outputs
    from arithinterp.sweep import cli as sweep_cli

    assert cli.fail is sweep_cli.fail is outputs.fail
    assert cli.print_summary is sweep_cli.print_summary is outputs.print_summary
    outputs.print_summary(dict(cells=2, plan=[dict(cell="c1", analysis="ablation")]), as_json=False)
    assert capsys.readouterr().out.splitlines() == ["cells: 2", "plan:", "cell analysis", "  c1 ablation"]
    assert sweep_cli.main(["no-such-config.toml", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("arithinterp sweep: error: ")
    assert json.loads(captured.out)["exit_code"] == 2


def test_the_ablation_has_one_flag(capsys):
    args = ["ablate", "--components", "mlp0", "--limit", "50", "--no-progress", "--json"]
    assert main([*args, "--ablation", "zero"]) == 0
    assert json.loads(capsys.readouterr().out)["ablation"] == "zero"
    with pytest.raises(SystemExit):
        main([*args, "--mode", "zero"])  # no second name for it
    assert "unrecognized arguments: --mode" in capsys.readouterr().err


def test_json_summaries_write_an_unmeasured_number_as_null(capsys):
    from arithinterp import outputs

    outputs.print_summary(dict(fraction=dict(helix=float("nan"), pca=0.5), effects=[float("inf"), 1.0]), as_json=True)
    assert json.loads(capsys.readouterr().out) == dict(fraction=dict(helix=None, pca=0.5), effects=[None, 1.0])


def _refusal(argv, capsys) -> str:
    """Run the command; it must exit 2 and name the reason on stderr. Returns that stderr."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's refusal: usage and one 'error:' line
        code = stop.code
    assert code == 2, argv
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, flag, words", [
    (["info", "zoo:add-100", "--limit", "-1"], "--limit", "an int >= 1"),  # not [:-1] of the held-out set
    (["patch", "--seed", "99999999999999999999"], "--seed", "0..4294967295"),
    (["report", "--seed", "-1", "--stages", "accuracy", "--out", "{tmp}/r.html"], "--seed", "0..4294967295"),
    (["fourier", "--numbers", "1"], "--numbers", "an int >= 2"),
    (["fourier", "--out", ""], "--out", "empty path"),  # not: no result saved
    (["fourier", "--figure", " "], "--figure", "empty path"),
    (["train", "add-100", "--out", "", "--steps", "1"], "--out", "empty path"),  # not the shipped checkpoint
    (["train-transcoders", "zoo:add-100", "--out", "", "--steps", "1"], "--out", "empty path"),
    (["graph", "zoo:add-100", "1+2=", "--out", ""], "--out", "empty path"),
    (["helix", "--periods", "10,10"], "--periods", "more than once"),  # not a doubled basis column
    (["helix", "--periods", "nan"], "--periods", "finite"),
    (["helix", "--position", "final"], "--position", "'a', 'b'"),
    (["probe", "--positions", "a,a"], "--positions", "more than once"),
    (["probe", "--positions", ","], "--positions", "names nothing"),
    (["ablate", "--components", "attn0,attn0"], "--components", "more than once"),
    (["das", "--variable", "carry_tens", "--every-layer", "--layers", ""], "--layers", "comma-separated"),  # not all
    (["das", "--variable", "carry_tens", "--every-layer", "--layers", "0,0"], "--layers", "more than once"),
    (["das", "--variable", "carry_tens", "--layers", "1"], "--layers", "--every-layer"),  # not silently layer 0
    (["das", "--variable", "carry_tens", "--position", "final+final"], "--position", "more than once"),
    (["das", "--variable", "carry_tens", "--every-layer", "--position", "b,b"], "--position", "more than once"),
    (["das", "--variable", "carry_tens", "--lr", "1e300"], "--lr", "finite"),
    (["circuit", "--target", "2"], "--target", "(0, 1]"),  # before the edges are scored
    (["circuit", "--ablation", "zero"], "--ablation", "'resample', 'mean'"),
    (["report", "--template", "", "--out", "{tmp}/r.html"], "--template", "empty"),  # not the default template
    (["report", "--operands", "1,1,5", "--out", "{tmp}/r.html"], "--operands", "more than once"),
    (["report", "--operands", "0-99999", "--out", "{tmp}/r.html"], "--operands", "operand pairs"),
    (["report", "--operands", "99999999999999999999", "--out", "{tmp}/r.html"], "--operands", "int64"),  # not torch's
    (["report", "--out", "{tmp}/new/", "--stages", "accuracy"], "--out", "names a folder"),  # not a file named new
    (["patch", "--figure", "{tmp}/figures/"], "--figure", "names a folder"),
    (["das", "--variable", "carry_tens", "--steps", "99999999999999999999"], "--steps", "1..10000000"),  # overflow
    (["train", "add-100", "--steps", "99999999999999999999", "--out", "{tmp}/m"], "--steps", "1..10000000"),
    (["train-transcoders", "zoo:add-100", "--steps", "99999999999999999999", "--out", "{tmp}/t"], "--steps",
     "1..10000000"),
    (["das", "--variable", "carry_tens", "--every-layer", "--resume", ""], "--resume", "empty path"),  # not "."
    (["graph", "zoo:add-100", "1+2=", "--transcoders", ""], "--transcoders", "empty path"),  # not the shipped ones
    (["info", ""], "model", "empty model spec"),  # not "list the zoo only"
])
def test_careless_flags_are_refused_before_the_model_loads(argv, flag, words, tmp_path, capsys, monkeypatch):
    from arithinterp import models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(models, "load_model", no_model)
    err = _refusal([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    line = err.strip().splitlines()[-1]
    assert flag in line and words in line, line


def test_fourier_refuses_more_numbers_than_the_vocabulary_before_tokenizing_them(capsys):
    err = _refusal(["fourier", "zoo:add-100", "--numbers", "99999999"], capsys)  # used to tokenize for minutes
    assert "--numbers" in err and "vocabulary" in err


def test_graph_replaces_its_outputs_with_overwrite(tmp_path):
    from arithinterp.cli import build_parser, check_outputs

    figure = tmp_path / "graph.html"
    figure.write_text("old")
    args = build_parser().parse_args(["graph", "zoo:add-100", "1+2=", "--figure", str(figure), "--overwrite"])
    check_outputs(args)  # the refusal without --overwrite points at this flag, so it must exist
