"""What a logit difference reads: the answers' columns of the unembedding and the final position.

On Gemma 3 270M (vocabulary 262,144, 671 MB of unembedding weights) a patched run that unembeds
its final position reads the whole matrix however few rows it has, and the neuron ranking's
forward and backward ran every position of the few-shot prompts. This script times, alternating
in one process (medians of ``--runs``):

* ``patching``: ``activation_patching(site)`` at every layer and the positions from the first one
  where the pairs differ, with ``metric="logit_diff"`` (the answers' columns alone) against the same
  logit difference as a metric callable, which reads the whole vocabulary's logits (the previous
  behaviour, and what a user's callable still gets);
* ``ranking``: ``neurons.importance(method="attribution")`` at every layer, stepped (the final position
  alone with gradients, the shared few-shot prefix computed once: ``engine.steppers.final_gradients``)
  against whole forwards and backwards (``engine.run(..., metric=...)``, the reference it equals).

    python benchmarks/read_columns.py [--model pkg:gemma-3-270m] [--pairs 16] [--ranked 100] [--runs 3]
                                      [--few-shot 3] [--sites mlp_out resid_pre]

Prompts: ``a + b`` over 10..39 × 10..39 in ``{a}+{b}=`` with a 3-shot prefix, counterfactual pairs
varying ``a`` whose answers start with different tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from typing import Callable

import torch


def _logit_diff(logits, pairs):  # the whole vocabulary's logits, read as a user's metric reads them
    rows = torch.arange(len(pairs))
    return logits[rows, pairs.clean_answer_token] - logits[rows, pairs.corrupt_answer_token]


@contextmanager
def _whole_forwards():
    """The ranking without its stepped path: whole forwards and backwards."""
    from arithinterp.neurons import neuron_importance

    stepped = neuron_importance.final_gradients
    neuron_importance.final_gradients = lambda *args: None
    try:
        yield
    finally:
        neuron_importance.final_gradients = stepped


def _alternate(runs: int, fast: Callable[[], object], reference: Callable[[], object]) -> tuple[list, list]:
    times: tuple[list, list] = ([], [])
    for _ in range(runs):
        for column, call in zip(times, (fast, reference)):
            start = time.perf_counter()
            call()
            column.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="pkg:gemma-3-270m")
    parser.add_argument("--pairs", type=int, default=16, help="pairs patched")
    parser.add_argument("--ranked", type=int, default=100, help="pairs the neurons are ranked on")
    parser.add_argument("--sites", nargs="+", default=["mlp_out", "resid_pre"])
    parser.add_argument("--few-shot", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import arithinterp as ai
    from arithinterp import neurons, patching
    from arithinterp.tasks import arithmetic

    model = ai.load_model(args.model)
    prompts = arithmetic(model, a=range(10, 40), b=range(10, 40), template="{a}+{b}=",
                         few_shot=args.few_shot)
    pairs = prompts.counterfactual(vary="a", seed=0, distinct_first_token=True)
    clean = pairs.clean
    first = int((clean.tokens != pairs.corrupt.tokens).any(0).int().argmax())
    positions = list(range(first, int(clean.tokens.shape[1])))
    print(f"{args.model}: vocabulary {model.cfg.d_vocab:,}, {model.cfg.n_layers} layers, prompts of "
          f"{clean.tokens.shape[1]} tokens; {torch.get_num_threads()} CPU threads; medians of {args.runs} "
          "alternating runs in one process")
    print("| analysis | what it reads | reference | median (runs) | reference median (runs) | ratio |")
    print("|---|---|---|---|---|---|")

    def row(name: str, what: str, reference: str, times: tuple[list, list]) -> None:
        fast, slow = (statistics.median(t) for t in times)
        runs = [", ".join(f"{v:.2f}" for v in t) for t in times]
        print(f"| {name} | {what} | {reference} | {fast:.2f} s ({runs[0]}) | {slow:.2f} s ({runs[1]}) | "
              f"{slow / fast:.1f}x |", flush=True)

    patched = pairs[: args.pairs]
    patching.activation_patching(model, patched[:2], "resid_pre", positions=positions, progress=False)  # warm-up
    for site in args.sites:
        def sweep(metric, site=site):
            return patching.activation_patching(model, patched, site, metric=metric, positions=positions,
                                                progress=False)

        times = _alternate(args.runs, lambda: sweep("logit_diff"), lambda: sweep(_logit_diff))
        row(f"`{site}` sweep, {len(patched)} pairs × {model.cfg.n_layers} layers × {len(positions)} positions",
            "the answers' columns", "a callable reading every column", times)

    ranked = pairs[: args.ranked]

    def rank():
        return neurons.importance(model, ranked, top_k=None, progress=False)

    def rank_whole():
        with _whole_forwards():
            return rank()

    torch.testing.assert_close(rank().scores, rank_whole().scores, atol=1e-4, rtol=1e-3)  # the same ranking
    row(f"neuron ranking (attribution), {len(ranked)} pairs × {model.cfg.n_layers} layers",
        "the final position, the prefix once", "whole forwards and backwards", _alternate(args.runs, rank, rank_whole))


if __name__ == "__main__":
    main()
