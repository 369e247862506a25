"""The ``sweep`` command line: the ``arithinterp sweep`` subcommand and ``python -m arithinterp.sweep``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from arithinterp.errors import ArithInterpError, ConfigError
from arithinterp.outputs import check_writable_dir, fail, print_summary
from arithinterp.sweep.config import EXECUTORS, load_config, plan
from arithinterp.sweep.plots import plot_sweep
from arithinterp.sweep.registry import describe_analyses, list_analyses
from arithinterp.sweep.runner import check_unfinished_cells, run_sweep


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``sweep`` subcommand to an argparse subparsers object.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returns.

    Returns:
        The subcommand's parser.
    """
    p = subparsers.add_parser("sweep", help="run a config-driven, resumable sweep (or plot one with --plot)",
                              description="Run every unfinished cell of a sweep config (TOML or YAML): models x tasks "
                              "x analyses x parameters. Re-running skips finished cells.")
    p.add_argument("config", nargs="?", default=None, help="sweep config file (.toml, .yaml or .yml)")
    p.add_argument("--out", default=None, help="results directory (default: the config's 'out')")
    p.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="where jobs run (default: the config's, else local)")
    p.add_argument("--workers", type=int, default=None, help="processes for --executor processes (default: 2)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address, e.g. ray://head:10001 (default: start a local one)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs each Ray job requests (default: 1)")
    p.add_argument("--num-gpus", type=float, default=None, help="GPUs each Ray job requests (default: 0)")
    p.add_argument("--device", default=None, help="device models load on: cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config and every cell to run (on its model and prompts) and list the cells "
                        "without running them")
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="DIR",
                   help="write HTML figures of the sweep in DIR "
                        "(or, without DIR, of the config's results after running)")
    p.add_argument("--list", action="store_true",
                   help="list the analyses a config can name, each parameter with its type, default and accepted "
                        "values")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")
    return p


def run_cli(args: argparse.Namespace) -> dict:
    """Run the ``sweep`` subcommand: the sweep, a dry run's plan, the figures of ``--plot``, or the
    analyses' parameters (``--list``).

    Args:
        args: The parsed arguments of the ``sweep`` subcommand.

    Returns:
        A JSON-able summary (the output directory, cell counts, or the figures written).

    Raises:
        ConfigError: No config and no ``--plot``, or a bad config, cell or flag.
    """
    if args.list:  # rows for a program, a readable block per analysis for a person
        return dict(parameters=list_analyses()) if args.json else describe_analyses()
    if args.plot and not args.config:
        files = plot_sweep(args.plot, overwrite=True)  # redrawn from the results: the figures are the sweep's own
        return dict(out=args.plot, figures=[str(f) for f in files])
    if not args.config:
        raise ConfigError("give a sweep config file, --plot DIR to draw an existing sweep, or --list to list the "
                          "analyses")
    overrides = dict(out=args.out, executor=args.executor, workers=args.workers, address=args.address,
                     num_cpus=args.num_cpus, num_gpus=args.num_gpus, device=args.device)
    if args.dry_run:
        cfg = load_config(args.config, **{k: (str(Path(v).resolve()) if k == "out" and v else v)
                                          for k, v in overrides.items()})
        cells = plan(cfg)
        out = cfg.out_dir if cfg.out else None
        to_run = len(check_unfinished_cells(cfg, cells))
        return dict(config_hash=cfg.digest(), out=str(out), cells=len(cells), finished=len(cells) - to_run,
                    to_run=to_run,
                    plan=[dict(cell=c.id, analysis=c.analysis, model=c.model, task=c.task["name"],
                               params=json.dumps(c.params, sort_keys=True)) for c in cells])
    if args.plot:  # a figures folder that cannot be written fails now, not after the sweep
        check_writable_dir(args.plot, "--plot")
    run = run_sweep(args.config, progress=not args.no_progress, **overrides)
    summary = run.summary()
    if args.plot is not None:
        summary["figures"] = [str(f) for f in plot_sweep(run.out, args.plot or None, overwrite=True)]
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m arithinterp.sweep CONFIG [flags]``.

    Args:
        argv: The arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 when every cell finished, 1 when some failed, 2 on a bad config, 130 when
        interrupted (one line, no traceback).
    """
    try:
        parser = add_cli(argparse.ArgumentParser().add_subparsers(dest="command"))
        parser.prog = "python -m arithinterp.sweep"
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        try:
            summary = run_cli(args)
        except ArithInterpError as error:
            return fail("sweep", error, 2, args.json)
        print_summary(summary, args.json)
    except KeyboardInterrupt:  # finished cells are kept; the next run resumes from them
        print("arithinterp sweep: interrupted", file=sys.stderr)
        return 130
    return 1 if summary.get("failed") else 0
