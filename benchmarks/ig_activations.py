"""Edge scores: EAP-IG over the input against EAP-IG over the senders' activations, on the zoo.

The same setting as ``benchmarks/circuits.py`` (correctly answered prompts ``{a}+{b}=``, pairs
varying ``a``, ``logit_diff``, the position-free graph): every edge scored exactly (each patched
alone), by EAP, by EAP-IG interpolating the embeddings (``"eap-ig"``) and by EAP-IG
interpolating each sender group's outputs (``"eap-ig-activations"``), with ``--steps``
interpolations. Reported: Pearson and Spearman correlation of the mean edge scores with the exact
ones, wall time (median of ``--runs``, one thread) and passes per batch. Markdown to stdout.

    python benchmarks/ig_activations.py [--pairs 100] [--steps 5] [--runs 3] [--models add-100 add-3digit]
"""

from __future__ import annotations

import argparse
from typing import cast

import torch
from circuits import pearson, ranks, zoo_pairs  # benchmarks/circuits.py: the same pairs and correlations
from patching import median_time  # benchmarks/patching.py: the same median timing

METHODS = ("eap", "eap-ig", "eap-ig-activations")


def bench(name: str, n_pairs: int, steps: int, runs: int) -> None:
    from arithinterp.circuits import attribute_edges, patch_edges

    model, pairs = zoo_pairs(name, n_pairs)
    exact = patch_edges(model, pairs, progress=False)["scores"].mean(0)
    print(f"\n**`zoo:{name}`** — {len(pairs)} pairs, {len(exact)} edges\n")
    print("| method | Pearson vs exact | Spearman vs exact | time (s) | passes per batch |")
    print("|---|---:|---:|---:|---:|")
    for method in METHODS:
        seconds, result = median_time(
            lambda method=method: attribute_edges(model, pairs, method=method, ig_steps=steps, batch_size=len(pairs),
                                                  progress=False), runs)
        got = cast(dict, result)  # what attribute_edges returns
        scores = got["scores"].mean(0)
        label = method if method == "eap" else f"{method} ({steps} steps)"
        print(f"| {label} | {pearson(exact, scores):.3f} | {pearson(ranks(exact), ranks(scores)):.3f} "
              f"| {seconds:.2f} | {got['passes_per_batch']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["add-100", "add-3digit"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"One CPU thread, torch {torch.__version__}, median of {args.runs} runs.")
    for name in args.models:
        bench(name, args.pairs, args.steps, args.runs)


if __name__ == "__main__":
    main()
