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
        (["probe", "--target", "a_digit_0", "--positions", "a", "--cv", "3"], lambda s: s["best"]["score"] > 0.8),
        (["fourier"], lambda s: 0 <= s["key_fraction"] <= 1),
        (["helix"], lambda s: abs(s["fraction_of_layer_patch"]["layer patch"] - 1) < 1e-6),
        (["neurons", "--top-k", "10"], lambda s: s["neurons"] == 20),
        (["ablate", "--components", "mlp0"], lambda s: s["accuracy_before"] == 1.0 and s["accuracy_after"] < 0.5),
        (["ablate", "zoo:add-3digit", "--components", "L0H0@answer3", "--full-answer"],
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
