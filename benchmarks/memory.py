"""Peak memory and time of the analyses over many units on a real-sized Llama-family model.

A random-weight Llama of SmolLM-135M's shape (30 layers, d_model 576, 9 heads / 3 key-value
heads, d_mlp 1536, vocabulary 49,152; built by ``benchmarks/evaluate.py``'s ``build``, no
download), digit-split tokenizer, two-digit addition with a few-shot prefix:

* ``classify-all``: ``neurons.classify(model, prompts, top_k=None)`` — every neuron of every layer
  (46,080), on the grid ``a, b in 10..10+side`` (``--side``, ``side²`` prompts);
* ``classify-top``: ``neurons.classify(model, prompts, top_k=50)`` — every layer's attribution-ranked
  top-k (``--top-k``), importance included (on the grid of side ``--top-side``);
* ``eap-ig``: ``circuits.score_edges(model, pairs, "eap-ig")`` over every edge (16 pairs);
* ``faithfulness``: ``circuits.faithfulness_curve`` of that circuit over 10 sizes (exact edge runs).

Each measurement runs in a fresh process and reports its peak resident set size increase over
the loaded model (sampled every 0.2 ms, ``benchmarks/collect.py``'s ``PeakRSS``) and its time.
"Before" runs the package as it was at ``--before`` (a git revision, exported to a temporary
folder) with its defaults; a process that passes ``--kill-at`` GB of RSS is stopped and reported
as such, so "before" cannot take the machine down.

    python benchmarks/memory.py [--side 50] [--top-k 50] [--pairs 16] [--before REV [--before-side 10]] [--kill-at 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from collect import PeakRSS, rss_bytes  # noqa: E402  (the same RSS sampler as the collect benchmark)
from evaluate import add_shape_arguments, build, prompts_for  # noqa: E402  (the 135M-shape Llama and its few-shot prompts)

MEASUREMENTS = ("classify-all", "classify-top", "eap-ig", "faithfulness")


def _watchdog(limit_bytes: float) -> None:
    """Stop this process (exit code 3) when its RSS passes ``limit_bytes``, saying so on stdout."""
    import threading

    def watch():
        while True:
            rss = rss_bytes()
            if rss > limit_bytes:
                print(json.dumps(dict(killed=True, rss=rss)), flush=True)
                os._exit(3)
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()


def _eap_pairs(model, n_pairs: int, shots: int):
    prompts = prompts_for(model, 4 * n_pairs, shots)
    return prompts.counterfactual(vary="a", seed=0)[:n_pairs]


def measure(what: str, folder: str, args) -> dict:
    """One measurement in this fresh process."""
    import arithinterp as ai
    from arithinterp import circuits, neurons
    from arithinterp.tasks import arithmetic

    if args.kill_at:
        _watchdog(args.kill_at * 1e9)
    torch.set_num_threads(args.threads)
    model = ai.load_model(folder)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if what.startswith("classify"):
        side = range(10, 10 + args.side)
        prompts = arithmetic(model, "+", side, side, "{a}+{b}=", few_shot=args.shots)
        neurons.classify(model, prompts[:16], layers=[0], top_k=None, shuffle_control=False)  # warm-up
        top_k = None if what == "classify-all" else args.top_k
        run = lambda: neurons.classify(model, prompts, top_k=top_k)  # noqa: E731
        n = len(prompts)
    else:
        pairs = _eap_pairs(model, args.pairs, args.shots)
        circuits.score_edges(model, pairs[:1], "eap", progress=False)  # warm-up: lazy imports, first kernels
        n = len(pairs)
        if what == "eap-ig":
            run = lambda: circuits.score_edges(model, pairs, "eap-ig", progress=False)  # noqa: E731
        else:  # the curve of an EAP circuit (scored 2 pairs at a time in both versions: not what is measured)
            circuit = circuits.score_edges(model, pairs, "eap", batch_size=2, progress=False)
            sizes = [int(round(circuit.n_edges ** (i / 9))) for i in range(10)]
            run = lambda: circuits.faithfulness_curve(model, pairs, circuit, sizes)  # noqa: E731
    with PeakRSS() as memory:
        start = time.perf_counter()
        result: Any = run()
        seconds = time.perf_counter() - start
    out: dict[str, Any] = dict(seconds=seconds, increase=memory.increase, model=model_bytes, n=n,
                               load=os.getloadavg()[0])
    if what.startswith("classify"):
        out.update(neurons=int(result.scores.shape[0]), heuristics=len(result.names),
                   labelled=int(result.labels.any(1).sum()), max_memory=result.meta.get("max_memory"))
    elif what == "eap-ig":
        out.update(edges=result.n_edges, batches=result.meta.get("batches"))
    else:
        out.update(sizes=result.sizes.tolist())
    return out


def _export(revision: str, into: Path) -> Path:
    """The package as it was at ``revision`` (``git archive``), importable from ``into``."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(root), "archive", revision, "arithinterp"], capture_output=True,
                             check=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--side", type=int, default=50, help="grid side of the classify prompts (side² prompts)")
    parser.add_argument("--top-k", type=int, default=50, help="neurons per layer of classify-top")
    parser.add_argument("--top-side", type=int, default=20, help="grid side of classify-top's 'after' (its importance "
                        "runs a backward per counterfactual pair)")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--shots", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", choices=MEASUREMENTS, default=list(MEASUREMENTS))
    parser.add_argument("--before", help="git revision whose package gives the 'before' numbers")
    parser.add_argument("--after", help="git revision whose package gives the 'after' numbers (default: this tree)")
    parser.add_argument("--before-side", type=int, help="grid side for 'before' (default --side)")
    parser.add_argument("--before-only", nargs="*", choices=MEASUREMENTS,
                        help="measurements run 'before' (default all)")
    parser.add_argument("--extra-side", type=int, nargs="*", default=[],
                        help="more grid sides measured 'after' for the classify measurements")
    parser.add_argument("--kill-at", type=float, default=8.0, help="stop a measurement past this RSS (GB)")
    add_shape_arguments(parser)
    parser.add_argument("--child", choices=MEASUREMENTS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--in-process", action="store_true",
                        help="take every measurement in this process instead of a fresh one each (a quick check "
                             "that the script runs: the peaks then count what earlier measurements left)")
    args = parser.parse_args()
    if args.child:
        from arithinterp.errors import ArithInterpError

        try:
            print(json.dumps(measure(args.child, args.folder, args)))
        except ArithInterpError as error:  # a refusal is a result too (e.g. a metric that never moves)
            print(json.dumps(dict(error=str(error))))
        return

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        build(folder, args)
        before = _export(args.before, Path(tmp) / "before") if args.before else None
        if args.after:
            root = _export(args.after, Path(tmp) / "after")

        def one(what: str, package: Path, side: int) -> dict:
            if args.in_process:  # this tree's package, and no watchdog: it would stop this very process
                if package != root or before is not None:
                    raise SystemExit("--in-process measures this tree only (no --before / --after)")
                return measure(what, str(folder), argparse.Namespace(**dict(vars(args), side=side, kill_at=0)))
            command = [sys.executable, __file__, "--child", what, "--folder", str(folder), "--side", str(side),
                       "--top-k", str(args.top_k), "--pairs", str(args.pairs), "--shots", str(args.shots),
                       "--threads", str(args.threads), "--kill-at", str(args.kill_at)]
            env = dict(os.environ, PYTHONPATH=str(package))
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            lines = done.stdout.strip().splitlines()
            if not lines:
                raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
            return json.loads(lines[-1])

        rows = []
        for what in args.only:
            runs = [("after", root, args.top_side if what == "classify-top" else args.side)]
            if before is not None and (args.before_only is None or what in args.before_only):
                runs.insert(0, ("before", before, args.before_side or args.side))
                if what.startswith("classify") and args.before_side and args.before_side != runs[-1][2]:
                    runs.insert(1, ("after", root, args.before_side))
            if what == "classify-all":
                runs += [("after", root, side) for side in args.extra_side]
            for label, package, side in runs:
                got = one(what, package, side)
                rows.append((what, label, side, got))
                print(json.dumps(dict(what=what, version=label, side=side, **got)), file=sys.stderr, flush=True)

    gib = 2**30
    print(f"random Llama, {args.layers} layers, d_model {args.d_model}, {args.heads} heads ({args.kv_heads} KV), "
          f"d_mlp {args.d_mlp}, vocabulary {args.vocab}, digit-split, {args.shots}-shot prefix; "
          f"{args.threads} thread(s); one fresh process per row\n")
    print("| analysis | version | prompts / pairs | time (s) | peak RSS increase (GiB) | model (GiB) | notes |")
    print("|---|---|---|---|---|---|---|")
    for what, label, side, got in rows:
        if got.get("error"):
            print(f"| {what} | {label} | – | – | – | – | refused: {got['error'][:80]} |")
            continue
        if got.get("killed"):
            print(f"| {what} | {label} | {side * side if what.startswith('classify') else args.pairs} | – | "
                  f"> {args.kill_at:.0f} GB (stopped) | – | |")
            continue
        if what.startswith("classify"):
            notes = (f"{got['neurons']} neurons x {got['heuristics']} heuristics, {got['labelled']} labelled"
                     + (f"; budget {got['max_memory'] / gib:.2f} GiB" if got.get("max_memory") else ""))
        elif what == "eap-ig":
            notes = f"{got['edges']} edges, {got['batches']} batch(es)"
        else:
            notes = f"sizes {got['sizes'][0]}..{got['sizes'][-1]}"
        print(f"| {what} | {label} | {got['n']} | {got['seconds']:.1f} | {got['increase'] / gib:.2f} | "
              f"{got['model'] / gib:.2f} | {notes} |")


if __name__ == "__main__":
    main()
