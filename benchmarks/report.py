"""The report on a real-sized model: time per stage, sample sizes and peak memory.

A random-weight Llama of SmolLM-135M's shape (30 layers, d_model 576, 9 heads / 3 key-value
heads, d_mlp 1,536, vocabulary 49,152, tied embeddings) with a digit-split tokenizer, built by
``benchmarks/evaluate.py``'s ``build`` (no download), then
``write_report(folder, template="{a}+{b}=", few_shot=3, operands="10-59")`` with the default
budget, as a user runs it: total time (model loading included), each stage's recorded seconds,
budget and sample (read from the page's stage list) and the process's peak resident set size
(``PeakRSS``). A random model answers almost none of the prompts, so with only the correct ones
every analysis says "not enough data"; ``--all-prompts`` (``correct_only=False``, the CLI's
``--all-prompts``) runs every stage on every evaluated prompt — the heavy stages at full size.

    python benchmarks/report.py [--budget 480] [--all-prompts] [--folder DIR] [--page PAGE.html] [--write FILE.md]
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from collect import PeakRSS  # noqa: E402  (the RSS sampler of the collect benchmark)
from evaluate import add_shape_arguments, build  # noqa: E402  (the random 135M-shaped Llama folder)

MIB = 2**20
TEMPLATE, FEW_SHOT, OPERANDS = "{a}+{b}=", 3, "10-59"


def stage_lines(page: str) -> list[tuple[str, str]]:
    """(stage, state) from the page's stage list."""
    block = page.split("<h2>Stages</h2><ul class='status'>")[1].split("</ul>")[0]
    return [(html.unescape(a), html.unescape(b)) for a, b in re.findall(r"<li><b>(.*?)</b>: (.*?)</li>", block)]


def report_run(folder: Path, budget: float, correct_only: bool = True) -> dict:
    """``write_report`` as a user calls it, the model loaded from the folder inside the timing."""
    from arithinterp.models import load_model
    from arithinterp.report import write_report

    with PeakRSS() as memory:
        start = time.perf_counter()
        model = load_model(str(folder))
        loaded = time.perf_counter() - start
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        with tempfile.TemporaryDirectory() as tmp:
            out = write_report(model, out=Path(tmp) / "report.html", budget=budget, progress=False,
                               template=TEMPLATE, few_shot=FEW_SHOT, operands=OPERANDS, correct_only=correct_only)
            page = out.read_text()
        seconds = time.perf_counter() - start
    return dict(seconds=seconds, load=loaded, peak=memory.peak, start=memory.start, model=model_bytes,
                stages=stage_lines(page), note=re.findall(r"<p class='state'>(.*?)</p>", page)[0], page=page)


def report_lines(run: dict, budget: float, args, correct_only: bool = True) -> list[str]:
    which = "" if correct_only else ", correct_only=False"
    lines = [f"`write_report` with `template=\"{{a}}+{{b}}=\", few_shot=3, operands=\"10-59\"{which}` and a "
             f"{budget:.0f} s budget on a random-weight Llama of {args.layers} layers, d_model {args.d_model}, "
             f"{args.heads} heads / {args.kv_heads} key-value heads, d_mlp {args.d_mlp}, vocabulary {args.vocab} "
             f"({run['model'] / MIB:.0f} MiB in float32); one thread: **{run['seconds']:.0f} s** in all "
             f"({run['load']:.0f} s loading the model), peak RSS {run['peak'] / MIB:,.0f} MiB "
             f"({(run['peak'] - run['start']) / MIB:,.0f} MiB above the start). {html.unescape(run['note'])}", "",
             "| stage | state, seconds, budget and sample (from the page) |", "|---|---|"]
    return lines + [f"| {name} | {state.replace('|', '/')} |" for name, state in run["stages"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--budget", type=float, default=None, help="write_report's budget (default: its default)")
    parser.add_argument("--all-prompts", action="store_true", help="every evaluated prompt (correct_only=False)")
    parser.add_argument("--page", default=None, help="also save the report page here")
    parser.add_argument("--folder", default=None, help="build the random-weight model here and keep it")
    parser.add_argument("--write", default=None, help="append the table to this Markdown file")
    add_shape_arguments(parser)
    args = parser.parse_args()
    from arithinterp.report import DEFAULT_BUDGET

    budget = DEFAULT_BUDGET if args.budget is None else args.budget
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder) if args.folder else Path(tmp) / "llama"
        build(folder, args)
        run = report_run(folder, budget, correct_only=not args.all_prompts)
    if args.page:
        Path(args.page).write_text(run["page"], encoding="utf-8")
    text = "\n".join(report_lines(run, budget, args, correct_only=not args.all_prompts))
    print(text)
    if args.write:
        with open(args.write, "a") as handle:
            handle.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
