"""The report on a real-sized model: time per stage, sample sizes and peak memory.

A random-weight Llama of SmolLM-135M's shape (30 layers, d_model 576, 9 heads / 3 key-value
heads, d_mlp 1,536, vocabulary 49,152, tied embeddings) with a digit-split tokenizer, built by
``benchmarks/evaluate.py``'s ``build`` (no download), then

* ``write_report(folder, template="{a}+{b}=", few_shot=3, operands="10-59")`` with the default
  budget, as a user runs it: total time, each stage's recorded seconds, budget and sample (read
  from the page's stage list) and the process's peak resident set size (``PeakRSS``);
* ``--every-prompt``: the same stages with every evaluated prompt treated as answered correctly
  (a random model answers almost none, so the analyses would otherwise refuse with "not enough
  data"): the heavy stages' seconds against their budgets at full size.

    python benchmarks/report.py [--budget 480] [--every-prompt] [--write docs/benchmarks.md]
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


def report_run(folder: Path, budget: float) -> dict:
    """``write_report`` as a user calls it."""
    from arithinterp.models import load_model
    from arithinterp.report import write_report

    with PeakRSS() as memory:
        start = time.perf_counter()
        model = load_model(str(folder))
        loaded = time.perf_counter() - start
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        with tempfile.TemporaryDirectory() as tmp:
            out = write_report(model, out=Path(tmp) / "report.html", budget=budget, progress=False,
                               template=TEMPLATE, few_shot=FEW_SHOT, operands=OPERANDS)
            page = out.read_text()
        seconds = time.perf_counter() - start
    return dict(seconds=seconds, load=loaded, peak=memory.peak, start=memory.start, model=model_bytes,
                stages=stage_lines(page), note=re.findall(r"<p class='state'>(.*?)</p>", page)[0])


def every_prompt_run(folder: Path, budget: float) -> dict:
    """The stages with every evaluated prompt counted as correct, each within its share of ``budget``."""
    from arithinterp.models import load_model
    from arithinterp.report import (STAGES, WEIGHTS, Budget, Context, Section, _evaluate_within, _run_stage,
                                    _task_prompts, default_max_memory)

    model = load_model(str(folder))
    memory = default_max_memory()
    rows = []
    with PeakRSS() as rss:
        clock = time.perf_counter()
        prompts = _task_prompts(model, str(folder), 2000, 0, TEMPLATE, FEW_SHOT, OPERANDS)
        share = budget * WEIGHTS["evaluation"] / sum(WEIGHTS.values())
        prompts, evaluation, per_prompt, sampled = _evaluate_within(model, prompts, share, Budget(share, memory), 0)
        rows.append(("evaluation", time.perf_counter() - clock, share, sampled, ""))
        pairs = prompts.counterfactual(vary="a", seed=0, distinct_first_token=True)
        ctx = Context(model, str(folder), prompts, prompts, evaluation, pairs, 0)
        names = list(STAGES)
        for i, name in enumerate(names):
            left = budget - (time.perf_counter() - clock)
            seconds = max(left, 0.0) * WEIGHTS[name] / sum(WEIGHTS[n] for n in names[i:])
            ctx.budget, ctx.stage_start = Budget(seconds, memory, per_prompt), time.perf_counter()
            try:
                section = _run_stage(ctx, name)
            except Exception as error:  # noqa: BLE001 (recorded, as the report does)
                section = Section(name, findings=[f"{type(error).__name__}: {error}"])
            rows.append((name, time.perf_counter() - ctx.stage_start, seconds, section.sample,
                         section.findings[0] if section.findings else ""))
        total = time.perf_counter() - clock
    return dict(rows=rows, total=total, peak=rss.peak, start=rss.start, n=len(prompts), pairs=len(pairs))


def report_lines(run: dict, budget: float, args) -> list[str]:
    lines = [f"`write_report` with `template=\"{{a}}+{{b}}=\", few_shot=3, operands=\"10-59\"` and a "
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
    parser.add_argument("--every-prompt", action="store_true", help="also run the stages on every prompt")
    parser.add_argument("--only-every-prompt", action="store_true", help="only the stages on every prompt")
    parser.add_argument("--write", default=None, help="append the tables to this Markdown file")
    add_shape_arguments(parser)
    args = parser.parse_args()
    from arithinterp.report import DEFAULT_BUDGET

    budget = DEFAULT_BUDGET if args.budget is None else args.budget
    torch.set_num_threads(1)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        build(folder, args)
        if args.only_every_prompt:
            args.every_prompt = True
        else:
            lines += report_lines(report_run(folder, budget), budget, args)
        if args.every_prompt:
            every = every_prompt_run(folder, budget)
            lines += ["", f"Every stage on the same model with all {every['n']} evaluated prompts counted as correct "
                      f"({every['pairs']} counterfactual pairs): {every['total']:.0f} s in all, peak RSS "
                      f"{every['peak'] / MIB:,.0f} MiB ({(every['peak'] - every['start']) / MIB:,.0f} MiB above the "
                      "start).", "", "| stage | seconds | budget (s) | sample | first finding |",
                      "|---|---|---|---|---|"]
            lines += [f"| {n} | {s:.1f} | {b:.0f} | {sample.replace('|', '/')} | {finding[:160].replace('|', '/')} |"
                      for n, s, b, sample, finding in every["rows"]]
    text = "\n".join(lines)
    print(text)
    if args.write:
        with open(args.write, "a") as handle:
            handle.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
