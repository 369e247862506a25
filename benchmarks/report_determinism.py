"""Same command, same page: the report's findings do not depend on how busy the machine is, and its
time grows no faster than the CPU share it gets.

Three checks, each run in fresh processes (``arithinterp report ... --out PAGE``), timed on the wall
clock, the child's peak resident set size read from the kernel (``wait4``):

- ``gemma``: ``arithinterp report pkg:gemma-3-270m --template "{a}+{b}=" --few-shot 3 --operands 10-39``
  (the README's real-model command) run quiet, then beside ``--busy`` CPU-bound busy loops (two on
  the 2-core development machine: the report then gets about two thirds of a core);
- ``zoo``: ``arithinterp report`` (``zoo:add-100``, every default) the same way;
- ``replay``: the zoo report made with another seed (``--seed 1``), then ``arithinterp report --plan
  PAGE`` replaying its recorded plan, quiet and loaded; before that, the seed-1 page's plan given
  with ``--seed 2`` must be refused.

The pages of each check are compared line by line on their findings: every section's sample line,
findings and figure data, each embedded viewer's document, and the page's description of its task
(the page's timing fields, the estimate and the stage list's timings left out). A stage "applies"
unless its section says it does not run on this model; every stage that applies must have run
(``done``: not skipped over budget, not short of data, not failed). The acceptance limits are
checked too: for every check the loaded run within 2.5× the quiet one; for ``gemma`` the quiet run
within 5 minutes and 6 GB.

The script prints each run's stage list, the differences, and one Markdown table to paste into
docs/benchmarks.md; it exits 1 when any page differs from its pair, a stage that applies did not
run, a run failed or a limit was passed. Run it on a machine with nothing else running (the busy
loops are the only load it means to measure against).

``--calibrate`` runs each stage of one report in this process on one thread and prints what its
plan said it would cost at the reference rate beside the CPU seconds it took (process time, so
that other work on the machine does not count): the constants of ``arithinterp/report/work.py``
come from these runs.

    python benchmarks/report_determinism.py                       # gemma, zoo and replay (about 40 min)
    python benchmarks/report_determinism.py --checks zoo replay   # without Gemma 3 (about 10 min)
    python benchmarks/report_determinism.py --checks zoo replay --args='--stages accuracy,patching --limit 300'
    python benchmarks/report_determinism.py --calibrate [--zoo]
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import html
import multiprocessing
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
GEMMA = ["pkg:gemma-3-270m", "--template", "{a}+{b}=", "--few-shot", "3", "--operands", "10-39"]
ZOO: list[str] = []  # `arithinterp report`: zoo:add-100 with every default
CHECKS = ("gemma", "zoo", "replay")
MAX_RATIO = 2.5  # the loaded run's wall time against the quiet one's, at most
GEMMA_SECONDS, GEMMA_BYTES = 300.0, 6 * 10**9  # the quiet Gemma 3 run: within 5 minutes and 6 GB
# what a page says of its run rather than what it finds
TIMING_FIELDS = ("seconds:", "estimate:", "plan:")


def _spin() -> None:
    while True:
        pass


def run_report(command: list[str], out: Path, busy: int = 0) -> dict:
    """``arithinterp report COMMAND --out OUT`` in a fresh process, beside ``busy`` spinning processes
    (started before it and stopped after it, whatever happens)."""
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
        errors = process.stderr.read() if process.stderr else ""  # read to the end first: a full pipe would block it
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
    finally:
        for loop in loops:
            loop.terminate()
            loop.join()
    return dict(seconds=seconds, peak=usage.ru_maxrss * 1024, status=os.waitstatus_to_exitcode(status),
                errors=errors[-3000:], page=out.read_text() if out.exists() else "")


def findings(page: str) -> list[str]:
    """What a page finds, as lines: the page's description of its task, then per section its title,
    sample line, findings, figures' data and embedded viewers' documents (timings left out)."""
    lines = []
    meta = re.search(r"<p class='meta'>(.*?)</p>", page, re.S)
    if meta:
        lines += [field for field in html.unescape(meta.group(1)).split(" · ") if not field.startswith(TIMING_FIELDS)]
    for title, body in re.findall(r"<section><h2>(.*?)</h2>(.*?)</section>", page, re.S):
        lines.append(f"== {html.unescape(title)}")
        lines += [f"sample: {html.unescape(s)}" for s in re.findall(r"<p class='sample'>sample: (.*?)</p>", body)]
        lines += [html.unescape(item) for item in re.findall(r"<li>(.*?)</li>", body, re.S)]
        # a figure's data: the arrays plotly draws (its layout holds no measured number the findings do not)
        lines += [f"figure data: {data}" for data in re.findall(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{",
                                                                  body, re.S)]
        # a viewer's document holds its graph's every node and edge: compared whole, shown by its digest
        lines += [f"viewer {html.unescape(name)}: sha256 {hashlib.sha256(doc.encode()).hexdigest()[:16]}"
                  for name, doc in re.findall(r"<iframe class='graph-view' title=\"(.*?)\".*?srcdoc=\"(.*?)\"", body,
                                              re.S)]
    return lines


def differences(a: str, b: str) -> list[str]:
    """The lines of two pages' findings that differ (``-`` the first page's, ``+`` the second's)."""
    return [line for line in difflib.unified_diff(findings(a), findings(b), lineterm="", n=0)
            if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]


