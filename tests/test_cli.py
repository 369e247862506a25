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
