"""The report under load: the same command run quiet, then beside CPU-bound busy loops, gives the
same findings (every number in every section, timings aside), and its time grows no faster than
the CPU share it gets.

Each run is ``arithinterp report ...`` in a fresh process, timed on the wall clock, its peak
resident set size read from the kernel (``wait4``). The loaded run starts ``--busy`` processes
that spin on the CPU for the whole run (two on the 2-core development machine: the report's
process then gets about two thirds of a core). The pages' findings, sample lines and figure data
are compared line by line; the stage list's timings and the page's timing fields are left out.
A third run replays the quiet page's plan (``--plan PAGE``) on another seed's command, which
must refuse it, and on the same one, which must give the same findings.

``--calibrate`` runs each stage of one report in this process on one thread and prints what its
plan said it would cost at the reference rate beside the CPU seconds it took (process time, so
that other work on the machine does not count): the constants of ``arithinterp/report/work.py``
come from these runs.

    python benchmarks/report_load.py                      # Gemma 3 270M's report, quiet and loaded
    python benchmarks/report_load.py --zoo                # zoo:add-100's default report
    python benchmarks/report_load.py --calibrate [--zoo]
"""

from __future__ import annotations

import argparse
import html
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
GEMMA = ["pkg:gemma-3-270m", "--template", "{a}+{b}=", "--few-shot", "3", "--operands", "10-39"]
ZOO = ["zoo:add-100"]


def _spin() -> None:
    while True:
        pass


def run_report(command: list[str], out: Path, busy: int = 0) -> dict:
    """``arithinterp report COMMAND --out OUT`` in a fresh process, beside ``busy`` spinning processes."""
    loops = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for loop in loops:
        loop.start()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("OMP_NUM_THREADS", None)  # the report chooses its threads
    try:
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "arithinterp.cli", "report", *command, "--out", str(out),
                                    "--overwrite", "--no-progress"], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        errors = process.stderr.read() if process.stderr else ""
    finally:
        for loop in loops:
            loop.terminate()
    return dict(seconds=seconds, peak=usage.ru_maxrss * 1024, status=os.waitstatus_to_exitcode(status),
                errors=errors[-2000:], page=out.read_text() if out.exists() else "")