def stage_states(page: str) -> list[tuple[str, str]]:
    """``(stage, state)`` from the page's stage list."""
    block = page.split("<h2>Stages</h2><ul class='status'>")[1].split("</ul>")[0] if "<h2>Stages</h2>" in page else ""
    return [(html.unescape(a), html.unescape(b)) for a, b in re.findall(r"<li><b>(.*?)</b>: (.*?)</li>", block)]


def unrun(page: str) -> list[str]:
    """The stages that apply to the model (all but those "not run" on it) and did not run to the
    end: skipped over budget, short of data, failed, interrupted or never started."""
    return [f"{stage} ({state.split(';')[0][:120]})" for stage, state in stage_states(page)
            if stage != "Evaluating the task" and not state.startswith(("done", "not run"))]


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f}"


def check_pair(name: str, command: list[str], busy: int, folder: Path, limits: bool) -> dict:
    """``command`` quiet, then loaded: their times, peaks, differences and unrun stages."""
    runs = {}
    for kind, loops in (("quiet", 0), ("loaded", busy)):
        run = runs[kind] = run_report(command, folder / f"{name}-{kind}.html", busy=loops)
        print(f"\n{name}, {kind} ({loops} busy loops): {run['seconds']:.0f} s, peak RSS {_gib(run['peak'])} GiB, "
              f"exit {run['status']}")
        print("\n".join(f"  {stage}: {state[:160]}" for stage, state in stage_states(run["page"])))
        if run["status"]:
            print(run["errors"])
    return summarise(name, runs["quiet"], runs["loaded"], limits)


def summarise(name: str, quiet: dict, loaded: dict, limits: bool, reference: str = "") -> dict:
    """One row of the table: the pair's times, ratio, peaks, differences, unrun stages and the limits
    passed. ``reference``: a page both must also agree with (the original of a replayed plan)."""
    diff = differences(quiet["page"], loaded["page"])
    if reference:
        diff += [f"quiet vs original: {line}" for line in differences(reference, quiet["page"])]
        diff += [f"loaded vs original: {line}" for line in differences(reference, loaded["page"])]
    missing = sorted(set(unrun(quiet["page"])) | set(unrun(loaded["page"])))
    ratio = loaded["seconds"] / quiet["seconds"]
    problems = [f"{len(diff)} lines of findings differ"] if diff else []
    problems += [] if findings(quiet["page"]) else ["no findings to compare (no page written)"]
    problems += [f"exit {run['status']} ({kind})" for kind, run in (("quiet", quiet), ("loaded", loaded))
                 if run["status"]]
    problems += [f"not run: {', '.join(missing)}"] if missing else []
    if ratio > MAX_RATIO:
        problems.append(f"loaded / quiet {ratio:.2f}× > {MAX_RATIO}×")
    if limits and quiet["seconds"] > GEMMA_SECONDS:
        problems.append(f"quiet {quiet['seconds']:.0f} s > {GEMMA_SECONDS:.0f} s")
    if limits and quiet["peak"] > GEMMA_BYTES:
        problems.append(f"quiet peak {quiet['peak'] / 1e9:.1f} GB > {GEMMA_BYTES / 1e9:.0f} GB")
    print(f"\n{name}: loaded / quiet {ratio:.2f}×; findings "
          + ("identical" if not diff else f"differ in {len(diff)} lines:"))
    print("\n".join(line[:300] for line in diff[:60]))
    return dict(name=name, quiet=quiet["seconds"], loaded=loaded["seconds"], ratio=ratio, peak_quiet=quiet["peak"],
                peak_loaded=loaded["peak"], lines=len(findings(quiet["page"])), diff=len(diff),
                stages=sum(1 for stage, state in stage_states(quiet["page"])
                           if stage != "Evaluating the task" and state.startswith("done")),
                missing=missing, problems=problems)


