"""Benchmark: one distributed-alignment-search fit on a real-sized model, and DAS at every layer × position.

``das(...)`` trains a rotation through patched runs of the same base prompts, scores it and the
baselines on held-out pairs. With ``engine="auto"`` the base and source prompts run once and every
interchange resumes at the intervened layer and position, unembedding the answer positions alone
(:mod:`arithinterp.engine.interchange`); ``engine="hooks"`` runs one whole forward per interchange
(the reference). This times one fit with the baselines (full vector, probe span, PCA, random
rotation) and without (``baselines=()``), medians of ``--runs`` runs after a first fit that also
pays the engine's one-time check of the model, one CPU thread, and prints the scores of each
engine (the same but for the learned rotation's float rounding). ``--every-layer`` instead runs
:func:`arithinterp.causal.das_layers` over ``--layers`` × ``--positions`` (each cell with its
random-rotation control) and prints the IIA grid.

    python benchmarks/das_speed.py --model /path/gemma-3-270m-q4_k_m.gguf --variable carry_tens \\
        --site resid_post --layer 6 --k 4 --steps 40 --pairs 400 --runs 3
    python benchmarks/das_speed.py --model /path/gemma-3-270m-q4_k_m.gguf --variable carry_tens --every-layer \\
        --layers 0-17 --positions "b[1],final" --k 4 --steps 40 --pairs 400
    python benchmarks/das_speed.py --model zoo:add-3digit --variable carry_hundreds --layer 0 --position "b[1]" --runs 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import arithinterp as ai
from arithinterp import causal


def prompts_for(model, spec: str, few_shot: int, limit: int):
    """Correctly answered prompts: the zoo model's own task, else two-digit sums ``{a}+{b}=`` with
    ``few_shot`` worked examples before them."""
    if spec.startswith("zoo:"):
        from arithinterp.models.zoo import task_prompts

        return task_prompts(model, spec, limit=limit).correct_only(model)
    prompts = ai.tasks.arithmetic(model, a=range(10, 40), b=range(10, 40), template="{a}+{b}=", few_shot=few_shot)
    return prompts.correct_only(model)


def fit_times(model, dataset, args, position, engine: str) -> None:
    def fit(baselines):
        start = time.perf_counter()
        result = causal.das(model, dataset, args.site, args.layer, args.k, positions=position, steps=args.steps,
                            baselines=baselines, seed=args.seed, progress=False, engine=engine)
        return time.perf_counter() - start, result

    first, result = fit(causal.BASELINES)  # the first fit of the process also pays the engine's one-time check
    with_baselines, without = [], []
    for _ in range(args.runs):
        with_baselines.append(fit(causal.BASELINES)[0])
        without.append(fit(())[0])
    scores = ", ".join(f"{name} {s['iia']:.3f} ({s['logit_diff']:+.2f})" for name, s in result.scores.items())
    runs = f"{args.runs} run{'s' * (args.runs > 1)}"
    print(f"| {engine} ({result.meta['engine']}) | {first:.1f} | "
          f"{statistics.median(with_baselines):.1f} ({', '.join(f'{t:.1f}' for t in with_baselines)}) | "
          f"{statistics.median(without):.1f} ({', '.join(f'{t:.1f}' for t in without)}) | {runs} | {scores} |",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="one DAS fit on a real-sized model: seconds and scores")
    parser.add_argument("--model", default="zoo:add-3digit", help="a GGUF file, HF folder or zoo name")
    parser.add_argument("--variable", default="carry_tens")
    parser.add_argument("--site", default="resid_post")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--position", default="final", help="one position, or several joined by '+'")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--few-shot", type=int, default=3)
    parser.add_argument("--limit", type=int, default=600, help="zoo prompts drawn before keeping the correct ones")
    parser.add_argument("--runs", type=int, default=3, help="timed fits per engine and setting, after the first")
    parser.add_argument("--engines", default="auto", help="comma-separated: auto, hooks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every-layer", action="store_true", help="every layer × position instead of one fit")
    parser.add_argument("--layers", default="0-1", help="for --every-layer: 'a-b' or a comma-separated list")
    parser.add_argument("--positions", default="final", help="for --every-layer: comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)

    start = time.perf_counter()
    model = ai.load_model(args.model)
    loaded = time.perf_counter() - start
    start = time.perf_counter()
    prompts = prompts_for(model, args.model, args.few_shot, args.limit)
    dataset = causal.interchange_dataset(prompts, args.variable, n=args.pairs, seed=args.seed)
    print(f"{args.model}: loaded in {loaded:.0f} s; {len(prompts)} correct prompts of {prompts.tokens.shape[1]} "
          f"tokens ({time.perf_counter() - start:.0f} s); {args.variable}: {len(dataset.train)} train / "
          f"{len(dataset.test)} held-out pairs; k = {args.k}, {args.steps} steps; one CPU thread", flush=True)
    if args.every_layer:
        if "-" in args.layers:
            low, high = map(int, args.layers.split("-"))
            layers = list(range(low, high + 1))
        else:
            layers = [int(x) for x in args.layers.split(",")]
        positions = args.positions.split(",")
        start = time.perf_counter()
        fits = causal.das_layers(model, dataset, args.site, args.k, layers=layers, positions=positions,
                                  steps=args.steps, seed=args.seed, progress=False)
        seconds = time.perf_counter() - start
        print(f"\n{args.site}, {len(layers)} layers × {len(positions)} positions in {seconds:.0f} s "
              f"({seconds / (len(layers) * len(positions)):.1f} s per cell); chance {fits.chance:.3f}\n")
        print("| layer | " + " | ".join(f"{p}: DAS [95% CI] | random" for p in positions) + " |")
        print("|---|" + "---|---|" * len(positions))
        for i, layer in enumerate(layers):
            cells = [f"{float(fits.iia[i, j]):.3f} [{float(fits.low[i, j]):.3f}, {float(fits.high[i, j]):.3f}] | "
                     f"{float(fits.random_iia[i, j]):.3f}" for j in range(len(positions))]
            print(f"| {layer} | " + " | ".join(cells) + " |")
    else:
        position = args.position.split("+") if "+" in args.position else args.position
        print(f"\n{args.site} L{args.layer} @{args.position}: seconds per fit\n")
        print("| engine | first fit | with baselines, median (runs) | without baselines, median (runs) | runs | "
              "held-out IIA (logit diff) |")
        print("|---|---|---|---|---|---|")
        for engine in args.engines.split(","):
            fit_times(model, dataset, args, position, engine)
    print(f"\nLoad average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