def findings(page: str) -> list[str]:
    """What a page finds, as lines: each section's title, sample line, findings and figures' data,
    and the page's description of its task (the timing fields and the stage list's timings left out)."""
    lines = []
    meta = re.search(r"<p class='meta'>(.*?)</p>", page, re.S)
    if meta:
        lines += [field for field in html.unescape(meta.group(1)).split(" · ")
                  if not field.startswith(("seconds:", "estimate:", "plan:"))]
    for title, body in re.findall(r"<section><h2>(.*?)</h2>(.*?)</section>", page, re.S):
        lines.append(f"== {html.unescape(title)}")
        lines += [f"sample: {html.unescape(s)}" for s in re.findall(r"<p class='sample'>sample: (.*?)</p>", body)]
        lines += [html.unescape(item) for item in re.findall(r"<li>(.*?)</li>", body, re.S)]
        # a figure's data: the arrays plotly draws (its layout holds no measured number the findings do not)
        lines += [f"figure data: {data}" for data in re.findall(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{",
                                                                  body, re.S)]
    return lines


def differences(a: str, b: str) -> list[str]:
    """The lines of two pages' findings that differ."""
    import difflib

    return [line for line in difflib.unified_diff(findings(a), findings(b), lineterm="", n=0)
            if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]


def stage_times(page: str) -> list[str]:
    block = page.split("<h2>Stages</h2><ul class='status'>")[1].split("</ul>")[0] if "<h2>Stages</h2>" in page else ""
    return [f"  {html.unescape(a)}: {html.unescape(b).split(';')[0]}"
            for a, b in re.findall(r"<li><b>(.*?)</b>: (.*?)</li>", block)]


def compare(command: list[str], busy: int, folder: Path) -> dict:
    """The command quiet and loaded; their times, peaks and findings' differences."""
    quiet = run_report(command, folder / "quiet.html")
    loaded = run_report(command, folder / "loaded.html", busy=busy)
    for name, run in (("quiet", quiet), ("loaded", loaded)):
        print(f"{name}: {run['seconds']:.0f} s, peak RSS {run['peak'] / 2**30:.2f} GiB, exit {run['status']}")
        print("\n".join(stage_times(run["page"])))
        if run["status"]:
            print(run["errors"])
    diff = differences(quiet["page"], loaded["page"])
    print(f"loaded / quiet: {loaded['seconds'] / quiet['seconds']:.2f}×; findings: "
          + ("identical" if not diff else f"{len(diff)} lines differ"))
    print("\n".join(diff[:40]))
    return dict(quiet=quiet, loaded=loaded, diff=diff)


def replay(command: list[str], page: Path, folder: Path) -> None:
    """The page's plan replayed: on another seed it is refused; replayed, the same findings."""
    other = run_report([*command, "--seed", "1", "--plan", str(page)], folder / "other-seed.html")
    refused = other["status"] == 2 and "differs from the plan's seed" in other["errors"]
    print(f"--plan with another seed: {'refused' if refused else 'NOT refused'} ({other['errors'].strip()[-200:]})")
    again = run_report(["--plan", str(page)], folder / "replayed.html")
    diff = differences(page.read_text(), again["page"])
    print(f"--plan replayed: {again['seconds']:.0f} s, exit {again['status']}; findings: "
          + ("identical" if not diff else f"{len(diff)} lines differ"))
    print("\n".join(diff[:20]))


def calibrate(command: list[str]) -> None:
    """Each stage of the command's report on one thread: planned reference seconds beside CPU seconds."""
    import torch

    from arithinterp.cli import build_parser
    from arithinterp.models import load_model
    from arithinterp.report import DEFAULT_BUDGET, STAGES, Context
    from arithinterp.report.budget import StagePlan, plan_stages
    from arithinterp.report.evaluation import evaluate_planned, evaluation_seconds, report_prompts

    torch.set_num_threads(1)
    args = build_parser().parse_args(["report", *command])
    model = load_model(args.model)
    task = report_prompts(model, args.model, args.limit, args.seed, args.template, args.few_shot, args.operands)
    per_prompt = evaluation_seconds(model, task, 256)
    n = min(len(task), int(DEFAULT_BUDGET / 15.25 / per_prompt))
    clock = time.process_time()
    prompts, evaluation, _ = evaluate_planned(model, task, n, n, 0, 256, args.seed)
    print(f"evaluation: {n} prompts, planned {n * per_prompt:.1f} s, cpu {time.process_time() - clock:.1f} s")
    correct = prompts[evaluation.correct]
    pairs = correct.counterfactual(vary="a", seed=args.seed, distinct_first_token=True)
    ctx = Context(model, args.model, correct, prompts, evaluation, pairs, args.seed, task_prompts=task)
    ctx.control_model()  # built once, outside every stage's time
    plans = plan_stages(ctx, list(STAGES.values()), DEFAULT_BUDGET - n * per_prompt, DEFAULT_BUDGET, 2 * 2**30)
    for name, plan in plans.items():
        if not isinstance(plan, StagePlan):
            print(f"{name}: {type(plan).__name__}: {str(plan)[:200]}")
            continue
        ctx.planned, ctx.budget = plan, plan.budget
        clock, wall = time.process_time(), time.perf_counter()
        try:
            section = STAGES[name].run(ctx)
            said = section.sample[:160]
        except Exception as error:  # noqa: BLE001  (a calibration run reports every stage)
            said = f"{type(error).__name__}: {error}"[:160]
        cpu = time.process_time() - clock
        print(f"{name}: planned {plan.seconds:.1f} s, cpu {cpu:.1f} s (×{cpu / max(plan.seconds, 1e-9):.2f}), "
              f"wall {time.perf_counter() - wall:.1f} s; {plan.choices}; {said}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--zoo", action="store_true", help="zoo:add-100's default report instead of Gemma 3 270M's")
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the loaded run (default 2)")
    parser.add_argument("--calibrate", action="store_true", help="planned against measured CPU seconds per stage")
    parser.add_argument("--no-replay", action="store_true", help="skip the --plan replay runs")
    args = parser.parse_args()
    command = ZOO if args.zoo else GEMMA
    if args.calibrate:
        calibrate(command)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        compare(command, args.busy, folder)
        if not args.no_replay:
            replay(command, folder / "quiet.html", folder)


if __name__ == "__main__":
    main()