def check_replay(command: list[str], busy: int, folder: Path) -> dict:
    """Another seed's page of ``command``, then its plan replayed quiet and loaded; the plan given
    with another seed's option must be refused before any work."""
    original = run_report([*command, "--seed", "1"], folder / "seed1.html")
    page = folder / "seed1.html"
    print(f"\nreplay: the seed-1 page took {original['seconds']:.0f} s, exit {original['status']}")
    refused = run_report(["--plan", str(page), "--seed", "2"], folder / "refused.html")
    said = "differs from the plan's seed=1" in refused["errors"]
    print(f"replay: --plan with --seed 2 {'refused' if refused['status'] == 2 and said else 'NOT refused'}: "
          f"{refused['errors'].strip()[-240:]}")
    runs = {}
    for kind, loops in (("quiet", 0), ("loaded", busy)):
        run = runs[kind] = run_report(["--plan", str(page)], folder / f"replay-{kind}.html", busy=loops)
        print(f"replay, {kind} ({loops} busy loops): {run['seconds']:.0f} s, peak RSS {_gib(run['peak'])} GiB, "
              f"exit {run['status']}")
        if run["status"]:
            print(run["errors"])
    row = summarise("replay", runs["quiet"], runs["loaded"], False, reference=original["page"])
    if original["status"]:
        row["problems"].append(f"the seed-1 page: exit {original['status']}")
    if not (refused["status"] == 2 and said):
        row["problems"].append("--plan with another seed was not refused")
    return row


def table(rows: list[dict], busy: int) -> str:
    """The rows as the Markdown table of docs/benchmarks.md."""
    lines = [f"| report | quiet (s) | beside {busy} busy loops (s) | loaded / quiet | peak RSS quiet / loaded (GiB) "
             "| findings compared | stages run | result |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    for row in rows:
        findings_said = (f"{row['lines']} lines, identical" if not row["diff"]
                         else f"{row['diff']} of {row['lines']} lines differ")
        lines.append(f"| {row['name']} | {row['quiet']:.0f} | {row['loaded']:.0f} | {row['ratio']:.2f}× | "
                     f"{_gib(row['peak_quiet'])} / {_gib(row['peak_loaded'])} | {findings_said} | {row['stages']} | "
                     + ("pass" if not row["problems"] else "FAIL: " + "; ".join(row["problems"])) + " |")
    return "\n".join(lines)


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
    spec = args.model or "zoo:add-100"
    model = load_model(spec)
    task = report_prompts(model, spec, args.limit, args.seed, args.template, args.few_shot, args.operands)
    per_prompt = evaluation_seconds(model, task, 256)
    n = min(len(task), int(DEFAULT_BUDGET / 15.25 / per_prompt))
    clock = time.process_time()
    prompts, evaluation, _ = evaluate_planned(model, task, n, n, 0, 256, args.seed)
    print(f"evaluation: {n} prompts, planned {n * per_prompt:.1f} s, cpu {time.process_time() - clock:.1f} s")
    correct = prompts[evaluation.correct]
    pairs = correct.counterfactual(vary="a", seed=args.seed, distinct_first_token=True)
    ctx = Context(model, spec, correct, prompts, evaluation, pairs, args.seed, task_prompts=task)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS),
                        help="which checks to run (default: all three)")
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the loaded runs (default 2)")
    parser.add_argument("--keep", default=None, metavar="DIR", help="write the pages here and keep them")
    parser.add_argument("--args", default="", metavar="ARGS",
                        help="more options for every report that is not a replay, e.g. a quick check of the script "
                        "itself: --args='--stages accuracy,patching,circuits --limit 300' (the acceptance: none)")
    parser.add_argument("--calibrate", action="store_true", help="planned against measured CPU seconds per stage")
    parser.add_argument("--zoo", action="store_true", help="with --calibrate: zoo:add-100's report, not Gemma 3's")
    args = parser.parse_args()
    if args.calibrate:
        calibrate(ZOO if args.zoo else GEMMA)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        extra, rows = shlex.split(args.args), []
        for check in args.checks:
            if check == "replay":
                rows.append(check_replay([*ZOO, *extra], args.busy, folder))
            else:
                rows.append(check_pair(check, [*(GEMMA if check == "gemma" else ZOO), *extra], args.busy, folder,
                                       limits=check == "gemma" and not extra))
    print(f"\nOn {os.cpu_count()} CPUs; {args.busy} busy loops beside the loaded runs"
          + (f"; every report with {args.args}" if args.args else "") + ".\n")
    print(table(rows, args.busy))
    return 1 if any(row["problems"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
