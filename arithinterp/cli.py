"""The ``arithinterp`` command: a thin layer over the same functions a notebook calls.

Every subcommand validates its flags, prints a short human summary (or JSON with ``--json``),
and exits 0 on success, 2 on bad input (an ``ArithInterpError``), 1 on anything unexpected.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Optional, Sequence

from arithinterp.errors import ArithInterpError

COMMANDS: dict[str, Callable[[argparse.Namespace], dict]] = {}


def command(name: str):
    def register(function):
        COMMANDS[name] = function
        return function

    return register


def _print(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    for key, value in summary.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            import pandas as pd

            print(f"{key}:")
            print(pd.DataFrame(value).to_string(index=False))
        else:
            print(f"{key}: {value}")


# --- info ----------------------------------------------------------------------------------------


@command("info")
def info(args: argparse.Namespace) -> dict:
    """List the zoo and evaluate a model on its task."""
    from arithinterp.models import list_zoo, load_model
    from arithinterp.models.zoo import evaluate, get_entry

    summary: dict[str, Any] = {"zoo": list_zoo()}
    if args.model:
        model = load_model(args.model)
        summary["model"] = args.model
        summary["config"] = dict(
            n_layers=model.cfg.n_layers, d_model=model.cfg.d_model, n_heads=model.cfg.n_heads, d_mlp=model.cfg.d_mlp
        )
        if args.model.startswith("zoo:"):
            summary["evaluation"] = evaluate(get_entry(args.model), model, limit=args.limit)
    return summary


# --- report --------------------------------------------------------------------------------------


@command("report")
def report_command(args: argparse.Namespace) -> dict:
    """Run the standard battery on a model and write one offline HTML report."""
    from arithinterp.report import report

    stages = args.stages.split(",") if args.stages else None
    path = report(args.model, out=args.out, stages=stages, limit=args.limit, seed=args.seed,
                  progress=not args.no_progress)
    return dict(report=str(path), size_kib=round(path.stat().st_size / 1024, 1))


# --- train ---------------------------------------------------------------------------------------


@command("train")
def train_command(args: argparse.Namespace) -> dict:
    """Train a zoo model from scratch with its recipe."""
    from pathlib import Path

    from arithinterp.models.train import train

    card = train(args.name, out=Path(args.out) if args.out else None, seed=args.seed, steps=args.steps,
                 progress=not args.no_progress)
    card.pop("history", None)
    return card


# --- parser --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from arithinterp import __version__
    from arithinterp.models.zoo import ZOO

    parser = argparse.ArgumentParser(
        prog="arithinterp",
        description="How does a language model do arithmetic? Patching, probes, Fourier/helix fits, "
        "heuristic neurons and reports for TransformerLens models.",
    )
    parser.add_argument("--version", action="version", version=f"arithinterp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from arithinterp.report import STAGES

    p = sub.add_parser("report", help="run the standard analyses on a model and write an offline HTML report")
    p.add_argument("model", nargs="?", default="zoo:add-100", help="model spec (default: zoo:add-100)")
    p.add_argument("--out", default="report.html", help="output HTML file (default: report.html)")
    p.add_argument("--stages", default=None, help=f"comma-separated stages to run (default: all of {','.join(STAGES)})")
    p.add_argument("--limit", type=int, default=2000, help="at most this many task prompts (default: 2000)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling and counterfactuals (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")

    from arithinterp import sweep

    sweep.add_cli(sub)
    COMMANDS["sweep"] = sweep.run_cli

    p = sub.add_parser("info", help="list the model zoo and evaluate a model on its task")
    p.add_argument("model", nargs="?", default=None, help="model spec, e.g. zoo:add-100 (default: only list the zoo)")
    p.add_argument("--limit", type=int, default=2000, help="held-out problems to evaluate (default: 2000)")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")

    p = sub.add_parser("train", help="train a zoo model from scratch with its recipe")
    p.add_argument("name", choices=sorted(ZOO), help="zoo model to train")
    p.add_argument("--out", default=None, help="output directory (default: the package's checkpoint folder)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the recipe's)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        summary = COMMANDS[args.command](args)
    except ArithInterpError as error:
        print(f"arithinterp {args.command}: error: {error}", file=sys.stderr)
        return 2
    _print(summary, getattr(args, "json", False))
    return 1 if summary.get("failed") else 0  # e.g. sweep cells that failed (they retry on the next run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
